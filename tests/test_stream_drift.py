"""Streams that drift (issue 14, items 3 and 4): partial replay and LR meta-schedules.

Pure functions first (the replay slots, the meta-schedules, the fingerprint), then real
``fairseq-train`` runs of a 4-mega-batch stream.  A test-only ``sitecustomize.py`` logs, for
every update, which mega-batches hold the token blocks it trained on (found by content, not by
the layout the task chose) and its tokens, so the tests check what was really trained on
against what ``stream.jsonl`` says.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from lm_fixtures import RESUMABLE, assert_same_stream, prepare_stream, run, stream_cmd, wait_for

from fairseq_alma.errors import UsageError
from fairseq_alma.optim.stage_lr_schedules import cosine_stage_lr, scheduled_lr, stage_peak
from fairseq_alma.stream.progress import StreamPlan
from fairseq_alma.stream.replay import (
    check_replay_budget,
    check_replay_ratio,
    counted_replays,
    replay_slots,
    slot_pattern,
)
from fairseq_alma.stream.stage_clock import StageClock, stage_position

U, WARMUP, LR = 6, 2, 0.003  # stream_cmd's --updates-per-stage, --warmup-updates, --lr

BATCH_HOOK = '''
import builtins, json, os, sys

LOG = os.environ.get("ALMA_TEST_BATCH_LOG", "")
_import = builtins.__import__
_done = []
_owners = {}  # a block's tokens -> the mega-batches holding it
_read = set()


def _owners_of(task, rows):
    for name, dataset in list(task.datasets.items()):
        if name.startswith("megabatch") and name not in _read:
            _read.add(name)
            for i in range(len(dataset)):
                block = tuple(dataset[i]["source"].tolist())
                _owners.setdefault(block, set()).add(int(name[len("megabatch"):]))
    pad, found = task.dictionary.pad(), set()
    for row in rows.tolist():
        while row and row[-1] == pad:
            row.pop()
        found |= _owners[tuple(row)]
    return sorted(found)


def _patch(module):
    task_class = module.AlmaStreamTask
    original = task_class.train_step

    def train_step(self, sample, model, criterion, optimizer, update_num, ignore_grad=False):
        found = _owners_of(self, sample["net_input"]["src_tokens"])
        with open(LOG, "a") as handle:
            handle.write(json.dumps({"update": update_num, "megabatches": found,
                                     "ntokens": int(sample["ntokens"])}) + "\\n")
        return original(self, sample, model, criterion, optimizer, update_num, ignore_grad)

    task_class.train_step = train_step


def _hooked_import(name, *args, **kwargs):
    module = _import(name, *args, **kwargs)
    target = sys.modules.get("fairseq_alma.tasks.alma_stream")
    if not _done and target is not None and hasattr(target, "AlmaStreamTask"):
        _done.append(1)
        _patch(target)
    return module


if LOG:
    builtins.__import__ = _hooked_import
'''


# ---- pure functions ---------------------------------------------------------------------
def test_replay_slots_are_exactly_round_r_u_and_spread_through_the_stage():
    assert [replay_slots(6, r) for r in (0.0, 0.25, 0.5, 0.1, 0.99)] == [0, 2, 3, 1, 6]  # 1.5 -> 2
    for budget in (1, 6, 7, 120):
        for replayed in range(budget + 1):
            pattern = slot_pattern(budget, budget, replayed)
            assert sum(pattern) == replayed
            # evenly spread: any window of k slots holds floor or ceil of k * R / U replays
            for k in range(1, budget + 1):
                counts = {sum(pattern[i:i + k]) for i in range(budget - k + 1)}
                assert max(counts) - min(counts) <= 1
            assert slot_pattern(3 * budget, budget, replayed) == pattern * 3  # spares repeat it
    assert slot_pattern(6, 6, 3) == [False, True] * 3
    assert counted_replays(6, 3, []) == 3
    # a skipped attempt trained on nothing: the counted updates consumed the next slot instead
    assert counted_replays(6, 3, [1]) == 2  # slots 0, 2..6 consumed: replays at 3 and 5 only
    assert counted_replays(6, 3, [0]) == 3  # slots 1..6: replays 1, 3, 5


# (r, U, round(r * U) with halves up, by hand): r * U is exactly a half in decimal, and in
# floating point floor(r * U + 0.5) lands one below (found by brute force over r = k / 1000).
FLOAT_ROUNDS_DOWN = [(0.145, 100, 15), (0.285, 100, 29), (0.29, 50, 15), (0.35, 90, 32),
                     (0.58, 25, 15), (0.7, 45, 32), (0.82, 75, 62), (0.009, 1500, 14),
                     (0.175, 180, 32)]


@pytest.mark.parametrize("ratio, budget, expected", FLOAT_ROUNDS_DOWN)
def test_replay_slots_round_the_typed_decimal_half_up(ratio, budget, expected):
    assert math.floor(ratio * budget + 0.5) == expected - 1  # the float rule this replaces
    assert replay_slots(budget, ratio) == expected
    assert StreamPlan(4, wait=1, replay_ratio=ratio).replay_slots(2, budget) == expected


def test_replay_slots_agree_with_decimal_half_up_everywhere():
    from decimal import ROUND_HALF_UP, Decimal

    for k in range(1000):
        ratio = k / 1000
        for budget in range(1, 121):
            exact = (Decimal(repr(ratio)) * budget).quantize(Decimal(1), rounding=ROUND_HALF_UP)
            assert replay_slots(budget, ratio) == int(exact), (ratio, budget)


def test_partial_replay_draws_from_mega_batches_before_the_new_ones():
    plan = StreamPlan(6, wait=2, replay_ratio=0.25)
    assert [s.new_megabatches for s in plan.schedule] == [(0, 1), (2, 3), (4, 5)]
    assert [s.replay_megabatches for s in plan.schedule] == [(), (0, 1), (0, 1, 2, 3)]
    assert [s.train_megabatches for s in plan.schedule] == [(0, 1), (2, 3), (4, 5)]
    assert [plan.replay_slots(s, 6) for s in (1, 2, 3)] == [0, 2, 2]  # stage 1: nothing earlier
    assert StreamPlan(6, wait=2).schedule[1].replay_megabatches == ()  # r = 0: today's stream
    with pytest.raises(UsageError, match="--replay-ratio 0.5 has nothing to replay"):
        StreamPlan(4, wait=3, replay_ratio=0.5)  # one stage, at arrival 3


@pytest.mark.parametrize("ratio, replay, needle", [
    (-0.1, False, "--replay-ratio must be in [0, 1)"),
    (1.0, False, "--replay-ratio must be in [0, 1)"),
    (float("nan"), False, "--replay-ratio must be in [0, 1)"),
    (0.5, True, "--replay-ratio 0.5 cannot be combined with --replay"),
])
def test_bad_replay_ratios_are_refused(ratio, replay, needle):
    with pytest.raises(UsageError) as caught:
        check_replay_ratio(ratio, replay)
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    assert check_replay_ratio(0.0, True) == 0.0  # --replay alone is the paper's full replay


def test_a_ratio_the_budget_cannot_honour_is_refused():
    for ratio, replayed in ((0.05, 0), (0.95, 6)):
        with pytest.raises(UsageError, match=f"rounds to {replayed} replayed updates"):
            check_replay_budget(ratio, 6)
    check_replay_budget(0.1, 6)  # 0.6 -> 1 replayed update
    check_replay_budget(0.0, 6)


def test_stage_position_reads_the_clock_back_from_fairseqs_counter():
    clock = StageClock(budget=6)
    for num_updates in range(1, 19):
        clock.attempt(num_updates)
        if num_updates == 3:
            clock.attempt(3)  # a skipped step (fp16 overflow): the position does not move
        assert stage_position(num_updates, 6) == ((clock.stage, clock.counted) if not clock.done
                                                  else (clock.stage + 1, 0))
        if clock.done and clock.stage < 3:
            clock.next_stage(clock.stage + 1)
    assert clock.skipped_slots == {1: [3]}  # the 4th attempt of stage 1


def _old_restart_lr(num_updates: int, budget: int, warmup: int, peak: float, init: float) -> float:
    """alma_stage_linear before --stage-lr-schedule (commit 3264a68), verbatim."""
    position = num_updates % budget
    if position < warmup:
        return init + (peak - init) * (position + 1) / warmup
    return peak * (budget - position) / max(1, budget - warmup)


def test_restart_is_todays_schedule_bit_for_bit():
    for budget, warmup, peak, init in ((6, 2, 0.003, 0.0), (1000, 37, 5e-4, 1e-7), (5, 0, 1.0, 0.0)):
        for n in range(4 * budget):
            stage, position = stage_position(n, budget)
            assert scheduled_lr("restart", stage, position, budget, warmup, peak, init) == \
                _old_restart_lr(n, budget, warmup, peak, init)


def test_decay_lowers_each_stage_peak_by_sqrt_stage():
    assert [stage_peak(1.0, s, "decay") for s in (1, 2, 3, 4)] == [1.0, 1 / math.sqrt(2), 1 / math.sqrt(3), 0.5]
    assert {stage_peak(1.0, s, k) for s in (1, 5) for k in ("restart", "cyclic")} == {1.0}
    for stage in (1, 2, 3):
        lrs = [scheduled_lr("decay", stage, p, 10, 2, 1.0) for p in range(10)]
        restart = [scheduled_lr("restart", stage, p, 10, 2, 1.0) for p in range(10)]
        assert lrs == pytest.approx([x / math.sqrt(stage) for x in restart], rel=1e-12)
        assert max(lrs) == pytest.approx(1 / math.sqrt(stage))


def test_cyclic_is_warmup_then_cosine_to_zero_every_stage():
    budget, warmup = 10, 2
    lrs = [scheduled_lr("cyclic", 1, p, budget, warmup, 1.0) for p in range(budget)]
    assert lrs[:2] == [0.5, 1.0] and lrs[2] == 1.0  # warmup as restart, peak at the first decay step
    assert lrs[6] == pytest.approx(0.5)  # half way through the decay: cos(pi/2)
    assert all(a > b > 0 for a, b in zip(lrs[2:], lrs[3:]))
    assert cosine_stage_lr(budget, budget, warmup, 1.0) == pytest.approx(0.0, abs=1e-15)
    assert [scheduled_lr("cyclic", 3, p, budget, warmup, 1.0) for p in range(budget)] == lrs


def test_fingerprint_names_the_new_settings_only_when_used(stream4, tmp_path):
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_alma.fairseq_glue.config import run_fingerprint

    def fingerprint(*extra: str) -> dict:
        argv = stream_cmd(stream4, tmp_path / "unused", *extra)[1:]
        cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_training_parser(), argv))
        return run_fingerprint(cfg.task)

    plain = fingerprint()  # a run directory written before these flags existed still resumes
    assert "replay_ratio" not in plain["task"] and "stage_lr_schedule" not in plain["lr_scheduler"]
    assert fingerprint("--replay-ratio", "0", "--stage-lr-schedule", "restart") == plain
    used = fingerprint("--replay-ratio", "0.25", "--stage-lr-schedule", "decay")
    assert used["task"]["replay_ratio"] == 0.25 and used["lr_scheduler"]["stage_lr_schedule"] == "decay"


def test_report_names_say_replay_ratio_and_schedule():
    from fairseq_alma.report.inputs import setting_name

    assert setting_name({"wait": 1}) == "SM_w1"
    assert setting_name({"wait": 1, "replay_ratio": 0.0}, lr_schedule="restart") == "SM_w1"
    assert setting_name({"wait": 2, "replay_ratio": 0.25}, lr_schedule="decay") == "SM_w2 replay r=0.25 lr decay"
    assert setting_name({"wait": 1, "replay": True}) == "SM_w1 replay"


# ---- real runs ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def stream4(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("stream4")
    return prepare_stream(root, root / "data", num_megabatches=4, lines=1600)


def _hooked_env(tmp: Path, batch_log: Path | None, overflow_at: str = "") -> dict:
    """The batch log hook, and test_stage_accounting's injected fp16 overflows at ``overflow_at``."""
    from test_stage_accounting import OVERFLOW_HOOK

    hooks = tmp / "hooks"
    hooks.mkdir(parents=True, exist_ok=True)
    (hooks / "batch_hook.py").write_text(BATCH_HOOK)
    (hooks / "overflow_hook.py").write_text(OVERFLOW_HOOK)
    (hooks / "sitecustomize.py").write_text("import overflow_hook, batch_hook\n")
    (tmp / "markers").mkdir(exist_ok=True)
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(hooks), os.environ.get("PYTHONPATH")])),
            "ALMA_TEST_BATCH_LOG": str(batch_log or ""), "ALMA_TEST_OVERFLOW_AT": overflow_at,
            "ALMA_TEST_OVERFLOW_DIR": str(tmp / "markers")}


def _train(cmd: list[str], tmp: Path, batch_log: Path | None = None, overflow_at: str = "") -> str:
    env = _hooked_env(tmp, batch_log, overflow_at)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _records(save: Path) -> list[dict]:
    return [json.loads(line) for line in (save / "stream.jsonl").read_text().splitlines()]


def _updates(batch_log: Path) -> dict[int, list[dict]]:
    """Logged updates by stage (no step is skipped here, so stage = update // U + 1)."""
    by_stage: dict[int, list[dict]] = {}
    for line in batch_log.read_text().splitlines():
        entry = json.loads(line)
        by_stage.setdefault(entry["update"] // U + 1, []).append(entry)
    return by_stage


def _check_batches(by_stage: dict[int, list[dict]], plan: StreamPlan) -> list[int]:
    """Every update trains on its stage's new mega-batches or wholly on earlier ones; returns
    the replayed updates per stage."""
    replayed = []
    for stage in plan.schedule:
        updates = by_stage[stage.index]
        assert len(updates) == U
        new, earlier = set(stage.new_megabatches), set(range(stage.arrival - plan.wait))
        old = [u for u in updates if not set(u["megabatches"]) <= new]
        for update in old:
            assert set(update["megabatches"]) <= earlier, (stage.index, update)
        replayed.append(len(old))
    return replayed


def _logged_lrs(log: str) -> list[tuple[int, float]]:
    return [(int(n), float(lr)) for n, lr in re.findall(r"num_updates=(\d+), lr=([0-9.e-]+)", log)]


def _check_lrs(log: str, schedule: str, updates: int) -> None:
    """fairseq logs, after update n, the LR it set for update n + 1 (0-based position n)."""
    logged = _logged_lrs(log)
    assert [n for n, _ in logged] == list(range(1, updates + 1))
    for n, lr in logged:
        stage, position = stage_position(n, U)
        assert lr == pytest.approx(scheduled_lr(schedule, stage, position, U, WARMUP, LR), rel=1e-5), n


DRIFT = ("--replay-ratio", "0.5", "--stage-lr-schedule", "decay", "--moe-max-experts", "5",
         "--grow-experts", "1", "--log-interval", "1", *RESUMABLE)


@pytest.fixture(scope="module")
def drift_run(stream4, tmp_path_factory) -> tuple[Path, str, Path]:
    """w = 1, r = 0.5 (3 of 6 updates replayed from stage 2 on), decay, experts grown 2 -> 5."""
    tmp = tmp_path_factory.mktemp("drift")
    save, batch_log = tmp / "run", tmp / "batches.jsonl"
    return save, _train(stream_cmd(stream4, save, *DRIFT), tmp, batch_log), batch_log


@pytest.mark.slow
def test_replayed_fraction_is_exact_and_drawn_only_from_earlier_mega_batches(drift_run):
    save, log, batch_log = drift_run
    plan = StreamPlan(4, 1, replay_ratio=0.5)
    by_stage = _updates(batch_log)
    assert _check_batches(by_stage, plan) == [0, 3, 3, 3]  # stage 1 has nothing earlier
    records = _records(save)
    assert [r["replayed_updates"] for r in records] == [0, 0, 3, 3, 3]
    assert {r["replay_ratio"] for r in records} == {0.5}
    # Comp counts what was trained on, replayed batches included
    tokens = [sum(u["ntokens"] for u in by_stage[s]) for s in (1, 2, 3, 4)]
    assert [r["train_tokens_cum"] for r in records] == [0, *(sum(tokens[:s]) for s in (1, 2, 3, 4))]
    assert records[4]["train_flops_cum"] > records[3]["train_flops_cum"] > 0
    # growth composed with replay: one expert per stage from stage 2 on
    grown = [json.loads(line)["stage"] for line in (save / "growth.jsonl").read_text().splitlines()]
    assert grown == [2, 3, 4] and "--replay-ratio 0.5: 3 of every stage's 6 updates" in log


@pytest.mark.slow
def test_decay_schedule_in_a_real_run(drift_run):
    save, log, _ = drift_run
    _check_lrs(log, "decay", 4 * U)
    assert "--stage-lr-schedule decay" in log and "stage peaks 0.003, 0.002121, 0.001732, 0.0015" in log
    assert [r.get("stage_peak_lr") for r in _records(save)] == [None, *(LR / math.sqrt(s) for s in (1, 2, 3, 4))]


@pytest.mark.slow
def test_killed_mid_stage_resumes_to_the_uninterrupted_run(stream4, drift_run, tmp_path):
    save = tmp_path / "resumed"
    cmd = stream_cmd(stream4, save, *DRIFT)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=_hooked_env(tmp_path, None))  # no hook: it changes nothing
    wait_for(save / "checkpoint_3_14.pt", proc)  # inside stage 3, a replay stage, after growth
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _train(cmd, tmp_path)
    assert_same_stream(save, drift_run[0], stages=(1, 2, 3, 4))


@pytest.mark.slow
def test_a_skipped_replay_step_is_not_counted_as_replayed(stream4, tmp_path):
    """An fp16 overflow at stage 2's second attempt (slot 1, a replay slot of r = 0.5's
    new/replay/new/replay... pattern) trains on nothing: the counted updates then use slots 0
    and 2-6, of which 3 and 5 replay, and stream.jsonl says 2, as the trained batches do."""
    save, batch_log = tmp_path / "run", tmp_path / "batches.jsonl"
    log = _train(stream_cmd(stream4, save, "--replay-ratio", "0.5"), tmp_path, batch_log, overflow_at="7")
    assert log.count("gradient overflow detected") == 1
    counted: dict[int, dict] = {}  # the last attempt at each update number is the counted one
    for line in batch_log.read_text().splitlines():
        entry = json.loads(line)
        counted[entry["update"]] = entry
    stage2 = [counted[n] for n in range(U, 2 * U)]
    assert sum(1 for u in stage2 if u["megabatches"] == [0]) == 2
    assert all(u["megabatches"] in ([0], [1]) for u in stage2)
    records = _records(save)
    assert [r["replayed_updates"] for r in records] == [0, 0, 2, 3, 3]
    assert [r["skipped_updates"] for r in records] == [0, 0, 1, 0, 0]


@pytest.mark.slow
def test_wait_two_cyclic_and_the_fingerprint(stream4, tmp_path):
    """w = 2: stage 2's new data is mega-batches 2 and 3, its replay 0 and 1; r = 0.25 of 6
    updates rounds to 2; the cyclic schedule; then the run directory refuses other settings."""
    save, batch_log = tmp_path / "run", tmp_path / "batches.jsonl"
    flags = ("--wait", "2", "--replay-ratio", "0.25", "--stage-lr-schedule", "cyclic", "--log-interval", "1")
    log = _train(stream_cmd(stream4, save, *flags), tmp_path, batch_log)
    plan = StreamPlan(4, 2, replay_ratio=0.25)
    assert _check_batches(_updates(batch_log), plan) == [0, 2]
    assert [r["replayed_updates"] for r in _records(save)] == [0, 0, 0, 0, 2]  # stage 2 at arrival 4
    _check_lrs(log, "cyclic", 2 * U)
    for other, needle in ((("--replay-ratio", "0.5", "--stage-lr-schedule", "cyclic"), "task.replay_ratio: 0.25 -> 0.5"),
                          (("--replay-ratio", "0.25"), "lr_scheduler.stage_lr_schedule: 'cyclic' -> '(unset)'"),
                          (("--stage-lr-schedule", "cyclic"), "task.replay_ratio: 0.25 -> '(unset)'")):
        proc = run(stream_cmd(stream4, save, "--wait", "2", *other), check=False)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
        assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], proc.stderr[-1500:]


@pytest.mark.slow
@pytest.mark.parametrize("flags, needle", [
    (("--replay-ratio", "1"), "--replay-ratio must be in [0, 1)"),
    (("--replay-ratio", "0.5", "--replay"), "cannot be combined with --replay"),
    (("--replay-ratio", "0.05"), "--replay-ratio 0.05 of a stage's 6 updates rounds to 0 replayed updates"),
])
def test_bad_flags_stop_before_the_first_update(stream4, tmp_path, flags, needle):
    proc = run(stream_cmd(stream4, tmp_path / "bad", *flags), check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr and not (tmp_path / "bad" / "stream.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("flags, needle", [
    (("--replay-ratio", "0.5"), "--replay-ratio 0.5 is for language-model streams"),
    (("--lr-scheduler", "alma_stage_linear", "--stage-lr-schedule", "decay", "--updates-per-stage",
      "4", "--warmup-updates", "1"), "--stage-lr-schedule decay is for language-model streams"),
])
def test_vision_streams_refuse_both_flags(tmp_path, flags, needle):
    from lm_fixtures import USER_DIR, tool

    cmd = [tool("fairseq-train"), "digits", "--user-dir", USER_DIR, "--task", "alma_stream",
           "--vision-dataset", "digits", "--arch", "alma_vision", "--num-megabatches", "4",
           "--batch-size", "128", "--save-dir", str(tmp_path / "run"), "--cpu", "--num-workers", "0", *flags]
    proc = run(cmd, check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("fairseq-alma: error:")]
    assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], proc.stderr[-1500:]
    assert not (tmp_path / "run" / "stream.jsonl").exists()
