"""Analytic FLOPs of a (Switch) transformer decoder LM, for Comp (paper Eq. 2) and §6.2.

Why analytic: Comp must be comparable across runs, machines and kernels, and the paper's point
about Switch layers (§6.2: the number of experts "does not affect the inference cost since only one
expert per input is selected") is a statement about this count, not about measured time.

Per token, forward, in multiply-adds (MACs); FLOPs = 2 × MACs:

  token / position embeddings          0            (a table lookup)
  attention projections Q, K, V, O     4·d²         per layer
  attention scores + weighted sum      2·n_ctx·d    per layer (QKᵀ and AV over the full context,
                                                    the convention of Kaplan et al. 2020, Table 1)
  dense feed-forward                   2·d·f        per dense layer
  Switch (MoE) feed-forward            d·E + 2·d·f  per MoE layer: the router, plus ONE expert,
                                                    the one the token is routed to (top-1)
  output projection to the vocabulary  d·V

Biases, layer norms, softmaxes, activations and the balance loss are ignored (lower order).
Training = 3 × forward: the backward pass costs about twice the forward (gradients with respect to
activations and to weights), as in Kaplan et al. 2020.

Check against the paper (§5, §6.2: "inference cost per input of 42 and 126 GFLOPS"): with an
input read as one 512-token sequence, V = 50,000 and Switch layers every other layer (which is
what §5's "6M additional parameters per expert" implies for the base model: 3 layers × 2·512·2048)
this formula gives, with 4 experts,
  base  (6 layers, d 512, f 2048):  48.77 GFLOPs per sequence = 1.16 × the paper's 42,
  large (12 layers, d 768, f 3072): 135.98 GFLOPs per sequence = 1.08 × the paper's 126.
The paper does not give its formula; the gap is of the size of the attention-score term
(3.2 and 9.7 GFLOPs), which some counts leave out.  We keep the term (it is real work) and report
the ratio instead of tuning the formula to the paper (tests/test_stream_flops.py).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass


def _integer(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} (got {value!r})")
    return int(value)


@dataclass(frozen=True)
class SwitchLMShape:
    """The sizes the FLOP count depends on.

    ``moe_layers`` is how many of the ``n_layers`` feed-forward blocks are Switch layers;
    ``num_experts`` is the experts per Switch layer (only the router cost depends on it, and it is
    ignored when ``moe_layers`` is 0).
    """

    n_layers: int
    d_model: int
    ffn_dim: int
    vocab_size: int
    context: int
    moe_layers: int
    num_experts: int

    def __post_init__(self) -> None:
        for name in ("n_layers", "d_model", "ffn_dim", "vocab_size", "context"):
            _integer(name, getattr(self, name), 1)
        _integer("moe_layers", self.moe_layers, 0)
        if self.moe_layers > self.n_layers:
            raise ValueError(
                f"moe_layers ({self.moe_layers}) cannot exceed n_layers ({self.n_layers})"
            )
        if self.moe_layers:
            _integer("num_experts", self.num_experts, 1)

    def forward_macs_per_token(self) -> int:
        """Multiply-adds of one token's forward pass (table in the module doc)."""
        d, f = self.d_model, self.ffn_dim
        experts = self.num_experts if self.moe_layers else 0
        attention = self.n_layers * (4 * d * d + 2 * self.context * d)
        feed_forward = self.n_layers * 2 * d * f + self.moe_layers * d * experts
        return attention + feed_forward + d * self.vocab_size

    def forward_flops_per_token(self) -> int:
        """2 x ``forward_macs_per_token``."""
        return 2 * self.forward_macs_per_token()

    def forward_flops_per_sequence(self) -> int:
        """Forward FLOPs of one full ``context``-token sequence: the LM's
        ``infer_flops_per_example`` in ``stream.jsonl`` and §6.2's "inference cost per input"."""
        return self.context * self.forward_flops_per_token()

    def train_flops(self, tokens: int) -> int:
        """Training FLOPs for ``tokens`` target tokens: 3 x forward (forward + backward).

        Count the tokens actually processed (all updates x batch tokens, padding excluded), so
        Comp grows with ``--updates-per-stage`` and with replay, as Eq. 2 intends.
        """
        return 3 * _integer("tokens", tokens, 0) * self.forward_flops_per_token()


def lm_forward_flops_per_token(
    n_layers: int,
    d_model: int,
    ffn_dim: int,
    vocab_size: int,
    context: int,
    moe_layers: int,
    num_experts: int,
) -> int:
    """Forward FLOPs of one token (module doc); arguments as ``SwitchLMShape``.

    >>> lm_forward_flops_per_token(1, 2, 4, 10, 3, moe_layers=1, num_experts=2)
    136
    """
    shape = SwitchLMShape(n_layers, d_model, ffn_dim, vocab_size, context, moe_layers, num_experts)
    return shape.forward_flops_per_token()


def lm_train_flops(tokens: int, *shape: int, **named_shape: int) -> int:
    """Training FLOPs of ``tokens`` tokens; the other arguments are those of
    ``lm_forward_flops_per_token`` (positional or by name), see ``SwitchLMShape.train_flops``."""
    return SwitchLMShape(*shape, **named_shape).train_flops(tokens)
