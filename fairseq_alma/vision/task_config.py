"""The vision flags of ``fairseq-train --task alma_stream`` and their typed values (§5, App. B.1).

``AlmaStreamConfig`` inherits ``VisionStreamFields``: one task, one set of stream flags
(``--wait``, ``--replay``, ``--seed`` are shared with the language-model stream), and
``--vision-dataset`` picks the vision back end.  The functions below turn the config into the
typed specs the vision library takes (``LearnerSpec``, ``StreamSpec``, ``StageTrainConfig``), so
no vision module reads the fairseq config itself, and adapt fairseq's own settings to a stream
whose stages train themselves (``adapt_training_config``).

No ``from __future__ import annotations`` here: fairseq builds argparse options from these
annotations at run time and needs real types, not strings.
"""

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

from fairseq.dataclass import ChoiceEnum, FairseqDataclass

from ..errors import UsageError, require
from .data import VisionData
from .learners import METHODS, LearnerSpec
from .stage_trainer import OptimizerSpec, StageTrainConfig
from .stream_runner import StreamSpec

VISION_DATASETS = ("digits", "mnist", "cifar10", "npz")
PAPER_BATCH_SIZE = 128  # App. B.1: "A training minibatch size of 128 is used."


@dataclass
class VisionStreamFields(FairseqDataclass):
    vision_dataset: str = field(default="", metadata={"help": (
        "run a vision stream (paper §5) on: digits (scikit-learn's embedded 8x8 digits), mnist "
        "(IDX files dir), cifar10 (python batches dir) or npz (x_train/y_train/x_test/y_test "
        "file), read from DATA or --vision-data-path; empty = a language-model stream")})
    vision_data_path: str = field(default="", metadata={"help": (
        "MNIST/CIFAR-10 directory or .npz file; default: DATA (unused for digits)")})
    num_megabatches: int = field(default=20, metadata={"help": (
        "B: mega-batches the vision training set is cut into (paper §5: 500 MNIST, "
        "100 CIFAR-10)")})
    valid_fraction: float = field(default=0.1, metadata={"help": (
        "share of each mega-batch kept as its validation set (paper §5: 10%%)")})
    vision_arch: ChoiceEnum(["mlp", "vgg"]) = field(default="mlp", metadata={"help": (
        "backbone: MLP with 2 hidden layers (MNIST) or reduced VGG19 with batch norm "
        "(CIFAR-10)")})
    vision_method: ChoiceEnum(list(METHODS)) = field(default="sm", metadata={"help": (
        "learner (paper §4): sm, ens, umix, gens, gmoe or ff")})
    vision_width: int = field(default=32, metadata={"help": (
        "hidden units h of the MLP / channels c of every VGG layer (paper §5: 4 ... 64)")})
    ensemble_members: int = field(default=5, metadata={"help": (
        "N members of ens and umix (App. B.1: 5)")})
    moe_gating: ChoiceEnum(["soft", "hard"]) = field(default="soft", metadata={"help": (
        "gmoe tree gating: soft, or hard with straight-through (App. B.1.1: soft)")})
    moe_mixture_layers: str = field(default="", metadata={"help": (
        "gmoe layers that grow, comma-separated 0-based indices; default: the first two layers "
        "of the MLP (paper §5), every conv layer of the VGG")})
    ff_growth_rate: float = field(default=0.25, metadata={"help": (
        "ff parameters added per stage, as a fraction of the initial count (App. B.1: 0.25)")})
    epochs_per_stage: int = field(default=100, metadata={"help": (
        "epochs per stage; the epoch with the best validation loss is kept (App. B.1: 100)")})
    vision_optimizer: ChoiceEnum(["paper", "adadelta", "sgd"]) = field(
        default="paper", metadata={"help": (
            "the learner's optimizer, fresh each stage: adadelta (App. B.1.1, MNIST) or sgd with "
            "momentum 0.9, weight decay 1e-4 (App. B.1.2, CIFAR-10); paper = sgd for cifar10, "
            "adadelta otherwise")})
    vision_lr: float = field(default=0.0, metadata={"help": (
        "the learner's learning rate; 0 = App. B.1's (adadelta 1.0, sgd 0.01)")})
    vision_augment: ChoiceEnum(["auto", "crop-flip", "none"]) = field(
        default="auto", metadata={"help": (
            "training augmentation: random 4-pixel-padded crop + horizontal flip (App. B.1.2); "
            "auto = crop-flip for cifar10 only")})
    vision_threads: int = field(default=1, metadata={"help": (
        "torch CPU threads for the learner (small models gain nothing from more)")})


def _text(value: Any) -> str:
    """fairseq keeps ChoiceEnum values as enum members; the vision library takes plain strings."""
    return str(getattr(value, "value", value))


def _mixture_layers(text: str) -> Optional[Tuple[int, ...]]:
    if not text.strip():
        return None
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise UsageError(f"--moe-mixture-layers takes comma-separated layer indices, e.g. '0,1' "
                         f"(got {text!r})") from None
    require(all(layer >= 0 for layer in layers),
            f"--moe-mixture-layers indices must be >= 0 (got {text!r})")
    return layers


def learner_spec(cfg: Any) -> LearnerSpec:
    """The learner the flags describe (LearnerSpec checks the values and names bad flags)."""
    return LearnerSpec(
        method=_text(cfg.vision_method),
        arch=_text(cfg.vision_arch),
        width=int(cfg.vision_width),
        members=int(cfg.ensemble_members),
        gating=_text(cfg.moe_gating),
        mixture_layers=_mixture_layers(cfg.moe_mixture_layers),
        growth_rate=float(cfg.ff_growth_rate),
        seed=int(cfg.seed),
    )


def stream_spec(cfg: Any) -> StreamSpec:
    """B, w, replay, validation share and partition seed (StreamSpec checks --wait's range)."""
    require(0.0 <= cfg.valid_fraction < 1.0,
            f"--valid-fraction must be in [0, 1) (got {cfg.valid_fraction})")
    return StreamSpec(
        num_megabatches=int(cfg.num_megabatches),
        wait=int(cfg.wait),
        replay=bool(cfg.replay),
        valid_fraction=float(cfg.valid_fraction),
        seed=int(cfg.seed),
    )


def optimizer_spec(cfg: Any) -> OptimizerSpec:
    """App. B.1's optimizers; --vision-lr replaces only the learning rate."""
    name = _text(cfg.vision_optimizer)
    if name == "paper":
        name = "sgd" if cfg.vision_dataset == "cifar10" else "adadelta"
    require(cfg.vision_lr >= 0,
            f"--vision-lr must be >= 0 (0 = the paper's value), got {cfg.vision_lr}")
    paper = OptimizerSpec.paper_cifar() if name == "sgd" else OptimizerSpec.paper_mnist()
    if cfg.vision_lr == 0:
        return paper
    return OptimizerSpec(name, float(cfg.vision_lr), paper.momentum, paper.weight_decay)


def stage_train_config(cfg: Any, data: VisionData) -> StageTrainConfig:
    """Epochs, minibatch (fairseq's --batch-size), optimizer and augmentation of every stage."""
    require(cfg.epochs_per_stage >= 1,
            f"--epochs-per-stage must be >= 1, got {cfg.epochs_per_stage}")
    augment = _text(cfg.vision_augment)
    crop_flip = augment == "crop-flip" or (augment == "auto" and cfg.vision_dataset == "cifar10")
    require(not crop_flip or data.is_image, f"--vision-augment crop-flip needs images, but "
            f"{data.name} holds feature vectors; use --vision-augment none")
    fill = tuple(-m / s for m, s in zip(data.mean, data.std)) if crop_flip else None
    return StageTrainConfig(
        epochs=int(cfg.epochs_per_stage),
        batch_size=int(cfg.batch_size or PAPER_BATCH_SIZE),
        optimizer=optimizer_spec(cfg),
        augment=crop_flip,
        augment_fill=fill,
    )


def data_location(cfg: Any) -> Optional[str]:
    """Where the data set lives: --vision-data-path, else fairseq-train's DATA (digits: none)."""
    require(cfg.vision_dataset in VISION_DATASETS, f"--vision-dataset {cfg.vision_dataset!r} is "
            f"unknown; use one of {', '.join(VISION_DATASETS)}")
    if cfg.vision_dataset == "digits":
        return None
    return cfg.vision_data_path or cfg.data


def _root(cfg: Any) -> Any:
    node = cfg
    while getattr(node, "_get_parent", None) is not None and node._get_parent() is not None:
        node = node._get_parent()
    return node


def adapt_training_config(cfg: Any, stages: int) -> Any:
    """fairseq-train's settings for a vision stream; returns the root config.

    * ``--max-epoch``: at most the stream's stages (default: all of them), lowered by
      ``ALMA_STOP_AFTER_STAGE=t`` (``alma-sweep --chain-stages``: stop after stage t, the same
      command continues), as in the language-model stream;
    * no fairseq ``valid*`` files to look for: DATA is a data set directory or file;
    * fairseq insists on an optimizer: without ``--optimizer`` a placeholder SGD (it never steps);
    * no ``--fp16``/``--bf16``/``--amp``: the learner trains in float32 with its own optimizer.
    """
    root = _root(cfg)
    if not hasattr(root, "get") or root.get("optimization") is None:
        return root
    optimization = root.optimization
    given = optimization.get("max_epoch") or 0
    require(given <= stages, f"--max-epoch must be <= {stages} (the stream's stages); got {given}")
    limit = given or stages
    env = os.environ.get("ALMA_STOP_AFTER_STAGE", "").strip()
    if env:
        require(env.isdigit() and int(env) >= 1,
                f"ALMA_STOP_AFTER_STAGE must be a stage number >= 1 (got {env!r})")
        limit = min(limit, int(env))
    optimization.max_epoch = limit
    if root.get("dataset") is not None:
        root.dataset.ignore_unused_valid_subsets = True
    if root.get("optimizer") is None:
        from omegaconf import OmegaConf

        root.optimizer = OmegaConf.create(
            {"_name": "sgd", "lr": [0.0], "momentum": 0.0, "weight_decay": 0.0})
    common = root.get("common") or {}
    for flag in ("fp16", "bf16", "amp", "memory_efficient_fp16", "memory_efficient_bf16"):
        require(not common.get(flag), f"--{flag.replace('_', '-')} does not apply to vision "
                "streams (the learner trains in float32 with its own optimizer); drop it")
    return root
