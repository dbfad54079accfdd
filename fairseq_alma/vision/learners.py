"""The six learners of §4 behind one interface the stage trainer and stream runner drive.

Fixed architectures (§4.1): SM (one model, fine-tuned stage after stage), Ens (N members trained
independently on the same data, probabilities averaged at test time) and UMix (N members whose
logits are averaged in training and at test time).  All three are one stacked module with N
members (N = 1 for SM), so Ens/UMix run as one batched model, not N models.
Growing architectures (§4.2): gEns (one new member per stage trained on the stage's data, older
members frozen), gMoE (tree-gated experts, the losing expert split at every stage, App. A) and FF
(Firefly width growth, linear in parameters, App. B.1).

Growth happens in ``before_stage`` for every stage after the first, before the stage's training
(the Avalanche-style ``pre_adapt`` hook), and the stage trainer builds a fresh optimizer after it.
gMoE scores its experts on the validation split of the data that just arrived, which the model
has not fit yet; the split keeps the function exactly, so which side of the stage boundary it
sits on changes no evaluation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UsageError
from .firefly import grow_width, units_for_growth
from .flops import count_forward_macs, count_parameters, inference_flops
from .models import build_backbone
from .models_moe import GATINGS, MoEBackbone

METHODS = ("sm", "ens", "umix", "gens", "gmoe", "ff")
GROWTH_EVAL_BATCH = 512


@dataclass(frozen=True)
class LearnerSpec:
    """Everything that defines a learner (typed; no argparse Namespace).

    Attributes:
        method: sm, ens, umix, gens, gmoe or ff.
        arch: mlp (two hidden layers of ``width``) or vgg (reduced VGG19, ``width`` channels).
        width: h or c (paper: 4 … 64).
        members: N for Ens and UMix (paper: 5).
        gating: gMoE gating, soft or hard (paper: soft on MNIST and CIFAR).
        mixture_layers: gMoE layers that grow; default the first two (paper, MNIST) for the
            MLP and every conv layer for the VGG.
        growth_rate: FF parameters added per step as a fraction of the initial count (0.25).
        ff_epsilon: FF step size of the new units' weights (0: function kept exactly).
        ff_score_examples: training examples used for the FF first-order scores.
        ens_member_data_order: give every Ens member its own shuffling of the data.  Off by
            default: the paper's members differ by their initialisation (§4.1) and are trained
            "independently on the same data"; one shared order lets the first layer run as one
            wide matmul/conv for all members, which is what keeps Ens near 2x SM on small models.
        seed: initialisation and growth randomness.
    """

    method: str = "sm"
    arch: str = "mlp"
    width: int = 32
    members: int = 5
    gating: str = "soft"
    mixture_layers: tuple[int, ...] | None = None
    growth_rate: float = 0.25
    ff_epsilon: float = 1e-2
    ff_score_examples: int = 1024
    ens_member_data_order: bool = False
    seed: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UsageError(f"--vision-method {self.method!r} is unknown; use one of {', '.join(METHODS)}")
        if self.width < 1:
            raise UsageError(f"--vision-width must be >= 1, got {self.width}")
        if self.members < 1:
            raise UsageError(f"--ensemble-members must be >= 1, got {self.members}")
        if self.gating not in GATINGS:
            raise UsageError(f"--moe-gating must be soft or hard, got {self.gating!r}")
        if not self.growth_rate > 0:
            raise UsageError(f"--ff-growth-rate must be > 0, got {self.growth_rate}")


class Learner(nn.Module):
    """Common interface.  ``train_logits`` returns (G, B, C): G groups each with its own loss
    and best-epoch selection (G = N for Ens, whose members are independent runs; else 1)."""

    def __init__(self, spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.spec = spec
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.generator = torch.Generator().manual_seed(spec.seed)
        self.independent_members = 0  # > 0: the trainer gives each member its own data order
        self.selection_groups = 1  # G of train_logits: groups with their own loss and best epoch

    def trainable(self) -> nn.Module:
        raise NotImplementedError

    def train_logits(self, x: Tensor, per_member: bool = False) -> Tensor:
        raise NotImplementedError

    def predict_log_probs(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def before_stage(self, stage_index: int, train_x: Tensor, train_y: Tensor,
                     valid_x: Tensor, valid_y: Tensor) -> dict[str, Any]:
        """Grow before stage ``stage_index`` (1-based); returns what was done, with its FLOPs."""
        return {"flops": 0.0}

    def params_active(self) -> int:
        """|θ_t|: every parameter the predictor uses, frozen members included (§3.1 Mem)."""
        return count_parameters(self)

    def describe(self) -> dict[str, Any]:
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything needed to resume: parameters (whatever their grown shapes) and the RNG
        that drives initialisation, growth and hard routing."""
        return {"spec": self.spec, "model": self.state_dict(), "generator": self.generator.get_state()}

    def load_checkpoint_state(self, checkpoint: dict[str, Any]) -> None:
        """Inverse of ``checkpoint_state`` on a freshly built learner of the same spec: grown
        tensors (FF widths, gMoE experts, gEns members) are resized to the saved shapes first."""
        if checkpoint["spec"] != self.spec:
            raise UsageError(f"checkpoint was written by {checkpoint['spec']}, not {self.spec}; use the same flags")
        state = checkpoint["model"]
        self._resize_like(state)
        for name, tensor in list(self.named_parameters()) + list(self.named_buffers()):
            saved = state.get(name)
            if saved is not None and saved.shape != tensor.shape:
                owner_name, _, attr = name.rpartition(".")
                owner = self.get_submodule(owner_name)
                fresh = torch.empty_like(saved)
                setattr(owner, attr, nn.Parameter(fresh) if isinstance(tensor, nn.Parameter) else fresh)
        self.load_state_dict(state)
        self.generator.set_state(checkpoint["generator"])

    def _resize_like(self, state: dict[str, Tensor]) -> None:
        """Hook for learners whose module structure (not only tensor shapes) grows."""

    def _example_batch(self) -> Tensor:
        return torch.zeros(2, *self.input_shape)

    def train_macs_per_example(self) -> float:
        module = self.trainable()
        was_training = module.training
        module.eval()
        x = self._example_batch()
        if self.independent_members:
            x = x.expand(self.independent_members, *x.shape)
        macs = count_forward_macs(module, lambda: self.train_logits(x, per_member=bool(self.independent_members)), 2)
        module.train(was_training)
        return macs

    def infer_macs_per_example(self) -> float:
        was_training = self.training
        self.eval()
        macs = count_forward_macs(self, lambda: self.predict_log_probs(self._example_batch()), 2)
        self.train(was_training)
        return macs

    def infer_flops_per_example(self) -> float:
        return inference_flops(self.infer_macs_per_example())


class StackedLearner(Learner):
    """SM (N = 1), Ens (N members, independent) and UMix (N members, logits averaged)."""

    def __init__(self, spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(spec, input_shape, num_classes)
        members = 1 if spec.method == "sm" else spec.members
        self.model = build_backbone(spec.arch, self.input_shape, spec.width, num_classes, members, self.generator)
        per_member_order = spec.method == "ens" and spec.ens_member_data_order and members > 1
        self.independent_members = members if per_member_order else 0
        self.selection_groups = members if spec.method == "ens" else 1

    def trainable(self) -> nn.Module:
        return self.model

    def train_logits(self, x: Tensor, per_member: bool = False) -> Tensor:
        logits = self.model(x, per_member=per_member)  # (N, B, C)
        return logits.mean(dim=0, keepdim=True) if self.spec.method == "umix" else logits

    def predict_log_probs(self, x: Tensor) -> Tensor:
        logits = self.model(x)  # (N, B, C)
        if self.spec.method == "ens":  # average of probabilities, in log space
            return torch.logsumexp(F.log_softmax(logits, dim=-1), dim=0) - math.log(logits.shape[0])
        return F.log_softmax(logits.mean(dim=0), dim=-1)

    def describe(self) -> dict[str, Any]:
        return {"members": self.model.members}


class GrowingEnsemble(Learner):
    """gEns: one new member per stage (k = 1), trained alone; earlier members frozen."""

    def __init__(self, spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(spec, input_shape, num_classes)
        self.members = nn.ModuleList([self._new_member()])

    def _new_member(self) -> nn.Module:
        return build_backbone(self.spec.arch, self.input_shape, self.spec.width, self.num_classes, 1, self.generator)

    def trainable(self) -> nn.Module:
        return self.members[-1]

    def train_logits(self, x: Tensor, per_member: bool = False) -> Tensor:
        return self.members[-1](x)

    def predict_log_probs(self, x: Tensor) -> Tensor:
        log_probs = torch.stack([F.log_softmax(member(x)[0], dim=-1) for member in self.members])
        return torch.logsumexp(log_probs, dim=0) - math.log(len(self.members))

    def before_stage(self, stage_index, train_x, train_y, valid_x, valid_y) -> dict[str, Any]:
        if stage_index > 1:
            for member in self.members:
                member.requires_grad_(False)
                member.eval()
            self.members.append(self._new_member())
        return {"flops": 0.0, "members": len(self.members)}

    def train(self, mode: bool = True) -> "GrowingEnsemble":
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


class _SingleModelLearner(Learner):
    """A learner that is one model with one member (``self.model``, logits (1, B, C))."""

    model: nn.Module

    def trainable(self) -> nn.Module:
        return self.model

    def train_logits(self, x: Tensor, per_member: bool = False) -> Tensor:
        return self.model(x)

    def predict_log_probs(self, x: Tensor) -> Tensor:
        return F.log_softmax(self.model(x)[0], dim=-1)


class GrowingMoE(_SingleModelLearner):
    """gMoE: split the losing expert of every mixture layer at every stage (Algorithm 2)."""

    def __init__(self, spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(spec, input_shape, num_classes)
        layers = spec.mixture_layers
        if layers is None:
            layers = (0, 1) if spec.arch == "mlp" else tuple(range(16))
        if spec.arch not in ("mlp", "vgg"):
            raise UsageError(f"--vision-arch {spec.arch!r} is unknown; use mlp or vgg")
        if spec.arch == "vgg":
            build_backbone("vgg", self.input_shape, spec.width, num_classes, 1, None)  # validates the input
        self.model = MoEBackbone(spec.arch, self.input_shape, spec.width, num_classes, spec.gating, layers, self.generator)
        for block in self.model.blocks:
            block.sampler = self.generator

    def expert_losses(self, valid_x: Tensor, valid_y: Tensor) -> list[Tensor]:
        """Per growing layer, (experts,): summed validation loss of the examples routed through
        each expert (soft gating: weighted by the routing probability)."""
        blocks = self.model.growing_blocks()
        totals = [torch.zeros(block.num_experts, dtype=torch.float64) for block in blocks]
        was_training = self.model.training
        self.model.eval()
        with torch.no_grad():
            for start in range(0, valid_x.shape[0], GROWTH_EVAL_BATCH):
                for block in blocks:
                    block.routing_log = []
                xb, yb = valid_x[start : start + GROWTH_EVAL_BATCH], valid_y[start : start + GROWTH_EVAL_BATCH]
                losses = F.cross_entropy(self.model(xb)[0], yb, reduction="none").double()  # (B,)
                for total, block in zip(totals, blocks):
                    total += block.routing_log[0].double().t() @ losses
        for block in blocks:
            block.routing_log = None
        self.model.train(was_training)
        return totals

    def before_stage(self, stage_index, train_x, train_y, valid_x, valid_y) -> dict[str, Any]:
        if stage_index <= 1:
            return {"flops": 0.0, "experts": self.describe()["experts"]}
        flops = inference_flops(self.infer_macs_per_example(), valid_x.shape[0])
        losers = [int(total.argmax()) for total in self.expert_losses(valid_x, valid_y)]
        for block, loser in zip(self.model.growing_blocks(), losers):
            block.split_expert(loser, self.generator)
        return {"flops": flops, "split": losers, "experts": self.describe()["experts"]}

    def describe(self) -> dict[str, Any]:
        return {"experts": [block.num_experts for block in self.model.growing_blocks()]}


class FireflyLearner(_SingleModelLearner):
    """FF: Firefly width growth of every hidden layer, ≈ growth_rate × initial |θ| per stage."""

    def __init__(self, spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(spec, input_shape, num_classes)
        self.model = build_backbone(spec.arch, self.input_shape, spec.width, num_classes, 1, self.generator)
        self.model.growable_layers()  # fails early on backbones FF cannot grow
        self.initial_params = count_parameters(self.model)

    def before_stage(self, stage_index, train_x, train_y, valid_x, valid_y) -> dict[str, Any]:
        if stage_index <= 1:
            return {"flops": 0.0, "widths": self.model.widths}
        units = units_for_growth(self.model, self.spec.growth_rate * self.initial_params)
        count = min(self.spec.ff_score_examples, train_x.shape[0])
        pick = torch.randperm(train_x.shape[0], generator=self.generator)[:count]
        report = grow_width(self.model, train_x[pick], train_y[pick], units, self.spec.ff_epsilon, self.generator)
        return {"flops": report.flops, "widths": self.model.widths, "splits": list(report.splits),
                "new_units": list(report.new_units)}

    def describe(self) -> dict[str, Any]:
        return {"widths": self.model.widths}


def build_learner(spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> Learner:
    """The learner for ``spec.method`` on inputs of ``input_shape`` with ``num_classes`` classes."""
    if spec.method in ("sm", "ens", "umix"):
        return StackedLearner(spec, input_shape, num_classes)
    if spec.method == "gens":
        return GrowingEnsemble(spec, input_shape, num_classes)
    if spec.method == "gmoe":
        return GrowingMoE(spec, input_shape, num_classes)
    return FireflyLearner(spec, input_shape, num_classes)
