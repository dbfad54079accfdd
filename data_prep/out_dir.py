"""``--out DIR`` of ``alma-data-prep``: which directories a run may write into, and its lock.

Why: a run builds its stream in place, reusing every step whose inputs are unchanged, and
removes shards its stream does not have (``remove_stale_megabatches``). That is what a re-run
of the same command on its own output should do -- continue after a kill, or rebuild what a
changed flag changes -- but pointed at a directory that holds another stream, or files that are
no stream at all, it would replace them. So before anything is written:

* ``DIR`` must be a directory or not exist yet (with a directory above it), and not lie inside
  an INPUT directory (a re-run would read its own outputs);
* a ``DIR/manifest.json`` that records other inputs than this command's (another corpus,
  another ``--from-binarized`` data-bin, text where it was binarized or back) is another
  stream: refused unless ``--clean`` says to replace it. The same inputs with other flags are
  the documented re-run: it rebuilds what those flags change;
* a non-empty ``DIR`` with neither a stream's manifest nor the ``.stamps`` every run leaves
  from its start holds someone else's files: refused (even with ``--clean``, which deletes
  ``DIR/work``). A killed run of ours, or one whose manifest was damaged, has its stamps: the
  same command continues or repairs it.

Inputs are compared by real path, as a set: the manifest's ``inputs`` (every INPUT, or the
DATA_BIN); manifests written before it have only the files read, ``sources``, compared with
the files this command would read (the data-bin, for ``--from-binarized``).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator

from fairseq_alma.errors import DataError
from fairseq_alma.out_paths import check_dir_path
from fairseq_alma.stream.atomic import TEMP_SUFFIX
from fairseq_alma.stream.lock import try_flock
from fairseq_alma.stream.manifest import MANIFEST_FORMAT, MANIFEST_NAME

from .corpus import discover_sources
from .fileio import PARTIAL_SUFFIX
from .options import PrepOptions
from .steps import STAMP_DIR

# What a run (or a Slurm submission, DIR/slurm) writes into DIR before its first stamp.
OWN_ENTRIES = {"work", ".lock", STAMP_DIR, "slurm"}


def stream_inputs(options: PrepOptions) -> list[str]:
    """What the stream is made from, as ``manifest.json`` records it: the real path of every
    INPUT, or of the ``--from-binarized`` data-bin."""
    given = [options.from_binarized] if options.from_binarized else options.inputs
    return [os.path.realpath(path) for path in given]


def check_output_dir(options: PrepOptions) -> None:
    """Refuse an ``--out`` this run must not write into (see the module docstring)."""
    out_dir = options.out
    out = os.path.realpath(out_dir)
    check_dir_path(out_dir, "--out", DataError)
    for given in ([options.from_binarized] if options.from_binarized else options.inputs):
        real = os.path.realpath(given)
        if os.path.isdir(real) and os.path.commonpath([real, out]) == real:
            raise DataError(f"--out {out_dir} lies inside input directory {given}; "
                            "a re-run would read its own outputs -- choose another --out")
    if not os.path.isdir(out):
        return
    manifest = _read_manifest(out)
    if manifest is not None:
        other = _other_inputs(manifest, options)
        if other is not None and not options.clean:
            raise DataError(f"--out {out_dir} holds another stream, prepared from {other} (its "
                            f"{MANIFEST_NAME}); choose another --out, or add --clean to replace "
                            "that stream with this one")
    elif not os.path.isdir(os.path.join(out, STAMP_DIR)):  # no run of ours began here
        foreign = sorted(set(os.listdir(out)) - OWN_ENTRIES)
        if foreign:
            more = f" and {len(foreign) - 1} more" if len(foreign) > 1 else ""
            raise DataError(f"--out {out_dir} holds files that are not an alma-data-prep stream "
                            f"({foreign[0]}{more}); choose a new or empty directory for --out")


def _read_manifest(out: str) -> dict | None:
    """The manifest of a stream in ``out``; None where there is none or it cannot be read (a
    run of ours that was killed, or whose manifest was damaged: re-running repairs it)."""
    try:
        with open(os.path.join(out, MANIFEST_NAME), encoding="utf-8") as f:
            manifest = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        return None
    return manifest


def _other_inputs(manifest: dict, options: PrepOptions) -> str | None:
    """The inputs ``manifest`` records, in words, when they are not this command's; None when
    they are (or the manifest does not say)."""
    tokenizer = manifest.get("tokenizer")
    binarized = isinstance(tokenizer, dict) and tokenizer.get("kind") == "from-binarized"
    recorded = manifest.get("inputs")
    if isinstance(recorded, list):
        current = stream_inputs(options)
    elif binarized:  # manifests before "inputs": the data-bin is the tokenizer's source
        recorded = [tokenizer.get("source")]
        current = stream_inputs(options)
    else:  # ... and the text route's are the files it read
        sources = manifest.get("sources")
        recorded = [s.get("path") for s in sources if isinstance(s, dict)] \
            if isinstance(sources, list) else []
        current = [] if options.from_binarized else \
            [source.path for source in discover_sources(options.inputs)]
    recorded = [path for path in recorded if isinstance(path, str)]
    if not recorded:
        return None
    same_route = binarized == bool(options.from_binarized)
    if same_route and {os.path.realpath(p) for p in recorded} == \
            {os.path.realpath(p) for p in current}:
        return None
    what = "--from-binarized " if binarized else ""
    return what + recorded[0] + (f" and {len(recorded) - 1} more" if len(recorded) > 1 else "")


def hold_lock(path: str, busy: str) -> int:
    """An fd holding ``path``'s ``flock`` (``stream.lock.try_flock``; closing it releases);
    ``DataError(busy)`` when another process holds it.  A file system without ``flock`` gets no
    exclusivity here, as before: data preparation is one command, not a requeued job."""
    taken = try_flock(path)
    if taken is None:
        raise DataError(busy)
    return taken[0]


def _lock(out_dir: str) -> int:
    return hold_lock(os.path.join(out_dir, ".lock"), f"--out {out_dir} is in use by another "
                     "alma-data-prep run; wait for it to finish")


@contextlib.contextmanager
def output_dir(options: PrepOptions) -> Iterator[None]:
    """Check, create, lock and tidy ``options.out`` for one run of either route."""
    out_dir = options.out
    check_output_dir(options)
    try:
        os.makedirs(os.path.join(out_dir, "work"), exist_ok=True)
    except OSError as exc:
        raise DataError(f"--out {out_dir}: cannot create it ({exc.strerror or exc}); choose "
                        "a directory you can write to") from None
    lock = _lock(out_dir)
    try:
        leftovers = [glob.glob(os.path.join(where, pattern))
                     for where in (out_dir, os.path.join(out_dir, "work"))
                     for pattern in (f"*{PARTIAL_SUFFIX}*", f".*{TEMP_SUFFIX}")]
        for leftover in (path for paths in leftovers for path in paths):
            os.remove(leftover)  # from a killed run; its step has no stamp and will rerun
        yield
    finally:
        os.close(lock)
