"""The fused router (one autograd node) equals the reference routing maths of switch_routing.py:
routing decisions, both losses, the diagnostics and every gradient, in float64."""

from __future__ import annotations

import pytest
import torch

from fairseq_alma.modules.expert_padded import buffer_rows, padded_experts
from fairseq_alma.modules.router_kernel import route_tokens
from fairseq_alma.modules.switch_routing import (
    balance_loss,
    expert_capacity,
    moe_losses,
    route_top1,
    router_z_loss,
    routing_diagnostics,
    summed_diagnostics,
)

CASES = [  # (tokens, d, active experts, slots, capacity factor, padded, prioritized, jitter)
    (40, 8, 4, 4, 1.0, False, False, 0.0),
    (40, 8, 4, 6, 1.0, True, False, 0.0),  # growth slack: 2 inactive slots
    (64, 16, 8, 8, 0.5, True, True, 0.0),
    (33, 8, 3, 3, None, True, False, 0.0),  # unlimited capacity (evaluation)
    (48, 8, 1, 1, 1.0, True, False, 0.0),  # one expert
    (50, 8, 5, 5, 1.25, True, False, 0.1),  # jitter
]


def reference(x: torch.Tensor, weight: torch.Tensor, experts: int, capacity_factor, padding, prioritized,
              noise=None):
    """switch_routing's functions under plain autograd."""
    xr = x if noise is None else x * noise
    logits = xr @ weight[:experts].t()
    valid = None if padding is None else ~padding
    routing = route_top1(logits, capacity_factor, valid, batch_prioritized=prioritized)
    return routing, balance_loss(routing, valid), router_z_loss(logits, valid), routing_diagnostics(routing, valid)


@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_fused_router_equals_the_reference_in_values_and_gradients(case):
    tokens, d, experts, slots, cf, padded, prioritized, jitter = case
    torch.manual_seed(tokens + experts)
    x = torch.randn(tokens, d, dtype=torch.float64)
    weight = torch.randn(slots, d, dtype=torch.float64)
    padding = None
    if padded:
        padding = torch.zeros(tokens, dtype=torch.bool)
        padding[-7:] = True
        padding[3] = True  # padding in the middle too
        x[padding] = 1e4  # garbage at padding never reaches a loss or a token's gradient
    capacity = expert_capacity(tokens, experts, cf)
    upstream = torch.randn(tokens, dtype=torch.float64)  # dL/dgate

    x1, w1 = x.clone().requires_grad_(), weight.clone().requires_grad_()
    torch.manual_seed(0)
    routed = route_tokens(x1, w1, experts, capacity, padding, jitter, prioritized)
    fused_balance, fused_z = (term[0] for term in moe_losses(
        routed.counts.unsqueeze(0), routed.prob_sums.unsqueeze(0), routed.lse_square_sum.reshape(1)))
    loss = (routed.gate.double() * upstream).sum() + 0.3 * fused_balance + 0.7 * fused_z
    loss.backward()

    torch.manual_seed(0)
    noise = torch.empty(tokens, d, dtype=torch.float32).uniform_(1 - jitter, 1 + jitter).double() if jitter else None
    x2, w2 = x.clone().requires_grad_(), weight.clone().requires_grad_()
    routing, balance, z, diagnostics = reference(x2, w2, experts, cf, padding, prioritized, noise)
    ref_loss = (routing.gate * upstream).sum() + 0.3 * balance + 0.7 * z
    ref_loss.backward()

    assert torch.equal(routed.expert, routing.expert)
    assert torch.equal(routed.keep, routing.keep)
    valid = torch.ones(tokens, dtype=torch.bool) if padding is None else ~padding
    assert torch.equal(routed.slot[valid].long(), routing.slot[valid])
    assert torch.equal(routed.counts, routing.counts.to(routed.counts.dtype))
    torch.testing.assert_close(routed.gate.double(), routing.gate.double(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(fused_balance.double(), balance.double(), rtol=1e-6, atol=0)
    torch.testing.assert_close(fused_z.double(), z.double(), rtol=1e-6, atol=0)
    entropy = torch.special.entr(routed.probs).sum().reshape(1)
    fused = summed_diagnostics(routed.counts.unsqueeze(0), entropy, capacity)
    for key, value in diagnostics.items():
        torch.testing.assert_close(fused[key].double(), value.double(), rtol=1e-5, atol=1e-5, msg=key)
    # gradients: the fused router runs in float32, the reference in float64
    assert x1.grad.dtype == torch.float64 and w1.grad.dtype == torch.float64
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=1e-4, atol=1e-5)
    if padding is not None:
        assert torch.equal(x1.grad[padding], torch.zeros(int(padding.sum()), d, dtype=torch.float64))
    if slots > experts:
        assert not w1.grad[experts:].any()  # inactive growth slots get exactly 0


def test_nan_at_padding_reaches_no_loss_and_no_token_gradient():
    torch.manual_seed(3)
    x = torch.randn(20, 8)
    padding = torch.zeros(20, dtype=torch.bool)
    padding[15:] = True
    x[padding] = float("nan")
    x.requires_grad_()
    routed = route_tokens(x, torch.randn(4, 8), 4, 5, padding)
    balance, z = moe_losses(routed.counts.unsqueeze(0), routed.prob_sums.unsqueeze(0), routed.lse_square_sum.reshape(1))
    assert torch.isfinite(balance).all() and torch.isfinite(z).all()
    assert torch.isfinite(routed.probs).all() and not routed.keep[padding].any()
    (routed.gate.sum() + balance.sum() + z.sum()).backward()
    assert torch.isfinite(x.grad[~padding]).all() and not x.grad[padding].any()


def test_padded_experts_equal_per_token_experts_with_every_gradient():
    """The GPU kernel (run here on CPU, float64): y_t = gate_t * expert_e(t)(x_t) for kept tokens,
    0 otherwise; gradients of the tokens, the gate and all four expert tensors (growth slots 0)."""
    torch.manual_seed(7)
    tokens, d, f, experts, slots = 30, 6, 10, 3, 5
    x = torch.randn(tokens, d, dtype=torch.float64, requires_grad=True)
    gate = torch.rand(tokens, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(slots, f, d, dtype=torch.float64), torch.randn(slots, f, dtype=torch.float64),
               torch.randn(slots, d, f, dtype=torch.float64), torch.randn(slots, d, dtype=torch.float64)]
    weights = [w.requires_grad_() for w in weights]
    expert = torch.randint(0, experts, (tokens,))
    expert[:2] = experts  # padding
    route_top1(torch.nn.functional.one_hot(expert.clamp(max=experts - 1), experts).double(), 1.0)
    rank = torch.zeros(tokens, dtype=torch.long)
    for e in range(experts + 1):
        ids = (expert == e).nonzero().squeeze(1)
        rank[ids] = torch.arange(1, len(ids) + 1)
    capacity = 8
    keep = (rank <= capacity) & (expert < experts)
    assert not keep.all() and keep.sum() > tokens // 2  # some dropped, most kept
    row = buffer_rows(expert, rank, keep, capacity)
    y = padded_experts(x, gate, row, tuple(weights), experts, capacity)
    grad = torch.randn(tokens, d, dtype=torch.float64)
    (y * grad).sum().backward()
    got = [x.grad, gate.grad] + [w.grad for w in weights]

    for t in [x, gate, *weights]:
        t.grad = None
    w1, b1, w2, b2 = weights
    rows = []
    for t in range(tokens):
        if keep[t]:
            e = int(expert[t])
            h = torch.relu(w1[e] @ x[t] + b1[e])
            rows.append(gate[t] * (w2[e] @ h + b2[e]))
        else:
            rows.append(torch.zeros(d, dtype=torch.float64))
    reference_y = torch.stack(rows)
    (reference_y * grad).sum().backward()
    torch.testing.assert_close(y, reference_y)
    for mine, want in zip(got, [x.grad, gate.grad] + [w.grad for w in weights]):
        torch.testing.assert_close(mine, want)
    assert not got[2][experts:].any() and not got[5][experts:].any()


def test_routing_seq_first_rows_batch_major_equals_routing_the_transposed_batch():
    """seq_first: (T, B, d) rows routed in (B, T) order without moving them give, token for
    token, what routing the (B, T, d) copy gives: outputs, losses, every gradient; with padding,
    batch-prioritised routing and dropped tokens."""
    from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig

    for prioritized in (False, True):
        torch.manual_seed(5)
        cfg = SwitchFFNConfig(8, 16, 4, capacity_factor=0.75, z_loss=True, expert_kernel="batched",
                              batch_prioritized_routing=prioritized)
        layer = SwitchFFN(cfg)
        x_bt = torch.randn(3, 10, 8)
        padding = torch.zeros(3, 10, dtype=torch.bool)
        padding[2, 7:] = True
        grads, outs = [], []
        for seq_first in (False, True):
            layer.zero_grad()
            x = (x_bt.transpose(0, 1).contiguous() if seq_first else x_bt.clone()).requires_grad_()
            y, aux = layer(x, padding, seq_first=seq_first)
            y_bt = y.transpose(0, 1) if seq_first else y
            (y_bt * torch.arange(8.0)).sum().add(aux.balance_loss + aux.z_loss).backward()
            dx = x.grad.transpose(0, 1) if seq_first else x.grad
            outs.append((y_bt, aux.balance_loss, aux.z_loss, aux.diagnostics["dropped"]))
            grads.append([dx] + [p.grad.clone() for p in layer.parameters()])
        assert outs[0][3] > 0  # tokens were dropped: the order mattered
        for a, b in zip(outs[0] + tuple(grads[0]), outs[1] + tuple(grads[1])):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["bf16", "autocast-bf16"])
def test_batched_layer_in_low_precision_matches_float32(mode):
    """The GPU path's precision handling, run on CPU: a bf16 layer (as --bf16) and a float32 layer
    under bf16 autocast (as --amp) give float32's outputs and gradients within bf16 rounding,
    each gradient in its parameter's dtype; the router stays float32 (same routing)."""
    from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig

    torch.manual_seed(11)
    cfg = SwitchFFNConfig(16, 32, 4, capacity_factor=1.0, z_loss=True, expert_kernel="batched")
    reference, layer = SwitchFFN(cfg), SwitchFFN(cfg)
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(2, 24, 16)
    padding = torch.zeros(2, 24, dtype=torch.bool)
    padding[1, 20:] = True
    grad = torch.randn(2, 24, 16)

    def run(module, inputs, autocast):
        inputs = inputs.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y, aux = module(inputs, padding)
        (y.float() * grad).sum().add(aux.balance_loss + aux.z_loss).backward()
        return y.float(), inputs.grad.float(), {n: p.grad for n, p in module.named_parameters()}, aux

    want_y, want_dx, want_grads, want_aux = run(reference, x, False)
    if mode == "bf16":
        layer = layer.to(torch.bfloat16)
        got_y, got_dx, got_grads, got_aux = run(layer, x.to(torch.bfloat16), False)
    else:
        got_y, got_dx, got_grads, got_aux = run(layer, x, True)
    assert torch.equal(got_aux.counts, want_aux.counts)  # same routing: router in float32
    for got, want in [(got_y, want_y), (got_dx, want_dx)] + [(got_grads[n].float(), want_grads[n]) for n in want_grads]:
        assert ((got - want).norm() / want.norm()).item() < 3e-2
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    assert all(g.dtype == dtype for g in got_grads.values())
