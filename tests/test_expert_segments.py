"""The CPU expert kernel (issue #2 speed): exact against autograd, and its memory pool is safe."""

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from fairseq_alma.errors import UsageError
from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig
from fairseq_alma.modules.expert_segments import GradientPool, relu_expert_segments


def _weights(experts: int, d: int, f: int, dtype=torch.float64):
    torch.manual_seed(0)
    shapes = [(experts, f, d), (experts, f), (experts, d, f), (experts, d)]
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]


def _reference(x, w1, b1, w2, b2, counts, dropout_p=0.0):
    """Plain autograd, one expert at a time, drawing dropout masks in the kernel's order."""
    outs, start = [], 0
    for e, count in enumerate(counts):
        if count == 0:
            continue
        h = F.relu(F.linear(x[start : start + count], w1[e], b1[e]))
        if dropout_p > 0:
            h = h * torch.empty_like(h).bernoulli_(1.0 - dropout_p) / (1.0 - dropout_p)
        outs.append(F.linear(h, w2[e], b2[e]))
        start += count
    return torch.cat(outs)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
@pytest.mark.parametrize("counts", [[3, 0, 5, 2], [0, 7, 1], [4]])
def test_outputs_and_every_gradient_equal_autograd(counts, dropout_p):
    """Groups of any size, empty experts, and slots past the groups given (zero gradients)."""
    d, f, experts = 6, 10, 4
    weights = _weights(experts, d, f)
    ref_weights = [w.detach().clone().requires_grad_(True) for w in weights]
    x = torch.randn(sum(counts), d, dtype=torch.float64, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    grad = torch.randn(sum(counts), d, dtype=torch.float64)

    torch.manual_seed(7)
    y = relu_expert_segments(x, *weights, counts, dropout_p)
    torch.manual_seed(7)
    y_ref = _reference(x_ref, *ref_weights, counts, dropout_p)
    assert torch.allclose(y, y_ref, atol=1e-12)
    y.backward(grad)
    y_ref.backward(grad)
    assert torch.allclose(x.grad, x_ref.grad, atol=1e-12)
    for w, w_ref in zip(weights, ref_weights):
        expected = torch.zeros_like(w) if w_ref.grad is None else w_ref.grad
        assert torch.allclose(w.grad, expected, atol=1e-12)
    idle = [e for e in range(experts) if e >= len(counts) or counts[e] == 0]
    for w in weights:
        assert torch.equal(w.grad[idle], torch.zeros_like(w.grad[idle]))


def test_gradcheck():
    weights = _weights(3, 4, 5)
    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    # inputs away from the ReLU kink so finite differences are valid
    assert torch.autograd.gradcheck(lambda *a: relu_expert_segments(*a, [2, 1, 3]), (x, *weights))


def _switch_step(layer: SwitchFFN, x: torch.Tensor) -> None:
    y, aux = layer(x)
    (y.pow(2).mean() + 0.01 * aux.balance_loss).backward()


def test_pool_reuses_released_gradient_memory():
    """After ``grad = None`` (what fairseq's zero_grad does) the next backward reuses the memory."""
    torch.manual_seed(1)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, capacity_factor=2.0))
    x = torch.randn(64, 8)
    _switch_step(layer, x)
    first = layer.fc1_weight.grad.data_ptr()
    assert first == layer._grad_pool._blocks["w1"].ctypes.data  # adopted as .grad without a copy
    layer.zero_grad(set_to_none=True)
    _switch_step(layer, x)
    assert layer.fc1_weight.grad.data_ptr() == first


def test_pool_never_overwrites_a_gradient_still_held():
    """A caller keeping .grad across steps keeps its values; accumulation (--update-freq) adds."""
    torch.manual_seed(2)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, capacity_factor=2.0))
    x1, x2 = torch.randn(64, 8), torch.randn(64, 8)
    _switch_step(layer, x1)
    kept = layer.fc1_weight.grad
    snapshot = kept.clone()
    layer.zero_grad(set_to_none=True)
    _switch_step(layer, x2)
    assert torch.equal(kept, snapshot)
    alone = layer.fc1_weight.grad.clone()

    layer.zero_grad(set_to_none=True)
    _switch_step(layer, x1)
    _switch_step(layer, x2)  # accumulate into the held gradient
    assert torch.allclose(layer.fc1_weight.grad, snapshot + alone, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_pool_reuses_a_block_only_when_no_tensor_or_view_holds_it(dtype):
    pool, ref = GradientPool(), torch.empty(0, dtype=dtype)
    first = pool.empty("w", (4, 8), ref)
    assert first.dtype == dtype and first.is_contiguous() and not first._is_view()
    assert first.data_ptr() % GradientPool.ALIGNMENT == 0
    view, ptr = first[1:].t(), first.data_ptr()
    del first
    second = pool.empty("w", (4, 8), ref)  # a view of the first hand-out is still alive
    assert second.data_ptr() != ptr
    del view  # the first block is now unreferenced: freed, never handed out again
    ptr = second.data_ptr()
    storage = second.untyped_storage()  # a bare storage also counts as a holder
    del second
    third = pool.empty("w", (4, 8), ref)
    assert third.data_ptr() != ptr
    del storage
    ptr = third.data_ptr()
    del third  # released (like ``param.grad = None``): a smaller request reuses it
    assert pool.empty("w", (2, 8), ref).data_ptr() == ptr
    assert pool.empty("w", (8, 8), ref).data_ptr() != ptr  # a larger one gets a new block


def test_pooled_hidden_survives_two_forwards_before_backward():
    """Two graphs alive at once (e.g. an ensemble step) must not share the saved activations."""
    torch.manual_seed(3)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 2, capacity_factor=4.0))
    x1, x2 = torch.randn(32, 8), torch.randn(32, 8)
    y1, _ = layer(x1)
    y2, _ = layer(x2)
    (y1.pow(2).sum() + y2.pow(2).sum()).backward()
    both = layer.fc1_weight.grad.clone()
    layer.zero_grad(set_to_none=True)
    layer(x1)[0].pow(2).sum().backward()
    layer(x2)[0].pow(2).sum().backward()
    assert torch.allclose(both, layer.fc1_weight.grad, atol=1e-5)


def test_segments_and_batched_kernels_agree():
    torch.manual_seed(4)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, capacity_factor=1.0, expert_kernel="segments"))
    twin = copy.deepcopy(layer)
    twin.cfg = dataclasses.replace(layer.cfg, expert_kernel="batched")
    x = torch.randn(3, 20, 8)
    _switch_step(layer, x)
    _switch_step(twin, x)
    for name, param in layer.named_parameters():
        assert torch.allclose(param.grad, dict(twin.named_parameters())[name].grad, atol=1e-6), name


def test_copied_module_gets_an_empty_pool():
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 2))
    _switch_step(layer, torch.randn(16, 8))
    assert layer._grad_pool._blocks
    assert not copy.deepcopy(layer)._grad_pool._blocks
    assert isinstance(copy.deepcopy(layer)._grad_pool, GradientPool)


def test_forcing_the_relu_kernel_on_another_activation_is_refused():
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 2, activation_fn="gelu"))
    layer(torch.randn(4, 8))  # auto: the batched kernel
    with pytest.raises(UsageError, match="fuses ReLU"):
        layer.cfg = dataclasses.replace(layer.cfg, expert_kernel="segments")
