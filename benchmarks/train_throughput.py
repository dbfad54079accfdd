"""End-to-end training speed: the Switch LM against fairseq's own dense LM, tokens/s, one run.

What is compared (issue 24): ``fairseq-train --task alma_stream`` with
  * ``switch_transformer_lm`` with 8 experts (every other block a Switch block),
  * ``switch_transformer_lm`` with 1 expert (a dense transformer plus a router),
  * both again with ``--moe-expert-kernel compiled`` (router and experts as one torch.compile
    graph; its compilation falls in the first window, which is dropped),
  * stock ``transformer_lm`` (pre-LN like ours, shared input/output embeddings),
all of the same sizes (default: 12 layers, d 768, FFN 3072, 12 heads, 24 x 512 tokens per
update, the paper's large model with its per-GPU batch), in each precision (``--fp16`` and
``--bf16`` on GPUs; fp32 on CPU).  The number is fairseq's own ``wps`` (words per second) of its
``train_inner`` log lines: tokens / wall time of each ``--log-interval`` window of the training
loop, data loading and the optimizer included.  The first window of a run is dropped (start-up,
cuDNN/cuBLAS warm-up); a run's speed is the harmonic mean of the rest (= tokens / time, the
windows holding equal token counts).  Once a run has logged its windows it is killed: what
follows (the stage's checkpoint and evaluation) is not training speed.  Configurations run one
after the other in one job on one device, stock first in each precision; ratios are to stock
``transformer_lm`` in the same precision and round (``--rounds``: the median over rounds, with
the range).  Targets: Switch E=8 >= 0.90x and E=1 >= 0.97x.

Data: ``--data`` (an ``alma-data-prep`` stream), or the demo corpus (``alma-demo-corpus``, nothing
downloaded) prepared into a 2-mega-batch stream with an 8,000-piece vocabulary in a temporary
directory.

Usage: python benchmarks/train_throughput.py [--data DIR] [--precisions fp16,bf16] [--windows 4]
       python benchmarks/train_throughput.py --tiny        # CPU, tiny model: the test suite's check
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
USER_DIR = os.path.join(REPO, "fairseq_alma")
WINDOW = re.compile(r"\| train_inner \| epoch \d+:.*?\bwps=([0-9.]+)")
MODELS = {  # name: fairseq flags beyond the shared sizes
    # fairseq keeps --decoder-input-dim/--decoder-output-dim at 512 unless given: without them the
    # baseline had 512-wide embeddings and output layer whatever --dim said (alma_stream now refuses that)
    "transformer_lm": "--arch transformer_lm --decoder-normalize-before --share-decoder-input-output-embed "
                      "--decoder-input-dim {dim} --decoder-output-dim {dim} --criterion cross_entropy",
    "switch E=1": "--arch switch_transformer_lm --moe-experts 1 --criterion switch_cross_entropy",
    "switch E=8": "--arch switch_transformer_lm --moe-experts 8 --criterion switch_cross_entropy",
    "switch E=1 compiled": "--arch switch_transformer_lm --moe-experts 1 --criterion switch_cross_entropy "
                           "--moe-expert-kernel compiled",
    "switch E=8 compiled": "--arch switch_transformer_lm --moe-experts 8 --criterion switch_cross_entropy "
                           "--moe-expert-kernel compiled",
}
PRECISION_FLAGS = {"fp32": [], "fp16": ["--fp16"], "bf16": ["--bf16"]}


def _tool(name: str) -> str:
    path = os.path.join(os.path.dirname(sys.executable), name)
    return path if os.path.exists(path) else name


def prepare(scratch: str, vocab: int, corpus_mb: float) -> str:
    corpus, data = os.path.join(scratch, "corpus.txt"), os.path.join(scratch, "data")
    for cmd in ([_tool("alma-demo-corpus"), "--out", corpus, "--max-mb", str(corpus_mb)],
                [_tool("alma-data-prep"), corpus, "--out", data, "--vocab-size", str(vocab), "--num-megabatches",
                 "2", "--eval-size", "0.02", "--valid-size", "0.01", "--workers", "2"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"train_throughput: {shlex.join(cmd)} failed:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return data


def train_command(args: argparse.Namespace, data: str, model: str, precision: str, save_dir: str) -> list[str]:
    sizes = (f"--decoder-layers {args.layers} --decoder-embed-dim {args.dim} --decoder-ffn-embed-dim "
             f"{4 * args.dim} --decoder-attention-heads {args.heads} --tokens-per-sample {args.length} "
             f"--batch-size {args.batch}")
    updates = (args.windows + 1) * args.log_interval + 5  # killed after its windows; never reached
    common = (f"--user-dir {USER_DIR} --task alma_stream --wait 1 --updates-per-stage {updates} "
              f"--optimizer adam --adam-betas (0.9,0.98) --lr 5e-4 --lr-scheduler alma_stage_linear "
              f"--warmup-updates {args.log_interval} --dropout 0.1 --seed 1 --log-format simple "
              f"--log-interval {args.log_interval} --max-epoch 1")
    device = ["--cpu", "--num-workers", "0"] if args.tiny else []
    return [_tool("fairseq-train"), data, *shlex.split(common), *shlex.split(sizes), *shlex.split(MODELS[model].format(dim=args.dim)),
            *PRECISION_FLAGS[precision], *device, "--save-dir", save_dir]


def measure(cmd: list[str], windows: int, timeout: float) -> list[float]:
    """wps of the first ``windows + 1`` train_inner windows (the first dropped); then kill."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    found: list[float] = []
    tail: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            tail = (tail + [line])[-40:]
            match = WINDOW.search(line)
            if match:
                found.append(float(match.group(1)))
                if len(found) > windows:
                    break
            if time.monotonic() > deadline:
                break
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    if len(found) <= windows:
        sys.exit(f"train_throughput: {len(found)} of {windows + 1} windows from {shlex.join(cmd)}:\n"
                 + "".join(tail)[-3000:])
    return found[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", help="a prepared stream (default: the demo corpus, prepared here)")
    parser.add_argument("--precisions", default=None, help="fp16,bf16 on GPUs (default); fp32 on CPU")
    parser.add_argument("--models", default=",".join(MODELS), help=f"any of: {', '.join(MODELS)}")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=768, help="model width (FFN = 4 x dim)")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--length", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--batch", type=int, default=24, help="sequences per update")
    parser.add_argument("--log-interval", type=int, default=10, help="updates per wps window")
    parser.add_argument("--windows", type=int, default=4, help="timed windows per run (after the first)")
    parser.add_argument("--vocab", type=int, default=8000, help="BPE pieces of the demo stream")
    parser.add_argument("--corpus-mb", type=float, default=3.0, help="size of the demo corpus")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of every configuration, interleaved; a "
                        "ratio is taken within its round and the median over rounds is reported")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run before giving up")
    parser.add_argument("--tiny", action="store_true", help="CPU, 2 layers of d 64: checks the script runs")
    parser.add_argument("--json", help="also write the results to this JSON file")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.dim, args.heads, args.length, args.batch = 2, 64, 4, 64, 4
        args.log_interval, args.windows, args.vocab, args.corpus_mb = 2, 2, 600, 0.3
    precisions = (args.precisions or ("fp32" if args.tiny else "fp16,bf16")).split(",")
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS] + [p for p in precisions if p not in PRECISION_FLAGS]
    if unknown:
        parser.error(f"unknown --models/--precisions: {', '.join(unknown)}")

    import torch

    from fairseq_alma.text_table import format_table

    device = "CPU" if args.tiny else (torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")
    print(f"training throughput on {device}: {args.layers} layers, d {args.dim}, FFN {4 * args.dim}, "
          f"{args.heads} heads, {args.batch} x {args.length} tokens per update, torch {torch.__version__}",
          flush=True)
    results: dict = {"device": device, "torch": torch.__version__, "rows": []}
    with tempfile.TemporaryDirectory(prefix="alma-throughput-") as scratch:
        data = args.data or prepare(scratch, args.vocab, args.corpus_mb)
        rounds: list[dict[tuple[str, str], float]] = []
        for round_index in range(args.rounds):
            speed: dict[tuple[str, str], float] = {}
            for precision in precisions:
                for model in models:
                    save = os.path.join(scratch, f"run-{round_index}-{precision}-{len(speed)}")
                    cmd = train_command(args, data, model, precision, save)
                    windows = measure(cmd, args.windows, args.timeout)
                    speed[precision, model] = statistics.harmonic_mean(windows)
                    print(f"  round {round_index + 1} {precision} {model:<20} {speed[precision, model]:>10,.0f} "
                          f"tokens/s (windows: {', '.join(f'{w:,.0f}' for w in windows)})", flush=True)
            rounds.append(speed)
    table = []
    for key in rounds[0]:
        precision, model = key
        wps = statistics.median(r[key] for r in rounds)
        ratios = [r[key] / r[(precision, "transformer_lm")] for r in rounds if (precision, "transformer_lm") in r]
        ratio = statistics.median(ratios) if ratios else None
        results["rows"].append({"precision": precision, "model": model, "wps": wps, "ratio_to_stock": ratio,
                                "wps_by_round": [r[key] for r in rounds], "ratio_by_round": ratios})
        spread = f" ({min(ratios):.2f}-{max(ratios):.2f})" if len(ratios) > 1 else ""
        table.append([precision, model, f"{wps:,.0f}", "-" if ratio is None else f"{ratio:.2f}x{spread}"])
    print(format_table(["precision", "model", "tokens/s (fairseq wps)", "x transformer_lm"], table, left=2),
          end="", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
