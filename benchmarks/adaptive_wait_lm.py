"""The LM stream of ``benchmarks/adaptive_wait.py``: fixed waiting times and ``--wait auto``
through ``fairseq-train --task alma_stream``, each run a process of its own.

Protocol (fixed before the runs): the embedded demo corpus (Python stdlib prose, 1.5 MB, nothing
downloaded) prepared into B = 8 mega-batches (vocabulary 1,000; 4% evaluation, 2% validation);
the tiny Switch LM (2 experts) at two sizes, d 64 / FFN 128 and d 128 / FFN 256; U = 40
updates per stage (the same for auto: every stage gets U), 64 tokens per sample, batch 8, Adam
lr 0.003 with ``alma_stage_linear``; w in {1, 2, 4, 8} and auto; seeds 1, 2, 3.  Anytime NLL:
the mean over arrivals 1..B of the evaluation mega-batch's cross-entropy (bits per token) of
the model the learner has then (the initialised one before its first stage), as ``alma-score``
computes it.

Not a script: ``python benchmarks/adaptive_wait.py`` runs this stream (``--no-lm`` skips it).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from fairseq_alma.demos.steps import tool
from fairseq_alma.fairseq_glue.user_dir import PLUGIN_DIR
from fairseq_alma.stream.run_view import RunView

B = 8
SIZES = {"d64": ["--decoder-embed-dim", "64", "--decoder-ffn-embed-dim", "128"],
         "d128": ["--decoder-embed-dim", "128", "--decoder-ffn-embed-dim", "256"]}
TRAIN = ["--task", "alma_stream", "--arch", "switch_transformer_lm_tiny", "--moe-experts", "2",
         "--criterion", "switch_cross_entropy", "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)",
         "--lr", "0.003", "--lr-scheduler", "alma_stage_linear", "--warmup-updates", "2",
         "--tokens-per-sample", "64", "--batch-size", "8", "--dropout", "0.1", "--cpu",
         "--num-workers", "0", "--log-format", "simple", "--log-interval", "100"]


@dataclass(frozen=True)
class LmRun:
    size: str
    wait: str
    seed: int

    @property
    def name(self) -> str:
        return f"sm_{self.size}_w{self.wait}_s{self.seed}"


def stream_shape(quick: bool) -> tuple[int, int]:
    """(mega-batches, vocabulary) of the stream: the protocol's, or ``--quick``'s tiny one."""
    return (4, 500) if quick else (B, 1000)


def lm_stream_problem(out: Path, quick: bool) -> str | None:
    """One line when ``out/data`` holds a stream of the other mode (``--quick`` or not): it
    would be reused, and the finished runs of that mode, named alike, with it."""
    manifest = out / "data" / "manifest.json"
    if not manifest.is_file():
        return None
    try:
        fields = json.loads(manifest.read_text(encoding="utf-8"))
        found = (int(fields["num_megabatches"]), int(fields["sentencepiece"]["vocab_size"]))
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"{manifest}: unreadable ({err}); use another --out"
    wanted = stream_shape(quick)
    if found == wanted:
        return None
    return (f"{manifest.parent} holds an LM stream of B={found[0]}, vocabulary {found[1]}, and this "
            f"run{' (--quick)' if quick else ''} needs B={wanted[0]}, vocabulary {wanted[1]}; "
            f"use another --out")


def prepare(out: Path, quick: bool) -> Path:
    """The stream, once (a finished one of the same shape is reused)."""
    data = out / "data"
    problem = lm_stream_problem(out, quick)
    if problem:
        raise RuntimeError(problem)
    if (data / "manifest.json").is_file():
        return data
    out.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus.txt"
    megabatches, vocab_size = stream_shape(quick)
    subprocess.run([tool("alma-demo-corpus"), "--out", str(corpus), "--max-mb",
                    "0.3" if quick else "1.5"], check=True, capture_output=True)
    subprocess.run([tool("alma-data-prep"), str(corpus), "--out", str(data), "--vocab-size",
                    str(vocab_size), "--num-megabatches", str(megabatches),
                    "--eval-size", "0.04", "--valid-size", "0.02", "--workers", "1"],
                   check=True, capture_output=True)
    return data


def train(run: LmRun, data: Path, out: Path, updates: int, megabatches: int) -> list:
    save = out / "runs" / run.name
    done = RunView(save).finished_records(megabatches)
    if done is not None:
        return done
    cmd = [tool("fairseq-train"), str(data), "--user-dir", str(PLUGIN_DIR), *TRAIN,
           *SIZES[run.size], "--wait", run.wait, "--updates-per-stage", str(updates),
           "--seed", str(run.seed), "--save-dir", str(save)]
    log = out / "logs" / f"{run.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    with open(log, "a") as handle:  # an earlier attempt's log is kept
        proc = subprocess.run(cmd, stdout=handle, stderr=subprocess.STDOUT, env=env)
    records = RunView(save).finished_records(megabatches)
    if proc.returncode != 0 or records is None:
        raise RuntimeError(f"{run.name} failed (exit {proc.returncode}); log: {log}")
    print(f"   {run.name}: done", flush=True)
    return records


def anytime_bits(records: list) -> float:
    """Mean eval cross-entropy over arrivals 1..B, bits per token (records hold nats)."""
    return statistics.mean(r.eval_nll for r in records[1:]) / math.log(2)


def run_lm(out: Path, seeds: list[int], quick: bool) -> dict:
    """Every (size, w, seed) run, two processes at a time; rows per size as in
    ``adaptive_wait.summarise`` (``cer`` holds the anytime NLL in bits)."""
    data = prepare(out, quick)
    megabatches, updates = (4, 6) if quick else (B, 40)
    sizes = ["d64"] if quick else list(SIZES)
    waits = [str(w) for w in ((1,) if quick else (1, 2, 4, 8))] + ["auto"]
    seeds = seeds[:1] if quick else seeds
    runs = [LmRun(size, wait, seed) for size in sizes for wait in waits for seed in seeds]
    print(f"== lm: B={megabatches}, U={updates} updates per stage, sizes {sizes}, w in {waits}, "
          f"seeds {seeds} ({len(runs)} fairseq-train runs, 2 at a time)", flush=True)
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = dict(zip(runs, pool.map(lambda r: train(r, data, out, updates, megabatches), runs)))
    table = {}
    for size in sizes:
        rows = {}
        for wait in waits:
            group = [results[LmRun(size, wait, seed)] for seed in seeds]
            metric = [anytime_bits(records) for records in group]
            rows[wait] = {
                "cer": statistics.mean(metric),
                "cer_std": statistics.stdev(metric) if len(metric) > 1 else 0.0,
                "final_error": statistics.mean(records[-1].eval_nll / math.log(2) for records in group),
                "compute": statistics.mean(records[-1].train_flops_cum for records in group),
                "mem": statistics.mean(sum(r.params_active for r in records) for records in group),
                "params": statistics.mean(records[-1].params_active for records in group),
                "seeds": len(group)}
        table[size] = rows
    return table


if __name__ == "__main__":
    # Imported by adaptive_wait.py, which runs this stream; run directly it would do nothing.
    MESSAGE = ("adaptive_wait_lm.py is the LM stream of benchmarks/adaptive_wait.py, not a script: "
               "run python benchmarks/adaptive_wait.py (--no-lm skips this stream, --quick runs a "
               "tiny one; --help lists the rest)")
    if sys.argv[1:] in (["--help"], ["-h"]):
        print(MESSAGE)
        sys.exit(0)
    print(f"adaptive_wait_lm.py: error: {MESSAGE}", file=sys.stderr)
    sys.exit(2)
