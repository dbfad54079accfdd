"""``alma_stream``: one ``fairseq-train`` runs a whole ALMA stream (paper §3, Algorithm 1; §5).

A stage is fairseq's epoch.  ``load_dataset("train", epoch=s)`` returns the mega-batches stage s
trains on (the w new ones, or all seen with --replay); its batch iterator yields exactly the
stage's update budget; ``alma_stage_linear`` restarts the LR each stage.  fairseq asks for stage
s+1's data right after saving the end of stage s: that is where the task keeps the stage
checkpoint, evaluates the model on the evaluation mega-batch and the validation set, and writes
one ``stream.jsonl`` record per arrival (arrivals without training repeat the model's numbers with
``trained: false``).  Every step is a function of the checkpoint and the data, so the same command
after a crash continues and writes the same files.
"""

import logging
import math
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
from fairseq.data import ConcatDataset, Dictionary, data_utils, iterators
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask
from omegaconf import II

from ..errors import UsageError, require
from ..lm.atomic_checkpoints import install as install_atomic_checkpoint_copies
from ..lm.atomic_checkpoints import remove_stale_temporaries
from ..lm.budget import fixed_budget_batches
from ..lm.evaluate import evaluate_nll
from ..lm.preemption import PreemptionStop
from ..lm.stage_checkpoints import materialize_stage_checkpoint
from ..optim.alma_stage_linear import stage_budget
from ..stream.records import ArrivalRecord, read_records, write_records
from ..stream.schedule import arrival_table, build_schedule
from ..vision.task_backend import VisionStreamTask
from ..vision.task_config import VisionStreamFields

logger = logging.getLogger(__name__)


@dataclass
class AlmaStreamConfig(LanguageModelingConfig, VisionStreamFields):
    wait: int = field(default=1, metadata={"help": "waiting time w: mega-batches aggregated per stage (paper §3)"})
    replay: bool = field(default=False, metadata={"help": "train each stage on every mega-batch seen so far"})
    updates_per_stage: int = field(default=120000, metadata={"help": "updates per stage U (paper §5: 120,000)"})
    scale_updates_by_wait: bool = field(
        default=False, metadata={"help": "U x w updates per stage (the paper's 'w3 (3x steps)' settings)"}
    )
    stage_init: ChoiceEnum(["continue", "scratch"]) = field(
        default="continue", metadata={"help": "start each stage from the previous stage's model, or from a fresh init"}
    )
    reset_optimizer_each_stage: bool = field(default=False, metadata={"help": "clear the optimizer state at each stage start"})
    grow_experts: str = field(
        default="",
        metadata={"help": "experts copied per MoE block at each growth: one k, or one per growth, e.g. '2,2,4' "
                  "for Table 2's 4 -> 6 -> 8 -> 12 (needs --moe-max-experts); empty = no growth"},
    )
    grow_at_stages: str = field(
        default="", metadata={"help": "stages at whose start to grow, e.g. '2,3,4'; default: every stage after the first"}
    )
    eval_subset: str = field(default="eval", metadata={"help": "split scored after every arrival (the evaluation mega-batch)"})
    stream_log: str = field(default="stream.jsonl", metadata={"help": "per-arrival records, in --save-dir"})
    save_dir: str = II("checkpoint.save_dir")
    max_tokens_valid: Optional[int] = II("dataset.max_tokens_valid")
    max_tokens: Optional[int] = II("dataset.max_tokens")
    required_batch_size_multiple: int = II("dataset.required_batch_size_multiple")
    distributed_world_size: int = II("distributed_training.distributed_world_size")
    update_freq: List[int] = II("optimization.update_freq")
    tensorboard_logdir: Optional[str] = II("common.tensorboard_logdir")


def _verify_stream_dir(data: str) -> dict:
    from data_prep.manifest import StreamDataError, verify_stream_dir

    try:
        return verify_stream_dir(data)
    except StreamDataError as exc:
        raise UsageError(str(exc)) from None


def _training_seconds() -> float:
    """Wall-clock seconds the run has spent so far: fairseq's ``wall`` meter, which the trainer
    starts at launch and carries over resumes in its checkpointed metrics (so a requeued run
    does not count the time it sat in the queue)."""
    from fairseq.logging import metrics as fairseq_metrics

    meter = fairseq_metrics.get_meter("default", "wall")
    return round(float(meter.elapsed_time), 3) if meter is not None else 0.0


def _root(cfg: Any) -> Any:
    node = cfg
    while getattr(node, "_get_parent", None) is not None and node._get_parent() is not None:
        node = node._get_parent()
    return node


@register_task("alma_stream", dataclass=AlmaStreamConfig)
class AlmaStreamTask(LanguageModelingTask):
    """Language-model ALMA stream over an ``alma-data-prep`` directory."""

    def __init__(self, cfg: AlmaStreamConfig, dictionary: Dictionary, manifest: dict) -> None:
        super().__init__(cfg, dictionary)
        self.cfg = cfg  # LanguageModelingTask is a legacy task: it only sets self.args
        self.manifest = manifest
        self.num_megabatches = int(manifest["num_megabatches"])
        self.schedule = build_schedule(self.num_megabatches, cfg.wait, cfg.replay)
        self.arrivals = arrival_table(self.schedule, self.num_megabatches)
        self.budget = stage_budget(cfg.updates_per_stage, cfg.wait, cfg.scale_updates_by_wait)
        self.model: Any = None
        self.stage_tokens: Dict[int, int] = {}
        self.records: Dict[int, ArrivalRecord] = {}
        self._started_stage = 0
        self.growth_plan = self._growth_plan(cfg)

    @classmethod
    def setup_task(cls, cfg: AlmaStreamConfig, **kwargs: Any) -> "AlmaStreamTask":
        if cfg.vision_dataset:
            return VisionStreamTask.setup_task(cfg, **kwargs)
        require(cfg.data is not None, "the stream directory (DATA) is required")
        manifest = _verify_stream_dir(cfg.data.split(os.pathsep)[0])
        num = int(manifest["num_megabatches"])
        require(1 <= cfg.wait <= num, f"--wait must be in [1, {num}] (the stream's mega-batches); got {cfg.wait}")
        require(cfg.updates_per_stage >= 1, f"--updates-per-stage must be >= 1 (got {cfg.updates_per_stage})")
        dictionary = Dictionary.load(os.path.join(cfg.data.split(os.pathsep)[0], "dict.txt"))
        install_atomic_checkpoint_copies()
        if os.path.isdir(cfg.save_dir) and AlmaStreamTask._is_master():
            remove_stale_temporaries(cfg.save_dir)
        task = cls(cfg, dictionary, manifest)
        task._set_max_epoch(cfg)
        task._stop = PreemptionStop(_root(cfg))
        return task

    def _set_max_epoch(self, cfg: AlmaStreamConfig) -> None:
        """fairseq-train stops after --max-epoch epochs; a stream has exactly len(schedule).

        ``ALMA_STOP_AFTER_STAGE=t`` (set by ``alma-sweep --chain-stages``) ends this process after
        stage t; the same command run again continues with stage t+1.
        """
        root = _root(cfg)
        optimization = root.get("optimization") if hasattr(root, "get") else None
        if optimization is None:
            return
        stages = len(self.schedule)
        given = optimization.get("max_epoch") or 0
        require(given <= stages, f"--max-epoch must be <= {stages} (the stream's stages); got {given}")
        # fairseq 0.12 broadcasts a resumed checkpoint to the other ranks with torch.load, whose
        # weights_only default (torch >= 2.6) rejects fairseq's config objects; loading the
        # checkpoint file on every rank avoids the broadcast, so multi-process streams resume.
        checkpoint = root.get("checkpoint") if hasattr(root, "get") else None
        if checkpoint is not None and "load_checkpoint_on_all_dp_ranks" in checkpoint:
            checkpoint.load_checkpoint_on_all_dp_ranks = True
        limit = given or stages
        env = os.environ.get("ALMA_STOP_AFTER_STAGE", "").strip()
        if env:
            require(env.isdigit() and int(env) >= 1, f"ALMA_STOP_AFTER_STAGE must be a stage number >= 1 (got {env!r})")
            limit = min(limit, int(env))
        optimization.max_epoch = limit

    def _growth_plan(self, cfg: AlmaStreamConfig) -> Dict[int, int]:
        """{stage: experts to copy per MoE block} from --grow-experts / --grow-at-stages."""
        if not cfg.grow_experts.strip():
            return {}
        try:
            counts = [int(k) for k in cfg.grow_experts.split(",")]
            stages = [int(s) for s in cfg.grow_at_stages.split(",")] if cfg.grow_at_stages.strip() else None
        except ValueError:
            raise UsageError(f"--grow-experts/--grow-at-stages take comma-separated integers (got "
                             f"{cfg.grow_experts!r} / {cfg.grow_at_stages!r})") from None
        stages = stages or list(range(2, len(self.schedule) + 1))
        require(all(2 <= s <= len(self.schedule) for s in stages),
                f"--grow-at-stages must list stages in [2, {len(self.schedule)}] (got {cfg.grow_at_stages!r})")
        if len(counts) == 1:
            counts = counts * len(stages)
        require(len(counts) == len(stages) and all(k >= 1 for k in counts),
                f"--grow-experts needs one k >= 1, or one per growth stage ({len(stages)}); got {cfg.grow_experts!r}")
        return dict(zip(stages, counts))

    # ---- model -------------------------------------------------------------------------
    def build_model(self, cfg: Any, from_checkpoint: bool = False) -> Any:
        model = super().build_model(cfg, from_checkpoint)
        self.model = model  # the same module fairseq trains (moved/cast in place by the Trainer)
        if self.growth_plan and hasattr(model, "moe_layers"):
            layers = model.moe_layers()
            require(bool(layers), "--grow-experts needs a model with MoE blocks")
            final = layers[0].num_experts + sum(self.growth_plan.values())
            require(layers[0].max_experts >= final,
                    f"--moe-max-experts must be >= {final} to grow by --grow-experts {self.cfg.grow_experts} "
                    f"(allocated: {layers[0].max_experts})")
        return model

    # ---- data --------------------------------------------------------------------------
    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, **kwargs: Any) -> None:
        if split != "train":
            super().load_dataset(split, epoch=epoch, combine=False, **kwargs)
            return
        self._finish_stages_before(epoch)
        stage = min(epoch, len(self.schedule))
        self.datasets["train"] = self._stage_dataset(stage)

    def _stage_dataset(self, stage: int) -> Any:
        """The mega-batches ``stage`` trains on (new ones, or all seen with --replay), concatenated."""
        parts = []
        for k in self.schedule[stage - 1].train_megabatches:
            name = f"megabatch{k}"
            if name not in self.datasets:
                super().load_dataset(name, epoch=1, combine=False)
            parts.append(self.datasets[name])
        return parts[0] if len(parts) == 1 else ConcatDataset(parts)

    def has_sharded_data(self, split: str) -> bool:
        return split == "train"  # a new dataset every epoch (= stage)

    def get_batch_iterator(self, dataset: Any, max_tokens: Optional[int] = None, max_sentences: Optional[int] = None,
                           max_positions: Any = None, ignore_invalid_inputs: bool = False,
                           required_batch_size_multiple: int = 1, seed: int = 1, num_shards: int = 1,
                           shard_id: int = 0, num_workers: int = 0, epoch: int = 1, data_buffer_size: int = 0,
                           **kwargs: Any) -> iterators.EpochBatchIterator:
        if dataset is not self.datasets.get("train"):
            return super().get_batch_iterator(
                dataset, max_tokens=max_tokens, max_sentences=max_sentences, max_positions=max_positions,
                ignore_invalid_inputs=ignore_invalid_inputs, required_batch_size_multiple=required_batch_size_multiple,
                seed=seed, num_shards=num_shards, shard_id=shard_id, num_workers=num_workers, epoch=epoch,
                data_buffer_size=data_buffer_size, **kwargs)
        stage = min(epoch, len(self.schedule))
        batches = self._stage_batches(stage, dataset, max_tokens, max_sentences, required_batch_size_multiple,
                                      seed, num_shards)
        return iterators.EpochBatchIterator(
            dataset=dataset, collate_fn=dataset.collater, batch_sampler=batches, seed=seed,
            num_shards=num_shards, shard_id=shard_id, num_workers=num_workers, epoch=epoch,
            buffer_size=data_buffer_size, disable_shuffling=True)

    def _stage_batches(self, stage: int, dataset: Any, max_tokens: Optional[int], max_sentences: Optional[int],
                       multiple: int, seed: int, num_shards: int) -> List[np.ndarray]:
        """The stage's batch list: exactly budget x update_freq x workers batches."""
        needed = self.budget * self.cfg.update_freq[-1] * num_shards

        def make_batches(order: np.ndarray) -> List[np.ndarray]:
            return list(data_utils.batch_by_size(order, dataset.num_tokens, max_tokens=max_tokens,
                                                 max_sentences=max_sentences, required_batch_size_multiple=multiple))

        batches = fixed_budget_batches(len(dataset), make_batches, needed, seed, stage)
        self.stage_tokens[stage] = int(sum(dataset.sizes[b].sum() for b in batches))
        return batches

    def _train_tokens(self, stage: int) -> int:
        """Tokens trained on in ``stage``: a function of the stage and the batching flags, so a
        resumed run records the same cumulative compute as an uninterrupted one."""
        if stage not in self.stage_tokens:
            self._stage_batches(stage, self._stage_dataset(stage), self.cfg.max_tokens, self.cfg.batch_size,
                                self.cfg.required_batch_size_multiple, self.cfg.seed, self.cfg.distributed_world_size)
        return self.stage_tokens[stage]

    # ---- stage start -------------------------------------------------------------------
    def train_step(self, sample: Any, model: Any, criterion: Any, optimizer: Any, update_num: int,
                   ignore_grad: bool = False) -> Any:
        self._stop.check(update_num)
        stage = update_num // self.budget + 1
        if update_num % self.budget == 0 and self._started_stage < stage:
            self._start_stage(stage, optimizer)
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)

    def _start_stage(self, stage: int, optimizer: Any) -> None:
        """Stage-start actions, taken once, at the stage's first update (never again on resume)."""
        from ..lm.stage_start import reinitialize, reset_optimizer_state

        self._started_stage = stage
        if stage in self.growth_plan:
            self._grow(stage, optimizer)
        if stage > 1 and self.cfg.stage_init == "scratch":
            reinitialize(self.model, seed=self.cfg.seed * 1000 + stage)
            reset_optimizer_state(optimizer, model=self.model)
        elif stage > 1 and self.cfg.reset_optimizer_each_stage:
            reset_optimizer_state(optimizer, model=None)

    def _grow(self, stage: int, optimizer: Any) -> None:
        from ..lm.growth import grow_experts
        from ..stream.atomic import atomic_write_text

        if "valid" not in self.datasets:
            super().load_dataset("valid", epoch=1, combine=False)
        batch = self.cfg.batch_size_valid or self.cfg.batch_size or 8
        info = grow_experts(self.model, self, self.datasets["valid"], self.growth_plan[stage], batch, optimizer,
                            seed=self.cfg.seed * 100 + stage)
        info = {"stage": stage, **info, "params_active": int(self.model.parameter_counts()["active"])}
        if self._is_master():
            import json

            path = os.path.join(self.cfg.save_dir, "growth.jsonl")
            kept = []
            if os.path.exists(path):  # a resumed run may redo a growth step: replace, never duplicate
                kept = [line for line in open(path, encoding="utf-8").read().splitlines()
                        if line.strip() and json.loads(line)["stage"] < stage]
            atomic_write_text(path, "\n".join(kept + [json.dumps(info)]) + "\n")

    # ---- stage end: checkpoint, evaluation, records --------------------------------------
    def _finish_stages_before(self, epoch: int) -> None:
        """Arrival records (and stage checkpoints) for everything before stage ``epoch``."""
        if self.model is None:
            return
        self._load_records()
        done_stage = min(epoch - 1, len(self.schedule))
        if done_stage >= 1 and self._is_master():
            materialize_stage_checkpoint(self.cfg.save_dir, done_stage, {"stage": done_stage,
                                         "arrival": self.schedule[done_stage - 1].arrival})
        next_arrival = self.schedule[done_stage].arrival if done_stage < len(self.schedule) else self.num_megabatches + 1
        pending = [a for a in self.arrivals if a.stage == done_stage and a.arrival < next_arrival
                   and a.arrival not in self.records]
        if pending:
            metrics = self._evaluate()
            for info in pending:
                self.records[info.arrival] = self._record(info, metrics)
            self._write_records()

    def _evaluate(self) -> Dict[str, float]:
        out: Dict[str, float] = {}
        batch = self.cfg.batch_size_valid or self.cfg.batch_size or 8
        for name, key in ((self.cfg.eval_subset, "eval"), ("valid", "valid")):
            if name not in self.datasets:
                super().load_dataset(name, epoch=1, combine=False)
            nll, ntok = evaluate_nll(self.model, self, self.datasets[name], batch, self.cfg.max_tokens_valid)
            out[f"{key}_nll"] = nll / max(ntok, 1)
            out[f"{key}_tokens"] = ntok
            out[f"{key}_ppl"] = math.exp(min(out[f"{key}_nll"], 700.0))
        return out

    def _record(self, info: Any, metrics: Dict[str, float]) -> ArrivalRecord:
        from ..lm.flops import model_flops

        counts = self.model.parameter_counts() if hasattr(self.model, "parameter_counts") else {}
        params = counts.get("active", sum(p.numel() for p in self.model.parameters()))
        train_tokens = sum(self._train_tokens(s.index) for s in self.schedule[: info.stage])
        infer, train = model_flops(self.model, self.cfg.tokens_per_sample, train_tokens)
        return ArrivalRecord(
            arrival=info.arrival, stage=info.stage, trained=info.trained, megabatches_seen=info.megabatches_seen,
            params_active=int(params), train_flops_cum=float(train), infer_flops_per_example=float(infer),
            wall_time=_training_seconds(), eval_ppl=metrics["eval_ppl"], eval_nll=metrics["eval_nll"],
            eval_tokens=int(metrics["eval_tokens"]),
            valid={"valid_ppl": metrics["valid_ppl"], "valid_nll": metrics["valid_nll"]},
            extra={"train_tokens_cum": train_tokens})

    def _log_path(self) -> str:
        return os.path.join(self.cfg.save_dir, self.cfg.stream_log)

    def _load_records(self) -> None:
        """Records of a resumed run; a fresh run (no checkpoint_last.pt) starts a new log."""
        if self.records or not os.path.exists(self._log_path()):
            return
        if not os.path.exists(os.path.join(self.cfg.save_dir, "checkpoint_last.pt")):
            return
        self.records = {r.arrival: r for r in read_records(self._log_path())}

    def _write_records(self) -> None:
        if not self._is_master():
            return
        os.makedirs(self.cfg.save_dir, exist_ok=True)
        ordered = [self.records[a] for a in sorted(self.records)]
        write_records(self._log_path(), ordered)
        from ..lm.tensorboard import log_arrivals

        log_arrivals(self.cfg.tensorboard_logdir, ordered)

    @staticmethod
    def _is_master() -> bool:
        import torch.distributed as dist

        return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
