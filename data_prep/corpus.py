"""Input discovery and streaming of documents (the unit that ALMA's splits move around).

A *document* is a block of non-empty lines; one or more blank (or whitespace-only) lines end it.
Inside a line every run of whitespace becomes one space, so a BPE piece never contains
whitespace and fairseq's whitespace tokenizer sees exactly the pieces sentencepiece produced.
Files are read line by line (``.gz`` through ``gzip``), never whole: the corpus behind paper §5
is ~2.2B words. Directories are walked in sorted order (hidden entries skipped) so the same
inputs give the same document order, hence the same seeded split, on every machine.
"""

from __future__ import annotations

import errno
import gzip
import hashlib
import os
import stat
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from fairseq_alma.errors import DataError
from fairseq_alma.stream.atomic import atomic_output

from .progress_lines import Progress
from .repeats import document_digest, later_copies, log_repeats


@dataclass(frozen=True)
class SourceFile:
    path: str  # absolute
    bytes: int
    mtime_ns: int
    # Why ctime too: the extraction is reused while a source's key is unchanged, and a file
    # replaced by another of the same size with its mtime kept (cp -p, rsync -a, touch -r)
    # has the old size and mtime, but no tool can set ctime: any write or replacement moves it.
    ctime_ns: int


def discover_sources(inputs: Iterable[str]) -> list[SourceFile]:
    """Expand files and directories into a de-duplicated list of files, in a stable order.

    Everything a directory holds is either read or refused, never skipped in silence: a
    sub-directory that cannot be listed, a link to nothing, or something that is no regular
    file (a FIFO would block the extraction forever, a device would stream without end) ends
    the run with a ``DataError`` naming it, before anything is written. Hidden entries are the
    one deliberate exception (module docstring)."""
    found: list[SourceFile] = []
    seen: set[str] = set()
    for given in inputs:
        if not os.path.exists(given):
            raise DataError(f"input {given}: no such file or directory")
        if os.path.isdir(given):
            files = _walk_sorted(given)
            if not files:
                raise DataError(f"input {given}: directory has no (non-hidden) files")
        else:
            files = [given]
        for path in files:
            real = os.path.realpath(path)
            if real in seen:  # a file listed twice would put one document in two splits
                continue
            seen.add(real)
            st = _stat_source(path, real, given)
            found.append(SourceFile(os.path.abspath(path), st.st_size, st.st_mtime_ns,
                                    st.st_ctime_ns))
    return found


def _stat_source(path: str, real: str, given: str) -> os.stat_result:
    """``os.stat`` of one file to read; what cannot be read as a text file is refused."""
    where = f"input {path} (in input directory {given})" if path != given else f"input {path}"
    try:
        st = os.stat(real)
    except FileNotFoundError:
        if os.path.islink(path):
            raise DataError(f"{where}: a symbolic link to {os.readlink(path)}, which does not "
                            "exist; fix the link or remove it") from None
        raise DataError(f"{where}: no such file or directory") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DataError(f"{where}: a loop of symbolic links; fix the link or remove it") \
                from None
        raise DataError(f"{where}: cannot read ({exc.strerror or exc})") from None
    if stat.S_ISREG(st.st_mode) and not os.access(real, os.R_OK):  # now, not mid-extraction
        raise DataError(f"{where}: cannot read (Permission denied); make it readable (chmod) "
                        "or leave it out")
    if not stat.S_ISREG(st.st_mode):
        fix = ("move it out of the directory, or list the text files as INPUTs"
               if path != given else "write its text to a file and give that")
        raise DataError(f"{where}: {_file_kind(st.st_mode)}, not a regular file, which is all "
                        f"alma-data-prep reads (plain or .gz text); {fix}")
    return st


def _file_kind(mode: int) -> str:
    for test, kind in ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return kind
    return "a special file"


def _walk_sorted(root: str) -> list[str]:
    """Every non-hidden file under ``root``, directories in sorted order (links followed).
    A directory ``os.walk`` cannot list is refused: by default it would skip it, and a
    corpus with one sub-directory unreadable would be prepared without it, exit 0."""
    def refuse(exc: OSError) -> None:
        where = exc.filename or root
        raise DataError(f"input {root}: cannot read directory {where} "
                        f"({exc.strerror or exc}); make it readable (chmod) or move it out of "
                        f"{root}")

    files = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=refuse, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
        _refuse_link_back_up(root, dirpath, dirnames)
        files.extend(os.path.join(dirpath, f) for f in sorted(filenames) if not f.startswith("."))
    return files


def _refuse_link_back_up(root: str, dirpath: str, dirnames: list[str]) -> None:
    """A linked sub-directory that leads back to a directory above it is refused: followed,
    it nests the same files deeper and deeper until the path is too long to open, and the
    error then names a path of forty repeats as "a special file"."""
    here = os.path.realpath(dirpath)
    for name in dirnames:
        link = os.path.join(dirpath, name)
        target = os.path.realpath(link)
        if here == target or here.startswith(target.rstrip(os.sep) + os.sep):
            raise DataError(f"input {root}: directory {link} is a link back to {target}, "
                            "which holds it (a loop); remove the link or move it out of "
                            f"{root}")


def is_gzip(path: str) -> bool:
    """Whether ``path`` is read through gzip (by its name, as users name such files)."""
    return path.endswith(".gz")


def iter_lines(path: str) -> Iterator[str]:
    """Lines of one UTF-8 file (plain or .gz); bad bytes or a broken .gz name the file.

    A NUL character is refused although it is valid UTF-8: text never holds one, while binary
    files of small integers do and decode without error (a fairseq ``.bin`` shard of token ids
    below 128 is pure ASCII), and would become a stream of control characters that trains.
    """
    lineno = 0
    try:
        opener = gzip.open if is_gzip(path) else open
        with opener(path, "rt", encoding="utf-8-sig") as f:
            for lineno, line in enumerate(f, start=1):
                if "\0" in line:
                    raise DataError(_compressed_input(path) or _binary_input(path, lineno))
                yield line
    except UnicodeDecodeError as exc:
        raise DataError(_compressed_input(path) or _not_utf8(path, exc)) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise DataError(f"input {path}: unreadable .gz file ({exc}); "
                            "re-create it or leave it out") from None
    except OSError as exc:
        raise DataError(f"input {path}: cannot read ({exc.strerror or exc})") from None


def _not_utf8(path: str, exc: UnicodeDecodeError) -> str:
    """The message for bytes that are not UTF-8, with the exact line of the first bad one.

    Why read the file again: the text layer decodes 8 KB at a time, so the line count it has
    reached when a chunk fails is up to a chunk short of the bad byte. Read again as bytes,
    line by line, the first line that does not decode is the one; this runs only on the way
    to the error. A multi-byte UTF-8 character never contains a newline byte, so a line of
    good text always decodes on its own."""
    opener = gzip.open if is_gzip(path) else open
    try:
        with opener(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as bad:
                    return (f"input {path}: not valid UTF-8 on line {lineno:,} (byte "
                            f"{bad.start + 1} of the line: {bad.reason}); convert it to UTF-8 "
                            "(e.g. iconv) or leave it out")
    except (OSError, EOFError, zlib.error):
        pass
    return (f"input {path}: not valid UTF-8 ({exc.reason}); convert it to UTF-8 (e.g. iconv) "
            "or leave it out")


def _binary_input(path: str, lineno: int) -> str:
    shard = (" (a fairseq-preprocess output goes in --from-binarized DATA_BIN)"
             if path.endswith((".bin", ".idx")) else "")
    return (f"input {path}: holds a NUL byte on line {lineno}, so it is a binary file, not "
            f"text{shard}; leave it out, or strip NUL bytes (tr -d '\\000') if it is text")


# The first bytes of compressed files that are not read as such: (magic, format, command).
COMPRESSED_MAGIC = ((b"\x1f\x8b", "gzip", "gunzip"), (b"BZh", "bzip2", "bunzip2"),
                    (b"\xfd7zXZ\x00", "xz", "unxz"), (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"),
                    (b"PK\x03\x04", "zip", "unzip"), (b"\x04\x22\x4d\x18", "lz4", "unlz4"))


def _compressed_input(path: str) -> str | None:
    """The message for a compressed file that is read as text, or None when it is not one.

    Why: such a file fails as "not valid UTF-8", whose advice (iconv) is wrong for it. Only
    ``.gz`` is decompressed, and only by its name: a gzip file named otherwise is told so."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError:
        return None
    if is_gzip(path):  # the bytes inside the .gz are themselves compressed
        try:
            with gzip.open(path, "rb") as f:
                head = f.read(6)
        except (OSError, EOFError, zlib.error):
            return None
    for magic, name, command in COMPRESSED_MAGIC:
        if not head.startswith(magic):
            continue
        if name == "gzip" and not is_gzip(path):
            return (f"input {path}: a gzip file without the .gz ending, by which "
                    "alma-data-prep knows to decompress it; rename it to end in .gz, or "
                    f"decompress it ({command})")
        if is_gzip(path):
            return (f"input {path}: a .gz file whose content is {name}-compressed again; "
                    f"decompress it fully ({command}) and gzip the text once, or leave it out")
        article = "an" if name[0] in "aeioux" else "a"
        return (f"input {path}: {article} {name}-compressed file; alma-data-prep reads plain "
                f"UTF-8 text and .gz files only: decompress it ({command}) or recompress it "
                "with gzip, or leave it out")
    return None


def iter_documents(lines: Iterable[str]) -> Iterator[list[str]]:
    """Group normalised lines into documents (lists of non-empty lines)."""
    doc: list[str] = []
    for line in lines:
        words = line.split()
        if words:
            doc.append(" ".join(words))
        elif doc:
            yield doc
            doc = []
    if doc:
        yield doc


def extract_documents(sources: list[SourceFile], out_path: str, drop_repeats: bool = True) -> dict:
    """Write every document to ``out_path`` (lines, blank line after each document).

    One plain file lets sentencepiece train from it natively and later steps stream it again
    without re-decompressing. With ``drop_repeats`` every exact repeat of an earlier document is
    left out (``repeats.py`` says why); the file is then written a second time, which costs a
    pass over the text only for corpora that hold repeats. Returns counts and the sha256 of what
    was written, which keys every later step: touching a source without changing its text
    rebuilds nothing else.
    """
    digests = bytearray()
    documents, lines, sha256 = _write_documents(
        out_path, (doc for source in sources for doc in iter_documents(iter_lines(source.path))),
        "extract", digests)
    if documents == 0:
        os.remove(out_path)
        raise DataError("the inputs contain no text (every line is blank); "
                            "pass files with documents separated by blank lines")
    repeated = later_copies(digests)
    found = int(repeated.sum())
    log_repeats(found, documents, dropped=drop_repeats)
    if found and drop_repeats:
        documents, lines, sha256 = _rewrite_without(out_path, repeated)
    return {"documents": documents, "lines": lines, "bytes": os.path.getsize(out_path),
            "sha256": sha256, "repeated_documents": found,
            "repeats_dropped": bool(found and drop_repeats)}


def _rewrite_without(path: str, dropped: np.ndarray) -> tuple[int, int, str]:
    """Rewrite the extracted text at ``path`` without the documents ``dropped`` marks; return
    its documents, lines and sha256. Reads the old file while the new one is written beside it,
    so a kill leaves the old one whole (the step then runs again)."""
    kept = (doc for index, doc in enumerate(iter_documents(iter_lines(path))) if not dropped[index])
    return _write_documents(path, kept, "drop repeats")


def _write_documents(path: str, documents: Iterable[list[str]], label: str,
                     digests: bytearray | None = None) -> tuple[int, int, str]:
    """Write ``documents`` to ``path`` atomically, lines then a blank line after each; return
    their count, their lines and the file's sha256.  With ``digests``, each document's
    ``document_digest`` is appended to it (``repeats.py``)."""
    digest = hashlib.sha256()
    count = lines = 0
    progress = Progress(label)
    with atomic_output(path, "wb") as out:
        for doc in documents:
            data = ("\n".join(doc) + "\n\n").encode("utf-8")
            out.write(data)
            digest.update(data)
            if digests is not None:
                digests += document_digest(data)
            count += 1
            lines += len(doc)
            progress.update(1, len(data))
    progress.finish()
    return count, lines, digest.hexdigest()
