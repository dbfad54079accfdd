"""How often fp16 storage changes a Switch routing decision (README "Precision").

Under ``--fp16`` fairseq calls ``model.half()``: the router's weights and its inputs are stored
in fp16, while the router computes its matmul and softmax in float32 (``SwitchFFN.router_logits``).
This counts the tokens whose top-1 expert differs from a float64 router on the same float64
weights and inputs, at the paper's base and large widths, for freshly initialised routers and
activations of unit scale (the regime of early training, where routing is least decided).

    python benchmarks/router_precision.py [--tokens 200000]
"""

from __future__ import annotations

import argparse

import torch


def changed_fraction(d: int, experts: int, tokens: int, seed: int) -> float:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.empty(experts, d, dtype=torch.float64)
    bound = 1 / d ** 0.5  # nn.Linear's default init (kaiming_uniform with a = sqrt(5))
    weight.uniform_(-bound, bound, generator=generator)
    x = torch.randn(tokens, d, dtype=torch.float64, generator=generator)
    exact = (x @ weight.T).argmax(-1)
    stored = x.half().float() @ weight.half().float().T  # fp16 storage, float32 compute
    return float((stored.argmax(-1) != exact).double().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=200_000)
    args = parser.parse_args()
    from fairseq_alma.text_table import format_table

    rows = []
    for name, d in (("base", 512), ("large", 768)):
        for experts in (4, 8, 12):
            runs = [changed_fraction(d, experts, args.tokens, seed) for seed in range(3)]
            rows.append([name, str(d), str(experts), f"{100 * max(runs):.4f}%"])
    print(format_table(["model", "d", "experts", "tokens routed elsewhere (max of 3 seeds)"], rows,
                       left=1), end="")


if __name__ == "__main__":
    main()
