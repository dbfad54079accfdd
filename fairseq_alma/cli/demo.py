"""``alma-demo`` (``make demo``): the main job end to end on the embedded default data.

Steps, each a real command a user could type (printed before it runs), each skipped or resumed
when its outputs already exist, so re-running after an interruption continues:
  1. ``alma-demo-corpus``: a few MB of real English prose from the Python standard library;
  2. ``alma-data-prep``: sentencepiece BPE, shuffled split into mega-batches + eval + valid,
     fairseq binaries and manifest.json;
  3. ``fairseq-train --task language_modeling --arch switch_transformer_lm_tiny``: a tiny Switch
     LM on the first mega-batch (stock fairseq task: the plugin works without our task);
  4. ``fairseq-eval-lm``: perplexity of the trained model on the held-out evaluation mega-batch.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent  # the --user-dir


def tool(name: str) -> str:
    """Console script next to the running interpreter (the venv's), else from PATH."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def step(title: str, cmd: list[str], log: Path) -> str:
    """Run one command, echoing it; output goes to ``log`` and is returned.  Exits on failure."""
    print(f"\n== {title}\n$ {' '.join(shlex.quote(c) for c in cmd)}", flush=True)
    start = time.time()
    with open(log, "w", encoding="utf-8") as fh:
        proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True)
    text = log.read_text(encoding="utf-8", errors="replace")
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-15:])
        raise SystemExit(f"alma-demo: error: step '{title}' failed (exit {proc.returncode}); log: {log}\n{tail}")
    print(f"   done in {time.time() - start:.0f}s (log: {log})", flush=True)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="alma-demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="demo_out", help="working directory for every output (default: demo_out)")
    parser.add_argument("--corpus-mb", type=float, default=3.0, help="size of the demo corpus in MB (default 3)")
    parser.add_argument("--vocab-size", type=int, default=2000, help="BPE vocabulary of the demo (paper: 50000)")
    parser.add_argument("--updates", type=int, default=200, help="training updates (default 200)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes for data preparation")
    args = parser.parse_args(argv)
    if args.updates < 1:
        parser.error(f"--updates must be >= 1 (got {args.updates})")

    out = Path(args.out).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    corpus = out / "corpus" / "demo_corpus.txt"
    data = out / "data"
    ckpt = out / "checkpoints" / "switch_lm_tiny"
    corpus.parent.mkdir(parents=True, exist_ok=True)

    step("1/4 build the demo corpus (Python stdlib prose)",
         [tool("alma-demo-corpus"), "--out", str(corpus), "--max-mb", str(args.corpus_mb)], logs / "corpus.log")
    step("2/4 prepare a 4-mega-batch stream (BPE, split, binarize)",
         [tool("alma-data-prep"), str(corpus), "--out", str(data), "--vocab-size", str(args.vocab_size),
          "--num-megabatches", "4", "--eval-size", "0.16", "--valid-size", "0.04", "--workers", str(args.workers)],
         logs / "data_prep.log")
    train_log = step("3/4 train a tiny Switch Transformer LM on mega-batch 0",
         [tool("fairseq-train"), str(data), "--user-dir", str(PACKAGE_DIR), "--task", "language_modeling",
          "--train-subset", "megabatch0", "--valid-subset", "valid",
          "--arch", "switch_transformer_lm_tiny", "--moe-experts", "4", "--criterion", "switch_cross_entropy",
          "--optimizer", "adam", "--adam-betas", "(0.9, 0.98)", "--lr", "0.002",
          "--lr-scheduler", "polynomial_decay", "--warmup-updates", str(max(1, args.updates // 10)),
          "--total-num-update", str(args.updates), "--max-update", str(args.updates),
          "--tokens-per-sample", "128", "--batch-size", "16", "--dropout", "0.1", "--cpu", "--num-workers", "0",
          "--save-dir", str(ckpt), "--no-epoch-checkpoints", "--log-format", "simple", "--log-interval", "50",
          "--seed", "1"],
         logs / "train.log")
    eval_log = step("4/4 score on the held-out evaluation mega-batch",
         [tool("fairseq-eval-lm"), str(data), "--user-dir", str(PACKAGE_DIR), "--path", str(ckpt / "checkpoint_last.pt"),
          "--gen-subset", "eval", "--tokens-per-sample", "128", "--batch-size", "16", "--cpu", "--num-workers", "0"],
         logs / "eval.log")

    params = re.search(r"switch_transformer_lm: (.*)", train_log)
    valid = re.findall(r"\| valid \|.*?\| ppl ([0-9.]+)", train_log)
    score = re.search(r"Loss \(base 2\): ([0-9.]+), Perplexity: ([0-9.]+)", eval_log)
    print("\n== summary")
    if params:
        print(f"model          : {params.group(1)}")
    if valid:
        print(f"valid ppl      : {valid[-1]}")
    if score:
        print(f"eval mega-batch: loss {score.group(1)} bits/token, perplexity {score.group(2)}")
    print(f"outputs        : {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
