"""The Switch layer's router and batched experts as one ``torch.compile`` graph.

Why: measured on an H100 (README, "Speed and memory"), the eager GPU path costs what the host
spends launching it, about 10 us per aten operation, not what the GPU computes: ~3 ms per
forward+backward whatever E, d or precision, for 277 operations where the dense FFN has 85.
Hand-written autograd nodes (router_kernel.py, expert_padded.py) took it from 458 operations;
eager PyTorch cannot go much further.  Compiled, the same code becomes a few generated kernels
(Triton on a GPU, C++ on CPU) in one forward and one backward graph, so the host launches a
handful of kernels instead of hundreds of operations.

What is compiled is exactly the eager code: ``route_tokens`` (router_kernel.py) and
``padded_experts`` (expert_padded.py), their custom autograd functions traced forward and
backward, so outputs, gradients and routing are the batched kernel's (tests/test_switch_compiled.py
compares them).  Random draws (router jitter, expert dropout) use eager's random ops
(inductor's ``fallback_random``), so a run and its resumption draw the same numbers whichever
kernel trained it.

Only training is compiled (its capacity is a Python int from the shape).  Evaluation runs the
batched kernel eagerly: without a capacity limit it reads the experts' loads back to the host,
its batch shapes vary (each would be a compilation), and a checkpoint trained with this kernel
must score on a machine without a compiler.  One graph per token count, expert count and flag
set: an LM stream trains on one or two batch shapes, growth adds a few expert counts.  Past
dynamo's recompile limit a new shape runs eagerly, with the same results.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import Callable, Optional

import torch
from torch import Tensor

from ..errors import UsageError, first_line
from .expert_padded import buffer_rows, padded_experts
from .router_kernel import route_tokens


def _route_and_run(
    tokens: Tensor,
    router_weight: Tensor,
    w1: Tensor,
    b1: Tensor,
    w2: Tensor,
    b2: Tensor,
    padding: Optional[Tensor],
    positions: Optional[Tensor],
    num_experts: int,
    capacity: int,
    jitter_eps: float,
    prioritized: bool,
    with_z: bool,
    activation: str,
    dropout_p: float,
) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor, Tensor]:
    """The eager batched path (``SwitchFFN.forward`` + ``dispatch``) for a known capacity:
    (y, prob_sums, lse_square_sum, counts, probs)."""
    routed = route_tokens(tokens, router_weight, num_experts, capacity, padding=padding, jitter_eps=jitter_eps,
                          prioritized=prioritized, positions=positions, with_z=with_z)
    row = buffer_rows(routed.expert, routed.rank, routed.keep, capacity)
    y = padded_experts(tokens, routed.gate, row, (w1, b1, w2, b2), num_experts, capacity, activation, dropout_p)
    return y, routed.prob_sums, routed.lse_square_sum, routed.counts, routed.probs


@functools.cache
def _compiled() -> Callable[..., tuple[Tensor, Tensor, Optional[Tensor], Tensor, Tensor]]:
    """``_route_and_run`` compiled once per process (module doc); every block shares it.

    The backward is compiled with the forward, not at the first ``backward()``: a failure to
    compile it is then the first forward's one-line error (``compiled_route_and_run``), not a
    traceback out of fairseq's first update.  (A torch without this setting keeps the lazy one.)"""
    try:
        import torch._functorch.config as functorch_config

        functorch_config.force_non_lazy_backward_lowering = True
    except (ImportError, AttributeError):
        pass
    return torch.compile(_route_and_run, fullgraph=True, dynamic=False, options={"fallback_random": True})


def compiled_route_and_run(*args: object) -> tuple[Tensor, Tensor, Optional[Tensor], Tensor, Tensor]:
    """``_route_and_run(*args)``, compiled.

    A failure to compile (a torch version whose dynamo cannot trace the layer, a Triton that
    cannot build a kernel) surfaces in the first forward, before the first update: it becomes one
    ``UsageError`` naming the flag and the uncompiled kernel with the same results."""
    try:
        return _compiled()(*args)
    except torch._dynamo.exc.TorchDynamoException as err:
        cause = getattr(err, "inner_exception", None) or err  # inductor's failure, not dynamo's wrapper
        reason = f"{type(cause).__name__}: {first_line(cause, 200)}"
        raise UsageError(f"--moe-expert-kernel compiled: torch {torch.__version__} could not compile the "
                         f"Switch layer ({reason}); use --moe-expert-kernel batched "
                         f"(the same results, uncompiled)") from err


def compiler_missing(device_type: str) -> Optional[str]:
    """Why ``torch.compile`` cannot build kernels for ``device_type`` on this machine, or None.

    Inductor writes Triton kernels for CUDA (Triton ships with torch's CUDA wheels) and C++ for
    CPU; both need a C compiler at run time (Triton builds its launcher with one).  Checked
    before the first update so a node without them gets one line instead of a traceback
    minutes into the run."""
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None and shutil.which("gcc") is None:
        return f"no C compiler ({compiler} or gcc) on PATH, which torch.compile needs"
    if device_type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "Triton is not installed (torch's CUDA wheels bring it)"
    return None
