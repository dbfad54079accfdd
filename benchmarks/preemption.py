"""How long a preempted run takes to save and exit, and how big what it saves is.

Slurm sends SIGUSR1 ``--signal=B:USR1@N`` seconds before a job's time limit (and kills the job
KillWait seconds after SIGTERM on preemption).  An ``alma_stream`` run finishes the update in
progress, writes ``checkpoint_last.pt`` only and exits with status 75.  This measures, for the
paper's base model (switch_transformer_lm_base, 8 experts in 12 growth slots) on this CPU:
seconds from the signal to the exit, the save's own seconds, and the checkpoint's bytes, so
``slurm/README.md`` can say which lead time to set for a checkpoint of N GB.

    python benchmarks/preemption.py [--experts 8 --max-experts 12 --repeats 2]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def prepare(root: Path) -> Path:
    subprocess.run([BIN / "alma-demo-corpus", "--out", root / "corpus.txt", "--max-mb", "0.3"],
                   check=True, capture_output=True)
    subprocess.run([BIN / "alma-data-prep", root / "corpus.txt", "--out", root / "data",
                    "--vocab-size", "2000", "--num-megabatches", "2", "--eval-size", "0.05",
                    "--valid-size", "0.05", "--workers", "1"], check=True, capture_output=True)
    return root / "data"


def one_run(data: Path, save: Path, args: argparse.Namespace) -> dict[str, float]:
    cmd = [BIN / "fairseq-train", data, "--user-dir", Path(__file__).resolve().parents[1] / "fairseq_alma",
           "--task", "alma_stream", "--arch", "switch_transformer_lm_base", "--moe-experts",
           str(args.experts), "--moe-max-experts", str(args.max_experts), "--criterion",
           "switch_cross_entropy", "--optimizer", "adam", "--lr", "0.0005", "--lr-scheduler",
           "alma_stage_linear", "--warmup-updates", "10", "--updates-per-stage", "1000",
           "--tokens-per-sample", "128", "--batch-size", "2", "--cpu", "--num-workers", "0",
           "--log-format", "simple", "--log-interval", "1", "--save-dir", save]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=env)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "num_updates=3," in line:
            break
    signalled = time.perf_counter()
    proc.send_signal(signal.SIGUSR1)
    lines += proc.stdout.readlines()
    proc.wait()
    exit_seconds = time.perf_counter() - signalled
    text = "".join(lines)
    saved = re.search(r"checkpoint saved in ([0-9.]+)s", text)
    assert proc.returncode == 75 and saved, text[-3000:]
    return {"exit_s": exit_seconds, "save_s": float(saved.group(1)),
            "bytes": (save / "checkpoint_last.pt").stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--max-experts", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    from fairseq_alma.text_table import format_table

    with tempfile.TemporaryDirectory() as tmp:
        data = prepare(Path(tmp))
        runs = [one_run(data, Path(tmp) / f"run{i}", args) for i in range(args.repeats)]
    rows = [[str(i + 1), f"{r['exit_s']:.2f}", f"{r['save_s']:.2f}",
             f"{r['exit_s'] - r['save_s']:.2f}", f"{r['bytes'] / 1e9:.3f}",
             f"{r['bytes'] / 1e9 / max(r['save_s'], 1e-9):.2f}"] for i, r in enumerate(runs)]
    print(format_table(["run", "signal to exit s", "save s", "rest (update, exit) s",
                        "checkpoint GB", "save GB/s"], rows, left=0), end="")


if __name__ == "__main__":
    main()
