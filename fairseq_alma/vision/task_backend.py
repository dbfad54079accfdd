"""``alma_stream`` with ``--vision-dataset``: a whole vision ALMA stream in one ``fairseq-train``.

Paper §3 (Algorithm 1), §5 and App. B.1.  ``AlmaStreamTask.setup_task`` hands over to this task
when ``--vision-dataset`` is set; it shares the language-model stream's schedule
(``build_schedule``: stages of w mega-batches, replay), stage checkpoints, ``stream.jsonl``
records, resume, ``--max-epoch``/``ALMA_STOP_AFTER_STAGE`` and SIGUSR1/SIGTERM handling.

A stage is fairseq's epoch, and one fairseq update trains the whole stage: a vision stage is its
own training run (``--epochs-per-stage`` epochs, the epoch with the best validation loss kept,
a fresh optimizer after any growth), which fairseq's optimizer cannot drive because growth
changes the learner's tensors.  So the stage's batch iterator yields exactly one sample per
data-parallel worker, ``train_step`` runs ``train_one_stage`` - the very function the in-process
``run_stream`` calls, so both paths train identically - and fairseq's optimizer never steps (its
one placeholder parameter gets no gradient; see ``models/alma_vision.py``).  A SIGUSR1/SIGTERM
during a stage takes effect when the stage ends: fairseq then saves and exits.

After fairseq saves the end of stage s it asks for stage s+1's data; that is where the task keeps
``checkpoint_stage{s}.pt``, measures the test error and writes one record per arrival answered
by stage s (t = 0 is the untrained model).  Records are rewritten whole and atomically from the
task's record dict, so a killed run resumed by the same command writes the same file.
"""

import logging
import os
import time
from typing import Any, Dict, List, Optional

import torch
from fairseq.data import FairseqDataset, iterators
from fairseq.tasks import FairseqTask

from ..errors import UsageError, require
from ..lm.atomic_checkpoints import install as install_atomic_checkpoint_copies
from ..lm.atomic_checkpoints import remove_stale_temporaries
from ..lm.preemption import PreemptionStop
from ..lm.stage_checkpoints import materialize_stage_checkpoint
from ..models.alma_vision import AlmaVisionModel
from ..stream.records import ArrivalRecord, StreamLogError, read_records, write_records
from ..stream.schedule import Stage, arrival_table, build_schedule
from .data import load_vision_data
from .learners import Learner, build_learner
from .stage_trainer import evaluate
from .stream_runner import make_partition, stage_data, train_one_stage
from .task_config import (
    adapt_training_config,
    data_location,
    learner_spec,
    stage_train_config,
    stream_spec,
)

logger = logging.getLogger(__name__)

PROGRESS_SECONDS = 30.0  # log a stage's epochs at most this often (paper stages: 100 epochs)


class StageSample(FairseqDataset):
    """A one-item data set: "train stage ``stage``" (or, with stage 0, "validate")."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def __getitem__(self, index: int) -> Dict[str, int]:
        return {"id": index}

    def __len__(self) -> int:
        return 1

    def num_tokens(self, index: int) -> int:
        return 1

    def size(self, index: int) -> int:
        return 1

    def collater(self, samples: List[Dict[str, int]]) -> Dict[str, Any]:
        ids = torch.tensor([s["id"] for s in samples])
        return {"id": ids, "stage": self.stage, "nsentences": len(samples)}


def _is_master() -> bool:
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class VisionStreamTask(FairseqTask):
    """The vision back end of ``alma_stream`` (not registered: ``--task alma_stream`` picks it)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__(cfg)
        self.spec = learner_spec(cfg)
        self.stream = stream_spec(cfg)
        require(cfg.vision_threads >= 1, f"--vision-threads must be >= 1, got {cfg.vision_threads}")
        torch.set_num_threads(cfg.vision_threads)
        self.data = load_vision_data(cfg.vision_dataset, data_location(cfg))
        self.train_config = stage_train_config(cfg, self.data)
        self.partition = make_partition(self.data, self.stream)
        stream = self.stream
        self.schedule = build_schedule(stream.num_megabatches, stream.wait, stream.replay)
        self.arrivals = arrival_table(self.schedule, stream.num_megabatches)
        self.model: Optional[AlmaVisionModel] = None
        self.records: Dict[int, ArrivalRecord] = {}
        self._stop: Optional[PreemptionStop] = None
        self.save_dir = cfg.save_dir

    @classmethod
    def setup_task(cls, cfg: Any, **kwargs: Any) -> "VisionStreamTask":
        task = cls(cfg)
        if kwargs.get("from_checkpoint"):
            return task  # loaded for scoring: no training-time settings, no signal handlers
        root = adapt_training_config(cfg, len(task.schedule))
        optimizer = task.train_config.optimizer
        logger.info("each stage trains with the learner's own %s (lr %g, momentum %g, weight decay "
                    "%g); fairseq's optimizer only holds a placeholder and never steps",
                    optimizer.name, optimizer.lr, optimizer.momentum, optimizer.weight_decay)
        install_atomic_checkpoint_copies()
        if os.path.isdir(task.save_dir) and _is_master():
            remove_stale_temporaries(task.save_dir)
        task._stop = PreemptionStop(root)
        return task

    # ---- model and criterion -----------------------------------------------------------
    def new_learner(self) -> Learner:
        """A freshly initialised learner of the flags' spec (seeded: the same every time)."""
        return build_learner(self.spec, self.data.input_shape, self.data.num_classes)

    def run_settings(self) -> Dict[str, Any]:
        """The flags a resumed run must share with its checkpoint (beyond the learner's spec)."""
        config, stream = self.train_config, self.stream
        return {
            "--vision-dataset": self.cfg.vision_dataset,
            "--num-megabatches": stream.num_megabatches,
            "--wait": stream.wait,
            "--replay": stream.replay,
            "--valid-fraction": stream.valid_fraction,
            "--epochs-per-stage": config.epochs,
            "--batch-size": config.batch_size,
            "--vision-optimizer": config.optimizer.name,
            "--vision-lr": config.optimizer.lr,
            "--vision-augment": config.augment,
        }

    def build_model(self, cfg: Any, from_checkpoint: bool = False) -> AlmaVisionModel:
        name = getattr(cfg, "_name", None) if cfg is not None else None
        require(name in (None, "alma_vision"), f"--arch {name} is not a vision model; vision "
                "streams use --arch alma_vision (the learner is set by --vision-method, "
                "--vision-arch, --vision-width)")
        self.model = AlmaVisionModel.build_model(cfg, self)
        return self.model

    def build_criterion(self, cfg: Any) -> Any:
        name = getattr(cfg, "_name", None)
        require(name == "alma_vision_stage", f"--criterion {name} does not apply to vision "
                "streams; use --criterion alma_vision_stage (each stage trains with the "
                "learner's own cross-entropy)")
        return super().build_criterion(cfg)

    # ---- data: one sample per stage ----------------------------------------------------
    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False,
                     **kwargs: Any) -> None:
        if split != "train":
            self.datasets[split] = StageSample(0)
            return
        self._finish_stages_before(epoch)
        self.datasets["train"] = StageSample(min(epoch, len(self.schedule)))

    def has_sharded_data(self, split: str) -> bool:
        return split == "train"  # a new data set every epoch (= stage): fairseq reloads it

    def get_batch_iterator(self, dataset: Any, *args: Any, seed: int = 1, num_shards: int = 1,
                           shard_id: int = 0, epoch: int = 1,
                           **kwargs: Any) -> iterators.EpochBatchIterator:
        return iterators.EpochBatchIterator(
            dataset=dataset, collate_fn=dataset.collater, seed=seed, num_shards=num_shards,
            batch_sampler=[[0] for _ in range(num_shards)], shard_id=shard_id, num_workers=0,
            epoch=epoch, disable_shuffling=True)

    def max_positions(self) -> None:
        return None

    @property
    def source_dictionary(self) -> None:
        return None

    @property
    def target_dictionary(self) -> None:
        return None

    # ---- a stage is one update ---------------------------------------------------------
    def train_step(self, sample: Dict[str, Any], model: AlmaVisionModel, criterion: Any,
                   optimizer: Any, update_num: int, ignore_grad: bool = False) -> Any:
        stage = self.schedule[sample["stage"] - 1]
        if not ignore_grad and stage.index not in model.stages:
            model.record_stage(stage.index, self._train_stage(model, stage))
        info = model.stages.get(stage.index, {})
        keys = ("loss_sum", "loss_examples", "valid_loss_sum", "valid_examples", "gflops")
        log = {key: info[key] for key in keys if key in info}
        if info.get("best_epoch"):  # one per selection group (Ens members): the log shows the mean
            log["best_epoch"] = sum(info["best_epoch"]) / len(info["best_epoch"])
        examples = info.get("loss_examples", 0)
        log.update(stage=stage.index, params=model.learner.params_active(), stage_logs=1,
                   nsentences=examples, ntokens=examples * self.train_config.epochs)
        result = criterion(model, {**sample, "alma_log": log})
        if self._stop is not None:
            self._stop.check(update_num)  # after a signal: fairseq saves this stage's end, exits
        return result

    def _train_stage(self, model: AlmaVisionModel, stage: Stage) -> Dict[str, Any]:
        """``train_one_stage`` (growth, then epochs with best-validation selection) + its log."""
        losses: List[float] = []
        last_log = [time.perf_counter()]

        def progress(epoch: int, train_loss: float, valid_losses: List[float]) -> None:
            losses.append(train_loss)
            if time.perf_counter() - last_log[0] >= PROGRESS_SECONDS:
                last_log[0] = time.perf_counter()
                logger.info("stage %d: epoch %d/%d, train loss %.4f, valid loss %s", stage.index,
                            epoch, self.train_config.epochs, train_loss,
                            [round(v, 4) for v in valid_losses])

        outcome = train_one_stage(model.learner, stage, self.data, self.partition,
                                  self.train_config, self.stream.seed, progress=progress)
        result = outcome.result
        growth = {k: v for k, v in outcome.growth.items() if k != "flops"}
        logger.info("stage %d (arrival %d, mega-batches %s): %s, best epoch %s, %.1fs", stage.index,
                    stage.arrival, list(stage.train_megabatches), growth or "no growth",
                    result.best_epoch, result.wall_time)
        examples = result.train_examples // result.epochs
        valid_examples = sum(len(self.partition[k].valid) for k in stage.train_megabatches)
        mean_valid = sum(result.best_valid_loss) / len(result.best_valid_loss)
        return {
            "flops": float(outcome.flops),
            "best_epoch": list(result.best_epoch),
            "loss_sum": losses[-1] * examples,
            "loss_examples": examples,
            "valid_loss_sum": mean_valid * valid_examples if valid_examples else 0.0,
            "valid_examples": valid_examples,
            "gflops": outcome.flops / 1e9,
        }

    def optimizer_step(self, optimizer: Any, model: Any, update_num: int) -> None:
        """Nothing: the stage already trained with the learner's own optimizer (module doc)."""

    def valid_step(self, sample: Dict[str, Any], model: AlmaVisionModel, criterion: Any) -> Any:
        """Loss and error of the predictor on the validation data of the last stage trained."""
        stage = self.schedule[max(model.stages_trained(), 1) - 1]
        _, _, valid_x, valid_y = stage_data(self.data, self.partition, stage.train_megabatches)
        log: Dict[str, Any] = {"loss_sum": 0.0, "loss_examples": 0, "wrong": 0,
                               "nsentences": valid_x.shape[0]}
        if valid_x.shape[0]:
            result = evaluate(model.learner, valid_x, valid_y, self.train_config.eval_batch_size)
            log.update(loss_sum=result.loss * result.examples, loss_examples=result.examples,
                       wrong=round(result.error * result.examples))
        return criterion(model, {**sample, "alma_log": log})

    # ---- stage end: checkpoint, test error, records --------------------------------------
    def _finish_stages_before(self, epoch: int) -> None:
        """Stage checkpoint and arrival records of everything before stage ``epoch``."""
        if self.model is None:
            return
        self._load_records()
        done = min(epoch - 1, len(self.schedule))
        if done >= 1 and _is_master():
            info = {"stage": done, "arrival": self.schedule[done - 1].arrival}
            materialize_stage_checkpoint(self.save_dir, done, info)
        pending = [a for a in self.arrivals if a.stage == done and a.arrival not in self.records]
        if not pending:
            return
        data, batch = self.data, self.train_config.eval_batch_size
        error = evaluate(self.model.learner, data.x_test, data.y_test, batch).error
        for info in pending:
            self.records[info.arrival] = self._record(info, error)
        logger.info("arrivals %s: test error %.4f", [info.arrival for info in pending], error)
        if _is_master():
            write_records(self._log_path(), [self.records[a] for a in sorted(self.records)])

    def _record(self, info: Any, error: float) -> ArrivalRecord:
        """The record ``run_stream`` writes for this arrival (without its stage_wall_time)."""
        model = self.model
        learner = model.learner
        trained = {"best_epoch": model.stages[info.stage]["best_epoch"]} if info.trained else {}
        return ArrivalRecord(
            arrival=info.arrival, stage=info.stage, trained=info.trained,
            megabatches_seen=info.megabatches_seen, params_active=learner.params_active(),
            train_flops_cum=sum(model.stages[s]["flops"] for s in range(1, info.stage + 1)),
            infer_flops_per_example=learner.infer_flops_per_example(), test_error=error,
            wall_time=model.run_seconds(),
            extra={"method": self.spec.method, "arch": self.spec.arch, "width": self.spec.width,
                   "wait": self.stream.wait, "replay": self.stream.replay, **learner.describe(),
                   **trained})

    def _log_path(self) -> str:
        return os.path.join(self.save_dir, self.cfg.stream_log)

    def _load_records(self) -> None:
        """Records of a resumed run; a fresh run (no checkpoint_last.pt) starts a new log."""
        if self.records or not os.path.exists(self._log_path()):
            return
        if not os.path.exists(os.path.join(self.save_dir, "checkpoint_last.pt")):
            return
        try:
            self.records = {r.arrival: r for r in read_records(self._log_path())}
        except StreamLogError:
            raise UsageError(f"cannot resume: {self._log_path()} is unreadable; restore it or "
                             "start again with another --save-dir") from None
