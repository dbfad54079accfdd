"""Switch FFN: a top-1 mixture of FFN experts (Fedus et al. 2021; ALMA paper §5, App. B.2).

Why this layout:
- Expert weights are stacked tensors ``[E_max, ...]`` instead of a ModuleList.  Growth (ALMA
  gMoE for LMs, Table 2: 4 -> 6 -> 8 -> 12 experts) then only switches on pre-allocated slots,
  so fairseq's optimizer and DDP keep the same parameter list (see DESIGN.md).
- Dispatch is by index, never by a tokens x experts x capacity one-hot tensor (the fairseq
  ``moe`` branch's dense dispatch is 4x slower than a dense FFN on CPU): on CPU kept tokens are
  sorted by expert and each expert runs one matmul on its segment (expert_segments.py); on GPU
  all experts run as one batched matmul over an ``[E, C, d]`` buffer (expert_padded.py).
- On a GPU the layer costs what it launches: routing and the loss sums are one autograd node
  (router_kernel.py), the experts another, about 60 launches per forward+backward where plain
  autograd took about 120 (``benchmarks/switch_ffn.py --ops``).  The ``compiled`` kernel
  (switch_compiled.py) hands both to ``torch.compile``, which fuses them into a few kernels.
- The batched path never reads a tensor back to the host in training, so CUDA kernels queue
  without stalls: the capacity comes from the token count in the shape (switch_routing.py) and
  padding is masked with tensors.  Only unlimited-capacity evaluation reads the experts' loads
  once; the CPU segment kernel reads its group sizes, which costs nothing on CPU.
- Router logits and softmax are float32 even under --fp16/--amp (Switch §2.4: selective
  precision), and the losses' sums are *returned* (``SwitchAux``), never stored on the module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UsageError
from .expert_padded import buffer_rows, padded_experts
from .expert_segments import GradientPool, relu_expert_segments
from .router_kernel import RoutedTokens, route_tokens, row_places
from .switch_compiled import compiled_route_and_run
from .switch_ffn_config import SwitchFFNConfig
from .switch_routing import Top1Routing, expert_capacity, moe_losses, summed_diagnostics

Routing = Union[RoutedTokens, Top1Routing]  # the fused router's, or the reference's (tests)


@dataclass
class SwitchAux:
    """What one SwitchFFN call reports besides its output: the fused router's sums.

    The balance loss, the z-loss and the logged diagnostics are formed from these sums once per
    step for every block together (``switch_routing.moe_losses``/``summed_diagnostics``, used by
    the ``switch_cross_entropy`` criterion), which costs no launches per block; the properties
    give one block's.  ``prob_sums`` (E,) and ``lse_square_sum`` keep their graph;
    ``lse_square_sum`` is None unless the z-loss is enabled.  ``counts`` (E + 1,): tokens per
    expert, padding last; ``probs`` (T, E): router probabilities (0 at padding), detached;
    ``expert_ids`` (T,) is set while ``record_expert_ids`` is on (growth).
    """

    prob_sums: Tensor
    lse_square_sum: Optional[Tensor]
    counts: Tensor
    probs: Tensor
    capacity: Optional[int]
    expert_ids: Optional[Tensor] = None

    @property
    def balance_loss(self) -> Tensor:
        """The Switch balance loss ``E * sum_i f_i P_i`` of this block (``balance_loss``)."""
        return moe_losses(self.counts.unsqueeze(0), self.prob_sums.unsqueeze(0), self.prob_sums.new_zeros(1))[0][0]

    @property
    def z_loss(self) -> Optional[Tensor]:
        """The router z-loss of this block (``router_z_loss``), or None when not enabled."""
        if self.lse_square_sum is None:
            return None
        return moe_losses(self.counts.unsqueeze(0), self.prob_sums.unsqueeze(0), self.lse_square_sum.reshape(1))[1][0]

    @property
    def diagnostics(self) -> dict[str, Tensor]:
        """tokens, dropped, entropy_sum, load_max, load_min, unused (``routing_diagnostics``)."""
        return summed_diagnostics(self.counts.unsqueeze(0), torch.special.entr(self.probs).sum().reshape(1),
                                  self.capacity)


_PLACES: dict[tuple[int, int, torch.device], Tensor] = {}


def _batch_major_places(length: int, batch: int, device: torch.device) -> Tensor:
    """(T * B,) long: the batch-major place (b * T + t) of each row of a (T, B) token grid; made
    once per shape and device (a training run has one or two shapes)."""
    key = (length, batch, device)
    places = _PLACES.get(key)
    if places is None:
        places = torch.arange(length * batch, device=device).view(batch, length).t().reshape(-1)
        _PLACES[key] = places
    return places


def _activation(name: str, inplace: bool = False):
    """Activation by name; ``inplace`` overwrites the matmul output (its backward never needs it),
    saving one (tokens, ffn) allocation per expert call."""
    if name == "relu":
        return lambda x: F.relu(x, inplace=inplace)
    if name == "gelu":
        return F.gelu
    if name == "silu":
        return lambda x: F.silu(x, inplace=inplace)
    raise ValueError(f"unknown activation {name!r}: use relu, gelu or silu")


class SwitchFFN(nn.Module):
    """Top-1 routed FFN experts with capacity, load balancing and diagnostics.

    ``cfg`` (switch_ffn_config.py) fixes sizes and routing; it is validated on construction.
    ``cfg.num_experts`` is the count at construction, ``num_experts`` the live one (growth).
    Sizes stay plain attributes (``embed_dim``, ``ffn_dim``, ``max_experts``) because growth,
    FLOP counting and scoring read them; routing knobs are read from ``self.cfg`` on every call,
    so ``layer.cfg = dataclasses.replace(layer.cfg, eval_capacity_factor=2.0)`` takes effect.
    """

    def __init__(self, cfg: SwitchFFNConfig) -> None:
        super().__init__()
        if not isinstance(cfg, SwitchFFNConfig):
            raise TypeError(f"SwitchFFN takes one SwitchFFNConfig (got {type(cfg).__name__})")
        self.cfg = cfg
        self.embed_dim = cfg.embed_dim
        self.ffn_dim = cfg.ffn_dim
        self.max_experts = max_experts = cfg.slots
        self.activation = _activation(cfg.activation_fn, inplace=True)
        self._grad_pool = GradientPool()  # CPU: expert-weight gradient memory reused (see there)

        embed_dim, ffn_dim = cfg.embed_dim, cfg.ffn_dim
        self.router = nn.Linear(embed_dim, max_experts, bias=False)
        self.fc1_weight = nn.Parameter(torch.empty(max_experts, ffn_dim, embed_dim))  # (E, f, d)
        self.fc1_bias = nn.Parameter(torch.empty(max_experts, ffn_dim))  # (E, f)
        self.fc2_weight = nn.Parameter(torch.empty(max_experts, embed_dim, ffn_dim))  # (E, d, f)
        self.fc2_bias = nn.Parameter(torch.empty(max_experts, embed_dim))  # (E, d)
        # Active expert count: a buffer so checkpoints carry it, mirrored as a Python int so the
        # forward never reads a (possibly CUDA) tensor back to the host.
        self.register_buffer("num_active", torch.tensor(cfg.num_experts, dtype=torch.long, device="cpu"))
        self._num_active = cfg.num_experts
        # Growth (lm/growth.py) turns this on briefly to read which expert each token chose.
        self.record_expert_ids = False
        self.reset_parameters()

    @property
    def num_experts(self) -> int:
        return self._num_active

    def set_num_experts(self, count: int) -> None:
        """Switch on the first ``count`` expert slots (growth); never more than allocated."""
        if not 1 <= count <= self.max_experts:
            raise ValueError(f"active experts must be in [1, {self.max_experts}] (got {count})")
        self._num_active = count
        self.num_active.fill_(count)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # noqa: ANN001
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        key = prefix + "num_active"
        if key in state_dict:
            count = int(state_dict[key])
            if count > self.max_experts:
                raise UsageError(
                    f"checkpoint has {count} active experts in {prefix or 'SwitchFFN'} but only "
                    f"{self.max_experts} slots are allocated: raise --moe-max-experts"
                )
            self._num_active = count

    def reset_parameters(self) -> None:
        """nn.Linear's default init for every expert and the router (what fairseq's FFN uses).

        The router's weights are then scaled by ``cfg.router_init_scale`` (skipped at 1.0, so
        the default init and its random stream are unchanged)."""
        nn.init.kaiming_uniform_(self.router.weight, a=math.sqrt(5))
        if self.cfg.router_init_scale != 1.0:
            with torch.no_grad():
                self.router.weight.mul_(self.cfg.router_init_scale)
        for weight, bias in ((self.fc1_weight, self.fc1_bias), (self.fc2_weight, self.fc2_bias)):
            bound = 1.0 / math.sqrt(weight.shape[-1])
            for e in range(self.max_experts):
                nn.init.kaiming_uniform_(weight.data[e], a=math.sqrt(5))
            nn.init.uniform_(bias, -bound, bound)

    def expert_parameter_count(self) -> int:
        """Parameters of one expert (both linear layers with biases)."""
        return 2 * self.embed_dim * self.ffn_dim + self.ffn_dim + self.embed_dim

    def router_logits(self, tokens: Tensor) -> Tensor:
        """(T, d) -> (T, E_active) float32 logits, with jitter noise in training.

        Selective precision (Switch §2.4): the router's inputs, weights, matmul and softmax are
        float32 under ``--fp16`` (model.half()), ``--amp`` and any ``torch.autocast``; autocast
        would otherwise run the matmul in fp16/bf16 despite the float32 operands."""
        with torch.autocast(device_type=tokens.device.type, enabled=False):
            x = tokens.float()
            eps = self.cfg.jitter_eps
            if self.training and eps > 0:
                x = x * torch.empty_like(x).uniform_(1.0 - eps, 1.0 + eps)
            weight = self.router.weight[: self.num_experts].float()
            return F.linear(x, weight)

    def forward(self, x: Tensor, padding_mask: Optional[Tensor] = None,
                seq_first: bool = False) -> tuple[Tensor, SwitchAux]:
        """x: (..., d); padding_mask: same leading shape, True at padding.  Returns (y, aux).

        ``seq_first``: x is (T, B, d) as fairseq's decoder holds it and padding_mask (B, T);
        tokens are routed in batch-major order ("first come" = the order of (B, T)) without
        being moved: only the routing order is permuted, the tokens and outputs stay where
        they are (no transposed copy in and out of the layer)."""
        shape = x.shape
        tokens = x.reshape(-1, self.embed_dim)  # (T, d) in x's own order
        positions = padding = None
        if seq_first:
            length, batch = shape[0], shape[1]
            positions = _batch_major_places(length, batch, x.device)
            if padding_mask is not None:
                padding = padding_mask.t().reshape(-1)  # (T * B,) in x's order
        elif padding_mask is not None:
            padding = padding_mask.reshape(-1)
        cfg = self.cfg
        capacity_factor = cfg.capacity_factor if self.training else cfg.eval_capacity_factor
        capacity = expert_capacity(tokens.shape[0], self.num_experts, capacity_factor)
        if self.training and capacity and not self.record_expert_ids and self.kernel_for(tokens) == "compiled":
            return self._compiled_forward(tokens, padding, positions, capacity, shape)
        routed = route_tokens(
            tokens, self.router.weight, self.num_experts, capacity,
            padding=padding,
            jitter_eps=cfg.jitter_eps if self.training else 0.0,
            prioritized=self.training and cfg.batch_prioritized_routing,
            positions=positions,
            with_z=cfg.z_loss,
        )
        y = self.dispatch(tokens, routed)
        expert_ids = None
        if self.record_expert_ids:  # in (B, T) order, padding: E
            expert_ids = routed.expert.detach()
            if seq_first:
                expert_ids = expert_ids.view(shape[0], shape[1]).t().reshape(-1)
        aux = SwitchAux(
            prob_sums=routed.prob_sums,
            lse_square_sum=routed.lse_square_sum,
            counts=routed.counts,
            probs=routed.probs,
            capacity=routed.capacity,
            expert_ids=expert_ids,
        )
        return y.reshape(shape), aux

    def _compiled_forward(self, tokens: Tensor, padding: Optional[Tensor], positions: Optional[Tensor],
                          capacity: int, shape: torch.Size) -> tuple[Tensor, SwitchAux]:
        """``forward`` in training with the ``compiled`` kernel: routing and the batched experts in
        one ``torch.compile`` graph (switch_compiled.py), the same values as the batched kernel."""
        cfg = self.cfg
        # the routing order's cached arange, made here: made inside the graph, the cache's new key
        # would fail the graph's guard on the next call and compile it a second time
        rows = row_places(tokens.shape[0], tokens.device)
        positions = rows if positions is None else positions
        y, prob_sums, lse_square_sum, counts, probs = compiled_route_and_run(
            tokens, self.router.weight, *self._expert_parameters(), padding, positions, self.num_experts,
            capacity, cfg.jitter_eps, cfg.batch_prioritized_routing, cfg.z_loss, cfg.activation_fn,
            cfg.activation_dropout)
        aux = SwitchAux(prob_sums=prob_sums, lse_square_sum=lse_square_sum, counts=counts, probs=probs,
                        capacity=capacity)
        return y.reshape(shape), aux

    def dispatch(self, tokens: Tensor, routing: Routing) -> Tensor:
        """Run each kept token through its expert; dropped and padding tokens get 0.

        Two kernels, chosen by ``cfg.expert_kernel`` ("auto" picks by device):

        - ``segments`` (CPU with ReLU): kept tokens sorted by expert, one small matmul per
          expert in a fused autograd function (expert_segments.py).  On 2 CPU threads this is
          as fast as the dense FFN at E <= 16 (benchmarks/switch_ffn.py).  It reads the group
          sizes back to the host once per call (``.tolist()``): free on CPU, which is the only
          device "auto" picks it for; the no-synchronisation guarantee is the batched path's.
        - ``batched`` (GPU, or other activations): every expert runs as one ``baddbmm`` over an
          ``[E, C, d]`` buffer in which kept token t sits at row ``1 + expert * C + slot``, in
          one autograd function whose gather and scatter are each other's backward
          (expert_padded.py).  With a capacity factor (always in training) C is known from the
          shape and nothing is read back to the host, forward or backward, so CUDA kernels
          queue without stalls; the buffer is E*C ~ capacity_factor x T rows.
        - Evaluation without a capacity limit (the default) reads the experts' loads back once:
          C is the busiest expert's load, and if that buffer would exceed 2x the tokens,
          experts run one by one over the same loads.  A sync-free bound would be C = T, i.e.
          E times the dense FFN's FLOPs and activation memory (16x at E = 16) for every
          evaluation batch; one read per layer of a forward-only pass costs far less.
        """
        keep = routing.keep
        if self._segment_kernel(tokens):
            gate = (routing.gate * keep).to(tokens.dtype)  # (T,): 0 if dropped/padding
            return self._dispatch_segments(tokens, routing, gate)
        num_experts = self.num_experts
        capacity = routing.capacity
        if capacity is None:  # evaluation without limit: the busiest expert sets the buffer depth
            counts = self._kept_counts(routing)  # the one host read (see the docstring)
            capacity = max(max(counts), 1)
            if num_experts * capacity > 2 * tokens.shape[0]:
                gate = (routing.gate * keep).to(tokens.dtype).unsqueeze(-1)
                return self._experts_by_segment(tokens, routing, counts) * gate
        if capacity == 0:  # tiny batches with a small capacity factor: every token dropped
            return tokens * 0.0
        row = buffer_rows(routing.expert, routing.rank, keep, capacity)  # (T,), 0 = dropped
        dropout = self.cfg.activation_dropout if self.training else 0.0
        return padded_experts(tokens, routing.gate, row, self._expert_parameters(), num_experts, capacity,
                              self.cfg.activation_fn, dropout)

    def kernel_for(self, tokens: Tensor) -> str:
        """The expert kernel ``dispatch`` runs for ``tokens``: ``cfg.expert_kernel``, or for
        "auto" ``segments`` on CPU with ReLU and ``batched`` everywhere else (the config
        already refused "segments" with another activation).  ``compiled`` runs the batched
        experts, and the router, in one compiled graph in training (``forward``); evaluation
        runs the batched kernel eagerly (its batch shapes vary, and a scoring machine need not
        have a compiler)."""
        if self.cfg.expert_kernel == "auto":
            return "segments" if tokens.device.type == "cpu" and self.cfg.activation_fn == "relu" else "batched"
        return self.cfg.expert_kernel

    def _segment_kernel(self, tokens: Tensor) -> bool:
        return self.kernel_for(tokens) == "segments"

    def _kept_expert(self, routing: Routing) -> Tensor:
        """(T,) expert of each kept token; dropped and padding tokens get the spare id E."""
        return torch.where(routing.keep, routing.expert, self.num_experts)

    def _kept_counts(self, routing: Routing) -> list[int]:
        """Kept tokens per expert, read back to the host: the callers size Python-side loops
        and buffers with them (the CPU segment kernel, unlimited-capacity evaluation)."""
        loads = routing.counts[: self.num_experts]
        if routing.capacity is not None:
            loads = loads.clamp(max=routing.capacity)
        return loads.tolist()

    def _group_by_expert(self, routing: Routing, counts: list[int]) -> Tensor:
        """(K,) kept token ids grouped by expert, token order inside a group.  One stable sort
        puts dropped and padding tokens (spare id E) last; ``counts`` (``_kept_counts``) say
        where the kept ones end."""
        return torch.argsort(self._kept_expert(routing), stable=True)[: sum(counts)]

    def _dispatch_segments(self, tokens: Tensor, routing: Routing, gate: Tensor) -> Tensor:
        """The ``segments`` kernel: (T, d) tokens -> gate x expert output in token order."""
        counts = self._kept_counts(routing)
        index = self._group_by_expert(routing, counts)
        out = self._run_experts(tokens.index_select(0, index), list(self._active_weights(self.num_experts)), counts)
        out = out * gate.index_select(0, index).unsqueeze(-1)  # (K, d)
        return tokens.new_zeros(tokens.shape).index_copy(0, index, out)

    def _run_experts(self, rows: Tensor, weights: list[Tensor], counts: list[int]) -> Tensor:
        """(K, d) rows grouped by expert (group sizes ``counts``) -> (K, d) expert outputs, with
        the fused ReLU kernel when ``_segment_kernel`` says so, else plain autograd.  ``weights``
        are stacked (fc1_w, fc1_b, fc2_w, fc2_b); expert parallelism passes its local shards."""
        if self._segment_kernel(rows):
            dropout_p = self.cfg.activation_dropout if self.training else 0.0
            return relu_expert_segments(rows, *weights, counts, dropout_p, self._grad_pool)
        return self._experts_autograd(rows, weights, counts)

    def _experts_autograd(self, rows: Tensor, weights: list[Tensor], counts: list[int]) -> Tensor:
        """Experts one by one with plain autograd (any activation, any device).  ``unbind`` gives
        per-expert views whose gradients are stacked once; indexing ``weight[e]`` would build one
        zero-filled full-size gradient per expert."""
        fc1_w, fc1_b, fc2_w, fc2_b = (w.unbind(0) for w in weights)
        outputs, start = [], 0
        for e, count in enumerate(counts):
            if count == 0:
                continue
            seg = rows[start : start + count]  # (c, d)
            h = self.activation(F.linear(seg, fc1_w[e], fc1_b[e]))  # (c, f)
            h = F.dropout(h, p=self.cfg.activation_dropout, training=self.training)
            outputs.append(F.linear(h, fc2_w[e], fc2_b[e]))  # (c, d)
            start += count
        return torch.cat(outputs) if outputs else rows * 0.0  # keep the graph even with no rows

    def _expert_parameters(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """fc1/fc2 weights and biases, every slot (kernels use the first ``num_experts``)."""
        return self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias

    def _active_weights(self, num_experts: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """fc1/fc2 weights and biases of the active slots.  Without growth slack the parameters
        are used whole: slicing them would make autograd build a zero-filled full-size gradient
        for each weight before accumulating it (one extra copy of every expert weight)."""
        params = (self.fc1_weight, self.fc1_bias, self.fc2_weight, self.fc2_bias)
        if num_experts == self.max_experts:
            return params
        return tuple(p[:num_experts] for p in params)  # type: ignore[return-value]

    def _experts_by_segment(self, tokens: Tensor, routing: Routing, counts: list[int]) -> Tensor:
        """Experts one by one over kept tokens sorted by expert (``counts`` per expert, from
        ``_kept_counts``); (T, d) in token order, 0 elsewhere."""
        index = self._group_by_expert(routing, counts)
        out = self._experts_autograd(tokens.index_select(0, index), list(self._active_weights(self.num_experts)), counts)
        return tokens.new_zeros(tokens.shape).index_copy(0, index, out)  # (T, d)
