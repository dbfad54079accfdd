"""``fairseq-train --task alma_stream --vision-dataset D --arch alma_vision``: a thin entry.

``AlmaStreamTask.setup_task`` hands a vision stream (``--arch alma_vision``) to
``VisionStreamEntry``.  fairseq then asks
it to build the model, the first moment it holds both the task's flags (data, ``--wait``,
``--replay``, ``--seed``, ``--save-dir``, ``--batch-size``) and the learner's
(``--arch alma_vision``, ``models/alma_vision.py``); the entry turns them into a ``VisionRun``
and runs the stream in a ``StreamSession`` (``stream/session.py``, opened with the ranks' agreement)
with ``runner.run_vision_session``, the code the sweep and the demo run too.
The process then ends (exit 0, or the requeue status after a signal); fairseq's own trainer,
optimizer and checkpoints are never involved.
"""

from __future__ import annotations

import logging
import os
from typing import Any, NoReturn

import torch
from fairseq.tasks import FairseqTask

from ..errors import UsageError, require
from ..ranks import raise_unless_all_ok, world
from ..stream.progress import StreamPlan, wait_from_flag
from ..stream.session import StreamSession
from ..stream.stop import StopSignal, stage_limit
from ..vision.devices import planned_device, resolve_device
from ..vision.learners import LearnerSpec, paper_backbone, parse_mixture_layers
from ..vision.runner import VisionRun, run_vision_session
from ..vision.stage_trainer import OptimizerSpec, StageTrainConfig
from .config import component_name, given, refuse_flags

logger = logging.getLogger(__name__)

PAPER_BATCH_SIZE = 128  # App. B.1: "A training minibatch size of 128 is used."
DATASETS = ("digits", "mnist", "cifar10", "npz")


def _text(value: Any) -> str:
    """fairseq keeps ChoiceEnum values as enum members; the vision library takes strings."""
    return str(getattr(value, "value", value))


def _arch(flag: str, dataset: str) -> str:
    return paper_backbone(dataset) if flag == "auto" else flag


def _optimizer(dataset: str, name: str, lr: float) -> OptimizerSpec:
    """App. B.1's optimizers; --vision-lr replaces only the learning rate."""
    if name == "paper":
        name = "sgd" if dataset == "cifar10" else "adadelta"
    require(lr >= 0, f"--vision-lr must be >= 0 (0 = the paper's value), got {lr}")
    paper = OptimizerSpec.paper_cifar() if name == "sgd" else OptimizerSpec.paper_mnist()
    return paper if lr == 0 else OptimizerSpec(name, float(lr), paper.momentum, paper.weight_decay)


# alma_stream's language-model flags, which a vision stream's learner never reads (a stage
# trains --epochs-per-stage epochs of images): flag -> what a vision stream has instead.
LM_TASK_FLAGS = {
    "updates_per_stage": "--epochs-per-stage",
    "scale_updates_by_wait": "--epochs-per-stage",
    "stage_init": "--vision-method gens (a new learner per stage)",
    "reset_optimizer_each_stage": "nothing: the learner's optimizer is App. B.1's, kept across stages",
    "grow_experts": "--vision-method gmoe or ff (learners that grow)",
    "grow_at_stages": "--vision-method gmoe or ff (learners that grow)",
    "eval_subset": "nothing: a vision stream is scored on its dataset's test set",
    "flops_convention": "nothing: a vision learner's FLOPs are counted per image",
    "fairseq_validation": "nothing: each stage validates on its mega-batches' held-out share",
    **{key: "nothing: a vision stream's inputs are images, not token blocks" for key in (
        "tokens_per_sample", "sample_break_mode", "output_dictionary_size", "self_target",
        "future_target", "past_target", "add_bos_token", "max_target_positions", "shorten_method",
        "shorten_data_split_list", "pad_to_fixed_length", "pad_to_fixed_bsz")},
}


def refuse_lm_only_stream_flags(task_cfg: Any) -> None:
    """Partial replay and LR meta-schedules are LM-stream features: a vision stage trains whole
    epochs with best-validation selection (no update budget to take a replayed fraction of) and
    its optimizer's LR never passes through fairseq's LR scheduler.  Likewise every flag of
    ``LM_TASK_FLAGS``: ``--stage-init scratch`` was silently ignored (the learner continued).
    Refused, never ignored."""
    # the task's config through fairseq's registry: importing tasks/alma_stream.py here would
    # close an import circle (it hands vision streams to this module)
    from fairseq.tasks import TASK_DATACLASS_REGISTRY

    ratio = task_cfg.get("replay_ratio") or 0.0
    require(ratio == 0.0, f"--replay-ratio {ratio:g} is for language-model streams; a vision stream "
            f"trains on its new mega-batches, or on everything seen with --replay")
    schedule = given(task_cfg, "lr_scheduler", "stage_lr_schedule")
    schedule = str(getattr(schedule, "value", schedule)) if schedule is not None else "restart"
    require(schedule == "restart", f"--stage-lr-schedule {schedule} is for language-model streams; a "
            f"vision stream's optimizer keeps App. B.1's settings (--vision-optimizer, --vision-lr)")
    # after these two: a meta-schedule needs --updates-per-stage, and the schedule is what to name
    defaults = TASK_DATACLASS_REGISTRY["alma_stream"]()
    for key, instead in LM_TASK_FLAGS.items():
        value, default = task_cfg.get(key), getattr(defaults, key)
        if _text(value) == _text(default):
            continue
        flag = f"--{key.replace('_', '-')}"
        if instead.startswith("nothing: "):
            raise UsageError(f"{flag} is for language-model streams ({instead.removeprefix('nothing: ')}); drop it")
        raise UsageError(f"{flag} is for language-model streams; a vision stream uses {instead}")


# fairseq-train's training flags that a vision stream's learner never reads (its optimizer, LR,
# budget and checkpoints are its own, App. B.1's, set by the --vision-* flags): (section, key)
# -> what sets that instead.  Given with a value other than fairseq's default, each is refused.
FAIRSEQ_TRAINING_FLAGS = {
    ("optimization", "lr"): "--vision-lr",
    ("optimization", "max_update"): "--epochs-per-stage",
    ("optimization", "update_freq"): "--batch-size",
    ("optimization", "clip_norm"): "nothing: the learner does not clip gradients",
    ("optimization", "stop_min_lr"): "--max-epoch N (stop after stage N)",
    ("optimization", "stop_time_hours"): "--max-epoch N (stop after stage N)",
    ("dataset", "max_tokens"): "--batch-size",
    ("dataset", "required_batch_size_multiple"): "--batch-size",
    ("optimization", "skip_remainder_batch"): "nothing: every stage trains on all of its examples",
    ("dataset", "grouped_shuffling"): "nothing: the learner shuffles its mega-batches itself, with --seed",
    ("dataset", "curriculum"): "nothing: the learner shuffles its mega-batches itself, with --seed",
    ("dataset", "update_epoch_batch_itr"): "nothing: the learner builds its own batches",
    ("distributed_training", "fix_batches_to_gpus"): "nothing: the learner builds its own batches",
    ("checkpoint", "patience"): "nothing: each stage keeps its best-validation epoch",
    ("checkpoint", "no_save"): "nothing: the stream resumes from its own checkpoints",
    ("checkpoint", "finetune_from_model"): "nothing: a vision stream starts from a fresh learner",
    ("ema", "store_ema"): "nothing: the learner keeps no EMA copy",
    **{("common", key): "nothing: a vision stream records its stages in stream.jsonl and on the "
       "console, and sends fairseq's logging backends nothing" for key in (
           "tensorboard_logdir", "wandb_project", "aim_repo", "azureml_logging")},
}


def refuse_fairseq_training_flags(task_cfg: Any) -> None:
    """fairseq's optimizer, LR scheduler, criterion and training flags given to a vision
    stream: its learner would train without them, so a run with ``--lr 0.5`` silently trained
    at App. B.1's rate.  Refused, never ignored."""
    from fairseq.dataclass.configs import FairseqConfig

    defaults = FairseqConfig()
    for (section_name, key), instead in FAIRSEQ_TRAINING_FLAGS.items():
        value = given(task_cfg, section_name, key)
        part = getattr(defaults, section_name)
        default = getattr(part() if isinstance(part, type) else part, key)  # a dataclass type or instance
        if isinstance(default, str) and default.startswith("${"):  # fairseq's II("section.key"): that value
            default = given(task_cfg, *default[2:-1].split(".", 1))
        if value is None or not _differs(value, default):
            continue
        what = f"--{key.replace('_', '-')} is fairseq's trainer's; a vision stream's learner does not read it"
        if instead.startswith("nothing: "):
            raise UsageError(f"{what} ({instead.removeprefix('nothing: ')}); drop it")
        raise UsageError(f"{what}: use {instead}")
    for section_name, default_name, why in (
            ("optimizer", None, "has its own optimizer (App. B.1's); use --vision-optimizer and --vision-lr"),
            ("lr_scheduler", "fixed", "trains each stage at a constant learning rate; use --vision-lr"),
            ("criterion", "cross_entropy", "has its own loss (cross-entropy); drop --criterion")):
        name = component_name(task_cfg, section_name)
        if name is not None and name != default_name:
            raise UsageError(f"--{section_name.replace('_', '-')} {name}: a vision stream's learner {why}")


def _differs(value: Any, default: Any) -> bool:
    """A config value other than fairseq's default (lists compared as lists)."""
    if isinstance(default, list):
        return list(value) != list(default)
    return value != default


def check_vision_stream_flags(task_cfg: Any, model_cfg: Any) -> None:
    """The flags of fairseq-train that a vision stream refuses before its ``VisionRun`` is made:
    another --arch, fairseq's precision flags and training flags, the LM-only stream flags."""
    name = getattr(model_cfg, "_name", None)
    require(name == "alma_vision", f"--arch {name} is not a vision learner; vision streams use "
            "--arch alma_vision (the learner is set by --vision-method, --vision-arch, --vision-width)")
    refuse_flags(task_cfg, "common", ("fp16", "bf16", "memory_efficient_fp16", "memory_efficient_bf16", "amp"),
                 "does not apply to vision streams (the learner has its own precision); use "
                 "--vision-amp fp16|bf16 instead")
    refuse_lm_only_stream_flags(task_cfg)  # first: it names the stream flag, not the scheduler it needs
    refuse_fairseq_training_flags(task_cfg)


def vision_run(task_cfg: Any, model_cfg: Any, machine_checks: bool = True) -> VisionRun:
    """The ``VisionRun`` that fairseq-train's flags describe (one-line errors name the flag).

    ``machine_checks=False`` (``alma-sweep submit``): the device is the one the run would take
    on a node with GPUs (``planned_device``), and --vision-amp is checked against it."""
    dataset = model_cfg.vision_dataset
    require(bool(dataset), f"--arch alma_vision needs --vision-dataset ({', '.join(DATASETS)})")
    require(dataset in DATASETS, f"--vision-dataset {dataset!r} is unknown; use one of {', '.join(DATASETS)}")
    data_path = None if dataset == "digits" else (model_cfg.vision_data_path or task_cfg.data)
    # both naming data, each of its own: which one trains was not said (--vision-data-path won)
    data, flag = str(task_cfg.data or ""), str(model_cfg.vision_data_path or "")
    require(not (dataset != "digits" and flag and os.path.exists(data)
                 and os.path.realpath(data) != os.path.realpath(flag)),
            f"--vision-data-path {flag} and fairseq-train's DATA {data} name different data; "
            f"give the data once (as DATA, or as --vision-data-path with DATA a placeholder)")
    where = (resolve_device if machine_checks else planned_device)
    device = where(_text(model_cfg.vision_device), bool(given(task_cfg, "common", "cpu")))
    augment = _text(model_cfg.vision_augment)
    crop_flip = augment == "crop-flip" or (augment == "auto" and dataset == "cifar10")
    require(model_cfg.epochs_per_stage >= 1, f"--epochs-per-stage must be >= 1, got {model_cfg.epochs_per_stage}")
    require(model_cfg.vision_threads >= 1, f"--vision-threads must be >= 1, got {model_cfg.vision_threads}")
    training = StageTrainConfig(
        epochs=int(model_cfg.epochs_per_stage), batch_size=int(task_cfg.batch_size or PAPER_BATCH_SIZE),
        optimizer=_optimizer(dataset, _text(model_cfg.vision_optimizer), float(model_cfg.vision_lr)),
        augment=crop_flip, amp=_text(model_cfg.vision_amp))
    learner = LearnerSpec(
        method=_text(model_cfg.vision_method), arch=_arch(_text(model_cfg.vision_arch), dataset),
        width=int(model_cfg.vision_width), members=int(model_cfg.ensemble_members),
        gating=_text(model_cfg.moe_gating), mixture_layers=parse_mixture_layers(model_cfg.moe_mixture_layers),
        growth_rate=float(model_cfg.ff_growth_rate),
        ff_new_layers=int(model_cfg.ff_new_layers), seed=int(task_cfg.seed))
    return VisionRun(
        dataset=dataset, data_path=data_path,
        plan=StreamPlan(int(model_cfg.num_megabatches), wait_from_flag(task_cfg.wait), bool(task_cfg.replay)),
        learner=learner, training=training, valid_fraction=float(model_cfg.valid_fraction),
        seed=int(task_cfg.seed), device=device, keep_stage_checkpoints=bool(model_cfg.keep_stage_checkpoints))


class VisionStreamEntry(FairseqTask):
    """What fairseq-train sees of a vision stream (module doc); not a registered task."""

    @classmethod
    def setup_task(cls, cfg: Any, **kwargs: Any) -> "VisionStreamEntry":
        if kwargs.get("from_checkpoint"):
            raise UsageError("a vision stream's checkpoints are the learner's own, not fairseq's; "
                             "read its records with alma-score --from-log RUN_DIR")
        return cls(cfg)

    def build_model(self, cfg: Any, from_checkpoint: bool = False) -> NoReturn:
        check_vision_stream_flags(self.cfg, cfg)
        run = vision_run(self.cfg, cfg)
        torch.set_num_threads(int(cfg.vision_threads))
        limit = stage_limit(run.plan.max_stages, self.cfg.max_epoch or None)
        # rank 0 takes the directory; every rank learns whether it could
        session = StreamSession.open(run.plan, self.cfg.save_dir, rank=world()[1],
                                     agree=raise_unless_all_ok, stop_after=limit)
        logger.info("vision stream: %s %s%d, B=%d, w=%s%s, %d epochs per stage on %s, up to stage %d of %d",
                    run.learner.method, run.learner.arch, run.learner.width, run.plan.num_megabatches,
                    run.plan.wait, " replay" if run.plan.replay else "", run.training.epochs, run.device,
                    limit, run.plan.max_stages)
        session.stop = StopSignal().install()
        records = run_vision_session(run, session, restart=bool(self.cfg.restart_stream))
        logger.info("vision stream: %d of %d arrivals recorded in %s", len(records),
                    run.plan.num_megabatches + 1, session.run_dir.stream_log)
        if torch.distributed.is_initialized():  # every rank ran the same stream; leave together
            torch.distributed.barrier()
            torch.distributed.destroy_process_group()
        raise SystemExit(0)  # the stream is done: nothing is left for fairseq-train to do
