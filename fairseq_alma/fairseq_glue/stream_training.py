"""What only a *training* process of an LM stream does (``tasks/alma_stream.py`` builds one in
``build_model`` unless fairseq loads a checkpoint for scoring): the LM learner behind the
stream core's ``StreamSession`` (``stream/session.py``), which owns the run.

* Opens the session: rank 0 locks the run directory, every rank checks that ``run.json``
  describes this run (or none), the first use of the data hashes every shard; the ranks agree
  before anything is trained (``ranks.py``).
* Derives fairseq's settings (``config.py``), installs the training patches
  (``patches.py``) and takes SIGUSR1/SIGTERM (``stream/stop.py``).
* Forwards fairseq's hooks to the session: the stage boundary (``load_dataset`` of the next
  stage), the update attempts, the state kept in fairseq's checkpoint; the session decides when
  a stage ends and what is recorded, this learner answers how: keep ``checkpoint_stage{s}.pt``,
  evaluate on the evaluation mega-batch and the validation set, build the records; and runs the
  stage-start actions the session calls for (growth, fresh initialisation, optimizer reset).
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Any, Dict, List

from ..errors import AlmaError, StreamFinished
from ..lm.model_flops import model_flops
from ..lm.nll import Batching, non_finite_loss, total_nll
from ..lm.stage_checkpoints import keep_initial_checkpoint, keep_stage_checkpoint
from ..optim.stage_lr_schedules import describe_schedule, stage_peak
from ..ranks import any_rank, raise_unless_all_ok, world
from ..stream.eval_batching import eval_batch_size
from ..stream.progress import DECISION_SUBSET
from ..stream.records import ArrivalRecord
from ..stream.replay import counted_replays
from ..stream.run_dir import DATA_VERIFIED, RunDirectory, fingerprint_hash
from ..stream.schedule import ArrivalInfo
from ..stream.session import StreamSession
from ..stream.stop import StopSignal, stage_limit
from .config import given

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
        from .config import stage_lr_settings, stream_training_settings
        from .patches import install_stream_training_patches
        from .train_flags import check_sharding, check_stream_start

        self.task, self.cfg = task, task.cfg
        # flags first: a refused combination leaves the run directory untouched
        check_sharding(self.cfg, growth=bool(task.growth_plan))
        limit = stage_limit(task.plan.max_stages, self.cfg.max_epoch or None)
        check_stream_start(task, limit, self.cfg.save_dir, bool(self.cfg.restart_stream))
        self.session = StreamSession.open(task.plan, self.cfg.save_dir, rank=world()[1],
                                          agree=raise_unless_all_ok, prepare=self.claim_run,
                                          budget=task.budget, stop_after=limit,
                                          metric_is_rate=False)  # --wait auto: validation NLL
        self.session.learner = self
        self.run_dir = self.session.run_dir
        self.measured: tuple[int, Dict[str, float]] | None = None  # (stages done, metrics)
        self.measure_key = 0
        self.restored_early = False
        if self.session.finished:  # the same command on a finished run changes no byte of it
            self.session.close()
            logger.info("alma_stream: %s holds this run, finished (every arrival recorded, every "
                        "stage checkpoint kept): nothing to train; --restart-stream trains it again",
                        self.run_dir.path)
            raise SystemExit(0)
        stream_training_settings(self.cfg, task.plan.max_stages, limit)
        install_stream_training_patches()
        self.session.stop = StopSignal().install()
        if task.plan.adaptive and self.session.resuming:
            self.restore_early()
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
            logger.info("alma_stream: %s", describe_schedule(schedule, peak, plan.max_stages))
        if plan.adaptive:
            logger.info("alma_stream: --wait auto: at each of the %d arrivals, train on the mega-"
                        "batches waiting (%d updates) or wait, from the validation NLL "
                        "(fairseq_alma/stream/wait_policy.py)", plan.num_megabatches, budget)
            if str(getattr(self.task.cfg.stage_init, "value", self.task.cfg.stage_init)) == "scratch":
                # the run cannot know it will be scored as gEns; say what its decisions weigh
                logger.warning("alma_stream: --wait auto with --stage-init scratch decides from "
                               "the newest model's validation NLL alone; scored as gEns "
                               "(alma-score --mode gens) the ensemble is not what it planned for")
        processes = world()[0]
        if self.session.resuming and processes >= 3 and \
                str(given(self.cfg, "distributed_training", "ddp_backend") or "") == "pytorch_ddp":
            # measured on 4 gloo ranks: weights 6.5e-5 apart two stages after a kill -9; two
            # processes sum a + b in either order alike, and legacy_ddp's buffers never move
            logger.warning("alma_stream: resuming under --ddp-backend pytorch_ddp on %d processes: torch DDP "
                           "lays out its gradient buckets anew in a restarted process, and with 3 or more "
                           "processes the all-reduce adds in an order that follows the layout, so the run "
                           "continues to the uninterrupted one to floating-point rounding, not bit for bit "
                           "(--ddp-backend legacy_ddp resumes bit for bit)", processes)

    def claim_run(self, session: StreamSession) -> None:
        """Make sure the run directory holds this run, or none (another run there is refused on
        every rank before anything is written), then claim it; the first use of the data hashes
        every shard."""
        from fairseq_alma.stream.manifest import data_identity

        from .config import run_fingerprint

        fingerprint = {"config": run_fingerprint(self.cfg), "data": data_identity(self.task.manifest)}
        session.claim(fingerprint, restart=self.cfg.restart_stream,
                      finished=lambda: self.holds_finished_run(session.run_dir))
        if not session.finished:
            self.verify_shards_once(session.run_dir, fingerprint["data"])

    def holds_finished_run(self, run_dir: RunDirectory) -> bool:
        """The directory's run (this one) has every arrival recorded and every trained stage's
        checkpoint kept."""
        import zipfile

        from ..errors import UsageError
        from ..stream.run_dir import damaged_record
        from ..stream.run_view import RunView

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
        from fairseq_alma.stream.manifest import has_shard_checksums, verify_stream_dir

        marker = run_dir.path / DATA_VERIFIED
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

    # ---- fairseq's hooks, forwarded to the session -------------------------------------------
    def stage_boundary(self, stages_done: int) -> None:
        """fairseq loaded the data of stage ``stages_done + 1``: stage ``stages_done`` is over."""
        self.measure_key = stages_done
        self.session.stage_boundary(stages_done)

    def arrive_until_stage(self, stage: int) -> None:
        """``--wait auto``, when fairseq loads the data of ``stage``: stage ``stage - 1`` is over
        (its arrival recorded); then each arrival after it is decided, from the model's NLL on
        the validation set, and recorded if the learner waits there, until one trains (stage
        ``stage``) or the stream has no arrival left (``StreamFinished``)."""
        self.session.start()  # a fresh run is live now; a resumed one was restored early
        self.stage_boundary(stage - 1)
        plan = self.session.plan
        while plan.num_stages < stage:
            if plan.decided == plan.num_megabatches:
                raise StreamFinished(f"alma_stream: --wait auto decided all {plan.decided} "
                                     f"arrivals ({plan.num_stages} stages trained); the stream "
                                     f"is over, every arrival recorded in {self.run_dir.stream_log}")
            metrics = self.measure()
            train = self.session.decide(metrics["valid_nll"], int(metrics["valid_tokens"]), any_rank,
                                        capacity=self.stage_capacity())
            decision = self.session.waits.decisions[plan.decided + 1]
            logger.info("alma_stream: arrival %d: %s (validation NLL %.4f, %d mega-batches waiting; "
                        "predicted NLL sum to B: %.3f training now, %.3f waiting)",
                        decision["arrival"], "train" if train else "wait", decision["error_now"],
                        decision["pending"], decision["cost_train_now"], decision["cost_wait"])
            if not train:
                self.stage_boundary(stage - 1)  # the arrival waited at: the same model answers
            plan = self.session.plan

    def stage_capacity(self) -> float:
        """The mega-batches one stage's updates can read (``--wait auto``): U updates x batches
        per update x tokens per batch, over a mega-batch's mean tokens.  Why: a stage gets U
        updates whatever it is given, so waiting for more data than it reads gains it nothing
        (``wait_policy.after_stage``).  Unbounded when the manifest has no token counts."""
        cfg = self.cfg
        limits = [cfg.batch_size * cfg.tokens_per_sample if cfg.batch_size else None, cfg.max_tokens]
        per_batch = min(limit for limit in limits if limit) if any(limits) else None
        splits = self.task.manifest.get("splits", {})
        sizes = [splits.get(f"megabatch{k}", {}).get("tokens") for k in range(self.task.plan.num_megabatches)]
        if per_batch is None or not all(sizes):
            return math.inf
        # one --update-freq for every stage: --wait auto refuses a per-stage list (check_wait_auto)
        tokens = self.task.budget * cfg.update_freq[-1] * (cfg.distributed_world_size or 1) * per_batch
        return tokens / (sum(sizes) / len(sizes))

    def restore_early(self) -> None:
        """``--wait auto``, resuming: fairseq builds a stage's data (``load_dataset``) before it
        hands the task its checkpointed state (``set_checkpoint_dict``), yet which mega-batches
        that stage trains on is a decision kept in that state: read it from
        ``checkpoint_last.pt`` first (memory-mapped: the weights are not read).  A file that
        cannot be read is left to fairseq's own load, which says why in one line."""
        import torch

        try:
            state = torch.load(self.run_dir.last_checkpoint, map_location="cpu", mmap=True,
                               weights_only=False)
            task_state = (state.get("extra_state") or {}).get(type(self.task).__name__)
        except Exception:  # noqa: BLE001 - reported by fairseq's load, with the file named
            return
        if task_state:
            self.session.restore(task_state)
            self.restored_early = True

    def after_update(self, num_updates: int) -> bool:
        """Asked by ``fairseq_glue/patches.install_requeue_save`` after every update attempt, with
        fairseq's counter: True when the stage's budget of counted updates is complete, so
        fairseq ends the epoch there however many steps it skipped."""
        return self.session.after_update(num_updates)

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if not self.restored_early:  # --wait auto restored it before fairseq's load_dataset
            self.session.restore(state)

    def resolve_start(self) -> None:
        self.session.start()

    def state_dict(self) -> Dict[str, Any]:
        return self.session.state_dict()

    # ---- stage end ------------------------------------------------------------------------
    def keep_checkpoint(self, stage: int) -> None:
        """Keep the end of ``stage`` (0: the initialised model) as ``checkpoint_stage{s}.pt``."""
        info = {"stage": stage, "arrival": self.task.plan.stage(stage).arrival if stage else 0,
                "run": fingerprint_hash(self.session.fingerprint),
                "dictionary": self.task.manifest["dictionary"]["sha256"]}
        if stage == 0:
            from .config import fairseq_root

            keep_initial_checkpoint(self.run_dir, self.task.model, fairseq_root(self.cfg),
                                    self.task.state_dict(), info)
        else:
            keep_stage_checkpoint(self.run_dir, stage, info)

    def recorded(self, new: List[ArrivalRecord]) -> None:
        """Rank 0 shows the new records: one log line each, and tensorboard."""
        if self.run_dir.writes:
            from ..lm.arrival_lines import print_arrivals
            from ..lm.tensorboard import log_arrivals
            from .config import section

            common = section(self.cfg, "common") or {}
            print_arrivals(new, common.get("log_format"), common.get("log_file"),
                           bool(common.get("no_progress_bar")))
            claimed = self.run_dir.read_fingerprint() or self.session.fingerprint
            log_arrivals(self.cfg.tensorboard_logdir, self.session.progress.ordered(),
                         fingerprint_hash(claimed))

    def measure(self) -> Dict[str, float]:
        """Perplexity of the model on the evaluation mega-batch and on the validation set; once
        per model (``--wait auto`` records every arrival it waits at with the same model)."""
        if self.measured is not None and self.measured[0] == self.measure_key:
            return self.measured[1]
        out: Dict[str, float] = {}
        batching = Batching(eval_batch_size(self.cfg.batch_size_valid, self.cfg.batch_size), self.cfg.max_tokens_valid)
        # the validation split is what --wait auto decides from (check_wait_auto refuses scoring it)
        for name, key in ((self.cfg.eval_subset, "eval"), (DECISION_SUBSET, "valid")):
            nll, ntok = total_nll(self.task.model, self.task, self.task.dataset_split(name), batching)
            why = non_finite_loss(nll, self.task.model)
            if why is not None:
                raise AlmaError(f"the model after {self.measure_key} stage(s), scored on split {name}: {why}; no "
                                f"record was written for it (a run that diverged: lower --lr, or fp32)")
            out[f"{key}_nll"] = nll / max(ntok, 1)
            out[f"{key}_tokens"] = ntok
            out[f"{key}_ppl"] = math.exp(min(out[f"{key}_nll"], 700.0))
        self.measured = (self.measure_key, out)
        return out

    def record(self, info: ArrivalInfo, metrics: Dict[str, float]) -> ArrivalRecord:
        model = self.task.model
        counts = model.parameter_counts() if hasattr(model, "parameter_counts") else {}
        params = counts.get("active", sum(p.numel() for p in model.parameters()))
        stage_tokens = {s.index: self.task.train_tokens(s.index) for s in self.task.plan.schedule[: info.stage]}
        train_tokens = sum(stage_tokens.values())
        convention = str(self.cfg.flops_convention)
        infer, _ = model_flops(model, self.cfg.tokens_per_sample, 0, convention)
        train = self.train_flops_cum(info.stage, stage_tokens, infer)
        return ArrivalRecord(
            arrival=info.arrival, stage=info.stage, trained=info.trained, megabatches_seen=info.megabatches_seen,
            params_active=int(params), train_flops_cum=float(train), infer_flops_per_token=float(infer),
            wall_time=_training_seconds(), eval_ppl=metrics["eval_ppl"], eval_nll=metrics["eval_nll"],
            eval_tokens=int(metrics["eval_tokens"]),
            valid={"valid_ppl": metrics["valid_ppl"], "valid_nll": metrics["valid_nll"]},
            extra={"infer_flops_per_sequence": float(infer) * self.cfg.tokens_per_sample,
                   "flops_convention": convention, "train_tokens_cum": train_tokens,
                   "skipped_updates": self.session.clock.skipped_by_stage.get(info.stage, 0),
                   **self.stage_extras(info.stage),
                   **(self.session.waits.record_extra(info.arrival) if self.session.waits else {})})

    def train_flops_cum(self, stage: int, stage_tokens: Dict[int, int], infer: int) -> int:
        """Training FLOPs of stages 1..``stage``, each stage's tokens at the cost per token of
        the model that trained it (3 x its forward, ``transformer_flops.train_flops``): the
        earlier stages' from their records' ``infer_flops_per_token``, this stage's ``infer``.

        Why not all tokens at the current model's cost: after ``--grow-experts`` that charged
        every earlier stage at the grown size (735,215,616 recorded for 734,330,880 trained at
        arrival 3 of a 2 -> 4 -> 6 run), and Comp counts what was trained.  Integers
        throughout: a run that never grows records exactly what it did before."""
        cost = {record.stage: int(record.infer_flops_per_token) for record in self.session.progress.ordered()
                if 1 <= record.stage < stage}
        return sum(3 * tokens * cost.get(index, infer) if index < stage else 3 * tokens * infer
                   for index, tokens in stage_tokens.items())

    def stage_extras(self, stage: int) -> Dict[str, Any]:
        """What a record says about the stage that answers it: its replayed counted updates
        (measured from the slots its counted updates consumed, ``stream/replay.py``) and, with
        ``alma_stage_linear``, its LR meta-schedule and peak LR."""
        plan = self.task.plan
        replayed = 0
        if stage >= 1:
            replayed = counted_replays(self.task.budget, plan.replay_slots(stage, self.task.budget),
                                       self.session.clock.skipped_slots.get(stage, []))
        extras: Dict[str, Any] = {"replay_ratio": plan.replay_ratio, "replayed_updates": replayed}
        if self.lr_schedule is not None:
            schedule, peak = self.lr_schedule
            extras["stage_lr_schedule"] = schedule
            if stage >= 1:  # the initialised model (stage 0) was trained with no LR
                extras["stage_peak_lr"] = stage_peak(peak, stage, schedule)
        return extras

    # ---- stage start ------------------------------------------------------------------------
    def before_update(self, update_num: int, optimizer: Any) -> None:
        """Stage-start actions, once per stage, before its first update attempt."""
        stage = self.session.stage_to_start(update_num)
        if stage is not None:
            self.start_stage(stage, optimizer)

    def start_stage(self, stage: int, optimizer: Any) -> None:
        from ..lm.stage_start import reinitialize, reset_optimizer_state

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
        self.session.grew(stage, {"stage": stage, **info,
                                  "params_active": int(model.parameter_counts()["active"])})

