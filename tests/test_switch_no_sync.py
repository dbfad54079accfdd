"""The Switch layer's batched (GPU) path reads nothing back to the host in training.

Why it matters: every host read (``.item()``, ``.tolist()``, ``int()``/``bool()`` of a tensor,
``nonzero()``, boolean-mask indexing, CUDA ``bincount``) makes the CPU wait for the GPU, so the
next kernels are not queued in time; with a Switch block every other layer that is a stall per
block.  On CPU those reads are Python calls, which these tests patch to raise; on a GPU
``torch.cuda.set_sync_debug_mode("error")`` makes any synchronising CUDA call raise (those tests
are marked ``cuda`` and skip without a GPU).  The CPU segment kernel keeps its one host read
(free on CPU), and so does unlimited-capacity evaluation: both are checked to read exactly that.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_switch_lm import build

from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig
from fairseq_alma.modules.switch_routing import (
    balance_loss,
    route_top1,
    router_z_loss,
    routing_diagnostics,
)


class HostRead(AssertionError):
    """A tensor was read back to the host on a path that promises not to."""


TENSOR_READS = ("item", "tolist", "__int__", "__index__", "__float__", "__bool__", "nonzero")
TORCH_READS = ("nonzero", "bincount", "masked_select", "unique", "argwhere")


def _refuse(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> None:
        raise HostRead(f"{name} reads a tensor back to the host")

    return refuse


def _refuse_masks(index: Any) -> Any:
    """Boolean-mask indexing sizes its result by the mask's count: a host read on CUDA."""
    for part in index if isinstance(index, tuple) else (index,):
        if isinstance(part, torch.Tensor) and part.dtype == torch.bool:
            raise HostRead("indexing with a boolean mask reads its count back to the host")
    return index


@contextlib.contextmanager
def host_reads_refused(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """Host reads raise ``HostRead`` inside; yields the patch so a test can add to it and have
    everything undone together on exit."""
    getitem, setitem = torch.Tensor.__getitem__, torch.Tensor.__setitem__
    with monkeypatch.context() as patch:
        for name in TENSOR_READS:
            patch.setattr(torch.Tensor, name, _refuse(f"Tensor.{name}"))
        for name in TORCH_READS:
            patch.setattr(torch, name, _refuse(f"torch.{name}"))
        patch.setattr(torch.Tensor, "__getitem__", lambda self, index: getitem(self, _refuse_masks(index)))
        patch.setattr(
            torch.Tensor, "__setitem__", lambda self, index, value: setitem(self, _refuse_masks(index), value)
        )
        yield patch


def padded_batch(seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(2, 12, 8) inputs and a (2, 12) padding mask with padding at the end of the second row."""
    torch.manual_seed(seed)
    x = torch.randn(2, 12, 8, device=device, dtype=dtype, requires_grad=True)
    padding = torch.zeros(2, 12, dtype=torch.bool, device=device)
    padding[1, 7:] = True
    return x, padding


@pytest.mark.parametrize("batch_prioritized", [False, True])
def test_routing_and_its_losses_read_nothing_back(monkeypatch, batch_prioritized):
    torch.manual_seed(0)
    logits = torch.randn(24, 4)
    valid = torch.ones(24, dtype=torch.bool)
    valid[17:] = False
    with host_reads_refused(monkeypatch):
        routing = route_top1(logits, 1.0, valid, batch_prioritized=batch_prioritized)
        losses = (balance_loss(routing, valid), router_z_loss(logits, valid))
        diagnostics = routing_diagnostics(routing, valid)
    assert routing.capacity == 6  # int(1.0 * ceil(24 / 4)): a Python int from the shape
    assert not routing.keep[17:].any()  # padding takes no slot
    assert diagnostics["tokens"] == 17 and all(torch.isfinite(loss) for loss in losses)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"batch_prioritized_routing": True, "jitter_eps": 0.1},
        {"activation_fn": "gelu", "activation_dropout": 0.1},
        {"capacity_factor": 0.25},  # int(0.25 * ceil(24 / 4)) = 1 slot per expert
        {"capacity_factor": 3.0},  # buffer larger than 2x the tokens: still batched
    ],
    ids=["plain", "prioritized-jitter", "gelu-dropout", "tiny-capacity", "large-capacity"],
)
def test_batched_training_forward_and_backward_read_nothing_back(monkeypatch, overrides):
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, z_loss=True, expert_kernel="batched", **overrides)).train()
    x, padding = padded_batch(1)
    with host_reads_refused(monkeypatch):
        y, aux = layer(x, padding)
        (y.pow(2).sum() + aux.balance_loss + aux.z_loss).backward()
    assert torch.equal(y[padding], torch.zeros(5, 8))
    assert torch.isfinite(x.grad).all() and torch.isfinite(layer.router.weight.grad).all()
    assert aux.diagnostics["tokens"] == 19


def test_batched_evaluation_with_a_capacity_factor_reads_nothing_back(monkeypatch):
    cfg = SwitchFFNConfig(8, 16, 4, eval_capacity_factor=2.0, expert_kernel="batched")
    layer = SwitchFFN(cfg).eval()
    x, padding = padded_batch(2)
    with host_reads_refused(monkeypatch), torch.no_grad():
        y, _ = layer(x, padding)
    assert torch.equal(y[padding], torch.zeros(5, 8))


@pytest.mark.parametrize("kernel, overloaded", [("batched", False), ("batched", True), ("segments", False)])
def test_unlimited_evaluation_and_the_segment_kernel_read_the_loads_once(monkeypatch, kernel, overloaded):
    """The two documented host reads: one ``.tolist()`` of the per-expert loads, nothing else;
    ``overloaded`` sends every token to one expert so the batched path runs expert by expert."""
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, expert_kernel=kernel)).eval()
    if overloaded:
        with torch.no_grad():
            layer.router.weight.zero_()
            layer.router.weight[2] = 1.0
    x, padding = padded_batch(3)
    x = x.detach().abs()  # positive inputs: the overloaded router picks expert 2 for all
    tolist, calls = torch.Tensor.tolist, []

    def counted_tolist(self: torch.Tensor) -> Any:
        calls.append(tuple(self.shape))
        return tolist(self)

    with host_reads_refused(monkeypatch) as patch:
        patch.setattr(torch.Tensor, "tolist", counted_tolist)
        y, aux = layer(x, padding)
    assert calls == [(4,)]  # the four experts' loads, once
    assert aux.diagnostics["dropped"] == 0 and torch.equal(y[padding], torch.zeros(5, 8))


def test_the_guard_catches_host_reads(monkeypatch):
    """The patch is live: the CPU segment kernel's ``.tolist()`` is caught in training."""
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, expert_kernel="segments"))
    x, padding = padded_batch(4)
    with host_reads_refused(monkeypatch), pytest.raises(HostRead, match="Tensor.tolist"):
        layer(x, padding)
    with host_reads_refused(monkeypatch), pytest.raises(HostRead, match="boolean mask"):
        x[padding]


def batched_lm(seed: int, **overrides: Any) -> Any:
    """The tiny Switch LM with every Switch block on the batched kernel (CPU picks segments)."""
    torch.manual_seed(seed)
    model = build("switch_transformer_lm_tiny", 50, moe_experts=4, **overrides)
    for layer in model.decoder.layers:
        if layer.is_moe:
            layer.ffn.cfg = dataclasses.replace(layer.ffn.cfg, expert_kernel="batched")
    return model


def padded_tokens(model: Any, device: str = "cpu") -> torch.Tensor:
    tokens = torch.randint(4, 50, (2, 12), device=device)
    tokens[1, 8:] = model.decoder.padding_idx
    return tokens


def test_lm_training_step_reads_nothing_back_with_batched_experts(monkeypatch):
    """The model's own forward has no ``padding_mask.any()`` branch any more.  Learned positions:
    fairseq's sinusoidal table compares its size with ``shape_as_tensor(input)``, a CPU tensor
    even on a GPU (no synchronisation there), which this CPU guard cannot tell from a host read."""
    model = batched_lm(5, decoder_learned_pos=True).train()
    tokens = padded_tokens(model)
    with host_reads_refused(monkeypatch):
        logits, extra = model(tokens)
        loss = logits.float().pow(2).mean() + sum(aux.balance_loss for aux in extra["moe_aux"])
        loss.backward()
    assert [aux.diagnostics["tokens"] for aux in extra["moe_aux"]] == [20] * len(extra["moe_aux"])


# Routing of unpadded batches recorded with the code before the capacity counted padding (the
# tokens dropped in a (3, 10, 8) batch of 4 experts, the balance and z losses): without padding
# T is the real-token count, so nothing may change.  Losses compare to 1e-6 relative, not
# bitwise, because BLAS may sum in another order on another machine.
BEFORE = {
    (0, 1.0, False): ([21, 22, 25, 26, 29], 1.0561325550079346, 2.357877492904663),
    (0, 0.5, True): ([0, 1, 4, 5, 6, 7, 13, 14, 15, 17, 19, 20, 21, 22, 23, 26], 1.0561325550079346, 2.357877492904663),
    (1, 1.0, False): ([24, 25, 26, 27, 28], 1.0282365083694458, 2.332364797592163),
    (1, 0.5, True): ([1, 2, 5, 6, 12, 13, 14, 15, 17, 18, 21, 22, 23, 26, 27, 28], 1.0282365083694458, 2.332364797592163),
    (2, 1.0, False): ([21, 23, 29], 1.0418075323104858, 2.181236743927002),
    (2, 0.5, True): ([0, 1, 4, 6, 11, 12, 15, 16, 17, 19, 20, 21, 26, 28, 29], 1.0418075323104858, 2.181236743927002),
}


@pytest.mark.parametrize("seed, capacity_factor, prioritized", sorted(BEFORE))
def test_unpadded_batches_route_as_before_and_both_kernels_agree(seed, capacity_factor, prioritized):
    dropped, balance, z = BEFORE[seed, capacity_factor, prioritized]
    results = {}
    for kernel in ("batched", "segments"):
        torch.manual_seed(seed)
        cfg = SwitchFFNConfig(8, 16, 4, capacity_factor=capacity_factor, batch_prioritized_routing=prioritized,
                              z_loss=True, expert_kernel=kernel)
        layer = SwitchFFN(cfg)
        x = torch.randn(3, 10, 8, requires_grad=True)
        y, aux = layer(x)
        (y.pow(2).sum() + aux.balance_loss + aux.z_loss).backward()
        routing = route_top1(layer.router_logits(x.detach().reshape(-1, 8)), capacity_factor,
                             batch_prioritized=prioritized)
        assert (~routing.keep).nonzero().squeeze(1).tolist() == dropped
        assert aux.balance_loss.item() == pytest.approx(balance, rel=1e-6)
        assert aux.z_loss.item() == pytest.approx(z, rel=1e-6)
        results[kernel] = (y.detach(), x.grad, layer.fc1_weight.grad, layer.router.weight.grad)
    for batched, segments in zip(results["batched"], results["segments"]):
        torch.testing.assert_close(batched, segments, rtol=1e-5, atol=1e-6)


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is visible to torch here")


@contextlib.contextmanager
def cuda_syncs_refused(warm_up: Any) -> Iterator[None]:
    """Every synchronising CUDA call raises inside (torch's sync debug mode), restored after.
    ``warm_up()`` runs first, unchecked: one-off work of a first call (cuBLAS handles, lazily
    moved buffers) is not the per-step cost this is about."""
    warm_up()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _precision(precision: str) -> tuple[torch.dtype, Any]:
    """(parameter and input dtype, context of the forward) of one precision mode."""
    if precision == "fp16":  # --fp16: model.half()
        return torch.float16, contextlib.nullcontext()
    if precision == "bf16":  # --bf16: model.bfloat16()
        return torch.bfloat16, contextlib.nullcontext()
    if precision == "autocast":  # --amp
        return torch.float32, torch.autocast("cuda", dtype=torch.float16)
    return torch.float32, contextlib.nullcontext()


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16", "autocast", "bf16"])
@pytest.mark.parametrize("kernel, prioritized", [("batched", False), ("batched", True), ("compiled", False)])
def test_cuda_switch_training_step_never_synchronises(precision, kernel, prioritized):
    """The compiled kernel's generated (Triton) kernels queue without a host read too; its
    compilation, in the unchecked warm-up, may read what it likes."""
    dtype, context = _precision(precision)
    cfg = SwitchFFNConfig(8, 16, 4, z_loss=True, batch_prioritized_routing=prioritized, jitter_eps=0.01,
                          expert_kernel=kernel)
    layer = SwitchFFN(cfg).cuda().to(dtype).train()
    x, padding = padded_batch(6, dtype, "cuda")

    def step() -> torch.Tensor:
        with context:
            y, aux = layer(x, padding)
            loss = y.float().pow(2).sum() + aux.balance_loss + aux.z_loss
        loss.backward()
        return y

    with cuda_syncs_refused(warm_up=step):
        y = step()
    assert torch.isfinite(x.grad).all() and y[padding].float().abs().sum().item() == 0


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16", "autocast", "bf16"])
def test_cuda_switch_evaluation_with_a_capacity_factor_never_synchronises(precision):
    dtype, context = _precision(precision)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 4, eval_capacity_factor=2.0)).cuda().to(dtype).eval()
    x, padding = padded_batch(7, dtype, "cuda")

    def forward() -> torch.Tensor:
        with context, torch.no_grad():
            return layer(x, padding)[0]

    with cuda_syncs_refused(warm_up=forward):
        y = forward()
    assert torch.isfinite(y).all()


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("precision", ["fp32", "fp16", "autocast", "bf16"])
def test_cuda_lm_forward_never_synchronises(precision):
    """The whole model's training forward on padded tokens (its backward is not claimed: torch
    kernels outside the Switch layer, such as the embedding's backward, are not ours)."""
    dtype, context = _precision(precision)
    model = batched_lm(8).cuda().to(dtype).train()
    tokens = padded_tokens(model, "cuda")

    def forward() -> tuple[torch.Tensor, dict]:
        with context:
            return model(tokens)

    with cuda_syncs_refused(warm_up=forward):
        logits, extra = forward()
    assert torch.isfinite(logits[0]).all() and len(extra["moe_aux"]) > 0
