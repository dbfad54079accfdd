"""Stock fairseq CLIs with the plugin (issue #2): train, eval-lm, one-line errors on bad flags."""

import re
from pathlib import Path

import pytest
import torch
from lm_fixtures import run, tool

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_alma")


def train_cmd(data: Path, save_dir: Path, *extra: str) -> list[str]:
    return [
        tool("fairseq-train"), str(data), "--user-dir", USER_DIR, "--task", "language_modeling",
        "--arch", "switch_transformer_lm_tiny", "--criterion", "switch_cross_entropy",
        "--moe-experts", "4", "--optimizer", "adam", "--lr", "0.005", "--lr-scheduler", "inverse_sqrt",
        "--warmup-updates", "5", "--tokens-per-sample", "32", "--batch-size", "16", "--cpu",
        "--save-dir", str(save_dir), "--log-format", "simple", "--log-interval", "5", "--seed", "1",
        "--dropout", "0.0", "--num-workers", "0", *extra,
    ]


@pytest.mark.slow
def test_train_then_eval_lm(tiny_lm_bin, tmp_path):
    proc = run(train_cmd(tiny_lm_bin, tmp_path / "ckpt", "--max-update", "40"))
    out = proc.stdout + proc.stderr
    losses = [float(x) for x in re.findall(r"\| train_inner \|.*?loss=([0-9.]+)", out)]
    assert len(losses) >= 6, out[-2000:]
    assert losses[-1] < losses[0] - 1.0, losses  # loss decreases
    for key in ("moe_balance", "moe_dropped_pct", "moe_entropy", "moe_load_max", "moe_load_min", "moe_unused"):
        assert f"{key}=" in out, key
    assert re.search(r"shared \+ [0-9.]+M per expert x 4 experts", out)
    ckpt = tmp_path / "ckpt" / "checkpoint_last.pt"
    assert ckpt.exists()

    valid_loss = float(re.findall(r"\| valid \|.*?\| loss ([0-9.]+)", out)[-1])
    ev = run([tool("fairseq-eval-lm"), str(tiny_lm_bin), "--user-dir", USER_DIR, "--path", str(ckpt),
              "--gen-subset", "valid", "--tokens-per-sample", "32", "--batch-size", "16", "--cpu"],
             fresh=True)
    # logged as fairseq_cli meant: INFO in its format on stdout (fairseq's import had left
    # DEBUG, hydra's lines included, in Python's default format on stderr)
    m = re.search(r"\| INFO \| fairseq_cli.eval_lm \| Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)",
                  ev.stdout)
    assert m and not ev.stderr.strip(), ev.stderr[-2000:]
    # the criterion's reported loss is the cross-entropy alone, so it matches eval-lm (same data,
    # same blocks, no capacity limit at evaluation)
    assert float(m.group(1)) == pytest.approx(valid_loss, abs=0.01)

    # a checkpoint as written before format versions were recorded (no decoder.version) still
    # loads strictly through fairseq's own loader and scores the same
    state = torch.load(ckpt, weights_only=False)
    del state["model"]["decoder.version"]
    legacy = tmp_path / "legacy.pt"
    torch.save(state, legacy)
    ev = run([tool("fairseq-eval-lm"), str(tiny_lm_bin), "--user-dir", USER_DIR, "--path", str(legacy),
              "--gen-subset", "valid", "--tokens-per-sample", "32", "--batch-size", "16", "--cpu"])
    legacy_m = re.search(r"Loss \(base 2\): ([0-9.]+)", ev.stdout + ev.stderr)
    assert legacy_m and legacy_m.group(1) == m.group(1), ev.stderr[-2000:]


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--moe-experts", "0"], "--moe-experts must be an integer >= 1"),
        (["--capacity-factor", "0"], "--capacity-factor must be > 0"),
        (["--eval-capacity-factor", "-1"], "--eval-capacity-factor must be > 0"),
        (["--moe-freq", "0"], "--moe-freq must be an integer >= 1"),
        (["--criterion", "cross_entropy"], "--criterion cross_entropy ignores the Switch balance loss"),
    ],
)
def test_bad_flags_give_one_line_errors(tiny_lm_bin, tmp_path, flags, needle):
    proc = run(train_cmd(tiny_lm_bin, tmp_path / "ckpt", "--max-update", "1", *flags), check=False)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
    assert len(errors) == 1 and needle in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
