"""The one place that reads across fairseq's config tree and derives fairseq settings.

fairseq hands a task or model only its own config node (``cfg.task``, ``cfg.model``).  A stream
sometimes needs another part: ``--max-epoch`` must equal the stream's stages (one fairseq epoch
is one stage), the Switch model must know the criterion (its balance loss is dropped by any
other).  OmegaConf nodes know their parent, so the whole config is reachable from any node;
this module is the only one that walks there.  Every value it sets is logged when training
starts (``alma_stream: max_epoch = 4 (one epoch per stage)``); a value the user gave is checked,
never silently replaced.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ..errors import UsageError
from ..stream.upgrade import drop_added_defaults

logger = logging.getLogger("fairseq_alma")


def fairseq_root(node: Any) -> Any:
    """The whole fairseq config that ``node`` belongs to (``node`` itself if it has no parent)."""
    root = node
    parent = getattr(root, "_get_parent", None)
    while parent is not None and parent() is not None:
        root = parent()
        parent = getattr(root, "_get_parent", None)
    return root


def section(node: Any, name: str) -> Any:
    """``cfg.<name>`` of the config ``node`` belongs to, or None outside a full fairseq config."""
    root = fairseq_root(node)
    return root.get(name) if hasattr(root, "get") else None


def model_name(node: Any) -> str | None:
    """The ``--arch`` family (``cfg.model._name``) of the config ``node`` belongs to."""
    model = section(node, "model")
    return model.get("_name") if model is not None and hasattr(model, "get") else None


def derive(node: Any, section_name: str, key: str, value: Any, reason: str) -> None:
    """Set ``cfg.<section_name>.<key> = value`` and log it with ``reason`` (module doc)."""
    target = section(node, section_name)
    if target is None or key not in target:
        return
    if target[key] != value:
        target[key] = value
    logger.info("alma_stream: %s = %s (%s)", key, value, reason)


def stream_training_settings(task_cfg: Any, stages: int, stop_after: int) -> None:
    """fairseq settings of a training ``alma_stream`` run, derived or checked (module doc).

    ``stop_after``: stages this process trains (``stream/stop.py``); the user's ``--max-epoch``
    was already checked against the stream there.
    """
    reason = "one epoch per stage" if stop_after == stages else \
        f"one epoch per stage; this process stops after stage {stop_after}"
    derive(task_cfg, "optimization", "max_epoch", stop_after, reason)
    derive(task_cfg, "checkpoint", "no_epoch_checkpoints", True,
           "checkpoint_stage{s}.pt keeps the end of every stage, checkpoint_last.pt the latest")
    if not task_cfg.get("fairseq_validation"):
        derive(task_cfg, "dataset", "disable_validation", True,
               "stream.jsonl records the validation perplexity after every arrival; no "
               "checkpoint_best.pt; --fairseq-validation turns fairseq's own validation back on")
    distributed = section(task_cfg, "distributed_training")
    if distributed is not None and (distributed.get("distributed_world_size") or 1) > 1:
        # fairseq 0.12 broadcasts a resumed checkpoint with torch.load, whose weights_only
        # default (torch >= 2.6) rejects fairseq's config objects; reading the file on every
        # rank avoids the broadcast.
        derive(task_cfg, "checkpoint", "load_checkpoint_on_all_dp_ranks", True,
               "every rank reads checkpoint_last.pt when resuming")


def given(node: Any, section_name: str, key: str) -> Any:
    """The value of ``cfg.<section_name>.<key>`` (None when absent)."""
    target = section(node, section_name)
    return target.get(key) if target is not None else None


def component_name(node: Any, section_name: str) -> str | None:
    """The registered name of ``cfg.<section_name>`` (``--optimizer``, ``--lr-scheduler``, ...),
    a config node or, for fairseq's pre-dataclass components, an ``argparse.Namespace``."""
    part = section(node, section_name)
    if isinstance(part, argparse.Namespace):
        return getattr(part, "_name", None)
    return part.get("_name") if part is not None and hasattr(part, "get") else None


def stage_lr_settings(node: Any) -> tuple[str, float] | None:
    """(``--stage-lr-schedule``, the peak ``--lr``) when the run's LR scheduler is
    ``alma_stage_linear``, else None (the records then say nothing about a meta-schedule)."""
    if component_name(node, "lr_scheduler") != "alma_stage_linear":
        return None
    scheduler = section(node, "lr_scheduler")
    schedule = scheduler.get("stage_lr_schedule") or "restart"
    lr = given(node, "optimization", "lr")
    return str(getattr(schedule, "value", schedule)), float(lr[0])


def refuse_flags(node: Any, section_name: str, keys: tuple[str, ...], why: str) -> None:
    """One-line error for the first of ``keys`` (flags of ``cfg.<section_name>``) that is set."""
    for key in keys:
        if given(node, section_name, key):
            raise UsageError(f"--{key.replace('_', '-')} {why}")


# Settings that change what a run computes, by section; everything else (paths, logging,
# workers, device, ports, --max-epoch, checkpoint cadence) may differ between a run and its
# continuation.  model/criterion/optimizer/lr_scheduler count whole.
FINGERPRINT_KEYS = {
    "common": ("seed", "fp16", "bf16", "amp", "memory_efficient_fp16", "memory_efficient_bf16"),
    "dataset": ("batch_size", "max_tokens", "batch_size_valid", "max_tokens_valid",
                "required_batch_size_multiple"),
    "optimization": ("lr", "update_freq", "clip_norm", "sentence_avg", "skip_remainder_batch"),
    "distributed_training": ("distributed_world_size",),
}
WHOLE_SECTIONS = ("model", "criterion", "optimizer", "lr_scheduler")
# task fields that are paths, run control, or copies of the sections above (II interpolations)
TASK_NOT_FINGERPRINTED = ("data", "save_dir", "max_epoch", "tensorboard_logdir", "restart_stream",
                          "fairseq_validation",
                          "seed", "batch_size", "batch_size_valid", "max_tokens",
                          "max_tokens_valid", "required_batch_size_multiple", "update_freq",
                          "distributed_world_size", "data_buffer_size", "tpu", "use_plasma_view",
                          "plasma_path")


def legacy_component_settings(section_name: str, namespace: argparse.Namespace) -> dict[str, Any]:
    """The settings of a component fairseq 0.12 still configures the pre-dataclass way
    (``--optimizer sgd``, ``adagrad``, ``adafactor``, ``adadelta``, ``adamax``, ``lamb``;
    ``--lr-scheduler manual``): the flags its class's ``add_args`` defines, and its name.

    Why: fairseq hands such a component the whole command line as one ``Namespace`` (paths,
    logging and ports included), which is neither JSON nor what the run's results depend on;
    taking all of it would make a moved ``--save-dir`` look like another run."""
    from fairseq.registry import REGISTRIES

    name = getattr(namespace, "_name", None) or getattr(namespace, section_name, None)
    component = REGISTRIES.get(section_name, {}).get("registry", {}).get(name)
    parser = argparse.ArgumentParser(add_help=False)
    if component is not None and hasattr(component, "add_args"):
        component.add_args(parser)
    keys = sorted({action.dest for action in parser._actions})
    settings = {key: getattr(namespace, key, None) for key in keys}
    return {"_name": name, **{key: list(v) if isinstance(v, tuple) else v for key, v in settings.items()}}


def run_fingerprint(node: Any) -> dict[str, Any]:
    """The settings of a fairseq-train run that change its results (see FINGERPRINT_KEYS)."""
    from omegaconf import OmegaConf

    def plain(value: Any, section_name: str = "") -> Any:
        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
        if isinstance(value, argparse.Namespace):
            return legacy_component_settings(section_name, value)
        return getattr(value, "value", value)  # ChoiceEnum members

    out: dict[str, Any] = {}
    for name, keys in FINGERPRINT_KEYS.items():
        part = section(node, name)
        if part is not None:
            out[name] = {key: plain(part.get(key)) for key in keys if key in part}
    for name in WHOLE_SECTIONS:
        part = section(node, name)
        if part is not None:
            out[name] = plain(part, name)
    task = section(node, "task")
    if task is not None:
        out["task"] = {key: plain(task.get(key)) for key in task if key not in TASK_NOT_FINGERPRINTED}
    return drop_added_defaults(out)  # as written before those settings existed
