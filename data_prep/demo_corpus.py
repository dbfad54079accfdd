"""``alma-demo-corpus``: the embedded default corpus, built from text every Python install has.

The demo stream (paper §5 uses ~2.2B words of English; we need a few MB that any machine can
produce offline) is made of the standard library's own prose: every module, class and function
docstring, every other string literal long enough to be prose (e.g. pydoc's help topics, the
language reference), and every block of consecutive comment lines, in sorted file order (test
suites skipped). Each becomes one *document* in ``alma-data-prep``'s input format (non-empty
lines; documents separated by one blank line), so the corpus exercises the real pipeline: BPE
training, document-level shuffling and splitting. On Python 3.11 the whole stdlib gives about
3.3 MB and 18,500 documents. Nothing is downloaded; the output depends only on the Python
version's stdlib, and re-running writes nothing when the content is unchanged.
"""

from __future__ import annotations

import argparse
import ast
import gzip
import hashlib
import inspect
import io
import math
import os
import sys
import sysconfig
import tokenize
from collections.abc import Iterator

from fairseq_alma.console import OneLineArgumentParser, run_console
from fairseq_alma.errors import DataError, UsageError, no_room_named
from fairseq_alma.stream.atomic import atomic_output

DEFAULT_FILE_NAME = "demo_corpus.txt"
# Test suites are absent from many distributions' Python packages (Debian splits them out);
# skipping them keeps the corpus the same across installs of one Python version.
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
MIN_WORDS_PER_DOCUMENT = 4
MIN_WORDS_OF_PROSE = 12  # a string literal this long that is not a docstring is still prose


def stdlib_source_files(stdlib_dir: str | None = None) -> list[str]:
    """Every ``.py`` file of the standard library, sorted, skipping test suites."""
    root = stdlib_dir or sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS)
        found.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: os.path.relpath(p, root))


def _prose_strings(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Docstrings, and other string literals long enough to be prose (pydoc's help topics)."""
    scopes = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    docstring_nodes = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, scopes) and ast.get_docstring(node, clean=False) is not None
    }
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        if id(node) in docstring_nodes or len(node.value.split()) >= MIN_WORDS_OF_PROSE:
            yield (node.lineno, node.value)


def _comment_blocks(source: str) -> Iterator[tuple[int, str]]:
    """Consecutive whole-line ``#`` comments form one block: a paragraph about the code below.

    A line scan rather than ``tokenize``: five times faster, and a ``#`` line inside a string
    literal is still real prose."""
    block: list[str] = []
    start = 0
    for row, line in enumerate(source.splitlines(), start=1):
        stripped = line.lstrip()
        if stripped.startswith("#"):
            if not block:
                start = row
            block.append(stripped.lstrip("#!").strip())
        elif block:
            yield (start, "\n".join(block))
            block = []
    if block:
        yield (start, "\n".join(block))


def documents_of_file(path: str) -> list[str]:
    """The documents of one source file in line order; unreadable files contribute none."""
    try:
        with tokenize.open(path) as f:  # honours PEP 263 coding cookies
            source = f.read()
        tree = ast.parse(source)
        pieces = sorted([*_prose_strings(tree), *_comment_blocks(source)], key=lambda p: p[0])
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    docs = []
    for _, text in pieces:
        lines = [" ".join(line.split()) for line in inspect.cleandoc(text).splitlines()]
        lines = [line for line in lines if any(c.isalpha() for c in line)]
        if sum(len(line.split()) for line in lines) >= MIN_WORDS_PER_DOCUMENT:
            docs.append("\n".join(lines))
    return docs


def build_demo_corpus(max_bytes: int, stdlib_dir: str | None = None) -> tuple[bytes, int, int]:
    """Return (corpus text as UTF-8, documents, source files used), stopping at ``max_bytes``."""
    out = io.BytesIO()
    n_docs = n_files = 0
    for path in stdlib_source_files(stdlib_dir):
        if out.tell() >= max_bytes:
            break
        docs = documents_of_file(path)
        if not docs:
            continue
        n_files += 1
        for doc in docs:
            out.write(doc.encode("utf-8") + b"\n\n")
            n_docs += 1
    return out.getvalue(), n_docs, n_files


def _resolve_output(out: str) -> str:
    if os.path.isdir(out) or out.endswith(os.sep):
        return os.path.join(out, DEFAULT_FILE_NAME)
    return out


def _existing_digest(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (OSError, EOFError):  # e.g. a broken .gz: it is simply rewritten
        return None


def write_demo_corpus(out: str, max_mb: float) -> tuple[str, bool]:
    """Write the corpus to ``out`` (a file, ``.gz`` compressed, or a directory); return
    (path, written). Identical content already there is left untouched, so its mtime, and with
    it ``alma-data-prep``'s reuse of finished steps, survives a re-run of ``make demo``."""
    if not (math.isfinite(max_mb) and max_mb > 0):
        raise UsageError(f"--max-mb must be a finite number > 0 (got {max_mb:g}); the default is 5")
    path = _resolve_output(out)
    text, n_docs, n_files = build_demo_corpus(int(max_mb * 1e6))
    if n_docs == 0:
        raise DataError(f"no docstrings found under {sysconfig.get_paths()['stdlib']}")
    print(f"alma-demo-corpus: {n_docs:,} documents from {n_files} stdlib files, "
          f"{len(text) / 1e6:.2f} MB", file=sys.stderr)
    if _existing_digest(path) == hashlib.sha256(text).hexdigest():
        return path, False
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise DataError(f"--out {out}: folder {parent} does not exist; create it first")
    with atomic_output(path, "wb") as f:
        if path.endswith(".gz"):
            # mtime=0: the same text gives the same bytes, run after run.
            with gzip.GzipFile(fileobj=f, mode="wb", mtime=0) as gz:
                gz.write(text)
        else:
            f.write(text)
    return path, True


def finite_mb(text: str) -> float:
    """``--max-mb``: a size, so finite and > 0 (``float`` alone takes inf and nan, and the
    corpus then fails converting them to a byte count, with a traceback)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {text}); the default is 5")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = OneLineArgumentParser(
        prog="alma-demo-corpus",
        description="Build the offline demo corpus from the Python standard library's docstrings, "
        "long prose strings and comments (one document each; documents separated by a blank "
        "line, the input format of alma-data-prep). Deterministic for a Python version; prints "
        "the path written.",
    )
    parser.add_argument("--out", required=True, metavar="FILE_OR_DIR",
                        help=f"output file (.gz to compress) or existing directory (the file is "
                        f"then DIR/{DEFAULT_FILE_NAME})")
    parser.add_argument("--max-mb", type=finite_mb, default=5.0,
                        help="stop after the source file that takes the corpus past this many "
                        "MB of UTF-8 text (default: 5; the whole Python 3.11 stdlib gives about "
                        "3.3 MB, enough for a 4-mega-batch stream with a 2000-piece BPE)")
    args = parser.parse_args(argv)

    def write() -> None:
        with no_room_named(f"--out {args.out}"):
            _report(*write_demo_corpus(args.out, args.max_mb))

    return run_console(parser.prog, write)


def _report(path: str, written: bool) -> None:
    print(f"alma-demo-corpus: {'wrote' if written else 'unchanged'} {path}", file=sys.stderr)
    print(path)


if __name__ == "__main__":
    sys.exit(main())
