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


def check_precision(node: Any) -> None:
    """Precision flags this run cannot train correctly, refused before the first update.

    ``--bf16``/``--memory-efficient-bf16`` train on CUDA GPUs (fairseq's trainer: model in bf16,
    fp32 master weights in ``FP16Optimizer``, no loss scaler; the plugin undoes the TPU mode
    fairseq 0.12's option parser attaches to the flag, ``fairseq_glue/patches.install_training_flags``).
    Not on CPU, where fairseq would run bf16 kernels no test covers, nor under fairscale's FSDP,
    which fairseq 0.12 refuses later with a traceback; ``--tpu`` needs torch_xla."""
    import torch

    if given(node, "common", "tpu"):  # explicit --tpu (fairseq-train's --bf16 no longer sets it)
        raise UsageError("--tpu (fairseq's TPU mode) needs torch_xla, which fairseq-alma does not "
                         "support; train on GPUs (--bf16 or --fp16, without --tpu) or on CPU (--cpu)")
    flag = next((f"--{key.replace('_', '-')}" for key in ("memory_efficient_bf16", "bf16")
                 if given(node, "common", key)), None)
    if flag is None:
        return
    if given(node, "common", "cpu") or not torch.cuda.is_available():
        raise UsageError(f"{flag} trains on CUDA GPUs only (model in bf16, fp32 master weights); "
                         f"on CPU train in fp32 (drop {flag})")
    if str(given(node, "distributed_training", "ddp_backend") or "") == "fully_sharded":
        raise UsageError(f"{flag} with --ddp-backend fully_sharded: fairseq 0.12's FSDP does not "
                         f"support bf16; use {flag} with --ddp-backend pytorch_ddp (or legacy_ddp)")


def check_training_flags(cfg: Any) -> None:
    """Flags a training run cannot honour, checked once on fairseq-train's whole config right
    after fairseq parsed it and before anything runs (``fairseq_glue/patches.install_training_flags``).

    Why there and not where the model or task is built: both are built again from a
    checkpoint's own config when it is scored, and a checkpoint trained with ``--bf16`` or
    FSDP on a GPU must still score on a CPU."""
    import torch

    from .train_flags import check_lm_training, check_run_inputs

    check_run_inputs(cfg)
    model = cfg.get("model") if hasattr(cfg, "get") else None
    arch = str(model.get("_name") or "") if model is not None and hasattr(model, "get") else ""
    if arch == "alma_vision":  # the vision learner checks its own flags (fairseq_glue/vision_entry.py)
        return
    check_precision(cfg)
    task = cfg.get("task")
    if task is not None and task.get("_name") == "alma_stream" and \
            str(given(cfg, "distributed_training", "ddp_backend") or "") == "fully_sharded":
        raise UsageError("--ddp-backend fully_sharded cannot train an alma_stream run: the stream evaluates, "
                         "counts and grows the model after every arrival outside fairscale's sharded, "
                         "flattened parameters (on an H100 it failed at the first evaluation); use "
                         "--ddp-backend pytorch_ddp or legacy_ddp, with --zero-sharding os to shard the "
                         "optimizer state")
    check_sharding(cfg, growth=bool(task is not None and str(task.get("grow_experts") or "").strip()))
    kernel = str(model.get("moe_expert_kernel") or "auto") if model is not None else "auto"
    if kernel == "segments" and torch.cuda.is_available() and not given(cfg, "common", "cpu"):
        raise UsageError("--moe-expert-kernel segments is the CPU kernel (it reads every block's expert "
                         "loads back to the host); on a GPU use --moe-expert-kernel batched or auto")
    check_lm_training(cfg)


def check_sharding(node: Any, growth: bool) -> None:
    """fairscale's sharding options that an LM stream cannot run correctly, refused before the
    first update (fairseq itself would fail later, with a traceback, or not at all)."""
    zero = str(given(node, "distributed_training", "zero_sharding") or "none")
    backend = str(given(node, "distributed_training", "ddp_backend") or "")
    fp16_flat = given(node, "common", "fp16") and not given(node, "common", "memory_efficient_fp16") \
        and not given(node, "common", "fp16_no_flatten_grads")
    if zero == "os" and fp16_flat:
        raise UsageError("--zero-sharding os cannot shard --fp16's flat fp32 copy: add "
                         "--fp16-no-flatten-grads, or use --memory-efficient-fp16")
    if backend == "fully_sharded":
        import torch

        if not torch.cuda.is_available() or given(node, "common", "cpu"):
            raise UsageError("--ddp-backend fully_sharded needs CUDA (fairscale's FSDP); use "
                             "--ddp-backend legacy_ddp (and --zero-sharding os) on CPU")
        if (given(node, "distributed_training", "distributed_world_size") or 1) <= 1:
            raise UsageError("--ddp-backend fully_sharded on one GPU: fairscale 0.4.13 cannot save "
                             "the optimizer state of a one-process FSDP run (it fails at the first "
                             "checkpoint, seen on an H100); one GPU needs no sharding: use "
                             "--ddp-backend pytorch_ddp, with --memory-efficient-fp16 or "
                             "--checkpoint-activations to cut memory")
        if growth:
            raise UsageError("--grow-experts cannot grow experts inside FSDP's flattened, sharded "
                             "parameters; use --ddp-backend legacy_ddp or pytorch_ddp with "
                             "--zero-sharding os")


def given(node: Any, section_name: str, key: str) -> Any:
    """The value of ``cfg.<section_name>.<key>`` (None when absent)."""
    target = section(node, section_name)
    return target.get(key) if target is not None else None


def stage_lr_settings(node: Any) -> tuple[str, float] | None:
    """(``--stage-lr-schedule``, the peak ``--lr``) when the run's LR scheduler is
    ``alma_stage_linear``, else None (the records then say nothing about a meta-schedule)."""
    scheduler = section(node, "lr_scheduler")
    if scheduler is None or scheduler.get("_name") != "alma_stage_linear":
        return None
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


def run_fingerprint(node: Any) -> dict[str, Any]:
    """The settings of a fairseq-train run that change its results (see FINGERPRINT_KEYS)."""
    from omegaconf import OmegaConf

    def plain(value: Any) -> Any:
        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
        return getattr(value, "value", value)  # ChoiceEnum members

    out: dict[str, Any] = {}
    for name, keys in FINGERPRINT_KEYS.items():
        part = section(node, name)
        if part is not None:
            out[name] = {key: plain(part.get(key)) for key in keys if key in part}
    for name in WHOLE_SECTIONS:
        part = section(node, name)
        if part is not None:
            out[name] = plain(part)
    task = section(node, "task")
    if task is not None:
        out["task"] = {key: plain(task.get(key)) for key in task if key not in TASK_NOT_FINGERPRINTED}
    return drop_added_defaults(out)  # as written before those settings existed
