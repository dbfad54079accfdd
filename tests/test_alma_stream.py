"""alma_stream task, first slice of issue #3: stages, fixed budget, LR restarts, per-arrival records,
stage checkpoints loadable by fairseq-eval-lm, one-line errors for bad stream flags."""

import json
import re
from pathlib import Path

import pytest

from fairseq_alma.optim.alma_stage_linear import stage_budget, stage_lr
from lm_fixtures import run, sentences, tool

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_alma")


def test_stage_lr_restarts_every_stage():
    budget, warmup, peak = 10, 2, 1.0
    lrs = [stage_lr(u % budget, budget, warmup, peak) for u in range(2 * budget)]
    assert lrs[0] == pytest.approx(0.5) and lrs[1] == pytest.approx(1.0)
    assert lrs[9] == pytest.approx(1 / 8)  # last update of the stage, one step above 0
    assert lrs[10:] == lrs[:10]  # the next stage restarts with warmup
    assert stage_budget(100, 3, True) == 300 and stage_budget(100, 3, False) == 100


@pytest.fixture(scope="module")
def stream_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    lines = sentences(1200, seed=7)
    docs = ["\n".join(lines[i : i + 4]) for i in range(0, len(lines), 4)]
    (root / "corpus.txt").write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    run([tool("alma-data-prep"), str(root / "corpus.txt"), "--out", str(root / "data"), "--vocab-size", "400",
         "--num-megabatches", "2", "--eval-size", "0.1", "--valid-size", "0.05", "--workers", "1"])
    return root / "data"


def stream_cmd(data: Path, save_dir: Path, *extra: str) -> list[str]:
    return [
        tool("fairseq-train"), str(data), "--user-dir", USER_DIR, "--task", "alma_stream",
        "--arch", "switch_transformer_lm_tiny", "--moe-experts", "2", "--criterion", "switch_cross_entropy",
        "--optimizer", "adam", "--lr", "0.003", "--lr-scheduler", "alma_stage_linear", "--warmup-updates", "2",
        "--updates-per-stage", "6", "--tokens-per-sample", "32", "--batch-size", "8", "--cpu", "--num-workers", "0",
        "--save-dir", str(save_dir), "--log-format", "simple", "--log-interval", "2", "--seed", "1", "--dropout", "0",
        *extra,
    ]


@pytest.mark.slow
def test_stream_records_and_stage_checkpoints(stream_dir, tmp_path):
    save = tmp_path / "run"
    proc = run(stream_cmd(stream_dir, save))
    out = proc.stdout + proc.stderr
    records = [json.loads(line) for line in (save / "stream.jsonl").read_text().splitlines()]
    assert [r["arrival"] for r in records] == [0, 1, 2]
    assert [r["trained"] for r in records] == [False, True, True]
    assert [r["stage"] for r in records] == [0, 1, 2]
    assert records[0]["train_flops_cum"] == 0 < records[1]["train_flops_cum"] < records[2]["train_flops_cum"]
    assert records[2]["eval_ppl"] < records[0]["eval_ppl"]
    # exactly the budget per stage: 2 stages x 6 updates
    assert re.search(r"num_updates 12\b", out)
    for stage in (1, 2):
        ckpt = save / f"checkpoint_stage{stage}.pt"
        assert ckpt.exists()
    ev = run([tool("fairseq-eval-lm"), str(stream_dir), "--user-dir", USER_DIR, "--path", str(save / "checkpoint_stage2.pt"),
              "--gen-subset", "eval", "--tokens-per-sample", "32", "--batch-size", "8", "--cpu", "--num-workers", "0"])
    ppl = float(re.search(r"Perplexity: ([0-9.]+)", ev.stdout + ev.stderr).group(1))
    assert ppl == pytest.approx(records[2]["eval_ppl"], rel=0.005)


@pytest.mark.parametrize("flags, needle", [(["--wait", "3"], "--wait must be in [1, 2]"),
                                           (["--updates-per-stage", "0"], "--updates-per-stage must be >= 1")])
def test_bad_stream_flags(stream_dir, tmp_path, flags, needle):
    proc = run(stream_cmd(stream_dir, tmp_path / "bad", *flags), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
    assert proc.returncode != 0 and len(errors) == 1 and needle in errors[0], proc.stderr[-1500:]


def test_missing_shard_is_named(stream_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(stream_dir, broken)
    (broken / "megabatch1.bin").unlink()
    proc = run(stream_cmd(broken, tmp_path / "bad"), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
    assert proc.returncode != 0 and len(errors) == 1 and "megabatch1.bin" in errors[0], proc.stderr[-1500:]
