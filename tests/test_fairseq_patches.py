"""One test per patch in fairseq_alma/fairseq_glue/patches.py: each fails if fairseq changes the code
the patch relies on (the name looked up at call time, the signature, the call site), and checks
what the patch does.  The end-to-end behaviour is tested where it matters (SIGUSR1 in
test_alma_stream.py, one-line errors in test_switch_cli.py, expert parallelism in
test_expert_parallel_train.py)."""

from __future__ import annotations

import inspect
import os
import pickle
import shutil

import pytest

from fairseq_alma.errors import Preempted, UsageError
from fairseq_alma.fairseq_glue import patches as fairseq_patches


def test_console_errors_reach_the_main_that_cli_main_calls(capsys):
    import fairseq_cli.eval_lm as eval_cli
    import fairseq_cli.train as train_cli

    # cli_main must look ``main`` up in its module when it runs (after --user-dir imported us)
    for module in (train_cli, eval_cli):
        assert "call_main(" in inspect.getsource(module.cli_main)
        assert ", main)" in inspect.getsource(module.cli_main)
    fairseq_patches.install_console_errors()
    assert fairseq_patches._patched(train_cli.main) and fairseq_patches._patched(eval_cli.main)
    # picklable by name, for fairseq's multi-GPU spawn
    assert fairseq_patches._patched(pickle.loads(pickle.dumps(train_cli.main)))

    def failing(cfg: object) -> None:
        raise UsageError("--moe-experts must be an integer >= 1 (got 0)")

    wrapped = fairseq_patches._ConsoleMain("fairseq_cli.train", failing)
    with pytest.raises(SystemExit) as caught:
        wrapped(None)
    assert caught.value.code == 2
    assert capsys.readouterr().err == "fairseq-alma: error: --moe-experts must be an integer >= 1 (got 0)\n"
    preempted = fairseq_patches._ConsoleMain("fairseq_cli.train", lambda cfg: (_ for _ in ()).throw(
        Preempted("preempted at update 7, checkpoint saved in 0.1s")))
    with pytest.raises(SystemExit) as caught:
        preempted(None)
    assert caught.value.code == 75 and "fairseq-alma: preempted at update 7" in capsys.readouterr().err


def test_checkpoint_copies_are_atomic(tmp_path, monkeypatch):
    from fairseq import checkpoint_utils
    from fairseq.file_io import PathManager

    # fairseq copies the first checkpoint of a save to its other names with PathManager.copy
    assert "PathManager.copy(" in inspect.getsource(checkpoint_utils.save_checkpoint)
    fairseq_patches.install_atomic_copies()
    assert fairseq_patches._patched(PathManager.copy)
    src, dst = tmp_path / "checkpoint_1_2.pt", tmp_path / "checkpoint_last.pt"
    src.write_bytes(b"new" * 1000)
    dst.write_bytes(b"old checkpoint")

    def killed(source, target, length=0):  # the process dies halfway through the copy
        target.write(source.read(10))
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "copyfileobj", killed)
    with pytest.raises(KeyboardInterrupt):
        PathManager.copy(str(src), str(dst), overwrite=True)
    assert dst.read_bytes() == b"old checkpoint"  # never a truncated checkpoint_last.pt
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name, dst.name]  # no temporary left
    monkeypatch.undo()
    assert PathManager.copy(str(src), str(dst), overwrite=True) and dst.read_bytes() == src.read_bytes()
    assert not PathManager.copy(str(src), str(dst), overwrite=False)  # fairseq's contract


def test_requeue_save_wraps_the_validate_and_save_that_train_calls():
    import fairseq_cli.train as train_cli
    from fairseq import checkpoint_utils

    # train() calls validate_and_save, looked up in its module, after every update
    assert "validate_and_save(" in inspect.getsource(train_cli.train)
    params = list(inspect.signature(train_cli.validate_and_save).parameters)
    assert params == ["cfg", "trainer", "task", "epoch_itr", "valid_subsets", "end_of_epoch"]
    # the settings save_for_requeue overrides are the ones save_checkpoint reads
    source = inspect.getsource(checkpoint_utils.save_checkpoint)
    for name in ("no_epoch_checkpoints", "save_interval_updates", "keep_best_checkpoints",
                 "no_last_checkpoints", "no_save", "keep_interval_updates"):
        assert f"cfg.{name}" in source, name
    # ending a stage's epoch early: the epoch's CountingIterator, truncated, reports its end
    import torch
    from fairseq.data import iterators

    epoch_itr = iterators.EpochBatchIterator(
        dataset=torch.utils.data.TensorDataset(torch.arange(6)), collate_fn=lambda s: s,
        batch_sampler=[[i] for i in range(6)])
    batches = epoch_itr.next_epoch_itr(shuffle=False)
    next(batches), next(batches)
    fairseq_patches.end_stage_epoch(epoch_itr)
    assert epoch_itr.end_of_epoch() and epoch_itr.state_dict()["epoch"] == 2
    assert epoch_itr.state_dict()["iterations_in_epoch"] == 0 and list(batches) == []
    assert "iterators.GroupedIterator(" in inspect.getsource(train_cli.train)
    fairseq_patches.install_requeue_save()
    assert fairseq_patches._patched(train_cli.validate_and_save)
    assert fairseq_patches._patched(iterators.GroupedIterator)
    epoch_itr = iterators.EpochBatchIterator(
        dataset=torch.utils.data.TensorDataset(torch.arange(8)), collate_fn=lambda s: s,
        batch_sampler=[[i] for i in range(8)], epoch=1)
    groups = iterators.GroupedIterator(epoch_itr.next_epoch_itr(shuffle=False), 2)
    next(groups)
    fairseq_patches.end_stage_epoch(epoch_itr)  # after one update of two batches
    assert not groups.has_next() and list(groups) == []
    overrides = fairseq_patches._CheckpointOverrides(type("C", (), {"save_dir": "d", "no_save": True})(),
                                                     no_save=False)
    assert overrides.save_dir == "d" and overrides.no_save is False


def test_expert_parallel_trainer_members_exist_and_are_wrapped():
    from fairseq import checkpoint_utils
    from fairseq.trainer import Trainer

    assert isinstance(inspect.getattr_static(Trainer, "always_call_state_dict_during_save_checkpoint"),
                      property)
    assert "trainer.always_call_state_dict_during_save_checkpoint" in inspect.getsource(
        checkpoint_utils.save_checkpoint)
    assert "self._build_optimizer()" in inspect.getsource(Trainer)
    fairseq_patches.install_expert_parallel_trainer()
    assert fairseq_patches._patched(Trainer._build_optimizer)


def test_training_config_undoes_the_tpu_mode_of_bf16_after_parsing(monkeypatch):
    """fairseq's parser sets ``tpu`` with ``--bf16``; the console commands convert the namespace
    through the name in their module after parsing, which the patch wraps (an explicit --tpu
    stays, and train_flags.check_precision refuses it)."""
    from argparse import Namespace

    import fairseq.options
    import fairseq_cli.train as train_cli

    assert "args.tpu = True" in inspect.getsource(fairseq.options.parse_args_and_arch)
    source = inspect.getsource(train_cli.cli_main)
    assert source.index("parse_args_and_arch") < source.index("convert_namespace_to_omegaconf(args)")
    seen = []
    wrapped = fairseq_patches._TrainingConfig("fairseq_cli.eval_lm", lambda args: seen.append(args.tpu) or args)
    monkeypatch.setattr("sys.argv", ["fairseq-train", "data", "--bf16"])
    wrapped(Namespace(bf16=True, tpu=True))
    monkeypatch.setattr("sys.argv", ["fairseq-train", "data", "--bf16", "--tpu"])
    wrapped(Namespace(bf16=True, tpu=True))
    assert seen == [False, True]


def test_flat_bf16_master_params_replace_fairseqs_per_parameter_copies(monkeypatch):
    """fairseq builds one fp32 copy per parameter under --bf16 (what the patch replaces) and
    constructs the optimizer as the patch does; the flat copy is chosen only on CUDA without
    the flags that need per-parameter copies."""
    import torch
    from fairseq.optim.fp16_optimizer import FP16Optimizer
    from omegaconf import OmegaConf

    fairseq_patches.install_flat_bf16_master()
    fairseq_patches.install_flat_bf16_master()  # idempotent
    original = inspect.getsource(FP16Optimizer.__dict__["build_optimizer"].__func__.__wrapped__)
    assert 'if getattr(cfg.common, "bf16", False):\n            flatten = False' in original
    assert "return cls(cfg, params, fp32_optimizer, fp32_params, **kwargs)" in original
    assert "flatten" in inspect.signature(FP16Optimizer.build_fp32_params).parameters

    def cfg(**common):
        return OmegaConf.create({"common": {"bf16": True, "tpu": False, "fp16_no_flatten_grads": False, **common},
                                 "distributed_training": {"zero_sharding": "none"}})

    params = [torch.nn.Parameter(torch.zeros(2))]
    assert not fairseq_patches.flat_bf16_master(cfg(), params)  # no CUDA here
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert fairseq_patches.flat_bf16_master(cfg(), params)
    assert not fairseq_patches.flat_bf16_master(cfg(bf16=False), params)
    assert not fairseq_patches.flat_bf16_master(cfg(fp16_no_flatten_grads=True), params)
    sharded = cfg()
    sharded.distributed_training.zero_sharding = "os"
    assert not fairseq_patches.flat_bf16_master(sharded, params)
    params[0].expert = True  # an expert-parallel shard
    assert not fairseq_patches.flat_bf16_master(cfg(), params)


def test_fairseqs_debug_basic_config_on_import_is_undone_only_when_it_set_it(monkeypatch):
    import logging

    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", [])
    monkeypatch.setattr(root, "level", logging.WARNING)
    with fairseq_patches.undo_debug_root_logging():
        logging.basicConfig(level=logging.DEBUG)  # what fairseq's wav2vec2 module does
    assert root.level == logging.INFO and len(root.handlers) == 1
    root.setLevel(logging.DEBUG)  # a user who asked for DEBUG keeps it
    with fairseq_patches.undo_debug_root_logging():
        logging.basicConfig(level=logging.DEBUG)
    assert root.level == logging.DEBUG


# Test-only sitecustomize: holds the import of fairseq.tasks (inside fairseq_alma's own import of
# fairseq) until a signal arrives, after leaving a mark, so the test's SIGINT lands there every time.
PAUSE_IN_IMPORT = """
import os, sys, time

class _Pause:
    def find_spec(self, name, path=None, target=None):
        if name == "fairseq.tasks":
            open(os.environ["ALMA_TEST_IMPORT_MARK"], "w").close()
            time.sleep(120)
        return None

sys.meta_path.insert(0, _Pause())
"""


def test_ctrl_c_while_our_tool_imports_fairseq_is_one_line(tmp_path):
    """A real SIGINT while alma-score is inside its import of fairseq (held there by a test-only
    sitecustomize, so the signal cannot come too early or too late): one line and the shell's
    status 130, as Ctrl-C later gets, not a traceback through the import machinery."""
    import signal
    import subprocess
    import time

    from lm_fixtures import THREADS, tool

    (tmp_path / "sitecustomize.py").write_text(PAUSE_IN_IMPORT)
    mark = tmp_path / "importing"
    env = {**os.environ, **THREADS, "ALMA_TEST_IMPORT_MARK": str(mark),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    # (alma-score --help answers without fairseq; scoring imports it once the flags are checked)
    proc = subprocess.Popen([tool("alma-score"), str(tmp_path / "run")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert mark.exists(), proc.communicate(timeout=60)[1][-2000:]
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err == "alma-score: interrupted\n" and out == "", err[-2000:]


def test_a_diverged_run_is_one_line_with_its_own_status(capsys):
    """fairseq's Trainer raises FloatingPointError for NaN/inf gradients and for a loss scale at
    its floor; fairseq-train's wrapper turns it into one line and exit 1 (not 2: no usage error;
    not 75: Slurm must not requeue a run that would diverge again)."""
    import fairseq.optim.dynamic_loss_scaler as scaler
    import fairseq.trainer as trainer

    assert 'raise FloatingPointError("gradients are Nan/Inf")' in inspect.getsource(trainer.Trainer.train_step)
    assert "raise FloatingPointError(" in inspect.getsource(scaler)

    def diverging(cfg: object) -> None:
        raise FloatingPointError("gradients are Nan/Inf")

    with pytest.raises(SystemExit) as caught:
        fairseq_patches._ConsoleMain("fairseq_cli.train", diverging)(None)
    assert caught.value.code == fairseq_patches.DIVERGED_EXIT_STATUS == 1
    assert capsys.readouterr().err.startswith("fairseq-alma: error: training diverged: gradients are Nan/Inf (")
    with pytest.raises(FloatingPointError):  # elsewhere a bug keeps its traceback
        fairseq_patches._ConsoleMain("fairseq_cli.eval_lm", diverging)(None)


def test_scoring_commands_filter_blocks_through_the_patched_task_method():
    """fairseq-eval-lm and fairseq-validate get their batches from ``task.get_batch_iterator``,
    which drops blocks longer than the model in ``filter_indices_by_size`` (looked up on the
    task at call time), and parse their flags through ``convert_namespace_to_omegaconf`` looked
    up in their module (where ``_TrainingConfig`` checks them)."""
    import fairseq_cli.eval_lm as eval_cli
    import fairseq_cli.validate as validate_cli
    from fairseq.tasks import FairseqTask
    from fairseq.tasks.language_modeling import LanguageModelingTask

    assert "self.filter_indices_by_size(" in inspect.getsource(FairseqTask.get_batch_iterator)
    assert "ignore_invalid_inputs=True" in inspect.getsource(LanguageModelingTask.eval_lm_dataloader)
    def source(main: object) -> str:  # an earlier test may have wrapped it (_ConsoleMain)
        return inspect.getsource(getattr(main, "original", main))

    assert "task.eval_lm_dataloader(" in source(eval_cli.main)
    assert "task.get_batch_iterator(" in source(validate_cli.main)
    for module in (eval_cli, validate_cli):
        assert "convert_namespace_to_omegaconf(" in inspect.getsource(module.cli_main)


@pytest.mark.parametrize("loglevel, level", [(None, "INFO"), ("warning", "WARNING"), ("foo", "INFO"), ("", "INFO")])
def test_fairseq_commands_log_as_fairseq_cli_meant(monkeypatch, loglevel, level):
    """fairseq-eval-lm's state after fairseq's import (root at DEBUG, one default-format handler
    on stderr) becomes fairseq_cli's INFO (or LOGLEVEL) on stdout; a LOGLEVEL that is no level
    (fairseq's own basicConfig ignored it there) gives INFO and a warning, not a traceback."""
    import logging
    import sys

    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    monkeypatch.setattr(sys, "argv", ["fairseq-eval-lm"])
    if loglevel is None:
        monkeypatch.delenv("LOGLEVEL", raising=False)
    else:
        monkeypatch.setenv("LOGLEVEL", loglevel)
    try:
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, force=True)
        fairseq_patches.repair_fairseq_cli_logging()
        (handler,) = root.handlers
        assert logging.getLevelName(root.level) == level and handler.stream is sys.stdout
        assert " | %(levelname)s | " in handler.formatter._fmt
        monkeypatch.setattr(sys, "argv", ["alma-score"])  # not a fairseq command: left alone
        logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, force=True)
        fairseq_patches.repair_fairseq_cli_logging()
        assert root.level == logging.DEBUG and root.handlers[0].stream is sys.stderr
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.setLevel(saved[0])
        for handler in saved[1]:
            root.addHandler(handler)


def test_log_file_gets_one_handler_however_often_fairseq_builds_a_progress_bar(tmp_path):
    import logging

    import fairseq_cli.train as train_cli
    from fairseq.logging import progress_bar

    # train() builds its epoch's bar through the module attribute, with --log-file, per epoch
    assert "progress_bar.progress_bar(" in inspect.getsource(train_cli.train)
    assert "log_file=cfg.common.log_file" in inspect.getsource(train_cli.train)
    fairseq_patches.install_one_log_file_handler()
    assert fairseq_patches._patched(progress_bar.progress_bar)
    log_file = tmp_path / "train.log"
    before, level = list(progress_bar.logger.handlers), progress_bar.logger.level
    progress_bar.logger.setLevel(logging.INFO)  # fairseq-train's root logger is at INFO
    try:
        for epoch in (1, 2, 3):
            bar = progress_bar.progress_bar([], log_format="json", log_file=str(log_file), epoch=epoch)
            bar.print({"loss": 1.0 / epoch}, tag="train")
        lines = log_file.read_text().splitlines()
        assert [line.split(",")[0] for line in lines] == ['{"epoch": 1', '{"epoch": 2', '{"epoch": 3']
    finally:
        for handler in progress_bar.logger.handlers[len(before):]:
            progress_bar.logger.removeHandler(handler)
            handler.close()
        progress_bar.logger.setLevel(level)
    assert all(not isinstance(h, logging.FileHandler) or h in before for h in progress_bar.logger.handlers)


def test_torch_ddp_wrapper_is_the_name_fairseq_calls_with_a_device():
    from fairseq.models import distributed_fairseq_model

    # fairseq wraps with the module-level name, always giving it a device (a CPU module fails)
    source = inspect.getsource(distributed_fairseq_model.DistributedFairseqModel)
    assert "wrapped_model = DistributedDataParallel(" in source
    assert "device_ids=[args.device_id]" in source and "output_device=args.device_id" in source
    fairseq_patches.install_torch_ddp_on_cpu()
    assert fairseq_patches._patched(distributed_fairseq_model.DistributedDataParallel)
    # the end-to-end runs: test_distributed_stream.py (a stream), test_expert_parallel_train.py
