"""alma-score --matrix and its alma-report figure (issue 14, item 2: time-stratified evaluation).

One tiny 3-mega-batch stream with a held-out slice of every mega-batch (``evalmb{k}``, made by
the real ``alma-data-prep --eval-per-megabatch 0.1``), three real trainings
(SM_w1 with seeds 1 and 2, SM_w2), scored once by the real alma-score with --matrix.  Each cell
is checked against an independent scoring loop (and one against stock fairseq-eval-lm), the
summaries against hand computations from the matrix, alma-report's table and heatmap against
the per-seed matrices, and the refusals are one line each.
"""

from __future__ import annotations

import csv
import json
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from lm_fixtures import USER_DIR, prepare_stream, run, tool

from fairseq_alma.cli import report as report_cli
from fairseq_alma.cli import score as score_cli
from fairseq_alma.stream.period_matrix import PeriodMatrix
from fairseq_alma.stream.records import read_records

FLAGS = ("--task alma_stream --arch switch_transformer_lm_tiny --moe-experts 2 --criterion "
         "switch_cross_entropy --optimizer adam --lr 0.003 --lr-scheduler alma_stage_linear "
         "--warmup-updates 2 --updates-per-stage 4 --tokens-per-sample 32 --batch-size 8 --cpu "
         "--num-workers 0 --log-format simple --dropout 0").split()
RUNS = {"w1_s1": "--seed 1", "w1_s2": "--seed 2", "w2": "--wait 2 --seed 1"}


@pytest.fixture(scope="module")
def stream(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("matrix")
    prepare_stream(root, root / "plain", num_megabatches=3)  # the same stream without period splits
    prepare_stream(root, root / "data", num_megabatches=3, extra=("--eval-per-megabatch", "0.1"))
    cmds = [[tool("fairseq-train"), str(root / "data"), "--user-dir", USER_DIR, *FLAGS,
             "--save-dir", str(root / name), *flags.split()] for name, flags in RUNS.items()]
    for start in range(0, len(cmds), 2):  # two at a time: CI has 2 cores
        procs = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)) for cmd in cmds[start:start + 2]]
        try:
            for cmd, proc in procs:
                out, _ = proc.communicate(timeout=600)
                assert proc.returncode == 0, f"{' '.join(cmd)}\n{out[-3000:]}"
        finally:  # a failed or timed-out fixture leaves no training behind
            for _, proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
    scored = run([tool("alma-score"), *(str(root / name) for name in RUNS), "--matrix", "--cpu",
                  "--json", str(root / "all.json")])
    (root / "all.txt").write_text(scored.stdout)
    return root


def _matrix(stream: Path, index: int, name: str = "all.json") -> dict:
    return json.loads((stream / name).read_text())["series"][index]["eval_matrix"]


def _reference_ppl(checkpoint: Path, data: Path, split: str, blocks: int | None = None) -> float:
    """exp(mean NLL) of one checkpoint over the split's blocks (the first ``blocks``), collated
    here in index order, 5 at a time, in float64: independent of alma-score's batching."""
    from fairseq import checkpoint_utils

    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [str(checkpoint)], arg_overrides={"data": str(data)})
    model = models[0].eval()
    task.load_dataset(split)
    dataset, pad = task.dataset(split), task.target_dictionary.pad()
    end = len(dataset) if blocks is None else blocks
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, end, 5):
            batch = dataset.collater([dataset[i] for i in range(start, min(start + 5, end))])
            lprobs = torch.log_softmax(model(**batch["net_input"])[0].double(), dim=-1)
            target = batch["target"]
            mask = target.ne(pad)
            nll -= lprobs.gather(-1, target.unsqueeze(-1)).squeeze(-1)[mask].sum().item()
            count += int(mask.sum())
    return math.exp(nll / count)


@pytest.mark.slow
def test_cells_equal_independent_scoring_and_fairseq_eval_lm(stream):
    matrix = _matrix(stream, 0)
    assert (matrix["rows"], matrix["arrivals"], matrix["periods"]) == ([1, 2, 3], [1, 2, 3],
                                                                       [1, 2, 3])
    assert matrix["new_periods"] == [[1], [2], [3]]
    manifest = json.loads((stream / "data" / "manifest.json").read_text())
    assert matrix["eval_tokens"] == [manifest["splits"][f"evalmb{k}"]["tokens"] for k in range(3)]
    assert matrix["eval_per_megabatch"] == manifest["eval_per_megabatch"]
    for r, stage in enumerate(matrix["rows"]):
        for p in matrix["periods"]:
            expected = _reference_ppl(stream / "w1_s1" / f"checkpoint_stage{stage}.pt",
                                      stream / "data", f"evalmb{p - 1}")
            assert matrix["ppl"][r][p - 1] == pytest.approx(expected, rel=1e-5), (stage, p)
            assert matrix["nll_bits"][r][p - 1] == pytest.approx(math.log2(expected), rel=1e-6)
    # the cells differ: not one number copied around (the table's eval split is another split)
    assert len({round(v, 6) for row in matrix["ppl"] for v in row}) == 9
    stock = run([tool("fairseq-eval-lm"), str(stream / "data"), "--user-dir", USER_DIR, "--path",
                 str(stream / "w1_s1" / "checkpoint_stage2.pt"), "--gen-subset", "evalmb0",
                 "--tokens-per-sample", "32", "--batch-size", "8", "--cpu", "--num-workers", "0"])
    printed = float(re.search(r"Perplexity: ([0-9.]+)", stock.stdout + stock.stderr).group(1))
    assert matrix["ppl"][1][0] == pytest.approx(printed, rel=0.005)
    # the Table 2 series is scored as without --matrix: stream.jsonl's numbers
    series = json.loads((stream / "all.json").read_text())["series"][0]
    logged = [r.eval_ppl for r in read_records(stream / "w1_s1" / "stream.jsonl")]
    for arrival in series["arrivals"][1:]:
        assert arrival["ppl"] == pytest.approx(logged[arrival["arrival"]], rel=1e-6)


@pytest.mark.slow
def test_summaries_equal_hand_computations(stream):
    w1, w2 = _matrix(stream, 0), _matrix(stream, 2)
    b = w1["nll_bits"]  # rows = stages 1..3 (arrivals 1..3), columns = periods 1..3
    hand = {"in_period": ((b[0][0] + b[1][1] + b[2][2]) / 3, [1, 2, 3]),
            "backward": ((b[1][0] + (b[2][0] + b[2][1]) / 2) / 2, [2, 3]),
            "forward": ((b[0][1] + b[1][2]) / 2, [1, 2])}
    for name, (bits, rows) in hand.items():
        got = w1["summary"][name]
        assert got["nll_bits"] == pytest.approx(bits, rel=1e-12) and got["rows"] == rows
        assert got["ppl"] == pytest.approx(2 ** bits, rel=1e-12)
    # --wait 2, B = 3: one stage at arrival 2, trained on periods 1 and 2; period 3 never
    assert (w2["rows"], w2["arrivals"], w2["new_periods"]) == ([1], [2], [[1, 2]])
    c = w2["nll_bits"]
    assert w2["summary"]["in_period"]["ppl"] == pytest.approx(2 ** ((c[0][0] + c[0][1]) / 2))
    assert w2["summary"]["backward"] == {"nll_bits": None, "ppl": None, "rows": []}
    assert w2["summary"]["forward"]["ppl"] == pytest.approx(w2["ppl"][0][2], rel=1e-12)
    text = (stream / "all.txt").read_text()
    assert re.search(r"^\s+2\s+2\s+" + re.escape(f"{w1['ppl'][1][0]:.2f}") + r"\s+"
                     + re.escape(f"[{w1['ppl'][1][1]:.2f}]"), text, re.M)
    assert f"backward ppl {w1['summary']['backward']['ppl']:.2f} (rows 2, 3; excluded 1: " \
           f"no older period)" in text
    assert "backward ppl n/a (rows none; excluded 1: no older period)" in text


def test_summary_definitions_on_a_longer_stream():
    """B = 5, --wait 2: stages at arrivals 2 and 4, period 5 never trained on."""
    bits = [[1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0]]
    summary = PeriodMatrix([1, 2], [2, 4], bits).summary()
    assert summary["in_period"]["nll_bits"] == ((1 + 2) / 2 + (8 + 9) / 2) / 2
    assert summary["backward"]["nll_bits"] == (6 + 7) / 2 and summary["backward"]["rows"] == [2]
    assert summary["forward"]["nll_bits"] == (3 + 10) / 2 and summary["forward"]["rows"] == [1, 2]
    assert summary["forward"]["ppl"] == 2 ** 6.5
    with pytest.raises(ValueError, match="must increase"):
        PeriodMatrix([1, 2], [3, 3], bits)


@pytest.mark.slow
def test_max_eval_tokens_scores_the_first_blocks_of_every_period(stream):
    assert score_cli.main([str(stream / "w2"), "--matrix", "--cpu", "--max-eval-tokens", "300",
                           "--json", str(stream / "sliced.json")]) == 0
    matrix = _matrix(stream, 0, "sliced.json")
    assert matrix["max_eval_tokens"] == 300
    for p in matrix["periods"]:
        blocks = matrix["eval_blocks"][p - 1]
        assert 0 < matrix["eval_tokens"][p - 1] <= 300 < matrix["eval_tokens_total"][p - 1]
        expected = _reference_ppl(stream / "w2" / "checkpoint_stage1.pt", stream / "data",
                                  f"evalmb{p - 1}", blocks)
        assert matrix["ppl"][0][p - 1] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_report_draws_heatmap_and_summary_over_seeds(stream, tmp_path, capsys):
    out = tmp_path / "report"
    result = run([tool("alma-report"), str(stream / "all.json"), "--out", str(out)])
    assert (out / "fig_eval_matrix.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    seeds = [_matrix(stream, 0), _matrix(stream, 1)]
    with open(out / "eval_matrix.csv", newline="") as fh:
        rows = {row["setting"]: row for row in csv.DictReader(fh)}
    assert set(rows) == {"SM_w1", "SM_w2"} and rows["SM_w1"]["seeds"] == "2"
    for name in ("in_period", "backward", "forward"):
        values = [m["summary"][name]["ppl"] for m in seeds]
        assert float(rows["SM_w1"][f"{name}_ppl"]) == pytest.approx(sum(values) / 2, rel=1e-12)
        assert float(rows["SM_w1"][f"{name}_ppl_std"]) == pytest.approx(
            abs(values[0] - values[1]) / math.sqrt(2), rel=1e-9)
    assert rows["SM_w2"]["backward_ppl"] == ""
    groups = {g["setting"]: g for g in json.loads((out / "eval_matrix.json").read_text())["groups"]}
    assert groups["SM_w1"]["ppl"][2][0] == pytest.approx(
        (seeds[0]["ppl"][2][0] + seeds[1]["ppl"][2][0]) / 2, rel=1e-12)
    markdown = (out / "eval_matrix.md").read_text()
    assert "in-period ppl |" in markdown and "SM_w2" in markdown
    assert "in-period ppl" in result.stdout and "fig_eval_matrix.png" in result.stdout
    helped = report_cli.build_parser().format_help()  # what alma-report --help prints
    assert "fig_eval_matrix.png" in helped and "eval_matrix.md" in helped
    # a seed group where one seed has no matrix is refused, not averaged over the others
    data = json.loads((stream / "all.json").read_text())
    del data["series"][1]["eval_matrix"]
    (tmp_path / "partial.json").write_text(json.dumps(data))
    capsys.readouterr()
    assert report_cli.main([str(tmp_path / "partial.json"), "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("alma-report: error: ") and "has no eval matrix" in err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "r2").exists()  # a refused report creates nothing ...
    before = {path.name: path.read_bytes() for path in out.iterdir()}
    assert report_cli.main([str(tmp_path / "partial.json"), "--out", str(out)]) == 2
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before  # ... nor overwrites


@pytest.mark.slow
def test_refusals_are_one_line(stream, capsys):
    capsys.readouterr()
    from fairseq_alma.errors import DataError
    from fairseq_alma.lm.score_matrix import check_period_splits

    # plain is another stream (its mega-batches keep the documents w2's data holds out as
    # periods): refused as data w2 was not trained on, before the period splits are looked for
    code = score_cli.main([str(stream / "w2"), "--matrix", "--cpu", "--data", str(stream / "plain")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("alma-score: error: ") and len(err.strip().splitlines()) == 1, err
    assert str(stream / "plain") in err and "score it on the stream it was trained on" in err
    with pytest.raises(DataError, match="alma-data-prep --eval-per-megabatch SIZE"):
        check_period_splits(str(stream / "plain"), 3)  # a run trained on plain asking --matrix
    for flags in (["--mode", "ens", str(stream / "w1_s2")], ["--from-log"]):
        assert score_cli.main([str(stream / "w1_s1"), "--matrix", "--cpu", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith("alma-score: error: --matrix") and err.count("\n") == 1, err


@pytest.mark.slow
def test_two_gloo_ranks_give_the_same_matrix(stream, tmp_path):
    """Data-parallel --matrix: each rank scores its share of every period's batches; rank 0's
    matrix equals the one-process one to the last bit (every batch's float64 sums are added in
    one process's order), rank 1 writes nothing."""
    from test_score_distributed import _two_ranks

    ranks = _two_ranks([str(stream / "w2"), "--matrix", "--cpu"],
                       lambda rank: tmp_path / f"rank{rank}.json")
    for rank, (code, _, err) in enumerate(ranks):
        assert code == 0, f"rank {rank}:\n{err[-3000:]}"
    assert ranks[1][1] == "" and not (tmp_path / "rank1.json").exists()
    assert "p1" in ranks[0][1] and "in_period ppl" in ranks[0][1]
    assert _matrix(tmp_path, 0, "rank0.json") == _matrix(stream, 2)


@pytest.mark.slow
def test_a_missing_or_truncated_period_split_is_named(stream, tmp_path):
    from fairseq_alma.errors import DataError
    from fairseq_alma.lm.score_matrix import check_period_splits

    data = tmp_path / "data"
    shutil.copytree(stream / "data", data)
    assert check_period_splits(str(data), 3)["eval_per_megabatch"] == "0.1"
    with open(data / "evalmb1.bin", "r+b") as fh:
        fh.truncate(10)
    with pytest.raises(DataError, match=r"evalmb1\.bin: 10 bytes, the manifest says \d+"):
        check_period_splits(str(data), 3)
    manifest = json.loads((data / "manifest.json").read_text())
    del manifest["splits"]["evalmb2"]
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=f"{data} lacks evalmb2 of the per-mega-batch"):
        check_period_splits(str(data), 3)
