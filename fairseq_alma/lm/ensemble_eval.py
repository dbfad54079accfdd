"""Scoring stage checkpoints for ``alma-score``: single models and probability-averaging ensembles.

Ens and gEns predict with the *average of their members' probabilities* (paper §4.1; DESIGN.md:
log-space, logsumexp − log N).  The averaged distribution's probability of a target token needs
only each member's probability of that same token, so the members of a predictor are loaded
together and run on each batch in turn; their target log-probabilities are combined in float64
(−(logsumexp_i log p_i − log N) per token) and summed before the next batch.  Memory is O(batch)
in the evaluation set (the paper's is 440M words: per-token vectors would not fit a job's host
memory; data-parallel scoring keeps 2M + 1 numbers per batch, ~3 MB for that set, to add them
in one process's order) and O(members) in models.  gEns's nested predictors (members 1..s for s = 1..S, Table 2)
are prefixes of one chain, so one pass over the data with its S members answers all of them and
each checkpoint is evaluated once.

Every model is scored by ``lm/nll.py``'s loop, the one the ``alma_stream`` task logs
``eval_ppl`` with: the tokens ``fairseq-eval-lm`` scores with the same --tokens-per-sample and no
context window; so a single model's perplexity equals stream.jsonl's.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from fairseq import checkpoint_utils, utils

from ..errors import AlmaError, CheckpointError, MissingSplit, UsageError
from ..ranks import world
from ..stream.eval_batching import own_eval_batch_size
from .eval_slice import EvalSlice, slice_dataset
from .nll import Batching, eval_batches, non_finite_loss, target_log_probs
from .score_distributed import all_reduce_sums, rows_in_batch_order

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSettings:
    """What a checkpoint is scored on; checkpoints with equal settings share one task/dataset."""

    data: str  # stream directory (alma-data-prep output)
    subset: str  # split name, e.g. "eval" (the evaluation mega-batch)
    tokens_per_sample: int  # block length: the same value fairseq-eval-lm is given
    batch_size: int  # sequences per batch (the stream's evaluation batching by default)
    max_tokens: int | None = None  # tokens per batch cap, as the task's --max-tokens-valid
    max_eval_tokens: int | None = None  # score the split's first blocks only (eval_slice.py)

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        data: str | None = None,
        subset: str | None = None,
        tokens_per_sample: int | None = None,
        batch_size: int | None = None,
        max_eval_tokens: int | None = None,
    ) -> EvalSettings:
        """The evaluation ``alma_stream`` ran after each arrival (a checkpoint's fairseq config),
        with any value given here overriding it."""
        task, dataset = cfg.task, cfg.dataset
        return cls(
            data=data or task.data,
            subset=subset or task.get("eval_subset") or "eval",
            tokens_per_sample=tokens_per_sample or int(task.tokens_per_sample),
            batch_size=batch_size or own_eval_batch_size(cfg),
            max_tokens=dataset.get("max_tokens_valid"),
            max_eval_tokens=max_eval_tokens,
        )


@dataclass
class JointScore:
    """Members 1..M scored on the same batches: every prefix's averaged prediction, and each
    member alone (for the log)."""

    prefix_nll: list[float]  # [k - 1]: summed NLL in nats of averaging members 1..k
    member_nll: list[float]  # [i]: summed NLL in nats of member i alone
    ntokens: int
    seconds: float  # first batch to last; iterator set-up excluded, as fairseq-eval-lm times it
    # with ``keep_rows``: each batch's terms [prefix 1..M, alone 1..M, tokens] (float64), in the
    # order this rank scored them, for a data-parallel total added in one process's order
    batch_rows: list[torch.Tensor] | None = None


@torch.no_grad()
def score_jointly(models: Sequence[Any], batches: Iterable[dict[str, Any]], pad: int,
                  keep_rows: bool = False) -> JointScore:
    """Score ``batches`` with every model, batch by batch, keeping only running sums.

    For each batch each member gives log p_i(target) (B, T); a float64 running logsumexp over
    members 1..k, minus log k, is the log-probability of the k-member average (paper §4.1), and
    its negated sum over non-padding targets is added to prefix k's NLL.  Nothing outlives its
    batch, so memory is O(batch), whatever the size of the evaluation set.  With one model this
    is the task's ``eval_ppl`` sum exactly (log 1 = 0; padding contributes 0).  ``keep_rows``
    (data-parallel scoring) also keeps each batch's terms, an empty batch's as zeros, so that
    ``all_ranks_joint`` can add every rank's batches in one process's order.
    """
    device = next(models[0].parameters()).device
    for model in models:
        model.eval()
    log_k = [math.log(k) for k in range(1, len(models) + 1)]
    prefix = torch.zeros(len(models), dtype=torch.float64, device=device)  # running NLL sums
    alone = torch.zeros(len(models), dtype=torch.float64, device=device)
    ntokens = torch.zeros((), dtype=torch.int64, device=device)
    rows: list[torch.Tensor] | None = [] if keep_rows else None
    start = time.perf_counter()
    for sample in batches:
        if not sample or "net_input" not in sample:  # the sharded iterator's padding batches
            if rows is not None:
                rows.append(torch.zeros(2 * len(models) + 1, dtype=torch.float64, device=device))
            continue
        if device.type == "cuda":
            sample = utils.move_to_cuda(sample, device=device)
        log_sum = None  # (B, T) float64: log sum_{i<=k} p_i(target)
        averaged_sums, member_sums = [], []
        for i, model in enumerate(models):
            token, mask = target_log_probs(model, sample, pad)  # (B, T) float32, 0 at padding
            token = token.double()
            member = token.sum()
            alone[i] -= member
            log_sum = token if log_sum is None else torch.logaddexp(log_sum, token)
            averaged = (log_sum - log_k[i]).masked_fill(~mask, 0.0).sum()
            prefix[i] -= averaged
            averaged_sums.append(averaged)
            member_sums.append(member)
        count = mask.sum()
        ntokens += count
        if rows is not None:
            rows.append(torch.stack([*averaged_sums, *member_sums, count.double()]))
    totals = prefix.tolist()  # synchronises a CUDA device before the clock stops
    seconds = time.perf_counter() - start
    return JointScore(totals, alone.tolist(), int(ntokens), seconds, rows)


def all_ranks_joint(scored: JointScore) -> JointScore:
    """Every data-parallel rank's ``JointScore`` of its share of the batches added up
    (score_distributed.py); the wall time is the slowest rank's.  Itself with one process.

    Why rows, not an all-reduce of each rank's sums: batch i is rank i % N's, so rank sums
    added together associate the float64 additions differently from one process (the last
    digits of a perplexity differed, and a CSV written by N processes was not the file one
    process writes).  Every rank's batch terms are gathered and subtracted in global batch
    order, the order ``score_jointly`` uses alone: the totals are one process's, bit for bit."""
    if scored.batch_rows is None:
        return scored
    m = len(scored.prefix_nll)
    width = 2 * m + 1
    rows = torch.stack(scored.batch_rows) if scored.batch_rows else \
        torch.zeros(0, width, dtype=torch.float64)
    totals, ntokens = [0.0] * (2 * m), 0
    for row in rows_in_batch_order(rows):
        for j in range(2 * m):
            totals[j] -= row[j]
        ntokens += int(row[2 * m])
    _, (seconds,) = all_reduce_sums([], [scored.seconds])
    return JointScore(totals[:m], totals[m:], ntokens, seconds)


class CheckpointScorer:
    """Loads checkpoints onto one device and scores them; counts progress over ``total`` loads.

    Every checkpoint's model is built by a task set up from its own config (a run's growth or
    UMix settings build its model); the evaluation dataset (with its ``--max-eval-tokens``
    slice) is loaded once per ``EvalSettings`` and data-shaping task settings
    (``DATASET_TASK_KEYS``) and shared by every checkpoint scored with them, as
    ``fairseq-eval-lm`` does for an ensemble.  Why not one task for all: a task shared across
    runs built every later run's model and blocks with the first run's settings (seen: a run
    trained with ``--sample-break-mode eos`` scored 205.28 after another run, 189.55 alone).  Under several processes (score_distributed.py)
    each scores batch i with i % world == its rank, and the sums are all-reduced, so every
    rank returns the totals.  ``fp16`` halves each model's weights (CUDA only:
    the caller refuses it on CPU); log-probabilities are still taken in float32 and summed in
    float64 (``score_jointly``).
    """

    def __init__(self, use_cuda: bool, total: int, fp16: bool = False) -> None:
        # the GPU score_distributed.scoring_group picked for this rank (cuda:0 alone)
        self.device = torch.device("cuda", torch.cuda.current_device()) if use_cuda \
            else torch.device("cpu")
        self.fp16 = fp16
        self.total = total
        self.done = 0
        self.tokens = 0
        self.seconds = 0.0
        self._datasets: dict[tuple, tuple[Any, Any, EvalSlice]] = {}
        self._keys: dict[tuple, tuple] = {}  # settings key -> the dataset key of its last load

    @staticmethod
    def _key(settings: EvalSettings) -> tuple:
        return (settings.data, settings.subset, settings.tokens_per_sample,
                settings.max_eval_tokens)

    def eval_slice(self, settings: EvalSettings) -> EvalSlice:
        """Which blocks of the split checkpoints were scored on with ``settings``."""
        return self._datasets[self._keys[self._key(settings)]][2]

    def _load(self, path: str, settings: EvalSettings) -> tuple[Any, Any, Any, tuple]:
        # experts whole on every rank (moe_expert_parallel_size 1): an expert-parallel run's
        # checkpoint holds full [E, ...] experts, and scoring ranks run no collective in the
        # forward. Sharded, a rank with one batch fewer waited in all_to_all forever, the
        # numbers differed from one process's, and 3 ranks were refused naming training flags.
        overrides = {"data": settings.data, "tokens_per_sample": settings.tokens_per_sample,
                     "moe_expert_parallel_size": 1}
        try:
            models, _, own_task = checkpoint_utils.load_model_ensemble_and_task(
                [path], arg_overrides=overrides
            )
        except CheckpointError:
            raise
        except AlmaError as err:
            raise type(err)(f"{path} with data {settings.data}: {err} (--data)") from None
        except (OSError, RuntimeError, KeyError) as err:
            raise UsageError(f"{path}: cannot load ({str(err).splitlines()[0]})") from None
        model = (models[0].half() if self.fp16 else models[0]).to(self.device)
        key = (*self._key(settings), dataset_task_settings(own_task.cfg))
        if key not in self._datasets:
            try:
                own_task.load_dataset(settings.subset)
            except (FileNotFoundError, MissingSplit):  # fairseq's task, or alma_stream's
                raise UsageError(
                    f"--subset {settings.subset}: no such split in {settings.data} "
                    f"(the stream's evaluation mega-batch is 'eval')"
                ) from None
            dataset, chosen = slice_dataset(own_task.dataset(settings.subset),
                                            settings.max_eval_tokens)
            self._datasets[key] = (own_task, dataset, chosen)
        self._keys[self._key(settings)] = key
        task, dataset, _ = self._datasets[key]
        if settings.tokens_per_sample > model.max_positions():
            raise UsageError(
                f"--tokens-per-sample {settings.tokens_per_sample} exceeds {path}'s "
                f"{model.max_positions()} positions; pass at most {model.max_positions()}"
            )
        return model, task, dataset, key

    def score_members(self, paths: list[str], settings: EvalSettings) -> JointScore:
        """Load ``paths`` together and score them on the same batches (``score_jointly``)."""
        loaded = [self._load(path, settings) for path in paths]
        models, (_, task, dataset, key) = [model for model, *_ in loaded], loaded[0]
        for path, (*_, other) in zip(paths[1:], loaded[1:]):
            if other != key:  # members averaged token by token must see the same blocks
                mine, theirs = dict(key[-1]), dict(other[-1])
                changed = [f"--{k.replace('_', '-')} {mine.get(k)} vs {theirs.get(k)}"
                           for k in dict.fromkeys([*mine, *theirs]) if mine.get(k) != theirs.get(k)]
                raise UsageError(f"{path} cuts the evaluation data into other blocks than "
                                 f"{paths[0]} ({'; '.join(changed)}); an ensemble's members must be "
                                 f"trained with the same data settings")
        batching = Batching(settings.batch_size, settings.max_tokens)
        size, rank = world()
        batches = eval_batches(models, task, dataset, batching, num_shards=size, shard_id=rank,
                               prefetch=10)
        scored = all_ranks_joint(score_jointly(models, batches, task.target_dictionary.pad(),
                                               keep_rows=size > 1))
        for path, model, nll in zip(paths, models, scored.member_nll):
            why = non_finite_loss(nll, model)
            if why is not None:
                fix = "score it without --fp16" if self.fp16 else "leave this run out of the scoring"
                raise CheckpointError(f"{path}, scored on --subset {settings.subset}: {why}; {fix}")
        del models, loaded  # free the members before the next predictor is loaded
        self.tokens += scored.ntokens * len(paths)
        self.seconds += scored.seconds
        rate = f"{scored.ntokens * len(paths) / max(scored.seconds, 1e-9):,.0f}"
        timing = f"{scored.ntokens:,} tokens in {scored.seconds:.2f}s ({rate} tokens/s)"
        for i, path in enumerate(paths):
            self.done += 1
            logger.info("checkpoint %d/%d %s: %s, ppl %.2f", self.done, self.total,
                        os.path.relpath(path), timing if len(paths) == 1 else
                        f"{scored.ntokens:,} tokens", _ppl(scored.member_nll[i], scored.ntokens))
        if len(paths) > 1:
            logger.info("%d members scored together: %s, ppl %.2f of their average", len(paths),
                        timing, _ppl(scored.prefix_nll[-1], scored.ntokens))
        return scored


# fairseq's LanguageModelingTask.load_dataset reads these task settings besides the data, the
# split and --tokens-per-sample (the EvalSettings): checkpoints whose values differ are scored on
# differently built blocks, so they must not share a loaded dataset.
DATASET_TASK_KEYS = ("dataset_impl", "sample_break_mode", "shorten_method", "shorten_data_split_list",
                     "pad_to_fixed_length", "pad_to_fixed_bsz", "add_bos_token", "self_target",
                     "future_target", "past_target")


def dataset_task_settings(task_cfg: Any) -> tuple[tuple[str, Any], ...]:
    """The ``DATASET_TASK_KEYS`` of a task config (and the --seed a random crop draws with,
    and the batch size --pad-to-fixed-bsz pads to), hashable, in a fixed order."""
    keys = list(DATASET_TASK_KEYS)
    if str(task_cfg.get("shorten_method") or "none") != "none":
        keys.append("seed")
    if task_cfg.get("pad_to_fixed_bsz"):
        keys.append("batch_size_valid")
    return tuple((key, str(task_cfg.get(key))) for key in keys)


def _ppl(nll: float, ntokens: int) -> float:
    """For the log only (alma-score's tables use stream/metrics.py's checked version)."""
    return math.exp(min(nll / max(ntokens, 1), 700.0))


def predictor_chains(predictors: dict[int, list[str]]) -> list[tuple[list[str], list[int]]]:
    """Stages grouped so that each checkpoint is loaded once: a predictor that extends the
    previous one (gEns: members 1..s, then 1..s+1) joins its chain; any other (Ens: every
    member's stage-s checkpoint; single models) starts a new one.  Each chain is
    (its longest member list, the stages it answers)."""
    chains: list[tuple[list[str], list[int]]] = []
    for stage in sorted(predictors):
        members = predictors[stage]
        if chains and members[: len(chains[-1][0])] == chains[-1][0]:
            chains[-1] = (members, chains[-1][1] + [stage])
        else:
            chains.append((members, [stage]))
    return chains


def score_predictors(
    scorer: CheckpointScorer, predictors: dict[int, list[str]], settings: EvalSettings
) -> dict[int, tuple[float, int]]:
    """Summed NLL and tokens of each stage's predictor (a list of member checkpoints): each
    chain's members are scored together, batch by batch, and stage s reads the running sum of
    its own prefix of them."""
    out: dict[int, tuple[float, int]] = {}
    for members, stages in predictor_chains(predictors):
        scored = scorer.score_members(members, settings)
        for stage in stages:
            out[stage] = scored.prefix_nll[len(predictors[stage]) - 1], scored.ntokens
    return out
