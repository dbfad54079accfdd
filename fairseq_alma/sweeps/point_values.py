"""The values of one grid point, checked at submit by the checks its array task would run.

Why: fairseq's parser accepts values that a training run refuses only once it starts
(``--wait 5`` on a stream of 2 mega-batches, ``--capacity-factor 0``, ``--replay`` on a stream
that trains one stage, ``--max-update`` below the stream's updates...).  On the cluster every task
of an array would fail in one line after queueing; here the sweep is refused before anything is
written or submitted.  No check is copied here: this module calls the training checks
themselves, in the order a training run meets them (``fairseq_cli/train.py``):

* ``check_training_flags`` on fairseq's whole config (``fairseq_glue/train_flags.py``), with
  ``machine_checks=False``: this login node's GPUs, compilers and file system are not the
  node's that trains, so a run trains on GPUs unless the flags say ``--cpu`` (the launcher adds
  it on a CPU profile, ``launcher_flags``) and the not yet existing --save-dir is not probed;
* ``--task alma_stream`` with its data at hand: fairseq's ``tasks.setup_task`` (reads the
  stream's manifest.json and dict.txt: wait vs mega-batches, ``--wait auto``, replay budget,
  growth plan);
* the model's own config check (``validate_config`` of the Switch LMs), which fairseq runs in
  ``build_model``; the model itself is not built (``build_model`` is also where a training run
  takes its run directory);
* what ``AlmaStreamTask.build_model`` and ``StreamTraining`` check before the run directory is
  taken: the growth against the model's experts, ``check_stream_start`` (replay, --max-update,
  --eval-subset).

A vision stream (``--arch alma_vision``) gets what its entry checks before it opens the run
directory (``fairseq_glue/vision_entry.py``: the precision and LM-only flags, the dataset,
epochs, threads, optimizer, --wait against --num-megabatches, the device) and --vision-amp
against that device, as its runner checks first. Building fairseq's config of a point costs
about a second (hydra's compose of ~300 overrides) and vision grids run to hundreds of points,
so ``run_config.check_config_flags`` checks the values of the few points that hold every value
of every grid flag (``RunConfig.covering_points``), not of every point.
"""

from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from ..fairseq_glue.config import given
from .resource_profile import ResourceProfile


@contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Only warnings from logger ``name`` meanwhile: hydra's compose would print its lines for
    every grid point wherever the root logger is at DEBUG (a program that imported fairseq
    first: ``fairseq/models/wav2vec/wav2vec2_classification.py`` sets DEBUG then)."""
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


def launcher_flags(profile: ResourceProfile) -> list[str]:
    """The flags ``slurm/launch_task.sh`` appends to every task's command line that change what
    the checks see: the processes of a run, and the CPU training flags of a CPU profile."""
    flags = ["--distributed-world-size", str(profile.world_size)]
    if profile.device == "cpu":
        flags += ["--cpu", "--distributed-backend", "gloo", "--ddp-backend", "legacy_ddp"]
    return flags


def _model_checks() -> dict[str, Callable[[Any], None]]:
    """fairseq model name -> the config check its ``build_model`` runs first."""
    from ..models.switch_transformer_lm import validate_config
    from ..models.umix_switch_transformer_lm import validate_umix_config

    return {"switch_transformer_lm": validate_config,
            "umix_switch_transformer_lm": validate_umix_config}


def check_model_values(model_cfg: Any) -> tuple[int | None, int] | None:
    """Run the model's own config check; return (experts, allocated slots) per MoE block as the
    model would be built ((None, 0): a model without MoE blocks), or None when not known here."""
    from fairseq.models import ARCH_MODEL_NAME_REGISTRY, ARCH_MODEL_REGISTRY

    arch = str(model_cfg.get("_name") or "")
    check = _model_checks().get(ARCH_MODEL_NAME_REGISTRY.get(arch, arch))
    if check is not None:
        from ..models.switch_transformer_lm import switch_ffn_config

        check(model_cfg)
        ffn = switch_ffn_config(model_cfg)
        return ffn.num_experts, ffn.slots
    if arch in ARCH_MODEL_REGISTRY and not hasattr(ARCH_MODEL_REGISTRY[arch], "moe_layers"):
        return None, 0
    return None  # another plugin's MoE model: its experts are known once built


def check_stream_start_values(task: Any, moe: tuple[int | None, int] | None) -> int:
    """What a training run of the ``alma_stream`` ``task`` checks after building its model and
    before it takes the run directory (``AlmaStreamTask.build_model``, ``StreamTraining``);
    ``moe``: ``check_model_values``'s answer.  Returns the stages the run trains (all of the
    stream's, fewer with ``--max-epoch``), with no ``ALMA_STOP_AFTER_STAGE``."""
    from ..fairseq_glue.train_flags import check_stream_start
    from ..lm.growth import check_growth_schedule
    from ..stream.stop import stage_limit

    if moe is not None:
        experts, slots = moe
        task.check_growth_room(experts, slots)
        check_growth_schedule(task.cfg.grow_experts, task.cfg.grow_at_stages, task.plan.max_stages,
                              experts or 0, task.cfg.stage_init)
    limit = stage_limit(task.plan.max_stages, task.cfg.max_epoch or None, env={})
    check_stream_start(task, limit, None, bool(task.cfg.restart_stream))
    return limit


def check_vision_values(cfg: Any) -> None:
    """What a vision stream checks before it opens its run directory (``VisionStreamEntry``'s
    ``build_model``) and first thing in its runner (--vision-amp against the device), with the
    device the run takes on the node that trains it."""
    import torch

    from ..fairseq_glue.vision_entry import check_vision_stream_flags, vision_run
    from ..vision.devices import check_amp

    check_vision_stream_flags(cfg.task, cfg.model)
    run = vision_run(cfg.task, cfg.model, machine_checks=False)
    check_amp(run.training.amp, torch.device(run.device))


def training_config(argv: list[str], profile: ResourceProfile) -> Any:
    """fairseq's config of a task of ``profile`` running fairseq-train ``argv`` (with the flags
    the launcher appends), built as fairseq-train builds it; the namespace checks that come
    first are run."""
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from ..fairseq_glue.patches import undo_bf16_tpu
    from ..fairseq_glue.train_flags import check_training_namespace
    from .fairseq_train_flags import parse_training_argv

    argv = argv + launcher_flags(profile)
    _, args, _ = parse_training_argv(argv)
    undo_bf16_tpu(args, argv)
    check_training_namespace(args)
    with quiet_logger("hydra"):
        return convert_namespace_to_omegaconf(args)


def check_run_values(argv: list[str], profile: ResourceProfile) -> int | None:
    """Raise the ``AlmaError`` a task of ``profile`` running fairseq-train ``argv`` would end
    with before training (module doc).  ``argv`` must already pass the flag check
    (``fairseq_train_flags.argv_flag_problem``).  Returns the stages the run trains when its
    stream is at hand (an ``alma_stream`` task whose data exists), else None."""
    from fairseq import tasks

    from ..fairseq_glue.train_flags import check_training_flags

    cfg = training_config(argv, profile)
    check_training_flags(cfg, machine_checks=False)
    if str(given(cfg, "model", "_name") or "") == "alma_vision":
        check_vision_values(cfg)
        return None
    data = str(given(cfg, "task", "data") or "").split(os.pathsep)[0]
    stream = str(given(cfg, "task", "_name") or "") == "alma_stream"
    # the stream's manifest and dictionary, read as fairseq-train reads them; data not there
    # (yet: a --dry-run): train_submit.runs_to_submit refuses it before anything is submitted
    task = tasks.setup_task(cfg.task) if stream and data and os.path.exists(data) else None
    moe = check_model_values(cfg.model)
    return check_stream_start_values(task, moe) if task is not None else None
