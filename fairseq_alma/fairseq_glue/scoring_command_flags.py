"""The flags of fairseq's scoring commands (fairseq-eval-lm, fairseq-validate) that they would
take and then fail on, or score wrongly with.

Why a check before they run: they read these flags deep inside their loop, so a value they
cannot use ends in a traceback after the checkpoint was loaded (``--tokens-per-sample 0`` or a
``--context-window`` as long as the block: ZeroDivisionError; ``--max-tokens`` below one block:
an AssertionError in the batch sampler; ``--post-process sentencepiece``: NotImplementedError;
``--model-overrides`` that is not a dict: a NameError from its ``eval``; a negative
``--softmax-batch``: an AssertionError; ``--num-workers -1``: torch's ValueError), and a negative
``--context-window`` was silently taken as none.  fairseq-eval-lm on several processes (by
default every GPU of the node) scores each rank's share of the split and prints rank 0's
perplexity as the split's, a wrong number with exit 0: refused.  So is scoring a checkpoint that
evaluates with ``--eval-capacity-factor`` with other batches than its run's own evaluation: its
perplexity depends on how the tokens are batched (``stream/eval_batching.py``), and
fairseq-eval-lm printed 204.72 at --batch-size 1 for the 204.63 the run recorded, exit 0;
alma-score refuses the same (``batch_size_problem``).  Called from ``patches._TrainingConfig``,
right after the command's flags are parsed.
"""

from __future__ import annotations

import ast
from typing import Any

from ..errors import UsageError
from .config import given

# fairseq-eval-lm merges sub-words into words only for subword-nmt's "@@ " continuation marker
# (``fairseq_cli/eval_lm.py``); any other value raises NotImplementedError mid-run.
POST_PROCESS_MERGED = ("subword_nmt", "@@ ")


def check_scoring_flags(cfg: Any, command: str) -> None:
    """Refuse, in one line, the flags ``command`` (``eval_lm`` or ``validate``: the module of
    ``fairseq_cli``) cannot score with."""
    tokens = given(cfg, "task", "tokens_per_sample")
    if tokens is not None and tokens < 1:
        raise UsageError(f"--tokens-per-sample must be >= 1 (got {tokens}): the length of the "
                         "blocks scored, at most the model's positions")
    max_tokens = given(cfg, "dataset", "max_tokens")
    if tokens is not None and max_tokens is not None and max_tokens < tokens:
        raise UsageError(f"--max-tokens {max_tokens} holds no block of --tokens-per-sample {tokens}; "
                         f"use --max-tokens >= {tokens} or --batch-size")
    workers = given(cfg, "dataset", "num_workers")
    if workers is not None and workers < 0:  # torch's DataLoader: a ValueError traceback
        raise UsageError(f"--num-workers must be >= 0 (got {workers}): loader processes, 0 to load "
                         "in this process")
    overrides = given(cfg, "common_eval", "model_overrides")
    if overrides is not None:
        try:
            value = ast.literal_eval(str(overrides))
        except (ValueError, SyntaxError):
            value = None
        if not isinstance(value, dict):
            raise UsageError(f"--model-overrides {overrides!r} is not a Python dict of model "
                             "options, e.g. \"{'eval_capacity_factor': 2.0}\"")
    if command == "eval_lm":
        _check_eval_lm_flags(cfg, tokens)
    _check_capacity_batching(cfg, command, tokens, overrides)


# fairseq-eval-lm's token budget per batch when neither --max-tokens nor a smaller --batch-size
# limits it (``fairseq_cli/eval_lm.py``: ``max_tokens=cfg.dataset.max_tokens or 36000``)
EVAL_LM_MAX_TOKENS = 36000


def _check_capacity_batching(cfg: Any, command: str, tokens: int | None, overrides: Any) -> None:
    """Refuse to score a checkpoint that evaluates with ``--eval-capacity-factor`` (its own, or
    one set by ``--model-overrides``) with other batches than its run's evaluation (module doc)."""
    import os

    from ..stream.eval_batching import batch_size_problem

    paths = str(given(cfg, "common_eval", "path") or "")
    batch_size = given(cfg, "dataset", "batch_size")
    max_tokens = given_max_tokens = given(cfg, "dataset", "max_tokens")
    if command == "eval_lm":
        max_tokens = max_tokens or EVAL_LM_MAX_TOKENS
    block = (tokens or 0) + int(given(cfg, "eval_lm", "context_window") or 0) if command == "eval_lm" \
        else tokens or 0
    # sequences per batch: fairseq fills a batch up to --batch-size blocks and --max-tokens tokens
    limits = [int(batch_size)] if batch_size else []
    if max_tokens and block:
        limits.append(max(int(max_tokens) // block, 1))
    if not limits:
        return  # fairseq refuses a command without either
    sequences = min(limits)
    if batch_size and sequences == int(batch_size):
        given_as = f"--batch-size {batch_size}"
    elif given_max_tokens:
        given_as = f"--max-tokens {max_tokens} ({sequences} blocks of {block} tokens a batch)"
    else:
        given_as = (f"no --batch-size (fairseq-eval-lm then fills batches to {max_tokens} tokens: "
                    f"{sequences} blocks of {block})")
    override = ast.literal_eval(str(overrides)) if overrides is not None else {}
    for path in filter(None, paths.split(os.pathsep)):
        config = _trained_config(path)
        if config is None:
            continue  # fairseq's own loader says what is wrong with the file
        if "eval_capacity_factor" in override:
            model = dict(config.get("model") or {}, eval_capacity_factor=override["eval_capacity_factor"])
            config = {**config, "model": model}
        problem = batch_size_problem(config, sequences, path, given_as=given_as, own_by_default=False)
        if problem is not None:
            raise UsageError(problem)


def _trained_config(path: str) -> dict | None:
    """The fairseq config a checkpoint was trained with (None: no file, or one this cannot read).

    Only the pickle is read (memory-mapped, tensors untouched, nothing but plain values
    unpickled); the CRC check and the one-line errors come with fairseq's own load right after
    (``patches.install_checkpoint_errors``)."""
    import os

    import torch

    from ..checkpoint_load import trusted

    if not os.path.isfile(path):
        return None
    try:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=not trusted())
    except Exception:  # noqa: BLE001 - the loader that follows reports it in one line
        return None
    config = state.get("cfg") if isinstance(state, dict) else None
    return config if isinstance(config, dict) else None


def _check_eval_lm_flags(cfg: Any, tokens: int | None) -> None:
    import os

    data = str(given(cfg, "task", "data") or "")
    first = data.split(os.pathsep)[0]
    if first and not os.path.isfile(os.path.join(first, "dict.txt")):  # fairseq: a FileNotFoundError
        raise UsageError(f"{os.path.join(first, 'dict.txt')}: missing, so {first} is no data-bin; pass "
                         f"the stream the checkpoint was trained on (alma-data-prep --out; a vision "
                         f"run's numbers are its stream.jsonl: alma-score --from-log)")
    processes = _processes(cfg)
    if processes > 1:
        raise UsageError(f"fairseq-eval-lm on {processes} processes scores each its share of the split "
                         f"and prints rank 0's perplexity as the split's (it never combines the ranks); "
                         f"score on one process (--distributed-world-size 1), or on several with "
                         f"alma-score (torchrun)")
    softmax_batch = given(cfg, "eval_lm", "softmax_batch")
    if softmax_batch is not None and softmax_batch < 0:  # SequenceScorer: an AssertionError
        raise UsageError(f"--softmax-batch must be >= 0 (got {softmax_batch}): the positions whose "
                         "softmax is taken at once, 0 for all of them")
    window = int(given(cfg, "eval_lm", "context_window") or 0)
    if window < 0:
        raise UsageError(f"--context-window must be >= 0 (got {window}): the tokens of context "
                         "each block is given before its scored tokens")
    if tokens is not None and window >= tokens:
        raise UsageError(f"--context-window {window} leaves no token to score in blocks of "
                         f"--tokens-per-sample {tokens}: pass a window below {tokens}")
    post_process = given(cfg, "common_eval", "post_process")
    if post_process is not None and post_process not in POST_PROCESS_MERGED:
        raise UsageError(f"--post-process {post_process}: fairseq-eval-lm merges sub-words into "
                         "words only for subword_nmt ('@@ '); drop it to score per token")


def _processes(cfg: Any) -> int:
    """How many processes fairseq's ``call_main`` will run the command on: the flag (whose
    default is every GPU of the node), a launcher's ``WORLD_SIZE``, or Slurm's tasks when
    ``--distributed-port`` asks fairseq to read them."""
    import os

    world = int(given(cfg, "distributed_training", "distributed_world_size") or 1)
    launched = int(os.environ.get("WORLD_SIZE", "1") or 1)
    slurm = int(os.environ.get("SLURM_NTASKS", "1") or 1) \
        if int(given(cfg, "distributed_training", "distributed_port") or -1) > 0 else 1
    return max(world, launched, slurm)
