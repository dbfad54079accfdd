#!/usr/bin/env python3
"""A stand-in for fairseq-train that keeps the launcher's contract with the trainer, nothing else.

Use it to check a cluster profile, the requeue path and stage chaining in seconds, before spending
GPU hours (the tests use it the same way)::

    alma-sweep submit CONFIG --sweep-dir DIR \\
        --program "python slurm/contract_trainer.py --stage-seconds 2"

It accepts fairseq-train's command line (unknown flags are ignored) and, like the real trainer:
  * trains ``--max-epoch`` stages (default 3; one stage = one arrival here), appending one JSON
    record per arrival to ``SAVE_DIR/stream.jsonl`` (fields as in DESIGN.md, ``eval_ppl`` =
    60 / arrival + seed, so tests can compute the best value by hand);
  * saves its position after every stage (``SAVE_DIR/checkpoint_last.json``) and resumes from it
    when started again, dropping stream records written after that checkpoint;
  * on SIGUSR1 (or SIGTERM) saves and exits at once (exit 0 / 143);
  * with ``ALMA_STOP_AFTER_STAGE=t`` stops after finishing stage t (exit 0);
  * only rank 0 writes; other ranks just keep time (``--distributed-rank``).
Every start is recorded in the checkpoint (``starts``) with its Slurm restart count, the stage it
resumed from and the distributed flags it was given, so tests can see what happened.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import ModuleType

_signalled: list[int] = []


def _on_signal(signum: int, _frame: object) -> None:
    _signalled.append(signum)


def _atomic() -> ModuleType:
    """fairseq_alma's one atomic-write module, imported on first use: importing fairseq_alma
    imports fairseq and torch (seconds), and until ``main`` has installed its handlers a USR1
    would kill this process instead of asking it to save. A Python without the package
    installed gets the one of this checkout."""
    try:
        from fairseq_alma.stream import atomic
    except ModuleNotFoundError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from fairseq_alma.stream import atomic
    return atomic


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("data", help="fairseq-train's DATA (only recorded)")
    parser.add_argument("--save-dir", required=True, help="run directory (checkpoint, stream)")
    parser.add_argument("--seed", type=int, default=1, help="shifts eval_ppl by the seed")
    parser.add_argument("--max-epoch", type=int, default=3, help="number of stages")
    parser.add_argument("--stage-seconds", type=float, default=0.5, help="time per stage")
    parser.add_argument("--fail-at-stage", type=int, default=0, help="exit 3 when starting it")
    parser.add_argument("--distributed-world-size", type=int, default=1, help="from launcher")
    parser.add_argument("--distributed-rank", type=int, default=0, help="from launcher")
    parser.add_argument("--distributed-init-method", default=None, help="from launcher")
    parser.add_argument("--cpu", action="store_true", help="from launcher (CPU profiles)")
    args, _ = parser.parse_known_args(argv)
    return args


def _resume(save_dir: Path) -> dict:
    """Load the checkpoint and drop stream records past it (no arrival lost or duplicated)."""
    checkpoint = save_dir / "checkpoint_last.json"
    state = json.loads(checkpoint.read_text()) if checkpoint.exists() else {"stage": 0}
    stream = save_dir / "stream.jsonl"
    if stream.exists():
        kept = stream.read_text().splitlines(keepends=True)[: state["stage"]]
        _atomic().atomic_write_text(stream, "".join(kept))
    return state


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGUSR1, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    save_dir = Path(args.save_dir)
    writer = args.distributed_rank == 0
    stop_after = int(os.environ.get("ALMA_STOP_AFTER_STAGE") or 0)
    save_dir.mkdir(parents=True, exist_ok=True)
    checkpoint = save_dir / "checkpoint_last.json"
    if writer:
        state = _resume(save_dir)
    else:  # other ranks read the same checkpoint, so every rank resumes at the same stage
        state = json.loads(checkpoint.read_text()) if checkpoint.exists() else {"stage": 0}
    if writer:
        state.setdefault("starts", []).append(
            {
                "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
                "job_id": os.environ.get("SLURM_JOB_ID"),
                "resumed_from_stage": state["stage"],
                "stop_after_stage": stop_after or None,
                "world_size": args.distributed_world_size,
                "init_method": args.distributed_init_method,
                "cpu": args.cpu,
                "argv": sys.argv[1:] if argv is None else argv,
            }
        )
        _atomic().atomic_write_json(checkpoint, state)
    print(f"contract_trainer: rank {args.distributed_rank} starts after stage {state['stage']}")
    stage = state["stage"]
    while stage < args.max_epoch and not (stop_after and stage >= stop_after):
        if args.fail_at_stage == stage + 1:
            print(f"contract_trainer: failing at stage {stage + 1} as asked", file=sys.stderr)
            return 3
        deadline = time.monotonic() + args.stage_seconds
        while time.monotonic() < deadline and not _signalled:
            time.sleep(0.02)
        if _signalled:
            if writer:
                state["saved_on_signal"] = state.get("saved_on_signal", 0) + 1
                _atomic().atomic_write_json(save_dir / "checkpoint_last.json", state)
            print(f"contract_trainer: signal {_signalled[0]}: saved after stage {stage}, exiting")
            return 0 if _signalled[0] == signal.SIGUSR1 else 143
        stage += 1
        if writer:
            record = {
                "arrival": stage,
                "stage": stage,
                "trained": True,
                "megabatches_seen": stage,
                "eval_ppl": 60.0 / stage + args.seed,
                "wall_time": time.time(),
            }
            with open(save_dir / "stream.jsonl", "a") as stream:
                stream.write(json.dumps(record) + "\n")
            state["stage"] = stage
            _atomic().atomic_write_json(checkpoint, state)
    print(f"contract_trainer: rank {args.distributed_rank} stops after stage {stage}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
