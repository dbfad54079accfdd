"""A whole vision ALMA stream: the vision learner behind the stream core (§3, §5, App. B.1).

The one way vision streams run.  ``fairseq-train --task alma_stream --vision-dataset ...``
(``fairseq_glue/vision_entry.py``), the in-process sweep (``sweep.py``) and ``alma-vision-demo`` all build a
``VisionRun`` and call ``run_vision_stream``:

    a StreamSession (stream/session.py) owns the run directory, the records and the stop
    resume (checkpoint_last.pt)  ->  close_stage(0): the untrained model, arrival 0
    for each stage s of the plan:    input statistics of the arrived mega-batches, grow
                                     (learner.before_stage), train epochs with
                                     best-validation selection (stream_stage.train_one_stage),
                                     close_stage(s): test error, one record per arrival,
                                     save checkpoint_last.pt (learner, RNG, progress)

A vision stage is short next to an LM stage, so it is the unit of resumption: a run killed or
preempted inside stage s restarts stage s from its beginning, which gives exactly the numbers
of an uninterrupted run (the stage is a function of the learner at its start and the seed).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint_load import load_checkpoint
from ..errors import Preempted, RunDirError, UsageError
from ..ranks import any_rank
from ..stream.fingerprint_forms import recorded_mixture_layers
from ..stream.progress import StreamPlan
from ..stream.records import ArrivalRecord
from ..stream.run_dir import RunDirectory
from ..stream.schedule import ArrivalInfo, Stage
from ..stream.session import StreamSession
from ..stream.stop import StopSignal
from .data import load_vision_data
from .dataset import VisionData
from .devices import check_amp
from .evaluation import evaluate
from .fingerprint import vision_fingerprint
from .learner_builder import build_learner
from .learners import LearnerSpec
from .stage_trainer import StageTrainConfig
from .stream_stage import (
    arrived_statistics,
    check_validation_parts,
    make_partition,
    stage_data,
    train_one_stage,
)

logger = logging.getLogger(__name__)

CHECKPOINT_FORMAT = "alma-vision-run/1"
PROGRESS_SECONDS = 30.0  # log a stage's epochs at most this often (paper stages: 100 epochs)


@dataclass(frozen=True)
class VisionRun:
    """Everything that defines one vision stream and changes its results (typed values).

    ``settings()`` is what a resumed run must share with its checkpoint.
    """

    dataset: str  # digits, mnist, cifar10 or npz
    data_path: str | None
    plan: StreamPlan
    learner: LearnerSpec
    training: StageTrainConfig
    valid_fraction: float = 0.1  # paper §5: 10% of each mega-batch
    seed: int = 1  # the partition and the stages' data order (the learner has its own)
    device: str = "cpu"
    keep_stage_checkpoints: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.valid_fraction < 1.0:
            raise UsageError(f"--valid-fraction must be in [0, 1) (got {self.valid_fraction})")

    def settings(self) -> dict[str, Any]:
        """Flag -> value of everything that changes results (not where the data lives)."""
        train = self.training
        spec = dataclasses.asdict(self.learner)
        spec["mixture_layers"] = list(spec["mixture_layers"] or [])
        return {
            "--vision-dataset": self.dataset, "--num-megabatches": self.plan.num_megabatches,
            "--wait": self.plan.wait, "--replay": self.plan.replay,
            "--valid-fraction": self.valid_fraction, "--seed": self.seed,
            "--epochs-per-stage": train.epochs, "--batch-size": train.batch_size,
            "--vision-optimizer": train.optimizer.name, "--vision-lr": train.optimizer.lr,
            "--vision-augment": train.augment, "--vision-amp": train.amp, "learner": spec,
        }


class _VisionStream:
    """One run of ``run_vision_stream``: learner, data, progress and the checkpoint."""

    def __init__(self, run: VisionRun, session: StreamSession, data: VisionData) -> None:
        if run.training.augment and not data.is_image:
            raise UsageError(f"--vision-augment crop-flip needs images, but {data.name} holds "
                             f"feature vectors; use --vision-augment none")
        self.run, self.session, self.run_dir = run, session, session.run_dir
        self.device = torch.device(run.device)
        self.data = _on_device(data, self.device)
        self.partition = make_partition(data, run.plan, run.seed, run.valid_fraction)
        check_validation_parts(data, self.partition, run.plan, run.valid_fraction,
                               run.learner.method)
        if run.valid_fraction == 0:
            logger.warning("--valid-fraction 0: no validation data, so every stage keeps its "
                           "last epoch (no best-epoch selection)")
        self.statistics = arrived_statistics(self.data, self.partition)
        self.learner = build_learner(run.learner, data.input_shape, data.num_classes).to(self.device)
        self.stages: dict[int, dict[str, Any]] = {}  # what each stage did (FLOPs, best epoch)
        self.seconds_before = 0.0
        self.started = time.perf_counter()

    @property
    def stages_done(self) -> int:
        return max(self.stages, default=0)

    def run_seconds(self) -> float:
        return self.seconds_before + time.perf_counter() - self.started

    # ---- checkpoint ----------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        learner = self.learner.checkpoint_state()
        return {
            "format": CHECKPOINT_FORMAT, "settings": self.run.settings(),
            "learner": {"spec": dataclasses.asdict(learner["spec"]),
                        "model": {k: v.cpu() for k, v in learner["model"].items()},
                        "generator": learner["generator"]},
            "stages": {s: dict(info) for s, info in self.stages.items()},
            "waits": None if self.session.waits is None else self.session.waits.state_dict(),
            "progress": self.session.progress.state_dict(), "run_seconds": self.run_seconds(),
        }

    def save(self) -> None:
        state = self.state()
        self.run_dir.write_file(self.run_dir.last_checkpoint.name,
                                lambda handle: torch.save(state, handle))
        if self.run.keep_stage_checkpoints:
            name = self.run_dir.stage_checkpoint(self.stages_done).name
            self.run_dir.write_file(name, lambda handle: torch.save(state, handle))

    def resume(self) -> None:
        path = self.run_dir.last_checkpoint
        if not path.is_file():
            self.session.restore_records(None)
            return
        state = load_checkpoint(path)  # CRC-checked, nothing unpickled but plain values
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise RunDirError(f"{path} is not a vision stream checkpoint of this version; use "
                              f"another --save-dir")
        saved = state["learner"]["spec"]
        layers = saved["mixture_layers"]
        if saved.get("method") == "gmoe":  # a checkpoint that names none grew its day's default
            layers = recorded_mixture_layers(saved.get("arch"), layers)
        spec = LearnerSpec(**{**saved, "mixture_layers": _tuple(layers)})
        self.learner.load_checkpoint_state({**state["learner"], "spec": spec})
        self.learner.to(self.device)
        self.stages = {int(s): dict(info) for s, info in state["stages"].items()}
        self.session.restore_waits(state.get("waits"))
        self.session.restore_records(state["progress"])
        self.seconds_before = float(state["run_seconds"])
        logger.info("resumed %s after stage %d", self.run_dir.path, self.stages_done)

    # ---- the stream ------------------------------------------------------------------------
    def recorded(self, new: list[ArrivalRecord]) -> None:
        logger.info("arrivals %s: test error %.4f", [r.arrival for r in new], new[0].test_error)

    def measure(self) -> float:
        return evaluate(self.learner, self.data.x_test, self.data.y_test,
                        self.run.training.eval_batch_size, amp=self.run.training.amp).error

    def record(self, info: ArrivalInfo, error: float) -> ArrivalRecord:
        spec, plan = self.run.learner, self.run.plan
        trained = {"best_epoch": self.stages[info.stage]["best_epoch"]} if info.trained else {}
        if self.session.waits is not None:
            trained.update(self.session.waits.record_extra(info.arrival))
        return ArrivalRecord(
            arrival=info.arrival, stage=info.stage, trained=info.trained,
            megabatches_seen=info.megabatches_seen, params_active=self.learner.params_active(),
            train_flops_cum=sum(self.stages[s]["flops"] for s in range(1, info.stage + 1)),
            infer_flops_per_image=self.learner.infer_flops_per_image(), test_error=error,
            wall_time=self.run_seconds(),
            extra={"method": spec.method, "arch": spec.arch, "width": spec.width,
                   "wait": plan.wait, "replay": plan.replay, **self.learner.describe(), **trained})

    def train(self, stage: Stage, stop: StopSignal | None = None) -> None:
        last_log = [time.perf_counter()]
        epochs = self.run.training.epochs

        def progress(epoch: int, train_loss: float, valid_losses: list[float]) -> None:
            if time.perf_counter() - last_log[0] >= PROGRESS_SECONDS:
                last_log[0] = time.perf_counter()
                logger.info("stage %d: epoch %d/%d, train loss %.4f, valid loss %s", stage.index,
                            epoch, epochs, train_loss, [round(v, 4) for v in valid_losses])

        outcome = train_one_stage(self.learner, stage, self.data, self.partition,
                                  self.statistics, self.run.training, self.run.seed,
                                  plans_growth=(stage.arrival < self.run.plan.num_megabatches
                                                if self.run.plan.adaptive
                                                else stage.index < self.run.plan.num_stages),
                                  progress=progress,
                                  should_stop=None if stop is None else lambda: stop.requested)
        result = outcome.result
        growth = {k: v for k, v in outcome.growth.items() if k != "flops"}
        plan = {k: v for k, v in outcome.plan.items() if k != "flops"}
        logger.info("stage %d (arrival %d, mega-batches %s): %s, best epoch %s, %.1fs%s",
                    stage.index, stage.arrival, list(stage.train_megabatches),
                    growth or "no growth", result.best_epoch, result.wall_time,
                    f", planned {plan}" if plan else "")
        self.stages[stage.index] = {"flops": float(outcome.flops),
                                    "best_epoch": list(result.best_epoch)}


    # ---- --wait auto ---------------------------------------------------------------------
    def decide(self, arrival: int) -> bool:
        """Train now or wait at ``arrival`` (``stream/wait_policy.py``), from the current model's
        error on the validation parts of every arrived mega-batch."""
        _, _, valid_x, valid_y = stage_data(self.data, self.partition, tuple(range(arrival)))
        error = evaluate(self.learner, valid_x, valid_y, self.run.training.eval_batch_size,
                         amp=self.run.training.amp).error
        train = self.session.decide(error, int(valid_y.shape[0]), any_rank)
        decision = self.session.waits.decisions[arrival]
        logger.info("arrival %d: %s (error %.4f on arrived validation data, %d mega-batches "
                    "waiting; predicted error sum to B: %.3f training now, %.3f waiting)",
                    arrival, "train" if train else "wait", error, decision["pending"],
                    decision["cost_train_now"], decision["cost_wait"])
        return train


def _run_adaptive(stream: _VisionStream, session: StreamSession) -> None:
    """``--wait auto``: one decision per arrival, then the stage it asks for (if any), the
    arrival's record and the checkpoint.  A run killed anywhere resumes at the arrival after
    the last checkpoint and decides it again from the same model and data: the same decision."""
    for arrival in range(session.plan.decided + 1, session.plan.num_megabatches + 1):
        if stream.stages_done >= session.last_stage:
            return  # ALMA_STOP_AFTER_STAGE
        if session.stop_requested:
            raise Preempted(f"preempted by {session.stop.signal_name} before arrival {arrival}; "
                            f"{session.run_dir.last_checkpoint} holds arrival {arrival - 1}; run "
                            f"the same command to continue")
        if stream.decide(arrival):
            stream.train(session.plan.stage(session.plan.num_stages), session.stop)
        session.stage_boundary(stream.stages_done)
        stream.save()


def _tuple(value: Any) -> tuple[int, ...] | None:
    return tuple(value) if value else None


def _on_device(data: VisionData, device: torch.device) -> VisionData:
    if data.x_train.device == device:
        return data
    return dataclasses.replace(data, x_train=data.x_train.to(device), y_train=data.y_train.to(device),
                               x_test=data.x_test.to(device), y_test=data.y_test.to(device))


def data_digest(data: VisionData) -> str:
    """sha256 of the data set's tensors: the data part of a vision run's fingerprint (the same
    files moved elsewhere are the same data; other files are not)."""
    digest = hashlib.sha256()
    for tensor in (data.x_train, data.y_train, data.x_test, data.y_test):
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def run_vision_stream(run: VisionRun, run_dir: RunDirectory, data: VisionData | None = None,
                      stop: StopSignal | None = None, stop_after: int | None = None,
                      restart: bool = False) -> list[ArrivalRecord]:
    """Run (or continue) the stream in ``run_dir``; returns the records of every arrival so far.

    ``run_dir`` must hold this run or none (``restart`` moves another one aside first).
    ``stop_after``: train at most up to this stage in this call (``ALMA_STOP_AFTER_STAGE``).
    A ``stop`` signal is honoured between stages (and between epochs by the stage trainer):
    the run raises ``Preempted``; the same call continues.
    """
    session = StreamSession(run.plan, run_dir, stop=stop, stop_after=stop_after)
    return run_vision_session(run, session, data, restart)


def run_vision_session(run: VisionRun, session: StreamSession, data: VisionData | None = None,
                       restart: bool = False) -> list[ArrivalRecord]:
    """``run_vision_stream`` in a session already opened (``fairseq_glue/vision_entry.py``
    opens it with the ranks' agreement)."""
    check_amp(run.training.amp, torch.device(run.device))
    data = data if data is not None else load_vision_data(run.dataset, run.data_path)
    stream = _VisionStream(run, session, data)  # checks the flags against the data first
    session.learner = stream
    session.claim(vision_fingerprint(run, data_digest(data)), restart)
    stream.resume()
    session.stage_boundary(stream.stages_done)
    if run.plan.adaptive:
        _run_adaptive(stream, session)
        return session.progress.ordered()
    for stage in session.stages_to_train(stream.stages_done):
        stream.train(stage, session.stop)
        session.stage_boundary(stream.stages_done)
        stream.save()
    return session.progress.ordered()
