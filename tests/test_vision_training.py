"""Stage training keeps the best-validation epoch; a digits stream yields B + 1 sane records."""

from __future__ import annotations

import pytest
import torch
from test_vision_data import _one_thread  # noqa: F401  (autouse: one torch thread)

from fairseq_alma.errors import UsageError
from fairseq_alma.stream.progress import StreamPlan
from fairseq_alma.stream.records import read_records
from fairseq_alma.stream.run_dir import RunDirectory
from fairseq_alma.stream.schedule import build_schedule
from fairseq_alma.vision.data import load_vision_data
from fairseq_alma.vision.learner_builder import build_learner
from fairseq_alma.vision.learners import LearnerSpec
from fairseq_alma.vision.runner import VisionRun, run_vision_stream
from fairseq_alma.vision.stage_trainer import StageTrainConfig, train_stage, validation_losses
from fairseq_alma.vision.stream_stage import make_partition, stage_data

SHAPE = (1, 8, 8)


def toy(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *SHAPE, generator=g)
    y = x.flatten(1)[:, :10].argmax(1) + 0  # learnable: the class is the argmax of 10 pixels
    return x, y


def state(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def test_keeps_the_epoch_with_lowest_validation_loss():
    x, y = toy()
    learner = build_learner(LearnerSpec("sm", "mlp", 16, seed=0), SHAPE, 10)
    result = train_stage(
        learner, x, y, x[:32], y[:32], StageTrainConfig(epochs=5, batch_size=16), seed=0
    )
    curve = [losses[0] for losses in result.valid_losses]
    assert len(curve) == 6 and result.best_epoch == [min(range(6), key=curve.__getitem__)]
    now = float(validation_losses(learner, x[:32], y[:32], 1024)[0])
    assert now == pytest.approx(min(curve), abs=1e-6) and result.best_valid_loss[
        0
    ] == pytest.approx(min(curve))


def test_epoch_zero_wins_when_training_hurts_validation():
    x, y = toy()
    learner = build_learner(LearnerSpec("sm", "mlp", 16, seed=0), SHAPE, 10)
    start = state(learner.trainable())
    wrong = (y[:32] + 3) % 10  # validation labels that training on y can only move away from
    train_stage(learner, x, y, x[:32], y[:32], StageTrainConfig(epochs=15, batch_size=16), seed=0)
    warmed = state(learner.trainable())
    result = train_stage(
        learner, x, y, x[:32], wrong, StageTrainConfig(epochs=4, batch_size=16), seed=1
    )
    assert result.best_epoch == [0]
    assert all(torch.equal(v, warmed[k]) for k, v in learner.trainable().state_dict().items())
    assert not all(torch.equal(v, start[k]) for k, v in warmed.items())


def test_ens_members_select_their_own_best_epoch():
    x, y = toy()
    learner = build_learner(LearnerSpec("ens", "mlp", 8, members=3, seed=0), SHAPE, 10)
    result = train_stage(
        learner, x, y, x[:24], y[:24], StageTrainConfig(epochs=4, batch_size=16), seed=0
    )
    curve = torch.tensor(result.valid_losses, dtype=torch.float64)  # (epochs + 1, members)
    assert result.best_epoch == curve.argmin(0).tolist()
    torch.testing.assert_close(
        validation_losses(learner, x[:24], y[:24], 1024), curve.min(0).values, rtol=1e-6, atol=1e-6
    )


def test_seeded_and_flops_by_hand():
    x, y = toy()
    runs = []
    for _ in range(2):
        learner = build_learner(LearnerSpec("sm", "mlp", 16, seed=3), SHAPE, 10)
        result = train_stage(
            learner, x, y, x[:10], y[:10], StageTrainConfig(epochs=2, batch_size=32), seed=7
        )
        runs.append(state(learner.trainable()))
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])
    # 64 -> 16 -> 16 -> 10 = 1440 MACs: 6 FLOPs/MAC per trained example (96 x 2 epochs) and
    # 2 per validated example (10 x 3 evaluations: the start and after each epoch).
    assert result.flops == 6 * 1440 * 96 * 2 + 2 * 1440 * 10 * 3


def test_augmented_stage_differs_and_is_seeded():
    x, y = toy()
    finals = []
    for augment in (False, True, True):
        learner = build_learner(LearnerSpec("sm", "mlp", 8, seed=0), SHAPE, 10)
        train_stage(
            learner,
            x,
            y,
            x[:0],
            y[:0],
            StageTrainConfig(epochs=1, batch_size=32, augment=augment),
            seed=0,
        )
        finals.append(state(learner.trainable())["layers.0.weight"])
    assert not torch.equal(finals[0], finals[1]) and torch.equal(finals[1], finals[2])


@pytest.fixture(scope="module")
def digits():
    return load_vision_data("digits")


def test_stage_data_with_and_without_replay(digits):
    partition = make_partition(digits, StreamPlan(6, 2, replay=True), seed=0, valid_fraction=0.1)
    last = build_schedule(6, 2, replay=True)[-1]
    train_x, _, valid_x, _ = stage_data(digits, partition, last.train_megabatches)
    assert train_x.shape[0] + valid_x.shape[0] == digits.x_train.shape[0]
    assert valid_x.shape[0] == sum(mb.valid.size for mb in partition)
    only_new = build_schedule(6, 2, replay=False)[-1]
    assert stage_data(digits, partition, only_new.train_megabatches)[0].shape[0] < train_x.shape[0]


def _run(digits, tmp_path, spec: LearnerSpec, plan: StreamPlan, epochs: int) -> list[dict]:
    run = VisionRun(dataset="digits", data_path=None, plan=plan, learner=spec,
                    training=StageTrainConfig(epochs=epochs), seed=0)
    with RunDirectory.for_training(tmp_path / "run") as run_dir:
        return [r.to_json() for r in run_vision_stream(run, run_dir, digits)]


@pytest.mark.parametrize("method", ["sm", "gens"])
def test_digits_stream_records(digits, tmp_path, method):
    records = _run(digits, tmp_path, LearnerSpec(method, "mlp", 8, seed=0), StreamPlan(6, 2), 10)
    assert [r["arrival"] for r in records] == list(range(7))
    assert [r["trained"] for r in records] == [False, False, True, False, True, False, True]
    assert [r["stage"] for r in records] == [0, 0, 1, 1, 2, 2, 3]
    errors = [r["test_error"] for r in records]
    assert errors[0] > 0.6 and errors[-1] < errors[0] - 0.3  # untrained ~ chance; trained learns
    assert errors[1] == errors[0] and errors[3] == errors[2]  # no training, same model
    flops = [r["train_flops_cum"] for r in records]
    assert flops[:2] == [0.0, 0.0] and flops[2] < flops[4] < flops[6] and flops[3] == flops[2]
    params = [r["params_active"] for r in records]
    expected_members = [1, 1, 1, 1, 2, 2, 3] if method == "gens" else [1] * 7
    assert params == [params[0] * m for m in expected_members]
    # 64 -> 8 -> 8 -> 10: 512 + 64 + 80 MACs per member, 2 FLOPs each
    assert all(
        r["infer_flops_per_image"] == 2 * (64 * 8 + 64 + 80) * m
        for r, m in zip(records, expected_members)
    )
    assert [r.test_error for r in read_records(tmp_path / "run" / "stream.jsonl")] == errors
    # the same call again finds the stream done and returns the same records, training nothing
    again = _run(digits, tmp_path, LearnerSpec(method, "mlp", 8, seed=0), StreamPlan(6, 2), 10)
    assert [r["test_error"] for r in again] == errors


def test_stream_bad_input(digits, tmp_path):
    with pytest.raises(UsageError, match=r"--wait must be in \[1, 4\]"):
        StreamPlan(num_megabatches=4, wait=5)
    with pytest.raises(UsageError, match="--num-megabatches 5000 is larger than the training set"):
        _run(digits, tmp_path, LearnerSpec("sm", "mlp", 4), StreamPlan(5000, 1), 1)
    with pytest.raises(UsageError, match="--vision-method 'bogus' is unknown"):
        LearnerSpec("bogus")
