"""CPU kernel for the Switch experts: one small matmul per expert over its contiguous tokens.

Why a hand-written autograd function instead of plain autograd or one batched matmul:

- On CPU a (tokens_e, d) x (d, f) matmul per expert stays in cache where the dense FFN's
  (tokens, f) activation does not, so E small matmuls are as fast as the dense layer's one
  (benchmarks/switch_ffn.py).  The batched ``[E, C, d]`` path instead pays for empty capacity
  slots and, in backward, for bmm over transposed views whose weight gradients come out
  non-contiguous and are copied again by AccumulateGrad (490 ms at E = 64).
- Plain autograd over ``weight[e]`` slices of the stacked parameters is worse still: the
  backward of every slice builds a zero-filled full ``[E, ...]`` gradient (E full copies).
- Here the backward writes each expert's gradient straight into its row of one contiguous
  ``[E, ...]`` gradient (``out=``), so there is no copy, and rows of experts that got no token
  are zero (growth slots and DDP then see the same gradient layout as the stacked parameters).

Only ReLU is fused (fairseq's and the paper's default).  Activation dropout is supported: for
h = relu(a) * m / (1 - p) with m in {0, 1}, dh/da = [h > 0] / (1 - p), so only the output h
is saved, exactly what the dense FFN keeps.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Optional

import numpy as np
import torch
from torch import Tensor
from torch.autograd.function import once_differentiable


class GradientPool:
    """Reuses large CPU buffers (stacked expert-weight gradients, hidden activations) across steps.

    Why: torch has no caching allocator on CPU, and glibc serves every allocation above 32 MiB
    with a fresh mmap whose pages fault in on first write.  Stacked expert gradients are E times
    a dense layer's (256 MiB per weight at E = 64, d 512, f 2048); filling a fresh one took
    134 ms against 14 ms for a reused one on our 2-core machines.

    A block is handed out again only when nothing holds it any more (the optimizer has set
    ``param.grad = None``, as fairseq does every step); otherwise a new block is made, so
    gradient accumulation, DDP buckets, views, or a caller keeping ``.grad`` never see their
    memory overwritten.  How that is known with public APIs only: each block is a numpy byte
    array, and each hand-out wraps a fresh numpy view of it (``lease``) with ``torch.from_numpy``.
    The tensor's storage owns the lease, so the lease lives exactly as long as any tensor or
    view on that memory; the pool keeps only a weak reference to it.  The hand-out itself is a
    fresh, non-view tensor (``set_`` on that storage) of any torch dtype, bfloat16 included, so
    autograd adopts it as ``.grad`` without copying.  Not used on GPU, where the CUDA caching
    allocator already recycles memory.
    """

    ALIGNMENT = 64  # bytes, as torch's own CPU allocator (vectorised kernels and MKL like it)

    def __init__(self) -> None:
        self._blocks: dict[str, np.ndarray] = {}  # name -> aligned uint8 block
        self._leases: dict[str, weakref.ref] = {}  # name -> the block's current hand-out

    def __deepcopy__(self, memo: dict) -> "GradientPool":
        return GradientPool()  # a copied module gets its own (empty) pool

    def __getstate__(self) -> dict:
        return {"_blocks": {}, "_leases": {}}

    def empty(self, name: str, shape: tuple[int, ...], ref: Tensor) -> Tensor:
        """An uninitialised contiguous tensor of ``shape`` with ``ref``'s dtype and device, on
        reused memory when possible.  A stored block at least as large is reused (its prefix), so
        batches whose kept-token count varies still hit the pool."""
        if ref.device.type != "cpu":
            return ref.new_empty(shape)
        nbytes = math.prod(shape) * ref.element_size()
        block = self._blocks.get(name)
        lease = self._leases.get(name)
        if block is None or block.nbytes < nbytes or (lease is not None and lease() is not None):
            block = self._allocate(nbytes)
            self._blocks[name] = block
        view = block[:nbytes]  # a new ndarray object: the lease of this hand-out
        self._leases[name] = weakref.ref(view)
        storage = torch.from_numpy(view).untyped_storage()
        return torch.empty(0, dtype=ref.dtype).set_(storage, 0, shape)

    def empty_like(self, name: str, ref: Tensor) -> Tensor:
        """``empty(name, ref.shape, ref)``."""
        return self.empty(name, tuple(ref.shape), ref)

    @classmethod
    def _allocate(cls, nbytes: int) -> np.ndarray:
        """A uint8 block of ``nbytes`` starting on an ``ALIGNMENT``-byte boundary."""
        raw = np.empty(nbytes + cls.ALIGNMENT, dtype=np.uint8)
        offset = -raw.ctypes.data % cls.ALIGNMENT
        return raw[offset : offset + nbytes]


class ReluExpertSegments(torch.autograd.Function):
    """y[s_e] = relu(x[s_e] W1[e]^T + b1[e]) W2[e]^T + b2[e] over consecutive segments s_e.

    Inputs: ``x_sorted`` (K, d) tokens grouped by expert in expert order; ``counts`` the
    group sizes (a Python list, len <= E); weights in SwitchFFN's layout ``w1 (E, f, d)``,
    ``b1 (E, f)``, ``w2 (E, d, f)``, ``b2 (E, d)``; ``pool`` supplies reusable memory for the
    weight gradients, the saved hidden activations and the backward's scratch block.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x_sorted: Tensor,
        w1: Tensor,
        b1: Tensor,
        w2: Tensor,
        b2: Tensor,
        counts: list[int],
        dropout_p: float,
        pool: GradientPool,
    ) -> Tensor:
        x_sorted = x_sorted.contiguous()
        num_tokens = x_sorted.shape[0]
        hidden = pool.empty("hidden", (num_tokens, w1.shape[1]), x_sorted)  # (K, f), saved
        out = x_sorted.new_empty(num_tokens, w2.shape[1])  # (K, d)
        start = 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            seg = slice(start, start + count)
            h = hidden[seg]
            torch.addmm(b1[e], x_sorted[seg], w1[e].t(), out=h)
            h.relu_()
            if dropout_p > 0:
                h.mul_(torch.empty_like(h).bernoulli_(1.0 - dropout_p)).div_(1.0 - dropout_p)
            torch.addmm(b2[e], h, w2[e].t(), out=out[seg])
            start += count
        ctx.counts, ctx.dropout_p, ctx.pool = counts, dropout_p, pool
        ctx.save_for_backward(x_sorted, w1, w2, hidden)
        return out

    @staticmethod
    @once_differentiable  # second derivatives (e.g. gradient penalties) are not supported
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        x_sorted, w1, w2, hidden = ctx.saved_tensors
        pool: GradientPool = ctx.pool
        need = dict(zip(("x", "w1", "b1", "w2", "b2"), ctx.needs_input_grad[:5]))
        grad_out = grad_out.contiguous()
        grads: dict[str, Optional[Tensor]] = {
            "x": torch.empty_like(x_sorted) if need["x"] else None,
            "w1": pool.empty_like("w1", w1) if need["w1"] else None,
            "w2": pool.empty_like("w2", w2) if need["w2"] else None,
            "b1": w1.new_empty(w1.shape[:2]) if need["b1"] else None,
            "b2": w2.new_empty(w2.shape[:2]) if need["b2"] else None,
        }
        idle = [e for e, count in enumerate(ctx.counts) if count == 0]
        idle += list(range(len(ctx.counts), w1.shape[0]))  # slots beyond the groups given
        for name in ("w1", "b1", "w2", "b2"):
            if grads[name] is not None and idle:
                grads[name][idle] = 0.0  # experts without tokens: zero rows, never garbage
        # Gradient w.r.t. the pre-activation, one segment at a time (at most the busiest expert).
        scratch = pool.empty("grad_hidden", (max(ctx.counts, default=0), hidden.shape[1]), hidden)
        start = 0
        for e, count in enumerate(ctx.counts):
            if count == 0:
                continue
            seg = slice(start, start + count)
            go, h, gh = grad_out[seg], hidden[seg], scratch[:count]  # (c, d), (c, f), (c, f)
            torch.mm(go, w2[e], out=gh)
            torch.ops.aten.threshold_backward.grad_input(gh, h, 0.0, grad_input=gh)  # ReLU mask
            if ctx.dropout_p > 0:
                gh.mul_(1.0 / (1.0 - ctx.dropout_p))
            if grads["x"] is not None:
                torch.mm(gh, w1[e], out=grads["x"][seg])
            if grads["w2"] is not None:
                torch.mm(go.t(), h, out=grads["w2"][e])
            if grads["b2"] is not None:
                torch.sum(go, 0, out=grads["b2"][e])
            if grads["w1"] is not None:
                torch.mm(gh.t(), x_sorted[seg], out=grads["w1"][e])
            if grads["b1"] is not None:
                torch.sum(gh, 0, out=grads["b1"][e])
            start += count
        return grads["x"], grads["w1"], grads["b1"], grads["w2"], grads["b2"], None, None, None


def relu_expert_segments(
    x_sorted: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    counts: list[int],
    dropout_p: float = 0.0,
    pool: Optional[GradientPool] = None,
) -> Tensor:
    """(K, d) tokens grouped by expert -> (K, d) expert outputs; see ReluExpertSegments."""
    if len(counts) > w1.shape[0]:
        raise ValueError(f"{len(counts)} expert groups but only {w1.shape[0]} experts")
    if sum(counts) != x_sorted.shape[0]:
        raise ValueError(f"group sizes sum to {sum(counts)} but {x_sorted.shape[0]} tokens were given")
    pool = GradientPool() if pool is None else pool  # a throwaway pool: plain allocations
    return ReluExpertSegments.apply(x_sorted, w1, b1, w2, b2, counts, dropout_p, pool)
