"""What the ALMA plumbing costs over stock fairseq, measured in one run (issue 3, "Speed").

(a) Training: updates/s of ``fairseq-train --task alma_stream --wait 1`` against
    ``fairseq-train --task language_modeling --train-subset megabatch0``: same data, same tiny
    Switch model, flags, batch and threads, U updates each (the stream's stage 1 trains on
    megabatch0 with --updates-per-stage U).  Method: fairseq logs ``ups`` for every
    --log-interval window (its ``train_inner`` meters are reset after each log line), so each
    value is updates / wall time of that window of the training loop, data loading included.
    The first window of every epoch (= stage) is dropped: it includes start-up or the previous
    epoch's end (checkpoint; for the stream, the per-arrival evaluation).  A run's speed is the
    harmonic mean of its windows (= updates / time, the windows being equally long).  Runs
    alternate (LM, stream, LM, ...) so load from other processes hits both alike, and each
    task's speed pools the windows of all its runs.  Target: stream >= 0.95x LM.
(b) Scoring: ``alma-score`` tokens/s against ``fairseq-eval-lm`` tokens/s on the same stage
    checkpoint, batch size and --tokens-per-sample.  Both tools time from the first batch to the
    last (iterator set-up excluded), the first batch's warm-up included, batches prefetched by a
    background thread; fairseq-eval-lm further leaves collation out of its clock, alma-score
    does not.  The stage-1 checkpoint, alma-score's first, is compared.  Also end to end: one
    alma-score over the run (both stages) against one fairseq-eval-lm per stage checkpoint.
    Alternating runs; tokens and seconds pooled over runs.  Target: >= 1.0x.
(c) Scoring's compute alone, like with like: in this process, on the stage-1 checkpoint and
    the same pre-collated batches, the CPU seconds (``time.process_time``) of alma-score's
    ``score_jointly`` against fairseq-eval-lm's own ``eval_lm`` function, alternating.  Why:
    (b)'s two clocks differ (collation, about 3% of the time, is in alma-score's only) and
    wall time swings with the machine's load; CPU time on the same batches does neither.  The
    two perplexities must agree (a check that both scored the same tokens alike).

Data: ``alma-demo-corpus`` (Python stdlib prose, nothing downloaded) prepared with
``alma-data-prep`` into a 2-mega-batch stream in a temporary directory.  Every process runs with
OMP_NUM_THREADS=1 (one core each: comparable on a shared machine).  About 3.5 minutes of CPU
with the defaults (mostly one process at a time); twice that wall time on a busy machine.

Usage: python benchmarks/stream_overhead.py [--updates U] [--repeats R] [--corpus-mb MB]
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from fairseq_alma.text_table import format_table

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(REPO, "fairseq_alma")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
BATCH = shlex.split("--tokens-per-sample 128 --batch-size 16 --cpu --num-workers 0")
MODEL = BATCH + shlex.split(
    "--arch switch_transformer_lm_tiny --moe-experts 4 --criterion switch_cross_entropy "
    "--optimizer adam --lr 0.002 --warmup-updates 10 --dropout 0.1 --seed 1 --log-format simple "
    "--disable-validation --no-epoch-checkpoints"
)
PREP = shlex.split("--vocab-size 1000 --num-megabatches 2 --eval-size 0.25 --valid-size 0.02 "
                   "--workers 2")
SCORED = re.compile(r"checkpoint 1/\d+ \S*checkpoint_stage1\.pt: ([0-9,]+) tokens in ([0-9.]+)s")
EVALUATED = re.compile(r"Evaluated ([0-9,]+) tokens in ([0-9.]+)s \(([0-9.]+) tokens/s\)")


def _tool(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else name


def _run(cmd: list[str]) -> tuple[str, float]:
    """Output (stdout + stderr) and wall seconds of one command; exits loudly on failure."""
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=ENV, check=False)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"stream_overhead: {shlex.join(cmd)} failed ({proc.returncode}):\n"
                 f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout + proc.stderr, wall


def loop_windows(log: str) -> list[float]:
    """ups of the train_inner windows of one run, the first window of each epoch dropped."""
    windows: dict[int, list[float]] = {}
    for epoch, ups in re.findall(r"\| train_inner \| epoch (\d+):.*?\bups=([0-9.]+)", log):
        windows.setdefault(int(epoch), []).append(float(ups))
    kept = [u for values in windows.values() for u in values[1:]]
    if not kept:
        sys.exit("stream_overhead: no train_inner windows after the first; raise --updates")
    return kept


def prepare(scratch: str, corpus_mb: float) -> str:
    corpus, data = os.path.join(scratch, "corpus.txt"), os.path.join(scratch, "data")
    _run([_tool("alma-demo-corpus"), "--out", corpus, "--max-mb", str(corpus_mb)])
    _run([_tool("alma-data-prep"), corpus, "--out", data, *PREP])
    return data


def train_speed(data: str, scratch: str, updates: int, repeats: int, interval: int) -> dict:
    """Alternating timed runs; the stream runs stop after stage 1 (--max-epoch 1), then the last
    one is finished by the same command without --max-epoch (a stream resumes where it stopped)
    so part (b) has a complete run to score."""
    train = [_tool("fairseq-train"), data, "--user-dir", USER_DIR, *MODEL,
             "--log-interval", str(interval)]
    lm = [*train, "--task", "language_modeling", "--train-subset", "megabatch0",
          "--lr-scheduler", "polynomial_decay", "--total-num-update", str(updates),
          "--max-update", str(updates)]
    stream = [*train, "--task", "alma_stream", "--wait", "1", "--updates-per-stage", str(updates),
              "--lr-scheduler", "alma_stage_linear"]
    windows: dict[str, list[float]] = {"language_modeling": [], "alma_stream": []}
    for rep in range(repeats):
        stage_1_only = [*stream, "--max-epoch", "1"]
        for name, cmd in (("language_modeling", lm), ("alma_stream", stage_1_only)):
            log, wall = _run([*cmd, "--save-dir", os.path.join(scratch, f"{name}{rep}")])
            kept = loop_windows(log)
            windows[name] += kept
            print(f"  {name:<18} run {rep + 1}: {statistics.harmonic_mean(kept):7.2f} updates/s "
                  f"over {len(kept)} windows ({wall:.0f}s wall)", flush=True)
    last = os.path.join(scratch, f"alma_stream{repeats - 1}")
    _run([*stream, "--save-dir", last])
    speeds = {name: statistics.harmonic_mean(kept) for name, kept in windows.items()}
    return speeds | {"stream_run": last}


def score_speed(data: str, run_dir: str, repeats: int) -> dict:
    """Alternating runs: alma-score over the run (both stage checkpoints), then fairseq-eval-lm
    on each stage checkpoint; tokens and seconds on stage 1, and end-to-end walls, summed."""
    totals = dict.fromkeys(("tokens", "alma_s", "stock_s", "alma_wall", "stock_wall"), 0.0)
    for rep in range(repeats):
        log, alma_wall = _run([_tool("alma-score"), run_dir, "--batch-size", "16", "--cpu"])
        found = SCORED.search(log)
        tokens, alma_s = int(found.group(1).replace(",", "")), float(found.group(2))
        stock_s, stock_wall = 0.0, 0.0
        for stage in (1, 2):
            log, wall = _run([_tool("fairseq-eval-lm"), data, "--user-dir", USER_DIR, "--path",
                              os.path.join(run_dir, f"checkpoint_stage{stage}.pt"),
                              "--gen-subset", "eval", *BATCH])
            stock_wall += wall
            if stage == 1:
                found = EVALUATED.search(log)
                if int(found.group(1).replace(",", "")) != tokens:
                    sys.exit("stream_overhead: the two tools scored different token counts")
                stock_s = tokens / float(found.group(3))  # seconds, from the finer-grained rate
        print(f"  run {rep + 1}: alma-score {tokens / alma_s:9,.0f} tokens/s, fairseq-eval-lm "
              f"{tokens / stock_s:9,.0f} tokens/s (stage 1); both stages end to end "
              f"{alma_wall:.1f}s vs {stock_wall:.1f}s", flush=True)
        for key, value in zip(totals, (tokens, alma_s, stock_s, alma_wall, stock_wall)):
            totals[key] += value
    return totals


def score_compute(data: str, run_dir: str, repeats: int) -> dict:
    """CPU seconds of ``score_jointly`` and of fairseq's ``eval_lm`` on the same batches (c)."""
    import argparse as _argparse
    import math

    import torch
    from fairseq import checkpoint_utils, utils
    from fairseq_cli.eval_lm import eval_lm

    from fairseq_alma.lm.ensemble_eval import score_jointly
    from fairseq_alma.lm.nll import Batching, eval_batches

    torch.set_num_threads(1)
    utils.import_user_module(_argparse.Namespace(user_dir=USER_DIR))
    models, _, task = checkpoint_utils.load_model_ensemble_and_task(
        [os.path.join(run_dir, "checkpoint_stage1.pt")],
        arg_overrides={"data": data, "tokens_per_sample": 128})
    task.load_dataset("eval")
    batches = list(eval_batches(models, task, task.dataset("eval"), Batching(16, None)))
    totals = {"alma_cpu": 0.0, "stock_cpu": 0.0}
    for _ in range(repeats):
        start = time.process_time()
        ours = score_jointly(models, iter(batches), task.target_dictionary.pad())
        totals["alma_cpu"] += time.process_time() - start
        start = time.process_time()
        with torch.no_grad():
            stock = eval_lm(models, task.source_dictionary, iter(batches),
                            target_dictionary=task.target_dictionary)
        totals["stock_cpu"] += time.process_time() - start
        ours_bits = ours.prefix_nll[0] / ours.ntokens / math.log(2)
        if not math.isclose(ours_bits, stock["loss"], rel_tol=1e-6):
            sys.exit(f"stream_overhead: the two scorers disagree ({ours_bits} vs {stock['loss']} "
                     f"bits per token)")
    print(f"  {ours.ntokens:,} tokens x {repeats}: score_jointly {totals['alma_cpu']:.2f} CPU s, "
          f"eval_lm {totals['stock_cpu']:.2f} CPU s", flush=True)
    return totals | {"tokens": ours.ntokens * repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--updates", type=int, default=100,
                        help="updates per stage / per LM run (default 100)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of each tool, alternating (default 2; more for a busy machine)")
    parser.add_argument("--corpus-mb", type=float, default=1.0,
                        help="demo corpus size in MB (default 1)")
    parser.add_argument("--log-interval", type=int, default=10,
                        help="updates per ups window (default 10)")
    args = parser.parse_args()
    if args.updates < 3 * args.log_interval or args.repeats < 1:
        parser.error("--updates must be >= 3 x --log-interval and --repeats >= 1")
    print(f"stream overhead benchmark: cpus {os.cpu_count()}, load average "
          f"{os.getloadavg()[0]:.1f}, OMP_NUM_THREADS=1", flush=True)
    with tempfile.TemporaryDirectory(prefix="alma-overhead-") as scratch:
        data = prepare(scratch, args.corpus_mb)
        print(f"(a) training loop, {args.updates} updates per stage:", flush=True)
        train = train_speed(data, scratch, args.updates, args.repeats, args.log_interval)
        print("(b) scoring the stream's stage checkpoints:", flush=True)
        score = score_speed(data, train["stream_run"], args.repeats)
        print("(c) scoring's compute alone, same batches, CPU time:", flush=True)
        compute = score_compute(data, train["stream_run"], 2 * args.repeats)
    per_run = int(score["tokens"]) // args.repeats
    rows = [  # (measure, ours, value, stock, value, ratio, target)
        ("training updates/s (all runs pooled)", "alma_stream", train["alma_stream"],
         "language_modeling", train["language_modeling"],
         train["alma_stream"] / train["language_modeling"], 0.95),
        (f"scoring tokens/s ({per_run:,} tokens, pooled)", "alma-score",
         score["tokens"] / score["alma_s"], "fairseq-eval-lm", score["tokens"] / score["stock_s"],
         score["stock_s"] / score["alma_s"], 1.0),
        ("scoring compute alone, tokens/CPU s (same batches)", "score_jointly",
         compute["tokens"] / compute["alma_cpu"], "eval_lm", compute["tokens"] / compute["stock_cpu"],
         compute["stock_cpu"] / compute["alma_cpu"], 1.0),
        ("scoring both checkpoints, wall s per run", "alma-score",
         score["alma_wall"] / args.repeats, "fairseq-eval-lm x2", score["stock_wall"] / args.repeats,
         score["stock_wall"] / score["alma_wall"], 1.0),
    ]
    table = [[what, ours, f"{ours_value:.2f}", stock, f"{stock_value:.2f}", f"{ratio:.2f}x",
              f">={target} {'ok' if ratio >= target else 'BELOW'}"]
             for what, ours, ours_value, stock, stock_value, ratio, target in rows]
    print("\n" + format_table(["measure", "ours", "", "stock fairseq", "", "ratio", "target"], table,
                              left=2), end="")


if __name__ == "__main__":
    main()
