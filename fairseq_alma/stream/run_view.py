"""Reading a run directory: the one view every reader of a stream's ``--save-dir`` goes through.

Why one view: ``alma-score``, ``alma-report``, ``alma-sweep status|score``, the vision sweep and
demo, and the code that keeps and loads stage checkpoints all ask the same questions of a run
directory: what are its records, is the run finished (every arrival 0..B recorded, every trained
stage's checkpoint there), which file answers which arrival, can a checkpoint be trusted to
load.  Asked in six places with six answers they drifted apart (one reader refused an unfinished
run, another published it as a shorter stream); here they have one answer each, and no other
product file spells a run file's name.

``RunView`` only reads; writing is ``run_dir.RunDirectory``'s (the writer of a training run).
It imports neither fairseq nor torch: a checkpoint is checked here (present, its zip records'
CRCs) and loaded by ``checkpoint_load.load_checkpoint`` with the hint this module gives.
"""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, RunDirError, UsageError
from .records import ArrivalRecord, read_records
from .run_dir import RUN_FILE, SLURM_EVENTS, RunDirectory, damaged_record, fingerprint_hash


class RunView:
    """A run directory as readers see it (module doc); every property reads lazily, once."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._dir = RunDirectory.for_reading(self.path)

    @classmethod
    def open(cls, path: str | os.PathLike, what: str = "RUN_DIR") -> RunView:
        """A view of ``path``, which must be a run directory (``stream.jsonl`` in it); one line
        naming ``what`` the user passed otherwise."""
        view = cls(path)
        if not view.path.is_dir():
            raise UsageError(f"{what} {path}: not a directory; pass an alma_stream --save-dir")
        if not view.stream_log.is_file():
            raise UsageError(f"{view.stream_log}: missing; pass the --save-dir of a fairseq-train "
                             f"--task alma_stream run")
        return view

    # ---- the files --------------------------------------------------------------------
    @property
    def stream_log(self) -> Path:
        return self._dir.stream_log

    @property
    def run_file(self) -> Path:
        return self.path / RUN_FILE

    @property
    def growth_log(self) -> Path:
        return self._dir.growth_log

    @property
    def slurm_events(self) -> Path:
        return self.path / SLURM_EVENTS

    @property
    def last_checkpoint(self) -> Path:
        return self._dir.last_checkpoint

    def stage_checkpoint(self, stage: int) -> Path:
        return self._dir.stage_checkpoint(stage)

    def stage_checkpoints(self) -> dict[int, Path]:
        """Stage -> ``checkpoint_stage{s}.pt`` for every stage checkpoint present."""
        return self._dir.stage_checkpoints()

    def signature_files(self) -> list[Path]:
        """The files whose change means the run changed (what ``alma-sweep score`` signs)."""
        return [self.run_file, self.stream_log, *sorted(self.stage_checkpoints().values())]

    # ---- what the run says --------------------------------------------------------------
    @cached_property
    def records(self) -> list[ArrivalRecord]:
        """The records of ``stream.jsonl``, arrivals 0..n in order (one line otherwise)."""
        try:
            records = read_records(self.stream_log)
        except RunDirError as err:
            raise UsageError(str(err)) from None
        if not records or [r.arrival for r in records] != list(range(len(records))):
            raise UsageError(f"{self.stream_log}: needs arrivals 0..B in order; run the training "
                             f"command of this run again to rewrite it")
        problem = _inconsistent(records)
        if problem is not None:
            raise UsageError(f"{self.stream_log}: {problem}, which training never writes (an edited "
                             f"or mixed file); run the training command of this run again to "
                             f"rewrite it")
        return records

    @cached_property
    def fingerprint(self) -> dict[str, Any] | None:
        """``run.json``'s fingerprint (None: a run of fairseq-alma 0.1)."""
        try:
            return self._dir.read_fingerprint()
        except RunDirError as err:
            raise UsageError(str(err)) from None

    def require_trusted_records(self) -> None:
        """Refuse a run whose records fairseq-alma before 2026-11-28 got wrong.

        * FLOPs: fairseq's ``transformer_lm`` trained with embeddings wider than its blocks
          (``transformer_flops.width_mismatch``) was counted as if the blocks were that wide
          (75x for a 2-layer d 32 model); its perplexities are right, its Comp column is not.
        * Perplexities: under ``--add-bos-token`` fairseq 0.12 makes ``<s>`` the first target
          of every block too (``MonolingualDataset._maybe_add_bos``), a token the model learns
          to predict for free; fairseq-eval-lm leaves it out, the stream's evaluations counted
          it (68.8 instead of 76.9 on a tiny stream).  Training refuses the flag now.
        A table of either is refused rather than printed."""
        from .transformer_flops import width_mismatch

        config = (self.fingerprint or {}).get("config") or {}
        if (config.get("task") or {}).get("add_bos_token"):
            raise UsageError(f"{self.path}: trained with --add-bos-token, so every block's first "
                             f"target is a free <s>, which its stream.jsonl and alma-score would "
                             f"count and fairseq-eval-lm leaves out; train it again without "
                             f"--add-bos-token")
        model = config.get("model") or {}
        mismatch = width_mismatch(model)
        if mismatch is not None:
            width = model.get("decoder_embed_dim")
            raise UsageError(f"{self.path}: its stream.jsonl counts FLOPs wrongly: {mismatch}, and "
                             f"fairseq-alma before 2026-11-28 counted its blocks at the wider width; "
                             f"train it again with --decoder-input-dim {width} --decoder-output-dim {width}")

    @cached_property
    def growth(self) -> list[dict[str, Any]]:
        try:
            return self._dir.read_growth()
        except RunDirError as err:
            raise UsageError(str(err)) from None

    @property
    def metric(self) -> str:
        """"ppl" for a language-model stream, "error" for a vision stream."""
        return "ppl" if self.records[0].eval_ppl is not None else "error"

    @property
    def trained_stages(self) -> list[int]:
        return sorted(r.stage for r in self.records if r.trained)

    @property
    def waits(self) -> bool:
        """Arrivals 1.. come before the first training: the initialised model answers them."""
        return any(r.stage == 0 and r.arrival >= 1 for r in self.records)

    @property
    def num_megabatches(self) -> int | None:
        """B of the stream this run trains on, from its fingerprint (LM: the data's manifest;
        vision: its ``--num-megabatches``); None for a run without ``run.json``."""
        return fingerprint_megabatches(self.fingerprint)

    def unfinished_reason(self, num_megabatches: int | None = None) -> str | None:
        """Why this run is not finished (arrivals 0..B of its stream's B, ``num_megabatches``
        if given, else its fingerprint's), or None when it is; a run whose B cannot be known is
        taken as it is."""
        b = num_megabatches if num_megabatches is not None else self.num_megabatches
        arrivals = len(self.records) - 1
        if b is None or arrivals == b:
            return None
        if arrivals > b:
            return (f"{self.stream_log}: arrivals 0..{arrivals} but its stream has B = {b}; "
                    f"score it on the data it was trained on")
        missing = f"arrival {b}" if arrivals + 1 == b else f"arrivals {arrivals + 1}..{b}"
        return (f"{self.stream_log}: training not finished: arrivals 0..{arrivals} of B = {b} "
                f"({missing} missing); run the same training command again to finish it")

    def require_finished(self, num_megabatches: int | None = None) -> None:
        """One line (``UsageError``) unless the run recorded every arrival of its stream."""
        reason = self.unfinished_reason(num_megabatches)
        if reason is not None:
            raise UsageError(reason)

    def finished_records(self, num_megabatches: int) -> list[ArrivalRecord] | None:
        """The records when the run recorded all B + 1 arrivals of a stream of
        ``num_megabatches`` mega-batches, else None (no file, unreadable, or not finished: a
        driver then runs or continues it)."""
        if not self.stream_log.is_file():
            return None
        try:
            records = self.records
        except UsageError:
            return None
        return records if len(records) == num_megabatches + 1 else None

    def trained_checkpoints(self) -> dict[int, Path]:
        """Stage -> checkpoint of every trained stage; one line naming the first one missing."""
        found = {}
        for record in self.records:
            if record.trained:
                path = self.stage_checkpoint(record.stage)
                if not path.is_file():
                    # training cannot make it again once later stages trained from it (the
                    # same command finds the run finished): what is left is a copy or a retrain
                    raise UsageError(f"{path}: missing (stage {record.stage}, trained at arrival "
                                     f"{record.arrival}); {recovery_hint(path)}")
                found[record.stage] = path
        return found

    def initial_checkpoint(self) -> Path | None:
        """``checkpoint_stage0.pt`` (the initialised model, kept when it answers arrivals)."""
        path = self.stage_checkpoint(0)
        return path if path.is_file() else None

    def run_hash(self) -> str | None:
        """The hash stage checkpoints carry of the run they belong to (None without run.json)."""
        return fingerprint_hash(self.fingerprint) if self.fingerprint is not None else None


def checked_checkpoint(path: str | os.PathLike) -> Path:
    """``path`` after checking it is there and every record of its zip archive passes its CRC
    (torch does not check them: a flipped byte would load as a wrong weight).  One line naming
    the file and the way back otherwise."""
    path = Path(path)
    if path.is_dir():
        raise CheckpointError(f"{path}: a directory, not a checkpoint file; give a checkpoint in it "
                              f"(e.g. {path / 'checkpoint_last.pt'})")
    foreign = _not_torch_format(path)
    if foreign is not None:
        way = recovery_hint(path) if path.name.startswith("checkpoint") else \
            "give a checkpoint file (checkpoint_last.pt, checkpoint_stage<s>.pt)"
        raise CheckpointError(f"{path}: not a torch checkpoint ({foreign}); {way}")
    bad = damaged_record(path)
    if bad is not None:
        raise CheckpointError(f"{path}: damaged (record {bad} fails its CRC check); "
                              f"{recovery_hint(path)}")
    return path


# How a torch checkpoint begins: its zip archive (torch >= 1.6) or a legacy pickle's protocol byte.
TORCH_FILE_STARTS = (b"PK\x03\x04", b"\x80")


def _not_torch_format(path: Path) -> str | None:
    """What ``path`` is when it is neither of torch's formats (a JSON or text file given by
    mistake, which torch's weights-only loader would report as a forbidden type); None for a
    torch file, or an empty or unreadable one, which the loader reports."""
    try:
        with open(path, "rb") as handle:
            start = handle.read(64)
    except OSError:
        return None
    if not start or start.startswith(TORCH_FILE_STARTS):
        return None
    if not all(byte in (9, 10, 13) or byte >= 32 for byte in start):
        return f"it begins with bytes {start[:4].hex()}"
    return "a JSON file" if start.lstrip()[:1] in (b"{", b"[") else "a text file"


def _inconsistent(records: list[ArrivalRecord]) -> str | None:
    """What in a stream log no training writes, or None.  Why: each number of a table is read
    off one record by its stage (which checkpoint answers the arrival) and its cumulative
    FLOPs; an arrival 3 saying stage 2 in a --wait 1 run scored stage 2's model in t2's column,
    and FLOPs that fall ended alma-score in a traceback.  Stages count the trainings so far
    (0 before the first), whatever the waiting policy; compute only grows."""
    stage, flops = 0, 0.0
    for record in records:
        stage += bool(record.trained)
        if record.stage != stage:
            return (f"arrival {record.arrival} says stage {record.stage}, but the trained arrivals "
                    f"up to it make it stage {stage}")
        if record.train_flops_cum < flops:
            return (f"arrival {record.arrival}'s train_flops_cum {record.train_flops_cum:g} is below "
                    f"the one before it ({flops:g}); it is cumulative")
        flops = record.train_flops_cum
    return None


def recovery_hint(path: str | os.PathLike) -> str:
    """What to do about an unreadable checkpoint, given what else the run directory holds."""
    name, directory = os.path.basename(path), os.path.dirname(os.path.abspath(path))
    if name.startswith("checkpoint_stage"):
        return ("restore it from a copy, or train the stream again with --restart-stream (the old "
                "files are moved aside)")
    newer = sorted((p for p in os.listdir(directory) if p.startswith("checkpoint_") and
                    p.count("_") == 2 and p.endswith(".pt")),
                   key=lambda p: os.path.getmtime(os.path.join(directory, p)), reverse=True)
    start_over = ("move it aside and run the same command to train the stream again from its "
                  "start (stage checkpoints hold no optimizer state to resume from), or use "
                  "--restart-stream")
    if newer:
        return (f"copy {newer[0]} (the newest interval checkpoint) over it and run the same "
                f"command, or {start_over}")
    return start_over


def fingerprint_megabatches(fingerprint: Any) -> int | None:
    """B of the stream a run with this ``run.json`` fingerprint trains on (an LM: its data's
    manifest; vision: its ``--num-megabatches``); None when the fingerprint does not say."""
    fingerprint = fingerprint if isinstance(fingerprint, dict) else {}
    data = fingerprint.get("data")
    if isinstance(data, dict) and data.get("num_megabatches") is not None:
        return int(data["num_megabatches"])
    settings = fingerprint.get("settings")
    if isinstance(settings, dict) and settings.get("--num-megabatches") is not None:
        return int(settings["--num-megabatches"])
    return None
