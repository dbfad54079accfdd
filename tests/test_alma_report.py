"""alma-report on real small runs: a tiny LM stream (2 seeds of SM_w1, SM_w2, SM_w1 with
replay, and an alma-score Ens JSON) and a digits vision sweep (2 seeds, 2 widths, 2 waiting
times, and a replay run).  Each table and figure the command promises is checked, and the
grouping of seeds against the members' own numbers."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from lm_fixtures import prepare_stream, run, tool

from fairseq_alma.stream.records import read_records

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_alma")
LM_FLAGS = (
    "--task alma_stream --arch switch_transformer_lm_tiny --moe-experts 2 --criterion "
    "switch_cross_entropy --optimizer adam --lr 0.003 --lr-scheduler alma_stage_linear "
    "--warmup-updates 2 --updates-per-stage 4 --tokens-per-sample 32 --batch-size 8 --cpu "
    "--num-workers 0 --log-format simple --dropout 0"
).split()


def _parallel(cmds: list[list[str]]) -> None:
    """Start-up bound commands, two at a time (CI has 2 cores)."""
    for start in range(0, len(cmds), 2):
        procs = [(cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True)) for cmd in cmds[start:start + 2]]
        for cmd, proc in procs:
            out, _ = proc.communicate(timeout=600)
            assert proc.returncode == 0, f"{' '.join(cmd)}\n{out[-3000:]}"


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_lm")
    prepare_stream(root, root / "data", num_megabatches=3)
    runs = {"sm_s1": "--seed 1", "sm_s2": "--seed 2", "w2_s1": "--wait 2 --seed 1",
            "replay_s1": "--replay --seed 1"}
    _parallel([[tool("fairseq-train"), str(root / "data"), "--user-dir", USER_DIR, *LM_FLAGS,
                "--save-dir", str(root / "runs" / name), *flags.split()]
               for name, flags in runs.items()])
    run([tool("alma-score"), str(root / "runs" / "sm_s1"), str(root / "runs" / "sm_s2"),
         "--mode", "ens", "--cpu", "--json", str(root / "ens.json")])
    return root


@pytest.fixture(scope="module")
def vision_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report_vision")
    common = ["--num-megabatches", "3", "--epochs-per-stage", "2", "--quiet"]
    _parallel([
        [tool("alma-vision-sweep"), "--out", str(root / "plain"), "--widths", "4", "8",
         "--waits", "1", "2", "--seeds", "1", "2", *common],
        [tool("alma-vision-sweep"), "--out", str(root / "replay"), "--widths", "4",
         "--waits", "2", "--seeds", "1", "--replay", *common],
    ])
    return root


def _report(*argv: str | Path) -> subprocess.CompletedProcess:
    return run([tool("alma-report"), *map(str, argv)], check=False)


def _report_ok(*argv: str | Path, out: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Run alma-report into ``out``; it must succeed. Returns the process and the files written."""
    proc = _report(*argv, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, sorted(p.name for p in out.iterdir())


def _png_with_ink(path: Path) -> tuple[int, int]:
    import matplotlib.image

    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20_000
    pixels = matplotlib.image.imread(str(path))
    assert float(pixels[..., :3].std()) > 0.05
    return pixels.shape[1], pixels.shape[0]


@pytest.mark.slow
def test_lm_report_groups_seeds_and_draws_figures_2_to_5(lm_runs, tmp_path):
    out = tmp_path / "report"
    proc, written = _report_ok(lm_runs / "runs", lm_runs / "ens.json", out=out)
    assert written == [
        "fig3_perplexity_curves.png", "fig4_replay.png", "fig5_tradeoffs.png",
        "table2.csv", "table2.json", "table2.md"]
    assert _png_with_ink(out / "fig5_tradeoffs.png") == (1980, 990)  # 3 panels x 2 rows
    _png_with_ink(out / "fig3_perplexity_curves.png")
    _png_with_ink(out / "fig4_replay.png")
    data = json.loads((out / "table2.json").read_text())
    rows = {(s["setting"], s["num_experts"]): s for s in data["series"]}
    assert sorted(rows) == [("Ens_w1", "2@2"), ("SM_w1", "2"), ("SM_w1 replay", "2"), ("SM_w2", "2")]
    sm = rows[("SM_w1", "2")]
    assert sm["seeds"] == [[1], [2]] and len(sm["members"]) == 2
    members = [read_records(lm_runs / "runs" / name / "stream.jsonl") for name in ("sm_s1", "sm_s2")]
    finals = [records[-1].eval_ppl for records in members]
    assert sm["arrivals"][3]["ppl"] == pytest.approx(statistics.fmean(finals))
    assert sm["arrivals"][3]["ppl_std"] == pytest.approx(statistics.stdev(finals))
    averages = [statistics.fmean(r.eval_ppl for r in records[1:]) for records in members]
    assert sm["summary"]["trained_avg_ppl"] == pytest.approx(statistics.fmean(averages))
    assert sm["summary_std"]["trained_avg_ppl"] == pytest.approx(statistics.stdev(averages))
    # SM_w2 waits: its arrival 1 is charged with the initialised model
    w2 = read_records(lm_runs / "runs" / "w2_s1" / "stream.jsonl")
    anytime = statistics.fmean(math.log2(r.eval_ppl) for r in w2[1:])
    assert rows[("SM_w2", "2")]["summary"]["anytime_nll"] == pytest.approx(anytime)
    assert rows[("SM_w2", "2")]["summary"]["trained_avg_ppl"] < 2 ** anytime
    assert "seeds" not in rows[("SM_w2", "2")]  # one seed: a plain series entry
    table = proc.stdout.splitlines()
    assert table[0].split()[:3] == ["setting", "#experts", "seeds"]
    assert "avg ppl (trained)" in table[0] and "anytime ppl" in table[0]
    sm_line = next(line for line in table if line.startswith("SM_w1  "))
    assert f"{statistics.fmean(averages):.2f} ± {statistics.stdev(averages):.2f}" in sm_line
    markdown = (out / "table2.md").read_text().splitlines()
    assert markdown[0].startswith("| setting") and markdown[1].startswith("|---")
    csv_header = (out / "table2.csv").read_text().splitlines()[0].split(",")
    assert {"seeds", "anytime_nll", "anytime_nll_std", "trained_avg_ppl_std"} <= set(csv_header)


@pytest.mark.slow
def test_no_seed_groups_gives_a_row_per_run(lm_runs, tmp_path):
    proc = _report(lm_runs / "runs", "--out", tmp_path, "--no-seed-groups")
    assert proc.returncode == 0, proc.stderr[-3000:]
    settings = [series["setting"] for series in json.loads((tmp_path / "table2.json").read_text())["series"]]
    assert len(settings) == 4 and len(set(settings)) == 4, settings  # seeds of one setting told apart
    assert any(setting.endswith("[seed=2]") for setting in settings), settings
    assert "seeds" not in proc.stdout.splitlines()[0]
    # a report's own table read again (alma-report report/*.json): its rows are means without
    # their runs, so beside the runs they came from every row would be there twice
    again = _report(lm_runs / "runs", tmp_path / "table2.json", "--out", tmp_path / "again")
    assert again.returncode == 2 and not (tmp_path / "again").exists()
    assert again.stderr.strip().splitlines() == [
        f"alma-report: error: {tmp_path / 'table2.json'}: a table alma-report (or alma-demo) wrote, not an "
        "alma-score --json file; pass the run directories or alma-score --json files it was made from"]


@pytest.mark.slow
def test_a_figure_an_earlier_report_left_in_out_is_removed_and_nothing_else(lm_runs, tmp_path):
    (tmp_path / "fig4_replay.png").write_bytes(b"an earlier report's Fig. 4")
    (tmp_path / "fig3_error_curves_4.png").write_bytes(b"an earlier vision report's")
    (tmp_path / "notes.md").write_text("mine")
    proc, written = _report_ok(lm_runs / "runs" / "sm_s1", out=tmp_path)
    assert "fig4_replay.png" not in written and "fig3_error_curves_4.png" not in written
    assert "removed fig4_replay.png, left in --out by an earlier report" in proc.stdout
    assert (tmp_path / "notes.md").read_text() == "mine" and "table2.json" in written


@pytest.mark.slow
def test_vision_report_draws_figures_2_3_4_with_error_bars(vision_runs, tmp_path):
    out = tmp_path / "report"
    proc, written = _report_ok(vision_runs / "plain", vision_runs / "replay", out=out)
    assert written == [
        "cer_table.csv", "cer_table.json", "cer_table.md", "fig2_cer_tradeoffs.png",
        "fig3_error_curves_mlp4.png", "fig3_error_curves_mlp8.png", "fig4_replay.png"]
    for png in out.glob("*.png"):
        _png_with_ink(png)
    data = json.loads((out / "cer_table.json").read_text())
    groups = {(s["setting"], s["num_experts"]): s for s in data["series"]}
    assert sorted(groups) == [("sm_w1", "mlp4"), ("sm_w1", "mlp8"), ("sm_w2", "mlp4"),
                              ("sm_w2", "mlp8"), ("sm_w2 replay", "mlp4")]
    assert all(len(g.get("seeds", [None])) == (1 if "replay" in key[0] else 2)
               for key, g in groups.items())
    one = groups[("sm_w2", "mlp8")]
    cers = [sum(r.test_error for r in read_records(Path(run) / "stream.jsonl"))
            for run in one["runs"]]
    assert one["summary"]["cer"] == pytest.approx(statistics.fmean(cers))
    assert one["summary_std"]["cer"] == pytest.approx(statistics.stdev(cers))


@pytest.mark.slow
def test_vision_scores_keep_their_fingerprint_and_an_unfinished_run_is_refused(vision_runs, tmp_path):
    """alma-score --from-log of vision runs: the JSON keeps each run's fingerprint (so its
    seeds group as their directories do), and a run stopped part-way is refused, not printed
    as a finished stream of a smaller B (CER 4.880 for a B = 10 run at arrival 5)."""
    jsons = []
    for seed in (1, 2):
        jsons.append(tmp_path / f"s{seed}.json")
        run([tool("alma-score"), str(vision_runs / "plain" / f"sm_mlp4_w1_s{seed}"), "--from-log",
             "--json", str(jsons[-1])])
        assert json.loads(jsons[-1].read_text())["series"][0]["scoring"]["fingerprints"][0]
    _, written = _report_ok(*jsons, out=tmp_path / "r")
    (row,) = json.loads((tmp_path / "r" / "cer_table.json").read_text())["series"]
    assert row["seeds"] == [[1], [2]]
    part = tmp_path / "part"
    shutil.copytree(vision_runs / "plain" / "sm_mlp4_w1_s1", part)
    lines = (part / "stream.jsonl").read_text().splitlines(keepends=True)
    (part / "stream.jsonl").write_text("".join(lines[:2]))
    refused = run([tool("alma-score"), str(part), "--from-log"], check=False)
    assert refused.returncode == 2 and "training not finished: arrivals 0..1 of B = 3" in refused.stderr


@pytest.mark.parametrize("case, needle", [
    ("missing", "no such file or directory"),
    ("not_a_run", "neither a run directory"),
    ("bad_json", "not an alma-score --json file"),
    ("twice", "is given twice"),
])
def test_bad_input_is_one_line(tmp_path, case, needle):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.json").write_text('{"series": 3}')
    argv = {"missing": [tmp_path / "nowhere"], "not_a_run": [tmp_path / "empty"],
            "bad_json": [tmp_path / "bad.json"],
            "twice": [tmp_path / "bad.json", tmp_path / "bad.json"]}[case]
    proc = _report(*argv, "--out", tmp_path / "out")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("alma-report: error:") and needle in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_lm_and_vision_runs_are_not_mixed(lm_runs, vision_runs, tmp_path):
    proc = _report(lm_runs / "runs" / "sm_s1", vision_runs / "replay", "--out", tmp_path / "o")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "sm_s1 (perplexity, B = 3) and " in proc.stderr and "(test error, B = 3) are not one stream" in proc.stderr, proc.stderr


def test_help_lists_the_figures():
    proc = run([tool("alma-report"), "--help"])
    for figure in ("fig2_cer_tradeoffs.png", "fig3_error_curves", "fig4_replay.png",
                   "fig5_tradeoffs.png", "table2.md", "anytime"):
        assert figure in proc.stdout


@pytest.mark.slow
def test_an_unfinished_run_is_refused_naming_what_is_missing(lm_runs, tmp_path):
    """A run stopped after stage 1 of 3 is not published as a shorter stream (alone, or next
    to a finished seed): one line naming the missing arrivals and how to finish it."""
    import shutil

    stopped = tmp_path / "stopped"
    shutil.copytree(lm_runs / "runs" / "sm_s2", stopped)
    lines = (stopped / "stream.jsonl").read_text().splitlines(keepends=True)
    (stopped / "stream.jsonl").write_text("".join(lines[:2]))
    for argv in ([stopped], [lm_runs / "runs" / "sm_s1", stopped]):
        proc = _report(*argv, "--out", tmp_path / "out")
        errors = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(errors) == 1, proc.stderr
        assert "training not finished: arrivals 0..1 of B = 3 (arrivals 2..3 missing)" in errors[0]
        assert "run the same training command again" in errors[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_numbers_obtained_differently_are_never_one_row(lm_runs, tmp_path):
    """Seeds scored on another split are two rows that say so; a run given as its directory and
    as its own alma-score JSON is refused; different updates per stage never share a name."""
    runs = lm_runs / "runs"
    run([tool("alma-score"), str(runs / "sm_s2"), "--subset", "valid", "--cpu", "--json",
         str(tmp_path / "valid.json")])
    proc, _ = _report_ok(runs / "sm_s1", tmp_path / "valid.json", out=tmp_path / "split")
    rows = {s["setting"] for s in json.loads((tmp_path / "split" / "table2.json").read_text())["series"]}
    assert rows == {"SM_w1 [split=eval]", "SM_w1 [split=valid]"}, rows
    proc, _ = _report_ok(tmp_path / "valid.json", out=tmp_path / "valid_only")
    note = "perplexity on split 'valid' (the validation set), not on the evaluation mega-batch 'eval'"
    assert note in proc.stdout and note in (tmp_path / "valid_only" / "table2.md").read_text()
    run([tool("alma-score"), str(runs / "sm_s1"), "--cpu", "--json", str(tmp_path / "own.json")])
    proc = _report(runs / "sm_s1", tmp_path / "own.json", "--out", tmp_path / "twice")
    assert proc.returncode == 2 and "is given twice" in proc.stderr and "own.json" in proc.stderr
    longer = tmp_path / "u6"
    run([tool("fairseq-train"), str(lm_runs / "data"), "--user-dir", USER_DIR, *LM_FLAGS, "--seed", "1",
         "--updates-per-stage", "6", "--save-dir", str(longer)])
    proc, _ = _report_ok(runs / "sm_s1", longer, out=tmp_path / "budget")
    rows = {s["setting"] for s in json.loads((tmp_path / "budget" / "table2.json").read_text())["series"]}
    assert len(rows) == 2 and all(row.startswith("SM_w1 [") for row in rows), rows
    assert sorted("config.task.updates_per_stage=4" in row for row in rows) == [False, True]
    assert sorted("config.task.updates_per_stage=6" in row for row in rows) == [False, True]


def test_a_score_json_keeps_what_it_scored(lm_runs, tmp_path):
    """An alma-score JSON is read long after it was written: it keeps the runs' fingerprints
    and the stream's identity (a run directory trained again since, or data moved, lent the
    JSON's numbers another run's settings, or made every row's name a list of data keys); an
    Ens is the set of its members, whatever their order; seeds of one setting are disjoint."""
    from dataclasses import replace

    from fairseq_alma.report.inputs import read_score_json
    from fairseq_alma.report.seeds import SeedGroup

    runs = lm_runs / "runs"
    copy = tmp_path / "copy_s1"
    shutil.copytree(runs / "sm_s1", copy)
    run([tool("alma-score"), str(copy), "--cpu", "--json", str(tmp_path / "copy.json")])
    shutil.rmtree(copy)  # gone: the JSON alone says what it scored
    proc, _ = _report_ok(tmp_path / "copy.json", runs / "sm_s2", out=tmp_path / "kept")
    rows = json.loads((tmp_path / "kept" / "table2.json").read_text())["series"]
    assert [(r["setting"], r["seeds"]) for r in rows] == [("SM_w1", [[1], [2]])], rows
    # a JSON from before the identity was kept, whose stream is gone: one line, not a row name
    old = json.loads((tmp_path / "copy.json").read_text())
    for entry in old["series"]:
        entry["scoring"].pop("data_identity")
        entry["scoring"]["settings"]["data"] = str(tmp_path / "moved")
    (tmp_path / "old.json").write_text(json.dumps(old))
    proc = _report(tmp_path / "old.json", "--out", tmp_path / "old")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "old.json: the stream it was scored on cannot be read" in proc.stderr
    run([tool("alma-score"), str(runs / "sm_s2"), str(runs / "sm_s1"), "--mode", "ens", "--cpu",
         "--json", str(tmp_path / "ens21.json")])
    proc = _report(lm_runs / "ens.json", tmp_path / "ens21.json", "--out", tmp_path / "twice")
    assert proc.returncode == 2 and "is given twice" in proc.stderr, proc.stderr
    ens = read_score_json(lm_runs / "ens.json")[0]
    other = replace(ens, source="other.json:Ens_w1", runs=(ens.runs[0], "/elsewhere/s3"))
    with pytest.raises(ValueError, match=r"share the run .*sm_s1, so they are not independent"):
        SeedGroup([ens, other])


@pytest.mark.slow
def test_one_anytime_number_everywhere(lm_runs, tmp_path):
    """anytime_ppl = 2 ** anytime_nll in the CSV and the JSON, for single runs and for seed
    groups, whose anytime_nll is the mean of each seed's, recomputed here from stream.jsonl."""
    import csv

    out = tmp_path / "report"
    _report_ok(lm_runs / "runs", out=out)
    data = json.loads((out / "table2.json").read_text())
    with open(out / "table2.csv", newline="") as handle:
        table = {(row["setting"], row["num_experts"]): row for row in csv.DictReader(handle)}
    for series in data["series"]:
        summary = series["summary"]
        assert summary["anytime_ppl"] == pytest.approx(2 ** summary["anytime_nll"], rel=1e-12)
        row = table[(series["setting"], series["num_experts"])]
        assert float(row["anytime_ppl"]) == pytest.approx(2 ** float(row["anytime_nll"]), rel=1e-12)
        assert float(row["anytime_nll"]) == pytest.approx(summary["anytime_nll"], rel=1e-12)
        assert series["arrivals"][-1]["anytime_nll_so_far"] == pytest.approx(summary["anytime_nll"])
    group = next(s for s in data["series"] if s["setting"] == "SM_w1")
    per_seed = [statistics.fmean(math.log2(r.eval_ppl) for r in read_records(Path(run) / "stream.jsonl")[1:])
                for run in group["runs"]]
    assert group["summary"]["anytime_nll"] == pytest.approx(statistics.fmean(per_seed))
    assert group["summary_std"]["anytime_nll"] == pytest.approx(statistics.stdev(per_seed))
    assert group["summary_std"]["anytime_ppl"] is None  # its spread is anytime_nll's, in bits


@pytest.mark.slow
def test_a_umix_run_is_named_umix_by_report_and_score(lm_runs, tmp_path):
    """A UMix LM trains with the stream flags of any SM run; named from those flags alone, both
    tools tabulated it as 'SM_w1' (alma-score also as 2 experts, alma-report as 2@2)."""
    umix = tmp_path / "umix"
    flags = [*LM_FLAGS, "--seed", "1", "--save-dir", str(umix)]
    flags[flags.index("switch_transformer_lm_tiny")] = "umix_switch_transformer_lm_tiny"
    run([tool("fairseq-train"), str(lm_runs / "data"), "--user-dir", USER_DIR, *flags, "--umix-members", "2"])
    _report_ok(lm_runs / "runs" / "sm_s1", umix, out=tmp_path / "report")
    rows = {(s["setting"], s["num_experts"])
            for s in json.loads((tmp_path / "report" / "table2.json").read_text())["series"]}
    assert rows == {("SM_w1", "2"), ("UMix_w1", "2@2")}, rows
    scored = run([tool("alma-score"), str(umix), "--from-log", "--json", str(tmp_path / "umix.json")])
    series = json.loads((tmp_path / "umix.json").read_text())["series"][0]
    assert (series["setting"], series["num_experts"]) == ("UMix_w1", "2@2"), scored.stdout


FAIRSEQ_FREE = """
import sys
sys.argv = {argv!r}
from {module} import main
try:
    status = main(sys.argv[1:])
except SystemExit as exit_:
    status = exit_.code
heavy = sorted(name for name in ("fairseq", "torch") if name in sys.modules)
print("status", status, "imported", heavy)
"""


@pytest.mark.slow
def test_report_and_sweep_status_start_without_fairseq(lm_runs, tmp_path):
    """alma-report and alma-sweep status read records only: importing torch and fairseq took 3-4 s
    of every call (fairseq_alma.FAIRSEQ_FREE_TOOLS); the report they draw is the same.
    alma-data-prep --help and alma-score --help answer before their import of fairseq too."""
    cases = [(["alma-report", str(lm_runs / "runs" / "sm_s1"), "--out", str(tmp_path / "r")], "fairseq_alma.cli.report"),
             (["alma-sweep", "status", "--help"], "fairseq_alma.cli.sweep"),
             (["alma-data-prep", "--help"], "data_prep.cli"),  # these two import fairseq once their
             (["alma-score", "--help"], "fairseq_alma.cli.score")]  # flags parsed
    for argv, module in cases:
        proc = subprocess.run([sys.executable, "-c", FAIRSEQ_FREE.format(argv=argv, module=module)],
                              capture_output=True, text=True, timeout=120)
        assert proc.stdout.splitlines()[-1] == "status 0 imported []", proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = json.loads((tmp_path / "r" / "table2.json").read_text())["series"]
    assert [(s["setting"], s["num_experts"]) for s in rows] == [("SM_w1", "2")]
