"""The growing learners of §4.2: gEns, gMoE and FF (see ``learners`` for the interface).

Growth happens in ``before_stage`` for every stage after the first, before the stage's training
(the Avalanche-style ``pre_adapt`` hook), and the stage trainer builds a fresh optimizer after it.
gMoE chooses what to split in ``plan_growth``, right after training the previous stage, on that
stage's validation data (Algorithm 2: "m.grow(D^VAL)" with the D^VAL just trained on), and keeps
the choice (a buffer, so a resumed run has it) until ``before_stage`` splits: the experts are
counted in |θ_t| from the stage that trains them.  Scoring the experts on the next stage's
validation data instead would pick the split with data of a later arrival.
Growth draws from the learner's CPU generator and places what it creates on the learner's
device and dtype, so ``learner.to(device)`` may come before or after any growth.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UsageError
from .devices import placement, to_device, upcast
from .firefly import grow_width
from .firefly_depth import grow_depth
from .learners import Learner, LearnerSpec, SingleModelLearner
from .mac_count import count_parameters, inference_flops
from .models import build_backbone
from .models_moe import MoEBackbone
from .normalization import InputNormalizer

GROWTH_EVAL_BATCH = 512


class GrowingEnsemble(Learner):
    """gEns: one new member per stage (k = 1), trained alone; earlier members frozen.

    Each member keeps the input statistics of the stage it was trained in (``member_norms``):
    ``input_norm`` holds the latest ones, which the member trained next adopts."""

    def __init__(self, spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(spec, input_shape, num_classes)
        self.members = nn.ModuleList([self._new_member()])
        self.member_norms = nn.ModuleList([InputNormalizer(self.input_shape)])

    def _new_member(self) -> nn.Module:
        """A fresh member drawn on the CPU generator, placed like the members so far (the
        first one, built before any exists, stays on the CPU in float32 like every module)."""
        device, dtype = placement(self)
        member = build_backbone(
            self.spec.arch, self.input_shape, self.spec.width, self.num_classes, 1, self.generator
        )
        return member.to(device=device, dtype=dtype)

    def trainable(self) -> nn.Module:
        return self.members[-1]

    def train_logits(self, x: Tensor, per_member: bool = False) -> Tensor:
        return self.members[-1](self.member_norms[-1](x))

    def predict_log_probs(self, x: Tensor) -> Tensor:
        log_probs = torch.stack([
            F.log_softmax(upcast(member(norm(x))[0]), dim=-1)
            for member, norm in zip(self.members, self.member_norms)
        ])
        return torch.logsumexp(log_probs, dim=0) - math.log(len(self.members))

    def before_stage(
        self, stage_index: int, train_x: Tensor, train_y: Tensor, valid_x: Tensor, valid_y: Tensor
    ) -> dict[str, Any]:
        if stage_index > 1:
            for member in self.members:
                member.requires_grad_(False)
                member.eval()
            self.members.append(self._new_member())
            self.member_norms.append(copy.deepcopy(self.input_norm))
        else:
            self.member_norms[-1].load_state_dict(self.input_norm.state_dict())
        return {"flops": 0.0, "members": len(self.members)}

    def train(self, mode: bool = True) -> GrowingEnsemble:
        super().train(mode)
        for member in self.members[:-1]:  # frozen members keep their batch-norm statistics
            member.eval()
        return self

    def describe(self) -> dict[str, Any]:
        return {"members": len(self.members)}

    def _resize_like(self, state: dict[str, Tensor]) -> None:
        saved = {int(key.split(".")[1]) for key in state if key.startswith("members.")}
        while len(self.members) < len(saved):
            self.before_stage(len(self.members) + 1, *([torch.empty(0)] * 4))


class GrowingMoE(SingleModelLearner):
    """gMoE: split the losing expert of every mixture layer at every stage (Algorithm 2)."""

    def __init__(self, spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(spec, input_shape, num_classes)
        layers = spec.mixture_layers  # LearnerSpec fills in the paper's default
        assert layers, "a gmoe LearnerSpec always names its mixture layers"
        if spec.arch not in ("mlp", "vgg"):
            raise UsageError(f"--vision-arch {spec.arch!r} is unknown; use mlp or vgg")
        if spec.arch == "vgg":
            build_backbone(
                "vgg", self.input_shape, spec.width, num_classes, 1, None
            )  # validates the input
        self.model = MoEBackbone(
            spec.arch,
            self.input_shape,
            spec.width,
            num_classes,
            spec.gating,
            layers,
            self.generator,
        )
        for block in self.model.blocks:
            block.sampler = self.generator
        # losing expert per growing layer, chosen by plan_growth; empty once split
        self.register_buffer("split_plan", torch.empty(0, dtype=torch.long))

    def expert_losses(self, valid_x: Tensor, valid_y: Tensor) -> list[Tensor]:
        """Per growing layer, (experts,): summed validation loss of the examples routed through
        each expert (soft gating: weighted by the routing probability)."""
        blocks = self.model.growing_blocks()
        device = self.device
        totals = [
            torch.zeros(block.num_experts, dtype=torch.float64, device=device) for block in blocks
        ]
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for start in range(0, valid_x.shape[0], GROWTH_EVAL_BATCH):
                for block in blocks:
                    block.routing_log = []
                xb = valid_x[start : start + GROWTH_EVAL_BATCH].to(device)
                yb = valid_y[start : start + GROWTH_EVAL_BATCH].to(device)
                logits = self.model(self.input_norm(xb))[0]
                losses = F.cross_entropy(logits, yb, reduction="none").double()  # (B,)
                for total, block in zip(totals, blocks):
                    total += block.routing_log[0].double().t() @ losses
        for block in blocks:
            block.routing_log = None
        self.model.train(was_training)
        return totals

    def plan_growth(self, stage_index: int, valid_x: Tensor, valid_y: Tensor) -> dict[str, Any]:
        flops = inference_flops(self.infer_macs_per_image(), valid_x.shape[0])
        losers = [int(total.argmax()) for total in self.expert_losses(valid_x, valid_y)]
        self.split_plan = torch.tensor(losers, dtype=torch.long, device=self.split_plan.device)
        return {"flops": flops, "losers": losers}

    def before_stage(
        self, stage_index: int, train_x: Tensor, train_y: Tensor, valid_x: Tensor, valid_y: Tensor
    ) -> dict[str, Any]:
        if stage_index <= 1:
            return {"flops": 0.0, "experts": self.describe()["experts"]}
        if self.split_plan.numel() == 0:
            raise RuntimeError(
                f"gMoE stage {stage_index}: no split was planned; call plan_growth with stage "
                f"{stage_index - 1}'s validation data after training it"
            )
        losers = self.split_plan.tolist()
        for block, loser in zip(self.model.growing_blocks(), losers):
            block.split_expert(loser, self.generator)
        self.split_plan = self.split_plan.new_empty(0)
        return {"flops": 0.0, "split": losers, "experts": self.describe()["experts"]}

    def describe(self) -> dict[str, Any]:
        return {"experts": [block.num_experts for block in self.model.growing_blocks()]}


class FireflyLearner(SingleModelLearner):
    """FF: Firefly growth in depth and width, linear in parameters (§4.2, App. B.1).

    The paper: "Growth includes both a width expansion by adding new hidden units (or feature
    maps) as well as a depth expansion by adding new layers" (§4.2); "For Firefly we use a
    growth rate of 0.25, meaning that at every growth phase, we add approximately a quarter of
    the initial number of parameters" (App. B.1); "we keep all the Firefly-specific
    hyperparameters to the default values suggested in the author's public codebase. We make
    one exception to this, namely we adapt the growth ratio to result in linear (rather than
    exponential) growth" (App. B.1.2): ε = 1e-2 and 70 new-unit candidates per layer.

    Every growth phase (every stage after the first) inserts ``ff_new_layers`` residual blocks
    where they decrease the loss fastest (``firefly_depth``), then adds units across all hidden
    layers (``firefly``) until |θ| reaches ``(1 + growth_rate · (stage - 1))`` × the initial
    count: each phase adds about a quarter of the initial parameters, and rounding never
    accumulates.  Both are scored on up to ``ff_score_examples`` of the stage's training data.
    ``residual_after`` (a buffer, so in the checkpoint) lists where the blocks were inserted,
    which is what a fresh learner needs to rebuild the grown network before loading it."""

    def __init__(self, spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(spec, input_shape, num_classes)
        self.model = build_backbone(
            spec.arch, self.input_shape, spec.width, num_classes, 1, self.generator
        )
        self.model.growable_layers()  # fails early on backbones FF cannot grow
        self.initial_params = count_parameters(self.model)
        self.register_buffer("residual_after", torch.empty(0, dtype=torch.long))

    def before_stage(
        self, stage_index: int, train_x: Tensor, train_y: Tensor, valid_x: Tensor, valid_y: Tensor
    ) -> dict[str, Any]:
        if stage_index <= 1:
            return {"flops": 0.0, **self.describe()}
        count = min(self.spec.ff_score_examples, train_x.shape[0])
        pick = torch.randperm(train_x.shape[0], generator=self.generator)[:count]
        pick = to_device(pick, train_x.device)
        x = self.input_norm(train_x[pick].to(self.device))  # the backbone sees normalised inputs
        y = train_y[pick].to(self.device)
        spec = self.spec
        depth = grow_depth(self.model, x, y, spec.ff_new_layers, spec.ff_epsilon, self.generator)
        self.residual_after = torch.tensor(
            self.model.residuals.after, dtype=torch.long, device=self.residual_after.device
        )
        target = self.initial_params * (1 + spec.growth_rate * (stage_index - 1))
        width = grow_width(self.model, x, y, target - count_parameters(self.model),
                           spec.ff_epsilon, self.generator, spec.ff_new_candidates)
        return {
            "flops": depth.flops + width.flops,
            **self.describe(),
            "inserted_after": list(depth.inserted_after),
            "splits": list(width.splits),
            "new_units": list(width.new_units),
        }

    def describe(self) -> dict[str, Any]:
        return {"widths": self.model.widths, "depth": self.model.depth}

    def _resize_like(self, state: dict[str, Tensor]) -> None:
        """Rebuild the inserted blocks (placeholders of the saved widths follow from the
        tensor resizing in ``load_checkpoint_state``)."""
        device, dtype = placement(self)
        for position in state["residual_after"].tolist()[len(self.model.residuals) :]:
            block = self.model.new_residual(position, self.generator)
            self.model.residuals.attach(position, block.to(device=device, dtype=dtype))
