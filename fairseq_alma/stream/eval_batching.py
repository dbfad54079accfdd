"""How a run's evaluation batches its blocks, and when scoring it with other batches changes the number.

Why its own file: the stage-end evaluation (``fairseq_glue/stream_training.py``), alma-score's
(``lm/ensemble_eval.EvalSettings``, ``scoring/series.settings_for``) and ``alma-sweep score`` (at submit, from each run's
``run.json``) must agree on both rules.

With ``--eval-capacity-factor`` an expert takes at most cf * ceil(T / E) of a batch's T token
positions in evaluation too, so which tokens are dropped, and the perplexity, depend on how the
blocks are batched.  Scoring such a run with another batch size gives another number, which
neither its records nor a report's grouping of scorings (by split, block length, precision and
data) would tell apart, so it is refused.
"""

from __future__ import annotations

from typing import Any

DEFAULT_EVAL_BATCH_SIZE = 8  # sequences, when a run gave neither --batch-size-valid nor --batch-size


def _section(config: Any, name: str) -> Any:
    """``config.<name>`` of a fairseq config node or of a run.json fingerprint's ``config`` dict."""
    get = getattr(config, "get", None)
    part = get(name) if get is not None else None
    return part if part is not None else {}


def eval_batch_size(batch_size_valid: int | None, batch_size: int | None) -> int:
    """Sequences per evaluation batch of a run given these flags (``--batch-size-valid``,
    ``--batch-size``)."""
    return int(batch_size_valid or batch_size or DEFAULT_EVAL_BATCH_SIZE)


def own_eval_batch_size(config: Any) -> int:
    """Sequences per batch of the evaluation the run ran after each arrival."""
    dataset = _section(config, "dataset")
    return eval_batch_size(dataset.get("batch_size_valid"), dataset.get("batch_size"))


def batch_size_problem(config: Any, batch_size: int | None, run: Any, *, given_as: str | None = None,
                       own_by_default: bool = True) -> str | None:
    """Why scoring ``run`` (its config ``config``) with ``batch_size`` sequences per batch would
    measure another number than its own evaluation (module doc), or None.

    ``given_as``: the flags that made ``batch_size``, as the message names them (default
    ``--batch-size N``); ``own_by_default``: the scoring tool takes the run's own batching when
    no batch size is given (alma-score), so dropping ``--batch-size`` is advice too (not for
    fairseq-eval-lm and fairseq-validate, whose batching is whatever their flags say)."""
    capacity = _section(config, "model").get("eval_capacity_factor")
    own = own_eval_batch_size(config)
    if capacity is None or batch_size is None or int(batch_size) == own:
        return None
    advice = f"drop --batch-size, or pass --batch-size {own}" if own_by_default else f"pass --batch-size {own}"
    return (f"{given_as or f'--batch-size {batch_size}'}: {run} evaluates with --eval-capacity-factor "
            f"{capacity:g}, so its perplexity depends on how the tokens are batched; score it with its "
            f"own evaluation batching ({advice})")
