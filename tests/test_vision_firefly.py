"""Firefly (FF, §4.2, App. B.1) grows width and depth, keeps the function, descends as scored,
and grows linearly: about a quarter of the initial parameters and one layer per growth phase."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from test_vision_data import _one_thread  # noqa: F401  (autouse: one torch thread)

from fairseq_alma.errors import UsageError
from fairseq_alma.stream.progress import StreamPlan
from fairseq_alma.stream.run_dir import RunDirectory
from fairseq_alma.vision.data import load_vision_data
from fairseq_alma.vision.firefly import grow_width
from fairseq_alma.vision.firefly_budget import UnitCosts
from fairseq_alma.vision.firefly_depth import grow_depth
from fairseq_alma.vision.learner_builder import build_learner
from fairseq_alma.vision.learners import LearnerSpec
from fairseq_alma.vision.mac_count import count_parameters
from fairseq_alma.vision.models import StackedMLP, build_backbone
from fairseq_alma.vision.runner import VisionRun, run_vision_stream
from fairseq_alma.vision.stage_trainer import StageTrainConfig

SHAPES = {"mlp": (1, 8, 8), "vgg": (3, 32, 32)}


def batch(arch: str, n: int, seed: int = 4):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *SHAPES[arch], generator=generator)
    return x, torch.randint(0, 10, (n,), generator=generator), generator


def test_unit_costs_and_a_budget_of_one_unit_by_hand():
    # MLP 64 -> 8 -> 8 -> 10: 520 + 72 + 90 = 682 parameters.  One more unit in layer 0 costs
    # 64 in + 1 bias + 8 out = 73, in layer 1 8 + 1 + 10 = 19; after a layer-1 unit, a layer-0
    # unit also feeds it: 74.  A budget of 19 fits one layer-1 unit and nothing else (73 is
    # farther from 19 than 0 is), whatever the scores.
    model = StackedMLP(64, [8, 8], 10, generator=torch.Generator().manual_seed(0))
    assert count_parameters(model) == 682
    costs = UnitCosts(model.growable_layers())
    assert (costs.marginal(0), costs.marginal(1)) == (73, 19)
    assert costs.keep(1) == 19 and costs.marginal(0) == 74
    x, y = torch.randn(50, 64), torch.randint(0, 10, (50,))
    report = grow_width(model, x, y, budget=19, generator=torch.Generator().manual_seed(0))
    assert model.widths == [8, 9] and (report.params_before, report.params_after) == (682, 701)
    assert report.splits[0] + report.new_units[0] == 0 and report.flops > 0
    nothing = grow_width(model, x, y, budget=0)
    assert nothing.params_after == 701 and nothing.flops == 0.0


def test_a_residual_block_widens_with_the_layer_it_sits_behind():
    # Behind layer 1 (width 8): W (8x8) + b + scale.  A unit of layer 1 now also costs the
    # block's new row and column (9*9 - 8*8 = 17), its bias and its scale: 8 + 1 + 19 + 10 = 38.
    model = StackedMLP(64, [8, 8], 10, generator=torch.Generator().manual_seed(0))
    model.residuals.attach(1, model.new_residual(1, torch.Generator().manual_seed(1)))
    assert count_parameters(model) == 682 + 64 + 8 + 8 and model.depth == 4
    assert UnitCosts(model.growable_layers()).marginal(1) == 38
    data = torch.Generator().manual_seed(2)  # the growth scores depend on the batch: fixed
    x, y = torch.randn(50, 64, generator=data), torch.randint(0, 10, (50,), generator=data)
    grow_width(model, x, y, budget=38, generator=torch.Generator().manual_seed(0))
    block = model.residuals.blocks[0]
    assert model.widths == [8, 9] and block.layer.weight.shape == (1, 9, 9)
    assert block.scale.shape == (1, 9) and count_parameters(model) == 682 + 80 + 38


@pytest.mark.parametrize("arch", ["mlp", "vgg"])
def test_depth_and_width_growth_keep_the_function_at_zero_step(arch):
    """In training and in eval mode: new blocks start with scale 0, new units with zero
    outgoing weights, split copies with halved ones."""
    x, y, generator = batch(arch, 64)
    model = build_backbone(arch, SHAPES[arch], 4, 10, 1, generator)
    params = count_parameters(model)
    for step in range(3):  # blocks behind grown layers, grown again
        before = {mode: copy.deepcopy(model).train(mode == "train")(x)
                  for mode in ("train", "eval")}
        depth = grow_depth(model, x, y, layers=1, epsilon=0.0, generator=generator)
        width = grow_width(model, x, y, 0.25 * params, epsilon=0.0, generator=generator)
        for mode in ("train", "eval"):
            after = copy.deepcopy(model).train(mode == "train")(x)
            torch.testing.assert_close(after, before[mode], rtol=0, atol=1e-5)
        assert len(depth.inserted_after) == 1 and len(model.residuals) == step + 1
        assert width.params_after > depth.params_after > depth.params_before
    assert sum(model.widths) > 4 * len(model.widths)  # width grew too


@pytest.mark.parametrize("arch", ["mlp", "vgg"])
def test_growth_descends_as_scored(arch):
    """The loss falls by what the first-order scores promised (ε × Σ chosen scores) up to
    O(ε²), in float64 with a small ε (the 16-layer batch-normed VGG is strongly curved)."""
    x, y, generator = batch(arch, 64)
    model = build_backbone(arch, SHAPES[arch], 4, 10, 1, generator).double().train()
    x = x.double()
    for grow in (
        lambda: grow_depth(model, x, y, layers=2, epsilon=1e-6, generator=generator),
        lambda: grow_width(model, x, y, 300, epsilon=1e-6, generator=generator),
    ):
        with torch.no_grad():
            loss_before = float(F.cross_entropy(model(x)[0], y))
        report = grow()
        with torch.no_grad():
            decrease = loss_before - float(F.cross_entropy(model.train()(x)[0], y))
        assert report.predicted_decrease > 0
        assert abs(decrease - report.predicted_decrease) < 1e-3 * report.predicted_decrease, (
            decrease, report)


@pytest.mark.parametrize("arch,width,examples", [("mlp", 8, 100), ("vgg", 4, 24)])
def test_learner_grows_one_layer_and_a_quarter_of_the_parameters_per_phase(arch, width, examples):
    x, y, _ = batch(arch, examples)
    learner = build_learner(LearnerSpec("ff", arch, width, seed=1), SHAPES[arch], 10)
    initial, depth = learner.params_active(), learner.describe()["depth"]
    assert learner.before_stage(1, x, y, x, y)["depth"] == depth  # no growth before stage 1
    for stage in (2, 3, 4):
        report = learner.before_stage(stage, x, y, x, y)
        assert report["depth"] == depth + stage - 1 and len(report["inserted_after"]) == 1
        target = initial * (1 + 0.25 * (stage - 1))  # App. B.1: linear, rate 0.25
        costs = UnitCosts(learner.model.growable_layers())
        slack = max(costs.marginal(i) for i in range(len(learner.model.widths))) / 2
        assert abs(learner.params_active() - target) <= slack, (stage, report)
    assert learner.residual_after.tolist() == learner.model.residuals.after
    assert sum(learner.model.widths) > width * len(learner.model.widths)
    fresh = build_learner(learner.spec, SHAPES[arch], 10)  # rebuilt from the checkpoint alone
    fresh.load_checkpoint_state(learner.checkpoint_state())
    learner.eval(), fresh.eval()
    assert fresh.describe() == learner.describe()
    assert torch.equal(fresh.predict_log_probs(x), learner.predict_log_probs(x))


def test_depth_only_and_bad_flags():
    x, y, _ = batch("mlp", 50)
    learner = build_learner(LearnerSpec("ff", "mlp", 8, seed=1, ff_new_layers=2), (1, 8, 8), 10)
    assert learner.before_stage(2, x, y, x, y)["depth"] == 3 + 2
    with pytest.raises(UsageError, match="^--ff-new-layers must be >= 0"):
        LearnerSpec("ff", ff_new_layers=-1)


def _ff_stream(path, stop_after=None):
    run = VisionRun(dataset="digits", data_path=None, plan=StreamPlan(3, 1),
                    learner=LearnerSpec("ff", "mlp", 8, seed=0),
                    training=StageTrainConfig(epochs=1), seed=0)
    with RunDirectory.for_training(path) as run_dir:
        return run_vision_stream(run, run_dir, load_vision_data("digits"), stop_after=stop_after)


def _comparable(records):
    return [(r.arrival, r.params_active, r.train_flops_cum, r.infer_flops_per_image,
             r.test_error, r.extra) for r in records]


def test_ff_stream_records_depth_and_parameters_and_resumes_after_growth(tmp_path):
    """A run stopped after the first growth phase continues from ``checkpoint_last.pt`` with
    the grown network (its inserted layer and widths) and ends where an uninterrupted run ends."""
    records = _ff_stream(tmp_path / "whole")
    assert [r.extra["depth"] for r in records] == [3, 3, 4, 5]
    params = [r.params_active for r in records]
    assert params[0] == params[1] == 682
    for stage, count in ((2, params[2]), (3, params[3])):
        assert abs(count - 682 * (1 + 0.25 * (stage - 1))) < 0.1 * 682, params
    assert len(_ff_stream(tmp_path / "parts", stop_after=2)) == 3
    assert _comparable(_ff_stream(tmp_path / "parts")) == _comparable(records)


def test_flops_of_a_grown_network_count_its_new_layers_and_units():
    """MLP 64 -> 8 -> 8 -> 10 holds 64·8 + 8·8 + 8·10 = 656 MACs per example; a block behind
    layer 1 adds its 8·8 Linear (the per-unit scale folds into it, ``residual``), and each
    unit added to layer 0 adds 64 + 8 (+ 8 more once a block sits behind layer 0)."""
    learner = build_learner(LearnerSpec("ff", "mlp", 8, seed=1), (1, 8, 8), 10)
    assert learner.infer_macs_per_image() == 656
    model = learner.model
    model.residuals.attach(1, model.new_residual(1, torch.Generator().manual_seed(0)))
    assert learner.infer_macs_per_image() == 656 + 64
    x, y, _ = batch("mlp", 50)
    grow_width(model, x, y, budget=0.25 * 682, generator=torch.Generator().manual_seed(0))
    (a, b), sizes = model.widths, (64, *model.widths, 10)
    expected = sum(i * o for i, o in zip(sizes, sizes[1:])) + b * b
    assert (a, b) != (8, 8) and learner.infer_macs_per_image() == expected
    assert learner.train_macs_per_example() == expected
    assert learner.params_active() == count_parameters(model) == (
        sum(i * o + o for i, o in zip(sizes, sizes[1:])) + b * b + 2 * b)
