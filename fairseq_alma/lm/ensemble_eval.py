"""Scoring stage checkpoints for ``alma-score``: single models and probability-averaging ensembles.

Ens and gEns predict with the *average of their members' probabilities* (paper §4.1; DESIGN.md:
log-space, logsumexp − log N).  The averaged distribution's probability of a target token needs
only each member's probability of that same token, so every member is scored once into a vector
of target log-probabilities (one float per scored token, in the evaluation set's fixed order) and
the ensemble's NLL per token is −(logsumexp_i log p_i − log N).  ``ProbabilityAverage`` keeps a
running logsumexp, so gEns's nested predictors (members 1..s for s = 1..S, Table 2) cost one
evaluation per member and O(tokens) memory, never all members' models at once.

Every model is scored by ``lm/nll.py``'s loop, the one the ``alma_stream`` task logs
``eval_ppl`` with: the tokens ``fairseq-eval-lm`` scores with the same --tokens-per-sample and no
context window; so a single model's perplexity equals stream.jsonl's.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
from fairseq import checkpoint_utils

from ..errors import AlmaError, CheckpointError, UsageError
from .nll import Batching, scored_batches

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EvalSettings:
    """What a checkpoint is scored on; checkpoints with equal settings share one task/dataset."""

    data: str  # stream directory (alma-data-prep output)
    subset: str  # split name, e.g. "eval" (the evaluation mega-batch)
    tokens_per_sample: int  # block length: the same value fairseq-eval-lm is given
    batch_size: int  # sequences per batch (the stream's evaluation batching by default)
    max_tokens: int | None = None  # tokens per batch cap, as the task's --max-tokens-valid

    @classmethod
    def from_config(
        cls,
        cfg: Any,
        data: str | None = None,
        subset: str | None = None,
        tokens_per_sample: int | None = None,
        batch_size: int | None = None,
    ) -> EvalSettings:
        """The evaluation ``alma_stream`` ran after each arrival (a checkpoint's fairseq config),
        with any value given here overriding it."""
        task, dataset = cfg.task, cfg.dataset
        return cls(
            data=data or task.data,
            subset=subset or task.get("eval_subset") or "eval",
            tokens_per_sample=tokens_per_sample or int(task.tokens_per_sample),
            batch_size=batch_size
            or dataset.get("batch_size_valid")
            or dataset.get("batch_size")
            or 8,
            max_tokens=dataset.get("max_tokens_valid"),
        )


@dataclass
class TokenLogProbs:
    """One member's log p(target) for every scored token, and those targets (for alignment)."""

    log_probs: torch.Tensor  # (N,) float32, on CPU
    targets: torch.Tensor  # (N,) int32, on CPU


@dataclass
class Scored:
    """One model's score on a dataset."""

    nll: float  # summed NLL in nats over the scored tokens
    ntokens: int
    seconds: float  # first batch to last; iterator set-up excluded, as fairseq-eval-lm times it
    tokens: TokenLogProbs | None = None  # per-token scores, when asked for (ensemble members)


def score_dataset(
    model: Any, task: Any, dataset: Any, settings: EvalSettings, keep_tokens: bool = False
) -> Scored:
    """NLL of every non-padding target of ``dataset``, batched and ordered as the task's
    ``eval_ppl`` (``lm/nll.py``); batches are prefetched by a background thread (as
    ``fairseq-eval-lm``) so collation overlaps the forward passes."""
    device = next(model.parameters()).device
    batches = scored_batches(model, task, dataset, Batching(settings.batch_size,
                                                            settings.max_tokens), prefetch=10)
    total = torch.zeros((), dtype=torch.float64, device=device)
    ntokens, scores, targets = 0, [], []
    start = time.perf_counter()
    for batch in batches:
        total -= batch.token_log_probs.double().sum()
        ntokens += int(batch.mask.sum())
        if keep_tokens:
            scores.append(batch.token_log_probs[batch.mask].cpu())
            targets.append(batch.sample["target"][batch.mask].to(torch.int32).cpu())
    nll = float(total)  # synchronises a CUDA device before the clock stops
    seconds = time.perf_counter() - start
    kept = None
    if keep_tokens:
        kept = TokenLogProbs(
            torch.cat(scores) if scores else torch.zeros(0),
            torch.cat(targets) if targets else torch.zeros(0, dtype=torch.int32),
        )
    return Scored(nll, ntokens, seconds, kept)


class ProbabilityAverage:
    """Running average of members' probabilities of the target tokens (in log space)."""

    def __init__(self) -> None:
        self._log_sum: torch.Tensor | None = None  # (N,) float64: log Σ_i p_i(target)
        self._targets: torch.Tensor | None = None
        self.members: list[str] = []

    def add(self, member: TokenLogProbs, name: str) -> None:
        """Add one member; it must have scored the very same tokens as the first one."""
        if self._targets is None:
            self._targets = member.targets
            self._log_sum = member.log_probs.double()
        else:
            if not torch.equal(member.targets, self._targets):
                raise UsageError(
                    f"{name} scored {member.targets.numel()} tokens that differ from "
                    f"{self.members[0]}'s {self._targets.numel()}; ensemble members must be "
                    f"scored on one --data, --subset and --tokens-per-sample"
                )
            self._log_sum = torch.logaddexp(self._log_sum, member.log_probs.double())
        self.members.append(name)

    def nll(self) -> tuple[float, int]:
        """Summed NLL in nats of the averaged prediction, and the number of scored tokens."""
        if self._log_sum is None:
            raise ValueError("no members added; add at least one before asking for the NLL")
        log_mean = self._log_sum - math.log(len(self.members))  # log (1/N Σ_i p_i)
        return float(-log_mean.sum()), int(log_mean.numel())


class CheckpointScorer:
    """Loads checkpoints onto one device and scores them; counts progress over ``total`` loads.

    A fairseq task (dictionary, manifest check, dataset) is set up once per ``EvalSettings`` and
    shared by every checkpoint scored with them, as ``fairseq-eval-lm`` does for an ensemble.
    """

    def __init__(self, use_cuda: bool, total: int) -> None:
        self.device = torch.device("cuda" if use_cuda else "cpu")
        self.total = total
        self.done = 0
        self.tokens = 0
        self.seconds = 0.0
        self._tasks: dict[tuple[str, str, int], tuple[Any, Any]] = {}

    def _load(self, path: str, settings: EvalSettings) -> tuple[Any, Any, Any]:
        key = (settings.data, settings.subset, settings.tokens_per_sample)
        task, dataset = self._tasks.get(key, (None, None))
        overrides = {"data": settings.data, "tokens_per_sample": settings.tokens_per_sample}
        try:
            models, _, task = checkpoint_utils.load_model_ensemble_and_task(
                [path], arg_overrides=overrides, task=task
            )
        except CheckpointError:
            raise
        except AlmaError as err:
            raise type(err)(f"{path} with data {settings.data}: {err} (--data)") from None
        except (OSError, RuntimeError, KeyError) as err:
            raise UsageError(f"{path}: cannot load ({str(err).splitlines()[0]})") from None
        model = models[0].to(self.device)
        if dataset is None:
            try:
                task.load_dataset(settings.subset)
            except FileNotFoundError:
                raise UsageError(
                    f"--subset {settings.subset}: no such split in {settings.data} "
                    f"(the stream's evaluation mega-batch is 'eval')"
                ) from None
            dataset = task.dataset(settings.subset)
            self._tasks[key] = (task, dataset)
        if settings.tokens_per_sample > model.max_positions():
            raise UsageError(
                f"--tokens-per-sample {settings.tokens_per_sample} exceeds {path}'s "
                f"{model.max_positions()} positions; pass at most {model.max_positions()}"
            )
        return model, task, dataset

    def _score(self, path: str, settings: EvalSettings, keep_tokens: bool) -> Scored:
        model, task, dataset = self._load(path, settings)
        scored = score_dataset(model, task, dataset, settings, keep_tokens)
        self.done += 1
        self.tokens += scored.ntokens
        self.seconds += scored.seconds
        ppl = math.exp(min(scored.nll / max(scored.ntokens, 1), 700.0))
        logger.info(
            "checkpoint %d/%d %s: %s tokens in %.2fs (%s tokens/s), ppl %.2f",
            self.done,
            self.total,
            os.path.relpath(path),
            f"{scored.ntokens:,}",
            scored.seconds,
            f"{scored.ntokens / max(scored.seconds, 1e-9):,.0f}",
            ppl,
        )
        return scored

    def nll(self, path: str, settings: EvalSettings) -> tuple[float, int]:
        """Summed NLL (nats) and token count of one model (the task's ``eval_ppl`` numbers)."""
        scored = self._score(path, settings, keep_tokens=False)
        return scored.nll, scored.ntokens

    def token_log_probs(self, path: str, settings: EvalSettings) -> TokenLogProbs:
        """Per-token target log-probabilities of one ensemble member."""
        return self._score(path, settings, keep_tokens=True).tokens


def score_predictors(
    scorer: CheckpointScorer, predictors: dict[int, list[str]], settings: EvalSettings
) -> dict[int, tuple[float, int]]:
    """Summed NLL and tokens of each stage's predictor (a list of member checkpoints).

    Single models (every predictor has one member) keep only sums.  Otherwise, when
    a predictor extends the previous one (gEns: members 1..s, then 1..s+1) the running average
    continues, so each checkpoint is evaluated once; else (Ens: every member's stage-s
    checkpoint) it restarts.
    """
    out: dict[int, tuple[float, int]] = {}
    if all(len(members) == 1 for members in predictors.values()):
        for stage in sorted(predictors):
            out[stage] = scorer.nll(predictors[stage][0], settings)
        return out
    average = ProbabilityAverage()
    for stage in sorted(predictors):
        members = predictors[stage]
        if average.members != members[: len(average.members)]:
            average = ProbabilityAverage()
        for path in members[len(average.members) :]:
            average.add(scorer.token_log_probs(path, settings), path)
        out[stage] = average.nll()
    return out
