"""SwitchFFN vs a dense FFN of the same width: forward+backward time and peak memory.

CPU (default; issue #2's protocol): d 512, FFN 2048, 8192 tokens, capacity factor 1.0,
E in {4, 8, 16, 64}, 2 threads, ratios to the dense FFN measured in the same run.  Targets:
time <= 0.95x dense at E <= 16 and <= 1.10x at E = 64; peak memory beyond parameters and their
gradients <= dense +25%.  Peak memory on CPU: torch has no CPU allocator statistics, so every
measurement runs in a fresh subprocess and reads the process's peak RSS (``ru_maxrss``) over one
forward+backward, minus the RSS once parameters and the input exist, minus the bytes of the
gradients that backward creates.  Gradients start as None, as in training (optimizers zero them
with ``set_to_none``).  Large tensors are mmap-allocated by glibc and returned on free, so the
high-water mark is the true peak.

CUDA (``--device cuda``; issue 24's protocol): 12288 tokens (24 x 512, the paper's per-GPU
share of its 192-sequence batch) with the all-False padding mask the LM always passes, capacity
factor 1.0, ReLU, d 512 / FFN 2048 and d 768 / FFN 3072, E in {4, 8, 12, 64}, in each precision
a fairseq run can use: ``fp16`` (the layer and input in fp16, as ``--fp16``), ``amp`` (float32
layer under fp16 autocast, as ``--amp``), ``bf16`` (the layer and input in bf16, as ``--bf16``).
One process; every configuration is timed with CUDA events around forward+backward after a
warm-up, median of ``--repeats``; the dense FFN of the same width and precision is timed
alongside in each of ``--rounds`` interleaved rounds and ratios are taken within a round (median
reported); ``x back-to-back`` times ``--repeats`` steps queued without waiting in between (as
consecutive layers of a model run: host and device overlap).  Peak memory:
``torch.cuda.max_memory_allocated`` over one forward+backward minus
what was allocated before it (parameters, input) minus the gradients it creates.  Targets:
time <= 1.3x dense at E = 4, 8, 12 in bf16 (<= 1.6x in fp16), peak memory <= 1.3x dense.

``--ops``: aten operations recorded by the profiler for one training forward+backward (balance
loss included) of the GPU path (``batched`` kernel) and of the dense FFN, on CPU; the
number of top-level, non-view operations is about the number of CUDA kernels launched.
``tests/test_benchmarks.py`` holds it (``OP_LIMIT``).  The ``compiled`` kernel's line adds the
kernels inductor generated for it (C++ on CPU, Triton on a GPU).

Usage: python benchmarks/switch_ffn.py [--device cpu|cuda] [--tokens N] [--experts 4,8,16,64]
       [--repeats 5] [--rounds 5] [--ops] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VIEW_OPS = frozenset({"aten::view", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze",
                      "aten::transpose", "aten::t", "aten::reshape", "aten::expand", "aten::as_strided",
                      "aten::alias", "aten::detach", "aten::unbind", "aten::permute", "aten::_unsafe_view",
                      "aten::lift_fresh", "aten::empty", "aten::empty_like", "aten::new_empty"})


def build(kind: str, experts: int, d: int, f: int, kernel: str = "auto"):
    from fairseq_alma.models.switch_decoder_layer import DenseFFN
    from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig

    if kind == "dense":
        return DenseFFN(d, f, "relu", 0.0)
    # z-loss off: the LM computes it only when --moe-z-loss-weight > 0 (default 0)
    return SwitchFFN(SwitchFFNConfig(d, f, experts, capacity_factor=1.0, expert_kernel=kernel))


def training_step(layer, x, padding, grad_y) -> None:
    """One forward+backward as the LM's criterion does it: the output and the balance loss
    (``moe_losses`` over the router's sums, as switch_cross_entropy forms it)."""
    from fairseq_alma.modules.switch_routing import moe_losses

    if padding is None:
        y, _ = layer(x)
        y.backward(grad_y)
        return
    y, aux = layer(x, padding)
    balance, _ = moe_losses(aux.counts.unsqueeze(0), aux.prob_sums.unsqueeze(0), aux.prob_sums.new_zeros(1))
    torch.autograd.backward([y, balance.sum()], [grad_y, torch.full((), 0.01, device=x.device)])


# ---- op counts --------------------------------------------------------------------------------
def op_counts(kind: str, experts: int = 8, kernel: str = "batched") -> dict:
    """aten ops of one training forward+backward on CPU (module doc, ``--ops``)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    layer = build(kind, experts, 64, 128, kernel).train()
    x = torch.randn(4, 128, 64, requires_grad=True)
    padding = None if kind == "dense" else torch.zeros(4, 128, dtype=torch.bool)
    grad_y = torch.randn(4, 128, 64)

    def step() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None
        training_step(layer, x, padding, grad_y)

    from torch._inductor import metrics

    metrics.reset()
    step()  # compiles, for the compiled kernel: the kernels it generates are counted here
    generated = metrics.generated_kernel_count
    step()  # a second call with the graph compiled: nothing generated in the profiled step
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    top = [e for e in events if e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")]
    return {"aten_ops": len(events), "launch_ops": sum(e.name not in VIEW_OPS for e in top),
            "generated_kernels": generated}


def print_op_counts() -> dict:
    """Eager paths: aten ops.  The compiled kernel: the aten ops left outside its generated code
    (matmuls, the balance loss) plus the kernels inductor generated for the layer's forward and
    backward (C++ here; on a GPU Triton, fused much the same way)."""
    counts = {"dense": op_counts("dense"), "switch_batched": op_counts("switch"),
              "switch_compiled": op_counts("switch", kernel="compiled")}
    for name, c in counts.items():
        generated = f" + {c['generated_kernels']} generated kernels" if c["generated_kernels"] else ""
        print(f"ops {name}: {c['aten_ops']} aten ops, {c['launch_ops']} top-level non-view ops{generated} "
              f"(~kernel launches) per forward+backward", flush=True)
    return counts


# ---- CPU: one configuration per subprocess ---------------------------------------------------
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
            diagnostics = aux.diagnostics
            dropped = float(diagnostics["dropped"] / diagnostics["tokens"])
    return {
        "time_s": statistics.median(times),
        "peak_extra_mib": (peak_kib - base_kib - grad_kib) / 1024.0,
        "dropped_frac": dropped,
    }


def run_child(kind: str, experts: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, str(experts), "--tokens", str(args.tokens),
           "--dim", str(args.dim), "--ffn", str(args.ffn), "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_benchmark(args: argparse.Namespace) -> dict:
    experts_list = [int(e) for e in args.experts.split(",")]
    print(f"SwitchFFN vs dense FFN on CPU: d={args.dim} ffn={args.ffn} tokens={args.tokens} "
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
    from fairseq_alma.text_table import format_table

    table, result = [], {"device": "cpu", "dense_ms": med(d["time_s"] for d in dense_runs) * 1000, "rows": []}
    for experts in experts_list:
        runs = rows[experts]
        row = {"experts": experts, "time_ms": med(r["time_s"] for r in runs) * 1000,
               "time_ratio": med(r["time_ratio"] for r in runs), "mem_ratio": med(r["mem_ratio"] for r in runs),
               "peak_mib": med(r["peak_extra_mib"] for r in runs), "dropped_pct": 100 * runs[0]["dropped_frac"]}
        result["rows"].append(row)
        table.append([str(experts), f"{row['time_ms']:.1f}", f"{row['time_ratio']:.2f}", f"{row['peak_mib']:.0f}",
                      f"{row['mem_ratio']:.2f}", f"{row['dropped_pct']:.1f}%"])
    print(format_table(["E", "time ms", "x dense", "peak MiB", "x dense", "dropped"], table, left=0),
          end="", flush=True)
    return result


# ---- CUDA: every configuration in one process ------------------------------------------------
PRECISIONS = {  # name: (dtype of the layer and its input, autocast dtype or None) -- module doc
    "fp16": (torch.float16, None),
    "amp": (torch.float32, torch.float16),
    "bf16": (torch.bfloat16, None),
}


def cuda_measure(kind: str, experts: int, d: int, precision: str, tokens: tuple[int, int], repeats: int,
                 kernel: str) -> dict:
    """Median forward+backward time (CUDA events) and peak memory beyond parameters, input and
    gradients, of one configuration."""
    dtype, autocast = PRECISIONS[precision]
    torch.manual_seed(0)
    with torch.device("cuda"):  # initialised on the GPU: E = 64 at d 768 is 300M parameters
        layer = build(kind, experts, d, 4 * d, kernel).to(dtype).train()
    batch, length = tokens
    x = torch.randn(batch, length, d, device="cuda", dtype=dtype, requires_grad=True)
    padding = None if kind == "dense" else torch.zeros(batch, length, dtype=torch.bool, device="cuda")
    grad_y = torch.randn(batch, length, d, device="cuda", dtype=torch.float16 if autocast else dtype)
    context = (lambda: torch.autocast("cuda", dtype=autocast)) if autocast else contextlib.nullcontext

    def step() -> None:
        with context():
            training_step(layer, x, padding, grad_y)

    def clear() -> None:
        layer.zero_grad(set_to_none=True)
        x.grad = None

    for _ in range(3):  # warm-up: cuBLAS handles, allocator, autotuning
        clear()
        step()
    torch.cuda.synchronize()
    clear()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in [*layer.parameters(), x] if p.grad is not None)
    peak = (torch.cuda.max_memory_allocated() - base - grads) / 2**20
    times = []
    for _ in range(repeats):
        clear()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    # back to back, as consecutive layers of a model run: the host queues the next step while
    # the GPU works on this one, so this is max(host, device) time per step
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        clear()
        step()
    end.record()
    end.synchronize()
    pipelined = start.elapsed_time(end) / repeats
    dropped = 0.0
    if kind != "dense":
        with torch.no_grad(), context():
            diagnostics = layer(x, padding)[1].diagnostics
        dropped = float(diagnostics["dropped"] / diagnostics["tokens"])
    used = kernel if kind != "dense" else "-"
    if kind != "dense" and kernel == "auto":
        used = layer.kernel_for(x)
    del layer, x, grad_y
    torch.cuda.empty_cache()
    return {"time_ms": statistics.median(times), "pipelined_ms": pipelined, "peak_mib": peak,
            "dropped_pct": 100 * dropped, "kernel": used}


def _kernel_list(text: str) -> str:
    """``--kernels``: names the layer knows, checked on any machine (a misspelt one was
    ignored on CPU and refused only on a GPU node)."""
    from fairseq_alma.modules.switch_ffn_config import EXPERT_KERNELS

    unknown = [k for k in text.split(",") if k not in EXPERT_KERNELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown expert kernel {unknown[0]!r}; use some of "
                                         f"{','.join(EXPERT_KERNELS)}")
    return text


def cuda_benchmark(args: argparse.Namespace) -> dict:
    from fairseq_alma.text_table import format_table

    experts_list = [int(e) for e in args.experts.split(",")]
    dims = [int(d) for d in args.dims.split(",")]
    precisions = args.precisions.split(",")
    kernels = args.kernels.split(",")
    name = torch.cuda.get_device_name()
    print(f"SwitchFFN vs dense FFN on {name}: tokens={args.batch}x{args.length} capacity_factor=1.0 "
          f"repeats={args.repeats} rounds={args.rounds} torch={torch.__version__}", flush=True)
    result: dict = {"device": name, "torch": torch.__version__, "tokens": args.batch * args.length, "rows": []}
    table = []
    for d in dims:
        for precision in precisions:
            per_round: dict[tuple[int, str], list[dict]] = {}
            dense_runs = []
            for _ in range(args.rounds):
                dense = cuda_measure("dense", 0, d, precision, (args.batch, args.length), args.repeats, "auto")
                dense_runs.append(dense)
                for experts in experts_list:
                    for kernel in kernels:
                        try:
                            r = cuda_measure("switch", experts, d, precision, (args.batch, args.length),
                                             args.repeats, kernel)
                        except Exception as err:  # an explicit kernel the dtype cannot run: say so
                            print(f"  d={d} {precision} E={experts} {kernel}: {type(err).__name__}: "
                                  f"{str(err).splitlines()[0][:160]}", flush=True)
                            continue
                        r["time_ratio"] = r["time_ms"] / dense["time_ms"]
                        r["pipelined_ratio"] = r["pipelined_ms"] / dense["pipelined_ms"]
                        r["mem_ratio"] = r["peak_mib"] / dense["peak_mib"]
                        per_round.setdefault((experts, kernel), []).append(r)
            med = statistics.median
            dense_ms, dense_mib = med(r["time_ms"] for r in dense_runs), med(r["peak_mib"] for r in dense_runs)
            dense_pipelined = med(r["pipelined_ms"] for r in dense_runs)
            for (experts, kernel), runs in per_round.items():
                row = {"dim": d, "ffn": 4 * d, "precision": precision, "experts": experts, "kernel": runs[0]["kernel"],
                       "requested_kernel": kernel, "dense_ms": dense_ms, "dense_peak_mib": dense_mib,
                       "time_ms": med(r["time_ms"] for r in runs), "time_ratio": med(r["time_ratio"] for r in runs),
                       "dense_pipelined_ms": dense_pipelined, "pipelined_ms": med(r["pipelined_ms"] for r in runs),
                       "pipelined_ratio": med(r["pipelined_ratio"] for r in runs),
                       "peak_mib": med(r["peak_mib"] for r in runs), "mem_ratio": med(r["mem_ratio"] for r in runs),
                       "dropped_pct": runs[0]["dropped_pct"]}
                result["rows"].append(row)
                table.append([f"{d}/{4 * d}", precision, str(experts), row["kernel"], f"{dense_ms:.3f}",
                              f"{row['time_ms']:.3f}", f"{row['time_ratio']:.2f}", f"{row['pipelined_ratio']:.2f}",
                              f"{dense_mib:.0f}",
                              f"{row['peak_mib']:.0f}", f"{row['mem_ratio']:.2f}", f"{row['dropped_pct']:.1f}%"])
            print(f"  d={d} {precision}: dense {dense_ms:.3f} ms, " + " ".join(
                f"E={e}/{k}:{statistics.median(r['time_ratio'] for r in runs):.2f}"
                for (e, k), runs in per_round.items()), flush=True)
    print(format_table(["d/FFN", "precision", "E", "kernel", "dense ms", "switch ms", "x dense", "x back-to-back", "dense MiB",
                        "switch MiB", "x dense", "dropped"], table, left=0), end="", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokens", type=int, default=8192, help="CPU: tokens per forward (default 8192)")
    parser.add_argument("--dim", type=int, default=512, help="CPU: model width d (default 512)")
    parser.add_argument("--ffn", type=int, default=2048, help="CPU: FFN width (default 2048)")
    parser.add_argument("--experts", default=None, help="comma-separated expert counts "
                        "(default 4,8,16,64 on CPU, 4,8,12,64 on CUDA)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per configuration, median "
                        "(default 5 on CPU, 20 on CUDA)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved rounds of dense + every E; ratios per round, median reported "
                        "(default 5 on CPU, 3 on CUDA)")
    parser.add_argument("--dims", default="512,768", help="CUDA: model widths (FFN = 4 x d)")
    parser.add_argument("--batch", type=int, default=24, help="CUDA: sequences (default 24)")
    parser.add_argument("--length", type=int, default=512, help="CUDA: tokens per sequence (default 512)")
    parser.add_argument("--precisions", default="fp16,amp,bf16", help="CUDA: fp16, amp, bf16 (module doc)")
    parser.add_argument("--kernels", default="auto", type=_kernel_list,
                        help="CUDA: expert kernels to time, comma-separated, of "
                             "auto,batched,segments,compiled (e.g. auto,batched); CPU times auto")
    parser.add_argument("--ops", action="store_true", help="print the op counts of the GPU path and the dense FFN")
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "E"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    cuda = args.device == "cuda"
    timing_asked = args.experts is not None or not args.ops
    args.experts = args.experts or ("4,8,12,64" if cuda else "4,8,16,64")
    args.repeats = args.repeats or (20 if cuda else 5)
    args.rounds = args.rounds or (3 if cuda else 5)

    if args.child:
        kind, experts = args.child[0], int(args.child[1])
        print(json.dumps(measure_one(kind, experts, args.tokens, args.dim, args.ffn, args.repeats, seed=0)))
        return
    result: dict = {}
    if args.ops:
        result["ops"] = print_op_counts()
    if cuda:
        if not torch.cuda.is_available():
            parser.exit(2, "switch_ffn.py: error: --device cuda: torch sees no CUDA GPU here\n")
        result["cuda"] = cuda_benchmark(args)
    elif timing_asked:
        result["cpu"] = cpu_benchmark(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()
