"""The six learners of §4 behind one interface the stage trainer and stream runner drive.

Fixed architectures (§4.1): SM (one model, fine-tuned stage after stage), Ens (N members trained
independently on the same data, probabilities averaged at test time) and UMix (N members whose
logits are averaged in training and at test time).  All three are one stacked module with N
members (N = 1 for SM), so Ens/UMix run as one batched model, not N models.
Growing architectures (§4.2): gEns (one new member per stage trained on the stage's data, older
members frozen), gMoE (tree-gated experts, the losing expert split at every stage, App. A) and FF
(Firefly growth in width and depth, linear in parameters, App. B.1); they live in
``learners_growing``.

Devices: ``learner.to(device)`` works at any time, before or after growth.  Randomness comes from
the learner's CPU ``generator`` on every device (CPU numbers never change and a CUDA run makes
the same draws); whatever growth creates is placed on ``learner.device`` in ``learner.dtype``.
Log-probabilities are computed in float32 when autocast hands back fp16/bf16 logits.

Inputs arrive unnormalised; every learner applies its ``input_norm`` (the statistics of the
mega-batches arrived by its latest stage, ``normalization``) before its backbone, so evaluation
always uses the statistics the model was trained with.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UsageError
from ..stream.fingerprint_forms import PAPER_MIXTURE_LAYERS, comparable_form
from .devices import placement, upcast
from .mac_count import count_forward_macs, count_parameters, inference_flops
from .models import build_backbone
from .models_moe import GATINGS, mixture_layer_count
from .normalization import InputNormalizer

METHODS = ("sm", "ens", "umix", "gens", "gmoe", "ff")


def paper_backbone(dataset: str) -> str:
    """The paper's backbone for ``dataset`` (§5): the reduced VGG19 on CIFAR-10, the MLP on
    MNIST (and the digits, an npz): what ``--vision-arch auto`` and ``alma-vision-sweep``
    without ``--arch`` train, as the optimizer and the augmentation follow the data set."""
    return "vgg" if dataset == "cifar10" else "mlp"


def parse_mixture_layers(text: str, flag: str = "--moe-mixture-layers") -> tuple[int, ...] | None:
    """``flag``'s comma-separated gMoE layer indices; None when empty (the paper's default)."""
    if not text.strip():
        return None
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"{flag} takes comma-separated layer indices, e.g. '0,1' "
                         f"(got {text!r})") from None
    if not all(layer >= 0 for layer in layers):
        raise UsageError(f"{flag} indices must be >= 0 (got {text!r})")
    return layers


@dataclass(frozen=True)
class LearnerSpec:
    """Everything that defines a learner (typed; no argparse Namespace).

    Attributes:
        method: sm, ens, umix, gens, gmoe or ff.
        arch: mlp (two hidden layers of ``width``) or vgg (reduced VGG19, ``width`` channels).
        width: h or c (paper: 4 … 64).
        members: N for Ens and UMix (paper: 5).
        gating: gMoE gating, soft or hard (paper: soft on MNIST and CIFAR).
        mixture_layers: gMoE layers that grow; default the first two, for the MLP (all it
            has) and the VGG alike (§5: "adds modules (at the first two layers)", and on
            CIFAR-10 "the methods ... are the same").  Filled in here so that every record
            names them (``fingerprint_forms.recorded_mixture_layers`` reads older ones).
        growth_rate: FF parameters added per step as a fraction of the initial count (0.25).
        ff_new_layers: FF residual layers inserted per growth step (depth growth; 0: width
            only).  Their parameters count towards the step's budget.
        ff_new_candidates: FF random new units offered per layer (Firefly's code: 70).
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
    ff_new_layers: int = 1
    ff_new_candidates: int = 70
    ff_epsilon: float = 1e-2
    ff_score_examples: int = 1024
    ens_member_data_order: bool = False
    seed: int = 1

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise UsageError(
                f"--vision-method {self.method!r} is unknown; use one of {', '.join(METHODS)}"
            )
        if self.width < 1:
            raise UsageError(f"--vision-width must be >= 1, got {self.width}")
        if self.members < 1:
            raise UsageError(f"--ensemble-members must be >= 1, got {self.members}")
        if self.gating not in GATINGS:
            raise UsageError(f"--moe-gating must be soft or hard, got {self.gating!r}")
        if not self.growth_rate > 0:
            raise UsageError(f"--ff-growth-rate must be > 0, got {self.growth_rate}")
        if self.ff_new_layers < 0:
            raise UsageError(f"--ff-new-layers must be >= 0 (0: width growth only), got "
                             f"{self.ff_new_layers}")
        if self.method == "gmoe" and not self.mixture_layers:
            object.__setattr__(self, "mixture_layers", PAPER_MIXTURE_LAYERS)
        if self.mixture_layers is not None:
            count = mixture_layer_count(self.arch)
            bad = [layer for layer in self.mixture_layers if not 0 <= layer < count]
            if bad:
                raise UsageError(f"--moe-mixture-layers {','.join(map(str, self.mixture_layers))}: "
                                 f"layer {bad[0]} is not in the {self.arch} backbone (layers "
                                 f"0-{count - 1})")
        if self.ff_new_candidates < 0:
            raise UsageError(f"ff_new_candidates must be >= 0, got {self.ff_new_candidates}")


class Learner(nn.Module):
    """Common interface.  ``train_logits`` returns (G, B, C): G groups each with its own loss
    and best-epoch selection (G = N for Ens, whose members are independent runs; else 1)."""

    def __init__(self, spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__()
        self.spec = spec
        self.input_shape = tuple(input_shape)
        self.num_classes = num_classes
        self.generator = torch.Generator().manual_seed(spec.seed)
        self.input_norm = InputNormalizer(self.input_shape)
        self.independent_members = 0  # > 0: the trainer gives each member its own data order
        self.selection_groups = 1  # G of train_logits: groups with their own loss and best epoch

    @property
    def device(self) -> torch.device:
        """Where the parameters live (``to`` moves them); grown tensors are created here."""
        return placement(self)[0]

    @property
    def dtype(self) -> torch.dtype:
        """Floating dtype of the parameters; grown tensors and example batches use it."""
        return placement(self)[1]

    def trainable(self) -> nn.Module:
        raise NotImplementedError

    def train_logits(self, x: Tensor, per_member: bool = False) -> Tensor:
        raise NotImplementedError

    def predict_log_probs(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def set_input_statistics(self, mean: Tensor, std: Tensor) -> None:
        """Normalise inputs with the statistics of the data arrived by the coming stage; the
        runner calls this before ``before_stage``."""
        self.input_norm.set_statistics(mean, std)

    def before_stage(
        self, stage_index: int, train_x: Tensor, train_y: Tensor, valid_x: Tensor, valid_y: Tensor
    ) -> dict[str, Any]:
        """Grow before stage ``stage_index`` (1-based); returns what was done, with its FLOPs."""
        return {"flops": 0.0}

    def plan_growth(self, stage_index: int, valid_x: Tensor, valid_y: Tensor) -> dict[str, Any]:
        """After training stage ``stage_index`` when another stage follows: decide the next
        growth on this stage's validation data, the data available then (Algorithm 2, line 11);
        returns what was decided, with its FLOPs.  Growth itself waits for ``before_stage``."""
        return {"flops": 0.0}

    def params_active(self) -> int:
        """|θ_t|: every parameter the predictor uses, frozen members included (§3.1 Mem)."""
        return count_parameters(self)

    def describe(self) -> dict[str, Any]:
        return {}

    def checkpoint_state(self) -> dict[str, Any]:
        """Everything needed to resume: parameters (whatever their grown shapes) and the RNG
        that drives initialisation, growth and hard routing."""
        return {
            "spec": self.spec,
            "model": self.state_dict(),
            "generator": self.generator.get_state(),
        }

    def load_checkpoint_state(self, checkpoint: dict[str, Any]) -> None:
        """Inverse of ``checkpoint_state`` on a freshly built learner of the same spec: grown
        tensors (FF widths, gMoE experts, gEns members) are resized to the saved shapes first."""
        # settings the method does not read (--members for SM, ...) may differ: the same learner
        if _read_settings(checkpoint["spec"]) != _read_settings(self.spec):
            raise UsageError(
                f"checkpoint was written by {checkpoint['spec']}, not {self.spec}; "
                "use the same flags"
            )
        state = checkpoint["model"]
        self._resize_like(state)
        for name, tensor in list(self.named_parameters()) + list(self.named_buffers()):
            saved = state.get(name)
            if saved is not None and saved.shape != tensor.shape:
                owner_name, _, attr = name.rpartition(".")
                owner = self.get_submodule(owner_name)
                fresh = torch.empty(saved.shape, dtype=tensor.dtype, device=tensor.device)
                setattr(
                    owner, attr, nn.Parameter(fresh) if isinstance(tensor, nn.Parameter) else fresh
                )
        self.load_state_dict(state)
        self.generator.set_state(checkpoint["generator"])

    def _resize_like(self, state: dict[str, Tensor]) -> None:
        """Hook for learners whose module structure (not only tensor shapes) grows."""

    def _example_batch(self) -> Tensor:
        return torch.zeros(2, *self.input_shape, device=self.device, dtype=self.dtype)

    def train_macs_per_example(self) -> float:
        module = self.trainable()
        was_training = module.training
        module.eval()
        x = self._example_batch()
        if self.independent_members:
            x = x.expand(self.independent_members, *x.shape)
        macs = count_forward_macs(
            module, lambda: self.train_logits(x, per_member=bool(self.independent_members)), 2
        )
        module.train(was_training)
        return macs

    def infer_macs_per_image(self) -> float:
        was_training = self.training
        self.eval()
        macs = count_forward_macs(self, lambda: self.predict_log_probs(self._example_batch()), 2)
        self.train(was_training)
        return macs

    def infer_flops_per_image(self) -> float:
        return inference_flops(self.infer_macs_per_image())


class StackedLearner(Learner):
    """SM (N = 1), Ens (N members, independent) and UMix (N members, logits averaged)."""

    def __init__(self, spec: LearnerSpec, input_shape: tuple[int, ...], num_classes: int) -> None:
        super().__init__(spec, input_shape, num_classes)
        members = 1 if spec.method == "sm" else spec.members
        self.model = build_backbone(
            spec.arch, self.input_shape, spec.width, num_classes, members, self.generator
        )
        per_member_order = spec.method == "ens" and spec.ens_member_data_order and members > 1
        self.independent_members = members if per_member_order else 0
        self.selection_groups = members if spec.method == "ens" else 1

    def trainable(self) -> nn.Module:
        return self.model

    def train_logits(self, x: Tensor, per_member: bool = False) -> Tensor:
        logits = self.model(self.input_norm(x), per_member=per_member)  # (N, B, C)
        return logits.mean(dim=0, keepdim=True) if self.spec.method == "umix" else logits

    def predict_log_probs(self, x: Tensor) -> Tensor:
        logits = upcast(self.model(self.input_norm(x)))  # (N, B, C)
        if self.spec.method == "ens":  # average of probabilities, in log space
            return torch.logsumexp(F.log_softmax(logits, dim=-1), dim=0) - math.log(logits.shape[0])
        return F.log_softmax(logits.mean(dim=0), dim=-1)

    def describe(self) -> dict[str, Any]:
        return {"members": self.model.members}


class SingleModelLearner(Learner):
    """A learner that is one model with one member (``self.model``, logits (1, B, C))."""

    model: nn.Module

    def trainable(self) -> nn.Module:
        return self.model

    def train_logits(self, x: Tensor, per_member: bool = False) -> Tensor:
        return self.model(self.input_norm(x))

    def predict_log_probs(self, x: Tensor) -> Tensor:
        return F.log_softmax(upcast(self.model(self.input_norm(x))[0]), dim=-1)


def _read_settings(spec: LearnerSpec) -> dict[str, Any]:
    """``spec``'s settings that its method reads (``fingerprint.comparable_form``)."""
    return comparable_form({"settings": {"learner": asdict(spec)}})["settings"]["learner"]
