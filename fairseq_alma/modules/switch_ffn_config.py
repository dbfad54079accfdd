"""The one typed configuration of a Switch FFN layer (``SwitchFFN``, ``ExpertParallelSwitchFFN``).

Why a frozen dataclass instead of loose keyword arguments: the layer is built from fairseq flags
(models/switch_transformer_lm.py), from tests and from benchmarks; one value object checked once
in ``__post_init__`` (MegaBlocks' ``Arguments`` style) gives every caller the same one-line
``UsageError`` naming the fairseq flag at fault, and it cannot drift after the layer allocated
its tensors.  Runtime experiments (another capacity factor at evaluation, another expert kernel)
replace the layer's config with ``dataclasses.replace(layer.cfg, ...)``, which validates again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from ..errors import UsageError, require

ACTIVATIONS = ("relu", "gelu", "silu")
EXPERT_KERNELS = ("auto", "segments", "batched", "compiled")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SwitchFFNConfig:
    """Sizes and routing of one Switch FFN layer; the fairseq flag of each field is in brackets.

    Args:
        embed_dim: model width d [--decoder-embed-dim].
        ffn_dim: hidden width of every expert, the dense FFN's width [--decoder-ffn-embed-dim].
        num_experts: experts active at construction [--moe-experts]; growth switches on more.
        max_experts: allocated expert slots (>= num_experts) for growth [--moe-max-experts];
            None = num_experts (see ``slots``).
        capacity_factor: training capacity factor (paper: 1.0) [--capacity-factor]: each expert
            takes at most ``int(capacity_factor * ceil(T / E))`` of a batch's T token positions.
            T includes padding (as in fairseq's MoE), so the capacity is known from the shape
            without reading the padding mask back from the GPU; padding itself takes no slot.
        eval_capacity_factor: capacity factor when ``not layer.training`` [--eval-capacity-factor].
            None = no limit: every token reaches its expert, so perplexity does not depend on how
            evaluation batches are composed (alma-score and fairseq-eval-lm batch differently yet
            must agree).  Set e.g. 2.0 (ST-MoE) to bound GPU memory and time on huge batches.
        activation_fn: relu (fairseq's default), gelu or silu [--activation-fn].
        activation_dropout: dropout after the activation inside each expert [--activation-dropout].
        jitter_eps: multiplicative router input noise U(1-eps, 1+eps) in training (Switch §2.4);
            0 disables it [--moe-jitter-eps].
        router_init_scale: multiplies the router's initial weights (nn.Linear's default init);
            1.0 keeps that init bit for bit. Switch §2.6 trains more stably with a 10x smaller
            initialisation scale, so 0.1 tests whether a near-uniform router at the start helps
            [--moe-router-init-scale].
        batch_prioritized_routing: in training, an overflowing expert keeps its most confident
            tokens, not its earliest [--moe-batch-prioritized-routing].
        z_loss: also return the ST-MoE router z-loss (the LM always asks for it).
        expert_kernel: "auto" (segments on CPU with ReLU, batched otherwise), "segments" (fused
            ReLU CPU kernel, expert_segments.py) or "batched" (one baddbmm over [E, C, d] in one
            autograd function, expert_padded.py) or "compiled" (the batched kernel and the
            router as one torch.compile graph, switch_compiled.py) [--moe-expert-kernel].
    """

    embed_dim: int
    ffn_dim: int
    num_experts: int
    max_experts: Optional[int] = None
    capacity_factor: float = 1.0
    eval_capacity_factor: Optional[float] = None
    activation_fn: str = "relu"
    activation_dropout: float = 0.0
    jitter_eps: float = 0.0
    router_init_scale: float = 1.0
    batch_prioritized_routing: bool = False
    z_loss: bool = False
    expert_kernel: str = "auto"

    def __post_init__(self) -> None:
        sizes = {"--decoder-embed-dim": self.embed_dim, "--decoder-ffn-embed-dim": self.ffn_dim,
                 "--moe-experts": self.num_experts}
        for flag, value in sizes.items():
            require(_is_int(value) and value >= 1, f"{flag} must be an integer >= 1 (got {value!r})")
        require(
            self.max_experts is None or (_is_int(self.max_experts) and self.max_experts >= self.num_experts),
            f"--moe-max-experts must be >= --moe-experts ({self.num_experts}), or left unset "
            f"(got {self.max_experts!r})",
        )
        require(
            _is_number(self.capacity_factor) and self.capacity_factor > 0,
            f"--capacity-factor must be > 0, e.g. 1.0 (got {self.capacity_factor!r})",
        )
        eval_cf = self.eval_capacity_factor
        require(
            eval_cf is None or (_is_number(eval_cf) and eval_cf > 0),
            f"--eval-capacity-factor must be > 0, or left unset for no limit (got {eval_cf!r})",
        )
        require(
            self.activation_fn in ACTIVATIONS,
            f"--activation-fn must be one of {', '.join(ACTIVATIONS)} (got {self.activation_fn!r})",
        )
        rates = {"--activation-dropout": self.activation_dropout, "--moe-jitter-eps": self.jitter_eps}
        for flag, value in rates.items():
            require(_is_number(value) and 0 <= value < 1, f"{flag} must be in [0, 1) (got {value!r})")
        require(
            _is_number(self.router_init_scale) and self.router_init_scale > 0,
            f"--moe-router-init-scale must be > 0, e.g. 0.1 (got {self.router_init_scale!r})",
        )
        require(
            self.expert_kernel in EXPERT_KERNELS,
            f"--moe-expert-kernel must be one of {', '.join(EXPERT_KERNELS)} (got {self.expert_kernel!r})",
        )
        if self.expert_kernel == "segments" and self.activation_fn != "relu":
            raise UsageError(
                f"--moe-expert-kernel segments fuses ReLU: use batched or auto with "
                f"--activation-fn {self.activation_fn}"
            )

    @property
    def slots(self) -> int:
        """Allocated expert slots: ``max_experts``, or ``num_experts`` when it is unset."""
        return self.num_experts if self.max_experts is None else self.max_experts
