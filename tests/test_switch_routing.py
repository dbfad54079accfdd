"""Routing maths on hand-made logits (Switch §2.1-2.2; issue #2)."""

import math

import pytest
import torch

from fairseq_alma.modules.switch_routing import (
    balance_loss,
    expert_capacity,
    route_top1,
    router_z_loss,
    routing_diagnostics,
)


def logits_for(experts: list[int], num_experts: int, strength: float = 5.0) -> torch.Tensor:
    """Logits whose argmax is the given expert per token."""
    logits = torch.zeros(len(experts), num_experts)
    logits[torch.arange(len(experts)), torch.tensor(experts)] = strength
    return logits


def test_capacity_formula():
    assert expert_capacity(6, 2, 1.0) == 3
    assert expert_capacity(7, 2, 1.0) == 4  # ceil(7/2) = 4
    assert expert_capacity(8, 4, 1.5) == 3  # int(1.5 * 2)
    assert expert_capacity(10, 4, 1.25) == 3  # int(1.25 * 3) = 3
    assert expert_capacity(10, 4, None) is None
    with pytest.raises(ValueError):
        expert_capacity(10, 4, 0.0)


def test_first_come_first_served_and_dropping():
    # 6 tokens, 2 experts, capacity int(1.0 * ceil(6/2)) = 3; four tokens want expert 0.
    routing = route_top1(logits_for([0, 1, 0, 0, 0, 1], 2), capacity_factor=1.0)
    assert routing.capacity == 3
    assert routing.expert.tolist() == [0, 1, 0, 0, 0, 1]
    assert routing.slot.tolist() == [0, 0, 1, 2, 3, 1]
    # token 4 is the 4th to ask for expert 0: it overflows and is dropped
    assert routing.keep.tolist() == [True, True, True, True, False, True]
    p = math.exp(5) / (math.exp(5) + 1)
    assert torch.allclose(routing.gate, torch.full((6,), p))


def test_padding_counts_towards_capacity_but_takes_no_slot():
    """Capacity comes from all positions (fairseq's top1gating; a Python int, no host read),
    yet padding never occupies a slot: the real tokens keep the room it would have taken."""
    valid = torch.tensor([True, False, True, False, True, True, True, False])
    routing = route_top1(logits_for([0, 0, 0, 0, 0, 0, 0, 1], 2), capacity_factor=1.0, valid=valid)
    assert routing.capacity == 4  # int(1.0 * ceil(8 / 2)): 8 positions, 3 of them padding
    # expert 0's real tokens 0, 2, 4, 5, 6 take slots 0-3 and token 6 overflows; had padding
    # taken slots, token 5 would have been dropped as well
    assert routing.slot[valid].tolist() == [0, 1, 2, 3, 4]
    assert routing.keep.tolist() == [True, False, True, False, True, True, False, False]
    assert routing.expert[~valid].tolist() == [2, 2, 2]  # id no expert has
    assert routing.gate[~valid].tolist() == [0.0, 0.0, 0.0]


def test_balance_loss_hand_computed():
    logits = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0], [3.0, 0.0, 1.0], [0.0, 0.0, 0.5]])
    routing = route_top1(logits, None)
    probs = torch.softmax(logits, -1)
    f = torch.tensor([2 / 4, 1 / 4, 1 / 4])  # argmax = 0, 1, 0, 2
    p_mean = probs.mean(0)
    expected = 3 * float((f * p_mean).sum())
    assert balance_loss(routing).item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("num_experts", [1, 2, 4, 8])
def test_balance_loss_is_one_when_uniform(num_experts):
    # perfectly uniform probabilities
    assert balance_loss(route_top1(torch.zeros(16, num_experts), 1.0)).item() == pytest.approx(1.0)
    # perfectly balanced assignment with equal confidence per expert
    experts = [i % num_experts for i in range(4 * num_experts)]
    routing = route_top1(logits_for(experts, num_experts), 1.0)
    assert balance_loss(routing).item() == pytest.approx(1.0, rel=1e-6)


def test_balance_loss_grows_with_imbalance():
    routing = route_top1(logits_for([0] * 8, 4, strength=20.0), 1.0)
    assert balance_loss(routing).item() == pytest.approx(4.0, rel=1e-3)


def test_balance_loss_ignores_padding():
    logits = torch.randn(10, 4)
    valid = torch.tensor([True] * 6 + [False] * 4)
    with_pad = balance_loss(route_top1(logits, 1.0, valid), valid)
    only_valid = balance_loss(route_top1(logits[:6], 1.0))
    assert with_pad.item() == pytest.approx(only_valid.item(), rel=1e-6)


def test_z_loss_hand_computed_and_masked():
    logits = torch.tensor([[0.0, 0.0], [1.0, 2.0], [5.0, 5.0]])
    lse = torch.logsumexp(logits, -1)
    assert router_z_loss(logits).item() == pytest.approx(float((lse**2).mean()), rel=1e-6)
    valid = torch.tensor([True, True, False])
    assert router_z_loss(logits, valid).item() == pytest.approx(float((lse[:2] ** 2).mean()), rel=1e-6)


def test_diagnostics():
    routing = route_top1(logits_for([0, 1, 0, 0, 0, 1], 4), capacity_factor=1.0)
    # capacity int(ceil(6/4)) = 2 -> expert 0 keeps 2 of 4, expert 1 keeps 2 of 2
    d = routing_diagnostics(routing)
    assert d["tokens"].item() == 6
    assert d["dropped"].item() == 2
    assert d["unused"].item() == 2
    assert d["load_max"].item() == pytest.approx(4 / 6 * 4)
    assert d["load_min"].item() == 0.0
    probs = torch.softmax(logits_for([0, 1, 0, 0, 0, 1], 4), -1)
    entropy = -(probs * probs.log()).sum(-1).sum()
    assert d["entropy_sum"].item() == pytest.approx(entropy.item(), rel=1e-5)


import pytest  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_router_is_float32_under_autocast_and_padding_never_reaches_the_losses(dtype):
    """Under torch.autocast (fairseq --amp) the router's matmul stays float32: routing
    decisions and the balance loss equal the float32 ones; NaN in padding rows changes
    nothing."""
    from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig

    torch.manual_seed(0)
    layer = SwitchFFN(SwitchFFNConfig(16, 32, 4, capacity_factor=1.0, z_loss=True)).eval()
    x = torch.randn(2, 12, 16)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, 8:] = True
    logits32 = layer.router_logits(x.reshape(-1, 16))
    _, aux32 = layer(x, padding)
    with torch.autocast("cpu", dtype=dtype):
        logits = layer.router_logits(x.reshape(-1, 16))
        _, aux = layer(x, padding)
    assert logits.dtype == torch.float32 and torch.equal(logits, logits32)
    assert torch.equal(aux.balance_loss, aux32.balance_loss) and torch.equal(aux.z_loss, aux32.z_loss)
    poisoned = x.clone()
    poisoned[1, 8:] = float("nan")  # whatever padding holds
    _, aux_nan = layer(poisoned, padding)
    assert torch.isfinite(aux_nan.balance_loss) and torch.equal(aux_nan.balance_loss, aux32.balance_loss)
    assert torch.equal(aux_nan.z_loss, aux32.z_loss)
    assert aux_nan.diagnostics["tokens"] == 20 and torch.isfinite(aux_nan.diagnostics["entropy_sum"])


def test_batch_prioritized_routing_keeps_the_most_confident_tokens():
    # 4 tokens, 2 experts, capacity 2; three want expert 0 with gates rising in token order.
    logits = torch.tensor([[1.0, 0.0], [2.0, 0.0], [3.0, 0.0], [0.0, 1.0]])
    first_come = route_top1(logits, capacity_factor=1.0)
    assert first_come.keep.tolist() == [True, True, False, True]  # the most confident is dropped
    prioritized = route_top1(logits, capacity_factor=1.0, batch_prioritized=True)
    assert prioritized.slot.tolist() == [2, 1, 0, 0]
    assert prioritized.keep.tolist() == [False, True, True, True]
    # same experts, gates and losses: only who keeps a slot changes
    assert torch.equal(prioritized.expert, first_come.expert)
    assert torch.equal(balance_loss(prioritized), balance_loss(first_come))


def test_batch_prioritized_routing_ignores_padding_and_ties_keep_token_order():
    logits = torch.tensor([[2.0, 0.0], [2.0, 0.0], [9.0, 0.0], [2.0, 0.0], [0.0, 1.0]])
    valid = torch.tensor([True, True, False, True, True])
    routing = route_top1(logits, capacity_factor=0.8, valid=valid, batch_prioritized=True)
    assert routing.capacity == 2  # int(0.8 * ceil(5 / 2)): all 5 positions count
    # the padding row's large logit gives it no slot; equal gates keep token order
    assert routing.keep.tolist() == [True, True, False, False, True]
