"""``--arch alma_vision``: the flags of a vision ALMA learner, in fairseq's model group.

A vision learner (paper §4: SM, Ens, UMix, gEns, gMoE, FF on an MLP or a reduced VGG) is not a
fairseq model: each stage is a whole training run of its own (epochs with best-validation
selection, a fresh optimizer after growth, App. B.1), which fairseq's trainer cannot drive.
``fairseq-train --task alma_stream --arch alma_vision --vision-dataset D ...`` therefore hands
the run to the vision learner (``fairseq_glue/vision_entry.py``, then ``vision/runner.py``, the code
the sweep and the demo call too).  This registration exists so that fairseq parses the
learner's flags in their own group (``fairseq-train --arch alma_vision --help``) and keeps them
out of every language-model run's config.

No ``from __future__ import annotations``: fairseq builds argparse options from these
annotations at run time and needs real types.
"""

from dataclasses import dataclass, field
from typing import Any

from fairseq.dataclass import ChoiceEnum, FairseqDataclass
from fairseq.models import BaseFairseqModel, register_model

from ..errors import UsageError
from ..vision.learners import METHODS


@dataclass
class AlmaVisionConfig(FairseqDataclass):
    vision_dataset: str = field(default="", metadata={"help": (
        "the data set of the stream (required): digits (scikit-learn's embedded 8x8 digits), mnist (IDX files "
        "dir), cifar10 (python batches dir) or npz (x_train/y_train/x_test/y_test file), read from "
        "DATA or --vision-data-path")})
    vision_data_path: str = field(default="", metadata={"help": (
        "MNIST/CIFAR-10 directory or .npz file; default: fairseq-train's DATA (unused for digits)")})
    num_megabatches: int = field(default=20, metadata={"help": (
        "B: mega-batches the training set is cut into (paper §5: 500 MNIST, 100 CIFAR-10)")})
    valid_fraction: float = field(default=0.1, metadata={"help": (
        "share of each mega-batch kept as its validation set (paper §5: 10%%)")})
    vision_arch: ChoiceEnum(["auto", "mlp", "vgg"]) = field(default="auto", metadata={"help": (
        "backbone: MLP with 2 hidden layers (MNIST) or reduced VGG19 with batch norm (CIFAR-10); "
        "auto (default): the paper's for --vision-dataset, vgg on cifar10, mlp otherwise")})
    vision_method: ChoiceEnum(list(METHODS)) = field(default="sm", metadata={"help": (
        "learner (paper §4): sm, ens, umix, gens, gmoe or ff")})
    vision_width: int = field(default=32, metadata={"help": (
        "hidden units h of the MLP / channels c of every VGG layer (paper §5: 4 ... 64)")})
    ensemble_members: int = field(default=5, metadata={"help": "N members of ens and umix (App. B.1: 5)"})
    moe_gating: ChoiceEnum(["soft", "hard"]) = field(default="soft", metadata={"help": (
        "gmoe tree gating: soft, or hard with straight-through (App. B.1.1: soft)")})
    moe_mixture_layers: str = field(default="", metadata={"help": (
        "gmoe layers that grow, comma-separated 0-based indices; default: the first two layers, of the "
        "MLP and the VGG alike (paper §5; e.g. 0,1,2,3 grows four of the VGG's 16 conv layers)")})
    ff_growth_rate: float = field(default=0.25, metadata={"help": (
        "ff parameters added per stage, as a fraction of the initial count (App. B.1: 0.25)")})
    ff_new_layers: int = field(default=1, metadata={"help": (
        "ff residual layers inserted per growth phase (depth growth, §4.2; their parameters count "
        "towards the phase's budget, width growth gets the rest); 0 = width only")})
    epochs_per_stage: int = field(default=100, metadata={"help": (
        "epochs per stage; the epoch with the best validation loss is kept (App. B.1: 100)")})
    vision_optimizer: ChoiceEnum(["paper", "adadelta", "sgd"]) = field(default="paper", metadata={"help": (
        "the learner's optimizer, fresh each stage: adadelta (App. B.1.1, MNIST) or sgd with momentum "
        "0.9, weight decay 1e-4 (App. B.1.2, CIFAR-10); paper = sgd for cifar10, adadelta otherwise")})
    vision_lr: float = field(default=0.0, metadata={"help": (
        "the learner's learning rate; 0 = App. B.1's (adadelta 1.0, sgd 0.01)")})
    vision_augment: ChoiceEnum(["auto", "crop-flip", "none"]) = field(default="auto", metadata={"help": (
        "training augmentation: random 4-pixel-padded crop + horizontal flip (App. B.1.2); auto = "
        "crop-flip for cifar10 only")})
    vision_threads: int = field(default=1, metadata={"help": (
        "torch CPU threads for the learner (small models gain nothing from more)")})
    vision_device: ChoiceEnum(["auto", "cpu", "cuda"]) = field(default="auto", metadata={"help": (
        "where the learner trains: auto = the GPU when there is one and --cpu is not given")})
    vision_amp: ChoiceEnum(["off", "fp16", "bf16"]) = field(default="off", metadata={"help": (
        "mixed precision for the learner's forward passes (torch.autocast; fp16 adds loss "
        "scaling and needs CUDA)")})
    keep_stage_checkpoints: bool = field(default=False, metadata={"help": (
        "also keep checkpoint_stage{s}.pt after every stage (checkpoint_last.pt always holds the "
        "latest; a stream of 500 stages would otherwise keep 500 files)")})


@register_model("alma_vision", dataclass=AlmaVisionConfig)
class AlmaVisionFlags(BaseFairseqModel):
    """Registered for its flags only (module doc); the task never builds it."""

    @classmethod
    def build_model(cls, cfg: AlmaVisionConfig, task: Any) -> "AlmaVisionFlags":
        raise UsageError("--arch alma_vision is the learner of vision streams: use it with "
                         "--task alma_stream --vision-dataset (digits, mnist, cifar10 or npz)")
