"""alma-score on a cluster's terms: --max-eval-tokens scores a fixed, recorded slice of the
evaluation mega-batch (and alma-report refuses to mix slices), --fp16 scores in half precision
on CUDA and is refused on CPU before anything is loaded.

The runs are test_score.py's (a 3-mega-batch stream; two --wait 2 members, one scratch run).
"""

from __future__ import annotations

import json

import pytest
import torch
from test_score import _ppls, _reference_ppl, _score, train_runs

from fairseq_alma.cli.report import main as report_main


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    return train_runs(tmp_path_factory.mktemp("score_cluster"))


def _scoring(json_path) -> dict:
    return json.loads(json_path.read_text())["series"][0]["scoring"]


@pytest.mark.slow
def test_max_eval_tokens_scores_the_first_whole_blocks(stream, tmp_path, capsys):
    """500 tokens of 32-token blocks: blocks 0..14 (480 tokens), for every checkpoint and both
    members; the perplexities are those of those blocks, and the table says so."""
    members = [stream / "ens1", stream / "ens2"]
    code, out, err = _score(capsys, *members, "--mode", "ens", "--max-eval-tokens", "500",
                            "--json", tmp_path / "ens.json")
    assert code == 0, err
    scoring = _scoring(tmp_path / "ens.json")
    assert (scoring["eval_tokens"], scoring["eval_tokens_total"]) == (480, 1505)
    assert (scoring["eval_blocks"], scoring["max_eval_tokens"]) == (15, 500)
    assert all(tokens == 480 for _, tokens in scoring["nll_tokens_by_stage"].values())
    ppls = _ppls(tmp_path / "ens.json")
    trained = _reference_ppl([m / "checkpoint_stage1.pt" for m in members], stream / "data", 15)
    initial = _reference_ppl([m / "checkpoint_stage0.pt" for m in members], stream / "data", 15)
    assert ppls[2] == pytest.approx(trained, rel=1e-5)
    assert ppls[0] == pytest.approx(initial, rel=1e-5)
    assert out.splitlines()[3] == ("perplexity on the first 480 of 1,505 tokens of 'eval' "
                                   "(blocks 0..14 of 48, --max-eval-tokens 500)")


@pytest.mark.slow
def test_max_eval_tokens_beyond_the_split_is_the_whole_split(stream, tmp_path, capsys):
    run_dir = stream / "ens1"
    code, whole_out, err = _score(capsys, run_dir, "--json", tmp_path / "whole.json")
    assert code == 0, err
    code, out, err = _score(capsys, run_dir, "--max-eval-tokens", "100000",
                            "--json", tmp_path / "big.json")
    assert code == 0, err
    assert _ppls(tmp_path / "big.json") == _ppls(tmp_path / "whole.json")
    assert out.splitlines()[:3] == whole_out.splitlines()[:3]
    assert out.splitlines()[3] == ("--max-eval-tokens 100,000 covers the whole 'eval' split "
                                   "(1,505 tokens): every token scored")
    scoring = _scoring(tmp_path / "big.json")
    assert scoring["eval_tokens"] == scoring["eval_tokens_total"] == 1505


@pytest.mark.slow
def test_report_refuses_to_mix_slices(stream, tmp_path, capsys):
    """A table of one slice is labelled with it; a slice next to a whole-split run is refused
    (another run: the same run twice is refused as given twice, whatever its scoring)."""
    run_dir = stream / "ens2"
    code, _, err = _score(capsys, run_dir, "--max-eval-tokens", "256",
                          "--json", tmp_path / "s.json")
    assert code == 0, err
    assert report_main([str(tmp_path / "s.json"), "--out", str(tmp_path / "one")]) == 0
    out = capsys.readouterr().out
    label = "perplexity on the first 256 of 1,505 tokens of the evaluation split"
    assert out.splitlines()[3].startswith(label)
    assert label in (tmp_path / "one" / "table2.md").read_text()
    other_run = stream / "ens1"
    code = report_main([str(tmp_path / "s.json"), str(other_run), "--out", str(tmp_path / "mixed")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "the first 256 of 1,505 tokens" in err[0] and f"{other_run} on every token" in err[0]


@pytest.mark.parametrize("flags, needle", [
    (["--max-eval-tokens", "0"], "--max-eval-tokens must be >= 1 (got 0)"),
    (["--max-eval-tokens", "-3"], "--max-eval-tokens must be >= 1 (got -3)"),
    (["--max-eval-tokens", "1k"], "argument --max-eval-tokens: invalid int value: '1k'"),
    (["--fp16", "--cpu"], "--fp16 needs a CUDA device; drop it to score in fp32 on CPU"),
    (["--from-log", "--max-eval-tokens", "64"], "drop --max-eval-tokens or --from-log"),
])
def test_bad_flags_are_one_line_before_loading(tmp_path, capsys, flags, needle):
    """The run dir does not exist: each flag is refused before any run is read."""
    try:
        code, _, err = _score(capsys, tmp_path / "nowhere", *flags)
    except SystemExit as exc:  # argparse's own errors
        code, err = exc.code, capsys.readouterr().err
    err = err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible to "
                                                          "torch here")
def test_fp16_perplexity_matches_fp32(stream, tmp_path, capsys):
    """Half-precision weights move a perplexity by well under 1% on these models, single and
    Ens alike; the JSON records the precision."""
    members = [stream / "ens1", stream / "ens2"]
    for mode, runs in (("single", members[:1]), ("ens", members)):
        ppls = {}
        for precision in ("fp32", "fp16"):
            flags = ["--fp16"] if precision == "fp16" else []
            path = tmp_path / f"{mode}_{precision}.json"
            code, _, err = _score(capsys, *runs, "--mode", mode, *flags, "--json", path)
            assert code == 0, err
            assert _scoring(path)["precision"] == precision
            ppls[precision] = _ppls(path)
        for half, full in zip(ppls["fp16"], ppls["fp32"], strict=True):
            assert (half is None) == (full is None)
            assert half is None or half == pytest.approx(full, rel=5e-3)
