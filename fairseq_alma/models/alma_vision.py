"""``alma_vision``: what fairseq sees of a vision ALMA learner (paper §4) in a vision stream.

``fairseq-train --task alma_stream --vision-dataset ... --arch alma_vision`` (the learner itself
is described by the task's ``--vision-*`` flags; this model has no flags of its own).

Why a wrapper that keeps the learner *outside* its module tree: a vision stage is a whole
training run of its own (epochs with best-validation selection and a fresh optimizer per stage,
App. B.1), and growth between stages (a gEns member, gMoE experts, Firefly units) replaces
tensors with larger ones.  fairseq's optimizer, DDP and fp16 wrappers capture a model's
parameter list once, so they would hold stale tensors.  fairseq therefore sees one placeholder
parameter, which never receives a gradient (the task never steps fairseq's optimizer), while the
learner's real state travels in ``state_dict``/``load_state_dict``: parameters in their grown
shapes, the RNG that drives initialisation and growth, and what each stage did (FLOPs, best
epoch), so every fairseq checkpoint resumes the stream exactly (DESIGN.md: same command again =
continue).
"""

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch
from fairseq.dataclass import FairseqDataclass
from fairseq.models import BaseFairseqModel, register_model
from torch import Tensor, nn

from ..errors import UsageError
from ..vision.learners import Learner, LearnerSpec, build_learner

# LearnerSpec field -> the alma_stream flag that sets it, for errors on resume with other flags.
SPEC_FLAGS = {
    "method": "--vision-method",
    "arch": "--vision-arch",
    "width": "--vision-width",
    "members": "--ensemble-members",
    "gating": "--moe-gating",
    "mixture_layers": "--moe-mixture-layers",
    "growth_rate": "--ff-growth-rate",
    "seed": "--seed",
}


@dataclass
class AlmaVisionConfig(FairseqDataclass):
    """No flags: the learner is set by the task's --vision-method, --vision-arch, --vision-width."""


@register_model("alma_vision", dataclass=AlmaVisionConfig)
class AlmaVisionModel(BaseFairseqModel):
    """A vision learner plus the per-stage facts the stream records need (see module doc).

    ``settings``: the run's stream and training flags (flag name -> value); a checkpoint written
    with other settings is refused on load, naming the flag, instead of silently mixing streams.
    """

    def __init__(self, learner: Learner, settings: Dict[str, Any]) -> None:
        super().__init__()
        self.placeholder = nn.Parameter(torch.zeros(1))  # fairseq's optimizer needs one parameter
        object.__setattr__(self, "_learner", learner)  # not a submodule, on purpose (module doc)
        self.settings = dict(settings)
        self.stages: Dict[int, Dict[str, Any]] = {}
        self._seconds_before = 0.0
        self._started = time.perf_counter()

    @classmethod
    def build_model(cls, cfg: Any, task: Any) -> "AlmaVisionModel":
        if not hasattr(task, "new_learner"):
            raise UsageError("--arch alma_vision is the model of vision streams; add "
                             "--vision-dataset (digits, mnist, cifar10 or npz) to "
                             "--task alma_stream")
        return cls(task.new_learner(), task.run_settings())

    @property
    def learner(self) -> Learner:
        return self._learner

    def forward(self, x: Tensor) -> Tensor:
        """(B, C) log-probabilities of the learner's predictor (ensembles averaged, §4.1)."""
        return self.learner.predict_log_probs(x)

    def stages_trained(self) -> int:
        return max(self.stages, default=0)

    def record_stage(self, stage: int, info: Dict[str, Any]) -> None:
        """Keep what stage ``stage`` did (plain numbers and lists: fairseq loads checkpoints
        with ``weights_only``)."""
        self.stages[stage] = info

    def run_seconds(self) -> float:
        """Wall-clock seconds spent on this stream so far, over all resumed processes."""
        return self._seconds_before + time.perf_counter() - self._started

    def extra_repr(self) -> str:
        return f"learner={self.learner!r}"

    # ---- checkpoints -------------------------------------------------------------------
    def state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:  # noqa: ARG002
        state = self.learner.checkpoint_state()
        return {
            "spec": dataclasses.asdict(state["spec"]),
            "learner": state["model"],
            "generator": state["generator"],
            "settings": dict(self.settings),
            "stages": {stage: dict(info) for stage, info in self.stages.items()},
            "run_seconds": self.run_seconds(),
        }

    def load_state_dict(self, state_dict: Dict[str, Any], strict: bool = True,  # noqa: ARG002
                        model_cfg: Optional[Any] = None, args: Optional[Any] = None) -> None:
        """Rebuild the learner from a checkpoint: grown shapes are restored, RNG state included."""
        if "spec" not in state_dict or "learner" not in state_dict:
            raise UsageError("the checkpoint does not hold an alma_vision learner; "
                             "use another --save-dir")
        saved = LearnerSpec(**state_dict["spec"])
        now = self.learner.spec
        differing = [
            f"{SPEC_FLAGS[name]} {getattr(saved, name)!r} (now {getattr(now, name)!r})"
            for name in SPEC_FLAGS if getattr(saved, name) != getattr(now, name)
        ]
        differing += [
            f"{flag} {state_dict['settings'].get(flag)!r} (now {value!r})"
            for flag, value in self.settings.items() if state_dict["settings"].get(flag) != value
        ]
        if differing:
            raise UsageError("the checkpoint in --save-dir was written with " + ", ".join(differing)
                             + "; run with the same flags or another --save-dir")
        learner = build_learner(saved, self.learner.input_shape, self.learner.num_classes)
        learner.load_checkpoint_state(
            {"spec": saved, "model": state_dict["learner"], "generator": state_dict["generator"]}
        )
        object.__setattr__(self, "_learner", learner)
        self.stages = {int(stage): dict(info) for stage, info in state_dict["stages"].items()}
        self._seconds_before = float(state_dict.get("run_seconds", 0.0))
        self._started = time.perf_counter()
