"""The waiting-time comparison of §6.1 behind ``alma-vision-demo``: one ``fairseq-train`` per
(width, wait, seed) on the embedded digits, the CER table, the verdict and the plots.

A run whose ``stream.jsonl`` holds all B + 1 arrivals is reused; an interrupted one is continued
by the same command (fairseq resumes from its ``checkpoint_last.pt``), so re-running the demo
only does the missing work.
"""

from __future__ import annotations

import os
import shlex
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..errors import AlmaError
from ..fairseq_glue.user_dir import PLUGIN_DIR
from ..report import figures, result_tables
from ..stream.atomic import atomic_write_json
from ..stream.progress import AUTO, wait_order
from ..stream.records import ArrivalRecord
from ..stream.run_view import RunView
from ..stream.series import ReportSeries, series_from_records
from .steps import tool


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


def run_stream(run: Run, settings: VisionDemoSettings, out: Path) -> list[ArrivalRecord]:
    """Run (or reuse, or continue) one stream; return its records.  Exits on failure."""
    save_dir = out / "runs" / run.name
    done = RunView(save_dir).finished_records(settings.num_megabatches)
    if done is not None:
        print(f"   {run.name}: complete, reused", flush=True)
        return done
    cmd = train_command(run, settings, save_dir)
    log = out / "logs" / f"{run.name}.log"
    print(f"   {run.name}: $ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    started = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log, "w", encoding="utf-8") as handle:
        proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env, check=False)
    records = RunView(save_dir).finished_records(settings.num_megabatches)
    if proc.returncode != 0 or records is None:
        text = log.read_text(encoding="utf-8", errors="replace")
        tail = "\n".join(text.splitlines()[-10:])
        raise AlmaError(f"{run.name} failed (exit {proc.returncode}, stream.jsonl incomplete); "
                        f"log: {log}\n{tail}")
    print(f"   {run.name}: done in {time.time() - started:.0f}s", flush=True)
    return records


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
        trained=per_seed[0].trained,
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
    (out / "logs").mkdir(parents=True, exist_ok=True)
    runs = [Run(w, h, s) for h in sorted(set(settings.widths))
            for w in sorted(set(settings.waits), key=wait_order)
            for s in sorted(set(settings.seeds))]
    print(f"== {len(runs)} streams on the embedded digits (B={settings.num_megabatches}, "
          f"{settings.epochs_per_stage} epochs per stage), {settings.jobs} at a time", flush=True)
    started = time.time()
    with ThreadPoolExecutor(max_workers=settings.jobs) as pool:
        results = dict(zip(runs, pool.map(lambda r: run_stream(r, settings, out), runs), strict=True))
    write_report(settings, out, results)
    print(f"total {time.time() - started:.0f}s")
