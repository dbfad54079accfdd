"""GPU kernel for the Switch experts: every expert as one batched matmul over ``[E, C, d]``.

Why this layout on a GPU: with a capacity C known from the shape, the buffer has a static size,
so the experts run as two ``baddbmm`` calls and nothing is read back to the host.  Why a
hand-written autograd function around it: top-1 routing with capacity is a partial permutation.
Each kept token owns exactly one buffer row, so moving tokens into the buffer (scatter) and
results back (gather) are each other's backward, with no atomic ``index_add_`` (autograd's
backward of a gather, which also funnelled every dropped token into one row).  The backward is
written out (~16 launches for the whole layer) and writes each weight gradient contiguously,
straight into its ``[E, ...]`` tensor, where autograd over transposed batched matmuls produced
non-contiguous gradients that were copied once more.

Buffer rows: row 0 is a sink that dropped and padding tokens point at (its output is zero, its
input is never read), expert e's slot s is row ``1 + e * C + s``; empty slots are zero, so they
contribute nothing to any gradient.  The gate scales the output here too, so the router's
gradient comes back as ``sum_d grad_y * expert_out`` without another pass.

Precision: the experts run in the dtype the layer is given (``model.half()`` / ``.bfloat16()``)
or, under ``torch.autocast``, in the autocast dtype with float32 weights cast per call, as
autocast would; gradients come back in each input's own dtype.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import once_differentiable

_ACTIVATION_BACKWARD = {
    "gelu": lambda grad, pre: torch.ops.aten.gelu_backward(grad, pre),
    "silu": lambda grad, pre: torch.ops.aten.silu_backward(grad, pre),
}


def buffer_rows(routed_expert: Tensor, rank: Tensor, keep: Tensor, capacity: int) -> Tensor:
    """(T,) buffer row of every token: ``1 + e * C + (rank - 1)`` if kept, else the sink row 0."""
    return torch.where(keep, torch.add(rank, routed_expert, alpha=capacity), 0)


def _active(param: Tensor, experts: int, dtype: torch.dtype) -> Tensor:
    """The first ``experts`` slots of a stacked parameter, in ``dtype`` (a view when possible)."""
    rows = param if experts == param.shape[0] else param[:experts]
    return rows if rows.dtype == dtype else rows.to(dtype)


def _full_grad(rows: Tensor, like: tuple[torch.Size, torch.dtype]) -> Tensor:
    """A gradient of a parameter's (shape, dtype) whose first rows are ``rows`` (growth slots: 0)."""
    shape, dtype = like
    if rows.shape[0] == shape[0]:
        return rows if rows.dtype == dtype else rows.to(dtype)
    full = rows.new_zeros(shape, dtype=dtype)
    full[: rows.shape[0]] = rows
    return full


class PaddedExperts(torch.autograd.Function):
    """y_t = gate_t * expert_{e(t)}(x_t) for kept tokens, 0 otherwise (module doc)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        tokens: Tensor,
        gate: Tensor,
        row: Tensor,
        w1: Tensor,
        b1: Tensor,
        w2: Tensor,
        b2: Tensor,
        experts: int,
        capacity: int,
        activation: str,
        dropout_p: float,
        compute_dtype: torch.dtype,
    ) -> Tensor:
        ctx.set_materialize_grads(False)
        dim = tokens.shape[1]
        x = tokens if tokens.dtype == compute_dtype else tokens.to(compute_dtype)
        slots = experts * capacity
        buf = x.new_zeros(slots + 1, dim)  # row 0: sink; empty slots stay 0
        buf.index_copy_(0, row, x)
        inputs = buf[1:].view(experts, capacity, dim)  # (E, C, d)
        fc1, fc2 = _active(w1, experts, compute_dtype), _active(w2, experts, compute_dtype)
        pre = torch.baddbmm(_active(b1, experts, compute_dtype).unsqueeze(1), inputs, fc1.transpose(1, 2))
        mask = None
        if activation == "relu":  # in place: relu's backward needs only its output
            hidden = pre.relu_()
            pre = None
        else:
            hidden = F.gelu(pre) if activation == "gelu" else F.silu(pre)
        if dropout_p > 0:
            mask = torch.empty_like(hidden).bernoulli_(1.0 - dropout_p)
            hidden = hidden.mul_(mask) if pre is None else hidden * mask
            hidden.div_(1.0 - dropout_p)
            if activation == "relu":
                mask = None  # relu: kept and positive <=> hidden > 0, no mask to keep
        out = x.new_empty(slots + 1, dim)
        torch.baddbmm(_active(b2, experts, compute_dtype).unsqueeze(1), hidden, fc2.transpose(1, 2),
                      out=out[1:].view(experts, capacity, dim))
        out[0].zero_()  # the sink: dropped and padding tokens get 0
        expert_out = out.index_select(0, row)  # (T, d), gate not applied
        y = expert_out * (gate if gate.dtype == compute_dtype else gate.to(compute_dtype)).unsqueeze(1)

        ctx.save_for_backward(gate, row, buf, hidden, pre, mask, expert_out, fc1, fc2)
        ctx.experts, ctx.capacity, ctx.activation, ctx.dropout_p = experts, capacity, activation, dropout_p
        ctx.tokens_dtype = tokens.dtype
        ctx.params = [(p.shape, p.dtype) for p in (w1, b1, w2, b2)]  # of the gradients
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_y: Tensor) -> tuple[Optional[Tensor], ...]:  # type: ignore[override]
        gate, row, buf, hidden, pre, mask, expert_out, fc1, fc2 = ctx.saved_tensors
        experts, capacity, dim = ctx.experts, ctx.capacity, buf.shape[1]
        w1, b1, w2, b2 = ctx.params
        needs = ctx.needs_input_grad
        if grad_y is None:
            return (None,) * 12
        grad_y = grad_y if grad_y.dtype == expert_out.dtype else grad_y.to(expert_out.dtype)
        gate_c = gate if gate.dtype == grad_y.dtype else gate.to(grad_y.dtype)
        grad_gate = (grad_y * expert_out).sum(1, dtype=gate.dtype) if needs[1] else None
        grad_rows = torch.zeros_like(buf)  # row 0 gathers dropped tokens' gradients: discarded
        grad_rows.index_copy_(0, row, grad_y * gate_c.unsqueeze(1))
        grad_out = grad_rows[1:].view(experts, capacity, dim)  # (E, C, d)

        grad_b2 = _full_grad(grad_out.sum(1), b2) if needs[6] else None
        grad_w2 = _full_grad(torch.bmm(grad_out.transpose(1, 2), hidden), w2) if needs[5] else None
        grad_hidden = torch.bmm(grad_out, fc2)  # (E, C, f)
        if ctx.dropout_p > 0:
            if mask is not None:
                grad_hidden.mul_(mask)
            grad_hidden.div_(1.0 - ctx.dropout_p)
        if ctx.activation == "relu":
            grad_pre = torch.ops.aten.threshold_backward(grad_hidden, hidden, 0.0)
        else:
            grad_pre = _ACTIVATION_BACKWARD[ctx.activation](grad_hidden, pre)
        grad_b1 = _full_grad(grad_pre.sum(1), b1) if needs[4] else None
        inputs = buf[1:].view(experts, capacity, dim)
        grad_w1 = _full_grad(torch.bmm(grad_pre.transpose(1, 2), inputs), w1) if needs[3] else None
        grad_tokens = None
        if needs[0]:
            grad_buf = torch.empty_like(buf)
            torch.bmm(grad_pre, fc1, out=grad_buf[1:].view(experts, capacity, dim))
            grad_buf[0].zero_()  # dropped and padding tokens: no gradient through the experts
            grad_tokens = grad_buf.index_select(0, row)
            if grad_tokens.dtype != ctx.tokens_dtype:
                grad_tokens = grad_tokens.to(ctx.tokens_dtype)
        return (grad_tokens, grad_gate, None, grad_w1, grad_b1, grad_w2, grad_b2,
                None, None, None, None, None)


def padded_experts(
    tokens: Tensor,
    gate: Tensor,
    row: Tensor,
    weights: tuple[Tensor, Tensor, Tensor, Tensor],
    experts: int,
    capacity: int,
    activation: str = "relu",
    dropout_p: float = 0.0,
) -> Tensor:
    """(T, d) tokens -> (T, d) gate-scaled expert outputs, 0 for tokens whose ``row`` is 0.

    ``row`` from ``buffer_rows``; ``weights`` the stacked ``(w1, b1, w2, b2)`` (all slots; only
    the first ``experts`` are used); ``dropout_p`` only in training (the caller decides)."""
    device = tokens.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return PaddedExperts.apply(tokens, gate, row, *weights, experts, capacity, activation, dropout_p, dtype)
    return PaddedExperts.apply(tokens, gate, row, *weights, experts, capacity, activation, dropout_p, tokens.dtype)
