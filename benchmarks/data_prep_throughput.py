"""alma-data-prep throughput (MB of input text per second) with 1 and 2 workers, in one run.

Builds the demo corpus (or takes ``--corpus``), prepares the same stream from scratch once per
worker count (fresh output directory, same flags), and prints wall-clock MB/s for the whole
command and for the two steps ``--workers`` parallelises (BPE encoding and binarization), with
the 2-workers/1-worker ratio, and the CPU seconds each run used (on a machine shared with other
work, equal CPU with a longer wall time means contention, not parallel overhead). Also checks
that both runs wrote byte-identical shards.

The whole-command rate includes fixed costs that do not scale with workers: importing fairseq
(~5 s of CPU), and sentencepiece training (its own ``--spm-threads``). On the few-MB demo
corpus they dominate; the per-step columns show the scaling of the parallel parts.

Usage: python benchmarks/data_prep_throughput.py [--corpus FILE] [--repeats N]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from fairseq_alma.tables import format_table

PREP_FLAGS = ["--vocab-size", "2000", "--valid-size", "0.05", "--spm-threads", "2"]
PARALLEL_STEPS = ("encode", "binarize")  # the steps that --workers parallelises


def _script(name: str) -> list[str]:
    path = os.path.join(os.path.dirname(sys.executable), name)
    module = {"alma-data-prep": "data_prep.cli", "alma-demo-corpus": "data_prep.demo_corpus"}
    return [path] if os.path.exists(path) else [sys.executable, "-m", module[name]]


def _shard_digest(out: str) -> str:
    digest = hashlib.sha256()
    for name in sorted(os.listdir(out)):
        if name.endswith((".bin", ".idx", ".txt", ".model")):
            with open(os.path.join(out, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()


def run_once(corpus: str, workers: int, scratch: str) -> dict:
    out = tempfile.mkdtemp(dir=scratch, prefix=f"w{workers}-")
    cpu_before = _children_cpu_seconds()
    started = time.perf_counter()
    subprocess.run([*_script("alma-data-prep"), corpus, "--out", out, "--workers",
                    str(workers), *PREP_FLAGS], check=True, capture_output=True)
    wall = time.perf_counter() - started
    cpu = _children_cpu_seconds() - cpu_before
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        steps = json.load(f)["step_seconds"]
    return {"wall": wall, "cpu": cpu, **{step: steps[step] for step in PARALLEL_STEPS},
            "digest": _shard_digest(out)}


def _children_cpu_seconds() -> float:
    """User + system CPU of finished child processes (the run and its workers): with the
    wall time it tells parallel speed-up from contention with other load on the machine."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", help="input text file (default: build the demo corpus)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per worker count; the fastest is reported (default: 1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="alma-prep-bench-") as scratch:
        corpus = args.corpus
        if corpus is None:
            corpus = os.path.join(scratch, "demo_corpus.txt")
            subprocess.run([*_script("alma-demo-corpus"), "--out", corpus], check=True,
                           capture_output=True)
        mb = os.path.getsize(corpus) / 1e6
        print(f"corpus: {corpus if args.corpus else 'demo corpus'}, {mb:.2f} MB; "
              f"flags: {' '.join(PREP_FLAGS)}; cpus: {os.cpu_count()}; load average before: "
              f"{os.getloadavg()[0]:.1f}", flush=True)
        results = {}
        for workers in (1, 2):
            runs = [run_once(corpus, workers, scratch) for _ in range(args.repeats)]
            results[workers] = min(runs, key=lambda r: r["wall"])
            best = results[workers]
            print(f"  workers={workers}: {best['wall']:.1f} s wall, {best['cpu']:.1f} s CPU",
                  flush=True)
    columns = ["wall", *PARALLEL_STEPS]
    ratio = {c: results[1][c] / results[2][c] for c in columns}
    table = [[str(workers), *(f"{mb / r[c]:.2f}" for c in columns)] for workers, r in results.items()]
    table.append(["2w / 1w", *(f"{ratio[c]:.2f}x" for c in columns)])
    print("\n" + format_table(["workers", *(f"{c} MB/s" for c in columns)], table), end="")
    same = results[1]["digest"] == results[2]["digest"]
    print(f"\noutputs identical with 1 and 2 workers: {'yes' if same else 'NO'}; "
          f"load average after: {os.getloadavg()[0]:.1f}")
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
