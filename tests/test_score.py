"""alma-score (issue 3, item 5): single-model stream perplexity agrees with fairseq-eval-lm and with
stream.jsonl; Ens and gEns average member probabilities (checked against a hand computation in
probability space); Table 2 layout, JSON/CSV/PNG outputs; one-line errors for bad input.

One tiny 3-mega-batch stream, three real trainings made once for the module: two members of an
Ens with --wait 2 (seeds 1 and 2: '*' at t0, stage 1 repeated at t2) and one --stage-init scratch
run with --wait 1 (three gEns members).
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from lm_fixtures import prepare_stream, run, tool

from fairseq_alma.cli.score import main
from fairseq_alma.errors import UsageError
from fairseq_alma.stream.records import ArrivalRecord, read_records, write_records

REPO = Path(__file__).resolve().parent.parent
USER_DIR = str(REPO / "fairseq_alma")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


TRAIN_FLAGS = shlex.split(
    "--task alma_stream --arch switch_transformer_lm_tiny --moe-experts 2 --criterion "
    "switch_cross_entropy --optimizer adam --lr 0.003 --lr-scheduler alma_stage_linear "
    "--warmup-updates 2 --updates-per-stage 4 --tokens-per-sample 32 --batch-size 8 --cpu "
    "--num-workers 0 --log-format simple --dropout 0"
)


def _parallel(cmds: list[list[str]]) -> list[tuple[int, str, str]]:
    """Run commands side by side (they are start-up bound): (exit status, stdout, stderr)."""
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        for c in cmds
    ]
    return [(p.wait(timeout=600), *p.communicate()) for p in procs]


def train_runs(root: Path) -> Path:
    """The module's stream and its three runs (module doc), under ``root``."""
    prepare_stream(root, root / "data", num_megabatches=3)
    runs = {"ens1": "--wait 2 --seed 1", "ens2": "--wait 2 --seed 2",
            "scratch": "--stage-init scratch --seed 3"}
    cmds = [[tool("fairseq-train"), str(root / "data"), "--user-dir", USER_DIR, *TRAIN_FLAGS,
             "--save-dir", str(root / name), *flags.split()] for name, flags in runs.items()]
    for cmd, (code, out, err) in zip(cmds, _parallel(cmds), strict=True):
        assert code == 0, f"{' '.join(cmd)} failed:\n{(out + err)[-3000:]}"
    return root


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    return train_runs(tmp_path_factory.mktemp("score"))


def _score(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _ppls(json_path: Path, index: int = 0) -> list[float | None]:
    return [a["ppl"] for a in json.loads(json_path.read_text())["series"][index]["arrivals"]]


_MODELS: dict[str, tuple] = {}


def _reference_ppl(checkpoints: list[Path], data: Path, blocks: int | None = None) -> float:
    """exp(mean NLL) of the members' averaged probabilities, in probability space (float64), over
    the eval blocks (the first ``blocks`` of them) collated in index order — independent of
    alma-score's batching and log-space averaging."""
    from fairseq import checkpoint_utils

    members = []
    for path in checkpoints:
        if str(path) not in _MODELS:
            models, _, task = checkpoint_utils.load_model_ensemble_and_task(
                [str(path)], arg_overrides={"data": str(data)})
            task.load_dataset("eval")
            pad = task.target_dictionary.pad()
            _MODELS[str(path)] = (models[0].eval(), task.dataset("eval"), pad)
        members.append(_MODELS[str(path)])
    dataset, pad = members[0][1], members[0][2]
    end = len(dataset) if blocks is None else blocks
    nll, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, end, 8):
            indices = range(start, min(start + 8, end))
            batch = dataset.collater([dataset[i] for i in indices])
            probs = [torch.softmax(model(**batch["net_input"])[0].double(), dim=-1)  # (B, T, V)
                     for model, _, _ in members]
            average = torch.stack(probs).mean(dim=0)  # (B, T, V)
            target = batch["target"]
            p_target = average.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            mask = target.ne(pad)
            nll -= p_target[mask].log().sum().item()
            count += int(mask.sum())
    return math.exp(nll / count)


def _eval_lm(stream: Path, checkpoint: Path) -> list[str]:
    return [tool("fairseq-eval-lm"), str(stream / "data"), "--user-dir", USER_DIR, "--path",
            str(checkpoint), "--gen-subset", "eval",
            *shlex.split("--tokens-per-sample 32 --batch-size 8 --cpu --num-workers 0")]


def _stock_ppl(result: tuple[int, str, str]) -> float:
    code, out, err = result
    assert code == 0, err[-3000:]
    return float(re.search(r"Perplexity: ([0-9.]+)", out + err).group(1))


@pytest.mark.slow
def test_single_matches_fairseq_eval_lm_and_writes_outputs(stream, tmp_path):
    run_dir, out = stream / "ens1", tmp_path / "out"
    score_cmd = [tool("alma-score"), str(run_dir), "--json", str(out / "s.json"),
                 "--csv", str(out / "s.csv"), "--plot", str(out / "s.svg")]
    (code, score_out, score_err), *stock = _parallel([
        score_cmd, _eval_lm(stream, run_dir / "checkpoint_stage1.pt"),
        _eval_lm(stream, run_dir / "checkpoint_stage0.pt")])
    assert code == 0, score_err[-3000:]
    trained, initial = (_stock_ppl(result) for result in stock)
    ppls = _ppls(out / "s.json")
    # --wait 2: arrivals 0 and 1 are answered by the initialised model (checkpoint_stage0.pt,
    # a fairseq checkpoint stock tools load), charged by the anytime metric
    assert ppls[0] == ppls[1] == pytest.approx(initial, rel=0.005)
    assert ppls[1] == pytest.approx(read_records(run_dir / "stream.jsonl")[1].eval_ppl, rel=1e-6)
    assert ppls[2] == pytest.approx(trained, rel=0.005)  # the acceptance criterion
    assert ppls[3] == ppls[2]  # arrival 3 trains nothing: stage 1 answers again
    row = next(line for line in score_out.splitlines() if line.startswith("SM_w2"))
    anytime = 2 ** ((math.log2(ppls[1]) + 2 * math.log2(ppls[2])) / 3)
    assert row.split() == ["SM_w2", "2", "0.11M", "*", f"{ppls[2]:.2f}", f"{ppls[2]:.2f}",
                           f"{ppls[2]:.2f}", f"{anytime:.2f}", *row.split()[-2:]]
    assert "checkpoint 2/2" in score_err and "tokens/s" in score_err
    csv_lines = (out / "s.csv").read_text().splitlines()
    assert csv_lines[0].startswith("setting,num_experts,params,ppl_t0,ppl_t1,ppl_t2,"
                                   "trained_avg_ppl,anytime_nll,anytime_ppl,")
    assert csv_lines[1].split(",")[3] == "" and float(csv_lines[1].split(",")[4]) == ppls[2]
    scoring = json.loads((out / "s.json").read_text())["series"][0]["scoring"]
    assert scoring["untrained_arrivals"].startswith("evaluated: checkpoint_stage0.pt")
    assert b"<svg" in (out / "s.svg").read_bytes()[:1000]  # the format its extension names


@pytest.mark.slow
def test_runs_without_an_initial_checkpoint(stream, tmp_path, capsys):
    """A run written before checkpoint_stage0.pt existed: the run's own evaluation reuses the
    logged arrival-0 perplexity (the same number); any other --subset or an Ens leaves the
    anytime metric undefined and says why, never a guess."""
    old = _without(stream, tmp_path, "ens1", drop="checkpoint_stage0.pt")
    code, out, err = _score(capsys, old, "--json", tmp_path / "own.json")
    assert code == 0, err
    own = json.loads((tmp_path / "own.json").read_text())["series"][0]
    assert own["scoring"]["untrained_arrivals"].startswith("stream.jsonl")
    assert own["summary"]["anytime_ppl"] is not None and err.count("checkpoint ") == 1
    code, out, err = _score(capsys, old, "--subset", "valid", "--json", tmp_path / "valid.json")
    valid = json.loads((tmp_path / "valid.json").read_text())["series"][0]
    assert code == 0 and valid["summary"]["anytime_ppl"] is None and valid["arrivals"][1]["ppl"] is None
    assert "no checkpoint_stage0.pt" in err and "anytime_nll is undefined" in err
    assert "n/a" in out.splitlines()[2]


@pytest.mark.slow
def test_from_log_equals_evaluation(stream, tmp_path, capsys):
    """Also: two seeds of one setting are told apart in the table and the CSV by their run
    directories, while the JSON keeps the setting's name (alma-report groups seeds by it)."""
    runs = [stream / "ens1", stream / "ens2", stream / "scratch"]
    code, out, _ = _score(capsys, *runs, "--json", tmp_path / "eval.json", "--csv", tmp_path / "eval.csv")
    assert code == 0
    shown = [line.split("  ")[0] for line in out.splitlines()[2:4]]
    assert shown == [f"SM_w2 [{runs[0]}]", f"SM_w2 [{runs[1]}]"], out
    assert [line.split(",")[0] for line in (tmp_path / "eval.csv").read_text().splitlines()[1:3]] == shown
    settings = [s["setting"] for s in json.loads((tmp_path / "eval.json").read_text())["series"]]
    assert settings == ["SM_w2", "SM_w2", "SM_w1 (scratch init)"]  # alma-report's names
    assert _score(capsys, *runs, "--from-log", "--json", tmp_path / "log.json")[0] == 0
    for i, run_dir in enumerate(runs):
        evaluated, logged = _ppls(tmp_path / "eval.json", i), _ppls(tmp_path / "log.json", i)
        # arrival 0 is evaluated only where the initial model answers later arrivals (--wait 2)
        assert [v is None for v in evaluated] == [run_dir.name == "scratch", False, False, False]
        assert None not in logged
        for a, b in zip(evaluated, logged):
            assert a is None or a == pytest.approx(b, rel=1e-6)
        records = read_records(run_dir / "stream.jsonl")
        assert logged == [r.eval_ppl for r in records]


@pytest.mark.slow
def test_ens_averages_member_probabilities(stream, tmp_path, capsys):
    members = [stream / "ens1", stream / "ens2"]
    code, out, err = _score(capsys, *members, "--mode", "ens", "--json", tmp_path / "ens.json")
    assert code == 0, err
    series = json.loads((tmp_path / "ens.json").read_text())["series"][0]
    ppls = [a["ppl"] for a in series["arrivals"]]
    expected = _reference_ppl([m / "checkpoint_stage1.pt" for m in members], stream / "data")
    assert ppls[2] == pytest.approx(expected, rel=1e-5) and ppls[3] == ppls[2]
    # arrivals 0-1 (--wait 2): the ensemble of the members' initialised models
    initial = _reference_ppl([m / "checkpoint_stage0.pt" for m in members], stream / "data")
    assert ppls[0] == ppls[1] == pytest.approx(initial, rel=1e-5)
    member_ppl = [read_records(m / "stream.jsonl")[2].eval_ppl for m in members]
    assert ppls[2] < max(member_ppl)
    records = [read_records(m / "stream.jsonl") for m in members]
    assert series["num_experts"] == "2@2" and series["setting"] == "Ens_w2"
    summed = [sum(r[t].params_active for r in records) for t in range(4)]
    assert [a["params"] for a in series["arrivals"]] == summed
    assert series["arrivals"][3]["train_flops_cum"] == sum(r[3].train_flops_cum for r in records)
    assert out.splitlines()[2].split()[:4] == ["Ens_w2", "2@2", "0.22M", "*"]  # under the rule
    assert err.count("checkpoint ") == 4  # each member's two checkpoints scored once


@pytest.mark.slow
def test_gens_arrival_t_uses_members_1_to_t(stream, tmp_path, capsys):
    run_dir = stream / "scratch"
    code, _, err = _score(capsys, run_dir, "--mode", "gens", "--json", tmp_path / "g.json")
    assert code == 0, err
    series = json.loads((tmp_path / "g.json").read_text())["series"][0]
    assert series["setting"] == "gEns_w1"  # its members are scratch-initialised by definition
    arrivals = series["arrivals"]
    stages = [run_dir / f"checkpoint_stage{s}.pt" for s in (1, 2, 3)]
    records = read_records(run_dir / "stream.jsonl")
    for t in (1, 2, 3):
        assert arrivals[t]["members"] == [str(p) for p in stages[:t]]
        assert arrivals[t]["params"] == t * records[t].params_active
    # one member is the stage-1 model itself; then members 1..t, averaged in probability space
    assert arrivals[1]["ppl"] == pytest.approx(records[1].eval_ppl, rel=1e-6)
    for t in (2, 3):
        expected = _reference_ppl(stages[:t], stream / "data")
        assert arrivals[t]["ppl"] == pytest.approx(expected, rel=1e-5)
    assert series["num_experts"] == "2@3" and series["setting"] == "gEns_w1"
    assert err.count("checkpoint ") == 3  # three members, each evaluated once


def test_sweep_dir_stands_for_its_runs(stream, tmp_path, capsys):
    """alma-sweep's --sweep-dir holds run dirs next to jobs.json: passing it scores each run."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "jobs.json").write_text("{}")
    for name in ("ens2", "ens1"):
        (sweep / name).symlink_to(stream / name)
    code, out, err = _score(capsys, sweep, "--from-log", "--json", tmp_path / "s.json")
    assert code == 0, err
    runs = [s["scoring"]["runs"] for s in json.loads((tmp_path / "s.json").read_text())["series"]]
    assert runs == [[str(sweep / "ens1")], [str(sweep / "ens2")]] and len(out.splitlines()) == 4


def _other_stream_member(stream: Path, tmp_path: Path) -> Path:
    """A copy of ens1 as if trained on a 2-mega-batch stream (its data's manifest says B = 2)."""
    data2 = tmp_path / "data2"
    data2.mkdir()
    manifest = json.loads((stream / "data" / "manifest.json").read_text())
    (data2 / "manifest.json").write_text(json.dumps(manifest | {"num_megabatches": 2}))
    member = tmp_path / "b2"
    member.mkdir()
    state = torch.load(stream / "ens1" / "checkpoint_stage1.pt", weights_only=False)
    state["cfg"]["task"]["data"] = str(data2)
    torch.save(state, member / "checkpoint_stage1.pt")
    write_records(member / "stream.jsonl", read_records(stream / "ens1" / "stream.jsonl")[:3])
    return member


def _without(stream: Path, tmp_path: Path, run_name: str, drop: str = "",
             keep_records: int = 0) -> Path:
    """A copy of a run dir with one file deleted, or its stream.jsonl cut short."""
    copy = tmp_path / run_name
    shutil.copytree(stream / run_name, copy)
    if drop:
        (copy / drop).unlink()
    if keep_records:
        write_records(copy / "stream.jsonl", read_records(copy / "stream.jsonl")[:keep_records])
    return copy


def _swapped_stages(stream: Path, tmp_path: Path) -> Path:
    """A copy of the scratch run with checkpoint_stage1.pt and checkpoint_stage2.pt swapped."""
    copy = _without(stream, tmp_path, "scratch")
    one, two = copy / "checkpoint_stage1.pt", copy / "checkpoint_stage2.pt"
    one.rename(copy / "swap.pt")
    two.rename(one)
    (copy / "swap.pt").rename(two)
    return copy


def _flipped_eval(stream: Path, tmp_path: Path) -> Path:
    """A copy of the stream with one bit of its evaluation split flipped (sizes unchanged)."""
    data = tmp_path / "flipped"
    shutil.copytree(stream / "data", data)
    raw = bytearray((data / "eval.bin").read_bytes())
    raw[100] ^= 1
    (data / "eval.bin").write_bytes(bytes(raw))
    return data


def _last_as_stage(stream: Path, tmp_path: Path) -> Path:
    """A copy of the scratch run with checkpoint_last.pt copied over checkpoint_stage1.pt."""
    copy = _without(stream, tmp_path, "scratch")
    shutil.copy(copy / "checkpoint_last.pt", copy / "checkpoint_stage1.pt")
    return copy


def _averaged_stage(stream: Path, tmp_path: Path) -> Path:
    """A copy of the scratch run whose checkpoint_stage1.pt holds the average of its stages 1
    and 2, as fairseq's scripts/average_checkpoints.py writes it: the first input's file, its
    ``alma`` stamp included, with the averaged tensors (integers floor-divided)."""
    copy = _without(stream, tmp_path, "scratch")
    first = torch.load(copy / "checkpoint_stage1.pt", weights_only=False)
    second = torch.load(copy / "checkpoint_stage2.pt", weights_only=False)
    for key, value in first["model"].items():
        total = value + second["model"][key]
        first["model"][key] = total / 2 if total.is_floating_point() else total // 2
    torch.save(first, copy / "checkpoint_stage1.pt")
    return copy


def _rebuilt_data(stream: Path, tmp_path: Path) -> Path:
    """A copy of the stream whose evaluation split is another (as another --eval-size makes)."""
    data = tmp_path / "rebuilt"
    shutil.copytree(stream / "data", data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["splits"]["eval"]["documents"] += 1
    (data / "manifest.json").write_text(json.dumps(manifest))
    return data


@pytest.mark.parametrize("case, needle", [
    ("no_log", "stream.jsonl: missing"),
    ("swapped_stages", "checkpoint_stage1.pt: holds the model of stage 2, not of stage 1"),
    ("flipped_eval", "eval.bin: sha256 differs from"),
    ("last_as_stage", "checkpoint_stage1.pt: not the model this run kept for stage 1 (no stage stamp"),
    ("averaged_stage", "checkpoint_stage1.pt: not the model this run kept for stage 1 (its weights "
                       "differ from the digest training stamped on it"),
    ("other_data", "was trained with other data (splits differ) than"),
    ("ens_copies", "have the same fingerprint and seed (1)"),
    ("from_log_data", "drop --data or --from-log"),
    ("json_in_run", "stream.jsonl: inside the run directory"),
    ("csv_in_run", "run.json: inside the run directory"),
    ("same_output", "--csv {tmp}/o.json: also given to --json"),
    ("unwritable_output", "--json /proc/o.json: cannot write in /proc"),
    ("gens_continue", "--stage-init scratch"),
    ("ens_other_b", "has B = 2 mega-batches but"),
    ("missing_checkpoint", "checkpoint_stage1.pt: missing (stage 1, trained at arrival 2)"),
    ("unfinished", "training not finished: arrivals 0..2 of B = 3 (arrival 3 missing)"),
    ("from_log_ens", "--from-log works with --mode single only"),
])
def test_bad_input_is_one_line(stream, tmp_path, capsys, case, needle):
    argv = {
        "no_log": lambda: [tmp_path],
        "gens_continue": lambda: [stream / "ens1", "--mode", "gens"],
        "ens_other_b": lambda: [stream / "ens1", _other_stream_member(stream, tmp_path),
                                "--mode", "ens"],
        "missing_checkpoint": lambda: [_without(stream, tmp_path, "ens1",
                                                drop="checkpoint_stage1.pt")],
        "unfinished": lambda: [_without(stream, tmp_path, "scratch", keep_records=3)],
        "from_log_ens": lambda: [stream / "ens1", stream / "ens2", "--mode", "ens", "--from-log"],
        "swapped_stages": lambda: [_swapped_stages(stream, tmp_path)],
        "last_as_stage": lambda: [_last_as_stage(stream, tmp_path)],
        "averaged_stage": lambda: [_averaged_stage(stream, tmp_path)],
        "flipped_eval": lambda: [stream / "ens1", "--data", _flipped_eval(stream, tmp_path)],
        "other_data": lambda: [stream / "ens1", "--data", _rebuilt_data(stream, tmp_path)],
        "ens_copies": lambda: [stream / "ens1", _without(stream, tmp_path, "ens1"), "--mode", "ens"],
        "from_log_data": lambda: [stream / "ens1", "--from-log", "--data", stream / "data"],
        "json_in_run": lambda: [stream / "ens1", "--from-log", "--json", stream / "ens1/stream.jsonl"],
        "csv_in_run": lambda: [stream / "ens1", "--from-log", "--csv", stream / "ens1/run.json"],
        "same_output": lambda: [stream / "ens1", "--from-log", "--json", tmp_path / "o.json",
                                "--csv", tmp_path / "o.json"],
        "unwritable_output": lambda: [stream / "ens1", "--from-log", "--json", "/proc/o.json"],
    }[case]()
    before = _snapshot(stream / "ens1")
    code, out, err = _score(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("alma-score: error:")
    assert needle.format(tmp=tmp_path) in lines[0], lines[0]
    assert _snapshot(stream / "ens1") == before  # nothing of the run overwritten


def test_stage_checkpoints_stamped_before_the_weights_digest_still_score(stream, tmp_path, capsys):
    """Stage checkpoints carry the digest of their weights (``lm/stage_checkpoints``); those
    written before it existed (a stamp without ``weights_sha256``) score as they did."""
    from fairseq_alma.lm.stage_checkpoints import WEIGHTS_DIGEST_KEY, weights_digest

    copy = _without(stream, tmp_path, "scratch")
    flags = ["--max-eval-tokens", "64"]
    code, stamped, err = _score(capsys, copy, *flags)
    assert code == 0, err
    for path in sorted(copy.glob("checkpoint_stage*.pt")):
        state = torch.load(path, weights_only=False)
        assert state["alma"][WEIGHTS_DIGEST_KEY] == weights_digest(state["model"])
        del state["alma"][WEIGHTS_DIGEST_KEY]
        torch.save(state, path)
    code, unstamped, err = _score(capsys, copy, *flags)
    assert code == 0, err
    assert unstamped == stamped


def test_ens_members_differ_only_by_seed():
    """Ens members share run.json's fingerprint but the seed (alma-report's rule); execution
    settings (the expert kernel) may differ.  Unit level: no checkpoint is read."""
    from types import SimpleNamespace

    from omegaconf import OmegaConf

    from fairseq_alma.errors import UsageError
    from fairseq_alma.scoring.runs import _check_ens_seeds

    def member(name: str, seed: int, updates: int = 4, kernel: str = "loop",
               run_json: bool = True, **growth: str) -> SimpleNamespace:
        config = {"common": {"seed": seed}, "task": {"updates_per_stage": updates, "wait": 1, **growth},
                  "model": {"moe_expert_kernel": kernel}}
        return SimpleNamespace(path=Path(name), cfg=OmegaConf.create(config), records=[None] * 4,
                               fingerprint={"config": config, "data": {"seed": 1, "num_megabatches": 3}}
                               if run_json else None)

    _check_ens_seeds([member("a", 1), member("b", 2, kernel="grouped")])  # accepted
    with pytest.raises(UsageError, match=r"--mode ens: b differs from a in more than the seed "
                                         r"\(config.task.updates_per_stage: 4 -> 8\)"):
        _check_ens_seeds([member("a", 1), member("b", 2, updates=8)])
    with pytest.raises(UsageError, match=r"a and b have the same fingerprint and seed \(1\)"):
        _check_ens_seeds([member("a", 1), member("b", 1)])
    # fairseq-alma 0.1 (no run.json): compared by the stage checkpoints' configs
    _check_ens_seeds([member("a", 1), member("old", 3, run_json=False)])
    with pytest.raises(UsageError, match=r"old differs from a in more than the seed "
                                         r"\(config.task.updates_per_stage: 4 -> 8\)"):
        _check_ens_seeds([member("a", 1), member("old", 3, updates=8, run_json=False)])
    # one growth plan spelled two ways is one setting (3 stages: 2 = 2,2 at stages 2,3)
    for run_json in (True, False):
        _check_ens_seeds([member("a", 1, grow_experts="2,2"),
                          member("b", 2, grow_experts="2", grow_at_stages="2,3", run_json=run_json)])
    with pytest.raises(UsageError, match=r"b differs from a in more than the seed "
                                         r"\(config.task.grow_experts: '2,2' -> '2,1'\)"):
        _check_ens_seeds([member("a", 1, grow_experts="2"), member("b", 2, grow_experts="2,1")])


def test_data_copied_elsewhere_scores_with_data(stream, tmp_path, capsys):
    """The data check compares what the stream is, not where: a copy of the run's stream
    passed with --data scores as the original does."""
    copy = tmp_path / "copy"
    shutil.copytree(stream / "data", copy)
    flags = ["--max-eval-tokens", "64"]
    code, original, err = _score(capsys, stream / "ens1", *flags)
    assert code == 0, err
    code, copied, err = _score(capsys, stream / "ens1", *flags, "--data", copy)
    assert code == 0, err
    assert copied == original


def _with_task_setting(stream: Path, tmp_path: Path, run_name: str, **task: object) -> Path:
    """A copy of a run whose stage checkpoints say they were trained with other task settings."""
    copy = _without(stream, tmp_path, run_name)
    for path in copy.glob("checkpoint_stage*.pt"):
        state = torch.load(path, weights_only=False)
        state["cfg"]["task"].update(task)
        torch.save(state, path)
    return copy


def test_each_run_is_scored_with_its_own_task_whatever_the_order(stream, tmp_path, capsys):
    """Several runs in one call: each checkpoint's model and evaluation blocks come from its
    own config.  One task shared across the call scored a run trained with --sample-break-mode
    eos on the first run's blocks (205.28 after another run, 189.55 alone)."""
    eos = _with_task_setting(stream, tmp_path, "scratch", sample_break_mode="eos")
    flags = ["--max-eval-tokens", "96"]
    alone = {}
    for run_dir in (stream / "scratch", eos):
        code, _, err = _score(capsys, run_dir, *flags, "--json", tmp_path / "alone.json")
        assert code == 0, err
        alone[run_dir] = _ppls(tmp_path / "alone.json")
    assert alone[eos] != alone[stream / "scratch"]  # other blocks: the case means something
    for order in ((stream / "scratch", eos), (eos, stream / "scratch")):
        code, _, err = _score(capsys, *order, *flags, "--json", tmp_path / "both.json")
        assert code == 0, err
        assert [_ppls(tmp_path / "both.json", i) for i in range(2)] == [alone[r] for r in order]
    # an ensemble averages token by token: members cut into other blocks are refused (Ens
    # members differ only by their seed, run.json says; this is the scorer's own guard)
    from fairseq_alma.lm.ensemble_eval import CheckpointScorer, EvalSettings
    settings = EvalSettings(str(stream / "data"), "eval", 32, 8, max_eval_tokens=96)
    with pytest.raises(UsageError, match=r"cuts the evaluation data into other blocks than .*"
                                         r"--sample-break-mode none vs eos"):
        CheckpointScorer(False, 2).score_members(
            [str(stream / "scratch" / "checkpoint_stage1.pt"), str(eos / "checkpoint_stage1.pt")],
            settings)


def test_unknown_mode_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["somewhere", "--mode", "moe"])
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1
    assert "--mode" in err[0] and "invalid choice" in err[0]


def test_console_script_exits_2_without_traceback(tmp_path):
    cmd = [tool("alma-score"), str(tmp_path / "nowhere"), "--mode", "ens", str(tmp_path)]
    proc = run(cmd, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    expected = f"RUN_DIR {tmp_path / 'nowhere'}: not a directory; pass an alma_stream --save-dir"
    assert proc.stderr.strip().splitlines() == [f"alma-score: error: {expected}"]


def test_from_log_renders_vision_streams(tmp_path, capsys):
    """Vision sweeps write the same records with test_error: --from-log shows their CER (Eq. 1)."""
    run_dir = tmp_path / "sm_mlp8_w1_s1"
    errors = [0.9, 0.5, 0.3]
    extra = {"method": "sm", "arch": "mlp", "width": 8, "wait": 1, "replay": False}
    write_records(run_dir / "stream.jsonl", [
        ArrivalRecord(arrival=t, stage=t, trained=t > 0, megabatches_seen=t, params_active=100,
                      train_flops_cum=1e9 * t, infer_flops_per_image=10.0, wall_time=1.0,
                      test_error=error, extra=extra)
        for t, error in enumerate(errors)])
    code, out, err = _score(capsys, run_dir, "--from-log", "--csv", tmp_path / "v.csv")
    assert code == 0, err
    row = out.splitlines()[2].split()  # header, rule, first row
    assert row[:2] == ["sm_w1", "mlp8"] and float(row[4]) == pytest.approx(sum(errors))  # CER 1.7
    assert (tmp_path / "v.csv").read_text().splitlines()[1].startswith("sm_w1,mlp8,100,0.9,0.5,0.3")


def test_runs_of_other_stream_lengths_are_refused_before_scoring(tmp_path, capsys):
    """The table refused them only after every checkpoint was scored (hours on large models)."""
    extra = {"method": "sm", "arch": "mlp", "width": 8, "wait": 1, "replay": False}
    for name, errors in (("b2", [0.9, 0.5, 0.3]), ("b3", [0.9, 0.5, 0.3, 0.2])):
        write_records(tmp_path / name / "stream.jsonl", [
            ArrivalRecord(arrival=t, stage=t, trained=t > 0, megabatches_seen=t, params_active=100,
                          train_flops_cum=1e9 * t, infer_flops_per_image=10.0, wall_time=1.0,
                          test_error=error, extra=extra)
            for t, error in enumerate(errors)])
    code, _, err = _score(capsys, tmp_path / "b2", tmp_path / "b3", "--from-log")
    assert code == 2 and "(test error, B = 2) and" in err and "(test error, B = 3) are not one " \
        "stream's results; score them separately" in err


def _snapshot(directory: Path) -> dict[str, tuple[int, int, str]]:
    import hashlib

    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(directory.iterdir())}


@pytest.mark.slow
def test_scoring_changes_nothing_in_the_run_dir(stream, tmp_path, capsys):
    """alma-score and fairseq-eval-lm only read a run dir: a stream still training there keeps its
    in-flight checkpoint temporaries, and no signal handler is taken from the scoring process."""
    import signal

    run_dir = tmp_path / "live"
    shutil.copytree(stream / "ens1", run_dir)
    (run_dir / "checkpoint_last.pt.tmp").write_bytes(b"half a checkpoint")  # fairseq's own
    (run_dir / ".checkpoint_stage2.pt.x1y2.tmp").write_bytes(b"half a copy")  # ours
    before = _snapshot(run_dir)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGUSR1, signal.SIGTERM)}
    assert _score(capsys, run_dir, "--json", tmp_path / "s.json")[0] == 0
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    run([tool("fairseq-eval-lm"), str(stream / "data"), "--user-dir", USER_DIR, "--path",
         str(run_dir / "checkpoint_stage1.pt"), "--gen-subset", "eval", "--tokens-per-sample", "32",
         "--batch-size", "8", "--cpu", "--num-workers", "0"])
    assert _snapshot(run_dir) == before


def test_blocks_the_model_cannot_take_are_refused_not_left_out(stream):
    """fairseq's batches for scoring leave blocks longer than the model's positions out with a
    warning; every scorer (stage-end evaluation, alma-score, growth) refuses them instead, naming
    the split. A real checkpoint told it has 8 positions, on the eval split's 32-token blocks."""
    from fairseq import checkpoint_utils

    from fairseq_alma.errors import UsageError
    from fairseq_alma.lm.nll import Batching, total_nll

    checkpoint = str(stream / "ens1" / "checkpoint_stage1.pt")
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [checkpoint], arg_overrides={"data": str(stream / "data"), "max_target_positions": 8})
    task.load_dataset("eval")
    dataset = task.dataset("eval")
    too_long = int((dataset.sizes > 8).sum())
    assert too_long > 0
    with pytest.raises(UsageError, match=rf"^{too_long:,} of the {len(dataset):,} blocks of eval are "
                                         r"longer than the model's 8 positions \(up to 32 tokens\)"):
        total_nll(models[0], task, dataset, Batching(8))


def test_fairseq_eval_lm_refuses_a_token_scored_minus_infinity(stream, tmp_path):
    """fairseq-eval-lm leaves tokens scored ±inf out of its perplexity ("skipping tokens with inf
    scores"); with the plugin it refuses them. A real checkpoint whose output logit for the eval
    split's most frequent token is below float32's range (-1e39): its final layer norm is made to
    output 1e21 along one axis, on which that token's embedding is -1e18 and every other's small."""
    import numpy as np
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    eval_tokens = np.asarray(MMapIndexedDataset(str(stream / "data" / "eval"))[0])
    token = int(np.bincount(eval_tokens).argmax())
    state = torch.load(stream / "ens1" / "checkpoint_stage1.pt", weights_only=False)
    weights = state["model"]
    weights["decoder.layer_norm.weight"].zero_()
    weights["decoder.layer_norm.bias"].zero_()[0] = 1e21
    weights["decoder.embed_tokens.weight"][:, 0].clamp_(-0.2, 0.2)[token] = -1e18
    torch.save(state, tmp_path / "inf.pt")
    result = subprocess.run(_eval_lm(stream, tmp_path / "inf.pt"), capture_output=True, text=True,
                            env=ENV, timeout=300)
    assert result.returncode == 2, result.stderr[-3000:]
    assert re.search(r"fairseq-alma: error: [\d,]+ tokens? of a batch score an infinite log-probability "
                     r".*fairseq-eval-lm would leave them out of the perplexity", result.stderr), result.stderr[-3000:]
    assert "Perplexity" not in result.stdout + result.stderr


def test_a_loss_that_is_not_a_number_is_explained_by_the_weights():
    """The stage-end measurement and alma-score refuse a NaN/inf loss (a NaN perplexity in a
    table) with its cause: NaN or infinite weights (counted), or finite weights whose
    log-probabilities overflow; in half precision they say so."""
    from fairseq_alma.lm.nll import non_finite_loss

    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    assert non_finite_loss(12.5, model) is None
    assert non_finite_loss(float("inf"), model) == (
        "its loss is inf although its weights are finite: a log-probability overflows")
    with torch.no_grad():
        model[1].weight[0, :2] = float("nan")
        model[0].bias[1] = float("-inf")
    assert non_finite_loss(float("nan"), model) == "its loss is nan: 3 of its weights are NaN or infinite"
    assert non_finite_loss(float("nan"), model.half()).endswith("NaN or infinite in half precision")


def test_another_batch_size_is_refused_under_an_evaluation_capacity(stream):
    """With --eval-capacity-factor an expert takes at most cf * ceil(T / E) of a batch's tokens,
    so the perplexity depends on the batches: alma-score --batch-size other than the run's own
    evaluation batching is refused (the number would differ from stream.jsonl's, and reports
    group scorings by split, block length, precision and data, not by batch size)."""
    from fairseq_alma.errors import UsageError
    from fairseq_alma.scoring.request import ScoreRequest
    from fairseq_alma.scoring.runs import load_run
    from fairseq_alma.scoring.series import settings_for

    run = load_run(str(stream / "ens1"), None, from_log=False)
    assert settings_for(run, ScoreRequest((str(run.path),), batch_size=4)).batch_size == 4  # no limit
    run.cfg.model.eval_capacity_factor = 1.0
    with pytest.raises(UsageError, match=r"^--batch-size 4: .*ens1 evaluates with --eval-capacity-factor 1, so "
                                         r"its perplexity depends on how the tokens are batched.* --batch-size 8\)$"):
        settings_for(run, ScoreRequest((str(run.path),), batch_size=4))
    assert settings_for(run, ScoreRequest((str(run.path),))).batch_size == 8


def test_fairseq_scorers_refuse_other_batches_under_an_evaluation_capacity(stream, tmp_path):
    """fairseq-eval-lm and fairseq-validate apply alma-score's rule (``batch_size_problem``) to a
    checkpoint that evaluates with --eval-capacity-factor: other batches are refused in one line
    before anything loads (they printed 204.72 for the run's 204.63, exit 0); its own batching
    (ens1: 8 blocks) scores, and so does a checkpoint without the limit at any batch size."""
    limited = tmp_path / "checkpoint_stage1.pt"
    state = torch.load(stream / "ens1" / "checkpoint_stage1.pt", weights_only=False)
    state["cfg"]["model"]["eval_capacity_factor"] = 1.0
    torch.save(state, limited)
    validate = [tool("fairseq-validate"), str(stream / "data"), "--user-dir", USER_DIR, "--path", str(limited),
                "--task", "alma_stream", "--valid-subset", "eval", "--tokens-per-sample", "32", "--cpu",
                "--num-workers", "0", "--max-tokens", "64"]
    commands = [_eval_lm(stream, limited) + ["--batch-size", "4"], validate,
                _eval_lm(stream, limited), _eval_lm(stream, stream / "ens1" / "checkpoint_stage1.pt") +
                ["--batch-size", "4"]]
    (code, out, err), (vcode, _, verr), own, unlimited = _parallel(commands)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Perplexity" not in out + err, err
    assert re.fullmatch(r"fairseq-alma: error: --batch-size 4: \S+checkpoint_stage1.pt evaluates with "
                        r"--eval-capacity-factor 1, so its perplexity depends on how the tokens are "
                        r"batched; score it with its own evaluation batching \(pass --batch-size 8\)",
                        err.strip()), err
    assert vcode == 2 and len(verr.strip().splitlines()) == 1, verr
    assert "--max-tokens 64 (2 blocks of 32 tokens a batch): " in verr, verr
    _stock_ppl(own), _stock_ppl(unlimited)


def test_alma_sweep_score_refuses_at_submit_the_batch_size_its_tasks_would(stream, tmp_path):
    """alma-sweep score plans the tasks from each run's run.json: a --batch-size its alma-score
    would refuse (the run evaluates with --eval-capacity-factor) is refused before any task
    queues, with alma-score's line."""
    import shutil

    from fairseq_alma.errors import UsageError
    from fairseq_alma.sweeps.score_plan import plan_scoring

    run_dir = tmp_path / "seed1"
    shutil.copytree(stream / "ens1", run_dir)
    run_file = json.loads((run_dir / "run.json").read_text())
    run_file["fingerprint"]["config"]["model"]["eval_capacity_factor"] = 1.0
    (run_dir / "run.json").write_text(json.dumps(run_file))
    jobs = [{"name": "seed1", "run_dir": str(run_dir), "argv": [str(stream / "data")], "seed": 1, "overrides": {}}]
    with pytest.raises(UsageError, match=r"^--batch-size 4: .*seed1 evaluates with --eval-capacity-factor 1"):
        plan_scoring(tmp_path, jobs, ["--batch-size", "4", "--cpu"])
    tasks, skipped = plan_scoring(tmp_path, jobs, ["--batch-size", "8", "--cpu"])
    assert [task.name for task in tasks] == ["seed1"] and not skipped
