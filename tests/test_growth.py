"""Expert growth (issue #3 item 3): copies weights, router rows and optimizer moments."""

import torch

from fairseq_alma.lm.growth import copy_experts
from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig


def test_copy_experts_copies_weights_router_rows_and_adam_moments():
    torch.manual_seed(0)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 2, max_experts=5, capacity_factor=2.0))
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    y, aux = layer(torch.randn(32, 8))
    (y.pow(2).sum() + aux.balance_loss).backward()
    opt.step()
    before_rows = layer.router.weight.detach().clone()
    new = copy_experts(layer, [1, 0], optimizer=opt)
    assert new == [2, 3] and layer.num_experts == 4 and int(layer.num_active) == 4
    for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
        p = getattr(layer, name)
        assert torch.equal(p[2], p[1]) and torch.equal(p[3], p[0])
        for moment in ("exp_avg", "exp_avg_sq"):
            m = opt.state[p][moment]
            assert torch.equal(m[2], m[1]) and torch.equal(m[3], m[0])
    # router rows: copy and source differ by a small symmetric tie-break, not exactly equal
    assert not torch.equal(layer.router.weight[2], layer.router.weight[1])
    assert torch.allclose(layer.router.weight[2] + layer.router.weight[1], 2 * before_rows[1], atol=1e-6)
    assert (layer.router.weight[2] - layer.router.weight[1]).norm() < 0.05 * before_rows[1].norm()
    # the optimizer's parameter list is unchanged and now updates the new experts too
    opt.zero_grad()
    layer.train()
    with torch.no_grad():
        layer.router.weight[2:4] += 1.0  # send tokens to the new experts
    y, aux = layer(torch.randn(64, 8))
    y.pow(2).sum().backward()
    before = layer.fc1_weight[2].clone()
    opt.step()
    assert not torch.equal(before, layer.fc1_weight[2])


def test_copy_beyond_allocated_slots_is_refused():
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 2, max_experts=3))
    try:
        copy_experts(layer, [0, 1])
    except ValueError as exc:
        assert "--moe-max-experts" in str(exc)
    else:
        raise AssertionError("expected ValueError")
