"""FLOPs of a Switch LM as the stream records them (formula in fairseq_alma/stream/transformer_flops.py)."""

from __future__ import annotations

from typing import Any, Tuple

from ..stream.transformer_flops import SwitchLMShape


def _members(model: Any) -> list:
    """Member decoders: one for a Switch LM, N for UMix (members share one shape)."""
    return list(getattr(model.decoder, "members", [model.decoder]))


def _dense_ffn_dim(layer: Any) -> int:
    """FFN width of a dense block: ours (``layer.ffn.fc1``) or fairseq's transformer (``fc1``)."""
    ffn = getattr(layer, "ffn", layer)
    return ffn.fc1.out_features


# parts of fairseq's transformer_lm that the analytic count has no term for
UNCOUNTED_PARTS = {
    "project_in_dim": "a projection from --decoder-input-dim",
    "project_out_dim": "a projection to --decoder-output-dim",
    "adaptive_softmax": "an adaptive softmax (--adaptive-softmax-cutoff)",
}


def model_shape(model: Any, context: int, convention: str = "full") -> SwitchLMShape:
    """The sizes of a Switch LM, a UMix member, or fairseq's own ``transformer_lm`` (dense).

    The width is the blocks' (their attention's), not the embedding table's: fairseq's
    ``transformer_lm`` keeps ``--decoder-input-dim`` at 512 unless given, and a model with
    parts the count has no term for (``UNCOUNTED_PARTS``) is refused rather than miscounted
    (training refuses its flags first: ``fairseq_glue/train_flags.check_dense_lm_shape``)."""
    from ..errors import UsageError

    decoder = _members(model)[0]
    layers = getattr(decoder, "layers", None)
    if not layers or not hasattr(layers[0], "self_attn") or not hasattr(decoder, "embed_tokens"):
        raise UsageError(f"the FLOPs count (stream/transformer_flops.py) takes transformer decoders, "
                         f"and {type(model).__name__} is none: use --arch switch_transformer_lm*, "
                         f"umix_switch_transformer_lm* or fairseq's transformer_lm*")
    extra = [what for name, what in UNCOUNTED_PARTS.items() if getattr(decoder, name, None) is not None]
    if extra or not hasattr(decoder.embed_tokens, "embedding_dim"):
        raise UsageError(f"the FLOPs count of this model would be wrong: it has "
                         f"{', '.join(extra) or 'no token embedding table (adaptive or character input)'}, "
                         f"which the count (stream/transformer_flops.py) has no term for")
    moe = decoder.moe_layers() if hasattr(decoder, "moe_layers") else []
    return SwitchLMShape(
        n_layers=len(decoder.layers),
        d_model=decoder.layers[0].self_attn.embed_dim,
        ffn_dim=(moe[0].ffn_dim if moe else _dense_ffn_dim(decoder.layers[0])),
        vocab_size=decoder.embed_tokens.num_embeddings,
        context=context,
        moe_layers=len(moe),
        num_experts=max((m.num_experts for m in moe), default=1),
        convention=convention,
    )


def model_flops(model: Any, context: int, train_tokens: int,
                convention: str = "full") -> Tuple[int, int]:
    """(inference FLOPs per token, training FLOPs for ``train_tokens`` tokens); UMix runs N members.
    ``convention``: how attention scores count (``stream/transformer_flops.py``)."""
    shape = model_shape(model, context, convention)
    n = len(_members(model))
    return n * shape.forward_flops_per_token(), n * shape.train_flops(train_tokens)
