"""Run configs and resource profiles: loading, include merging, and the errors users see.

Flag checks parse with the real fairseq-train parser (fairseq imported once per session).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fairseq_alma.errors import UsageError
from fairseq_alma.fairseq_glue.user_dir import PLUGIN_DIR
from fairseq_alma.sweeps import load_profile, load_run_config, parse_grid_option
from fairseq_alma.sweeps.resource_profile import PROFILES_DIR, parse_profile

EXAMPLES = Path(__file__).resolve().parents[1] / "train_configs" / "examples"
BASE = """\
description: base
data: data-bin/x
args:
  task: language_modeling
  arch: transformer_lm
  decoder-layers: 2
  lr: 0.001
  fp16: true
  no-epoch-checkpoints: true
seeds: [1, 2]
resources: local-cpu
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


def error_of(path: Path, check_flags: bool = True) -> str:
    with pytest.raises(UsageError) as caught:
        load_run_config(path, check_flags=check_flags)
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_unknown_top_level_key_names_key_and_file(tmp_path):
    path = write(tmp_path, "run.yaml", BASE + "seed: 3\n")
    message = error_of(path, check_flags=False)
    assert f"{path}: unknown top-level key 'seed'" in message
    assert "seeds" in message  # the allowed keys are listed


def test_unknown_key_in_an_included_file_names_that_file(tmp_path):
    base = write(tmp_path, "base.yaml", BASE + "gird: {lr: [1]}\n")
    child = write(tmp_path, "child.yaml", "include: base.yaml\n")
    assert f"{base}: unknown top-level key 'gird'" in error_of(child, check_flags=False)


def test_include_merges_child_wins_and_null_removes(tmp_path):
    write(tmp_path, "base.yaml", BASE + "grid: {lr: [0.1, 0.2], decoder-layers: [1, 2]}\n")
    child = write(tmp_path, "child.yaml", """\
include: base.yaml
description: child
args: {lr: 0.005, fp16: null, decoder-embed-dim: 16}
grid: {decoder-layers: [3], lr: null}
seeds: [7]
""")
    config = load_run_config(child)
    assert config.description == "child"
    assert config.data == "data-bin/x"  # inherited
    assert config.args == {
        "task": "language_modeling", "arch": "transformer_lm", "decoder-layers": 2,
        "lr": 0.005, "fp16": None, "no-epoch-checkpoints": True, "decoder-embed-dim": 16,
    }
    assert config.grid == {"decoder-layers": [3]}
    assert config.seeds == (7,)
    assert config.sources == (tmp_path / "base.yaml", child)
    assert config.resources == "local-cpu"


def test_to_argv_booleans_overrides_seed_and_save_dir(tmp_path):
    config = load_run_config(write(tmp_path, "run.yaml", BASE.replace("fp16: true", "fp16: false")))
    argv = config.to_argv({"lr": 0.01, "decoder-embed-dim": 8}, 2, "/runs/a")
    assert argv == [
        "data-bin/x", "--user-dir", str(PLUGIN_DIR),
        "--task", "language_modeling", "--arch", "transformer_lm", "--decoder-layers", "2",
        "--lr", "0.01",  # replaced in place
        "--no-epoch-checkpoints",  # true -> bare flag; fp16: false -> left out
        "--decoder-embed-dim", "8",  # new flags follow
        "--seed", "2", "--save-dir", "/runs/a",
    ]


def test_unknown_flag_names_flag_file_and_close_match(tmp_path):
    base = write(tmp_path, "base.yaml", BASE.replace("decoder-layers:", "decoder-layer:"))
    child = write(tmp_path, "child.yaml", "include: base.yaml\nargs: {lr: 0.002}\n")
    message = error_of(child)
    assert message == (
        f"{base}: unknown fairseq-train flag 'decoder-layer'; did you mean 'decoder-layers'?"
    )


def test_flag_of_another_architecture_is_unknown(tmp_path):
    # lstm_lm flags exist in fairseq, but not for transformer_lm: checked per component choice
    path = write(tmp_path, "run.yaml", BASE + "grid: {decoder-hidden-size: [8]}\n")
    message = error_of(path)
    assert "unknown fairseq-train flag 'decoder-hidden-size'" in message
    assert "grid point decoder-hidden-size=8" in message


def test_invalid_choice_gets_a_suggestion(tmp_path):
    path = write(tmp_path, "run.yaml", BASE.replace("transformer_lm", "transformer_lmm"))
    message = error_of(path)
    assert "--arch/-a: invalid choice 'transformer_lmm'; did you mean 'transformer_lm'?" in message


def test_switch_with_a_value_and_value_flag_as_switch(tmp_path):
    path = write(tmp_path, "a.yaml", BASE.replace("fp16: true", "fp16: 1"))
    assert "'fp16' is a switch: write fp16: true or false" in error_of(path)
    path = write(tmp_path, "b.yaml", BASE.replace("lr: 0.001", "lr: true"))
    assert "'lr' takes a value" in error_of(path)


@pytest.mark.parametrize(
    "line, expected",
    [
        ("  seed: 3\n", "'seed' cannot be set here: list seeds under seeds:"),
        ("  --lr: 3\n", "write 'lr', not '--lr'"),
        ("  distributed-world-size: 2\n", "'distributed-world-size' cannot be set here"),
        ("  lr: 0.2\n", "key 'lr' appears twice (first on line 7)"),
        ("  dropout: [0.1, 0.2]\n", "'dropout' must be a single value"),
    ],
)
def test_bad_args_entries(tmp_path, line, expected):
    text = BASE.replace("  no-epoch-checkpoints: true\n", f"  no-epoch-checkpoints: true\n{line}")
    assert expected in error_of(write(tmp_path, "run.yaml", text), check_flags=False)


def test_missing_data_arch_and_include_cycle(tmp_path):
    path = write(tmp_path, "nodata.yaml", BASE.replace("data: data-bin/x\n", ""))
    assert "data: is required" in error_of(path, check_flags=False)
    path = write(tmp_path, "noarch.yaml", BASE.replace("  arch: transformer_lm\n", ""))
    assert "needs an architecture: add 'arch: NAME'" in error_of(path)
    write(tmp_path, "a.yaml", "include: b.yaml\n")
    write(tmp_path, "b.yaml", "include: a.yaml\n")
    assert "include cycle" in error_of(tmp_path / "a.yaml", check_flags=False)
    assert "not found" in error_of(tmp_path / "missing.yaml", check_flags=False)


def test_invalid_yaml_names_the_line(tmp_path):
    path = write(tmp_path, "run.yaml", BASE + "grid: {lr: [1, 2}\n")
    assert f"{path}:12: invalid YAML" in error_of(path, check_flags=False)
    path = write(tmp_path, "key.yaml", BASE + "grid:\n  ? [lr]\n  : [1]\n")
    assert f"{path}:13: invalid YAML (found unhashable key)" in error_of(path, check_flags=False)


def test_values_read_as_written_and_reach_fairseq_unchanged(tmp_path):
    # OmegaConf.load would read 1e-3 and 5e-4 as floats (--lr 0.001) and dates as text; the
    # YAML 1.1 reading keeps the command lines (and run directory names) of existing configs
    args = ("  optimizer: adam\n  lr: 1e-3\n  dropout: .5\n  decoder-embed-dim: 0x10\n"
            "  adam-eps: 1.0e-8\n")
    text = BASE.replace("  lr: 0.001\n", "") + "grid: {weight-decay: [5e-4, 0.01]}\n"
    text = text.replace("  fp16: true\n", args + "  restore-file: ${HOME}/2024-01-01\n"
                        "  tensorboard-logdir: 2024-01-01\n")
    config = load_run_config(write(tmp_path, "run.yaml", text))
    argv = config.to_argv(config.grid_points()[0], 1, "/runs/a")
    shown = " ".join(argv[argv.index("--decoder-layers"):argv.index("--seed")])
    assert shown == (
        "--decoder-layers 2 --optimizer adam --lr 1e-3 --dropout 0.5 --decoder-embed-dim 16 "
        "--adam-eps 1e-08 "
        "--restore-file ${HOME}/2024-01-01 --tensorboard-logdir 2024-01-01 "
        "--no-epoch-checkpoints --weight-decay 5e-4"
    )
    assert parse_grid_option("lr=1e-3,.5,0x10") == ("lr", ["1e-3", 0.5, 16])


def test_merge_errors_name_file_and_key(tmp_path):
    write(tmp_path, "base.yaml", BASE + "grid: {lr: [0.1, 0.2]}\n")
    child = write(tmp_path, "child.yaml", "include: base.yaml\ngrid: {lr: {a: 1}}\n")
    assert error_of(child, check_flags=False) == (
        f"{child}: 'grid.lr' is a mapping here but a list in an included config; write a list"
    )
    path = write(tmp_path, "interp.yaml", BASE.replace("description: base", "description: ${oops"))
    message = error_of(path, check_flags=False)
    assert message.startswith(f"{path}: 'description': ") and "${oops" in message


def test_example_configs_load_and_expand():
    config = load_run_config(EXAMPLES / "tiny_sweep.yaml")
    assert config.grid_points() == [{"decoder-layers": 1}, {"decoder-layers": 2}]
    assert config.args["adam-betas"] == "(0.9, 0.98)"
    assert config.sources[0] == EXAMPLES / "tiny_base.yaml"


def test_shipped_profiles():
    local = load_profile("local-cpu")
    assert (local.device, local.world_size, local.nodes) == ("cpu", 1, 1)
    assert "--signal=B:USR1@60" in local.sbatch_options()
    gpu = load_profile(PROFILES_DIR / "gpu-node-8.yaml")
    assert (gpu.device, gpu.tasks_per_node, gpu.world_size) == ("gpu", 8, 8)
    options = gpu.sbatch_options()
    assert "--gpus-per-node=8" in options and "--ntasks-per-node=8" in options
    assert "--exclusive" in options and "--mem=480G" in options
    assert load_profile("gpu-1").world_size == 1


@pytest.mark.parametrize(
    "data, expected",
    [
        ({"gpus": 8}, "unknown profile key 'gpus'"),
        ({"signal_seconds": 60, "save_grace_seconds": 60}, "must be smaller than signal_seconds"),
        ({"gpus_per_node": 2, "ntasks_per_node": 2}, "ntasks_per_node is for CPU profiles"),
        ({"time": "2 hours"}, "not Slurm syntax"),
        ({"nodes": 0}, "nodes must be an integer >= 1"),
        ({"extra_sbatch": ["exclusive"]}, "extra_sbatch must be a list of sbatch options"),
    ],
)
def test_bad_profiles(data, expected):
    with pytest.raises(UsageError, match=expected):
        parse_profile(data, "p", "p.yaml")


def test_unknown_profile_lists_the_shipped_ones():
    with pytest.raises(UsageError, match="local-cpu"):
        load_profile("no-such-profile")
