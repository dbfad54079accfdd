"""Activation memory per sequence of the base Switch LM, with and without --checkpoint-activations.

What a training step keeps between its forward and its backward pass grows with the batch; with
``--checkpoint-activations`` each block keeps only its input and recomputes the rest in backward.
Each measurement runs in its own process: the resident memory after the forward pass minus
before it (weights and the input excluded), divided by the sequences in the batch.

    python benchmarks/checkpoint_activations.py [--sequences 4 --tokens 512 --experts 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(checkpointing: bool, sequences: int, tokens: int, experts: int) -> float:
    import torch
    from fairseq.models import ARCH_CONFIG_REGISTRY
    from omegaconf import OmegaConf

    from fairseq_alma.models.switch_transformer_lm import (
        SwitchTransformerLanguageModel,
        SwitchTransformerLMConfig,
    )

    class Task:
        target_dictionary = None

    from fairseq.data import Dictionary

    dictionary = Dictionary()
    for i in range(1000):
        dictionary.add_symbol(f"w{i}")
    Task.target_dictionary = dictionary
    torch.manual_seed(0)
    torch.set_num_threads(2)
    cfg = OmegaConf.structured(SwitchTransformerLMConfig(tokens_per_sample=tokens))
    ARCH_CONFIG_REGISTRY["switch_transformer_lm_base"](cfg)
    cfg.moe_experts, cfg.checkpoint_activations, cfg.dropout = experts, checkpointing, 0.1
    model = SwitchTransformerLanguageModel.build_model(cfg, Task()).train()
    batch = torch.randint(4, len(dictionary), (sequences, tokens))
    model(batch[:1, :8])[0].sum().backward()  # warm up allocator paths and lazy buffers
    model.zero_grad(set_to_none=True)
    before = rss_bytes()
    logits, extra = model(batch)
    loss = logits.float().logsumexp(-1).mean() + sum(a.balance_loss for a in extra["moe_aux"])
    after = rss_bytes()
    loss.backward()
    return (after - before) / sequences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--child", choices=("plain", "checkpointed"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child == "checkpointed", args.sequences, args.tokens,
                                 args.experts)))
        return
    from fairseq_alma.text_table import format_table

    results = {}
    for kind in ("plain", "checkpointed"):
        # glibc serves allocations above 128 KiB with mmap and returns them when freed, so the
        # resident size tracks the memory still held instead of freed-but-kept heap
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
        out = subprocess.run([sys.executable, __file__, "--child", kind, "--sequences",
                              str(args.sequences), "--tokens", str(args.tokens), "--experts",
                              str(args.experts)], capture_output=True, text=True, check=True, env=env)
        results[kind] = json.loads(out.stdout.strip().splitlines()[-1])
    rows = [[kind, f"{value / 2**20:.1f}"] for kind, value in results.items()]
    rows.append(["checkpointed / plain", f"{results['checkpointed'] / results['plain']:.2f}x"])
    print(f"base model, {args.experts} experts, {args.sequences} x {args.tokens} tokens, fp32 CPU")
    print(format_table(["activations kept for backward", "MiB per sequence"], rows), end="")


if __name__ == "__main__":
    main()
