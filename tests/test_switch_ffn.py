"""SwitchFFN layer behaviour (issue #2): dispatch, exact outputs, dense equivalence, gradients."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fairseq_alma.errors import UsageError
from fairseq_alma.models.switch_decoder_layer import DenseFFN
from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig
from fairseq_alma.modules.expert_padded import buffer_rows, padded_experts
from fairseq_alma.modules.switch_routing import route_top1


def manual_expert(layer: SwitchFFN, e: int, x: torch.Tensor) -> torch.Tensor:
    h = F.relu(F.linear(x, layer.fc1_weight[e], layer.fc1_bias[e]))
    return F.linear(h, layer.fc2_weight[e], layer.fc2_bias[e])


KERNELS = pytest.mark.parametrize("kernel", ["segments", "batched"])


@KERNELS
def test_exact_outputs_on_hand_made_routing(kernel):
    torch.manual_seed(0)
    layer = SwitchFFN(SwitchFFNConfig(4, 6, 2, capacity_factor=1.0, expert_kernel=kernel))
    x = torch.randn(6, 4)
    logits = torch.zeros(6, 2)
    logits[torch.arange(6), torch.tensor([0, 1, 0, 0, 0, 1])] = 3.0
    routing = route_top1(logits, 1.0)
    y = layer.dispatch(x, routing)
    for t in range(6):
        if routing.keep[t]:
            expected = routing.gate[t] * manual_expert(layer, int(routing.expert[t]), x[t : t + 1])[0]
            assert torch.allclose(y[t], expected, atol=1e-6)
        else:
            assert torch.equal(y[t], torch.zeros(4))  # dropped: residual passes the token through
    assert not routing.keep[4]


def test_forward_shape_and_aux():
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4))
    y, aux = layer(torch.randn(3, 5, 8))
    assert y.shape == (3, 5, 8)
    assert aux.balance_loss.requires_grad
    assert aux.z_loss is None
    assert set(aux.diagnostics) == {"tokens", "dropped", "entropy_sum", "load_max", "load_min", "unused"}


@KERNELS
@pytest.mark.parametrize("shape", [(1, 4, 8, 16), (3, 7, 16, 32), (2, 33, 32, 64)])
def test_single_expert_equals_dense_ffn_outputs_and_gradients(shape, kernel):
    batch, seq, d, f = shape
    torch.manual_seed(1)
    dense = DenseFFN(d, f, "relu", 0.0)
    moe = SwitchFFN(SwitchFFNConfig(d, f, 1, capacity_factor=1.0, expert_kernel=kernel))
    with torch.no_grad():
        moe.fc1_weight[0].copy_(dense.fc1.weight)
        moe.fc1_bias[0].copy_(dense.fc1.bias)
        moe.fc2_weight[0].copy_(dense.fc2.weight)
        moe.fc2_bias[0].copy_(dense.fc2.bias)
    x1 = torch.randn(batch, seq, d, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    y_dense, _ = dense(x1)
    y_moe, aux = moe(x2)
    assert torch.allclose(y_dense, y_moe, atol=1e-6)
    assert aux.diagnostics["dropped"].item() == 0
    grad_out = torch.randn_like(y_dense)
    y_dense.backward(grad_out)
    y_moe.backward(grad_out)
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5)
    assert torch.allclose(dense.fc1.weight.grad, moe.fc1_weight.grad[0], atol=1e-5)
    assert torch.allclose(dense.fc1.bias.grad, moe.fc1_bias.grad[0], atol=1e-5)
    assert torch.allclose(dense.fc2.weight.grad, moe.fc2_weight.grad[0], atol=1e-5)
    assert torch.allclose(dense.fc2.bias.grad, moe.fc2_bias.grad[0], atol=1e-5)


@KERNELS
def test_gradients_reach_router_and_every_used_expert(kernel):
    torch.manual_seed(2)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, capacity_factor=2.0, expert_kernel=kernel))
    y, aux = layer(torch.randn(64, 8))
    (y.pow(2).sum() + aux.balance_loss).backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    used = layer.fc1_weight.grad.abs().sum(dim=(1, 2)) > 0
    assert used.sum() >= 2
    assert torch.equal(used, layer.fc2_weight.grad.abs().sum(dim=(1, 2)) > 0)


def test_padding_is_excluded():
    torch.manual_seed(3)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, capacity_factor=1.0))
    x = torch.randn(2, 6, 8)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[0, 4:] = True
    pad[1, 5:] = True
    y, aux = layer(x, pad)
    assert torch.equal(y[pad], torch.zeros(int(pad.sum()), 8))
    # same tokens without the padding give the same outputs and the same balance loss (the
    # capacity counts padding: int(ceil(12 / 4)) = 3 here, int(ceil(9 / 4)) = 3 unpadded)
    y_valid, aux_valid = layer(x[~pad])
    assert torch.allclose(y[~pad], y_valid, atol=1e-6)
    assert aux.balance_loss.item() == pytest.approx(aux_valid.balance_loss.item(), rel=1e-6)
    assert aux.diagnostics["tokens"].item() == 9


def test_train_and_eval_capacity():
    torch.manual_seed(4)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, capacity_factor=0.5, eval_capacity_factor=None))
    x = torch.randn(64, 8)
    _, aux_train = layer.train()(x)
    assert aux_train.diagnostics["dropped"].item() >= 32  # capacity 8 per expert -> at most 32 kept
    _, aux_eval = layer.eval()(x)
    assert aux_eval.diagnostics["dropped"].item() == 0  # default: no capacity limit at evaluation
    layer.cfg = dataclasses.replace(layer.cfg, eval_capacity_factor=0.5)  # validated again
    _, aux_eval_capped = layer.eval()(x)
    assert aux_eval_capped.diagnostics["dropped"].item() == aux_train.diagnostics["dropped"].item()


def test_batch_prioritized_routing_in_training_only():
    """--moe-batch-prioritized-routing: training keeps the most confident tokens of a full
    expert (so the kept tokens' mean gate rises); evaluation with a capacity stays first come,
    first served, so a token's output never depends on later tokens."""
    torch.manual_seed(5)
    cfg = SwitchFFNConfig(8, 16, 4, capacity_factor=0.5, eval_capacity_factor=0.5)
    plain, prioritized = SwitchFFN(cfg), SwitchFFN(dataclasses.replace(cfg, batch_prioritized_routing=True))
    prioritized.load_state_dict(plain.state_dict())
    x = torch.randn(64, 8)
    logits = plain.router_logits(x)
    for layer, expect in ((plain, False), (prioritized, True)):
        y, _ = layer.train()(x)
        routing = route_top1(logits, 0.5, batch_prioritized=expect)
        gate = routing.gate * routing.keep
        reference = torch.stack([gate[t] * manual_expert(layer, int(routing.expert[t]), x[t]) for t in range(64)])
        torch.testing.assert_close(y, reference)
    kept = [route_top1(logits, 0.5, batch_prioritized=b) for b in (False, True)]
    assert kept[1].gate[kept[1].keep].mean() > kept[0].gate[kept[0].keep].mean()
    torch.testing.assert_close(prioritized.eval()(x)[0], plain.eval()(x)[0])


def test_inactive_slots_take_no_tokens():
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 2, max_experts=6))
    with torch.no_grad():
        layer.router.weight[2:] = 100.0  # would win every token if it were active
    y, aux = layer(torch.rand(32, 8))
    assert layer.router_logits(torch.rand(3, 8)).shape == (3, 2)
    assert aux.diagnostics["unused"].item() <= 2


def test_router_is_float32_under_half_precision():
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4)).to(torch.bfloat16)
    logits = layer.router_logits(torch.randn(5, 8, dtype=torch.bfloat16))
    assert logits.dtype == torch.float32
    y, aux = layer(torch.randn(5, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16
    assert aux.balance_loss.dtype == torch.float32


def test_z_loss_optional():
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, z_loss=True))
    _, aux = layer(torch.randn(10, 8))
    assert aux.z_loss is not None and aux.z_loss.item() > 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_experts=0), "--moe-experts must be an integer >= 1 (got 0)"),
        (dict(num_experts=2.5), "--moe-experts must be an integer >= 1 (got 2.5)"),
        (dict(num_experts=2, capacity_factor=0.0), "--capacity-factor must be > 0, e.g. 1.0 (got 0.0)"),
        (dict(num_experts=2, eval_capacity_factor=-1.0), "--eval-capacity-factor must be > 0"),
        (dict(num_experts=4, max_experts=2), "--moe-max-experts must be >= --moe-experts (4)"),
        (dict(num_experts=2, activation_fn="tanh"), "--activation-fn must be one of relu, gelu, silu"),
        (dict(num_experts=2, activation_dropout=1.0), "--activation-dropout must be in [0, 1)"),
        (dict(num_experts=2, jitter_eps=-0.1), "--moe-jitter-eps must be in [0, 1)"),
        (dict(num_experts=2, router_init_scale=0.0), "--moe-router-init-scale must be > 0"),
        (dict(num_experts=2, expert_kernel="fast"), "--moe-expert-kernel must be one of auto, segments, batched, compiled"),
        (dict(num_experts=2, activation_fn="gelu", expert_kernel="segments"), "--moe-expert-kernel segments fuses ReLU"),
    ],
)
def test_bad_config_values_are_one_line_usage_errors_naming_the_flag(kwargs, message):
    with pytest.raises(UsageError) as err:
        SwitchFFNConfig(8, 16, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_router_init_scale_scales_only_the_router_and_default_is_unchanged():
    """Scale 1.0 must leave the default init (and the random stream after it) bit for bit, so
    checkpoints and seeds of runs made before the flag existed reproduce; 0.1 scales the router
    only: the experts draw the same numbers as without the flag."""
    def build(**kwargs):
        torch.manual_seed(3)
        layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, **kwargs))
        return layer, torch.rand(1)

    default, after_default = build()
    scaled, after_scaled = build(router_init_scale=0.1)
    bound = 1 / 8 ** 0.5  # nn.Linear's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert default.router.weight.abs().max() <= bound and default.router.weight.abs().max() > bound / 2
    assert torch.allclose(scaled.router.weight, 0.1 * default.router.weight, rtol=0, atol=1e-8)
    for name in ("fc1_weight", "fc1_bias", "fc2_weight", "fc2_bias"):
        assert torch.equal(getattr(scaled, name), getattr(default, name)), name
    assert torch.equal(after_default, after_scaled)


def test_config_is_frozen_and_replace_validates():
    cfg = SwitchFFNConfig(8, 16, 4)
    assert cfg.slots == 4 and SwitchFFNConfig(8, 16, 4, max_experts=6).slots == 6
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.num_experts = 2  # type: ignore[misc]
    with pytest.raises(UsageError, match="--capacity-factor"):
        dataclasses.replace(cfg, capacity_factor=-1.0)
    with pytest.raises(TypeError):
        SwitchFFN(8, 16, 4)  # type: ignore[call-arg]  # the old loose arguments
    with pytest.raises(TypeError, match="SwitchFFNConfig"):
        SwitchFFN(dict(embed_dim=8, ffn_dim=16, num_experts=4))  # type: ignore[arg-type]


def test_no_tokens_x_experts_x_capacity_tensor():
    """Every tensor saved for backward is at most tokens x max(d, f) (no T x E x C dispatch mask)."""
    tokens, d, f, experts = 256, 8, 16, 16
    layer = SwitchFFN(SwitchFFNConfig(d, f, experts, capacity_factor=1.0))
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y, aux = layer(torch.randn(tokens, d, requires_grad=True))
    capacity = tokens // experts
    assert max(sizes) < tokens * experts * capacity
    assert max(sizes) <= max(tokens * max(d, experts), experts * f * d)


def test_segment_fallback_equals_batched_path():
    """Unbounded evaluation with one overloaded expert (E*C > 2T) runs expert by expert."""
    torch.manual_seed(5)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 8)).eval()
    x = torch.randn(40, 8)
    logits = torch.zeros(40, 8)
    logits[:, 3] = 5.0  # every token wants expert 3 -> C = 40, E*C = 320 > 2*40
    logits[:4, 1] = 9.0
    routing = route_top1(logits, None)
    by_segment = layer._experts_by_segment(x, routing, layer._kept_counts(routing))
    row = buffer_rows(routing.expert, routing.rank, routing.keep, 40)
    ones = torch.ones(40)
    batched = padded_experts(x, ones, row, layer._expert_parameters(), 8, 40)
    assert torch.allclose(by_segment, batched, atol=1e-6)
    y = layer.dispatch(x, routing)
    for t in range(40):
        e = int(routing.expert[t])
        assert torch.allclose(y[t], routing.gate[t] * manual_expert(layer, e, x[t : t + 1])[0], atol=1e-5)
