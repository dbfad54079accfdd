"""vision/fingerprint.py: a vision run's fingerprint holds the learner settings its method reads,
and only those; run directories written before (their run.json holds every learner setting)
still resume and are still reused, by the same comparison."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from fairseq_alma.errors import UsageError
from fairseq_alma.stream.fingerprint_forms import (
    METHOD_SETTINGS,
    READ_BY_METHOD,
    comparable_form,
)
from fairseq_alma.stream.progress import StreamPlan
from fairseq_alma.stream.run_dir import RunDirectory, fingerprint_hash
from fairseq_alma.vision.data import load_vision_data
from fairseq_alma.vision.fingerprint import vision_fingerprint
from fairseq_alma.vision.learner_builder import build_learner
from fairseq_alma.vision.learners import METHODS, LearnerSpec
from fairseq_alma.vision.runner import VisionRun, data_digest, run_vision_stream
from fairseq_alma.vision.stage_trainer import StageTrainConfig
from fairseq_alma.vision.sweep_runs import held_records, run_name

READ: set[str] = set()


@dataclasses.dataclass(frozen=True)
class _RecordingSpec(LearnerSpec):
    """A LearnerSpec that notes every field a learner reads."""

    def __getattribute__(self, name: str):
        if name in METHOD_SETTINGS:
            READ.add(name)
        return super().__getattribute__(name)


@pytest.mark.parametrize("method", METHODS)
def test_each_method_reads_exactly_the_settings_its_fingerprint_keeps(method):
    """Build each learner, run it, grow it twice (gMoE plans its split, FF scores units and
    layers) and see which method settings it read: those, and only those, are in its
    fingerprint.  A learner that starts reading another setting fails here."""
    torch.manual_seed(0)
    spec = _RecordingSpec(method, "mlp", 4, members=2, seed=1)
    READ.clear()  # the spec's own checks read every field
    learner = build_learner(spec, (1, 8, 8), 10)
    x, y = torch.rand(40, 1, 8, 8), torch.arange(40) % 10
    for stage in (1, 2, 3):
        learner.before_stage(stage, x, y, x, y)
        learner.train_logits(x)
        learner.predict_log_probs(x)
        learner.plan_growth(stage, x, y)
    learner.params_active()
    learner.infer_flops_per_image()
    learner.train_macs_per_example()
    assert READ == READ_BY_METHOD[method]


def test_the_fingerprint_leaves_out_what_the_method_does_not_read():
    def settings(**learner):
        return {"settings": {"--seed": 1, "learner": learner}, "data": "a" * 64}

    sm = settings(method="sm", width=4, members=5, gating="soft", ff_epsilon=0.01, seed=1)
    assert comparable_form(sm) == settings(method="sm", width=4, seed=1)
    ens = settings(method="ens", members=5, gating="soft", ens_member_data_order=False)
    assert comparable_form(ens) == settings(method="ens", members=5, ens_member_data_order=False)
    # an alma-score Ens wrapper: each member's; an LM's or an unknown method's: untouched
    assert comparable_form({"mode": "ens", "members": [sm]}) == {
        "mode": "ens", "members": [settings(method="sm", width=4, seed=1)]}
    for kept in ({"config": {"task": {"members": 2}}}, settings(method="new", members=3),
                 settings(members=3), None):
        assert comparable_form(kept) == kept


def _run(method: str = "sm", **learner) -> VisionRun:
    return VisionRun(dataset="digits", data_path=None, plan=StreamPlan(2, 1),
                     learner=LearnerSpec(method, "mlp", 4, seed=3, **learner),
                     training=StageTrainConfig(epochs=1), seed=3)


def _arrivals(records):
    return [(r.arrival, r.test_error, r.train_flops_cum, r.params_active) for r in records]


def test_a_run_json_of_earlier_versions_still_resumes_and_is_reused(tmp_path):
    """A run.json written before unread settings were left out (an SM run holding
    ``learner.members: 5``) continues to the numbers of an uninterrupted run, keeps its
    run.json, and a sweep with another --members reuses it; a setting SM reads still refuses,
    and its message names only that."""
    data = load_vision_data("digits")
    digest = data_digest(data)
    run = _run()
    assert "members" not in vision_fingerprint(run, digest)["settings"]["learner"]
    with RunDirectory.for_training(tmp_path / "whole") as run_dir:
        whole = run_vision_stream(run, run_dir, data)

    path = tmp_path / "out" / run_name(run)
    with RunDirectory.for_training(path) as run_dir:
        assert len(run_vision_stream(run, run_dir, data, stop_after=1)) == 2
    old = {"settings": run.settings(), "data": digest}  # every learner setting, as before
    assert old["settings"]["learner"]["members"] == 5
    (path / "run.json").write_text(json.dumps({"fingerprint": old, "hash": fingerprint_hash(old)}))
    with RunDirectory.for_training(path) as run_dir:
        resumed = run_vision_stream(run, run_dir, data)
    assert _arrivals(resumed) == _arrivals(whole)
    assert json.loads((path / "run.json").read_text())["fingerprint"] == old

    reused = held_records(_run(members=2, gating="hard"), str(tmp_path / "out"), digest)
    assert _arrivals(reused) == _arrivals(whole)
    wider = dataclasses.replace(run, training=StageTrainConfig(epochs=2))
    with pytest.raises(UsageError) as caught:
        held_records(wider, str(tmp_path / "out"), digest)
    assert "(--epochs-per-stage: 1 -> 2); use another --out" in str(caught.value)

    # an unfinished SM run continued with another --members: the same learner (its checkpoint's
    # spec used to be compared whole, and the continuation was refused)
    other = tmp_path / "other"
    with RunDirectory.for_training(other) as run_dir:
        run_vision_stream(run, run_dir, data, stop_after=1)
    with RunDirectory.for_training(other) as run_dir:
        continued = run_vision_stream(_run(members=2, gating="hard"), run_dir, data)
    assert _arrivals(continued) == _arrivals(whole)


def test_gmoe_grows_the_first_two_layers_and_old_records_keep_their_meaning(tmp_path):
    """§5: gMoE "adds modules (at the first two layers)", the same on CIFAR-10: a VGG gMoE
    left without --moe-mixture-layers grew all 16 conv layers, while the shipped CIFAR-10 config
    said 0,1.  The default is now the first two for both backbones and every record names them;
    an old record (no layers named) keeps its day's meaning: an old MLP run still resumes to an
    uninterrupted run's numbers, an old VGG run is never taken for a new default one."""
    from fairseq_alma.stream.run_dir import same_run
    from fairseq_alma.vision.learners_growing import GrowingMoE

    vgg = GrowingMoE(LearnerSpec("gmoe", "vgg", 4), (3, 32, 32), 10)
    assert vgg.model.mixture_layers == (0, 1)

    def record(arch: str, layers: list[int]) -> dict:
        return {"settings": {"learner": {"method": "gmoe", "arch": arch, "width": 4,
                                         "gating": "soft", "mixture_layers": layers}}}

    assert not same_run(record("vgg", []), record("vgg", [0, 1]))
    assert same_run(record("vgg", []), record("vgg", list(range(16))))
    assert same_run(record("mlp", []), record("mlp", [0, 1]))

    data = load_vision_data("digits")
    digest = data_digest(data)
    run = _run("gmoe")
    assert vision_fingerprint(run, digest)["settings"]["learner"]["mixture_layers"] == [0, 1]
    with RunDirectory.for_training(tmp_path / "whole") as run_dir:
        whole = run_vision_stream(run, run_dir, data)
    path = tmp_path / "old"
    with RunDirectory.for_training(path) as run_dir:
        run_vision_stream(run, run_dir, data, stop_after=1)
    old = {"settings": run.settings(), "data": digest}
    old["settings"]["learner"]["mixture_layers"] = []  # as versions before 2026-11-29 wrote it
    (path / "run.json").write_text(json.dumps({"fingerprint": old, "hash": fingerprint_hash(old)}))
    state = torch.load(path / "checkpoint_last.pt", weights_only=False)
    state["learner"]["spec"]["mixture_layers"] = None
    torch.save(state, path / "checkpoint_last.pt")
    with RunDirectory.for_training(path) as run_dir:
        assert _arrivals(run_vision_stream(run, run_dir, data)) == _arrivals(whole)
