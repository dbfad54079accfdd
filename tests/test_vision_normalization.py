"""Input normalisation uses only the mega-batches arrived by the stage (§3, App. B.1), and every
model is evaluated with the statistics of its own time."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_vision_data import _one_thread  # noqa: F401  (autouse: one torch thread)

from fairseq_alma.stream.progress import StreamPlan
from fairseq_alma.stream.run_dir import RunDirectory
from fairseq_alma.vision.data import load_vision_data
from fairseq_alma.vision.learner_builder import build_learner
from fairseq_alma.vision.learners import LearnerSpec
from fairseq_alma.vision.normalization import ArrivedStatistics, InputNormalizer
from fairseq_alma.vision.runner import VisionRun, run_vision_stream
from fairseq_alma.vision.stage_trainer import StageTrainConfig
from fairseq_alma.vision.stream_stage import make_partition

PLAN = StreamPlan(4, 1)


@pytest.mark.parametrize("shape", [(3, 4, 4), (7,)])
def test_statistics_after_an_arrival_are_those_of_the_arrived_examples(shape):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(30, *shape, generator=generator) * 3 + 2
    megabatches = [np.arange(0, 10), np.array([12, 10, 11, 13, 14]), np.arange(15, 30)]
    stats = ArrivedStatistics(x, megabatches, per_channel=len(shape) == 3)
    for arrival, end in ((1, 10), (2, 15), (3, 30)):
        seen = x[:end].double()
        if len(shape) == 3:  # per channel
            values = seen.transpose(0, 1).reshape(shape[0], -1)
            expected = values.mean(dim=1), values.std(dim=1)
        else:
            expected = seen.mean().reshape(1), seen.std().reshape(1)
        mean, std = stats.after(arrival)
        torch.testing.assert_close(mean, expected[0])
        torch.testing.assert_close(std, expected[1])
    with pytest.raises(ValueError, match="arrival 0 is outside the stream"):
        stats.after(0)


def test_constant_inputs_get_unit_std_and_the_normaliser_starts_as_identity():
    stats = ArrivedStatistics(torch.full((5, 4), 0.5), [np.arange(5)], per_channel=False)
    mean, std = stats.after(1)
    assert mean.tolist() == [0.5] and std.tolist() == [1.0]
    norm = InputNormalizer((1, 8, 8))
    x = torch.rand(3, 1, 8, 8)
    assert torch.equal(norm(x), x)  # before any arrival: the raw inputs, bit for bit
    norm.set_statistics(torch.tensor([0.25], dtype=torch.float64), torch.tensor([2.0]))
    torch.testing.assert_close(norm(x), (x - 0.25) / 2)


@pytest.fixture(scope="module")
def digits():
    return load_vision_data("digits")


def _save_npz(data, path, shift: float = 0.0):
    """``data`` as an .npz file, every example of mega-batches 2, 3, 4 moved by ``shift``: a
    drift that only arrives after stage 1 of a w = 1 learner."""
    partition = make_partition(data, PLAN, seed=0, valid_fraction=0.1)
    later = np.concatenate([np.concatenate([mb.train, mb.valid]) for mb in partition[1:]])
    x = data.x_train.numpy().copy()
    x[later] += shift
    np.savez(path, x_train=x, y_train=data.y_train.numpy(), x_test=data.x_test.numpy(),
             y_test=data.y_test.numpy())
    return str(path)


def _run(tmp_path, method: str, data=None, path: str | None = None, stop_after=None):
    """The stream as the real entries run it: from the file when ``path`` is given."""
    run = VisionRun(dataset="npz" if path else "digits", data_path=path, plan=PLAN,
                    learner=LearnerSpec(method, "mlp", 8, seed=0),
                    training=StageTrainConfig(epochs=3), seed=0)
    with RunDirectory.for_training(tmp_path) as run_dir:
        records = run_vision_stream(run, run_dir, data, stop_after=stop_after)
        state = torch.load(run_dir.last_checkpoint, weights_only=False)
    return records, state["learner"]["model"]


def test_later_drift_does_not_change_stage_one(digits, tmp_path):
    """Statistics of the whole training set (the old normalisation, at loading) would move with
    the shifted later mega-batches and change stage 1's inputs and its test error."""
    plain = _save_npz(digits, tmp_path / "plain.npz")
    drifted = _save_npz(digits, tmp_path / "drifted.npz", shift=5.0)
    records, model = _run(tmp_path / "plain", "sm", path=plain, stop_after=1)
    shifted_records, shifted_model = _run(tmp_path / "drifted", "sm", path=drifted, stop_after=1)
    assert [r.test_error for r in shifted_records] == [r.test_error for r in records]
    for key in ("input_norm.mean", "input_norm.std", "model.layers.0.weight"):
        assert torch.equal(shifted_model[key], model[key]), key
    partition = make_partition(digits, PLAN, seed=0, valid_fraction=0.1)
    first = torch.from_numpy(np.concatenate([partition[0].train, partition[0].valid]))
    torch.testing.assert_close(model["input_norm.mean"].double(),
                               digits.x_train[first].double().mean().view(1, 1, 1))
    # the drift is real: after stage 2 the drifted learner's statistics differ
    _, later = _run(tmp_path / "drifted", "sm", path=drifted, stop_after=2)
    assert float(later["input_norm.mean"]) > float(model["input_norm.mean"]) + 2


def test_each_model_keeps_the_statistics_of_its_own_stage(digits, tmp_path):
    """The learner adopts the statistics of everything arrived by each stage; a gEns member
    keeps those of the stage it was trained in, and the checkpoint carries them."""
    _, model = _run(tmp_path / "gens", "gens", data=digits)
    partition = make_partition(digits, PLAN, seed=0, valid_fraction=0.1)
    stats = ArrivedStatistics(digits.x_train, [np.concatenate([mb.train, mb.valid])
                                               for mb in partition], per_channel=True)
    for member in range(4):
        mean, std = stats.after(member + 1)
        torch.testing.assert_close(model[f"member_norms.{member}.mean"], mean.float().view(1, 1, 1))
        torch.testing.assert_close(model[f"member_norms.{member}.std"], std.float().view(1, 1, 1))
    assert not torch.equal(model["member_norms.0.mean"], model["member_norms.3.mean"])
    spec = LearnerSpec("gens", "mlp", 8, seed=0)
    fresh = build_learner(spec, digits.input_shape, 10)
    fresh.load_checkpoint_state({"spec": spec, "model": model,
                                 "generator": fresh.generator.get_state()})
    assert torch.equal(fresh.member_norms[2].mean, model["member_norms.2.mean"])
