"""The ``compiled`` expert kernel (switch_compiled.py) is the batched kernel, compiled: on CPU
(inductor's C++ backend, the same graphs the GPU gets as Triton) it gives the batched kernel's
outputs, loss sums, routing and every gradient (to float32 rounding: the router is float32
and its fused sums add in another order), and draws the same random numbers.

Each distinct configuration costs one compilation (~20 s on 2 cores), so one test covers every
routing feature at once: padding, growth slots, z-loss, dropped tokens, jitter, dropout,
batch-prioritised routing and (T, B) rows routed batch-major."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from fairseq_alma.errors import UsageError
from fairseq_alma.modules import SwitchFFN, SwitchFFNConfig
from fairseq_alma.modules.switch_compiled import compiler_missing

pytestmark = pytest.mark.skipif(compiler_missing("cpu") is not None, reason="no C compiler for torch.compile")


def _step(layer: SwitchFFN, x: torch.Tensor, padding: torch.Tensor, seed: int) -> list[torch.Tensor]:
    torch.manual_seed(seed)  # jitter and dropout draw from here
    layer.zero_grad()
    x = x.clone().requires_grad_()
    y, aux = layer(x, padding, seq_first=True)
    (y * torch.linspace(-1, 1, y.shape[-1], dtype=y.dtype)).sum().add(aux.balance_loss + aux.z_loss).backward()
    after = torch.rand(())  # the generator's state after the step: same draws consumed
    return [y, aux.balance_loss, aux.z_loss, aux.counts, aux.probs, aux.diagnostics["dropped"], after, x.grad] + [
        p.grad for p in layer.parameters()]


def test_compiled_kernel_equals_the_batched_kernel_in_every_output_and_gradient():
    torch.manual_seed(3)
    cfg = SwitchFFNConfig(8, 16, 3, max_experts=4, capacity_factor=0.75, z_loss=True, expert_kernel="batched",
                          jitter_eps=0.1, activation_dropout=0.2, batch_prioritized_routing=True)
    eager = SwitchFFN(cfg).double().train()
    compiled = SwitchFFN(dataclasses.replace(cfg, expert_kernel="compiled")).double().train()
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(10, 3, 8, dtype=torch.float64)  # (T, B, d)
    padding = torch.zeros(3, 10, dtype=torch.bool)
    padding[2, 6:] = True
    padding[0, 9] = True
    for seed in (0, 1):  # the second call runs the graph of the first: a recompilation raises
        with torch._dynamo.config.patch(error_on_recompile=seed > 0):
            got, want = _step(compiled, x, padding, seed), _step(eager, x, padding, seed)
        assert want[5] > 0  # tokens were dropped: capacity and arrival order mattered
        assert not want[-4][3:].any() and not got[-4][3:].any()  # growth slot: no gradient
        assert torch.equal(got[3], want[3]) and torch.equal(got[5], want[5])  # same routing
        for a, b in zip(want, got):  # the router is float32 in both: its fused sums round apart
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("eval_capacity_factor", [None, 2.0])
def test_compiled_kernel_evaluates_eagerly_and_is_refused_with_expert_parallelism(monkeypatch, eval_capacity_factor):
    """Evaluation (with or without a capacity) runs the batched kernel eagerly: nothing is
    compiled when a checkpoint is scored.  Expert parallelism exchanges tokens between ranks,
    which the compiled graph does not, so it is refused in one line."""
    from fairseq_alma.modules import switch_ffn
    from fairseq_alma.modules.expert_parallel import ExpertParallelSwitchFFN

    monkeypatch.setattr(switch_ffn, "compiled_route_and_run", lambda *_: pytest.fail("compiled in evaluation"))
    torch.manual_seed(4)
    cfg = SwitchFFNConfig(8, 16, 4, expert_kernel="batched", eval_capacity_factor=eval_capacity_factor)
    eager = SwitchFFN(cfg).eval()
    compiled = SwitchFFN(dataclasses.replace(cfg, expert_kernel="compiled")).eval()
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(12, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x)[0], eager(x)[0], rtol=0, atol=0)
    with pytest.raises(UsageError, match="--moe-expert-kernel compiled runs every expert on this rank"):
        ExpertParallelSwitchFFN(dataclasses.replace(cfg, expert_kernel="compiled"), 2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_kernel_in_half_precision_keeps_the_dtypes_and_the_routing(dtype):
    """As ``--bf16`` / ``--fp16`` (model.bfloat16() / model.half()): the same routing, output and
    gradients in each tensor's own dtype, within rounding of the eager kernel (fused, the
    compiled graph rounds less often)."""
    torch.manual_seed(0)
    cfg = SwitchFFNConfig(16, 32, 4, capacity_factor=1.0, z_loss=True, expert_kernel="batched")
    eager = SwitchFFN(cfg).to(dtype)
    compiled = SwitchFFN(dataclasses.replace(cfg, expert_kernel="compiled")).to(dtype)
    compiled.load_state_dict(eager.state_dict())
    x = torch.randn(24, 2, 16, dtype=dtype)
    padding = torch.zeros(2, 24, dtype=torch.bool)
    padding[1, 20:] = True
    runs = []
    for layer in (eager, compiled):
        inputs = x.clone().requires_grad_()
        y, aux = layer(inputs, padding, seq_first=True)
        (y.float().square().sum() + aux.balance_loss + aux.z_loss).backward()
        runs.append((aux.counts, [y, inputs.grad] + [p.grad for p in layer.parameters()]))
    (want_counts, want), (got_counts, got) = runs
    assert torch.equal(got_counts, want_counts)
    for a, b in zip(want, got):
        assert b.dtype == a.dtype == dtype
        assert ((b.float() - a.float()).norm() / a.float().norm()).item() < 2e-2


def test_a_layer_torch_cannot_compile_is_one_line_naming_the_flag(monkeypatch):
    """dynamo or inductor failing on the layer (another torch, a Triton without a kernel for the
    GPU) stops the first forward with one UsageError naming the uncompiled kernel."""
    from fairseq_alma.modules import switch_compiled

    def fails(*_args):
        raise torch._dynamo.exc.TorchDynamoException("cannot trace this\nmore detail")

    monkeypatch.setattr(switch_compiled, "_compiled", lambda: fails)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 2, expert_kernel="compiled")).train()
    with pytest.raises(UsageError, match=r"could not compile the Switch layer \(TorchDynamoException: cannot "
                                         r"trace this\); use --moe-expert-kernel batched"):
        layer(torch.randn(6, 8))


def test_a_backward_inductor_cannot_build_stops_the_first_forward_in_one_line(monkeypatch):
    """The backward is compiled with the forward (``force_non_lazy_backward_lowering``): a
    failure to build it is the first forward's UsageError, not a traceback out of the first
    update's ``backward()``.  The failure is injected where inductor compiles each graph."""
    import torch._inductor.compile_fx as compile_fx

    build = compile_fx._compile_fx_inner

    def fails_on_backward(graph, inputs, **kwargs):
        if kwargs.get("is_backward"):
            raise RuntimeError("no kernel for this GPU\nmore detail")
        return build(graph, inputs, **kwargs)

    torch._dynamo.reset()
    monkeypatch.setattr(compile_fx, "_compile_fx_inner", fails_on_backward)
    layer = SwitchFFN(SwitchFFNConfig(8, 16, 2, expert_kernel="compiled")).train()
    try:
        with pytest.raises(UsageError, match=r"could not compile the Switch layer \(RuntimeError: no kernel for "
                                             r"this GPU\); use --moe-expert-kernel batched"):
            layer(torch.randn(6, 8, requires_grad=True))
    finally:
        torch._dynamo.reset()
