"""The waiting-time comparison of §6.1 behind ``alma-vision-demo``: one ``fairseq-train`` per
(width, wait, seed) on the embedded digits, the CER table, the verdict and the plots.

A run whose ``stream.jsonl`` holds all B + 1 arrivals is reused; an interrupted one is continued
by the same command (fairseq resumes from its ``checkpoint_last.pt``), so re-running the demo
only does the missing work.  Both only when the run's ``run.json`` fingerprint is the one its
``fairseq-train`` command would write (the run directory's name holds only width, wait and
seed): a directory holding a run with other settings (``--epochs-per-stage``, B) is refused
before anything trains (``stream/held_run.py``).  Each attempt at a run appends its output to
``logs/<run>.log`` after a separator line, so the log of the training that made a run is kept.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import AlmaError
from ..fairseq_glue.user_dir import PLUGIN_DIR
from ..report import figures, result_tables
from ..stream.atomic import atomic_write_json
from ..stream.held_run import held_run_records
from ..stream.progress import AUTO, wait_order
from ..stream.records import ArrivalRecord
from ..stream.run_view import RunView
from ..stream.series import ReportSeries, series_from_records
from .steps import ONE_THREAD, run_attempt, shown_command, tool, without_tool_advice

# where the demo's refusal of a run directory sends the user: the demo's own flag
OTHER_OUT = "use another --out"
# the line a fairseq-train refusal ends with (``console.error_line`` under fairseq-train)
FAIRSEQ_TRAIN_ERROR = ("fairseq-alma: error: ", "fairseq-train: error: ")


@dataclass(frozen=True)
class VisionDemoSettings:
    """What ``alma-vision-demo``'s flags set (``cli/vision_demo.py`` checks them)."""

    out: Path
    num_megabatches: int
    waits: tuple[int | str, ...]  # fixed waiting times, and auto (``stream/wait_policy.py``)
    widths: tuple[int, ...]
    seeds: tuple[int, ...]
    epochs_per_stage: int
    jobs: int


@dataclass(frozen=True)
class Run:
    """One stream of the demo: waiting time, MLP width and seed."""

    wait: int | str
    width: int
    seed: int

    @property
    def name(self) -> str:
        return f"sm_mlp{self.width}_w{self.wait}_s{self.seed}"


def train_command(run: Run, settings: VisionDemoSettings, save_dir: Path) -> list[str]:
    """The ``fairseq-train`` command of one run (App. B.1 values except epochs and B)."""
    return [
        tool("fairseq-train"), "digits", "--user-dir", str(PLUGIN_DIR),
        "--task", "alma_stream", "--vision-dataset", "digits",
        "--arch", "alma_vision",
        "--vision-method", "sm", "--vision-arch", "mlp", "--vision-width", str(run.width),
        "--num-megabatches", str(settings.num_megabatches), "--wait", str(run.wait),
        "--epochs-per-stage", str(settings.epochs_per_stage), "--batch-size", "128",
        "--vision-threads", "1", "--seed", str(run.seed), "--save-dir", str(save_dir),
        "--cpu", "--num-workers", "0", "--no-epoch-checkpoints", "--log-format", "simple",
    ]


def command_fingerprint(cmd: list[str], data_sha256: dict[str, str]) -> dict[str, Any]:
    """The fingerprint ``fairseq-train`` ``cmd`` would write to its ``run.json``: the command
    parsed by fairseq-train's own parser into the ``VisionRun`` its task builds
    (``vision_entry.vision_run``), so no flag's default is restated here.  ``data_sha256``
    caches ``runner.data_digest`` per data set."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from ..fairseq_glue.vision_entry import vision_run
    from ..sweeps.fairseq_train_flags import parse_training_argv
    from ..vision.data import load_vision_data
    from ..vision.fingerprint import vision_fingerprint
    from ..vision.runner import data_digest

    _, args, _ = parse_training_argv(cmd[1:])
    config = convert_namespace_to_omegaconf(args)
    run = vision_run(config.task, config.model)
    key = f"{run.dataset}:{run.data_path}"
    if key not in data_sha256:
        data_sha256[key] = data_digest(load_vision_data(run.dataset, run.data_path))
    return vision_fingerprint(run, data_sha256[key])


def held_runs(runs: list[Run], settings: VisionDemoSettings,
              out: Path) -> dict[Run, list[ArrivalRecord] | None]:
    """Run -> its records when ``runs/<run>`` holds it finished (reused), None when it is to be
    trained or continued; one line (``UsageError``) for the first directory holding a run
    with other settings.  Every run is checked before the first one trains."""
    held: dict[Run, list[ArrivalRecord] | None] = {}
    data_sha256: dict[str, str] = {}
    for run in runs:
        save_dir = Path(settings.out) / "runs" / run.name  # as the user named it, for the message
        if not save_dir.is_dir():
            held[run] = None  # nothing to compare: the command below makes the run
            continue
        fingerprint = command_fingerprint(train_command(run, settings, out / "runs" / run.name),
                                          data_sha256)
        held[run] = held_run_records(save_dir, fingerprint, settings.num_megabatches, OTHER_OUT)
    return held


def run_stream(run: Run, settings: VisionDemoSettings, out: Path,
               reused: list[ArrivalRecord] | None = None) -> list[ArrivalRecord]:
    """Reuse (``reused``: the records ``held_runs`` found), or run or continue one stream;
    return its records.  The command's output is appended to ``logs/<run>.log``.  Exits on
    failure, with fairseq-train's one-line error when it gave one."""
    if reused is not None:
        print(f"   {run.name}: complete, reused", flush=True)
        return reused
    save_dir = out / "runs" / run.name
    cmd = train_command(run, settings, save_dir)
    log = out / "logs" / f"{run.name}.log"
    print(f"   {run.name}: $ {shown_command(cmd)}", flush=True)
    started = time.time()
    status, attempt = run_attempt(cmd, log, f"alma-vision-demo run {run.name}",
                                  {**os.environ, **ONE_THREAD})
    records = RunView(save_dir).finished_records(settings.num_megabatches)
    if status != 0 or records is None:
        raise AlmaError(_failure(run, status, attempt, log))
    print(f"   {run.name}: done in {time.time() - started:.0f}s", flush=True)
    return records


def _failure(run: Run, status: int, attempt: str, log: Path) -> str:
    """Why ``run``'s command failed: fairseq-train's own one-line error if this ``attempt`` (its
    output) ended in one, else the attempt's last lines (a traceback: a bug)."""
    lines = attempt.splitlines()
    refusals = [line for line in lines if line.startswith(FAIRSEQ_TRAIN_ERROR)]
    if refusals:
        # "holds another run (...); use another --save-dir, or add --restart-stream": flags the
        # demo sets itself (a run made between held_runs' check and this command)
        reason, tool_advice = without_tool_advice(refusals[-1].split(": error: ", 1)[1])
        return (f"{run.name}: fairseq-train refused it (exit {status}): {reason}"
                f"{'; ' + OTHER_OUT if tool_advice else ''} (log: {log})")
    tail = "\n".join(lines[-10:])
    return f"{run.name} failed (exit {status}, stream.jsonl incomplete); log: {log}\n{tail}"


def _mean_lists(lists: list[list[float]]) -> list[float]:
    return [statistics.mean(column) for column in zip(*lists, strict=True)]


def mean_series(wait: int | str, width: int, per_seed: list[ReportSeries]) -> ReportSeries:
    """One series per (w, width): per-arrival errors, FLOPs and |θ| averaged over the seeds
    (CER is linear in the errors, so the mean series' CER is the mean of the seeds' CERs)."""
    return ReportSeries(
        setting=f"SM_w{wait}",
        num_experts=f"h{width}",
        metric_by_arrival=_mean_lists([s.metric_by_arrival for s in per_seed]),
        train_flops_cum=_mean_lists([s.train_flops_cum for s in per_seed]),
        params_by_arrival=[round(p) for p in _mean_lists([s.params_by_arrival for s in per_seed])],
        trained=[any(column) for column in zip(*(s.trained for s in per_seed), strict=True)],
        metric="error",
    )


def verdict(cers: dict[int | str, list[float]], num_megabatches: int) -> str:
    """Does an intermediate w have a lower mean CER than both w = 1 and w = B (§6.1)?"""
    mean = {w: statistics.mean(v) for w, v in cers.items() if w != AUTO}
    middle = [w for w in mean if 1 < w < num_megabatches]
    if 1 not in mean or num_megabatches not in mean or not middle:
        return f"not tested (needs --waits with 1, {num_megabatches} and one in between)"
    best = min(middle, key=mean.get)
    holds = mean[best] < mean[1] and mean[best] < mean[num_megabatches]
    return (f"{'HOLDS' if holds else 'does NOT hold'}: best intermediate w={best} CER "
            f"{mean[best]:.3f} vs w=1 {mean[1]:.3f} and w={num_megabatches} "
            f"{mean[num_megabatches]:.3f}")


def auto_verdict(cers: dict[int | str, list[float]]) -> str:
    """Does ``--wait auto`` reach the best fixed w's mean CER, within the seeds' spread?"""
    fixed = {w: v for w, v in cers.items() if w != AUTO}
    if AUTO not in cers or not fixed:
        return "not tested (needs --waits with auto and a fixed w)"
    best = min(fixed, key=lambda w: statistics.mean(fixed[w]))
    mean_auto, mean_best = statistics.mean(cers[AUTO]), statistics.mean(fixed[best])
    spread = max((statistics.stdev(v) for v in (cers[AUTO], fixed[best]) if len(v) > 1), default=0.0)
    holds = mean_auto <= mean_best + spread
    return (f"{'HOLDS' if holds else 'does NOT hold'}: auto CER {mean_auto:.3f} vs best fixed "
            f"w={best} {mean_best:.3f} (seed spread {spread:.3f})")


def write_report(settings: VisionDemoSettings, out: Path, results: dict[Run, list]) -> None:
    """CER table, per-seed CERs, the §6.1 verdict, plots and summary.json."""
    waits = sorted(set(settings.waits), key=wait_order)
    widths, seeds = sorted(set(settings.widths)), sorted(set(settings.seeds))
    series, cers, finding = [], {}, {}
    for h in widths:
        cers[h] = {}
        for w in waits:
            per_seed = [series_from_records(f"SM_w{w}", f"h{h}", results[Run(w, h, s)])
                        for s in seeds]
            cers[h][w] = [s.summary()["cer"] for s in per_seed]
            series.append(mean_series(w, h, per_seed))
    print(f"\n== CER table (errors averaged over seeds {seeds}; CER sums the test error after "
          f"each of the B + 1 = {settings.num_megabatches + 1} arrivals, Eq. 1)\n")
    print(result_tables.format_series_table(series))
    print("CER per seed:")
    for h in widths:
        for w in waits:
            spread = statistics.stdev(cers[h][w]) if len(seeds) > 1 else 0.0
            values = " ".join(f"{c:7.3f}" for c in cers[h][w])
            print(f"  h{h:<3} w={w!s:<4} {values}   (± {spread:.3f})")
    print("\n== paper §6.1: an intermediate waiting time beats w=1 and w=B for small models")
    for h in widths:
        finding[f"h{h}"] = verdict(cers[h], settings.num_megabatches)
        print(f"  h{h}: {finding[f'h{h}']}")
    if AUTO in waits:
        print("\n== --wait auto (decided at each arrival) against the best fixed w, chosen in hindsight")
        for h in widths:
            finding[f"h{h} auto"] = auto_verdict(cers[h])
            print(f"  h{h}: {finding[f'h{h} auto']}")
    plots = []
    for h in widths:
        plots.append(out / f"error_curves_h{h}.png")
        figures.plot_error_curves([s for s in series if s.num_experts == f"h{h}"], plots[-1])
    plots.append(out / "cer_tradeoffs.png")
    figures.plot_cer_tradeoffs(series, plots[-1])
    result_tables.write_json(series, out / "report.json")
    atomic_write_json(out / "summary.json", {
        "num_megabatches": settings.num_megabatches, "epochs_per_stage": settings.epochs_per_stage,
        "seeds": seeds, "finding": finding,
        "cer": {f"h{h}": {str(w): cers[h][w] for w in waits} for h in widths},
    })
    print(f"\nplots: {', '.join(str(p) for p in plots)}\nsummary: {out / 'summary.json'}")


def run_vision_demo(settings: VisionDemoSettings) -> None:
    """Every (width, wait, seed) stream, ``settings.jobs`` at a time, then the report."""
    out = Path(settings.out).resolve()
    runs = [Run(w, h, s) for h in sorted(set(settings.widths))
            for w in sorted(set(settings.waits), key=wait_order)
            for s in sorted(set(settings.seeds))]
    held = held_runs(runs, settings, out)  # before anything trains or is printed
    (out / "logs").mkdir(parents=True, exist_ok=True)
    print(f"== {len(runs)} streams on the embedded digits (B={settings.num_megabatches}, "
          f"{settings.epochs_per_stage} epochs per stage), {settings.jobs} at a time", flush=True)
    started = time.time()
    with ThreadPoolExecutor(max_workers=settings.jobs) as pool:
        results = dict(zip(runs, pool.map(lambda r: run_stream(r, settings, out, held[r]), runs),
                           strict=True))
    write_report(settings, out, results)
    print(f"total {time.time() - started:.0f}s")
