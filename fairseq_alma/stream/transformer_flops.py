"""Analytic FLOPs of a (Switch) transformer decoder LM, for Comp (paper Eq. 2) and §6.2.

Why analytic: Comp must be comparable across runs, machines and kernels, and the paper's point
about Switch layers (§6.2: the number of experts "does not affect the inference cost since only one
expert per input is selected") is a statement about this count, not about measured time.

Per token, forward, in multiply-adds (MACs); FLOPs = 2 × MACs.  d = model width, f = FFN width,
n_ctx = --tokens-per-sample, V = vocabulary, E = experts per Switch layer:

  term                                 MACs per token           why
  token / position embeddings          0                        a table lookup, no arithmetic
  attention projections Q, K, V, O     4·d²         per layer   four d×d matrices
  attention scores QKᵀ                 n_ctx·d      per layer   one dot product per position
  attention-weighted sum of V          n_ctx·d      per layer   one d-vector per position
  dense feed-forward                   2·d·f        per dense layer   d→f and f→d
  Switch feed-forward                  d·E + 2·d·f  per Switch layer  the router (d→E), then ONE
                                                                expert, the token's (top-1)
  output projection to the vocabulary  d·V                      the softmax's logits

Biases, layer norms, softmaxes, activations and the balance loss are ignored (lower order).
Training = 3 × forward: the backward pass costs about twice the forward (gradients with respect to
activations and to weights), as in Kaplan et al. 2020.

The two attention-score terms are counted over the full context, as a dense kernel computes them
(the causal mask halves the useful work, not the work done).  Conventions differ here, so
``FLOPS_CONVENTIONS`` offers three (``--flops-convention`` of the alma_stream task):

  full    (default) both terms above: 2·n_ctx·d MACs per layer;
  kaplan  Kaplan et al. 2020, Table 1: C_forward = 2N + 2·n_layer·n_ctx·d, i.e. the QKᵀ term
          only (n_ctx·d MACs per layer);
  params  2N: two FLOPs per parameter used by the token, no attention-score term.

Against the paper (§5, §6.2: "inference cost per input of 42 and 126 GFLOPS"), with an input
read as one 512-token sequence, V = 50,000, 4 experts and Switch layers every other layer (what
§5's "6M additional parameters per expert" implies for the base model: 3 layers × 2·512·2048):

  model                              full      kaplan    params    paper
  base  (6 layers, d 512, f 2048)    48.77     47.16     45.55     42
  large (12 layers, d 768, f 3072)  135.98    131.15    126.31    126

``params`` reproduces the large model's 126 GFLOPs.  No count that includes the token's expert
reproduces the base model's 42: ``params`` without the Switch experts gives 39.1, and 42 is about
2 × the paper's "40M shared parameters" × 512, as if the base number left the routed expert out.
We default to ``full`` (it is the work a GPU does) and report the ratio; tests/test_stream_flops.py
checks every number of this table.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

FLOPS_CONVENTIONS = ("full", "kaplan", "params")


def _integer(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum} (got {value!r})")
    return int(value)


@dataclass(frozen=True)
class SwitchLMShape:
    """The sizes the FLOP count depends on.

    ``moe_layers`` is how many of the ``n_layers`` feed-forward blocks are Switch layers;
    ``num_experts`` is the experts per Switch layer (only the router cost depends on it, and it is
    ignored when ``moe_layers`` is 0).  ``convention`` says how attention scores count (module
    doc).
    """

    n_layers: int
    d_model: int
    ffn_dim: int
    vocab_size: int
    context: int
    moe_layers: int
    num_experts: int
    convention: str = "full"

    def __post_init__(self) -> None:
        if self.convention not in FLOPS_CONVENTIONS:
            raise ValueError(f"convention {self.convention!r} must be one of {FLOPS_CONVENTIONS}")
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
        scores = {"full": 2, "kaplan": 1, "params": 0}[self.convention] * self.context * d
        attention = self.n_layers * (4 * d * d + scores)
        feed_forward = self.n_layers * 2 * d * f + self.moe_layers * d * experts
        return attention + feed_forward + d * self.vocab_size

    def forward_flops_per_token(self) -> int:
        """2 x ``forward_macs_per_token``."""
        return 2 * self.forward_macs_per_token()

    def forward_flops_per_sequence(self) -> int:
        """Forward FLOPs of one full ``context``-token sequence: ``infer_flops_per_sequence`` in
        ``stream.jsonl`` and §6.2's "inference cost per input"."""
        return self.context * self.forward_flops_per_token()

    def train_flops(self, tokens: int) -> int:
        """Training FLOPs for ``tokens`` target tokens: 3 x forward (forward + backward).

        Count the tokens actually processed (all updates x batch tokens, padding excluded), so
        Comp grows with ``--updates-per-stage`` and with replay, as Eq. 2 intends.
        """
        return 3 * _integer("tokens", tokens, 0) * self.forward_flops_per_token()


def width_mismatch(model_cfg: Any) -> str | None:
    """Why a model config's FLOPs cannot be counted at one width (None when they can): fairseq's
    ``transformer_lm`` with ``--decoder-input-dim`` or ``--decoder-output-dim`` (fairseq's
    default: 512, whatever ``--decoder-embed-dim`` says) other than the blocks' width builds
    embeddings or an output layer of that width projected to and from the blocks, which this
    count has no term for.  ``model_cfg``: a run's ``config.model`` (a dict or config node)."""
    get = getattr(model_cfg, "get", None)
    if get is None:
        return None
    width = get("decoder_embed_dim")
    for key, what in (("decoder_input_dim", "embeddings"), ("decoder_output_dim", "output")):
        value = get(key)
        if width is not None and value is not None and value != width:
            return (f"--decoder-embed-dim {width} with --{key.replace('_', '-')} {value} (fairseq's "
                    f"default is 512, whatever --decoder-embed-dim says): that builds {value}-wide "
                    f"{what} projected to or from {width}-wide blocks, and the FLOPs count takes one width")
    return None


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
