"""The run directory of one stream (fairseq's ``--save-dir``): what is in it and who may write it.

Why one object: a run directory is shared by several processes over days.  The training
processes of one run (one writer, rank 0, and its data-parallel followers), requeued
continuations of that run, and readers (``alma-score``, ``fairseq-eval-lm``, a user's ``ls``)
all look at it, possibly while it is being written.  Every write of the package goes through
here, is atomic (``atomic.py``) and happens only in the writer; a reader that tries to write
is a bug and raises at once, so scoring a stream that is still training can never delete or
change the writer's files.

Layout (DESIGN.md "Contracts"):
  run.json                     what the run is: the fingerprint of every setting that changes
                               its results; another run in the same directory is refused
  run.lock, run.lock.json      the writer's lock and its holder record (``lock.py``)
  stream.jsonl                 one record per arrival (``records.py``)
  growth.jsonl                 one line per growth step (LM gMoE)
  checkpoint_stage{s}.pt       the model at the end of stage s (scoring, gEns members)
  checkpoint_last.pt           where the run resumes (written by the learner's trainer)
"""

from __future__ import annotations

import enum
import glob
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import RunDirError
from .atomic import atomic_write_json, atomic_write_stream, atomic_write_text
from .fingerprint_forms import comparable_form
from .lock import HOLDER_FILE, LOCK_FILE, RunLock
from .records import ArrivalRecord, read_records, write_records
from .upgrade import note_run_without_fingerprint

logger = logging.getLogger(__name__)

RUN_FILE = "run.json"
STREAM_LOG = "stream.jsonl"
GROWTH_LOG = "growth.jsonl"
DATA_VERIFIED = "data_verified.json"  # the training process hashed the data once for this run
SLURM_EVENTS = "slurm_events.jsonl"  # written by slurm/sweep.sbatch.in (alma-sweep status)
# What a run writes when it claims its directory, before any record, checkpoint or log of
# training (and what its Slurm batch script logs): a command refused after that point leaves
# only these, and the lock file.
BOOKKEEPING_FILES = frozenset({RUN_FILE, DATA_VERIFIED, SLURM_EVENTS})
LAST_CHECKPOINT = "checkpoint_last.pt"
STAGE_CHECKPOINT = "checkpoint_stage{stage}.pt"
# Temporaries of interrupted writes: fairseq's own ``<name>.tmp`` and ``atomic.py``'s
# ``.<name>.<random>.tmp``.  Never a complete file: the rename is what completes a write.
_TEMPORARY_PATTERNS = ("*.pt.tmp", "*.pt.tmp[0-9]*", ".*.tmp")


class Role(enum.Enum):
    """What a process may do to the directory."""

    WRITER = "writer"  # rank 0 of a training run: the only process that writes
    FOLLOWER = "follower"  # another rank of the same run: computes the same things, writes nothing
    READER = "reader"  # scoring, inspection: must never write


class RunDirectory:
    """One stream's ``--save-dir``; see the module doc for the layout and the write rules."""

    def __init__(self, path: str | os.PathLike, role: Role) -> None:
        self.path = Path(path)
        self.role = role
        self.lock: RunLock | None = None

    @classmethod
    def for_training(cls, path: str | os.PathLike, rank: int = 0) -> RunDirectory:
        """Rank 0 takes the directory's lock (``lock.py``; a second writer is stopped with one
        line naming the holder) and clears temporaries of killed writes; other ranks follow."""
        run_dir = cls(path, Role.WRITER if rank == 0 else Role.FOLLOWER)
        if run_dir.writes:
            run_dir.lock = RunLock(run_dir.path).acquire()
            run_dir.remove_stale_temporaries()
        return run_dir

    @classmethod
    def for_reading(cls, path: str | os.PathLike) -> RunDirectory:
        return cls(path, Role.READER)

    def close(self) -> None:
        """Give the directory back (the writer's lock); also done at process exit."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def __enter__(self) -> RunDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- where things are ------------------------------------------------------------
    @property
    def writes(self) -> bool:
        return self.role is Role.WRITER

    @property
    def stream_log(self) -> Path:
        return self.path / STREAM_LOG

    @property
    def growth_log(self) -> Path:
        return self.path / GROWTH_LOG

    @property
    def last_checkpoint(self) -> Path:
        return self.path / LAST_CHECKPOINT

    def stage_checkpoint(self, stage: int) -> Path:
        return self.path / STAGE_CHECKPOINT.format(stage=stage)

    def stage_checkpoints(self) -> dict[int, Path]:
        """Stage number -> ``checkpoint_stage{s}.pt`` for every stage checkpoint present."""
        found = {}
        for path in self.path.glob("checkpoint_stage*.pt"):
            number = path.name[len("checkpoint_stage") : -len(".pt")]
            if number.isdigit():
                found[int(number)] = path
        return dict(sorted(found.items()))

    # ---- which run this is -----------------------------------------------------------------
    def read_fingerprint(self) -> dict[str, Any] | None:
        """The fingerprint in ``run.json`` (None: a new directory, or one from before 0.2)."""
        try:
            fingerprint = json.loads((self.path / RUN_FILE).read_text("utf-8"))["fingerprint"]
            _check_fingerprint_shape(fingerprint)
            return fingerprint
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise RunDirError(f"{self.path / RUN_FILE}: unreadable ({err}); restore it, or start "
                              f"again with --restart-stream (the old run is moved aside)") from None

    def check_fingerprint(self, fingerprint: dict[str, Any], restart: bool = False) -> None:
        """Refuse to continue another run here (every rank checks; nothing is written).

        The message names the settings that differ and the two ways out.  A run may continue
        under other ``EXECUTION_SETTINGS`` (``same_run``)."""
        old = self.read_fingerprint()
        if old is None or same_run(old, fingerprint) or restart or self.never_trained():
            return
        # as same_run compares them: a setting spelled another way is no difference
        changed = fingerprint_differences(comparable_form(old), comparable_form(fingerprint))
        shown = "; ".join(changed[:4]) + (f"; and {len(changed) - 4} more" if len(changed) > 4 else "")
        if _stream_kind(old) != _stream_kind(fingerprint):
            shown = f"a {_stream_kind(old)} stream's; this command trains a {_stream_kind(fingerprint)} stream"
        elif all(line.split(":", 1)[0] in PROCESS_LAYOUT for line in changed):
            # this run, preempted and requeued on another layout: both ways out below give up
            # its progress, and the one that keeps it was not named
            raise RunDirError(f"{self.path} holds this run, started on another process layout "
                              f"({shown}); a run keeps the processes it started on: run the same "
                              f"command on that layout to continue it, or use another --save-dir")
        raise RunDirError(f"{self.path} holds another run ({shown}); use another --save-dir, or add "
                          f"--restart-stream to move the old run aside (nothing is deleted)")

    def claim(self, fingerprint: dict[str, Any], restart: bool = False) -> Path | None:
        """Make this directory the run ``fingerprint`` describes (writer only; after
        ``check_fingerprint``).  With ``restart`` an existing run is moved into
        ``replaced-<time>/`` first; returns where it went."""
        if not self._may_write(RUN_FILE):
            return None
        old = self.read_fingerprint()
        moved = None
        if restart and self.run_files():
            moved = self.move_aside()
        elif old is None and self.run_files():
            note_run_without_fingerprint(self.path)

        if old != fingerprint or moved is not None:
            atomic_write_json(self.path / RUN_FILE, {"fingerprint": fingerprint,
                                                     "hash": fingerprint_hash(fingerprint)})
        return moved

    def never_trained(self) -> bool:
        """Whether the run here left nothing but its bookkeeping (``BOOKKEEPING_FILES``): no
        record, checkpoint or log. Another run may then take the directory: there is nothing
        to protect, and refusing would stop the corrected command of a refused one."""
        return all(path.name in BOOKKEEPING_FILES for path in self.run_files())

    def run_files(self) -> list[Path]:
        """What a run leaves here (everything but the lock and earlier replaced runs)."""
        keep = {LOCK_FILE, HOLDER_FILE}
        return sorted(p for p in self.path.iterdir()
                      if p.name not in keep and not p.name.startswith("replaced-"))

    def move_aside(self) -> Path:
        """Move this directory's run into ``replaced-<time>/`` (never delete a result)."""
        target = self.path / time.strftime("replaced-%Y%m%d-%H%M%S")
        suffix = 1
        while target.exists():
            target = self.path / (time.strftime("replaced-%Y%m%d-%H%M%S") + f"-{suffix}")
            suffix += 1
        target.mkdir()
        for item in self.run_files():
            if item != target:
                shutil.move(str(item), str(target / item.name))
        logger.warning("--restart-stream: the previous run in %s was moved to %s", self.path, target)
        return target

    # ---- writing (the writer only) ------------------------------------------------------
    def _may_write(self, what: str) -> bool:
        if self.role is Role.READER:
            raise RuntimeError(f"{self.path}: a reading process tried to write {what}")
        return self.writes

    def write_records(self, records: Iterable[ArrivalRecord]) -> None:
        """Rewrite ``stream.jsonl`` with exactly ``records`` (ordered by arrival)."""
        if self._may_write(STREAM_LOG):
            write_records(self.stream_log, records)

    def write_growth(self, entries: Iterable[dict[str, Any]]) -> None:
        """Rewrite ``growth.jsonl`` with exactly ``entries`` (one per growth step)."""
        if self._may_write(GROWTH_LOG):
            lines = [json.dumps(entry) + "\n" for entry in entries]
            atomic_write_text(self.growth_log, "".join(lines))

    def write_file(self, name: str, write: Callable[[BinaryIO], None]) -> Path | None:
        """Write ``name`` in the directory atomically with ``write(handle)`` (e.g. torch.save)."""
        if not self._may_write(name):
            return None
        target = self.path / name
        atomic_write_stream(target, write)
        return target

    def remove_stale_temporaries(self) -> list[str]:
        """Delete temporaries of writes a crash interrupted (never a complete file)."""
        if not self._may_write("(temporary cleanup)"):
            return []
        stale = sorted({p for pattern in _TEMPORARY_PATTERNS
                        for p in glob.glob(str(self.path / pattern))})
        for path in stale:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
        return stale

    # ---- reading ---------------------------------------------------------------------
    def read_records(self) -> list[ArrivalRecord]:
        """The records of ``stream.jsonl``; ``RunDirError`` names the file and line if bad."""
        return read_records(self.stream_log)

    def read_growth(self) -> list[dict[str, Any]]:
        if not self.growth_log.is_file():
            return []
        try:
            return [json.loads(line) for line in self.growth_log.read_text("utf-8").splitlines()
                    if line.strip()]
        except (OSError, ValueError) as err:
            raise RunDirError(f"{self.growth_log}: unreadable ({err}); re-run the same training "
                              f"command to rewrite it") from None


def fingerprint_hash(fingerprint: dict[str, Any]) -> str:
    """A short stable hash of a fingerprint (stored in checkpoints to tie them to their run)."""
    text = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


# Model settings that choose how a run computes, not what: the expert kernel (another device's,
# or compiled) and activation checkpointing (less memory).  A run started under one may continue
# under another, as it may on another device; the results agree to floating-point rounding.
EXECUTION_SETTINGS = ("moe_expert_kernel", "checkpoint_activations")


# Where a run's processes stand: an expert-parallel run's optimizer state is gathered and cut
# by its layout, and a data-parallel run's batches are dealt by it, so a run keeps its layout
PROCESS_LAYOUT = ("config.distributed_training.distributed_world_size",
                  "config.model.moe_expert_parallel_size")


def without_execution_settings(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """``fingerprint`` (``{"config": {"model": ...}, ...}``) without ``EXECUTION_SETTINGS``."""
    config = fingerprint.get("config")
    model = config.get("model") if isinstance(config, dict) else None
    if not isinstance(model, dict):
        return fingerprint
    model = {key: value for key, value in model.items() if key not in EXECUTION_SETTINGS}
    return {**fingerprint, "config": {**config, "model": model}}


def _stream_kind(fingerprint: dict[str, Any]) -> str:
    """A vision run's fingerprint holds its learner ``settings``; a language model's its fairseq
    ``config``."""
    return "vision" if "settings" in fingerprint else "language-model"


def same_run(old: dict[str, Any], new: dict[str, Any]) -> bool:
    """``new`` continues the run ``old`` describes: equal but for ``EXECUTION_SETTINGS`` and,
    for a vision run, the learner settings its method does not read (a ``run.json`` written
    before they were left out holds them: ``fingerprint_forms.comparable_form``)."""
    def comparable(fingerprint: dict[str, Any]) -> Any:
        return comparable_form(without_execution_settings(fingerprint))

    return old == new or comparable(old) == comparable(new)


def fingerprint_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """``key: old -> new`` for every leaf that differs (nested dicts flattened with dots).

    A whole section on one side only (a vision run's ``settings`` against a language model's
    ``config``) is shown by its size, not its contents: it would fill the one-line error."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(set(old) | set(new), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            out += fingerprint_differences(old.get(key, "(unset)"), new.get(key, "(unset)"), name)
        return out
    return [] if old == new else [f"{prefix}: {_leaf(old)} -> {_leaf(new)}"]


def _leaf(value: Any) -> str:
    return f"({len(value)} settings)" if isinstance(value, dict) else repr(value)


def damaged_record(path: str | os.PathLike) -> str | None:
    """The first record of a (zip-format) torch checkpoint whose CRC does not match, else None.

    torch does not check the CRCs its zip format stores, so a flipped byte inside a tensor would
    load silently as a wrong weight.  Reading the file once for the check costs about what
    loading it costs.  A file that is not a zip archive (truncated, or torch's legacy format)
    is left to the loader, which fails on it.
    """
    import zipfile

    if not zipfile.is_zipfile(path):
        return None
    try:
        with zipfile.ZipFile(path) as archive:
            return archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        return f"({err})"


def discard_unstarted(path: str | os.PathLike) -> None:
    """Remove the run directory ``path`` if it holds no more than a run that never trained
    leaves (``BOOKKEEPING_FILES`` and the lock file, whose lock nobody holds): what a command
    refused after it made the directory leaves behind. Anything else, it is left as it is."""
    from .lock import try_flock

    path = Path(path)
    try:
        names = {entry.name for entry in path.iterdir()}
    except OSError:
        return
    if not names <= BOOKKEEPING_FILES | {LOCK_FILE}:
        return
    held = try_flock(path / LOCK_FILE) if LOCK_FILE in names else None
    if LOCK_FILE in names and held is None:
        return  # another process holds the lock: its run
    try:
        for name in names:
            (path / name).unlink(missing_ok=True)
        path.rmdir()
    except OSError:
        pass
    finally:
        if held is not None:
            os.close(held[0])


# the config sections the readers of a fingerprint look into (report names, FLOPs and record checks)
READ_SECTIONS = ("task", "model", "criterion", "optimizer", "lr_scheduler")


def _check_fingerprint_shape(fingerprint: Any) -> None:
    """A fingerprint is a mapping, and its ``config`` (an LM run's) a mapping whose sections
    are mappings: a hand-edited ``run.json`` that breaks this was an AttributeError traceback in
    every reader; it is the same one-line "unreadable" error as a file that is not JSON."""
    if not isinstance(fingerprint, dict):
        raise TypeError(f"its fingerprint is a {type(fingerprint).__name__}, not a mapping")
    config = fingerprint.get("config", {})
    if not isinstance(config, dict):
        raise TypeError(f"its fingerprint's config is a {type(config).__name__}, not a mapping")
    for section in READ_SECTIONS:  # a run trains a task and a model: those are never null
        allowed = dict if section in ("task", "model") else (dict, type(None))
        if not isinstance(config.get(section, {}), allowed):
            raise TypeError(f"its config.{section} is {json.dumps(config[section])[:40]}, not a mapping")
