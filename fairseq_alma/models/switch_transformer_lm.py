"""Switch Transformer decoder-only language model (ALMA paper §5, App. B.2; Fedus et al. 2021).

Every ``--moe-freq``-th block has a top-1 Switch FFN instead of the dense FFN (2 = every other
block, as in Switch).  The decoder returns the blocks' auxiliary outputs (balance loss and
routing diagnostics) in ``extra["moe_aux"]``; ``switch_cross_entropy`` turns them into the
training loss and logged metrics.  Nothing is kept in module or global state between calls.

With ``--eval-capacity-factor`` an expert takes at most cf * ceil(T / E) of the T tokens one
evaluation forward routes.  In incremental decoding (fairseq-generate, fairseq-interactive, the
hub's ``sample``: the decoder gets ``incremental_state``) a forward routes one token per sequence,
so T is the number of prompts decoded together: with the limit a prompt's continuation and its
log-probabilities depended on which prompts shared its batch (-6.4281 alone, -6.4300 beside
another), and no batch gives what a full forward gives.  Incremental decoding therefore routes
without the limit, with a one-time warning (``_without_eval_capacity``); so does the hub
interface for every forward, its full-sequence ``score`` included (``drop_eval_capacity``,
called by ``fairseq_glue/scoring_commands.install_hub_routing``), which would otherwise depend
on which sentences it pads together.  The run's perplexities are alma-score's, or
fairseq-eval-lm's with the run's own batching (``fairseq_glue/scoring_command_flags.py``).

Presets: ``switch_transformer_lm_base`` (6 x 512, FFN 2048, 8 heads) and ``_large`` (12 x 768,
FFN 3072, 12 heads) reproduce Table 2's parameter counts with a 50k dictionary (tests check
within 3%); ``_tiny`` is for CPU tests and the demo.
"""


import dataclasses
import logging
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
from fairseq import utils
from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.distributed import fsdp_wrap
from fairseq.models import (
    FairseqIncrementalDecoder,
    FairseqLanguageModel,
    register_model,
    register_model_architecture,
)
from fairseq.modules import LayerNorm, PositionalEmbedding
from fairseq.utils import safe_getattr
from omegaconf import II
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..errors import UsageError, require
from ..fairseq_glue.config import section
from ..fairseq_glue.expert_parallel import prepare_expert_parallel
from ..modules.expert_parallel import build_switch_ffn
from ..modules.switch_ffn import SwitchFFN
from ..modules.switch_ffn_config import SwitchFFNConfig
from .checkpoint_format import (
    SWITCH_DECODER_UPGRADES,
    SWITCH_DECODER_VERSION,
    register_version,
    upgrade_state_dict,
)
from .switch_decoder_layer import DenseFFN, SwitchDecoderLayer

logger = logging.getLogger(__name__)

DEFAULT_MAX_TARGET_POSITIONS = 1024
LEFT_PADDING_MESSAGE = ("switch_transformer_lm trains on batches padded at the end of each row "
                        "(fairseq's language-model datasets); this batch has padding before a real token")
# Criteria that consume extra["moe_aux"]; training with any other would silently drop the
# balance loss, so build_model refuses it.
MOE_AWARE_CRITERIA = ("switch_cross_entropy",)


@dataclass
class SwitchTransformerLMConfig(FairseqDataclass):
    activation_fn: ChoiceEnum(["relu", "gelu", "silu"]) = field(default="relu", metadata={"help": "FFN and expert activation"})
    dropout: float = field(default=0.1, metadata={"help": "dropout on residual branches and embeddings"})
    attention_dropout: float = field(default=0.0, metadata={"help": "dropout on attention weights"})
    activation_dropout: float = field(default=0.0, metadata={"help": "dropout after the FFN/expert activation"})
    decoder_embed_dim: int = field(default=512, metadata={"help": "model width d"})
    decoder_ffn_embed_dim: int = field(default=2048, metadata={"help": "FFN width, also of every expert"})
    decoder_layers: int = field(default=6, metadata={"help": "number of decoder blocks"})
    decoder_attention_heads: int = field(default=8, metadata={"help": "attention heads"})
    decoder_post_norm: bool = field(
        default=False, metadata={"help": "post-LayerNorm blocks (fairseq transformer_lm default) instead of pre-LN"}
    )
    untie_embeddings: bool = field(
        default=False, metadata={"help": "separate output projection (default: shared input/output embeddings)"}
    )
    decoder_learned_pos: bool = field(default=False, metadata={"help": "learned instead of sinusoidal positions"})
    no_scale_embedding: bool = field(default=False, metadata={"help": "do not scale embeddings by sqrt(d)"})
    moe_experts: int = field(default=8, metadata={"help": "experts per MoE block (paper: 4, 8 or 12)"})
    moe_max_experts: Optional[int] = field(
        default=None,
        metadata={"help": "expert slots allocated per MoE block for growth (--grow-experts); default --moe-experts"},
    )
    moe_freq: int = field(default=2, metadata={"help": "every N-th block is a Switch block (2 = every other, as in Switch)"})
    capacity_factor: float = field(default=1.0, metadata={"help": (
        "training capacity factor (paper: 1.0): each expert takes at most int(cf * ceil(T / E)) of "
        "a batch's T token positions, padding included (padding itself takes no slot)")})
    eval_capacity_factor: Optional[float] = field(
        default=None,
        metadata={
            "help": "capacity factor at evaluation; default: no limit, so perplexity does not depend on how "
            "evaluation batches are composed (e.g. 2.0 bounds GPU time on huge batches)"
        },
    )
    moe_jitter_eps: float = field(default=0.0, metadata={"help": "multiplicative router jitter noise in training (0 = off)"})
    moe_router_init_scale: float = field(default=1.0, metadata={"help": (
        "multiply the router's initial weights by this (1.0 = nn.Linear's default init; Switch "
        "§2.6 recommends a 10x smaller initialisation scale, e.g. 0.1)")})
    moe_batch_prioritized_routing: bool = field(default=False, metadata={"help": (
        "in training, an overflowing expert keeps the tokens with the highest router probability "
        "instead of the earliest (batch-prioritised routing); off in the paper")})
    moe_expert_kernel: ChoiceEnum(["auto", "batched", "segments", "compiled"]) = field(default="auto", metadata={
        "help": (
            "how the experts run: batched (one batched matmul over a capacity-sized buffer, no host "
            "synchronisation; GPUs), segments (one matmul per expert over its tokens; CPU only, with "
            "relu), compiled (batched and the router as one torch.compile graph: a few fused kernels "
            "instead of ~280 operations per block; needs a C compiler, and Triton on GPUs); auto "
            "picks segments on CPU with relu, batched otherwise")})
    checkpoint_activations: bool = field(default=False, metadata={"help": (
        "recompute each block's activations in the backward pass instead of keeping them "
        "(less memory, about a third more compute); non-reentrant torch.utils.checkpoint, so "
        "every gradient, the router's and the balance loss's included, is the one without it")})
    moe_expert_parallel_size: int = field(
        default=1,
        metadata={
            "help": "shard each MoE block's experts over groups of this many training processes (all_to_all "
            "token exchange); must divide --moe-experts and the number of processes; 1 = every process holds "
            "all experts"
        },
    )
    max_target_positions: Optional[int] = field(default=None, metadata={"help": "max tokens per sequence"})
    tokens_per_sample: int = II("task.tokens_per_sample")


class SwitchTransformerDecoder(FairseqIncrementalDecoder):
    """Token + position embeddings, blocks, final LayerNorm (pre-LN), output projection."""

    def __init__(self, cfg: SwitchTransformerLMConfig, dictionary: Any) -> None:
        super().__init__(dictionary)
        d = cfg.decoder_embed_dim
        self.padding_idx = dictionary.pad()
        self.embed_tokens = nn.Embedding(len(dictionary), d, padding_idx=self.padding_idx)
        self.embed_scale = 1.0 if cfg.no_scale_embedding else math.sqrt(d)
        self.max_target_positions = cfg.max_target_positions
        self.embed_positions = PositionalEmbedding(
            cfg.max_target_positions, d, self.padding_idx, learned=cfg.decoder_learned_pos
        )
        self.dropout = cfg.dropout
        self.checkpoint_activations = cfg.checkpoint_activations
        normalize_before = not cfg.decoder_post_norm
        # each block its own FSDP unit under --ddp-backend fully_sharded (no-op otherwise), so
        # FSDP gathers one block's parameters at a time instead of the whole model
        self.layers = nn.ModuleList(
            fsdp_wrap(SwitchDecoderLayer(
                d,
                cfg.decoder_attention_heads,
                self._build_ffn(cfg, i),
                dropout=cfg.dropout,
                attention_dropout=cfg.attention_dropout,
                normalize_before=normalize_before,
            ))
            for i in range(cfg.decoder_layers)
        )
        self.layer_norm = LayerNorm(d) if normalize_before else None
        self.output_projection = nn.Linear(d, len(dictionary), bias=False) if cfg.untie_embeddings else None
        register_version(self, SWITCH_DECODER_VERSION)  # checkpoint format: checkpoint_format.py
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Embedding init of fairseq's transformer LM: N(0, d^-0.5), zero padding row."""
        d = self.embed_tokens.embedding_dim
        nn.init.normal_(self.embed_tokens.weight, mean=0, std=d**-0.5)
        nn.init.constant_(self.embed_tokens.weight[self.padding_idx], 0)
        if self.output_projection is not None:
            nn.init.normal_(self.output_projection.weight, mean=0, std=d**-0.5)

    @staticmethod
    def _build_ffn(cfg: SwitchTransformerLMConfig, layer: int) -> nn.Module:
        if (layer + 1) % cfg.moe_freq == 0:
            return build_switch_ffn(switch_ffn_config(cfg), cfg.moe_expert_parallel_size)
        return DenseFFN(cfg.decoder_embed_dim, cfg.decoder_ffn_embed_dim, str(cfg.activation_fn), cfg.activation_dropout)

    def moe_layers(self) -> List[SwitchFFN]:
        return [layer.ffn for layer in self.layers if layer.is_moe]

    def upgrade_state_dict_named(self, state_dict: Dict[str, Tensor], name: str) -> Dict[str, Tensor]:
        """Called by fairseq before every load: older formats rewritten, newer ones refused."""
        upgrade_state_dict(state_dict, name, SWITCH_DECODER_VERSION, SWITCH_DECODER_UPGRADES, "switch_transformer_lm")
        return state_dict

    def forward(
        self,
        prev_output_tokens: Tensor,
        encoder_out: Optional[Dict[str, List[Tensor]]] = None,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        features_only: bool = False,
        src_lengths: Optional[Any] = None,
        **unused: Any,
    ) -> Tuple[Tensor, Dict[str, Any]]:
        x, extra = self.extract_features(prev_output_tokens, incremental_state)
        if not features_only:
            x = self.output_layer(x)
        return x, extra

    def extract_features(
        self,
        prev_output_tokens: Tensor,
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
        **unused: Any,
    ) -> Tuple[Tensor, Dict[str, Any]]:
        positions = self.embed_positions(prev_output_tokens, incremental_state=incremental_state)  # (B, T, C)
        if incremental_state is not None:
            prev_output_tokens = prev_output_tokens[:, -1:]
            positions = positions[:, -1:]
        x = self.embed_scale * self.embed_tokens(prev_output_tokens) + positions  # (B, T, C)
        x = nn.functional.dropout(x, p=self.dropout, training=self.training)
        x = x.transpose(0, 1)  # (T, B, C)

        # Always a tensor, never ``mask if mask.any() else None``: that Python branch would read
        # the mask back from the GPU (a stall before every forward); the Switch blocks need it
        # to keep padding out of routing.
        padding_mask = prev_output_tokens.eq(self.padding_idx)  # (B, T)
        causal = incremental_state is None and self.attention_needs_no_mask(padding_mask)
        attn_mask = None if incremental_state is not None or causal else self.causal_mask(x.size(0), x)

        moe_aux = []
        inner_states: List[Optional[Tensor]] = [x]
        recompute = self.checkpoint_activations and self.training and incremental_state is None \
            and torch.is_grad_enabled()
        decoding = incremental_state is not None and not self.training
        with self._without_eval_capacity(decoding, "incremental decoding routes one token per sequence "
                                                   "a step, so the limit would be set by how many "
                                                   "prompts are decoded together"):
            for layer in self.layers:
                if recompute:  # non-reentrant: the aux losses keep their graph (reentrant would not)
                    x, aux = checkpoint(layer, x, attn_mask, padding_mask, None, causal, use_reentrant=False)
                else:
                    x, aux = layer(x, attn_mask, padding_mask, incremental_state, causal)
                if aux is not None:
                    moe_aux.append(aux)
                inner_states.append(x)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        x = x.transpose(0, 1)  # (B, T, C)
        return x, {"attn": [None], "inner_states": inner_states, "moe_aux": moe_aux}

    def _eval_capacity_layers(self) -> List[SwitchFFN]:
        return [layer for layer in self.moe_layers() if layer.cfg.eval_capacity_factor is not None]

    def _warn_routing_without_eval_capacity(self, layers: List[SwitchFFN], why: str) -> None:
        if not getattr(self, "_warned_eval_capacity", False):
            self._warned_eval_capacity = True
            logger.warning("this model evaluates with --eval-capacity-factor %g, but %s: its experts "
                           "route here without a capacity limit, so a sequence's result does not "
                           "depend on the others batched with it (the run's perplexities: alma-score, "
                           "or fairseq-eval-lm with the run's own --batch-size)",
                           layers[0].cfg.eval_capacity_factor, why)

    @contextmanager
    def _without_eval_capacity(self, active: bool, why: str) -> Iterator[None]:
        """Route without ``--eval-capacity-factor`` inside the block when ``active`` (module doc)."""
        layers = self._eval_capacity_layers() if active else []
        if not layers:
            yield
            return
        self._warn_routing_without_eval_capacity(layers, why)
        kept = [layer.cfg for layer in layers]
        for layer in layers:  # the layer reads its routing knobs from cfg at every call
            layer.cfg = dataclasses.replace(layer.cfg, eval_capacity_factor=None)
        try:
            yield
        finally:
            for layer, cfg in zip(layers, kept):
                layer.cfg = cfg

    def drop_eval_capacity(self, why: str) -> None:
        """Route every later evaluation forward without ``--eval-capacity-factor`` (module doc:
        the hub), with the one-time warning."""
        layers = self._eval_capacity_layers()
        if layers:
            self._warn_routing_without_eval_capacity(layers, why)
            for layer in layers:
                layer.cfg = dataclasses.replace(layer.cfg, eval_capacity_factor=None)

    def attention_needs_no_mask(self, padding_mask: Tensor) -> bool:
        """Whether causal attention without any mask is exact for this batch: padding only at
        the end of each row (switch_decoder_layer.py says why), which fairseq's language-model
        datasets always give.  Training checks it on the device without waiting for it (a batch
        padded elsewhere stops the run with the message below, never trains on a wrong
        result); evaluation, which reads routing loads back anyway, checks it on the host and
        falls back to masked attention."""
        if padding_mask.size(1) < 2:
            return True
        padded_then_real = padding_mask[:, :-1] > padding_mask[:, 1:]  # (B, T - 1)
        if self.training and torch.is_grad_enabled():
            torch._assert_async(~padded_then_real.any(), LEFT_PADDING_MESSAGE)
            return True
        return not bool(padded_then_real.any())

    @staticmethod
    def causal_mask(seq_len: int, like: Tensor) -> Tensor:
        """(T, T) additive mask with -inf above the diagonal."""
        return torch.triu(utils.fill_with_neg_inf(torch.zeros(seq_len, seq_len, device=like.device)), 1).to(like.dtype)

    def output_layer(self, features: Tensor) -> Tensor:
        weight = self.embed_tokens.weight if self.output_projection is None else self.output_projection.weight
        return nn.functional.linear(features, weight)

    def max_positions(self) -> int:
        return self.max_target_positions


def _z_loss_wanted(cfg: Any) -> bool:
    """Whether the blocks compute the router z-loss: when the criterion weighs it
    (``--moe-z-loss-weight`` > 0), or when the criterion cannot be seen (a bare model config:
    the layer then reports it); with weight 0 (the default) it would be computed for nothing."""
    criterion = section(cfg, "criterion")
    weight = criterion.get("moe_z_loss_weight") if criterion is not None and hasattr(criterion, "get") else None
    return weight is None or float(weight) > 0


def switch_ffn_config(cfg: SwitchTransformerLMConfig) -> SwitchFFNConfig:
    """The Switch FFN of every MoE block, from the model flags (validated: one-line errors)."""
    return SwitchFFNConfig(
        embed_dim=cfg.decoder_embed_dim,
        ffn_dim=cfg.decoder_ffn_embed_dim,
        num_experts=cfg.moe_experts,
        max_experts=cfg.moe_max_experts,
        capacity_factor=cfg.capacity_factor,
        eval_capacity_factor=cfg.eval_capacity_factor,
        activation_fn=str(cfg.activation_fn),
        activation_dropout=cfg.activation_dropout,
        jitter_eps=cfg.moe_jitter_eps,
        router_init_scale=getattr(cfg, "moe_router_init_scale", 1.0),  # absent in older checkpoints
        batch_prioritized_routing=cfg.moe_batch_prioritized_routing,
        z_loss=_z_loss_wanted(cfg),
        expert_kernel=str(getattr(cfg, "moe_expert_kernel", "auto")),  # absent in older checkpoints
    )


def validate_config(cfg: SwitchTransformerLMConfig) -> None:
    """One-line errors naming the flag and the accepted values (issue: bad input).

    The expert flags are checked by ``SwitchFFNConfig``; the criterion is read through
    ``fairseq_glue.config.section``, None when the model config stands alone (tests, a bare
    dataclass): the check is then skipped.
    """
    switch_ffn_config(cfg)
    require(not (cfg.checkpoint_activations and cfg.moe_expert_parallel_size > 1),
            "--checkpoint-activations with --moe-expert-parallel-size > 1 is not supported (the "
            "recomputed all_to_all would have to run in the same order on every rank); drop one")
    require(cfg.moe_freq >= 1, f"--moe-freq must be an integer >= 1 (got {cfg.moe_freq})")
    require(cfg.decoder_layers >= 1, f"--decoder-layers must be an integer >= 1 (got {cfg.decoder_layers})")
    require(cfg.moe_freq <= cfg.decoder_layers,
            f"--moe-freq {cfg.moe_freq} leaves the {cfg.decoder_layers} decoder layers without a "
            f"Switch block (every {cfg.moe_freq}-th layer is one): use --moe-freq <= "
            f"{cfg.decoder_layers}, or a dense --arch for a dense model")
    require(
        cfg.decoder_embed_dim % cfg.decoder_attention_heads == 0,
        f"--decoder-embed-dim ({cfg.decoder_embed_dim}) must be divisible by --decoder-attention-heads "
        f"({cfg.decoder_attention_heads})",
    )
    criterion = section(cfg, "criterion")
    name = criterion.get("_name") if criterion is not None and hasattr(criterion, "get") else None
    if name is not None and name not in MOE_AWARE_CRITERIA:
        raise UsageError(
            f"--criterion {name} ignores the Switch balance loss of --arch switch_transformer_lm*: "
            f"use --criterion {' or '.join(MOE_AWARE_CRITERIA)}"
        )


@register_model("switch_transformer_lm", dataclass=SwitchTransformerLMConfig)
class SwitchTransformerLanguageModel(FairseqLanguageModel):
    """Decoder-only Switch Transformer LM."""

    @classmethod
    def build_model(cls, cfg: SwitchTransformerLMConfig, task: Any) -> "SwitchTransformerLanguageModel":
        validate_config(cfg)
        if cfg.max_target_positions is None:
            cfg.max_target_positions = getattr(cfg, "tokens_per_sample", DEFAULT_MAX_TARGET_POSITIONS)
        model = cls(SwitchTransformerDecoder(cfg, task.target_dictionary))
        prepare_expert_parallel(model)
        model.log_parameter_counts()
        return model

    def moe_layers(self) -> List[SwitchFFN]:
        return self.decoder.moe_layers()

    def drop_eval_capacity(self, why: str) -> None:
        """See ``SwitchTransformerDecoder.drop_eval_capacity``."""
        self.decoder.drop_eval_capacity(why)

    def parameter_counts(self) -> Dict[str, int]:
        """Shared, per-expert and active parameter counts (|θ_t| counts active experts only, and
        only their router rows); ``allocated`` is every parameter, growth's free slots included."""
        total = sum(p.numel() for p in self.parameters())
        moe = self.moe_layers()
        # with expert parallelism a rank holds only its shard of the slots (local_slots)
        expert_slots = sum(getattr(layer, "local_slots", layer.max_experts) * layer.expert_parameter_count() for layer in moe)
        # the router's rows of slots pre-allocated for growth score no token yet: not part of
        # the model of num_experts experts, as those slots' experts are not
        unused_router_rows = sum((layer.max_experts - layer.num_experts) * layer.router.weight.shape[1] for layer in moe)
        shared = total - expert_slots - unused_router_rows
        per_expert = sum(layer.expert_parameter_count() for layer in moe)
        active_experts = sum(layer.num_experts * layer.expert_parameter_count() for layer in moe)
        return {
            "shared": shared,
            "per_expert": per_expert,
            "experts": moe[0].num_experts if moe else 0,
            "active": shared + active_experts,
            "allocated": total,
        }

    def log_parameter_counts(self) -> None:
        c = self.parameter_counts()
        logger.info(
            "switch_transformer_lm: %.2fM shared + %.2fM per expert x %d experts = %.2fM active parameters "
            "(%.2fM allocated)",
            c["shared"] / 1e6,
            c["per_expert"] / 1e6,
            c["experts"],
            c["active"] / 1e6,
            c["allocated"] / 1e6,
        )


def _preset(cfg: Any, layers: int, dim: int, ffn: int, heads: int) -> None:
    """Fill size flags the user did not give (fairseq parses model flags with defaults removed)."""
    cfg.decoder_layers = safe_getattr(cfg, "decoder_layers", layers)
    cfg.decoder_embed_dim = safe_getattr(cfg, "decoder_embed_dim", dim)
    cfg.decoder_ffn_embed_dim = safe_getattr(cfg, "decoder_ffn_embed_dim", ffn)
    cfg.decoder_attention_heads = safe_getattr(cfg, "decoder_attention_heads", heads)


@register_model_architecture("switch_transformer_lm", "switch_transformer_lm_base")
def switch_transformer_lm_base(cfg: Any) -> None:
    """Paper §5 base: 6 layers, d 512, FFN 2048, 8 heads (≈40M shared + ≈6M per expert, 50k BPE)."""
    _preset(cfg, 6, 512, 2048, 8)


@register_model_architecture("switch_transformer_lm", "switch_transformer_lm_large")
def switch_transformer_lm_large(cfg: Any) -> None:
    """Paper §5 large: 12 layers, d 768, FFN 3072, 12 heads (≈96M shared + ≈28M per expert)."""
    _preset(cfg, 12, 768, 3072, 12)


@register_model_architecture("switch_transformer_lm", "switch_transformer_lm_tiny")
def switch_transformer_lm_tiny(cfg: Any) -> None:
    """CPU tests and the demo: 2 layers, d 64, FFN 128, 4 heads (one dense + one Switch block)."""
    _preset(cfg, 2, 64, 128, 4)
