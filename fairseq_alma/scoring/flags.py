"""alma-score's options, as (flag, argparse keywords) pairs: one table for two commands.

Why a table and not a parser: ``alma-score`` adds them to its parser, and ``alma-sweep score``
passes the same options on to each of its tasks (refusing those it sets itself), so the two never
disagree on a flag's name, type or help.  Each flag's destination is a ``ScoreRequest`` field,
except the outputs (--json, --csv, --plot), which the command writes.
"""

from __future__ import annotations

from typing import Any

from .request import MODES

SCORE_FLAGS: list[tuple[str, dict[str, Any]]] = [
    ("--mode", {"choices": MODES, "default": "single",
                "help": "single: a series per run; ens: the runs are one ensemble's members; gens: "
                        "one --stage-init scratch run whose stage checkpoints are the members"}),
    ("--data", {"help": "stream directory to score on (default: each run's cfg.task.data)"}),
    ("--subset", {"help": "split to score (default: the run's --eval-subset, 'eval')"}),
    ("--from-log", {"action": "store_true",
                    "help": "single mode: reuse stream.jsonl's eval_ppl instead of evaluating "
                            "(fast; also renders vision runs' test_error)"}),
    ("--batch-size", {"type": int, "help": "sequences per evaluation batch (default: the run's "
                      "own evaluation batching: --batch-size-valid, --batch-size, else 8)"}),
    ("--tokens-per-sample", {"type": int, "help": "block length scored, as given to "
                             "fairseq-eval-lm (default: the run's)"}),
    ("--max-eval-tokens", {"type": int, "metavar": "N",
                           "help": "score a fixed slice of the split: its first blocks in index "
                                   "order (the order of its text), as many whole blocks as hold "
                                   "at most N tokens together; the same blocks for every "
                                   "checkpoint and member; N at least the split's size scores "
                                   "all of it. Recorded in --json (eval_tokens, "
                                   "eval_tokens_total, max_eval_tokens) and under the table "
                                   "(default: the whole split)"}),
    ("--fp16", {"action": "store_true",
                "help": "score in half precision on CUDA (weights in fp16; log-probabilities "
                        "in fp32, sums in fp64); refused on CPU"}),
    ("--matrix", {"action": "store_true",
                  "help": "--mode single: also score every stage checkpoint on every period's "
                          "held-out slice (splits evalmb0..evalmb{B-1} of a stream prepared with "
                          "alma-data-prep --eval-per-megabatch SIZE): the stage x period matrix "
                          "and its in-period, backward (forgetting) and forward summaries, "
                          "printed and under each series' eval_matrix in --json"}),
    ("--setting", {"help": "series name in the table (default from the run's flags, e.g. "
                           "'SM_w1', 'Ens_w4 (4x steps)', 'gEns_w1')"}),
    ("--json", {"metavar": "FILE", "help": "write every number per arrival as JSON"}),
    ("--csv", {"metavar": "FILE", "help": "write the table as CSV (full precision)"}),
    ("--plot", {"metavar": "FILE.png",
                "help": "Fig. 5: average perplexity vs cumulative compute and vs parameters "
                        "(.png, .pdf or .svg: the format follows the extension)"}),
    ("--cpu", {"action": "store_true", "help": "score on CPU even if CUDA is available"}),
    ("--trust-checkpoint", {"action": "store_true",
                            "help": "unpickle checkpoints fully (a pickle can run code when it is "
                                    "loaded): only for files from a source you trust; by default "
                                    "only tensors and plain values are read, and a checkpoint "
                                    "holding anything else is refused naming the type"}),
    ("--distributed-backend", {"choices": ("gloo", "nccl"),
                               "help": "under torchrun/srun with several processes: how they add "
                                       "their sums (default: nccl on CUDA, gloo on CPU)"}),
]
