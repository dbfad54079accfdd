"""fairseq-train's flags that fairseq itself never checks or that this plugin cannot train
correctly, refused in one line before anything runs: ``check_training_flags`` runs once on
fairseq-train's whole config right after fairseq parsed it (``patches.install_training_flags``);
the stream training calls ``check_stream_start`` before it takes the run directory.
``alma-sweep submit`` runs the same checks on every grid point (``sweeps/point_values.py``) with
``machine_checks=False``: there, on a login node, this machine's GPUs, compilers and file system
say nothing about the node a run will train on.

Why: fairseq turns these into a traceback minutes in (a ZeroDivisionError for
``--tokens-per-sample 0``), into a late failure after a stage was trained (blocks longer than
``--max-target-positions`` are dropped, and the first evaluation finds no tokens), or into a run
that silently does something else (``--batch-size 0`` trains with fairseq's default batching,
``--moe-expert-parallel-size 2`` in one process trains without expert parallelism, a
``--max-update`` below the stream's updates ends it after the first stage with exit 0).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ..errors import REQUEUE_EXIT_STATUS, CheckpointError, UsageError
from ..out_paths import check_dir_path, check_file_path, check_writable
from .config import component_name, fairseq_root, given, run_fingerprint, section

# flag -> (section, key): sizes that must be >= 1 when given (None: fairseq's default)
SIZES = {
    "--batch-size": ("dataset", "batch_size"),
    "--batch-size-valid": ("dataset", "batch_size_valid"),
    "--max-tokens": ("dataset", "max_tokens"),
    "--max-tokens-valid": ("dataset", "max_tokens_valid"),
    "--required-batch-size-multiple": ("dataset", "required_batch_size_multiple"),
}
FP16_FLAGS = ("memory_efficient_fp16", "amp", "fp16")  # fairseq sets fp16 with the first


def on_cuda(node: Any, machine_checks: bool = True) -> bool:
    """Whether the run trains on CUDA GPUs: never with ``--cpu``; otherwise where torch sees a
    GPU, or, without ``machine_checks`` (``alma-sweep submit`` on a login node), wherever the
    flags ask: a sweep on a CPU profile gets ``--cpu`` from ``slurm/launch_task.sh``, so a run
    without it trains on the GPUs of its profile."""
    if given(node, "common", "cpu"):
        return False
    if not machine_checks:
        return True
    import torch

    return torch.cuda.is_available()


def check_run_inputs(cfg: Any, machine_checks: bool = True) -> None:
    """Every stream (LM or vision): ``--save-dir`` can be a directory, a batch size is given,
    batch sizes and ``--update-freq`` are >= 1.  Without ``machine_checks`` the save dir is not probed: at
    submit it does not exist yet, and the probe would write."""
    save_dir = given(cfg, "checkpoint", "save_dir")
    if save_dir is not None and not str(save_dir).strip():  # fairseq's makedirs("") traceback
        raise UsageError("--save-dir: an empty path; give the run's directory")
    if save_dir and machine_checks:
        check_dir_path(save_dir, "--save-dir")
        check_writable(save_dir, f"--save-dir {save_dir}")  # fairseq's own probe is a traceback
    log_file = given(cfg, "common", "log_file")
    if log_file is not None and machine_checks:  # fairseq opens it at its start: a traceback
        check_log_file(str(log_file))
    seed = given(cfg, "common", "seed")
    if seed is not None and not 0 <= seed < 2**32:
        # numpy's seeding in fairseq's data loading would end in a ValueError traceback
        raise UsageError(f"--seed must be in [0, {2**32 - 1}] (got {seed})")
    model = cfg.get("model") if hasattr(cfg, "get") else None
    for key, value in (model.items() if model is not None and hasattr(model, "items") else []):
        if str(key).endswith("dropout") and isinstance(value, (int, float)) and \
                not isinstance(value, bool) and not 0 <= value <= 1:
            # torch would end in a ValueError traceback at the first forward
            raise UsageError(f"--{str(key).replace('_', '-')} must be in [0, 1] (a probability); "
                             f"got {value}")
    check_process_start(cfg, machine_checks)
    if given(cfg, "dataset", "batch_size") is None and given(cfg, "dataset", "max_tokens") is None:
        # fairseq_cli/train.py would end in an AssertionError traceback
        raise UsageError("--batch-size N or --max-tokens N is required: the sequences (or tokens) "
                         "of one batch of each process, e.g. --batch-size 8 (the paper's LMs: 8 per "
                         "GPU; its vision streams: 128)")
    for flag, (section_name, key) in SIZES.items():
        value = given(cfg, section_name, key)
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1 (got {value}); leave it out for fairseq's default")
    workers = given(cfg, "dataset", "num_workers")
    if workers is not None and workers < 0:  # torch's DataLoader: a ValueError traceback
        raise UsageError(f"--num-workers must be >= 0 (got {workers}): loader processes per training "
                         f"process, 0 to load in the training process")
    max_update = given(cfg, "optimization", "max_update")
    if max_update is not None and max_update < 0:  # fairseq stops once num_updates >= it: at once
        raise UsageError(f"--max-update must be >= 0 (got {max_update}): the update to stop at, "
                         "0 for no limit")
    max_epoch = given(cfg, "optimization", "max_epoch")
    if max_epoch is not None and max_epoch < 0:
        raise UsageError(f"--max-epoch must be >= 0 (got {max_epoch}): in a stream, stop after "
                         "stage N; 0 or left out trains every stage")
    for value in given(cfg, "optimization", "update_freq") or []:
        if value < 1:
            raise UsageError(f"--update-freq must be >= 1 (got {value}): batches accumulated per "
                             "update, e.g. --update-freq 4")
    for flag, (section_name, key) in INTERVALS.items():
        value = given(cfg, section_name, key)
        if value is not None and value < 1:
            # fairseq takes each modulo its interval: a ZeroDivisionError traceback at the first one
            raise UsageError(f"{flag} must be >= 1 (got {value}); leave it out for fairseq's default")
    check_finite(cfg)


# flag -> (section, key): fairseq's every-N cadences (it computes ``n % N``)
INTERVALS = {
    "--log-interval": ("common", "log_interval"),
    "--validate-interval": ("dataset", "validate_interval"),
    "--save-interval": ("checkpoint", "save_interval"),
}


def check_finite(cfg: Any) -> None:
    """Every number of the config is finite: fairseq parses ``nan`` and ``inf`` for any float
    flag (``--clip-norm nan``, ``--capacity-factor inf``), and no such setting trains a run
    whose records can be written or compared (run.json and stream.jsonl hold strict JSON)."""
    import math
    from argparse import Namespace

    sections = cfg.items() if hasattr(cfg, "items") else []
    for _, part in sections:
        if isinstance(part, Namespace):  # a pre-dataclass component (--optimizer sgd, ...)
            items = vars(part).items()
        else:
            items = part.items() if hasattr(part, "items") else []
        for key, value in items:
            many = isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig"
            values = value if many else [value]
            for item in values:
                if isinstance(item, float) and not math.isfinite(item):
                    raise UsageError(f"--{str(key).replace('_', '-')} {item}: every number a run is "
                                     "given must be finite; give a finite value")


TORCH_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


def check_process_start(cfg: Any, machine_checks: bool = True) -> None:
    """``--distributed-world-size N`` with nothing that says where the other processes come
    from: fairseq then starts one process per GPU of this machine
    (``distributed_utils.infer_init_method``), and with fewer GPUs than N it ends in an
    AssertionError traceback. Not asked at submit (``machine_checks=False``): the launcher
    gives every task its init method."""
    world = given(cfg, "distributed_training", "distributed_world_size") or 1
    port = given(cfg, "distributed_training", "distributed_port") or 0
    if (not machine_checks or world <= 1 or given(cfg, "distributed_training", "distributed_init_method")
            or given(cfg, "common", "tpu") or port > 0
            or all(name in os.environ for name in TORCH_LAUNCH_VARIABLES)):
        return
    import torch

    gpus = torch.cuda.device_count()
    if world > gpus:
        how = ("on CPU, start one process per rank with --distributed-init-method tcp://HOST:PORT "
               "and --distributed-rank R (or torchrun, or alma-sweep on Slurm)") if gpus == 0 else \
            f"use at most {gpus}, or start the processes with torchrun or alma-sweep on Slurm"
        raise UsageError(f"--distributed-world-size {world}: fairseq would start one process per GPU "
                         f"of this machine, which has {gpus}; {how}")


def check_lm_training(cfg: Any, machine_checks: bool = True) -> None:
    """A language-model run: block length, precision on its device (``on_cuda``), the processes
    that the distributed options need."""
    tokens = given(cfg, "task", "tokens_per_sample")
    if tokens is not None:
        if tokens < 1:
            raise UsageError(f"--tokens-per-sample must be >= 1 (got {tokens}): the block length "
                             "trained on, e.g. --tokens-per-sample 1024")
        positions = given(cfg, "model", "max_target_positions")
        if positions is not None and tokens > positions:
            raise UsageError(f"--tokens-per-sample {tokens} is longer than the model takes "
                             f"(--max-target-positions {positions}); lower it or raise "
                             "--max-target-positions")
        for key, sentences in (("max_tokens", "--batch-size"), ("max_tokens_valid", "--batch-size-valid")):
            max_tokens = given(cfg, "dataset", key)  # the valid one: the stage-end evaluation
            if max_tokens is not None and max_tokens < tokens:
                flag = f"--{key.replace('_', '-')}"
                raise UsageError(f"{flag} {max_tokens} holds no block of --tokens-per-sample "
                                 f"{tokens}; use {flag} >= {tokens} or {sentences}")
    flag = next((f"--{key.replace('_', '-')}" for key in FP16_FLAGS if given(cfg, "common", key)), None)
    if flag is not None and not on_cuda(cfg, machine_checks):
        raise UsageError(f"{flag} trains on CUDA GPUs only (half precision with loss scaling); "
                         f"on CPU train in fp32 (drop {flag})")
    world = int(given(cfg, "distributed_training", "distributed_world_size") or 1)
    if str(given(cfg, "distributed_training", "zero_sharding") or "none") == "os" and world <= 1:
        raise UsageError(f"--zero-sharding os shards the optimizer state over the processes of a "
                         f"run; this one has {world}: drop it, or train on several processes")
    size = given(cfg, "model", "moe_expert_parallel_size")
    if size is not None:
        from ..modules.expert_parallel import check_expert_parallel_size

        check_expert_parallel_size(int(given(cfg, "model", "moe_experts") or 1), int(size))
        if world % int(size):
            raise UsageError(f"--moe-expert-parallel-size {size} must divide the number of "
                             f"processes ({world}): each group of {size} ranks shares out the "
                             "experts; use --moe-expert-parallel-size 1 in one process")


def check_stream_start(task: Any, stages: int, save_dir: str | None, restart: bool) -> None:
    """What only the stream knows, before the run directory is taken: ``--replay`` has an
    earlier stage to replay (a one-stage run would be labelled replay yet train as without it;
    checked here, on the LM training path, not in ``StreamPlan``, which scoring and vision sweeps
    also build), ``--max-update`` leaves
    the stream's updates, the evaluation split exists, every split's blocks fit the model
    (``lm/block_lengths``), and a ``checkpoint_last.pt`` left without
    ``run.json`` is of this model (fairseq would fail to load it after run.json was written);
    ``save_dir`` None: no run directory yet (``alma-sweep submit``), nothing left in it."""
    plan = task.plan
    if plan.replay and not plan.adaptive and plan.num_stages < 2:  # as --replay-ratio (StreamPlan)
        raise UsageError(f"--replay has nothing to replay: with --wait {plan.wait} the stream of "
                         f"{plan.num_megabatches} mega-batches trains one stage, and a stage replays "
                         f"only earlier stages' data; drop --replay, or lower --wait")
    needed = stages * task.budget
    max_update = given(task.cfg, "optimization", "max_update") or 0
    if 0 < max_update < needed:
        raise UsageError(f"--max-update {max_update} stops the stream before its end ({stages} "
                         f"stages x {task.budget} updates = {needed}); leave --max-update out "
                         "(--updates-per-stage sets the budget; --max-epoch N stops after stage N)")
    check_whole_run_schedule(task.cfg, stages, task.budget)
    if component_name(task.cfg, "lr_scheduler") == "alma_stage_linear":
        from ..optim.alma_stage_linear import check_stage_schedule

        warmup, lr = given(task.cfg, "lr_scheduler", "warmup_updates"), given(task.cfg, "optimization", "lr")
        if warmup is not None and lr is not None:
            check_stage_schedule(list(lr), int(warmup), task.budget)
    data = str(task.cfg.data).split(os.pathsep)[0]
    subset = task.cfg.eval_subset
    missing = [f"{subset}{ext}" for ext in (".bin", ".idx") if not os.path.exists(os.path.join(data, subset + ext))]
    if missing:
        splits = sorted(name[:-4] for name in os.listdir(data)
                        if name.endswith(".idx") and not name.startswith("megabatch"))
        raise UsageError(f"--eval-subset {subset}: {' and '.join(missing)} missing in {data}; use "
                         f"one of its splits ({', '.join(splits)})")
    from ..lm.block_lengths import check_stream_blocks
    from ..stream.manifest import expected_splits

    splits = expected_splits(int(task.manifest["num_megabatches"]),
                             task.manifest.get("eval_per_megabatch") is not None)
    check_stream_blocks(task.cfg, data, splits, _model_positions(task))
    if task.model is not None:  # the FLOPs count takes this model (refused here, not at arrival 0)
        from ..lm.model_flops import model_shape

        model_shape(task.model, int(task.cfg.tokens_per_sample))
    if save_dir is not None and not restart:
        check_leftover_checkpoint(save_dir, task.cfg, int(task.manifest["num_megabatches"]))


# fairseq's LR schedulers that span the whole run (its length: --max-update, or for cosine
# --lr-period-updates, for tri_stage its step counts, for polynomial_decay --total-num-update)
WHOLE_RUN_SCHEDULERS = ("cosine", "tri_stage", "polynomial_decay")


def check_whole_run_schedule(node: Any, stages: int, budget: int) -> None:
    """One of fairseq's schedules over the whole run (``--lr-scheduler cosine``, ``tri_stage``
    with ``--phase-ratio``, ``polynomial_decay``) spans the stream's updates.

    Why: they take the run's length from ``--max-update``, which a stream leaves at 0 (each
    stage stops after its budget): ``cosine`` and ``tri_stage`` ended in an AssertionError
    traceback after the run directory was taken; ``polynomial_decay`` with a
    ``--total-num-update`` shorter than the stream trained every later update at
    ``--end-learning-rate`` (0 by default: stages that change nothing, recorded as trained)."""
    name = component_name(node, "lr_scheduler")
    if name not in WHOLE_RUN_SCHEDULERS:
        return
    needed = stages * budget
    length = f"the stream's {stages} stages x {budget} updates = {needed}"
    if name == "polynomial_decay":
        total = float(given(node, "lr_scheduler", "total_num_update") or 0)
        end = float(given(node, "lr_scheduler", "end_learning_rate") or 0)
        if total < needed and end == 0:
            raise UsageError(f"--total-num-update {total:g} ends --lr-scheduler polynomial_decay before "
                             f"the stream does ({length}): the later updates would train at "
                             f"--end-learning-rate 0; use --total-num-update {needed}")
        return
    if name == "cosine" and float(given(node, "lr_scheduler", "lr_period_updates") or -1) > 0:
        return
    if name == "tri_stage" and given(node, "lr_scheduler", "phase_ratio") is None:
        return  # --warmup-steps, --hold-steps and --decay-steps: its length is given
    if not (given(node, "optimization", "max_update") or 0):
        raise UsageError(f"--lr-scheduler {name} spans the run's --max-update, which an alma_stream "
                         f"run leaves unset (every stage stops after its --updates-per-stage): add "
                         f"--max-update {needed} ({length}), or use --lr-scheduler alma_stage_linear "
                         f"(the paper's schedule, restarted in every stage)")


def check_training_namespace(args: Any) -> None:
    """What fairseq-train's parsed flags cannot become a config for: a ``nan`` or ``inf`` given
    to a component's float flag (``--total-num-update nan``, ``--adam-eps inf``: fairseq's
    conversion passes it through ``ast.literal_eval``, a ValueError traceback; the config's
    own sections are checked by ``check_finite``, with the same line), and ``--lr-scheduler
    polynomial_decay`` without ``--total-num-update`` (fairseq 0.12 takes its default from
    ``--max-update`` as a null float and fails in hydra with a page of overrides)."""
    import dataclasses
    import math

    from fairseq.registry import REGISTRIES

    numeric = set()  # components' number flags; one whose default interpolates another is a string here
    for name, registry in REGISTRIES.items():
        component = registry["dataclass_registry"].get(getattr(args, name, None) or "")
        if component is not None:
            numeric |= {f.name for f in dataclasses.fields(component) if f.type in (int, float, "int", "float")}
    for key, value in sorted(vars(args).items()):
        text = value.strip().lower().lstrip("+-") if isinstance(value, str) and key in numeric else None
        if (isinstance(value, float) and not math.isfinite(value)) or text in ("nan", "inf", "infinity"):
            raise UsageError(f"--{key.replace('_', '-')} {value}: every number a run is given must "
                             "be finite; give a finite value")
    if getattr(args, "lr_scheduler", None) == "polynomial_decay" and \
            getattr(args, "total_num_update", None) is None:
        raise UsageError("--lr-scheduler polynomial_decay needs --total-num-update N, the updates its "
                         "decay spans (fairseq 0.12 cannot take it from --max-update); for an "
                         "alma_stream run: its stages x --updates-per-stage")


def _model_positions(task: Any) -> int:
    """The longest sequence the model takes: its ``max_positions()`` once built, else
    ``--max-target-positions`` (default ``--tokens-per-sample``); and the task's own limit."""
    cfg = task.cfg
    positions = task.model.max_positions() if task.model is not None else \
        given(cfg, "model", "max_target_positions") or cfg.tokens_per_sample
    limit = getattr(cfg, "max_target_positions", None)
    return int(min(positions, limit) if limit else positions)


def check_leftover_checkpoint(save_dir: str, node: Any, num_megabatches: int | None = None) -> None:
    """Checkpoints in a --save-dir without ``run.json``: a run of fairseq-alma 0.1 (its records
    in ``stream.jsonl`` beside them) of these settings is continued; anything else is refused
    before the first update.  It was all continued as "a run of 0.1": a stock ``fairseq-train``
    checkpoint (fairseq saves to ``checkpoints/`` by default, as the stream does) became
    arrival 0 and its update counter cut stage 1 short, while the records counted the whole
    stage; another seed's or learning rate's ``checkpoint_last.pt`` copied in was continued
    under this run's name; another run's stage checkpoint was kept as this run's.
    ``num_megabatches``: the stream's B, which reads a growth plan spelled either way
    (``--grow-experts 2`` or ``2,2``) as one."""
    from pathlib import Path

    from ..checkpoint_load import load_checkpoint
    from ..stream.run_dir import LAST_CHECKPOINT, RUN_FILE, STREAM_LOG

    run_dir = Path(save_dir)
    if (run_dir / RUN_FILE).exists():
        return
    last = run_dir / LAST_CHECKPOINT
    held = ([last] if last.is_file() else []) + sorted(run_dir.glob("checkpoint_stage*.pt"))
    if not held:
        return
    advice = "move it aside or use another --save-dir, or add --restart-stream"
    if last.is_file():
        state = load_checkpoint(last, mmap=True)
        cfg = state.get("cfg") if isinstance(state, dict) else None
        old = _plain(cfg) if cfg is not None else None
        if not isinstance(old, dict):  # a vision stream's learner, or no fairseq checkpoint
            raise CheckpointError(f"{last} holds no fairseq config: not a language-model stream's "
                                  f"checkpoint (a vision stream's?); {advice}")
        task = (old.get("task") or {}).get("_name")
        if task != "alma_stream":
            raise CheckpointError(f"{last} is a checkpoint of a --task {task} run, not of a "
                                  f"stream; {advice}")
        changed = _settings_changed(old, fairseq_root(node), num_megabatches)
        if changed:
            what = "another model" if changed[0].startswith("model.") else "a run with other settings"
            raise CheckpointError(f"{last} holds {what} ({'; '.join(changed[:3])}); {advice}")
    if not (run_dir / STREAM_LOG).is_file():
        raise CheckpointError(f"{held[0]} has neither run.json nor {STREAM_LOG} beside it, so it is "
                              f"no stream run this command can continue (another run's, or a copied "
                              f"file); {advice}")


def _settings_changed(old: dict, new: Any, num_megabatches: int | None) -> list[str]:
    """``key: old -> new`` for the settings that change results (``run_fingerprint``) of a
    checkpoint's config ``old`` (plain values; fairseq's legacy components, ``--optimizer sgd``,
    as argparse Namespaces) against the command's config ``new``, compared as ``run.json``
    fingerprints are (``same_run``: execution settings left out, one growth plan spelled one
    way); settings one side does not know (added or removed since it was written) are not."""
    from ..stream.fingerprint_forms import comparable_form
    from ..stream.growth_plan import with_parsed_growth_plan
    from ..stream.run_dir import fingerprint_differences, without_execution_settings

    prints = [comparable_form(with_parsed_growth_plan(without_execution_settings(
        {"config": run_fingerprint(side)}), num_megabatches))["config"] for side in (old, new)]
    both = [{name: {key: part[key] for key in part if key in other.get(name, {})}
             for name, part in mine.items() if isinstance(part, dict) and isinstance(other.get(name), dict)}
            for mine, other in (prints, prints[::-1])]
    changed = fingerprint_differences(both[0], both[1])
    # the model first: what the message calls "another model"
    return sorted(changed, key=lambda item: not item.startswith("model."))


def _plain(value: Any) -> Any:
    """A checkpoint's config as plain values (enum members as their strings)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return getattr(value, "value", value)


def check_loss_scaling(node: Any) -> None:
    """fairseq's loss-scaler settings (``--fp16``, ``--amp``) that cannot train: an initial scale
    of 0 or below (the first update's gradients are 0 x 1/0, "overflow", and the scale never
    rises from 0: fairseq stops with "Minimum loss scale reached", reported as divergence), a
    scale window below 1 (``n % 0``: a ZeroDivisionError traceback at the first update), an
    overflow tolerance outside [0, 1]."""
    for key in ("fp16_init_scale", "amp_init_scale"):
        value = given(node, "common", key)
        if value is not None and not value > 0:
            raise UsageError(f"--{key.replace('_', '-')} must be > 0 (got {value:g}): the loss scale of "
                             f"the first update, e.g. --{key.replace('_', '-')} 128")
    for key in ("fp16_scale_window", "amp_scale_window"):
        value = given(node, "common", key)
        if value is not None and value < 1:
            raise UsageError(f"--{key.replace('_', '-')} must be >= 1 (got {value}): updates without "
                             f"overflow before the loss scale doubles; leave it out for fairseq's default")
    tolerance = given(node, "common", "fp16_scale_tolerance")
    if tolerance is not None and not 0 <= tolerance <= 1:
        raise UsageError(f"--fp16-scale-tolerance must be in [0, 1] (got {tolerance:g}): the share of "
                         f"overflowing updates tolerated before the scale is lowered")


def check_precision(node: Any, machine_checks: bool = True) -> None:
    """Precision flags this run cannot train correctly, refused before the first update.

    ``--bf16``/``--memory-efficient-bf16`` train on CUDA GPUs (fairseq's trainer: model in bf16,
    fp32 master weights in ``FP16Optimizer``, no loss scaler; the plugin undoes the TPU mode
    fairseq 0.12's option parser attaches to the flag, ``fairseq_glue/patches.install_training_flags``).
    Not on CPU, where fairseq would run bf16 kernels no test covers, nor under fairscale's FSDP,
    which fairseq 0.12 refuses later with a traceback; ``--tpu`` needs torch_xla."""
    if given(node, "common", "tpu"):  # explicit --tpu (fairseq-train's --bf16 no longer sets it)
        raise UsageError("--tpu (fairseq's TPU mode) needs torch_xla, which fairseq-alma does not "
                         "support; train on GPUs (--bf16 or --fp16, without --tpu) or on CPU (--cpu)")
    check_precision_combinations(node)
    flag = next((f"--{key.replace('_', '-')}" for key in ("memory_efficient_bf16", "bf16")
                 if given(node, "common", key)), None)
    if flag is None:
        return
    if not on_cuda(node, machine_checks):
        raise UsageError(f"{flag} trains on CUDA GPUs only (model in bf16, fp32 master weights); "
                         f"on CPU train in fp32 (drop {flag})")
    if str(given(node, "distributed_training", "ddp_backend") or "") == "fully_sharded":
        raise UsageError(f"{flag} with --ddp-backend fully_sharded: fairseq 0.12's FSDP does not "
                         f"support bf16; use {flag} with --ddp-backend pytorch_ddp (or legacy_ddp)")


def check_precision_combinations(node: Any) -> None:
    """Precision flags that fairseq's trainer or optimizer wrapper refuse only once they are
    built, after the run directory was taken, with a traceback: ``--fp16`` with ``--amp``; an
    ``--update-freq`` per stage without ``--fp16-scale-window`` under fairseq's FP16Optimizer
    (its default window divides by one ``--update-freq``); ``--fp16``'s flat master copy with an
    optimizer that keeps no flat state (Adagrad, Adafactor); ``--memory-efficient-*`` with an
    optimizer it cannot wrap (SGD, Adagrad).  Checked whatever the device, so a CPU machine
    (where these flags are refused anyway) tests what a GPU node would meet."""
    half = next((f"--{key.replace('_', '-')}" for key in HALF_PRECISION_FLAGS
                 if given(node, "common", key)), None)
    if half is None:
        return
    if given(node, "common", "amp") and half != "--amp" and "bf16" not in half:
        raise UsageError(f"{half} with --amp: fairseq trains one of them (--amp: an fp32 model under "
                         f"autocast; {half}: a half-precision model); drop one")
    if half == "--amp":
        return
    bf16 = "bf16" in half
    freqs = given(node, "optimization", "update_freq") or []
    if len(list(freqs)) > 1 and given(node, "common", "fp16_scale_window") is None:
        raise UsageError(f"{half} with an --update-freq per stage needs --fp16-scale-window N: fairseq's "
                         f"default window divides by one --update-freq and refuses a list"
                         + (" (bf16 has no loss scaler, so any N will do)" if bf16 else
                            " (e.g. 16384 / processes / the largest --update-freq)"))
    optimizer = component_name(node, "optimizer")
    supports = _optimizer_support(node)
    if supports is None:
        return
    flat, memory_efficient = supports
    if half.startswith("--memory-efficient") and not memory_efficient:
        plain = half.replace("--memory-efficient-", "--")
        raise UsageError(f"{half} cannot wrap --optimizer {optimizer} (fairseq's memory-efficient "
                         f"wrapper steps only Adam, Adamax and Adafactor); use {plain}, or "
                         f"--optimizer adam")
    if half == "--fp16" and not flat and not given(node, "common", "fp16_no_flatten_grads"):
        raise UsageError(f"--fp16 keeps one flat fp32 master copy, which --optimizer {optimizer} cannot "
                         f"step; add --fp16-no-flatten-grads (a master copy per parameter)")


# half precision under fairseq's FP16Optimizer / MemoryEfficientFP16Optimizer, or AMP; the
# memory-efficient flags first: fairseq sets --fp16 (--bf16) with them
HALF_PRECISION_FLAGS = ("memory_efficient_fp16", "memory_efficient_bf16", "fp16", "bf16", "amp")


def _optimizer_support(node: Any) -> tuple[bool, bool] | None:
    """(flat master params, memory-efficient fp16) of ``--optimizer``, from fairseq's own
    wrapper of it built over one dummy parameter; None where it cannot be built here (apex's
    or DeepSpeed's optimizers: their own checks speak)."""
    import torch
    from fairseq import optim

    part = section(node, "optimizer")
    if part is None:
        return None
    try:
        built = optim.build_optimizer(part, [torch.nn.Parameter(torch.zeros(1))])
    except Exception:  # noqa: BLE001 - a missing extension or an unusual optimizer: not ours to judge
        return None
    return bool(built.supports_flat_params), bool(built.supports_memory_efficient_fp16)


def check_log_file(log_file: str) -> None:
    """``--log-file``: a file fairseq can append to.  fairseq opens it with a bare
    ``logging.FileHandler``, which creates no folder: a missing folder, a directory or a
    read-only place ended in an ``OSError`` traceback."""
    check_file_path(log_file, "--log-file")
    folder = os.path.dirname(os.path.abspath(log_file))
    if not os.path.isdir(folder):
        raise UsageError(f"--log-file {log_file}: its folder {folder} does not exist (fairseq "
                         f"creates none); create it, or give a path in an existing folder")
    check_writable(folder, f"--log-file {log_file}")


def check_training_flags(cfg: Any, machine_checks: bool = True) -> None:
    """Flags a training run cannot honour, checked once on fairseq-train's whole config right
    after fairseq parsed it and before anything runs (``fairseq_glue/patches.install_training_flags``).

    Why there and not where the model or task is built: both are built again from a
    checkpoint's own config when it is scored, and a checkpoint trained with ``--bf16`` or
    FSDP on a GPU must still score on a CPU.

    ``machine_checks=False`` (``alma-sweep submit``): nothing that asks this machine (its CUDA
    devices, compilers, the --save-dir probe); a run trains on GPUs unless it has ``--cpu``
    (``on_cuda``)."""
    check_run_inputs(cfg, machine_checks)
    model = cfg.get("model") if hasattr(cfg, "get") else None
    arch = str(model.get("_name") or "") if model is not None and hasattr(model, "get") else ""
    if arch == "alma_vision":  # the vision learner checks its own flags (fairseq_glue/vision_entry.py)
        return
    check_precision(cfg, machine_checks)
    check_loss_scaling(cfg)
    check_optimizer(cfg)
    if machine_checks:
        check_logging_backends(cfg)
    task = cfg.get("task")
    if task is not None and task.get("_name") == "alma_stream":
        check_stream_run_flags(cfg)
        check_dense_lm_shape(cfg)
    if task is not None and task.get("_name") == "alma_stream" and \
            str(given(cfg, "distributed_training", "ddp_backend") or "") == "fully_sharded":
        raise UsageError("--ddp-backend fully_sharded cannot train an alma_stream run: the stream evaluates, "
                         "counts and grows the model after every arrival outside fairscale's sharded, "
                         "flattened parameters (on an H100 it failed at the first evaluation); use "
                         "--ddp-backend pytorch_ddp or legacy_ddp, with --zero-sharding os to shard the "
                         "optimizer state")
    growth = bool(task is not None and str(task.get("grow_experts") or "").strip())
    check_sharding(cfg, growth=growth, machine_checks=machine_checks)
    kernel = str(model.get("moe_expert_kernel") or "auto") if model is not None else "auto"
    if kernel == "segments" and on_cuda(cfg, machine_checks):
        raise UsageError("--moe-expert-kernel segments is the CPU kernel (it reads every block's expert "
                         "loads back to the host); on a GPU use --moe-expert-kernel batched or auto")
    if kernel == "compiled" and machine_checks:  # the compiler of the node that trains
        from ..modules.switch_compiled import compiler_missing

        missing = compiler_missing("cuda" if on_cuda(cfg) else "cpu")
        if missing is not None:
            raise UsageError(f"--moe-expert-kernel compiled: {missing}; install it, or use "
                             f"--moe-expert-kernel batched (the same results, uncompiled)")
    check_lm_training(cfg, machine_checks)


# fairseq's logging flags, the module each needs and the package that installs it
LOGGING_BACKENDS = (("tensorboard_logdir", "tensorboardX", "tensorboardX"), ("wandb_project", "wandb", "wandb"),
                    ("aim_repo", "aim", "aim"), ("azureml_logging", "azureml.core", "azureml-core"))


def check_logging_backends(cfg: Any) -> None:
    """A logging flag whose package this Python lacks, refused before the run starts.

    Why: fairseq's progress bar then warns (once per stage) and logs nothing there, so a run of
    days ends without the curves its user asked for; the per-arrival tensorboard scalars
    (``lm/tensorboard.py``) need tensorboardX. Asked on the machine that trains only."""
    import importlib.util

    for key, module, package in LOGGING_BACKENDS:
        value = given(cfg, "common", key)
        if not value:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:  # the parent package (azureml) is missing
            found = False
        if not found:
            flag = f"--{key.replace('_', '-')}"
            raise UsageError(f"{flag}: {module} is not installed in this Python, so fairseq would log "
                             f"nothing there; pip install {package}, or drop {flag}")


def check_optimizer(cfg: Any) -> None:
    """A learning rate below 0 (fairseq would stop before the first update with exit 0: its
    loop ends once the LR is at most ``--stop-min-lr``, -1 by default); growth with an optimizer
    whose state is not per element (``lm/growth.py`` copies each expert's moments with its
    weights); ``--optimizer lamb`` without NVIDIA apex (fairseq's LAMB is apex's fused kernel:
    an ImportError traceback)."""
    for value in given(cfg, "optimization", "lr") or []:
        if value < 0:
            raise UsageError(f"--lr must be >= 0 (got {value:g}): the peak learning rate, e.g. "
                             "--lr 0.0005")
    clip = given(cfg, "optimization", "clip_norm")
    if clip is not None and clip < 0:  # fairseq clips only above 0: a negative norm was no clipping
        raise UsageError(f"--clip-norm must be >= 0 (got {clip:g}): the largest gradient norm, "
                         "0 for no clipping, e.g. --clip-norm 1.0")
    check_optimizer_values(cfg)
    init = given(cfg, "lr_scheduler", "warmup_init_lr")
    if component_name(cfg, "lr_scheduler") == "alma_stage_linear" and init is not None and init < 0:
        raise UsageError(f"--warmup-init-lr must be >= 0 (got {init:g}): every stage's warmup starts "
                         f"there, and a negative learning rate climbs the loss; e.g. --warmup-init-lr 0")
    task = cfg.get("task") if hasattr(cfg, "get") else None
    growth = bool(task is not None and str(task.get("grow_experts") or "").strip())
    if growth and component_name(cfg, "optimizer") == "adafactor":
        raise UsageError("--grow-experts with --optimizer adafactor: Adafactor keeps factored second "
                         "moments (a row and a column statistic per matrix; the router's mixes every "
                         "expert), so a copied expert cannot take its source's moments as growth "
                         "does; use --optimizer adam (or sgd, adagrad, adamax, adadelta)")
    if component_name(cfg, "optimizer") == "lamb":
        import importlib.util

        if importlib.util.find_spec("apex") is None:
            raise UsageError("--optimizer lamb is NVIDIA apex's fused LAMB, and apex is not installed; "
                             "install apex, or use --optimizer adam")


def _optimizer_settings(cfg: Any) -> dict[str, Any]:
    """``--optimizer``'s settings by name: a config node, or fairseq's older argparse options."""
    import argparse

    part = section(cfg, "optimizer")
    if isinstance(part, argparse.Namespace):
        return dict(vars(part))
    return {str(key): part.get(key) for key in part.keys()} if part is not None and hasattr(part, "keys") else {}


def check_optimizer_values(cfg: Any) -> None:
    """The optimizer's settings that fairseq takes without a check, refused before the first
    update: a negative ``--weight-decay`` or momentum (fairseq's Adam grows the weights instead
    of shrinking them, and trains on), an ``--adam-eps`` (``--adamax-eps``, ...) of 0 (Adam's
    update is 0/0 for a parameter whose gradient is 0, such as an unused token's embedding: NaN
    at the first update, reported as divergence), ``--adam-betas`` outside [0, 1) (a math domain
    error traceback, or moments that grow without bound)."""
    import ast

    for key, value in _optimizer_settings(cfg).items():
        flag = f"--{key.replace('_', '-')}"
        number = isinstance(value, (int, float)) and not isinstance(value, bool)  # --anneal-eps is a switch
        if key in ("weight_decay", "momentum") and number and value < 0:
            raise UsageError(f"{flag} must be >= 0 (got {value:g}); e.g. {flag} "
                             f"{'0.9' if key == 'momentum' else '0.01'}")
        if key.endswith("_eps") and number and not value > 0:
            raise UsageError(f"{flag} must be > 0 (got {value:g}): it keeps the update finite where a "
                             f"gradient is 0; e.g. {flag} 1e-8")
        if key.endswith("_betas") and value is not None:
            try:
                betas = [float(beta) for beta in (ast.literal_eval(value) if isinstance(value, str) else value)]
            except (ValueError, TypeError, SyntaxError):
                betas = []
            if len(betas) != 2 or not all(0 <= beta < 1 for beta in betas):
                raise UsageError(f"{flag} {value}: two decay rates in [0, 1) are needed, e.g. "
                                 f"{flag} '(0.9, 0.98)'")


# fairseq's resume-time resets: an alma_stream run resumes its optimizer, LR schedule, data
# position and meters exactly as checkpointed (fairseq's update counter is the stream's
# position), so a reset would train a run its records no longer describe.
RESET_FLAGS = ("reset_optimizer", "reset_lr_scheduler", "reset_dataloader", "reset_meters")


def check_dense_lm_shape(node: Any) -> None:
    """fairseq's ``transformer_lm`` options that a stream cannot count or train correctly,
    refused before anything runs (the Switch LMs have none of them).

    Why: every arrival records the model's FLOPs from one width, its blocks, and a token
    embedding table (``lm/model_flops.py``).  fairseq 0.12 keeps ``--decoder-input-dim`` and
    ``--decoder-output-dim`` at 512 (its dataclass defaults) whatever ``--decoder-embed-dim``
    says, so ``--decoder-embed-dim 32`` alone built 512-wide embeddings and output layer
    projected to and from 32-wide blocks, and the records counted 512-wide blocks (75x the
    FLOPs of that 2-layer model).  Adaptive and character inputs, the adaptive softmax and
    BASE layers ended in tracebacks; layer drop trains on fewer blocks than are counted.
    fairseq's LMs configured the older way (``lstm_lm``, ``fconv_lm``, ``lightconv_lm``: an
    argparse namespace, not a dataclass) are no transformer decoders the count knows."""
    import argparse

    if isinstance(section(node, "model"), argparse.Namespace):
        raise UsageError(f"--arch {component_name(node, 'model')}: an alma_stream run counts the FLOPs of "
                         f"transformer decoders (--arch switch_transformer_lm*, umix_switch_transformer_lm*, "
                         f"fairseq's transformer_lm*), and this model is none; use one of those")
    from ..stream.transformer_flops import width_mismatch

    mismatch = width_mismatch(section(node, "model"))
    if mismatch is not None:
        width = given(node, "model", "decoder_embed_dim")
        raise UsageError(f"{mismatch}; add --decoder-input-dim {width} --decoder-output-dim {width}")
    refused = {"adaptive_softmax_cutoff": "an adaptive softmax", "adaptive_input": "adaptive input embeddings",
               "character_embeddings": "character embeddings", "base_layers": "BASE layers (fairseq's own routing)",
               "decoder_layerdrop": "layer drop (blocks skipped at random in training)"}
    for key, what in refused.items():
        value = given(node, "model", key)
        if value:
            flag = f"--{key.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")
            raise UsageError(f"{flag}: {what}, which an alma_stream run cannot count (every arrival "
                             f"records FLOPs of full blocks over a token embedding table and a full "
                             f"softmax); drop it, or use an --arch that does not set it (transformer_lm_wiki103 "
                             f"does): transformer_lm_gpt, or switch_transformer_lm for routed experts")


def check_stream_run_flags(node: Any) -> None:
    """fairseq's checkpoint and stopping flags that an ``alma_stream`` run cannot honour,
    refused before anything is read or written.

    Why: the run directory (``--save-dir``: run.json, stream.jsonl, checkpoint_last.pt) is the
    unit of resumption.  ``--restore-file``/``--finetune-from-model`` would load another run's
    weights and stream position into this run directory under this run's settings (seen: a new
    --save-dir "done training in 0.0 seconds" holding the other run's records); ``--no-save``
    leaves no stage checkpoints to resume or score; ``--valid-subset`` would name a validation
    that the stream turns off (``config.stream_training_settings``); ``--stop-time-hours`` ends fairseq's loop
    mid-stage with exit 0 and an unfinished stream; the ``--reset-*`` flags break the resumed
    run's update count and schedule.  Nothing in fairseq_alma passes these flags itself (stage
    starts and growth reset the optimizer in place: ``lm/stage_start.py``, ``lm/growth.py``)."""
    from ..stream.run_dir import LAST_CHECKPOINT

    restore = given(node, "checkpoint", "restore_file") or LAST_CHECKPOINT
    save_dir = given(node, "checkpoint", "save_dir") or "checkpoints"
    if restore != LAST_CHECKPOINT and \
            os.path.abspath(restore) != os.path.abspath(os.path.join(save_dir, LAST_CHECKPOINT)):
        raise UsageError(f"--restore-file {restore}: an alma_stream run resumes only from its own "
                         f"--save-dir (its checkpoint_last.pt and stream records); drop it, and give "
                         f"that run's directory as --save-dir to continue it")
    finetune = given(node, "checkpoint", "finetune_from_model")
    if finetune:
        raise UsageError(f"--finetune-from-model {finetune}: an alma_stream run starts from a fresh "
                         f"model or resumes from its own --save-dir; drop it (give that run's "
                         f"directory as --save-dir to continue it)")
    valid_subset = str(given(node, "dataset", "valid_subset") or "valid")
    if valid_subset != "valid" and not given(node, "task", "fairseq_validation"):
        raise UsageError(f"--valid-subset {valid_subset} sets fairseq's own validation, which an "
                         f"alma_stream run does not run: stream.jsonl records the split 'valid' and "
                         f"--eval-subset after every arrival; score {valid_subset} with --eval-subset "
                         f"{valid_subset}, or add --fairseq-validation")
    if not given(node, "task", "fairseq_validation") and \
            component_name(node, "lr_scheduler") == "reduce_lr_on_plateau":
        # fairseq steps it with the validation loss of each epoch, None without that validation
        raise UsageError("--lr-scheduler reduce_lr_on_plateau lowers the LR when fairseq's validation "
                         "loss stops improving, and an alma_stream run does not run that validation: "
                         "the LR would never change; add --fairseq-validation, or use --lr-scheduler "
                         "alma_stage_linear")
    if given(node, "task", "fairseq_validation") and given(node, "dataset", "disable_validation"):
        # one turns fairseq's validation on, the other off: its best checkpoints never came
        raise UsageError("--fairseq-validation with --disable-validation: one runs fairseq's own "
                         "validation after every stage, the other turns it off; drop one of them")
    if not given(node, "task", "fairseq_validation"):
        for section_name, key, set_ in FAIRSEQ_VALIDATION_FLAGS:
            value = given(node, section_name, key)
            if value is not None and set_(value):
                flag = f"--{key.replace('_', '-')}" + ("" if isinstance(value, bool) else f" {value}")
                raise UsageError(f"{flag} belongs to fairseq's own validation, which an alma_stream run "
                                 f"does not run (stream.jsonl records 'valid' and --eval-subset, every "
                                 f"block, after every arrival): it would do nothing; drop it, or add "
                                 f"--fairseq-validation")
    check_stream_refused_flags(node)
    for key in RESET_FLAGS:
        if given(node, "checkpoint", key):
            flag = f"--{key.replace('_', '-')}"
            hint = " (--reset-optimizer-each-stage clears the optimizer state at each stage start)" \
                if key == "reset_optimizer" else ""
            raise UsageError(f"{flag}: an alma_stream run resumes its optimizer, LR schedule, data "
                             f"position and meters as checkpointed; drop {flag}{hint}")


def check_sharding(node: Any, growth: bool, machine_checks: bool = True) -> None:
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
        if not on_cuda(node, machine_checks):
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
    if growth and int(given(node, "model", "moe_expert_parallel_size") or 1) > 1:
        # lm/growth.py refused it at the first growth: after stage 1 had trained, and again at
        # every retry of "the same command"
        raise UsageError("--grow-experts does not support --moe-expert-parallel-size > 1 (a growth "
                         "step copies whole experts, which expert-parallel ranks hold in shards); "
                         "train with --moe-expert-parallel-size 1")


# (section, key, refused when, the one line; {v} is the value): fairseq's flags that would end
# an alma_stream run early with exit 0, leave it without the checkpoints every stage needs, or
# that it would ignore (``check_stream_refused_flags``).
STREAM_REFUSED_FLAGS: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("checkpoint", "no_save", bool,
     "--no-save: an alma_stream run needs its checkpoints (checkpoint_last.pt to resume, "
     "checkpoint_stage{{s}}.pt to score); drop --no-save"),
    ("checkpoint", "no_last_checkpoints", bool,
     "--no-last-checkpoints: an alma_stream run keeps each stage's model from the "
     "checkpoint_last.pt saved at the stage's end (and resumes from it); drop it"),
    ("checkpoint", "save_interval", lambda v: v != 1,
     "--save-interval {v}: an alma_stream run saves at the end of every stage (one fairseq "
     "epoch), which is its stage checkpoint; drop it (--save-interval-updates N saves within stages)"),
    ("optimization", "stop_time_hours", lambda v: v > 0,
     "--stop-time-hours {v:g} would end the stream mid-stage with exit 0; drop it: --max-epoch N "
     "stops after stage N (run again without it to continue), and SIGUSR1/SIGTERM save and exit "
     f"{REQUEUE_EXIT_STATUS} for a requeue"),
    ("checkpoint", "patience", lambda v: v > 0,
     "--patience {v} would end the stream with exit 0 when validation stops improving; drop it "
     "(every arrival is evaluated; --max-epoch N stops after stage N)"),
    ("optimization", "stop_min_lr", lambda v: v >= 0,
     "--stop-min-lr {v:g} would end the stream with exit 0 when the LR falls to it (the stage "
     "schedules decay to 0); drop it (--max-epoch N stops after stage N)"),
    ("ema", "store_ema", bool,
     "--store-ema: an alma_stream run evaluates and keeps the trained weights at every arrival, "
     "not fairseq's EMA copy; drop --store-ema"),
    ("checkpoint", "continue_once", bool,
     "--continue-once {v}: an alma_stream run starts from a fresh model or resumes from its own "
     "--save-dir (it loaded that checkpoint into a new run's records, then stopped); drop it, and "
     "give that run's directory as --save-dir to continue it"),
    ("checkpoint", "optimizer_overrides", lambda v: str(v).strip() not in ("", "{}"),
     "--optimizer-overrides {v}: an alma_stream run resumes its optimizer as checkpointed (the "
     "overrides would change it from the resumed update on, unlike the uninterrupted run); drop it"),
    ("optimization", "use_bmuf", bool,
     "--use-bmuf: BMUF lets every process train its own copy between syncs, and an alma_stream run "
     "keeps and evaluates the first process's model at each stage's end; drop it (data-parallel "
     "training keeps one model)"),
    ("distributed_training", "ddp_backend", lambda v: str(v) == "slowmo",
     "--ddp-backend slowmo: SlowMo lets every process take its own steps between syncs (as BMUF), "
     "and an alma_stream run keeps and evaluates the first process's model at each stage's end; "
     "use --ddp-backend pytorch_ddp, legacy_ddp or no_c10d"),
    ("distributed_training", "pipeline_model_parallel", bool,
     "--pipeline-model-parallel: fairseq's pipeline parallelism (its pipeline_parallel_transformer "
     "models) is not supported by alma_stream; drop it (--moe-expert-parallel-size shards the experts)"),
    ("common", "quantization_config_path", bool,
     "--quantization-config-path {v}: fairseq's iterative product quantization rewrites the model "
     "between epochs, which are an alma_stream run's stages, outside what its records and "
     "fingerprint describe; not supported: drop it"),
    ("common", "model_parallel_size", lambda v: v > 1,
     "--model-parallel-size {v}: Megatron model parallelism (fairseq's model_parallel models) is not "
     "supported by alma_stream; drop it (--moe-expert-parallel-size shards the experts)"),
    ("common", "use_plasma_view", bool,
     "--use-plasma-view: an alma_stream run reads its mega-batches through its own views (pyarrow's "
     "plasma store is not used); drop it"),
    ("checkpoint", "no_save_optimizer_state", bool,
     "--no-save-optimizer-state: an alma_stream run resumes its optimizer, LR schedule and update "
     "count from checkpoint_last.pt (without them it cannot continue); drop it"),
    ("checkpoint", "checkpoint_suffix", bool,
     "--checkpoint-suffix {v}: an alma_stream run keeps each stage from checkpoint_last.pt and "
     "resumes from it (with a suffix it kept no stage checkpoint); drop it"),
    ("checkpoint", "write_checkpoints_asynchronously", bool,
     "--write-checkpoints-asynchronously: an alma_stream run copies each stage's checkpoint as "
     "soon as fairseq has saved it, which an asynchronous write may not have finished; drop it"),
    ("dataset", "train_subset", lambda v: v != "train",
     "--train-subset {v}: an alma_stream run trains on its mega-batches (megabatch0, ...) in stream "
     "order; drop it"),
    ("dataset", "num_shards", lambda v: v > 1,
     "--num-shards {v}: an alma_stream run shares each stage's batches out over its processes "
     "itself (--distributed-world-size); drop --num-shards and --shard-id"),
    ("task", "output_dictionary_size", lambda v: v >= 0,
     "--output-dictionary-size {v}: an alma_stream model predicts every symbol of the stream's "
     "dictionary (the flag would be ignored); drop it"),
    ("task", "self_target", bool,
     "--self-target: an alma_stream model predicts the next token only (the flag would be ignored); drop it"),
    ("task", "add_bos_token", bool,
     "--add-bos-token: fairseq 0.12 then makes <s> the first target of every block too, a token "
     "the model learns to predict for free, which fairseq-eval-lm leaves out and an alma_stream "
     "run's perplexities would count; drop it"),
    ("task", "past_target", bool,
     "--past-target: an alma_stream model predicts the next token only (the flag would be ignored); drop it"),
    ("dataset", "grouped_shuffling", bool,
     "--grouped-shuffling: an alma_stream run orders each stage's batches itself (passes over "
     "the stage's data shuffled with --seed); drop it"),
    ("dataset", "curriculum", lambda v: v > 0,
     "--curriculum {v}: an alma_stream run orders each stage's data itself (passes over it "
     "shuffled with --seed); drop it"),
    ("optimization", "skip_remainder_batch", bool,
     "--skip-remainder-batch: an alma_stream stage's batches are whole groups of --update-freq "
     "on every process (its updates and their spares), so there is no remainder; drop it"),
    ("dataset", "update_epoch_batch_itr", bool,
     "--update-epoch-batch-itr: an alma_stream run builds each stage's batches anew (none are "
     "cached); drop it"),
    ("distributed_training", "fix_batches_to_gpus", bool,
     "--fix-batches-to-gpus: an alma_stream run deals each stage's batches out to its processes "
     "itself, in stream order (fairseq's shuffle, which the flag changes, is off); drop it"),
)


# fairseq's validation settings (section, key, set when): without --fairseq-validation a
# stream turns that validation off (``config.stream_training_settings``), so each would be a
# no-op; --valid-subset has its own message above
FAIRSEQ_VALIDATION_FLAGS = (
    ("dataset", "max_valid_steps", lambda v: True),
    ("dataset", "validate_interval", lambda v: v != 1),
    ("dataset", "validate_interval_updates", lambda v: v > 0),
    ("dataset", "validate_after_updates", lambda v: v > 0),
    ("dataset", "fixed_validation_seed", lambda v: True),
    ("dataset", "combine_valid_subsets", bool),
    ("dataset", "ignore_unused_valid_subsets", bool),
    ("checkpoint", "best_checkpoint_metric", lambda v: v != "loss"),
    ("checkpoint", "maximize_best_checkpoint_metric", bool),
    ("checkpoint", "keep_best_checkpoints", lambda v: v > 0),
)


def check_stream_refused_flags(node: Any) -> None:
    """``STREAM_REFUSED_FLAGS``: what each did when it was accepted.

    Why: a stage checkpoint is the ``checkpoint_last.pt`` fairseq saves at the end of each
    epoch (one epoch per stage), so ``--no-last-checkpoints`` left a finished-looking
    ``stream.jsonl`` with no stage checkpoint at all, ``--checkpoint-suffix`` too, and
    ``--save-interval 2`` kept every second stage only.  ``--no-save-optimizer-state`` left a
    run that could not resume (its checkpoint had lost the update count).  An asynchronous
    checkpoint write (fairseq's iopath) may still be running when the stage's copy is taken, and
    without iopath it ended in a traceback.  ``--stop-time-hours``, ``--patience`` (with ``--fairseq-validation``)
    and ``--stop-min-lr`` stop fairseq's loop on time, stalled validation or a low LR: with exit
    0 and an unfinished stream (``--patience 1`` ended one after its first stage).  fairseq's
    EMA (``--store-ema``) is neither what the stream evaluates after every arrival nor what its
    stage checkpoints keep, and its update fails on the model's integer buffers (a Switch
    layer's expert count).
    ``--train-subset valid`` trained on the validation split, wrote no stream record and no
    stage checkpoint, and exited 0; the stream's own data order makes fairseq's ``--num-shards``
    and ``--curriculum`` no-ops, and a flag that does nothing is refused, not ignored."""
    for section_name, key, refused, message in STREAM_REFUSED_FLAGS:
        value = given(node, section_name, key)
        if value is not None and refused(value):
            raise UsageError(message.format(v=value))
