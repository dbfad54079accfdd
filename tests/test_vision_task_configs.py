"""train_configs/vision: every config loads with its flags checked by the real fairseq-train
parser (plugin loaded), holds the paper's grid (§5, §6.1, App. B.1), and a config's command
runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lm_fixtures import run, tool

from fairseq_alma.configs import load_run_config, resolve_profile

VISION = Path(__file__).resolve().parents[1] / "train_configs" / "vision"
CONFIGS = sorted(VISION.glob("*.yaml"))


def test_there_are_configs_for_both_paper_datasets():
    names = {path.name for path in CONFIGS}
    assert {"mnist.yaml", "cifar10.yaml", "mnist_base.yaml", "cifar10_base.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[path.name for path in CONFIGS])
def test_config_loads_with_flags_checked_and_has_resources(path):
    config = load_run_config(path, check_flags=True)  # parses every grid point
    assert config.args["task"] == "alma_stream" and config.args["arch"] == "alma_vision"
    assert "criterion" not in config.args  # the learner trains with its own loss
    assert config.args["vision-dataset"] in ("digits", "mnist", "cifar10", "npz")
    profile = resolve_profile(None, config.resources, config.path)
    assert profile.cpus_per_task == config.args["vision-threads"] or profile.name == "local-cpu"


def test_grids_hold_the_paper_settings():
    mnist = load_run_config(VISION / "mnist.yaml", check_flags=False)  # flags: the test above
    cifar = load_run_config(VISION / "cifar10.yaml", check_flags=False)
    # App. B.1: 100 epochs, minibatch 128, N = 5, 10% validation; §5: B = 500 / 100
    for config, b in ((mnist, 500), (cifar, 100)):
        args = config.args
        sizes = (args["epochs-per-stage"], args["batch-size"], args["ensemble-members"])
        assert sizes == (100, 128, 5)
        assert args["num-megabatches"] == b and args["valid-fraction"] == 0.1
        assert config.grid["vision-width"] == [4, 8, 16, 32, 64]  # §5: sizes 4 ... 64
        assert config.grid["replay"] == [False, True]
        assert max(config.grid["wait"]) == b  # the tardy learner, w = B
    assert (mnist.args["vision-arch"], mnist.args["vision-optimizer"], mnist.args["vision-lr"]) == (
        "mlp", "adadelta", 1.0)
    assert mnist.args["moe-mixture-layers"] == "0,1" and mnist.args["moe-gating"] == "soft"
    assert (cifar.args["vision-arch"], cifar.args["vision-optimizer"], cifar.args["vision-lr"]) == (
        "vgg", "sgd", 0.01)
    assert cifar.args["vision-augment"] == "crop-flip" and cifar.args["ff-growth-rate"] == 0.25
    assert cifar.grid["wait"] == [2, 10, 100]  # §6.1, Fig. 3
    assert mnist.grid["vision-method"] == ["sm", "ens", "umix", "gens", "gmoe"]
    assert cifar.grid["vision-method"] == ["sm", "ens", "umix", "gens", "gmoe", "ff"]
    assert len(mnist.grid_points()) == 200 and len(cifar.grid_points()) == 180


@pytest.mark.slow
def test_a_config_grid_point_runs_through_fairseq_train(tmp_path):
    """The digits smoke config's gMoE, w = B point, as alma-sweep would launch it (--cpu from the
    local-cpu profile): a complete stream.jsonl."""
    config = load_run_config(VISION / "digits_smoke.yaml", check_flags=False)
    point = {"vision-method": "gmoe", "wait": 4}
    assert point in config.grid_points()
    save = tmp_path / "run"
    run([tool("fairseq-train"), *config.to_argv(point, 1, save), "--cpu"], cwd=tmp_path)
    records = [json.loads(line) for line in (save / "stream.jsonl").read_text().splitlines()]
    assert [r["trained"] for r in records] == [False, False, False, False, True]
    assert records[-1]["method"] == "gmoe" and records[-1]["wait"] == 4
