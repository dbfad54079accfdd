"""Every place fairseq-alma changes fairseq's own behaviour, each with the reason it must.

fairseq 0.12 has no hook for these; everything else the plugin does goes through fairseq's
documented extension points (registered tasks, models, criterions and LR schedulers, and the
task's ``get_checkpoint_dict``/``set_checkpoint_dict``).  Each patch:

* is installed by one idempotent function, called from one of two places:
  ``install_command_patches`` (importing the package: every fairseq command with
  ``--user-dir fairseq_alma`` and our console tools) and ``install_stream_training_patches``
  (an ``alma_stream`` training process, when it opens its run directory), so a process that
  only scores checkpoints installs none of the training patches;
* wraps fairseq's function and calls it, so fairseq's behaviour is kept everywhere the patch
  has nothing to add;
* has a test in ``tests/test_fairseq_patches.py`` that fails if fairseq changes the code the
  patch relies on (the name looked up at call time, the signature, the call site).

The patches:

``install_console_errors``   fairseq-train / fairseq-eval-lm print a fairseq-alma error as one
                             line and exit with its status instead of a traceback; fairseq's
                             batch-prefetching thread is stopped first (``loader_threads``),
                             since one inside a torch op at exit aborts the process.
``install_atomic_copies``    fairseq copies a saved checkpoint to its other names
                             (checkpoint_last.pt, ...) with a plain, non-atomic copy.
``install_requeue_save``     after every update attempt: end the epoch when the stage's
                             budget of counted updates is done (fp16 overflow steps do not count),
                             and on SIGUSR1/SIGTERM save checkpoint_last.pt only, without
                             validation or extra copies, then exit with the requeue status.
``install_expert_parallel_trainer``  expert shards differ across ranks, which fairseq's Trainer
                             assumes they never do (optimizer state, collective state_dict).
``install_checkpoint_errors`` a checkpoint torch cannot read ends in one line naming the file
                             and the way out, not in torch's traceback.
``install_quiet_startup``    fairseq's use of hydra's deprecated APIs prints ~20 lines of
                             warnings at every start.
``install_training_flags``   fairseq 0.12's option parser turns ``--bf16`` into TPU mode,
                             although its trainer and FP16Optimizer train bf16 on GPUs; flags a
                             training run cannot honour are refused before anything runs.
``install_every_block_scored`` fairseq-eval-lm and fairseq-validate leave a block longer than
                             the model's positions out of the perplexity they print.
``repair_fairseq_cli_logging`` fairseq-eval-lm and fairseq-validate log at DEBUG, unformatted,
                             on stderr, because fairseq's import configured logging first.
``install_every_token_scored`` fairseq-eval-lm leaves a token whose log-probability is
                             infinite out of the perplexity it prints.
``install_one_log_file_handler`` fairseq's progress bar adds one more ``--log-file``
                             handler at every epoch, so epoch N's lines reach the file N times.
``install_torch_ddp_on_cpu``  fairseq passes a GPU device to torch's DDP even for a CPU model,
                             so ``--ddp-backend pytorch_ddp`` (its default) failed on CPU ranks.
``install_flat_bf16_master``  fairseq's FP16Optimizer keeps one fp32 master copy per parameter
                             under ``--bf16`` (a TPU choice), so its pure-Python Adam steps
                             every parameter tensor on its own; on GPUs one flat copy, as under
                             ``--fp16``, costs a few launches per step instead of ~10 per tensor.
``install_scoring_command_patches`` (``scoring_commands.py``) fairseq-eval-lm / fairseq-validate:
                             the trained dictionary checked under any --task; an
                             expert-parallel checkpoint built with every expert on every rank.
``install_fp16_master_in_checkpoints`` (``fp16_master.py``) fairseq's FP16Optimizer does not save
                             its fp32 master weights, nor its loss scaler's counters, so a
                             resumed --fp16/--bf16 run was not the uninterrupted one.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import importlib
import logging
import math
import os
import pickle
import shutil
import sys
import time
import warnings
import zipfile
from collections.abc import Iterator
from typing import Any

from ..errors import AlmaError, CheckpointError, Preempted, StreamFinished
from ..stream.run_dir import LAST_CHECKPOINT
from .patch_marks import is_patched as _patched
from .patch_marks import mark as _mark
from .patch_marks import running as _running

logger = logging.getLogger(__name__)

# fairseq's console commands whose ``main`` gets one-line errors (module, program name).
CONSOLE_COMMANDS = {"fairseq_cli.train": "fairseq-train", "fairseq_cli.eval_lm": "fairseq-eval-lm",
                    "fairseq_cli.validate": "fairseq-validate"}
ERROR_PROG = "fairseq-alma"
# A run that diverged is no usage error (2) and no preemption (75, which Slurm requeues).
DIVERGED_EXIT_STATUS = 1
# Nor is a run whose other process died: retrying may work (a lost node) or not (an OOM kill).
PEER_LOST_EXIT_STATUS = 1
# What gloo and NCCL raise in a collective when another rank's process is gone
PEER_LOST_MESSAGES = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                      "NCCL communicator was aborted")


# ---- one-line errors for fairseq's own commands ------------------------------------------
class _ConsoleMain:
    """fairseq's ``main(cfg)`` with fairseq-alma errors turned into one line and a status.

    Why: ``fairseq-train``/``fairseq-eval-lm`` are fairseq's console entry points, not ours,
    and the plugin's errors (a bad flag, a wrong data directory, a preemption) would otherwise
    end in a traceback that hides the one line a user needs.  ``cli_main`` looks ``main`` up in
    its module when it runs, after ``--user-dir`` imported the plugin, so replacing the module's
    ``main`` reaches it.  Picklable by module name, so fairseq's multi-GPU spawn works too.
    """

    _alma_patch = True

    def __init__(self, module_name: str, original: Any) -> None:
        self.module_name = module_name
        self.original = original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from ..loader_threads import stop_background_loaders

        try:
            return self._call_original(*args, **kwargs)
        finally:  # a prefetching thread inside a torch op at exit aborts the process
            stop_background_loaders()

    def _call_original(self, *args: Any, **kwargs: Any) -> Any:
        from ..console import INTERRUPTED_EXIT_STATUS, error_line

        refused: list[bool] = []
        made = _new_save_dir(args[0] if args else kwargs.get("cfg"))
        if made is not None:  # registered before the run lock's release, so it runs after it
            atexit.register(_remove_if_refused_and_empty, made, refused)
        try:
            return self.original(*args, **kwargs)
        except StreamFinished as end:
            logger.info("%s", end)
            return None
        except KeyboardInterrupt:  # Ctrl-C: what was saved stays, and the same command resumes
            sys.stdout.flush()
            print(f"{ERROR_PROG}: interrupted; run the same command again to continue", file=sys.stderr,
                  flush=True)
            raise SystemExit(INTERRUPTED_EXIT_STATUS) from None
        except AlmaError as err:
            if not isinstance(err, Preempted):
                refused.append(True)
            sys.stdout.flush()
            print(error_line(ERROR_PROG, err), file=sys.stderr, flush=True)
            raise SystemExit(err.exit_status) from None
        except FloatingPointError as err:  # fairseq's Trainer: NaN/inf gradients, loss scale at its floor
            if not self.module_name.endswith(".train"):
                raise
            sys.stdout.flush()
            print(f"{ERROR_PROG}: error: training diverged: {str(err).splitlines()[0]} (fairseq's log "
                  f"above has the details); what was saved before is intact, and the same command would "
                  f"diverge again: train in a new --save-dir with a lower --lr or with --clip-norm",
                  file=sys.stderr, flush=True)
            raise SystemExit(DIVERGED_EXIT_STATUS) from None
        except FileNotFoundError as err:
            if not str(err).startswith("Dataset not found:"):  # fairseq's load_dataset
                raise
            sys.stdout.flush()
            print(f"{ERROR_PROG}: error: {err}{_split_hint(args[0] if args else kwargs.get('cfg'))}",
                  file=sys.stderr, flush=True)
            raise SystemExit(2) from None
        except (OSError, RuntimeError) as err:
            if isinstance(err, OSError) and str(err).startswith("Model file not found:"):
                sys.stdout.flush()  # fairseq's load_model_ensemble_and_task, for --path
                print(f"{ERROR_PROG}: error: {err}; give the path of a checkpoint file (--path)",
                      file=sys.stderr, flush=True)
                raise SystemExit(2) from None
            if _peer_lost(err):
                sys.stdout.flush()
                print(f"{ERROR_PROG}: error: another process of this distributed run stopped "
                      f"({_first_line(err)}); its own output says why; what was saved is intact: "
                      f"run the same command on every rank to continue", file=sys.stderr, flush=True)
                raise SystemExit(PEER_LOST_EXIT_STATUS) from None
            save_dir = _save_dir(args[0] if args else kwargs.get("cfg"))
            if not _disk_full(err, save_dir):
                raise
            sys.stdout.flush()
            print(f"{ERROR_PROG}: error: no space left on the device of {save_dir} (a write there "
                  f"failed); every file written before is intact: free space and run the same "
                  f"command to continue", file=sys.stderr, flush=True)
            raise SystemExit(2) from None

    def __reduce__(self) -> tuple:
        return (_console_main, (self.module_name,))


def _new_save_dir(cfg: Any) -> str | None:
    """``--save-dir`` when it does not exist yet: fairseq-train makes it first thing
    (``checkpoint_utils.verify_checkpoint_directory``), before the task, the data or the model
    can refuse the command."""
    save_dir = _save_dir(cfg)
    return save_dir if save_dir != "." and not os.path.exists(save_dir) else None


def _remove_if_refused_and_empty(save_dir: str, refused: list[bool]) -> None:
    """At exit, after the run lock it may have taken is released: a refused command leaves no
    trace, so the --save-dir it made goes again if it holds no more than a run that never
    trained (``run_dir.discard_unstarted``). One that existed before is never touched."""
    if refused:
        from ..stream.run_dir import discard_unstarted

        discard_unstarted(save_dir)


def _split_hint(cfg: Any) -> str:
    """What to name instead of a split DATA lacks (fairseq-eval-lm scores ``test`` unless told):
    on an ALMA stream, its evaluation mega-batch and validation set."""
    try:
        data = str(cfg.task.data).split(os.pathsep)[0]
    except AttributeError:
        return ""
    if not os.path.isfile(os.path.join(data, "manifest.json")):
        return "; name a split that DATA holds (--gen-subset, --valid-subset)"
    return ("; an ALMA stream holds eval (the evaluation mega-batch), valid and megabatch{k}: "
            "e.g. --gen-subset eval")


def _save_dir(cfg: Any) -> str:
    try:
        return str(cfg.checkpoint.save_dir)
    except AttributeError:
        return "."


def _peer_lost(err: BaseException) -> bool:
    """Did a collective fail because another rank's process is gone (killed, out of memory, its
    node lost)?  Then this rank's traceback says nothing about the cause, which is in the other
    rank's output; only with more than one process, and only for gloo's and NCCL's messages."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    return any(message in str(err) for message in PEER_LOST_MESSAGES)


def _first_line(err: BaseException) -> str:
    """``err``'s message without the backend's source location prefix, on one line."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text


def _disk_full(err: BaseException, directory: str, slack: int = 64 << 20) -> bool:
    """Did ``err`` come from a full disk?  torch's zip writer reports ENOSPC as an opaque
    ``RuntimeError`` ("enforce fail ... file write failed"), so a write error while the save
    directory's file system has (almost) no space left counts too."""
    chain: BaseException | None = err
    while chain is not None:
        if isinstance(chain, OSError) and chain.errno == errno.ENOSPC:
            return True
        chain = chain.__cause__ or chain.__context__
    message = str(err)
    if isinstance(err, RuntimeError) and ("enforce fail" in message or "write failed" in message):
        try:
            return shutil.disk_usage(directory).free < slack
        except OSError:
            return False
    return False


def _console_main(module_name: str) -> Any:
    module = importlib.import_module(module_name)
    _wrap_console_main(module, module_name)
    return module.main


def _wrap_console_main(module: Any, module_name: str) -> None:
    main = getattr(module, "main", None)
    if main is not None and not _patched(main):
        module.main = _ConsoleMain(module_name, main)


def install_console_errors() -> None:
    """Wrap ``main`` of the fairseq command this process runs (if any; see ``_ConsoleMain``)."""
    for name in CONSOLE_COMMANDS:
        if name in sys.modules:
            _wrap_console_main(sys.modules[name], name)
    main_module = sys.modules.get("__main__")
    spec = getattr(main_module, "__spec__", None)
    if spec is not None and spec.name in CONSOLE_COMMANDS:  # python -m fairseq_cli.train
        _wrap_console_main(main_module, spec.name)


# ---- bf16 on GPUs ------------------------------------------------------------------------
BF16_FLAGS = ("--bf16", "--memory-efficient-bf16")
OTHER_PRECISION_FLAGS = ("--fp16", "--memory-efficient-fp16", "--amp")
CONSOLE_PROGRAMS = ("fairseq-train", "fairseq-eval-lm", "fairseq-validate", "alma-train")


def _running_console_command() -> bool:
    """Whether this process is one of fairseq's commands (or alma-train) parsing its flags."""
    return _running(CONSOLE_PROGRAMS, tuple(CONSOLE_COMMANDS))


def _flags_given(names: tuple[str, ...], argv: list[str] | None = None) -> list[str]:
    """Flags of ``names`` in ``argv`` (default: this command line; fairseq's parser takes no
    abbreviations)."""
    argv = sys.argv[1:] if argv is None else argv
    return [arg.split("=")[0] for arg in argv if arg.split("=")[0] in names]


TRAINING_PROGRAMS = ("fairseq-train", "alma-train")
HELP_FLAGS = ("-h", "--help")


def _running_training_command() -> bool:
    """Whether this process is fairseq-train (or alma-train, or ``python -m fairseq_cli.train``)."""
    return _running(TRAINING_PROGRAMS, ("fairseq_cli.train",))


def arch_missing(argv: list[str]) -> bool:
    """Whether a training command line names no model: fairseq 0.12 then ends in a bare
    ``RuntimeError()`` traceback (``options.parse_args_and_arch``), with no word of why."""
    return not any(arg in ("--arch", "-a") or arg.startswith("--arch=") or
                   (arg.startswith("-a") and not arg.startswith("--")) for arg in argv)


def precision_conflict(argv: list[str]) -> str | None:
    """Why ``argv`` asks for two precisions (a bf16 flag with --fp16, --memory-efficient-fp16
    or --amp), or None; fairseq itself would raise "Cannot combine --fp16 and --tpu" with a
    traceback.  ``alma-sweep submit`` asks it of every grid point
    (``sweeps/fairseq_train_flags.argv_flag_problem``)."""
    bf16, other = _flags_given(BF16_FLAGS, argv), _flags_given(OTHER_PRECISION_FLAGS, argv)
    if bf16 and other:
        return (f"{bf16[0]} and {other[0]} are two precisions: use one (bf16 on A100/H100, "
                f"--fp16 on V100)")
    return None


def undo_bf16_tpu(args: Any, argv: list[str] | None = None) -> None:
    """Undo the TPU mode that ``options.parse_args_and_arch`` attaches to ``--bf16`` unless
    ``argv`` (default: this command line) asks for ``--tpu`` itself (``_TrainingConfig``)."""
    tpu_given = bool(_flags_given(("--tpu",), argv))
    if getattr(args, "bf16", False) and getattr(args, "tpu", False) and not tpu_given:
        args.tpu = False


class _TrainingConfig:
    """fairseq's ``convert_namespace_to_omegaconf`` as the console commands call it (looked up
    in their module when they run, after ``--user-dir`` imported the plugin), between parsing
    the flags and running anything:

    * ``--bf16``'s implied TPU mode is undone: ``options.parse_args_and_arch`` sets
      ``args.tpu = True`` whenever ``--bf16`` is given (fairseq 0.12 only ran bf16 on TPUs), but
      its ``Trainer`` and ``FP16Optimizer`` train bf16 on GPUs (model in bf16, fp32 master
      weights, no loss scaler).  An explicit ``--tpu`` is kept, and refused below.
    * fairseq-train: the flags a run cannot honour end in one line and exit 2 before
      anything starts (``train_flags.check_training_flags``), and ``--bf16`` keeps one flat
      fp32 master copy (``install_flat_bf16_master``);
    * fairseq-eval-lm and fairseq-validate: likewise for their own flags
      (``scoring_command_flags.check_scoring_flags``)."""

    _alma_patch = True

    def __init__(self, module_name: str, original: Any) -> None:
        self.module_name, self.original = module_name, original

    def __call__(self, args: Any) -> Any:
        undo_bf16_tpu(args)
        if self.module_name.endswith(".train"):
            from .train_flags import check_training_namespace

            self._refuse_in_one_line(check_training_namespace, args)
        cfg = self.original(args)
        if self.module_name.endswith(".train"):
            from .train_flags import check_training_flags

            self._refuse_in_one_line(check_training_flags, cfg)
            install_flat_bf16_master()
        elif self.module_name.endswith((".eval_lm", ".validate")):
            from .scoring_command_flags import check_scoring_flags

            self._refuse_in_one_line(check_scoring_flags, cfg, self.module_name.rsplit(".", 1)[1])
        return cfg

    @staticmethod
    def _refuse_in_one_line(check: Any, *args: Any) -> None:
        try:
            check(*args)
        except AlmaError as err:
            from ..console import error_line

            sys.stdout.flush()
            print(error_line(ERROR_PROG, err), file=sys.stderr, flush=True)
            raise SystemExit(err.exit_status) from None


def install_training_flags() -> None:
    """``_TrainingConfig`` in the fairseq command this process runs; and two command lines end
    in one line and exit 2 while fairseq is still parsing, where fairseq itself would end in a
    traceback: ``--bf16`` or ``--memory-efficient-bf16`` with ``--fp16``,
    ``--memory-efficient-fp16`` or ``--amp`` ("Cannot combine --fp16 and --tpu"), a
    training command without ``--arch`` (a bare ``RuntimeError``) and fairseq-validate without
    ``--task`` (it has no default: ``KeyError: None``)."""
    if not _running_console_command():
        return
    conflict = precision_conflict(sys.argv[1:])
    if conflict is None and _running_training_command() and arch_missing(sys.argv[1:]) and \
            not _flags_given(HELP_FLAGS):
        conflict = ("--arch is required: the model to train, e.g. --arch switch_transformer_lm_base "
                    "(alma-train --arch NAME --help lists that model's options)")
    if conflict is None and _running(("fairseq-validate",), ("fairseq_cli.validate",)) and \
            not _flags_given(("--task",)) and not _flags_given(HELP_FLAGS):  # fairseq: KeyError: None
        conflict = "--task is required: the task the checkpoint was trained with, e.g. --task alma_stream"
    if conflict is not None:
        sys.stdout.flush()
        print(f"{ERROR_PROG}: error: {conflict}", file=sys.stderr, flush=True)
        raise SystemExit(2)
    modules = {name: sys.modules[name] for name in CONSOLE_COMMANDS if name in sys.modules}
    main_module = sys.modules.get("__main__")
    main_name = getattr(getattr(main_module, "__spec__", None), "name", None)
    if main_name in CONSOLE_COMMANDS:
        modules[main_name + ":__main__"] = main_module
    for name, module in modules.items():
        original = getattr(module, "convert_namespace_to_omegaconf", None)
        if original is not None and not _patched(original):
            module.convert_namespace_to_omegaconf = _TrainingConfig(name.split(":")[0], original)


def flat_bf16_master(cfg: Any, params: list) -> bool:
    """Whether ``--bf16`` (FP16Optimizer) keeps one flat fp32 master copy: on CUDA, unless the
    flags need per-parameter copies as they do under --fp16 (``--fp16-no-flatten-grads``,
    ``--zero-sharding os``) or expert-parallel shards carry per-parameter attributes."""
    import torch

    common = cfg.common
    return (getattr(common, "bf16", False) and not getattr(common, "tpu", False)
            and not getattr(common, "fp16_no_flatten_grads", False) and torch.cuda.is_available()
            and str(getattr(cfg.distributed_training, "zero_sharding", "none")) != "os"
            and not any(hasattr(p, "expert") for p in params))


def install_flat_bf16_master() -> None:
    """``FP16Optimizer.build_optimizer``: one flat fp32 master copy under ``--bf16`` on GPUs.

    Why: fairseq 0.12 builds per-parameter fp32 copies whenever ``--bf16`` is set ("mixed
    precision is faster on TPUs without flat grads"); without apex its Adam then runs ~10 small
    ops per parameter tensor each step, which made a 12-layer bf16 model train 22% slower than
    the same model in fp16 on an H100.  The flat layout is the one ``--fp16`` uses (the
    mixin handles both; growth's optimizer-state copies read either,
    ``lm/stage_start.optimizer_state_like``).  fairseq's own code runs otherwise."""
    from fairseq import optim
    from fairseq.optim.fp16_optimizer import FP16Optimizer

    original = FP16Optimizer.__dict__["build_optimizer"].__func__
    if _patched(original):
        return

    def build_optimizer(cls: Any, cfg: Any, params: Any, **kwargs: Any) -> Any:
        params = list(params)
        if not flat_bf16_master(cfg, params):
            return original(cls, cfg, params, **kwargs)
        fp32_params = cls.build_fp32_params(cfg.optimizer, params, flatten=True)
        fp32_optimizer = optim.build_optimizer(cfg.optimizer, [fp32_params])
        if not fp32_optimizer.supports_flat_params:
            return original(cls, cfg, params, **kwargs)
        return cls(cfg, params, fp32_optimizer, fp32_params, **kwargs)

    build_optimizer._alma_patch = True  # type: ignore[attr-defined]
    build_optimizer.__wrapped__ = original  # type: ignore[attr-defined]
    FP16Optimizer.build_optimizer = classmethod(build_optimizer)


# ---- atomic checkpoint copies ------------------------------------------------------------
def install_atomic_copies() -> None:
    """Make ``PathManager.copy`` of local files atomic (temp file, fsync, rename).

    Why: ``checkpoint_utils.save_checkpoint`` writes the first checkpoint of a save atomically
    (``.tmp`` + rename) and then copies it to the other names with ``PathManager.copy``, a plain
    ``shutil.copyfile``.  A process killed during that copy (kill -9, OOM, a node failure, a
    Slurm time limit) leaves a truncated ``checkpoint_last.pt``, and the same command then
    cannot resume.  Remote (iopath) paths keep fairseq's behaviour.
    """
    from fairseq.file_io import PathManager

    from ..stream.atomic import atomic_copy

    original = PathManager.copy
    if _patched(original):
        return

    def copy(src_path: str, dst_path: str, overwrite: bool = False) -> bool:
        if "://" in str(src_path) or "://" in str(dst_path):
            return original(src_path, dst_path, overwrite)
        if os.path.exists(dst_path) and not overwrite:
            return False
        atomic_copy(src_path, dst_path)
        return True

    PathManager.copy = staticmethod(_mark(copy))


# ---- save-and-requeue on SIGUSR1/SIGTERM ------------------------------------------------
class _CheckpointOverrides:
    """fairseq's checkpoint settings with a few values replaced, without writing the config."""

    def __init__(self, base: Any, **overrides: Any) -> None:
        self._base = base
        self._overrides = overrides

    def __getattr__(self, name: str) -> Any:
        overrides = self.__dict__["_overrides"]
        return overrides[name] if name in overrides else getattr(self.__dict__["_base"], name)


def save_for_requeue(cfg: Any, trainer: Any, epoch_itr: Any) -> float:
    """Write ``checkpoint_last.pt`` and nothing else; returns the seconds it took.

    Inside Slurm's grace period every second counts: no validation (its numbers would not be
    recorded anywhere), no epoch, interval or best copies (each a full copy of the checkpoint).
    """
    from fairseq import checkpoint_utils

    start = time.perf_counter()
    only_last = _CheckpointOverrides(cfg.checkpoint, no_epoch_checkpoints=True,
                                     save_interval_updates=0, keep_best_checkpoints=0,
                                     keep_interval_updates=0, no_last_checkpoints=False,
                                     no_save=False)
    checkpoint_utils.save_checkpoint(only_last, trainer, epoch_itr, None)
    return time.perf_counter() - start


def end_stage_epoch(epoch_itr: Any) -> None:
    """End fairseq's current epoch after the batch just trained (the rest are spares).

    ``EpochBatchIterator`` keeps the epoch's ``CountingIterator`` in ``_cur_epoch_itr``;
    ``take`` truncates it, so ``end_of_epoch()`` is true for the save that follows (the
    checkpoint then says "next epoch, 0 iterations", as at a natural epoch end), and the
    training loop's grouping of it (``train`` builds ``iterators.GroupedIterator``, looked up
    when it runs; replaced here by a subclass that sees the truncation) stops the epoch."""
    current = epoch_itr._cur_epoch_itr
    current.take(current.n)


def _stage_aware_grouped_iterator(base_class: Any) -> Any:
    """fairseq's ``GroupedIterator`` that also ends when the iterator it groups was truncated
    (``end_stage_epoch``); fairseq's own raises ``IndexError`` ("exhausted at position")."""
    from fairseq.data.iterators import CountingIterator

    class StageAwareGroupedIterator(base_class):
        _alma_patch = True

        def __init__(self, iterable: Any, chunk_size: int, skip_remainder_batch: bool = False) -> None:
            super().__init__(iterable, chunk_size, skip_remainder_batch)
            self._grouped = iterable

        def _truncated(self) -> bool:
            return isinstance(self._grouped, CountingIterator) and not self._grouped.has_next()

        def has_next(self) -> bool:
            return super().has_next() and not self._truncated()

        def __next__(self) -> Any:
            if self._truncated():
                raise StopIteration
            return super().__next__()

    return StageAwareGroupedIterator


def install_requeue_save() -> None:
    """Let the task end a stage's epoch after its counted updates, and stop training at an
    update boundary after a signal (``stream/stop.py``).

    Why: fairseq ends an epoch when its batches run out, and skipped (overflow) steps use up
    batches without counting, so a stage would end early; and fairseq has no way to save on a
    signal.  ``fairseq_cli.train.train`` calls
    ``validate_and_save`` after every update, looked up in its module at call time; the wrapper
    asks the task (``task.stop_requested(num_updates)``, which agrees across ranks) and, if a
    stop is due, saves only ``checkpoint_last.pt`` and raises ``Preempted``, which the console
    wrapper turns into the requeue exit status.  Otherwise fairseq's function runs unchanged.
    """
    import fairseq_cli.train as train_cli
    from fairseq.data import iterators

    original = train_cli.validate_and_save
    if _patched(original):
        return
    iterators.GroupedIterator = _stage_aware_grouped_iterator(iterators.GroupedIterator)

    def validate_and_save(cfg: Any, trainer: Any, task: Any, epoch_itr: Any,
                          valid_subsets: list, end_of_epoch: bool) -> Any:
        updates = trainer.get_num_updates()
        after_update = getattr(task, "after_update", None)
        stage_done = after_update is not None and after_update(updates)
        if stage_done and not end_of_epoch:
            end_stage_epoch(epoch_itr)  # the stage has its counted updates: its epoch ends here
            end_of_epoch = True
        stop_requested = getattr(task, "stop_requested", None)
        if stop_requested is not None and stop_requested(updates):
            seconds = save_for_requeue(cfg, trainer, epoch_itr)
            why = "stopped: the stage's batches ran out" if getattr(task, "batches_ran_out", False) \
                else "preempted"
            message = (f"{why} at update {updates}, checkpoint saved in {seconds:.1f}s "
                       f"({os.path.join(cfg.checkpoint.save_dir, LAST_CHECKPOINT)}); "
                       f"run the same command to continue")
            logger.warning(message)
            raise Preempted(message)
        valid_losses, should_stop = original(cfg, trainer, task, epoch_itr, valid_subsets, end_of_epoch)
        if should_stop and stage_done and updates >= (cfg.optimization.max_update or math.inf):
            # --max-update at a stage's last update (a stream refuses one that is earlier):
            # fairseq would stop before its next epoch, whose start records the arrival this
            # stage answers, and exit 0 with the stream unfinished; its epoch loop ends anyway,
            # after the stream's last stage (--max-epoch: the stream's stages)
            should_stop = False
        return valid_losses, should_stop

    train_cli.validate_and_save = _mark(validate_and_save)


def install_command_patches() -> None:
    """The patches every process that imports fairseq with the plugin needs (package import).

    Why here: fairseq looks each patched name up at call time, so installing them before its
    command runs is enough; each is a no-op for what it does not concern (a run without expert
    shards, a command that is not fairseq's own)."""
    from .scoring_commands import install_scoring_command_patches

    install_console_errors()
    install_checkpoint_errors()
    install_training_flags()
    install_expert_parallel_trainer()
    install_every_block_scored()
    install_every_token_scored()
    install_scoring_command_patches()
    repair_fairseq_cli_logging()
    install_one_log_file_handler()
    install_torch_ddp_on_cpu()


def install_torch_ddp_on_cpu() -> None:
    """``--ddp-backend pytorch_ddp`` (fairseq's default) trains on CPU ranks (gloo) too.

    Why: fairseq 0.12 always passes ``device_ids=[args.device_id]`` to torch's
    ``DistributedDataParallel``, which torch refuses for a CPU module, so a CPU run on 2+ ranks
    without ``--ddp-backend legacy_ddp`` ended in a ``ValueError`` traceback on every rank.  For a
    module whose parameters are all on the CPU the wrapper passes no device (torch's own CPU
    usage); GPU modules get fairseq's arguments unchanged.  It also lets the CPU test suite run
    the backend GPU users train with (expert-parallel parameters left out of DDP's all-reduce)."""
    from fairseq.models import distributed_fairseq_model as module

    original = module.DistributedDataParallel
    if _patched(original):
        return

    def distributed_data_parallel(module: Any, device_ids: Any = None, output_device: Any = None,
                                  **kwargs: Any) -> Any:
        if all(param.device.type == "cpu" for param in module.parameters()):
            device_ids = output_device = None
        return original(module=module, device_ids=device_ids, output_device=output_device, **kwargs)

    module.DistributedDataParallel = _mark(distributed_data_parallel)


def install_one_log_file_handler() -> None:
    """fairseq's progress bar copies its lines to ``--log-file`` through one handler, not one
    more per epoch.

    Why: ``progress_bar.progress_bar(log_file=...)`` adds a new ``FileHandler`` to its logger at
    every call, and fairseq-train calls it once per epoch (and per validation): the N-th epoch's
    lines reach the file N times.  An alma_stream stage is an epoch, so a 100-stage run wrote its
    last stage's stats 100 times, and every tool reading the file saw each line repeated.  The
    wrapper passes ``log_file`` on only while no handler for that file is attached."""
    from fairseq.logging import progress_bar as module

    original = module.progress_bar
    if _patched(original):
        return

    def progress_bar(iterator: Any, *args: Any, **kwargs: Any) -> Any:
        log_file = kwargs.get("log_file")
        if log_file is not None and any(
                isinstance(handler, logging.FileHandler)
                and handler.baseFilename == os.path.abspath(log_file)
                for handler in module.logger.handlers):
            kwargs["log_file"] = None
        return original(iterator, *args, **kwargs)

    module.progress_bar = _mark(progress_bar)


def repair_fairseq_cli_logging() -> None:
    """fairseq-eval-lm, fairseq-validate, ...: log as fairseq_cli meant to (INFO, its format, on
    stdout), not as fairseq's import left it (DEBUG, Python's default format, on stderr).

    Why: those commands call ``logging.basicConfig`` after importing fairseq, whose wav2vec2
    classification module has already called ``basicConfig(level=DEBUG)``; theirs is then a
    no-op, and every run starts with hydra's and other libraries' DEBUG lines, its own lines
    in another format on stderr (fairseq-train configures logging before its imports and is
    not affected).  Only that exact state is repaired, and only under a fairseq command: the
    root logger at DEBUG with the one default-format handler on stderr."""
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    root = logging.getLogger()
    if not program.startswith("fairseq-") or root.level != logging.DEBUG or len(root.handlers) != 1:
        return
    handler = root.handlers[0]
    default = handler.formatter is None or handler.formatter._fmt == logging.BASIC_FORMAT
    if type(handler) is logging.StreamHandler and handler.stream is sys.stderr and default:
        level = (os.environ.get("LOGLEVEL") or "INFO").upper()  # fairseq_cli's own variable
        known = isinstance(logging.getLevelName(level), int)
        logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s",
                            datefmt="%Y-%m-%d %H:%M:%S", stream=sys.stdout, force=True,
                            level=level if known else "INFO")
        if not known:  # fairseq's own basicConfig ignored it (it was a no-op): say so, go on
            logging.getLogger(__name__).warning("LOGLEVEL=%s is no logging level (DEBUG, INFO, "
                                                "WARNING, ERROR); logging at INFO", level)


def install_every_block_scored() -> None:
    """fairseq-eval-lm and fairseq-validate: a block longer than the model's positions is
    refused in one line instead of being left out of the score.

    Why: fairseq-eval-lm asks for its batches with ``ignore_invalid_inputs=True``, so
    ``FairseqTask.filter_indices_by_size`` drops such blocks with a warning and the perplexity
    it prints is of what is left: with ``--tokens-per-sample`` above the model's positions that
    is nothing, and it printed "Loss (base 2): 0.0000, Perplexity: 1.00".  fairseq-validate
    does the same under ``--skip-invalid-size-inputs-valid-test`` (an IndexError when nothing
    is left) and raises a bare Exception without it.  Only in these two commands: training's
    validation keeps fairseq's flag, and alma-score refuses such a block length itself."""
    from fairseq.tasks import FairseqTask

    original = FairseqTask.filter_indices_by_size
    if _patched(original) or not _running(("fairseq-eval-lm", "fairseq-validate"),
                                          ("fairseq_cli.eval_lm", "fairseq_cli.validate")):
        return

    def filter_indices_by_size(self: Any, indices: Any, dataset: Any, max_positions: Any = None,
                               ignore_invalid_inputs: bool = False) -> Any:
        from ..lm.block_lengths import blocks_too_long

        kept, too_long = blocks_too_long(dataset, indices, max_positions, "to score")
        if too_long is not None:
            from ..errors import UsageError

            raise UsageError(f"{too_long}: pass --tokens-per-sample {max_positions} or less")
        return kept

    FairseqTask.filter_indices_by_size = _mark(filter_indices_by_size)


def install_every_token_scored() -> None:
    """fairseq-eval-lm: a token scored with an infinite log-probability is refused in one line
    instead of being left out of the perplexity.

    Why: fairseq-eval-lm drops every ±inf token score from its sums ("skipping tokens with inf
    scores", a log call that itself fails to format), so the perplexity it prints is of the
    tokens the model did not rule out: lower than the truth, by as much as the worst tokens
    weigh.  A logit beyond the float range does it, most easily under ``--fp16`` (half
    precision ends at 65,504).  alma-score refuses a non-finite loss (``lm/nll.non_finite_loss``)."""
    from fairseq.sequence_scorer import SequenceScorer

    original = SequenceScorer.generate
    if _patched(original) or not _running(("fairseq-eval-lm",), ("fairseq_cli.eval_lm",)):
        return

    def generate(self: Any, models: Any, sample: Any, **kwargs: Any) -> Any:
        import torch

        hypos = original(self, models, sample, **kwargs)
        scores = [hypo[0]["positional_scores"] for hypo in hypos if hypo]
        if scores and bool(torch.stack([s.isinf().any() for s in scores]).any()):  # one sync
            from ..errors import UsageError

            count = sum(int(s.isinf().sum()) for s in scores)
            tokens = f"{count:,} token{'s' if count != 1 else ''}"
            raise UsageError(f"{tokens} of a batch score an infinite log-probability (a logit beyond "
                             f"the float range: in half precision above 65,504); fairseq-eval-lm "
                             f"would leave them out of the perplexity, which would look better than it "
                             f"is: score in fp32 (drop --fp16), or with alma-score")
        return hypos

    SequenceScorer.generate = _mark(generate)


def install_stream_training_patches() -> None:
    """The patches only an ``alma_stream`` training process needs: they change how fairseq-train
    saves and ends epochs, which a scoring process or a plain fairseq task must not see."""
    from .fp16_master import install_fp16_master_in_checkpoints

    install_atomic_copies()
    install_requeue_save()
    install_fp16_master_in_checkpoints()


# ---- expert parallelism and fairseq's Trainer --------------------------------------------
def install_expert_parallel_trainer() -> None:
    """Three Trainer members for models whose experts are sharded over ranks.

    Why: fairseq's Trainer assumes every rank holds the same parameters.  With expert shards
    (``modules/expert_parallel.py``), (1) ``state_dict()`` is a collective (the full [E, ...]
    expert tensors are gathered), so every rank must call it during a save, which fairseq does
    when ``always_call_state_dict_during_save_checkpoint`` is true (made for FSDP); and (2) the
    optimizer's state of a shard must be gathered on save and sliced on load, by hooks on the
    torch optimizer that fairseq builds lazily in ``_build_optimizer``; (3) the gradient norm
    (``--clip-norm``, the logged ``gnorm``) takes in every rank's experts, as one process's does
    (``expert_parallel.norm_with_experts``).  Models without shards see fairseq's behaviour
    unchanged.
    """
    from fairseq.trainer import Trainer

    from .expert_parallel import (
        check_training_setup,
        expert_parallel_layers,
        innermost_torch_optimizer,
        norm_with_experts,
        register_optimizer_hooks,
    )

    if _patched(Trainer._build_optimizer):
        return
    base_always_call = Trainer.always_call_state_dict_during_save_checkpoint.fget
    base_build_optimizer = Trainer._build_optimizer

    def always_call_state_dict(self: Any) -> bool:
        return base_always_call(self) or bool(expert_parallel_layers(self._model))

    def _build_optimizer(self: Any) -> None:
        layers = expert_parallel_layers(self._model)
        if layers:
            check_training_setup(self.cfg)
        base_build_optimizer(self)
        if layers:
            register_optimizer_hooks(innermost_torch_optimizer(self._optimizer), layers)

    base_clip_grad_norm = Trainer.clip_grad_norm

    def clip_grad_norm(self: Any, clip_norm: float) -> Any:
        layers = expert_parallel_layers(self._model)
        if not layers:
            return base_clip_grad_norm(self, clip_norm)
        return self.optimizer.clip_grad_norm(
            clip_norm, aggregate_norm_fn=functools.partial(norm_with_experts, layers))

    Trainer.always_call_state_dict_during_save_checkpoint = property(always_call_state_dict)
    Trainer._build_optimizer = _mark(_build_optimizer)
    Trainer.clip_grad_norm = _mark(clip_grad_norm)


# ---- unreadable checkpoints ----------------------------------------------------------------
_UNREADABLE = (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, ValueError,
               KeyError, IndexError, AttributeError)


def install_checkpoint_errors() -> None:
    """``checkpoint_utils.load_checkpoint_to_cpu``: a file torch cannot read, or whose records
    fail their CRC check, raises a one-line ``CheckpointError`` naming it and the way out.

    Why: fairseq resumes from ``checkpoint_last.pt`` and loads checkpoints for scoring through
    this function; a truncated or damaged file (a disk fault, a copy cut short by hand) ends in
    a torch traceback that names neither the file nor what to do.  The trainer and
    ``load_model_ensemble_and_task`` look the function up in the module when they call it.
    """
    from fairseq import checkpoint_utils

    original = checkpoint_utils.load_checkpoint_to_cpu
    if _patched(original):
        return

    def load_checkpoint_to_cpu(path: str, arg_overrides: Any = None,
                               load_on_all_ranks: bool = False) -> Any:
        from ..checkpoint_load import TRUST_FLAG, unreadable, unsafe_type
        from ..stream.run_view import checked_checkpoint

        checked_checkpoint(path)
        try:
            return original(path, arg_overrides, load_on_all_ranks)
        except pickle.UnpicklingError as err:  # torch's weights_only refusal (checkpoint_load.py)
            if "weights_only" in str(err) or "Unsupported global" in str(err):
                raise CheckpointError(f"{path}: holds {unsafe_type(err)}, which fairseq-alma's "
                                      f"checkpoints never hold; loading it would run code from the "
                                      f"file: load it only if you trust where it came from "
                                      f"({TRUST_FLAG})") from None
            raise unreadable(path, err) from None
        except _UNREADABLE as err:
            if isinstance(err, KeyError) and _vision_checkpoint(path):  # fairseq looked for its keys
                raise CheckpointError(f"{path}: a vision stream's checkpoint (--arch alma_vision), not a "
                                      f"language model's; its test errors are in its run's stream.jsonl "
                                      f"(alma-score --from-log, alma-report)") from None
            raise unreadable(path, err) from None

    checkpoint_utils.load_checkpoint_to_cpu = _mark(load_checkpoint_to_cpu)


def _vision_checkpoint(path: str) -> bool:
    """Whether ``path`` is a vision learner's checkpoint, which fairseq's loader would call
    unreadable (it holds no fairseq training state) although nothing is wrong with it."""
    from ..checkpoint_load import load_checkpoint
    from ..vision.runner import CHECKPOINT_FORMAT

    try:
        state = load_checkpoint(path)
    except Exception:  # noqa: BLE001 - unreadable after all: fairseq's error stands
        return False
    return isinstance(state, dict) and state.get("format") == CHECKPOINT_FORMAT


# ---- quiet start-up ---------------------------------------------------------------------------
HYDRA_DEPRECATIONS = (
    r"hydra\.experimental\.(initialize|compose)\(\) is no longer experimental",
    r"\s*The version_base parameter is not specified",
    r"In 'config': Usage of deprecated keyword in package header",
    r"\s*'config' is validated against ConfigStore schema",
    r"\s*The strict flag in the compose API is deprecated",
)


def install_quiet_startup() -> None:
    """Silence the deprecation warnings hydra prints when fairseq 0.12 builds its config.

    Why: fairseq turns its argparse namespace into a config through hydra's deprecated
    ``experimental.initialize``/``compose`` with a 1.0-style schema; hydra 1.3 warns about each
    of those on every start (about 20 lines in front of every run's log), which buries the
    lines users need.  Only these exact messages are filtered; every other warning stays.
    """
    for message in HYDRA_DEPRECATIONS:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    # fairscale 0.4.13 (imported by fairseq's fsdp_wrap) uses torch.cuda.amp's deprecated API;
    # under fairseq-train that import comes before the plugin's, so `make install` also puts
    # this filter in the venv's site-packages (quiet_imports.pth, next to this file)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"fairscale\.")
    # fairseq 0.12's train and valid steps enter torch.cuda.amp.autocast (deprecated in torch 2.4)
    warnings.filterwarnings("ignore", message=r"`torch\.cuda\.amp\.autocast\(args\.\.\.\)` is deprecated",
                            category=FutureWarning, module=r"fairseq\.")
    # fairseq's iterators ask for pinned memory, which a host without an accelerator cannot give
    warnings.filterwarnings("ignore", message=r".*'pin_memory' argument is set as true but no accelerator",
                            category=UserWarning)


@contextlib.contextmanager
def undo_debug_root_logging() -> Iterator[None]:
    """Keep fairseq's import from turning every library's DEBUG records on.

    Why: one of fairseq 0.12's model modules calls ``logging.basicConfig(level=DEBUG)`` when it
    is imported. Under ``fairseq-train`` that does nothing, since fairseq_cli has configured
    logging (INFO) before. In our own tools, benchmarks and notebooks, fairseq's import comes
    first, so the root logger ends up at DEBUG, and matplotlib's font search, filelock's locks
    and inductor's compiler print hundreds of DEBUG lines in front of the results. When the
    import is what set DEBUG, the root level goes back to INFO: the INFO lines those tools
    print stay, in the same format. A root logger someone else configured is left alone.
    """
    root = logging.getLogger()
    configured_before = bool(root.handlers) or root.level == logging.DEBUG
    yield
    if not configured_before and root.level == logging.DEBUG:
        root.setLevel(logging.INFO)
