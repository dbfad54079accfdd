"""One decoder block of the Switch Transformer LM: self-attention then a dense or Switch FFN.

Why our own block rather than fairseq's ``TransformerDecoderLayerBase``: fairseq's block computes
its FFN inline (fc1/fc2) and returns no auxiliary output, so an MoE FFN and its balance loss
cannot be slotted in without copying the whole forward.  This block reuses fairseq's
MultiheadAttention (its parameters, and its forward for incremental decoding and for batches
that need a key-padding mask) and keeps the FFN a swappable module.

Causal attention without masks (``attend_causally``): fairseq's attention adds a float causal
mask, and with a key-padding mask torch expands both into a (batch x heads, T, T) tensor that
every layer writes and reads, forward and backward; a float mask also rules out FlashAttention.
For a batch whose padding is at the end of each row (fairseq's language-model datasets pad on
the right), no real token ever sees a padding key under a causal mask, so
``scaled_dot_product_attention(is_causal=True)`` with no mask gives every real position the
same output; padding positions, which no loss or routing decision reads, attend to the tokens
before them instead of nothing.  The decoder checks the padding is on the right
(``SwitchTransformerDecoder.attention_needs_no_mask``).
"""

from __future__ import annotations

import warnings
from typing import Dict, Optional

import torch.nn.functional as F
from fairseq.modules import LayerNorm, MultiheadAttention
from torch import Tensor, nn

from ..modules.switch_ffn import SwitchAux, SwitchFFN, _activation

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
        attend_causally: bool = False,
    ) -> tuple[Tensor, Optional[SwitchAux]]:
        """x: (T, B, C).  ``attend_causally``: causal attention with no mask at all (module doc;
        the caller guarantees padding only at the end of each row), else fairseq's attention
        with ``self_attn_mask`` and the key-padding mask.  The FFN always gets the padding mask."""
        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        if attend_causally and incremental_state is None:
            x = causal_self_attention(self.self_attn, x, self.training)
        else:
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
        if self.is_moe:  # "first come" is batch-major: routed in (B, T) order, tokens unmoved
            y, aux = self.ffn(x, self_attn_padding_mask, seq_first=True)  # (T, B, C), mask (B, T)
        else:
            y, aux = self.ffn(x)
        x = residual + F.dropout(y, p=self.dropout, training=self.training)
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x, aux


def causal_self_attention(attention: MultiheadAttention, x: Tensor, training: bool) -> Tensor:
    """(T, B, C) -> (T, B, C): ``attention``'s projections around causal scaled dot-product
    attention with no mask (FlashAttention where torch has it).  The same computation as
    fairseq's ``MultiheadAttention`` (three input projections, softmax(q k^T / sqrt(head_dim)),
    attention dropout, output projection) without its masks (module doc)."""
    length, batch, dim = x.shape
    heads, head_dim = attention.num_heads, attention.head_dim

    def project(linear: nn.Linear) -> Tensor:  # (B, heads, T, head_dim)
        return F.linear(x, linear.weight, linear.bias).view(length, batch, heads, head_dim).permute(1, 2, 0, 3)

    dropout = attention.dropout_module
    p = dropout.p if training or dropout.apply_during_inference else 0.0
    out = F.scaled_dot_product_attention(project(attention.q_proj), project(attention.k_proj),
                                         project(attention.v_proj), dropout_p=p, is_causal=True)
    out = out.permute(2, 0, 1, 3).reshape(length, batch, dim)  # (T, B, C)
    return attention.out_proj(out)
