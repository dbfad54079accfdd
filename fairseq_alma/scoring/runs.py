"""Run directories as ``alma-score`` needs them: read through ``RunView``, checked scorable.

Why separate from the scoring: everything here is about *which* runs may be scored and what they
say about themselves (records, stage checkpoints, flags); ``series.py`` turns them into series.
Every refusal is a one-line ``UsageError`` naming the file and the way out.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DataError, RunDirError, UsageError
from ..report.inputs import lm_experts_label, setting_name, vision_size_label
from ..stream.records import ArrivalRecord
from ..stream.run_view import RunView, recovery_hint
from ..stream.series import flops_convention
from . import LOGGER_NAME

logger = logging.getLogger(LOGGER_NAME)


@dataclass
class StreamRun:
    """One run dir: its per-arrival records and, for an LM, its stage checkpoints' configs."""

    view: RunView  # its records, files and what they say (stream/run_view.py)
    checkpoints: dict[int, str]  # stage s -> its stage checkpoint
    initial: str | None = None  # stage 0's checkpoint: the initialised model (runs with --wait > 1)
    cfg: Any = None  # fairseq config of the last stage checkpoint (None: a vision log)
    experts: int | None = None  # active experts per MoE block at the last stage
    fingerprint: dict | None = None  # run.json's (None: a run of fairseq-alma 0.1)
    dictionaries: dict[int, str | None] = field(default_factory=dict)  # stage -> dict sha256

    @property
    def path(self) -> Path:
        return self.view.path

    @property
    def records(self) -> list[ArrivalRecord]:
        return self.view.records

    @property
    def metric(self) -> str:
        """"ppl" for a language-model stream, "error" for a vision stream."""
        return self.view.metric

    @property
    def stages(self) -> list[int]:
        return self.view.trained_stages

    @property
    def waits(self) -> bool:
        """Arrivals 1.. come before the first training: the initial model answers them."""
        return self.view.waits

    def logged_metric(self) -> list[float | None]:
        """The metric the run recorded at every arrival (the initial model's before training)."""
        if self.metric == "error":
            return [r.test_error for r in self.records]
        return [r.eval_ppl for r in self.records]

    def experts_label(self) -> str:
        if self.cfg is None:  # vision sweep records say what they trained
            return vision_size_label(self.records[-1])
        return lm_experts_label(self.cfg.model, self.experts)

    def default_setting(self, prefix: str | None = None) -> str:
        """Table 2's names: 'SM_w1', 'Ens_w4 (4x steps)', 'gEns_w1'; ' replay' when replaying."""
        if self.cfg is None:
            return setting_name(self.records[-1].extra, prefix)
        scheduler = self.cfg.get("lr_scheduler")  # a Namespace for --lr-scheduler manual
        schedule = getattr(scheduler, "stage_lr_schedule", None) if scheduler is not None else None
        return setting_name(self.cfg.task, prefix, schedule, model=self.cfg.model)


def load_run(run_dir: str, data: str | None, from_log: bool) -> StreamRun:
    """Read and check one run dir (records, stage checkpoints of this run, complete stream);
    ``data`` is the stream it will be scored on (None: its own), ``from_log`` whether only its
    logged metric is read (no checkpoint is then needed, and a vision log is accepted)."""
    from omegaconf import OmegaConf

    view = RunView.open(run_dir)
    records = view.records
    if len(records) < 2:
        raise UsageError(f"{view.stream_log}: needs arrivals 0..B in order; re-run the "
                         f"training command to complete it")
    run = StreamRun(view, {})
    if run.metric == "error":
        if not from_log:
            raise UsageError(f"{view.path}: a vision stream (test_error): only --from-log reads it")
        # as an LM's: a run stopped at arrival 5 of B = 10 printed a CER over 5 arrivals as the
        # stream's, and its JSON (without the fingerprint) carried it into alma-report
        run.fingerprint = view.fingerprint
        view.require_finished()
        return run
    if not run.stages:
        raise UsageError(f"{view.stream_log}: no stage has trained yet; nothing to score")
    run.checkpoints = {stage: str(path) for stage, path in view.trained_checkpoints().items()}
    initial = view.initial_checkpoint()
    run.initial = str(initial) if initial is not None and run.waits and not from_log else None
    run.fingerprint = view.fingerprint
    view.require_trusted_records()
    expected = view.run_hash()
    kept = {**run.checkpoints, **({0: run.initial} if run.initial else {})}
    for stage, ckpt in sorted(kept.items()):
        state = _read_checkpoint(ckpt)
        alma = state.get("alma") or {}
        _check_stage_identity(ckpt, stage, state, bool(expected))
        if expected and alma.get("run") and alma["run"] != expected:
            raise RunDirError(f"{ckpt} belongs to another run than {view.run_file} (a "
                              f"restarted or mixed --save-dir); train this stream again with "
                              f"--restart-stream, or score the run it came from")
        # The file name alone says which arrivals a checkpoint answers: a renamed or swapped
        # file would score silently under another stage's column.
        if alma.get("stage") is not None and int(alma["stage"]) != stage:
            raise RunDirError(f"{ckpt}: holds the model of stage {alma['stage']}, not of stage "
                              f"{stage} as its name says (renamed or swapped); rename it back to "
                              f"{view.stage_checkpoint(int(alma['stage'])).name}")
        run.dictionaries[stage] = alma.get("dictionary")
    state = _read_checkpoint(run.checkpoints[run.stages[-1]])
    # allow_objects, as fairseq's own loader: a pre-dataclass optimizer's config is a Namespace
    run.cfg = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
    counts = [int(v) for k, v in state["model"].items() if k.endswith("num_active")]
    run.experts = max(counts) if counts else run.cfg.model.get("moe_experts")
    _check_complete(view, data or run.cfg.task.data, from_log)
    if not from_log:  # --from-log reads the logged metric of the run's own data, not this one
        _check_same_data(view, data or run.cfg.task.data)
    return run


def _check_stage_identity(ckpt: str, stage: int, state: dict, stamped_run: bool) -> None:
    """A file under a stage checkpoint's name that training did not keep for that stage.

    Why: every stage checkpoint of a run with ``run.json`` carries training's stamp (``alma``:
    run and stage; ``lm/stage_checkpoints.py``), but a file without it was accepted: a copy of
    ``checkpoint_last.pt`` put in place of a lost stage checkpoint (as "restore it from a copy"
    invites) scored the last stage's model under stage 2's column (64.38 for 96.36), and one
    over ``checkpoint_stage0.pt`` erased the cost of waiting from the anytime metric.  A run
    from before the stamp (no run.json) is checked by what fairseq saved: the training position
    at a stage's end is (epoch stage + 1, 0 iterations in it).

    A stamp with the digest of the weights (``lm/stage_checkpoints.weights_digest``) must match
    the file's tensors: fairseq's ``average_checkpoints.py`` keeps its first input's stamp, so
    the average of a grown run's stages 2 and 3 (5 active experts, which the run never had)
    scored 102.30 in stage 2's column (its own model: 119.05).  A stamp written before the
    digest existed is not checked for it."""
    alma = state.get("alma") or {}
    if alma.get("stage") is not None and (alma.get("run") or not stamped_run):
        _check_weights_digest(ckpt, stage, state, alma)
        return
    itr = (state.get("extra_state") or {}).get("train_iterator") or {}
    epoch = itr.get("epoch")
    if stamped_run or epoch != stage + 1 or itr.get("iterations_in_epoch", 0) != 0:
        where = f"fairseq's stage {int(epoch) - 1} position" if isinstance(epoch, int) else \
            "no training position"
        raise RunDirError(f"{ckpt}: not the model this run kept for stage {stage} (no stage stamp; "
                          f"it holds {where}: a copy of checkpoint_last.pt or another run's file?); "
                          f"{recovery_hint(ckpt)}")


def _check_weights_digest(ckpt: str, stage: int, state: dict, alma: dict) -> None:
    """The stamped digest of the weights against the file's tensors (``_check_stage_identity``)."""
    from ..lm.stage_checkpoints import WEIGHTS_DIGEST_KEY, weights_digest

    stamped = alma.get(WEIGHTS_DIGEST_KEY)
    if stamped is not None and weights_digest(state.get("model") or {}) != stamped:
        raise RunDirError(f"{ckpt}: not the model this run kept for stage {stage} (its weights "
                          f"differ from the digest training stamped on it: an averaged, edited or "
                          f"fine-tuned copy?); {recovery_hint(ckpt)}")


def _read_checkpoint(path: str) -> dict:
    """A stage checkpoint, memory-mapped (only what is read is paged in), never unpickling
    anything but tensors and plain values (``checkpoint_load.py``)."""
    from ..checkpoint_load import load_checkpoint

    return load_checkpoint(path, mmap=True)


def _check_complete(view: RunView, data: str, from_log: bool) -> None:
    """An unfinished run has fewer arrivals than its stream's B: scoring it would mislabel t.
    B is the data's (the stream it is scored on), else the run's fingerprint's."""
    from fairseq_alma.stream.manifest import load_manifest

    if from_log and view.num_megabatches is not None:  # the logged metric is of its own stream
        view.require_finished(view.num_megabatches)
        return
    try:
        b = int(load_manifest(data.split(os.pathsep)[0])["num_megabatches"])
    except DataError as err:
        if from_log and view.num_megabatches is None:  # logs copied without their data
            logger.warning("%s; cannot check that %s is complete", err, view.path)
            return
        if not from_log:
            raise UsageError(f"{err} (the data of {view.path}; point --data at it)") from None
        b = view.num_megabatches
    view.require_finished(b)


def _check_same_data(view: RunView, data: str) -> None:
    """Refuse to score on a stream other than the one the run trained on: a stream rebuilt in
    place (another --eval-size moves training documents into the evaluation split) or a relative
    cfg.task.data resolved from another directory would give numbers on the wrong data.  The
    identity is training's own (``data_identity``, in run.json's fingerprint), which leaves out
    where the stream lives, so a copy elsewhere passed with --data is accepted.  A run without
    that record (0.1: no run.json, or a fingerprint without ``data``) cannot be checked."""
    from fairseq_alma.stream.manifest import data_identity, load_manifest

    recorded = (view.fingerprint or {}).get("data")
    if not isinstance(recorded, dict):
        # debug, not warning: a refusal about another file must stay one line on stderr
        logger.debug("%s records no data identity; cannot check that %s is its stream",
                     view.path, data)
        return
    directory = data.split(os.pathsep)[0]
    try:
        current = data_identity(load_manifest(directory))
    except DataError as err:
        raise UsageError(f"{err} (the data of {view.path}; point --data at it)") from None
    # keys the recorded identity lacks were added to it later (e.g. ``tokenizer``): not compared
    differing = [key for key in recorded if recorded[key] != current.get(key)]
    if differing:  # the dictionary first: the reason the task itself gives for that case
        what = ("another dictionary" if "dictionary" in differing else
                f"other data ({', '.join(differing)} differ)")
        raise UsageError(f"{view.path} was trained with {what} than {directory} (the data "
                         f"identity in {view.run_file}); score it on the stream it was trained "
                         f"on, or point --data at it")


def check_members(runs: list[StreamRun], mode: str) -> None:
    """Ens members share one stream schedule; gEns needs fresh members, each on its own stage."""
    first = runs[0]
    if mode == "gens":
        init, replay = first.cfg.task.get("stage_init", "continue"), first.cfg.task.get("replay")
        if init != "scratch" or replay:
            raise UsageError(f"--mode gens: {first.path} was trained with --stage-init {init}"
                             f"{' --replay' if replay else ''}; gEns members need a run with "
                             f"--stage-init scratch and no --replay")
        return
    for run in runs[1:]:
        data = [r.fingerprint.get("data") if r.fingerprint else None for r in (first, run)]
        dicts = [set(r.dictionaries.values()) - {None} for r in (first, run)]
        if (None not in data and data[0] != data[1]) or (all(dicts) and dicts[0] != dicts[1]):
            raise UsageError(f"--mode ens: {run.path} was trained on another stream (data or "
                             f"dictionary) than {first.path}; members must share one stream")
        if flops_convention(run.records) != flops_convention(first.records):
            raise UsageError(f"--mode ens: {run.path} counts FLOPs with --flops-convention "
                             f"{flops_convention(run.records)}, {first.path} with "
                             f"{flops_convention(first.records)}; members must count alike")
        if len(run.records) != len(first.records):
            raise UsageError(f"--mode ens: {run.path} has B = {len(run.records) - 1} mega-batches "
                             f"but {first.path} has B = {len(first.records) - 1}; members must "
                             f"run the same stream")
        if [r.trained for r in run.records] != [r.trained for r in first.records]:
            # --wait auto is one setting whose seeds may decide differently (task.wait None)
            auto = all(r.cfg.task.get("wait", 1) is None for r in (first, run))
            why = "--wait auto decided other arrivals for each seed" if auto else "--wait differs"
            raise UsageError(f"--mode ens: {run.path} trains at other arrivals than {first.path} "
                             f"({why}); members must share one schedule")
    _check_ens_seeds(runs)


def _check_ens_seeds(runs: list[StreamRun]) -> None:
    """Ens members are one setting trained with different seeds (alma-report's rule,
    ``report/seeds.py``): a member trained otherwise is another model, and a copy (same
    fingerprint and seed) would count its compute twice for one model's perplexity.  Settings
    that change how a run computes, not what (``EXECUTION_SETTINGS``), may differ, and so may
    the spelling of one growth plan (``--grow-experts 2`` and ``2,2``: ``stream/growth_plan``)."""
    from ..fairseq_glue.config import run_fingerprint
    from ..report.seeds import SEED_KEYS, without_keys
    from ..stream.growth_plan import with_parsed_growth_plan
    from ..stream.run_dir import fingerprint_differences, without_execution_settings

    # a member without run.json (fairseq-alma 0.1) is compared by its stage checkpoint's
    # config, as training fingerprints it (then every member is: run.json holds more keys);
    # it was let through, so members trained with another --lr or budget averaged as seeds
    from_checkpoints = any(run.fingerprint is None for run in runs)

    def settings(run: StreamRun) -> dict:
        fingerprint = {"config": run_fingerprint(run.cfg)} if from_checkpoints else run.fingerprint
        # run.json's data identity says the stream's B; a 0.1 run's records do
        fingerprint = with_parsed_growth_plan(fingerprint, len(run.records) - 1 if from_checkpoints else None)
        return without_keys(without_execution_settings(fingerprint), SEED_KEYS)

    first = runs[0]
    seen: dict[Any, StreamRun] = {}
    for run in runs:
        if run is not first:
            changed = fingerprint_differences(settings(first), settings(run))
            if changed:
                shown = "; ".join(changed[:3]) + (f"; and {len(changed) - 3} more"
                                                  if len(changed) > 3 else "")
                raise UsageError(f"--mode ens: {run.path} differs from {first.path} in more "
                                 f"than the seed ({shown}); members must share every training "
                                 f"setting but --seed")
        seed = run.cfg.common.get("seed")
        if seed in seen:
            raise UsageError(f"--mode ens: {seen[seed].path} and {run.path} have the same "
                             f"fingerprint and seed ({seed}): the same run given twice, or "
                             f"copies; pass members trained with distinct --seed")
        seen[seed] = run
