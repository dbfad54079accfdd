"""fairseq-train's flags that fairseq itself never checks, refused in one line before anything
runs (``config.check_training_flags`` calls the first two right after fairseq parsed them; the
stream training calls ``check_stream_start`` before it takes the run directory).

Why: fairseq turns these into a traceback minutes in (a ZeroDivisionError for
``--tokens-per-sample 0``), into a late failure after a stage was trained (blocks longer than
``--max-target-positions`` are dropped, and the first evaluation finds no tokens), or into a run
that silently does something else (``--batch-size 0`` trains with fairseq's default batching,
``--moe-expert-parallel-size 2`` in one process trains without expert parallelism, a
``--max-update`` below the stream's updates ends it after the first stage with exit 0).
"""

from __future__ import annotations

import os
from typing import Any

from ..errors import CheckpointError, UsageError
from ..out_paths import check_dir_path
from .config import given, section

# flag -> (section, key): sizes that must be >= 1 when given (None: fairseq's default)
SIZES = {
    "--batch-size": ("dataset", "batch_size"),
    "--batch-size-valid": ("dataset", "batch_size_valid"),
    "--max-tokens": ("dataset", "max_tokens"),
    "--max-tokens-valid": ("dataset", "max_tokens_valid"),
    "--required-batch-size-multiple": ("dataset", "required_batch_size_multiple"),
}
FP16_FLAGS = ("memory_efficient_fp16", "amp", "fp16")  # fairseq sets fp16 with the first


def check_run_inputs(cfg: Any) -> None:
    """Every stream (LM or vision): ``--save-dir`` can be a directory, batch sizes and
    ``--update-freq`` are >= 1."""
    save_dir = given(cfg, "checkpoint", "save_dir")
    if save_dir:
        check_dir_path(save_dir, "--save-dir")
    for flag, (section_name, key) in SIZES.items():
        value = given(cfg, section_name, key)
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1 (got {value}); leave it out for fairseq's default")
    max_epoch = given(cfg, "optimization", "max_epoch")
    if max_epoch is not None and max_epoch < 0:
        raise UsageError(f"--max-epoch must be >= 0 (got {max_epoch}): in a stream, stop after "
                         "stage N; 0 or left out trains every stage")
    for value in given(cfg, "optimization", "update_freq") or []:
        if value < 1:
            raise UsageError(f"--update-freq must be >= 1 (got {value}): batches accumulated per "
                             "update, e.g. --update-freq 4")


def check_lm_training(cfg: Any) -> None:
    """A language-model run: block length, precision on this device, the processes that the
    distributed options need."""
    import torch

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
        max_tokens = given(cfg, "dataset", "max_tokens")
        if max_tokens is not None and max_tokens < tokens:
            raise UsageError(f"--max-tokens {max_tokens} holds no block of --tokens-per-sample "
                             f"{tokens}; use --max-tokens >= {tokens} or --batch-size")
    flag = next((f"--{key.replace('_', '-')}" for key in FP16_FLAGS if given(cfg, "common", key)), None)
    if flag is not None and (given(cfg, "common", "cpu") or not torch.cuda.is_available()):
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


def check_stream_start(task: Any, stages: int, save_dir: str, restart: bool) -> None:
    """What only the stream knows, before the run directory is taken: ``--max-update`` leaves
    the stream's updates, the evaluation split exists, and a ``checkpoint_last.pt`` left without
    ``run.json`` is of this model (fairseq would fail to load it after run.json was written)."""
    needed = stages * task.budget
    max_update = given(task.cfg, "optimization", "max_update") or 0
    if 0 < max_update < needed:
        raise UsageError(f"--max-update {max_update} stops the stream before its end ({stages} "
                         f"stages x {task.budget} updates = {needed}); leave --max-update out "
                         "(--updates-per-stage sets the budget; --max-epoch N stops after stage N)")
    data = str(task.cfg.data).split(os.pathsep)[0]
    subset = task.cfg.eval_subset
    missing = [f"{subset}{ext}" for ext in (".bin", ".idx") if not os.path.exists(os.path.join(data, subset + ext))]
    if missing:
        splits = sorted(name[:-4] for name in os.listdir(data)
                        if name.endswith(".idx") and not name.startswith("megabatch"))
        raise UsageError(f"--eval-subset {subset}: {' and '.join(missing)} missing in {data}; use "
                         f"one of its splits ({', '.join(splits)})")
    if not restart:
        check_leftover_checkpoint(save_dir, task.cfg)


def check_leftover_checkpoint(save_dir: str, node: Any) -> None:
    """A ``checkpoint_last.pt`` in a --save-dir without ``run.json`` (a run of fairseq-alma 0.1,
    or a file copied there) is continued; refuse it when it holds another model."""
    from omegaconf import OmegaConf

    from ..checkpoint_load import load_checkpoint
    from ..stream.run_dir import RUN_FILE, fingerprint_differences

    last = os.path.join(save_dir, "checkpoint_last.pt")
    if not os.path.isfile(last) or os.path.exists(os.path.join(save_dir, RUN_FILE)):
        return
    state = load_checkpoint(last, mmap=True)
    old = (state.get("cfg") or {}).get("model") if isinstance(state, dict) else None
    model = section(node, "model")
    if not isinstance(old, dict) or model is None:
        return
    model = OmegaConf.to_container(model, resolve=True, enum_to_str=True)
    # settings the checkpoint does not know were added to the model later: not compared
    changed = fingerprint_differences(_plain(old), {k: v for k, v in model.items() if k in old}, "model")
    if changed:
        raise CheckpointError(f"{last} holds another model ({'; '.join(changed[:3])}); move it "
                              "aside or use another --save-dir, or add --restart-stream")


def _plain(value: Any) -> Any:
    """A checkpoint's config as plain values (enum members as their strings)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True, enum_to_str=True)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return getattr(value, "value", value)
