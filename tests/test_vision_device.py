"""Vision learners on a device: moves before and after growth, mixed precision, cooperative stop.

The CPU tests run everywhere.  Tests marked ``cuda`` need a GPU: there each method trains on
CUDA to within a small tolerance of its CPU run, growth creates its tensors on the GPU, fp16
trains, and an epoch runs without reading a device value back on the host.
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest
import torch
from test_vision_data import _one_thread  # noqa: F401  (autouse: one torch thread)

from fairseq_alma.errors import Preempted, UsageError
from fairseq_alma.vision.data import load_vision_data
from fairseq_alma.vision.learner_builder import build_learner
from fairseq_alma.vision.learners import LearnerSpec
from fairseq_alma.vision.moe_tree import TreeGating
from fairseq_alma.vision.normalization import mean_and_std, moment_sums
from fairseq_alma.vision.stage_trainer import (
    OptimizerSpec,
    StageTrainConfig,
    _train_epoch,
    evaluate,
    train_stage,
    validation_losses,
)

FP16_ON_CPU = "--vision-amp fp16 needs a CUDA device; use bf16 or off on CPU"
CPU = torch.device("cpu")
WIDTH = 8  # with CONFIG, every learner reaches ~30% test error in a fraction of a second
VARIANTS = {  # name -> LearnerSpec keywords
    "sm": {"method": "sm"},
    "ens": {"method": "ens", "members": 3},
    "umix": {"method": "umix", "members": 3},
    "gens": {"method": "gens"},
    "gmoe": {"method": "gmoe"},
    "gmoe-hard": {"method": "gmoe", "gating": "hard"},
    "ff": {"method": "ff"},
}
GROWING = ("gens", "gmoe", "gmoe-hard", "ff")
CONFIG = StageTrainConfig(epochs=6, batch_size=32)


def cuda_test(function):
    """Mark ``function`` as needing a GPU and skip it, saying why, when torch sees none."""
    skip = pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible to torch here"
    )
    return pytest.mark.cuda(skip(function))


@pytest.fixture(scope="module")
def digits():
    return load_vision_data("digits")


def stage_tensors(digits, stage: int, device=CPU):
    """(train_x, train_y, valid_x, valid_y): 300 + 60 fresh digits per stage, on ``device``."""
    start = (stage - 1) * 360
    x, y = digits.x_train[start : start + 360], digits.y_train[start : start + 360]
    return tuple(t.to(device) for t in (x[:300], y[:300], x[300:], y[300:]))


def begin_stage(learner, digits, stage: int, data) -> None:
    """What the runner does before a stage: adopt the statistics of the digits arrived so far
    (``stage`` blocks of 360), then grow."""
    arrived = digits.x_train[: stage * 360]
    learner.set_input_statistics(*mean_and_std(moment_sums(arrived, per_channel=True)))
    learner.before_stage(stage, *data)


def run_stages(digits, variant: str, device, stages=(1, 2), move_every_stage=False, **config):
    """Train ``variant`` on ``device`` stage by stage (growth before stages > 1, the runner's
    order); returns the learner, each stage's result and the final test error."""
    spec = LearnerSpec(arch="mlp", width=WIDTH, seed=3, **VARIANTS[variant])
    learner = build_learner(spec, digits.input_shape, digits.num_classes).to(device)
    settings = dataclasses.replace(CONFIG, **config)
    results = []
    for stage in stages:
        data = stage_tensors(digits, stage, device)
        begin_stage(learner, digits, stage, data)
        if move_every_stage:
            learner.to(device)
        results.append(train_stage(learner, *data, settings, seed=stage))
        learner.plan_growth(stage, data[2], data[3])  # the runner's order: plan, then grow
    x_test, y_test = digits.x_test.to(device), digits.y_test.to(device)
    error = evaluate(learner, x_test, y_test, 128, amp=settings.amp).error
    return learner, results, error


def finite(result) -> bool:
    return all(math.isfinite(v) for losses in result.valid_losses for v in losses)


def state(learner):
    return {k: v.detach().cpu().clone() for k, v in learner.state_dict().items()}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_moving_to_the_cpu_before_and_after_growth_changes_nothing(digits, variant):
    moved, moved_results, moved_error = run_stages(digits, variant, CPU, move_every_stage=True)
    plain = build_learner(
        LearnerSpec(arch="mlp", width=WIDTH, seed=3, **VARIANTS[variant]),
        digits.input_shape,
        digits.num_classes,
    )
    plain_results = []
    for stage in (1, 2):
        data = stage_tensors(digits, stage)
        begin_stage(plain, digits, stage, data)
        plain_results.append(train_stage(plain, *data, CONFIG, seed=stage))
        plain.plan_growth(stage, data[2], data[3])
    assert all(finite(result) for result in moved_results)
    assert [r.valid_losses for r in moved_results] == [r.valid_losses for r in plain_results]
    plain_state = state(plain)
    assert all(torch.equal(v, plain_state[k]) for k, v in state(moved).items())
    assert moved_error == evaluate(plain, digits.x_test, digits.y_test, 128).error < 0.5
    if variant in GROWING:
        assert moved.params_active() > build_learner(moved.spec, (1, 8, 8), 10).params_active()


@pytest.mark.parametrize("variant", GROWING)
def test_growth_creates_tensors_in_the_learners_dtype(digits, variant):
    """The CPU stand-in for "growth creates its tensors on the learner's device": placement
    follows the learner's parameters, and a float64 learner must get float64 growth."""
    learner = build_learner(
        LearnerSpec(arch="mlp", width=6, seed=1, **VARIANTS[variant]), (1, 8, 8), 10
    ).double()
    data = [t.double() if t.is_floating_point() else t for t in stage_tensors(digits, 1)]
    for stage in (2, 3):
        learner.plan_growth(stage - 1, data[2], data[3])
        learner.before_stage(stage, *data)
    tensors = list(learner.parameters()) + list(learner.buffers())
    assert all(t.dtype == torch.float64 for t in tensors if t.is_floating_point())
    assert learner._example_batch().dtype == torch.float64 and learner.infer_flops_per_image()
    fresh = build_learner(learner.spec, (1, 8, 8), 10).double()
    fresh.load_checkpoint_state(learner.checkpoint_state())  # resized tensors are float64 too
    assert all(t.dtype == torch.float64 for t in fresh.parameters())


@pytest.mark.parametrize("variant", ["sm", "ens", "gmoe-hard"])
def test_bf16_autocast_trains_on_the_cpu(digits, variant):
    learner, results, error = run_stages(digits, variant, CPU, amp="bf16")
    assert all(finite(result) for result in results) and error < 0.5
    assert all(p.dtype == torch.float32 for p in learner.parameters())  # autocast, not a cast
    data = stage_tensors(digits, 1)
    losses = validation_losses(learner, data[2], data[3], 64, amp="bf16")
    assert losses.dtype == torch.float64 and torch.isfinite(losses).all()


def test_bf16_autocast_trains_the_vgg_with_augmentation_on_the_cpu():
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3, 32, 32, generator=generator), torch.randint(0, 10, (40,))
    learner = build_learner(LearnerSpec("sm", "vgg", 4, seed=0), (3, 32, 32), 10)
    config = StageTrainConfig(
        epochs=1, batch_size=16, optimizer=OptimizerSpec.paper_cifar(), augment=True, amp="bf16"
    )
    seen = []
    result = train_stage(
        learner, x[:32], y[:32], x[32:], y[32:], config, 0, progress=lambda *a: seen.append(a[1])
    )
    assert finite(result) and all(math.isfinite(loss) for loss in seen)


def test_fp16_is_refused_on_the_cpu_with_one_line(digits):
    learner = build_learner(LearnerSpec("sm", "mlp", 4), (1, 8, 8), 10)
    data = stage_tensors(digits, 1)
    with pytest.raises(UsageError, match=f"^{re.escape(FP16_ON_CPU)}$"):
        train_stage(learner, *data, StageTrainConfig(epochs=1, amp="fp16"), seed=0)
    with pytest.raises(UsageError, match=f"^{re.escape(FP16_ON_CPU)}$"):
        evaluate(learner, data[0], data[1], amp="fp16")
    with pytest.raises(UsageError, match=r"^--vision-amp 'fp32' is unknown; use one of off, "):
        StageTrainConfig(amp="fp32")


def test_should_stop_raises_preempted_and_leaves_the_best_parameters(digits):
    learner = build_learner(LearnerSpec("ens", "mlp", 6, members=2, seed=0), (1, 8, 8), 10)
    data = stage_tensors(digits, 1)
    curve, asked = [], []

    def stop() -> bool:
        asked.append(len(curve))
        return True

    message = (
        "preempted in stage 4 at epoch 1: the stage restarts from its beginning; "
        "run the same command to continue"
    )
    with pytest.raises(Preempted, match=f"^{re.escape(message)}$"):
        train_stage(
            learner,
            *data,
            StageTrainConfig(epochs=5, batch_size=64),
            seed=0,
            progress=lambda epoch, loss, valid: curve.append(valid),
            should_stop=stop,
            stage=4,
        )
    assert asked == [1]  # asked once, after the first epoch
    # The learner holds each member's best of epochs 0 and 1 and still trains and evaluates.
    start = validation_losses(build_learner(learner.spec, (1, 8, 8), 10), data[2], data[3], 64)
    best = torch.minimum(start, torch.tensor(curve[0], dtype=torch.float64))
    torch.testing.assert_close(validation_losses(learner, data[2], data[3], 64), best)
    result = train_stage(learner, *data, CONFIG, seed=1, should_stop=lambda: False)
    assert finite(result) and evaluate(learner, digits.x_test, digits.y_test).error < 0.9


def test_should_stop_is_not_asked_after_the_last_epoch_and_changes_no_number(digits):
    runs = []
    for should_stop in (None, lambda: False):
        learner = build_learner(LearnerSpec("sm", "mlp", 6, seed=0), (1, 8, 8), 10)
        result = train_stage(learner, *stage_tensors(digits, 1), CONFIG, 0, should_stop=should_stop)
        runs.append((result.valid_losses, state(learner)))
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(v, runs[1][1][k]) for k, v in runs[0][1].items())
    learner = build_learner(LearnerSpec("sm", "mlp", 6, seed=0), (1, 8, 8), 10)
    one_epoch = StageTrainConfig(epochs=1)
    train_stage(learner, *stage_tensors(digits, 1), one_epoch, 0, should_stop=lambda: True)


def test_tree_gating_reads_codes_loaded_in_place():
    """The host copy of the tree is refreshed when ``load_state_dict`` writes the buffer."""
    generator = torch.Generator().manual_seed(0)
    a, b = TreeGating(3), TreeGating(3)
    a.split(0, 1, generator), a.split(1, 2, generator)  # root (0, node 1), node 1 (1, 2)
    b.split(0, 1, generator), b.split(0, 2, generator)  # root (node 1, 1), node 1 (0, 2)
    z = torch.randn(9, 3, generator=generator)
    b.leaf_probs(b.left_probs(z))  # b reads (and caches) its own tree
    b.load_state_dict(a.state_dict())  # same shapes: written in place
    left = a.left_probs(z)
    assert torch.equal(b.leaf_probs(left), a.leaf_probs(left))
    assert torch.equal(b.choose_leaf(left, None, False), a.choose_leaf(left, None, False))


# ---- on a GPU ------------------------------------------------------------------------------
CUDA = torch.device("cuda")


@cuda_test
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cuda_run_matches_the_cpu_run(digits, variant):
    cpu_learner, cpu_results, cpu_error = run_stages(digits, variant, CPU)
    learner, results, error = run_stages(digits, variant, CUDA)
    tensors = list(learner.parameters()) + list(learner.buffers())
    assert all(t.is_cuda for t in tensors)  # growth happened on the GPU learner
    assert learner.params_active() == cpu_learner.params_active()  # and grew as much
    assert abs(error - cpu_error) <= 0.05, (error, cpu_error)
    torch.testing.assert_close(  # the untrained start of stage 1: same draws, same losses
        results[0].valid_losses[0], cpu_results[0].valid_losses[0], rtol=1e-4, atol=1e-5
    )


@cuda_test
@pytest.mark.parametrize("variant", GROWING)
def test_cuda_grown_learner_and_grown_checkpoint_stay_on_the_gpu(digits, variant):
    learner, _, _ = run_stages(digits, variant, CUDA, stages=(1, 2, 3))
    assert all(t.is_cuda for t in list(learner.parameters()) + list(learner.buffers()))
    assert learner.infer_flops_per_image() > 0
    fresh = build_learner(learner.spec, (1, 8, 8), 10).to(CUDA)
    fresh.load_checkpoint_state(learner.checkpoint_state())
    assert all(t.is_cuda for t in list(fresh.parameters()) + list(fresh.buffers()))
    x = digits.x_test.to(CUDA)
    learner.eval(), fresh.eval()
    assert torch.equal(learner.predict_log_probs(x), fresh.predict_log_probs(x))


@cuda_test
@pytest.mark.parametrize("amp", ["fp16", "bf16"])
@pytest.mark.parametrize("variant", ["sm", "ens", "gmoe", "ff"])
def test_cuda_mixed_precision_trains(digits, variant, amp):
    learner, results, error = run_stages(digits, variant, CUDA, amp=amp)
    assert all(finite(result) for result in results) and error < 0.5
    assert all(p.dtype == torch.float32 for p in learner.parameters())


@cuda_test
def test_cuda_vgg_with_augmentation_and_fp16():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, 32, 32, generator=generator).to(CUDA)
    y = torch.randint(0, 10, (40,), generator=generator).to(CUDA)
    for method in ("sm", "gmoe", "ff"):
        learner = build_learner(LearnerSpec(method, "vgg", 4, seed=0), (3, 32, 32), 10).to(CUDA)
        config = StageTrainConfig(
            epochs=1,
            batch_size=16,
            optimizer=OptimizerSpec.paper_cifar(),
            augment=True,
            augment_fill=(-0.5, 0.0, 0.5),
            amp="fp16",
        )
        for stage in (1, 2):
            learner.before_stage(stage, x[:32], y[:32], x[32:], y[32:])
            assert finite(train_stage(learner, x[:32], y[:32], x[32:], y[32:], config, stage))
            learner.plan_growth(stage, x[32:], y[32:])
        assert all(t.is_cuda for t in list(learner.parameters()) + list(learner.buffers()))


@cuda_test
@pytest.mark.parametrize("variant", ["sm", "ens", "umix", "gens", "gmoe", "ff"])
def test_cuda_epoch_reads_nothing_back_on_the_host(digits, variant):
    """An epoch (shuffle, crop/flip, forward, backward, step) with synchronising CUDA calls
    made errors.  Hard gating is left out: its groups' sizes must reach the host."""
    learner, _, _ = run_stages(digits, variant, CUDA)
    train_x, train_y = stage_tensors(digits, 3, CUDA)[:2]
    config = StageTrainConfig(epochs=1, batch_size=64, augment=True)
    optimizer = config.optimizer.build(list(learner.trainable().parameters()))
    generator, fill = torch.Generator().manual_seed(0), torch.tensor([-1.0], device=CUDA)
    learner.trainable().train()
    epoch = (learner, optimizer, None, train_x, train_y, config, generator, fill)
    _train_epoch(*epoch)  # warm-up: first-call allocations and pinned buffers
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        running = _train_epoch(*epoch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert math.isfinite(float(running))


def test_planned_device_is_the_training_nodes_not_this_machines():
    """``alma-sweep submit`` on a login node without GPUs: a run trains on a GPU unless its
    flags say CPU (--cpu, which a CPU profile's launcher adds, or --vision-device cpu)."""
    from fairseq_alma.vision.devices import planned_device

    assert planned_device("auto") == planned_device("cuda") == "cuda"
    assert planned_device("auto", cpu_flag=True) == planned_device("cpu") == "cpu"
    with pytest.raises(UsageError, match="contradicts --cpu"):
        planned_device("cuda", cpu_flag=True)
    with pytest.raises(UsageError, match="--vision-device 'tpu' is unknown"):
        planned_device("tpu")
