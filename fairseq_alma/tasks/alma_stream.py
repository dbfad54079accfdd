"""``alma_stream``: one ``fairseq-train`` runs a whole ALMA stream (paper §3, Algorithm 1; §5).

A thin adapter between fairseq's training loop and the stream core (``fairseq_alma/stream``):

* a stage is fairseq's epoch: ``load_dataset("train", epoch=s)`` returns the mega-batches stage
  s trains on (``StreamPlan``: the w new ones, or all seen with --replay; with --replay-ratio
  also the earlier ones its replayed updates draw from), and its batch iterator yields exactly
  the stage's update budget (``lm/budget.py``, ``stream/replay.py``);
* stage-start actions (growth, fresh initialisation, optimizer reset) run at the stage's first
  update (``train_step``);
* fairseq asks for stage s+1's data right after saving the end of stage s: there the core's
  stage-end protocol runs (``StreamProgress.close_stage``: keep ``checkpoint_stage{s}.pt``,
  evaluate on the evaluation mega-batch and the validation set, write ``stream.jsonl``);
* the core's progress travels in fairseq's checkpoint through the task's
  ``get_checkpoint_dict``/``set_checkpoint_dict``, so the same command after a crash continues
  and writes the same files.

What only a training process does (``build_model`` without ``from_checkpoint``: open the run
directory for writing, derive fairseq settings, take SIGUSR1/SIGTERM, the stage-start and
stage-end work) lives in ``fairseq_glue/stream_training.py``; ``fairseq-eval-lm``/``alma-score`` loading
a checkpoint through this task change nothing.
With ``--arch alma_vision`` (a vision stream) the task hands over to the vision learner
(``fairseq_glue/vision_entry.py``).
"""

import logging
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
from fairseq.data import ConcatDataset, Dictionary, data_utils, iterators
from fairseq.dataclass import ChoiceEnum
from fairseq.tasks import register_task
from fairseq.tasks.language_modeling import LanguageModelingConfig, LanguageModelingTask
from omegaconf import II

from ..errors import DataError, MissingSplit, UsageError, require
from ..lm.budget import fixed_budget_batches, interleave_slots, spare_updates
from ..lm.growth import parse_growth_plan
from ..optim.alma_stage_linear import stage_budget
from ..ranks import all_ranks_stop
from ..stream.manifest import check_same_dictionary, expected_splits, kept_repeats
from ..stream.progress import StreamPlan, auto_wait_conflict, wait_flag, wait_from_flag
from ..stream.replay import check_replay_budget, slot_pattern
from ..stream.stage_clock import counted_slots

logger = logging.getLogger(__name__)


@dataclass
class AlmaStreamConfig(LanguageModelingConfig):
    wait: Optional[int] = field(default=1, metadata={"help": (
        "waiting time w: mega-batches aggregated per stage (paper §3); or auto: "
        "train or wait decided at each arrival (fairseq_alma/stream/wait_policy.py)")})
    replay: bool = field(default=False, metadata={"help": "train each stage on every mega-batch seen so far"})
    replay_ratio: float = field(default=0.0, metadata={"help": (
        "partial replay: round(r x stage updates) of every stage's updates train on batches drawn from the "
        "mega-batches that arrived before the stage's new ones (stage 1: none); 0 <= r < 1; not with --replay "
        "(fairseq_alma/stream/replay.py; TiC-LM's fixed-ratio replay)")})
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
    flops_convention: ChoiceEnum(["full", "kaplan", "params"]) = field(default="full", metadata={"help": (
        "how stream.jsonl counts FLOPs (fairseq_alma/stream/transformer_flops.py): full = attention scores "
        "QK and AV over the whole context, as computed; kaplan = Kaplan et al. 2020 (QK only); "
        "params = 2 FLOPs per parameter used, which gives the paper's 126 GFLOPs for the large "
        "model")})
    fairseq_validation: bool = field(default=False, metadata={"help": (
        "also run fairseq's own validation (and write checkpoint_best.pt, which means nothing "
        "across stages); off by default: stream.jsonl records the validation perplexity after "
        "every arrival")})
    restart_stream: bool = field(default=False, metadata={"help": (
        "start the stream again in a --save-dir that holds another run, or this run finished: its "
        "files are moved to SAVE_DIR/replaced-<time>/ (nothing is deleted); without it such a "
        "directory is refused")})
    save_dir: str = II("checkpoint.save_dir")
    max_epoch: int = II("optimization.max_epoch")
    max_tokens_valid: Optional[int] = II("dataset.max_tokens_valid")
    max_tokens: Optional[int] = II("dataset.max_tokens")
    required_batch_size_multiple: int = II("dataset.required_batch_size_multiple")
    distributed_world_size: int = II("distributed_training.distributed_world_size")
    update_freq: List[int] = II("optimization.update_freq")
    tensorboard_logdir: Optional[str] = II("common.tensorboard_logdir")


def check_wait_auto(cfg: AlmaStreamConfig, manifest: dict) -> None:
    """What ``--wait auto`` cannot do correctly, refused before anything is trained: stages
    whose size, growth or replayed share must be known in advance (``AUTO_CONFLICTS``), and a
    drifting stream, whose validation set samples every period (a decision would see later
    periods)."""
    conflict = auto_wait_conflict({"scale-updates-by-wait": cfg.scale_updates_by_wait,
                                   "grow-experts": cfg.grow_experts, "replay-ratio": cfg.replay_ratio,
                                   "update-freq": len(set(cfg.update_freq)) > 1,
                                   "eval-subset": cfg.eval_subset})
    require(conflict is None, conflict or "")
    require(manifest.get("order", "shuffle") == "shuffle",
            "--wait auto on a stream prepared with --order given: not supported (its validation "
            "set samples every period, so a decision would see later periods); use a fixed --wait")


def _verify_stream_dir(data: str) -> dict:
    from fairseq_alma.stream.manifest import verify_stream_dir

    return verify_stream_dir(data)


@register_task("alma_stream", dataclass=AlmaStreamConfig)
class AlmaStreamTask(LanguageModelingTask):
    """Language-model ALMA stream over an ``alma-data-prep`` directory (module doc)."""

    def __init__(self, cfg: AlmaStreamConfig, dictionary: Dictionary, manifest: dict) -> None:
        super().__init__(cfg, dictionary)
        self.cfg = cfg  # LanguageModelingTask is a legacy task: it only sets self.args
        self.manifest = manifest
        self.training: Any = None  # set when this process trains (build_model)
        self.stream_plan = StreamPlan(int(manifest["num_megabatches"]), wait_from_flag(cfg.wait),
                                      cfg.replay, float(cfg.replay_ratio))
        # --wait auto: U updates per stage, whatever the arrivals it covers (check_wait_auto)
        self.budget = stage_budget(cfg.updates_per_stage, cfg.wait or 1, cfg.scale_updates_by_wait)
        check_replay_budget(self.plan.replay_ratio, self.budget)
        self.growth_plan = parse_growth_plan(cfg.grow_experts, cfg.grow_at_stages, self.plan.max_stages)
        self.model: Any = None
        self.slot_tokens: Dict[int, List[int]] = {}  # stage -> tokens of each update slot
        self.stage_slots: Dict[int, int] = {}  # stage -> update slots of the list fairseq trains
        self.batches_ran_out = False  # stop (and save) mid-stage: see after_update

    @property
    def plan(self) -> StreamPlan:
        """The stream's plan: the training session's once it runs (with ``--wait auto`` it
        grows by one decision per arrival), else the one the flags describe."""
        return self.training.session.plan if self.training is not None else self.stream_plan

    @classmethod
    def add_args(cls, parser: Any) -> None:
        """The dataclass's flags, with ``--wait`` also taking ``auto`` (``wait_flag``)."""
        super().add_args(parser)
        for action in parser._actions:
            if "--wait" in action.option_strings:
                action.type = wait_flag

    @classmethod
    def setup_task(cls, cfg: AlmaStreamConfig, **kwargs: Any) -> Any:
        from ..fairseq_glue.config import given, model_name

        if model_name(cfg) == "alma_vision":  # a vision stream (--arch alma_vision --vision-dataset)
            from ..fairseq_glue.vision_entry import VisionStreamEntry

            return VisionStreamEntry.setup_task(cfg, **kwargs)
        require(cfg.data is not None, "the stream directory (DATA) is required")
        paths = [path for path in cfg.data.split(os.pathsep) if path]
        # fairseq's DIR1:DIR2 reads one directory per epoch, and a stream's epochs are its
        # stages: every directory but the first would be ignored
        require(len(paths) == 1, f"DATA {cfg.data}: an alma_stream run reads one prepared stream; "
                f"give one directory (the --out of alma-data-prep)")
        data = paths[0]
        impl = given(cfg, "dataset", "dataset_impl")  # None for a task config standing alone
        require(impl is None or str(getattr(impl, "value", impl)) == "mmap",
                f"--dataset-impl {getattr(impl, 'value', impl)}: a stream's splits are the mmap binaries "
                f"alma-data-prep writes; drop --dataset-impl")
        if os.path.exists(data) and not os.path.isdir(data):
            raise DataError(f"DATA {data}: not a directory; give the --out directory of alma-data-prep")
        manifest = _verify_stream_dir(data)
        if kept_repeats(manifest):
            logger.warning("%s: %d documents that repeat an earlier one were kept (alma-data-prep "
                           "--keep-duplicates), so evaluation may be partly on text it trains on; "
                           "alma-data-prep --verify %s counts the held-out ones", data,
                           kept_repeats(manifest), data)
        if cfg.wait is None:
            check_wait_auto(cfg, manifest)
        require(cfg.updates_per_stage >= 1, f"--updates-per-stage must be >= 1 (got {cfg.updates_per_stage})")
        dictionary = Dictionary.load(os.path.join(data, "dict.txt"))
        return cls(cfg, dictionary, manifest)

    # ---- model; the start of training --------------------------------------------------
    def build_model(self, cfg: Any, from_checkpoint: bool = False) -> Any:
        model = super().build_model(cfg, from_checkpoint)
        self.model = model  # the same module fairseq trains (moved/cast in place by the Trainer)
        layers = model.moe_layers() if hasattr(model, "moe_layers") else []
        self.check_growth_room(layers[0].num_experts if layers else None,
                               layers[0].max_experts if layers else 0)
        if not from_checkpoint:
            from ..fairseq_glue.stream_training import StreamTraining
            from ..lm.growth import check_growth_schedule

            # training only: a run already trained with such flags is still scored
            check_growth_schedule(self.cfg.grow_experts, self.cfg.grow_at_stages, self.plan.max_stages,
                                  layers[0].num_experts if layers else 0, self.cfg.stage_init)

            self.training = StreamTraining(self)
            _log_expert_parameters(layers)
        return model

    def check_growth_room(self, experts: Optional[int], slots: int) -> None:
        """``--grow-experts`` against the model's MoE blocks: ``experts`` per block before the
        first growth (None: the model has no MoE block) and the ``slots`` allocated per block
        (``--moe-max-experts``).  ``build_model`` asks it of the model it built; ``alma-sweep
        submit`` of the model the flags describe (``sweeps/point_values.py``), so a sweep is
        refused before its tasks queue."""
        if not self.growth_plan:
            return
        if experts is None:
            raise UsageError("--grow-experts needs a model with MoE blocks")
        final = experts + sum(self.growth_plan.values())
        require(slots >= final, f"--moe-max-experts must be >= {final} to grow by --grow-experts "
                f"{self.cfg.grow_experts} (allocated: {slots})")

    # ---- data --------------------------------------------------------------------------
    def load_dataset(self, split: str, epoch: int = 1, combine: bool = False, **kwargs: Any) -> None:
        if split != "train":
            self._check_split(split)
            super().load_dataset(split, epoch=epoch, combine=False, **kwargs)
            return
        if self.plan.adaptive and self.training is not None:
            # --wait auto: stage ``epoch`` is known once the arrivals before it are decided
            self.training.arrive_until_stage(epoch)
            self.datasets["train"] = self._stage_dataset(epoch)
            return
        self.datasets["train"] = self._stage_dataset(min(epoch, self.plan.num_stages))
        if self.training is not None:
            self.training.stage_boundary(epoch - 1)

    def _check_split(self, split: str) -> None:
        """A split the stream does not hold (``--valid-subset``, fairseq-eval-lm's
        ``--gen-subset``) is one line naming the ones it does; fairseq would end in a
        FileNotFoundError traceback."""
        data = self.cfg.data.split(os.pathsep)[0]
        names = expected_splits(int(self.manifest["num_megabatches"]),
                                self.manifest.get("eval_per_megabatch") is not None)
        if split not in names:
            held_out = [name for name in names if not name.startswith("megabatch")]
            raise MissingSplit(f"{data}: the stream has no split {split!r} (the subset flag: "
                            f"--valid-subset, or fairseq-eval-lm's --gen-subset); it holds "
                            f"{', '.join(held_out)} and megabatch0..{self.plan.num_megabatches - 1}")

    def _stage_dataset(self, stage: int) -> Any:
        """The mega-batches ``stage`` trains on (new ones, or all seen with --replay), concatenated;
        with --replay-ratio the earlier ones its replayed updates draw from follow them, so the
        new ones keep the indices they have without replay."""
        info = self.plan.stage(stage)
        parts = [self._megabatch(k) for k in info.train_megabatches + info.replay_megabatches]
        return parts[0] if len(parts) == 1 else ConcatDataset(parts)

    def _megabatch(self, k: int) -> Any:
        name = f"megabatch{k}"
        if name not in self.datasets:
            super().load_dataset(name, epoch=1, combine=False)
        return self.datasets[name]

    def dataset_split(self, name: str) -> Any:
        """A fixed split (eval, valid), loaded once."""
        if name not in self.datasets:
            super().load_dataset(name, epoch=1, combine=False)
        return self.datasets[name]

    def has_sharded_data(self, split: str) -> bool:
        return split == "train"  # a new dataset every epoch (= stage)

    def get_batch_iterator(self, dataset: Any, max_tokens: Optional[int] = None, max_sentences: Optional[int] = None,
                           max_positions: Any = None, ignore_invalid_inputs: bool = False,
                           required_batch_size_multiple: int = 1, seed: int = 1, num_shards: int = 1,
                           shard_id: int = 0, num_workers: int = 0, epoch: int = 1, data_buffer_size: int = 0,
                           **kwargs: Any) -> iterators.EpochBatchIterator:
        if dataset is not self.datasets.get("train"):
            # every block of a split scored: fairseq's batch_by_size with a batch multiple of 8
            # (its default) leaves out the last blocks that fill no multiple, so fairseq-validate
            # printed 361.41 at --batch-size 4 and 361.97 at 1 for a split whose perplexity is
            # 361.92 (the stream's records and fairseq-eval-lm batch their own way)
            return super().get_batch_iterator(
                dataset, max_tokens=max_tokens, max_sentences=max_sentences, max_positions=max_positions,
                ignore_invalid_inputs=ignore_invalid_inputs, required_batch_size_multiple=1,
                seed=seed, num_shards=num_shards, shard_id=shard_id, num_workers=num_workers, epoch=epoch,
                data_buffer_size=data_buffer_size, **kwargs)
        stage = min(epoch, self.plan.num_stages)
        slots = self.budget + spare_updates(self.budget) + self._skips_before_this_process(stage)
        batches = self._stage_batches(stage, dataset, max_tokens, max_sentences, required_batch_size_multiple,
                                      seed, num_shards, slots)
        if epoch <= self.plan.num_stages:  # fairseq also builds the epoch after the last one
            self.stage_slots[stage] = slots
            self._log_stage(stage, slots)
        return iterators.EpochBatchIterator(
            dataset=dataset, collate_fn=dataset.collater, batch_sampler=batches, seed=seed,
            num_shards=num_shards, shard_id=shard_id, num_workers=num_workers, epoch=epoch,
            buffer_size=data_buffer_size, disable_shuffling=True)

    def _log_stage(self, stage: int, slots: int) -> None:
        """Say what the stage trains on, and why fairseq's progress counts past its updates (the
        spare batches): a stage that ended at 100 of 120 looked cut short."""
        info, spares = self.plan.stage(stage), slots - self.budget
        of = "" if self.cfg.wait is None else f" of {self.plan.num_stages}"  # --wait auto: not known yet
        replay = f" (replayed updates from {','.join(map(str, info.replay_megabatches))})" \
            if info.replay_megabatches else ""
        logger.info("alma_stream: stage %d%s (arrival %d) trains on mega-batch%s %s%s: %d updates; fairseq's "
                    "progress counts to %d (%d spares for steps an fp16 overflow skips)", stage, of, info.arrival,
                    "es" if len(info.train_megabatches) > 1 else "", ",".join(map(str, info.train_megabatches)),
                    replay, self.budget, slots, spares)

    def _skips_before_this_process(self, stage: int) -> int:
        """Steps of ``stage`` skipped before this process started it: a run that resumes
        mid-stage gives the stage that many more batches, so a stage whose skips used up its
        spares (``after_update`` then stopped and saved) continues.  Its list is built before
        fairseq hands the task its checkpointed state, so that state's clock is read from
        ``checkpoint_last.pt`` first (memory-mapped: the weights are not read).  Why this is
        exact: a longer list starts with the same batches (``lm/budget.py``), so where a run
        stopped changes how far its list reaches, never what it trains."""
        session = self.training.session if self.training is not None else None
        if session is None or session.clock is None:
            return 0
        if session.live:  # --wait auto restored the state before fairseq's load
            clock = session.clock
            return clock.skipped if clock.stage == stage else 0
        if not session.resuming:
            return 0
        import torch

        try:
            state = torch.load(session.run_dir.last_checkpoint, map_location="cpu", mmap=True,
                               weights_only=False)
            clock = ((state.get("extra_state") or {}).get(type(self).__name__) or {}).get("clock") or {}
        except Exception:  # noqa: BLE001 - fairseq's own load of the file says why, in one line
            return 0
        return int(clock.get("skipped", 0)) if int(clock.get("stage", 0)) == stage else 0

    def _stage_batches(self, stage: int, dataset: Any, max_tokens: Optional[int], max_sentences: Optional[int],
                       multiple: int, seed: int, num_shards: int, slots: int) -> List[np.ndarray]:
        """The stage's batch list, ``slots`` update slots of update_freq x workers batches: its
        budget, then spares for the steps fairseq may skip (fp16 overflow); the stage ends after
        its budget of counted updates (``stream/stage_clock.py``), wherever that falls in the
        list.  With --replay-ratio the replay slots (``stream/replay.py``) take their batches
        from the earlier mega-batches, which follow the new ones in ``dataset``.  Keeps each
        slot's tokens (``train_tokens``)."""
        per_slot = self.update_freq(stage) * num_shards
        new_examples = sum(len(self._megabatch(k)) for k in self.plan.stage(stage).train_megabatches)

        def make_batches(order: np.ndarray) -> List[np.ndarray]:
            return list(data_utils.batch_by_size(order, dataset.num_tokens, max_tokens=max_tokens,
                                                 max_sentences=max_sentences, required_batch_size_multiple=multiple))

        def new_batches(count: int) -> List[np.ndarray]:
            return fixed_budget_batches(new_examples, make_batches, count, seed, stage)

        def replay_batches(count: int) -> List[np.ndarray]:  # uniformly over every earlier example
            return fixed_budget_batches(len(dataset) - new_examples, lambda order: make_batches(order + new_examples),
                                        count, seed, stage, source=1)

        pattern = slot_pattern(slots, self.budget, self.plan.replay_slots(stage, self.budget))
        batches = interleave_slots(pattern, per_slot, new_batches, replay_batches)
        tokens = [int(dataset.sizes[b].sum()) for b in batches]
        if len(self.slot_tokens.get(stage, ())) < slots:  # a longer list starts with the same slots
            self.slot_tokens[stage] = [sum(tokens[u * per_slot:(u + 1) * per_slot]) for u in range(slots)]
        return batches

    def update_freq(self, stage: int) -> int:
        """Batches per update in ``stage``: ``--update-freq`` may list one per fairseq epoch, which
        is one per stage here, its last entry holding for every later one (as fairseq's trainer
        reads it).  Why per stage: the stage's batch list and its recorded tokens (and so its
        FLOPs) must be the ones fairseq trains; taking the last entry for every stage recorded
        1.5x stage 1's compute under ``--update-freq 2,3``."""
        freqs = list(self.cfg.update_freq)
        return int(freqs[stage - 1] if stage <= len(freqs) else freqs[-1])

    def train_tokens(self, stage: int) -> int:
        """Tokens of the finished ``stage``'s counted updates (the README's "every counted
        update"): the slots its counted updates trained on (``counted_slots``), not the
        first budget of them, since a skipped step's batches were not trained and the next
        slot's were trained in its place.  A function of the stage, the batching flags and the
        clock's skipped slots (kept in the checkpoint), so a resumed run records the same
        cumulative compute as an uninterrupted one."""
        clock = self.training.session.clock if self.training is not None else None
        slots = counted_slots(self.budget, clock.skipped_slots.get(stage, []) if clock is not None else [])
        if slots[-1] >= len(self.slot_tokens.get(stage, ())):  # not built, or built shorter
            self._stage_batches(stage, self._stage_dataset(stage), self.cfg.max_tokens, self.cfg.batch_size,
                                self.cfg.required_batch_size_multiple, self.cfg.seed, self.cfg.distributed_world_size,
                                max(slots[-1] + 1, self.budget + spare_updates(self.budget)))
        tokens = self.slot_tokens[stage]
        return sum(tokens[u] for u in slots)

    # ---- training hooks ----------------------------------------------------------------
    def train_step(self, sample: Any, model: Any, criterion: Any, optimizer: Any, update_num: int,
                   ignore_grad: bool = False) -> Any:
        if self.training is not None:
            self.training.before_update(update_num, optimizer)
        return super().train_step(sample, model, criterion, optimizer, update_num, ignore_grad)

    def begin_epoch(self, epoch: int, model: Any) -> None:
        super().begin_epoch(epoch, model)
        if self.training is not None:
            self.training.resolve_start()

    def after_update(self, num_updates: int) -> bool:
        """Asked by ``fairseq_glue/patches.install_requeue_save`` after every update attempt: True
        when the stage's budget of counted updates is done (the epoch then ends there).

        A stage whose skipped steps (fp16 overflows) leave its list too few batches for its
        budget stops here, mid-stage, while one slot is left (fairseq would otherwise end the
        epoch and save its end, a stage that cannot be continued): ``stop_requested`` then saves
        ``checkpoint_last.pt``, and the same command continues the stage with more batches
        (``_skips_before_this_process``)."""
        if self.training is None:
            return False
        done = self.training.after_update(num_updates)
        clock = self.training.session.clock
        slots = self.stage_slots.get(clock.stage)
        if not done and slots is not None and not clock.can_finish(slots - 1) and not self.batches_ran_out:
            self.batches_ran_out = True
            logger.warning("stage %d: %d steps skipped by the trainer (e.g. fp16 overflows) leave its batches "
                           "too few for its %d counted updates (%d done): saving checkpoint_last.pt and stopping; "
                           "the same command continues the stage with %d more spare batches", clock.stage,
                           clock.skipped, self.budget, clock.counted, spare_updates(self.budget))
        return done

    def stop_requested(self, num_updates: int) -> bool:
        """Asked by ``fairseq_glue/patches.install_requeue_save`` after every update: a signal,
        or a stage whose batches ran out (``after_update``)."""
        return self.training is not None and all_ranks_stop(self.training.session.stop_requested
                                                            or self.batches_ran_out)

    def state_dict(self) -> Dict[str, Any]:
        """fairseq keeps this in every checkpoint (``task_state``): the dictionary trained with."""
        return {"dictionary_sha256": self.manifest["dictionary"]["sha256"]}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """fairseq calls this when it loads a checkpoint through the task (alma-score,
        fairseq-eval-lm): a checkpoint trained with another dictionary would score every token
        against the wrong ids, so it is refused."""
        check_same_dictionary((state_dict or {}).get("dictionary_sha256"), self.manifest["dictionary"]["sha256"],
                              os.path.join(self.cfg.data.split(os.pathsep)[0], "dict.txt"))

    def get_checkpoint_dict(self) -> Dict[str, Any]:
        """The stream core's progress, saved inside fairseq's checkpoint (extra_state)."""
        if self.training is None:
            return {}
        return {type(self).__name__: self.training.state_dict()}

    def set_checkpoint_dict(self, state: Dict[str, Any]) -> None:
        """Called by fairseq after it restored the model and the epoch iterator."""
        if self.training is not None:
            self.training.load_state_dict(state)


def _log_expert_parameters(layers: List[Any]) -> None:
    """fairseq's next line, "num. expert model params: 0", counts only parameters marked
    ``expert`` (kept out of its data-parallel all-reduce and grad norm: here, only expert-parallel
    shards). Say where the Switch experts are, so a user does not read 0 as "no experts"."""
    from ..modules.expert_parallel import EXPERT_PARAMETERS

    if not layers or any(getattr(getattr(layers[0], n), "expert", False) for n in EXPERT_PARAMETERS):
        return
    per_expert = [sum(getattr(layer, n)[0].numel() for n in EXPERT_PARAMETERS) for layer in layers]
    active = sum(size * layer.num_experts for size, layer in zip(per_expert, layers))
    slots = sum(size * layer.max_experts for size, layer in zip(per_expert, layers))
    spare = f"; {slots - active:,} more in slots kept for --grow-experts" if slots > active else ""
    blocks = f"{len(layers)} MoE block" + ("s" if len(layers) > 1 else "")
    logger.info(f"Switch experts: {active:,} parameters in {blocks}{spare}; "
                "fairseq counts them among its shared params below (its expert count is only "
                "for expert-parallel shards)")

