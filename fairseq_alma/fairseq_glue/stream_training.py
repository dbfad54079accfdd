"""What only a *training* process of an LM stream does (``tasks/alma_stream.py`` builds one in
``build_model`` unless fairseq loads a checkpoint for scoring).

* Takes the run directory: rank 0 locks it, every rank checks that ``run.json`` describes this
  run (or none), the first use of the data hashes every shard; the ranks agree before anything
  is trained (``ranks.py``).
* Derives fairseq's settings (``config.py``), installs the training patches
  (``patches.py``) and takes SIGUSR1/SIGTERM (``stream/stop.py``).
* Runs the stream core's stage-end protocol at every stage boundary (``StreamProgress``): keep
  ``checkpoint_stage{s}.pt``, evaluate on the evaluation mega-batch and the validation set,
  write ``stream.jsonl``; and the stage-start actions at a stage's first update (growth, fresh
  initialisation, optimizer reset).
* Keeps the progress in fairseq's checkpoint; the first stage boundary a process meets comes
  while fairseq is still restoring it, so it waits for ``set_checkpoint_dict`` (or, in a fresh
  run, for the first epoch).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Dict, List, Optional

from ..lm.flops import model_flops
from ..lm.nll import Batching, total_nll
from ..lm.stage_checkpoints import keep_initial_checkpoint, keep_stage_checkpoint
from ..optim.stage_lr_schedules import describe_schedule, stage_peak
from ..ranks import world
from ..stream.progress import StreamProgress
from ..stream.records import ArrivalRecord
from ..stream.replay import counted_replays
from ..stream.run_dir import RunDirectory, fingerprint_hash
from ..stream.schedule import ArrivalInfo
from ..stream.stage_clock import StageClock
from ..stream.stop import StopSignal, stage_limit

logger = logging.getLogger(__name__)


def _training_seconds() -> float:
    """Wall-clock seconds the run has spent so far: fairseq's ``wall`` meter, which the trainer
    starts at launch and carries over resumes in its checkpointed metrics (so a requeued run
    does not count the time it sat in the queue)."""
    from fairseq.logging import metrics as fairseq_metrics

    meter = fairseq_metrics.get_meter("default", "wall")
    return round(float(meter.elapsed_time), 3) if meter is not None else 0.0


class StreamTraining:
    """The training side of ``AlmaStreamTask`` (module doc)."""

    def __init__(self, task: Any) -> None:
        from .config import check_sharding, stage_lr_settings, stream_training_settings
        from .patches import install_stream_training_patches
        from .train_flags import check_stream_start

        self.task, self.cfg = task, task.cfg
        # flags first: a refused combination leaves the run directory untouched
        check_sharding(self.cfg, growth=bool(task.growth_plan))
        limit = stage_limit(task.plan.num_stages, self.cfg.max_epoch or None)
        check_stream_start(task, limit, self.cfg.save_dir, bool(self.cfg.restart_stream))
        self.run_dir, self.fingerprint = self.open_run_dir()
        self.progress = StreamProgress(task.plan, self.run_dir)
        self.growth: List[Dict[str, Any]] = []
        stream_training_settings(self.cfg, task.plan.num_stages, limit)
        install_stream_training_patches()
        self.stop = StopSignal().install()
        self.resuming = self.run_dir.last_checkpoint.exists()  # fairseq will restore it
        self.live = False  # False until this process knows the progress (fresh, or restored)
        self.deferred: Optional[int] = None  # a stage boundary met before that
        self.clock = StageClock(task.budget)  # counted / skipped updates of the stage
        self.clock_unknown = False  # resumed from a checkpoint written before the clock was saved
        self.started_stage = 0  # the last stage whose start actions ran
        self.lr_schedule = stage_lr_settings(self.cfg)  # (schedule, peak) of alma_stage_linear, or None
        self.log_stream_settings()

    def log_stream_settings(self) -> None:
        """Say, before the first update, what partial replay and the LR meta-schedule will do."""
        plan, budget = self.task.plan, self.task.budget
        if plan.replay_ratio > 0:
            replayed = plan.replay_slots(min(2, plan.num_stages), budget)
            logger.info("alma_stream: --replay-ratio %g: %d of every stage's %d updates train on batches drawn "
                        "from the mega-batches that arrived before the stage's new ones (stages 2-%d; stage 1 "
                        "has none and trains on its new data only)", plan.replay_ratio, replayed, budget,
                        plan.num_stages)
        if self.lr_schedule is not None:
            schedule, peak = self.lr_schedule
            logger.info("alma_stream: %s", describe_schedule(schedule, peak, plan.num_stages))

    def open_run_dir(self) -> tuple:
        """Take the run directory (rank 0 locks it) and make sure it holds this run, or none:
        another run there is refused on every rank before anything is written."""
        from data_prep.manifest import data_identity

        from ..errors import AlmaError
        from .config import run_fingerprint
        from ..ranks import raise_unless_all_ok

        error, run_dir, fingerprint, finished = None, None, {}, False
        try:
            run_dir = RunDirectory.for_training(self.cfg.save_dir, rank=world()[1])
            fingerprint = {"config": run_fingerprint(self.cfg), "data": data_identity(self.task.manifest)}
            run_dir.check_fingerprint(fingerprint, restart=self.cfg.restart_stream)
            finished = not self.cfg.restart_stream and self.holds_finished_run(run_dir, fingerprint)
            if not finished:
                run_dir.claim(fingerprint, restart=self.cfg.restart_stream)
                self.verify_shards_once(run_dir, fingerprint["data"])
        except AlmaError as err:
            error = err
        raise_unless_all_ok(error)
        if finished:  # the same command on a finished run changes no byte of it
            run_dir.close()
            logger.info("alma_stream: %s holds this run, finished (every arrival recorded, every "
                        "stage checkpoint kept): nothing to train; --restart-stream trains it again",
                        run_dir.path)
            raise SystemExit(0)
        return run_dir, fingerprint

    def holds_finished_run(self, run_dir: RunDirectory, fingerprint: Dict[str, Any]) -> bool:
        """This run, with every arrival recorded and every trained stage's checkpoint kept."""
        from ..errors import UsageError
        from ..stream.run_view import RunView

        import zipfile

        from ..stream.run_dir import damaged_record

        if run_dir.read_fingerprint() != fingerprint:
            return False
        last = run_dir.last_checkpoint
        if last.exists() and (not zipfile.is_zipfile(last) or damaged_record(last) is not None):
            return False  # fairseq's own load says what is wrong with it, in one line
        view = RunView(run_dir.path)
        if view.finished_records(self.task.plan.num_megabatches) is None:
            return False
        try:
            view.trained_checkpoints()
        except UsageError:
            return False  # a stage checkpoint went missing: the run restores what it can
        return True

    def verify_shards_once(self, run_dir: RunDirectory, data: Dict[str, Any]) -> None:
        """Hash every shard against the manifest the first time this run uses the data (sizes
        are checked at every start); ``data_verified.json`` records it for later starts."""
        from data_prep.manifest import has_shard_checksums, verify_stream_dir

        marker = run_dir.path / "data_verified.json"
        done = fingerprint_hash(data)
        if not run_dir.writes or not has_shard_checksums(self.task.manifest):
            return
        if marker.is_file() and marker.read_text("utf-8").strip() == f'"{done}"':
            return
        started = time.perf_counter()
        verify_stream_dir(self.cfg.data.split(os.pathsep)[0], hashes=True)
        logger.info("alma_stream: every shard matches its sha256 in manifest.json (%.1fs; not "
                    "repeated for this run)", time.perf_counter() - started)
        run_dir.write_file(marker.name, lambda handle: handle.write(f'"{done}"\n'.encode()))

    # ---- where the run stands ------------------------------------------------------------
    def stage_boundary(self, stages_done: int) -> None:
        """fairseq loaded the data of stage ``stages_done + 1``: close stage ``stages_done``.

        The first boundary of a process comes while fairseq is restoring a checkpoint, before
        the progress saved with it is back (``set_checkpoint_dict``), so it is deferred."""
        if not self.live:
            self.deferred = stages_done
            return
        self.advance_clock(stages_done)
        self.close_stage(stages_done)

    def advance_clock(self, stages_done: int) -> None:
        """The stage that just ended must have all its counted updates; the next one starts."""
        if self.clock_unknown or stages_done < self.clock.stage:
            return  # a fresh start (stage 0 done), a boundary already passed, or a 0.1 checkpoint
        if stages_done < self.task.plan.num_stages:
            self.clock.next_stage(stages_done + 1)
        elif not self.clock.done:
            self.clock.next_stage(stages_done + 1)  # raises: the last stage's data ran out

    def after_update(self, num_updates: int) -> bool:
        """Asked by ``fairseq_glue/patches.install_requeue_save`` after every update attempt, with
        fairseq's counter: True when the stage's budget of counted updates is complete, so
        fairseq ends the epoch there however many steps it skipped."""
        done = self.clock.attempt(num_updates)
        if self.clock.skipped and num_updates == self.clock.expected_updates() and not done:
            logger.info("stage %d: update %d skipped by the trainer (%d skipped in this stage)",
                        self.clock.stage, num_updates + 1, self.clock.skipped)
        return done

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        self.progress.load_state_dict(state["progress"])
        self.growth = list(state.get("growth", []))
        if "clock" in state:
            self.clock.load_state_dict(state["clock"])
            self.started_stage = int(state["started_stage"])
        else:
            self.clock_unknown = True
        self.live = True
        self._resolve_deferred()

    def resolve_start(self) -> None:
        """Before the first update of this process: no progress was restored (a fresh run, or
        a checkpoint written before progress travelled in checkpoints)."""
        if self.live:
            return
        self.live = True
        if self.resuming and self.deferred is not None:
            self.progress.adopt_log(upto_stage=self.deferred)
            self.growth = self.run_dir.read_growth()
            self.clock_unknown = True
        self._resolve_deferred()

    def _resolve_deferred(self) -> None:
        if self.deferred is not None:
            stages_done, self.deferred = self.deferred, None
            self.advance_clock(stages_done)
            self.close_stage(stages_done)

    def state_dict(self) -> Dict[str, Any]:
        return {"progress": self.progress.state_dict(), "growth": list(self.growth),
                "clock": self.clock.state_dict(), "started_stage": self.started_stage}

    # ---- stage end ------------------------------------------------------------------------
    def close_stage(self, stages_done: int) -> None:
        stages_done = min(stages_done, self.task.plan.num_stages)

        def keep(stage: int) -> None:
            info = {"stage": stage, "arrival": self.task.plan.stage(stage).arrival if stage else 0,
                    "run": fingerprint_hash(self.fingerprint),
                    "dictionary": self.task.manifest["dictionary"]["sha256"]}
            if stage == 0:
                from .config import fairseq_root

                keep_initial_checkpoint(self.run_dir, self.task.model, fairseq_root(self.cfg),
                                        self.task.state_dict(), info)
            else:
                keep_stage_checkpoint(self.run_dir, stage, info)

        new = self.progress.close_stage(stages_done, self.measure, self.record, keep_checkpoint=keep)
        if new and self.run_dir.writes:
            from ..lm.tensorboard import log_arrivals

            log_arrivals(self.cfg.tensorboard_logdir, self.progress.ordered())

    def measure(self) -> Dict[str, float]:
        """Perplexity of the model on the evaluation mega-batch and on the validation set."""
        out: Dict[str, float] = {}
        batching = Batching(self.cfg.batch_size_valid or self.cfg.batch_size or 8, self.cfg.max_tokens_valid)
        for name, key in ((self.cfg.eval_subset, "eval"), ("valid", "valid")):
            nll, ntok = total_nll(self.task.model, self.task, self.task.dataset_split(name), batching)
            out[f"{key}_nll"] = nll / max(ntok, 1)
            out[f"{key}_tokens"] = ntok
            out[f"{key}_ppl"] = math.exp(min(out[f"{key}_nll"], 700.0))
        return out

    def record(self, info: ArrivalInfo, metrics: Dict[str, float]) -> ArrivalRecord:
        model = self.task.model
        counts = model.parameter_counts() if hasattr(model, "parameter_counts") else {}
        params = counts.get("active", sum(p.numel() for p in model.parameters()))
        train_tokens = sum(self.task.train_tokens(s.index) for s in self.task.plan.schedule[: info.stage])
        convention = str(self.cfg.flops_convention)
        infer, train = model_flops(model, self.cfg.tokens_per_sample, train_tokens, convention)
        return ArrivalRecord(
            arrival=info.arrival, stage=info.stage, trained=info.trained, megabatches_seen=info.megabatches_seen,
            params_active=int(params), train_flops_cum=float(train), infer_flops_per_token=float(infer),
            wall_time=_training_seconds(), eval_ppl=metrics["eval_ppl"], eval_nll=metrics["eval_nll"],
            eval_tokens=int(metrics["eval_tokens"]),
            valid={"valid_ppl": metrics["valid_ppl"], "valid_nll": metrics["valid_nll"]},
            extra={"infer_flops_per_sequence": float(infer) * self.cfg.tokens_per_sample,
                   "flops_convention": convention, "train_tokens_cum": train_tokens,
                   "skipped_updates": self.clock.skipped_by_stage.get(info.stage, 0),
                   **self.stage_extras(info.stage)})

    def stage_extras(self, stage: int) -> Dict[str, Any]:
        """What a record says about the stage that answers it: its replayed counted updates
        (measured from the slots its counted updates consumed, ``stream/replay.py``) and, with
        ``alma_stage_linear``, its LR meta-schedule and peak LR."""
        plan = self.task.plan
        replayed = 0
        if stage >= 1:
            replayed = counted_replays(self.task.budget, plan.replay_slots(stage, self.task.budget),
                                       self.clock.skipped_slots.get(stage, []))
        extras: Dict[str, Any] = {"replay_ratio": plan.replay_ratio, "replayed_updates": replayed}
        if self.lr_schedule is not None:
            schedule, peak = self.lr_schedule
            extras["stage_lr_schedule"] = schedule
            if stage >= 1:  # the initialised model (stage 0) was trained with no LR
                extras["stage_peak_lr"] = stage_peak(peak, stage, schedule)
        return extras

    # ---- stage start ------------------------------------------------------------------------
    def before_update(self, update_num: int, optimizer: Any) -> None:
        """Stage-start actions, once per stage, before its first update attempt (the clock and
        ``started_stage`` travel in the checkpoint: a resume never repeats them)."""
        self.resolve_start()
        if self.clock_unknown:  # a 0.1 checkpoint: the position is fairseq's counter (no skips then)
            self.clock_unknown = False
            self.clock.stage, self.clock.counted = divmod(update_num, self.task.budget)
            self.clock.stage += 1
            self.started_stage = self.clock.stage - (1 if self.clock.counted == 0 else 0)
        if self.started_stage < self.clock.stage:
            self.start_stage(self.clock.stage, optimizer)

    def start_stage(self, stage: int, optimizer: Any) -> None:
        from ..lm.stage_start import reinitialize, reset_optimizer_state

        self.started_stage = stage
        model = self.task.model
        if stage in self.task.growth_plan:
            self.grow(stage, optimizer)
        if stage > 1 and self.cfg.stage_init == "scratch":
            reinitialize(model, seed=self.cfg.seed * 1000 + stage)
            reset_optimizer_state(optimizer, model=model)
        elif stage > 1 and self.cfg.reset_optimizer_each_stage:
            reset_optimizer_state(optimizer, model=None)

    def grow(self, stage: int, optimizer: Any) -> None:
        from ..lm.growth import grow_experts

        model = self.task.model
        batch = self.cfg.batch_size_valid or self.cfg.batch_size or 8
        info = grow_experts(model, self.task, self.task.dataset_split("valid"), self.task.growth_plan[stage],
                            batch, optimizer, seed=self.cfg.seed * 100 + stage)
        info = {"stage": stage, **info, "params_active": int(model.parameter_counts()["active"])}
        # a resumed run may redo a growth step: replace it, never duplicate it
        self.growth = [entry for entry in self.growth if entry["stage"] < stage] + [info]
        self.run_dir.write_growth(self.growth)

