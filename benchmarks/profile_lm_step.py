"""Where one training step's time goes: host (launching) against device (kernels), per model.

``train_throughput.py`` says how fast a run trains; this says why.  For the Switch LM (E = 8 and
E = 1) and stock ``transformer_lm`` of the same sizes it times, in one process, a forward+backward
of the criterion's loss (no optimizer, no data loading):

* ``step ms``: wall time of a step, synchronised at its end;
* ``launch ms``: host time until the step's last kernel is queued (no synchronisation inside);
  when it is close to ``step ms`` the step is bound by the host, not the GPU;
* ``kernels ms``: summed device time of the step's kernels (torch profiler), and the kernels
  that take most of it (``--top``); then the operations that take most host time (self CPU
  time under the profiler, which adds its own overhead to every op).

Usage: python benchmarks/profile_lm_step.py [--precision fp16|bf16|fp32] [--top 12]
       python benchmarks/profile_lm_step.py --tiny     # CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class _Task:
    """The part of a fairseq task that building a language model reads."""

    def __init__(self, vocab: int) -> None:
        from fairseq.data import Dictionary

        self.target_dictionary = Dictionary()
        for i in range(vocab - len(self.target_dictionary)):
            self.target_dictionary.add_symbol(f"w{i}")
        self.source_dictionary = self.target_dictionary


def build(name: str, args: argparse.Namespace, task: _Task):
    """(model, criterion) of ``name``: switch E=8, switch E=1 or transformer_lm."""
    from omegaconf import OmegaConf

    sizes = dict(decoder_layers=args.layers, decoder_embed_dim=args.dim, decoder_ffn_embed_dim=4 * args.dim,
                 decoder_attention_heads=args.heads)
    if name == "transformer_lm":
        from fairseq.criterions.cross_entropy import CrossEntropyCriterion
        from fairseq.models.transformer_lm import (
            TransformerLanguageModel,
            TransformerLanguageModelConfig,
        )

        cfg = OmegaConf.structured(TransformerLanguageModelConfig(
            **sizes, share_decoder_input_output_embed=True, decoder_normalize_before=True,
            decoder_input_dim=args.dim, decoder_output_dim=args.dim,  # fairseq's default: 512, whatever the width
            tokens_per_sample=args.length, max_target_positions=args.length))
        return TransformerLanguageModel.build_model(cfg, task), CrossEntropyCriterion(task, False)
    from fairseq_alma.criterions.switch_cross_entropy import SwitchCrossEntropyCriterion
    from fairseq_alma.models.switch_transformer_lm import (
        SwitchTransformerLanguageModel,
        SwitchTransformerLMConfig,
    )

    experts = int(name.split("=")[1])
    cfg = OmegaConf.structured(SwitchTransformerLMConfig(**sizes, moe_experts=experts, tokens_per_sample=args.length))
    return SwitchTransformerLanguageModel.build_model(cfg, task), SwitchCrossEntropyCriterion(task, False, 0.01, "sum", 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", choices=("fp16", "bf16", "fp32"), default="fp16")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--batch", type=int, default=24)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    parser.add_argument("--top", type=int, default=12, help="kernels listed per model")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny sizes")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.dim, args.heads, args.length, args.batch, args.vocab = 2, 32, 4, 16, 2, 50
        args.precision, args.steps = "fp32", 2
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[args.precision]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    task = _Task(args.vocab)
    tokens = torch.randint(4, args.vocab, (args.batch, args.length), device=device)
    sample = {"net_input": {"src_tokens": tokens, "src_lengths": torch.full((args.batch,), args.length, device=device)},
              "target": tokens, "ntokens": tokens.numel()}
    print(f"one training forward+backward on {torch.cuda.get_device_name() if device.type == 'cuda' else 'CPU'}, "
          f"{args.precision}: {args.layers} layers, d {args.dim}, {args.batch} x {args.length} tokens", flush=True)
    from torch.profiler import ProfilerActivity, profile

    for name in ("transformer_lm", "switch E=1", "switch E=8"):
        torch.manual_seed(0)
        model, criterion = build(name, args, task)
        model = model.to(device=device, dtype=dtype).train()

        def step() -> float:
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            loss, _, _ = criterion(model, sample)
            loss.backward()
            return time.perf_counter() - start

        for _ in range(3):
            step()
        sync()
        walls, launches = [], []
        for _ in range(args.steps):
            sync()
            start = time.perf_counter()
            launches.append(step())
            sync()
            walls.append(time.perf_counter() - start)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=activities) as prof:
            step()
            sync()
        kernels = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0]
        total = sum(e.self_device_time_total for e in kernels) / 1000.0
        print(f"{name:<15} step {statistics.median(walls) * 1000:8.2f} ms   launch {statistics.median(launches) * 1000:8.2f} ms"
              f"   kernels {total:8.2f} ms   ({sum(e.count for e in kernels)} kernel launches)", flush=True)
        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[: args.top]:
            print(f"    {e.self_device_time_total / 1000:7.2f} ms  x{e.count:<4} {e.key[:110]}", flush=True)
        host = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[: args.top]
        print(f"  host time ({sum(e.self_cpu_time_total for e in prof.key_averages()) / 1000:.2f} ms of ops):",
              flush=True)
        for e in host:
            print(f"    {e.self_cpu_time_total / 1000:7.2f} ms  x{e.count:<4} {e.key[:110]}", flush=True)
        del model, criterion
        if device.type == "cuda":
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
