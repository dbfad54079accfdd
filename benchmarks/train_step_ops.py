"""Host work of one whole training update, by phase: stock ``transformer_lm`` against the Switch LM.

Why: on a GPU our training step is bound by the host (README, "Speed and memory"): each aten
operation costs ~10 µs to dispatch and launch, whatever its size, so the operations an update
runs bound its speed.  ``switch_ffn.py --ops`` counts one Switch layer; this counts a whole
``fairseq-train --task alma_stream`` update (the real trainer, criterion, optimizer and logging,
in the process fairseq-train runs in) and says which phase the operations come from:

  forward    the criterion's forward (model, loss, auxiliary losses, diagnostics)
  backward   ``loss.backward()`` (autograd, custom backward functions)
  optimizer  gradient clipping and the optimizer step
  logging    the criterion's ``reduce_metrics`` and fairseq's meters (every update)
  trainer    the rest of ``Trainer.train_step``

Operations are counted at the dispatcher (``TorchDispatchMode``: what runs below autograd, the
level at which a GPU kernel is launched), for update ``--at`` of a run on CPU (fp32; the counts do
not depend on widths, so the run uses d 64, 4 x 64 tokens).  Switch models run the GPU's eager
kernel (``--moe-expert-kernel batched``); the compiled kernel is counted by ``switch_ffn.py --ops``.

Usage: python benchmarks/train_step_ops.py [--layers 12] [--models transformer_lm,switch E=1,switch E=8]
       python benchmarks/train_step_ops.py --tiny        # 2 layers: the test suite's check
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, REPO)
from train_throughput import MODELS, prepare, train_command  # noqa: E402

PHASES = ("forward", "backward", "optimizer", "logging", "trainer")
EAGER = [model for model in MODELS if "compiled" not in model]  # train_throughput's models


def phase_of(frames: list[traceback.FrameSummary]) -> str:
    """The phase of an operation from the Python stack it was called from (outermost first):
    the first frame that names one wins."""
    for frame in frames:
        path, name = frame.filename.replace(os.sep, "/"), frame.name
        if "/fairseq/optim/" in path:
            return "backward" if name == "backward" else "optimizer"
        if path.endswith("/fairseq/trainer.py") and name == "clip_grad_norm":
            return "optimizer"
        if name in ("_reduce_and_log_stats", "reduce_metrics") or "/fairseq/logging/" in path:
            return "logging"
        if "/criterions/" in path:  # fairseq's or ours: the criterion's forward
            return "forward"
    return "trainer"


def count_update(trainer_class: type, at: int, out: str) -> None:
    """Wrap ``trainer_class.train_step`` so that update ``at`` counts its operations by phase
    into the JSON file ``out``."""
    from torch.utils._python_dispatch import TorchDispatchMode

    original = trainer_class.train_step
    calls = [0]

    def train_step(self, samples, raise_oom=False):
        calls[0] += 1
        if calls[0] != at:
            return original(self, samples, raise_oom)
        counts: collections.Counter = collections.Counter()
        main = threading.get_ident()

        class Count(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                # the autograd engine runs CUDA backward on its own threads
                phase = "backward" if threading.get_ident() != main else phase_of(traceback.extract_stack()[:-2])
                counts[phase] += 1
                return func(*args, **(kwargs or {}))

        with Count():
            result = original(self, samples, raise_oom)
        with open(out, "w") as fh:
            json.dump({phase: counts[phase] for phase in PHASES}, fh)
        return result

    trainer_class.train_step = train_step


def worker(out: str, at: int, fairseq_args: list[str]) -> None:
    """Run fairseq-train (its own ``cli_main``) in this process with update ``at`` counted."""
    from fairseq import trainer
    from fairseq_cli.train import cli_main

    count_update(trainer.Trainer, at, out)
    sys.argv = ["fairseq-train", *fairseq_args]
    cli_main()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], int(sys.argv[3]), sys.argv[5:])  # --worker OUT AT -- ARGS...
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(EAGER), help=f"any of: {', '.join(EAGER)}")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (the paper's large model: 12)")
    parser.add_argument("--at", type=int, default=4, help="the update counted (after warm-up)")
    parser.add_argument("--data", help="a prepared stream (default: the demo corpus, prepared here)")
    parser.add_argument("--tiny", action="store_true", help="2 layers: checks the script runs")
    parser.add_argument("--json", help="also write the counts to this JSON file")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in EAGER]
    if unknown:
        parser.error(f"unknown --models: {', '.join(unknown)}")
    if args.at < 1 or args.layers < 1:
        parser.error("--at and --layers must be >= 1")
    if args.tiny:
        args.layers = 2
    sizes = argparse.Namespace(layers=args.layers, dim=64, heads=4, length=64, batch=4, windows=1,
                               log_interval=args.at, tiny=True)  # train_command's sizes; --cpu
    import torch

    from fairseq_alma.text_table import format_table

    print(f"aten operations of update {args.at} of fairseq-train --task alma_stream, by phase "
          f"({args.layers} layers, CPU, fp32, torch {torch.__version__})", flush=True)
    with tempfile.TemporaryDirectory(prefix="alma-step-ops-") as scratch:
        data = args.data or prepare(scratch, 600, 0.3)
        def count(index: int, model: str) -> dict[str, int]:
            out = os.path.join(scratch, f"ops-{index}.json")
            cmd = train_command(sizes, data, model, "fp32", os.path.join(scratch, f"run-{index}"))
            flags = cmd[1:] + (["--moe-expert-kernel", "batched"] if model.startswith("switch") else [])
            flags[flags.index("--updates-per-stage") + 1] = str(args.at + 1)
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", out, str(args.at), "--",
                                   *flags], capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            if proc.returncode != 0 or not os.path.exists(out):
                text = proc.stdout + proc.stderr
                said = [line for line in text.splitlines() if line.startswith("fairseq-alma: error")]
                sys.exit(f"train_step_ops: {model}: {said[-1] if said else chr(10) + text[-3000:]}")
            with open(out) as fh:
                return json.load(fh)

        with ThreadPoolExecutor(max_workers=2) as pool:  # counts do not depend on timing
            counts = dict(zip(models, pool.map(count, range(len(models)), models)))
    base = counts.get("transformer_lm")
    rows = []
    for model, phases in counts.items():
        total = sum(phases.values())
        ratio = f"{total / sum(base.values()):.2f}x" if base else "-"
        rows.append([model, *(str(phases[p]) for p in PHASES), str(total), ratio])
    print(format_table(["model", *PHASES, "total", "x transformer_lm"], rows, left=2), end="", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"layers": args.layers, "at": args.at, "counts": counts}, fh, indent=1)


if __name__ == "__main__":
    main()
