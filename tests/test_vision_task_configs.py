"""train_configs/vision: every config loads with its flags checked by the real fairseq-train
parser (plugin loaded), holds the paper's grid (§5, §6.1, App. B.1), and a config's command
runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lm_fixtures import run, tool

from fairseq_alma.sweeps import load_run_config, resolve_profile
from fairseq_alma.vision.learners import LearnerSpec
from fairseq_alma.vision.stage_trainer import OptimizerSpec

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


# (config, flag, the paper's value, where the paper says so); "both": MNIST and CIFAR-10.
PAPER_SETTINGS = [
    ("both", "epochs-per-stage", 100, "App. B.1.1 / B.1.2: 'trained for 100 epochs'"),
    ("both", "batch-size", 128, "App. B.1: 'A training minibatch size of 128 is used'"),
    ("both", "ensemble-members", 5, "App. B.1: 'UMix and Ens models have N = 5'"),
    ("both", "valid-fraction", 0.1, "App. B.1 and §5: 'we keep 10% of the data'"),
    ("both", "moe-gating", "soft", "App. B.1.1: 'we report results with soft gating'"),
    ("both", "moe-mixture-layers", "0,1",
     "§5: gMoE 'adds modules (at the first two layers)'; CIFAR: 'methods ... are the same'"),
    ("mnist", "num-megabatches", 500, "§5: 'B = 500 for MNIST'"),
    ("mnist", "vision-arch", "mlp", "§5: 'a three layer fully connected neural network'"),
    ("mnist", "vision-optimizer", "adadelta", "App. B.1.1: 'the AdaDelta ... optimizer'"),
    ("mnist", "vision-lr", 1.0, "App. B.1.1: 'default learning rate of 1'"),
    ("mnist", "vision-augment", "none", "App. B.1.2 augments CIFAR-10 only"),
    ("cifar10", "num-megabatches", 100, "§5: 'B = 100 for CIFAR'"),
    ("cifar10", "vision-arch", "vgg", "App. B.1.2: 'reduced VGG with batch normalization'"),
    ("cifar10", "vision-optimizer", "sgd", "App. B.1.2: SGD, momentum 0.9, weight decay 1e-4"),
    ("cifar10", "vision-lr", 0.01, "App. B.1.2: 'with a learning rate of 0.01'"),
    ("cifar10", "vision-augment", "crop-flip", "App. B.1.2: flips, crops with padding 4"),
    ("cifar10", "ff-growth-rate", 0.25, "App. B.1: 'For Firefly we use a growth rate of 0.25'"),
]


@pytest.mark.parametrize("name,flag,value,where", PAPER_SETTINGS,
                         ids=[f"{n}-{f}" for n, f, _, _ in PAPER_SETTINGS])
def test_config_holds_the_paper_setting(name, flag, value, where):
    for dataset in ("mnist", "cifar10") if name == "both" else (name,):
        config = load_run_config(VISION / f"{dataset}.yaml", check_flags=False)
        assert config.args[flag] == value, (dataset, flag, where)


def test_optimizer_presets_and_firefly_defaults_are_the_papers():
    """App. B.1.2's SGD is the sgd preset; FF keeps Firefly's public code's ε = 1e-2 and K = 70
    candidates ('we keep all the Firefly-specific hyperparameters to the default values')."""
    assert OptimizerSpec.paper_cifar() == OptimizerSpec("sgd", 0.01, 0.9, 1e-4)
    assert OptimizerSpec.paper_mnist() == OptimizerSpec("adadelta", 1.0)
    spec = LearnerSpec("ff")
    assert (spec.ff_epsilon, spec.ff_new_candidates, spec.growth_rate) == (1e-2, 70, 0.25)


def test_grids_hold_the_paper_sweeps():
    mnist = load_run_config(VISION / "mnist.yaml", check_flags=False)  # flags: the test above
    cifar = load_run_config(VISION / "cifar10.yaml", check_flags=False)
    for config, b in ((mnist, 500), (cifar, 100)):
        assert config.grid["vision-width"] == [4, 8, 16, 32, 64]  # §5: sizes "from 4 to 64"
        assert config.grid["replay"] == [False, True]  # §6.1, App. C.2: with and without replay
        assert max(config.grid["wait"]) == b  # the tardy learner, w = B
    assert cifar.grid["wait"] == [2, 10, 100]  # §6.1, Fig. 3
    assert mnist.grid["vision-method"] == ["sm", "ens", "umix", "gens", "gmoe"]
    assert cifar.grid["vision-method"] == ["sm", "ens", "umix", "gens", "gmoe", "ff"]  # §5
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
