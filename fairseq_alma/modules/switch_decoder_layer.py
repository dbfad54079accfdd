"""One decoder block of the Switch Transformer LM: self-attention then a dense or Switch FFN.

Why our own block rather than fairseq's ``TransformerDecoderLayerBase``: fairseq's block computes
its FFN inline (fc1/fc2) and returns no auxiliary output, so an MoE FFN and its balance loss
cannot be slotted in without copying the whole forward.  This block reuses fairseq's
MultiheadAttention (incremental decoding included) and keeps the FFN a swappable module.
"""

from __future__ import annotations

import warnings
from typing import Dict, Optional

import torch.nn.functional as F
from fairseq.modules import LayerNorm, MultiheadAttention
from torch import Tensor, nn

from .switch_ffn import SwitchAux, SwitchFFN, _activation

# fairseq's MultiheadAttention hands torch a bool key-padding mask (it calls .bool() itself) next
# to the additive float causal mask; torch then converts the bool mask to -inf exactly as intended
# but warns on every batch with padding.  The combination is fairseq's, the result is correct,
# and the warning would bury the training log, so only this message is silenced.
warnings.filterwarnings("ignore", message="Support for mismatched key_padding_mask and attn_mask")


class DenseFFN(nn.Module):
    """The dense FFN (Linear, activation, dropout, Linear) that experts replicate."""

    def __init__(self, embed_dim: int, ffn_dim: int, activation_fn: str, activation_dropout: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(embed_dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, embed_dim)
        self.activation = _activation(activation_fn)
        self.activation_dropout = activation_dropout

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None) -> tuple[Tensor, None]:
        h = F.dropout(self.activation(self.fc1(x)), p=self.activation_dropout, training=self.training)
        return self.fc2(h), None


class SwitchDecoderLayer(nn.Module):
    """Pre-norm (default) or post-norm decoder block; x is (T, B, C) as in fairseq."""

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        ffn: nn.Module,
        dropout: float,
        attention_dropout: float,
        normalize_before: bool,
    ) -> None:
        super().__init__()
        self.self_attn = MultiheadAttention(embed_dim, num_heads, dropout=attention_dropout, self_attention=True)
        self.self_attn_layer_norm = LayerNorm(embed_dim)
        self.ffn = ffn
        self.final_layer_norm = LayerNorm(embed_dim)
        self.dropout = dropout
        self.normalize_before = normalize_before

    @property
    def is_moe(self) -> bool:
        return isinstance(self.ffn, SwitchFFN)

    def forward(
        self,
        x: Tensor,
        self_attn_mask: Optional[Tensor],
        self_attn_padding_mask: Optional[Tensor],
        incremental_state: Optional[Dict[str, Dict[str, Optional[Tensor]]]] = None,
    ) -> tuple[Tensor, Optional[SwitchAux]]:
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(
            query=x,
            key=x,
            value=x,
            key_padding_mask=self_attn_padding_mask,
            incremental_state=incremental_state,
            need_weights=False,
            attn_mask=self_attn_mask,
        )
        x = residual + F.dropout(x, p=self.dropout, training=self.training)
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        # SwitchFFN flattens tokens in (B, T) order, so "first come" means batch-major order.
        pad_bt = None if self_attn_padding_mask is None else self_attn_padding_mask  # (B, T)
        y, aux = self.ffn(x.transpose(0, 1), pad_bt)  # (B, T, C)
        x = residual + F.dropout(y.transpose(0, 1), p=self.dropout, training=self.training)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x, aux
