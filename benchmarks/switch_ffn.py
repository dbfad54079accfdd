"""SwitchFFN vs a dense FFN of the same width: forward+backward time and peak memory.

Issue #2's protocol: d 512, FFN 2048, 8192 tokens, capacity factor 1.0, E in {4, 8, 16, 64},
2 threads, ratios to the dense FFN measured in the same run.  Targets: time <= 0.95x dense at
E <= 16 and <= 1.10x at E = 64; peak memory beyond parameters and their gradients <= dense +25%.

Peak memory on CPU: torch has no CPU allocator statistics, so every measurement runs in a fresh
subprocess and reads the process's peak RSS (``ru_maxrss``) over one forward+backward, minus the
RSS once parameters and the input exist, minus the bytes of the gradients that backward creates.
Gradients start as None, as in training (optimizers zero them with ``set_to_none``), so autograd
stores each new gradient without an extra accumulation copy.  Large tensors are mmap-allocated by
glibc and returned on free, so the high-water mark is the true peak.

Usage: python benchmarks/switch_ffn.py [--tokens 8192] [--experts 4,8,16,64] [--repeats 5] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def build(kind: str, experts: int, d: int, f: int):
    from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig
    from fairseq_alma.modules.switch_decoder_layer import DenseFFN

    if kind == "dense":
        return DenseFFN(d, f, "relu", 0.0)
    return SwitchFFN(SwitchFFNConfig(d, f, experts, capacity_factor=1.0))


def rss_kib() -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure_one(kind: str, experts: int, tokens: int, d: int, f: int, repeats: int, seed: int) -> dict:
    """Runs inside the child process: one configuration, time and peak memory."""
    torch.set_num_threads(2)
    torch.manual_seed(seed)
    layer = build(kind, experts, d, f).train()
    x = torch.randn(tokens, d, requires_grad=True)
    grad_kib = (sum(p.numel() * p.element_size() for p in layer.parameters()) + x.numel() * x.element_size()) / 1024
    base_kib = rss_kib()

    def step() -> float:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        t0 = time.perf_counter()
        y, aux = layer(x)
        loss = y.float().pow(2).mean()
        if aux is not None:
            loss = loss + 0.01 * aux.balance_loss
        loss.backward()
        return time.perf_counter() - t0

    step()  # first call: allocator warm-up; its peak counts (same for every kind)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times = [step() for _ in range(repeats)]
    dropped = 0.0
    if kind != "dense":
        with torch.no_grad():
            _, aux = layer(x)
            dropped = float(aux.diagnostics["dropped"] / aux.diagnostics["tokens"])
    return {
        "time_s": statistics.median(times),
        "peak_extra_mib": (peak_kib - base_kib - grad_kib) / 1024.0,
        "dropped_frac": dropped,
    }


def run_child(kind: str, experts: int, args: argparse.Namespace) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        kind,
        str(experts),
        "--tokens",
        str(args.tokens),
        "--dim",
        str(args.dim),
        "--ffn",
        str(args.ffn),
        "--repeats",
        str(args.repeats),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per forward (default 8192)")
    parser.add_argument("--dim", type=int, default=512, help="model width d (default 512)")
    parser.add_argument("--ffn", type=int, default=2048, help="FFN width (default 2048)")
    parser.add_argument("--experts", default="4,8,16,64", help="comma-separated expert counts")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per configuration (median)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="interleaved rounds of dense + every E; ratios are per round, median reported")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "E"), help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.child:
        kind, experts = args.child[0], int(args.child[1])
        print(json.dumps(measure_one(kind, experts, args.tokens, args.dim, args.ffn, args.repeats, seed=0)))
        return

    experts_list = [int(e) for e in args.experts.split(",")]
    print(f"SwitchFFN vs dense FFN: d={args.dim} ffn={args.ffn} tokens={args.tokens} "
          f"capacity_factor=1.0 threads=2 rounds={args.rounds} torch={torch.__version__}", flush=True)
    # Rounds interleave dense and every E, so a slow spell of a shared machine hits both sides of
    # a ratio; each ratio is taken within its round and the median over rounds is reported.
    rows: dict[int, list[dict]] = {e: [] for e in experts_list}
    dense_runs: list[dict] = []
    for round_index in range(args.rounds):
        dense = run_child("dense", 0, args)
        dense_runs.append(dense)
        for experts in experts_list:
            r = run_child("switch", experts, args)
            r["time_ratio"] = r["time_s"] / dense["time_s"]
            r["mem_ratio"] = r["peak_extra_mib"] / dense["peak_extra_mib"]
            rows[experts].append(r)
        print(f"round {round_index + 1}/{args.rounds}: dense {dense['time_s'] * 1000:.0f} ms, x dense "
              + " ".join(f"E={e}:{rows[e][-1]['time_ratio']:.2f}" for e in experts_list), flush=True)
    med = statistics.median
    print(f"dense FFN: {med(d['time_s'] for d in dense_runs) * 1000:.1f} ms fwd+bwd, "
          f"peak extra {med(d['peak_extra_mib'] for d in dense_runs):.0f} MiB", flush=True)
    from fairseq_alma.tables import format_table

    table = []
    for experts in experts_list:
        runs = rows[experts]
        table.append([str(experts), f"{med(r['time_s'] for r in runs) * 1000:.1f}",
                      f"{med(r['time_ratio'] for r in runs):.2f}",
                      f"{med(r['peak_extra_mib'] for r in runs):.0f}",
                      f"{med(r['mem_ratio'] for r in runs):.2f}", f"{100 * runs[0]['dropped_frac']:.1f}%"])
    print(format_table(["E", "time ms", "x dense", "peak MiB", "x dense", "dropped"], table, left=0),
          end="", flush=True)


if __name__ == "__main__":
    main()
