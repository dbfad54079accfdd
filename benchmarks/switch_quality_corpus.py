"""The English corpus of ``switch_quality.py``: the documentation Debian's package manager installed.

Why this corpus: the Switch-vs-dense comparison needs tens of MB of real English that every
machine running the toolkit can rebuild offline, and that is not the embedded demo corpus (Python
docstrings, 3 MB). The manual pages, info manuals and package documentation under /usr/share are
written by hundreds of authors, are mostly prose, and come with the system.

Sources, in this order (each file becomes one *document* of ``alma-data-prep``'s input: non-empty
lines, one blank line after it):

* ``/usr/share/man/man1`` .. ``man8`` (English only: the translated ``/usr/share/man/<lang>``
  trees are skipped), rendered to plain text by ``groff -man -Tutf8`` with an unbounded line length,
  so a paragraph is one line and nothing is hyphenated or justified. Alias pages (only ``.so``)
  and symbolic links are skipped, and so are ``gcloud alpha``/``gcloud beta`` pages: they repeat
  the GA ``gcloud`` page of the same command almost word for word.
* ``/usr/share/info/*.info*``: texinfo manuals; node headers and menus dropped.
* ``/usr/share/doc/**``: ``.txt``/``.md``/``.rst``/``.html`` and extension-less README/NEWS-like
  files (plain or ``.gz``); HTML tags stripped. Skipped: copyright and licence files, Debian
  changelogs, source code, data and images; when one directory has a page as ``.md`` and as
  ``.html`` (nodejs's API docs), the ``.md`` is kept, and nodejs's ``all.html`` (all its API pages
  again in one) is skipped.

Cleaning: typographic characters mapped to ASCII; a paragraph of wrapped prose is joined into one
line; every line of 40 characters or more that was seen before anywhere in the corpus is dropped
(boilerplate shared by many pages: gcloud's flag list, licence paragraphs); a document is kept if
it still has >= 50 words, >= 97% of its letters are ASCII and >= 3% of its words are common English
function words (drops the few translated docs). The counts and bytes of each source are written to
``sources.json`` next to the corpus.

Usage: python benchmarks/switch_quality_corpus.py --out /work/switchq_work/corpus
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import html.parser
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data_prep.corpus import iter_documents  # noqa: E402

MAN_ROOT, INFO_ROOT, DOC_ROOT = "/usr/share/man", "/usr/share/info", "/usr/share/doc"
MIN_WORDS = 50
MIN_ASCII_LETTERS = 0.97
MIN_FUNCTION_WORDS = 0.03
DEDUPE_MIN_CHARS = 40
FUNCTION_WORDS = frozenset(
    "the of and to a in is for that with as on by be this are or it from an if not can at "
    "which when will all use used you your see".split())
TYPOGRAPHY = str.maketrans({"\u2010": "-", "\u2011": "-", "\u2012": "-", "\u2013": "-", "\u2014": "--",
                            "\u2212": "-", "\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"',
                            "\u2022": "*", "\u00b7": "*", "\u00a0": " ", "\u2026": "...", "\u00ad": ""})
DOC_EXTENSIONS = (".txt", ".md", ".rst", ".html", ".htm")
DOC_PREFERENCE = {".txt": 0, ".md": 1, ".rst": 2, "": 3, ".html": 4, ".htm": 4}
# Extension-less files that packages ship as prose documentation (a file named TODO is a
# package's to-do list, read as English text like README).
DOC_PLAIN_NAMES = re.compile(r"^(README|NEWS|TODO|FAQ|AUTHORS|THANKS|BUGS|HACKING|USAGE|INSTALL)", re.I)
DOC_SKIPPED_NAMES = re.compile(r"(copyright|licen[cs]e|copying|changelog\.debian|^changelog)", re.I)
# nodejs ships its API docs as one page per module (.md, kept) and again concatenated in all.html
DOC_SKIPPED_PATHS = frozenset({"nodejs/api/all.html"})
SKIPPED_GCLOUD = re.compile(r"^gcloud_(alpha|beta)_")
WORD = re.compile(r"[A-Za-z]+")


@dataclass
class SourceStats:
    """What one source gave: files seen and kept, bytes read from disk and written."""

    files_seen: int = 0
    files_kept: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    skipped: dict[str, int] = field(default_factory=dict)

    def skip(self, reason: str) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + 1


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read()
    return gzip.decompress(raw) if path.endswith(".gz") else raw


def render_man(path: str) -> str | None:
    """Plain text of one manual page, or None for an alias page or one groff cannot render."""
    source = _read_bytes(path)
    if source.lstrip().startswith(b".so ") and source.count(b"\n") <= 2:
        return None
    proc = subprocess.run(["groff", "-t", "-man", "-Tutf8", "-P-cbou", "-rLL=8000n", "-rHY=0"],
                          input=source, capture_output=True, check=False)
    if proc.returncode != 0:
        return None
    lines = proc.stdout.decode("utf-8", "replace").splitlines()
    text = [i for i, line in enumerate(lines) if line.strip()]
    if len(text) < 3:
        return None
    return "\n".join(lines[text[0] + 1: text[-1]])  # page header and footer lines dropped


def info_text(path: str) -> str:
    """An info manual without node separators, ``File: ... Node: ...`` headers and menus."""
    keep, in_menu = [], False
    for line in _read_bytes(path).decode("utf-8", "replace").splitlines():
        if line.startswith("\x1f") or line.startswith("File: ") or line.startswith("Tag Table:"):
            in_menu = False
            continue
        if line.startswith("* Menu:"):
            in_menu = True
            continue
        if in_menu and (line.startswith("* ") or not line.strip()):
            continue
        in_menu = False
        keep.append(line)
    return "\n".join(keep)


class _TextOfHtml(html.parser.HTMLParser):
    """Visible text of an HTML page: block elements end a paragraph, scripts/styles dropped."""

    BLOCKS = {"p", "div", "li", "br", "tr", "h1", "h2", "h3", "h4", "h5", "h6", "pre", "dt", "dd",
              "table", "ul", "ol", "section", "blockquote"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.hidden = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag in ("script", "style", "head"):
            self.hidden += 1
        if tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_endtag(self, tag: str) -> None:
        if tag in ("script", "style", "head"):
            self.hidden = max(0, self.hidden - 1)
        if tag in self.BLOCKS:
            self.parts.append("\n\n")

    def handle_data(self, data: str) -> None:
        if not self.hidden:
            self.parts.append(data)


def html_text(raw: str) -> str:
    parser = _TextOfHtml()
    parser.feed(raw)
    return re.sub(r"[ \t]*\n[ \t]*", "\n", "".join(parser.parts))


def paragraphs(text: str) -> Iterator[list[str]]:
    """Blocks of non-empty lines (whitespace runs collapsed), typographic characters in ASCII:
    ``alma-data-prep``'s own notion of a document, applied to one page."""
    return iter_documents(text.translate(TYPOGRAPHY).splitlines())


def _is_prose(block: list[str]) -> bool:
    """Wrapped prose (mostly letters and spaces, no line a list item) is joined into one line;
    code, tables and lists keep their lines."""
    joined = " ".join(block)
    letters = sum(c.isalpha() or c == " " for c in joined)
    return letters >= 0.85 * len(joined) and not any(re.match(r"^([-*+]|\d+[.)])\s", b) for b in block[1:])


class Deduper:
    """Drops every line of >= DEDUPE_MIN_CHARS characters that appeared before in the corpus."""

    def __init__(self) -> None:
        self.seen: set[bytes] = set()
        self.dropped_lines = 0

    def keep(self, line: str) -> bool:
        if len(line) < DEDUPE_MIN_CHARS:
            return True
        key = hashlib.blake2b(line.lower().encode("utf-8"), digest_size=12).digest()
        if key in self.seen:
            self.dropped_lines += 1
            return False
        self.seen.add(key)
        return True


def _joined(block: list[str]) -> list[str]:
    """A block's lines as written to the corpus: a leading section heading (all capitals, as man
    pages put them right above their first paragraph) stays alone, wrapped prose becomes one line."""
    head = []
    if len(block) > 1 and block[0].isupper() and len(block[0]) < DEDUPE_MIN_CHARS:
        head, block = block[:1], block[1:]
    return head + ([" ".join(block)] if len(block) > 1 and _is_prose(block) else block)


def clean_document(text: str, dedupe: Deduper) -> list[str] | None:
    """The document's lines after joining prose, dedupe and the English filter; None = dropped."""
    lines: list[str] = []
    for block in paragraphs(text):
        for line in _joined(block):
            if dedupe.keep(line):
                lines.append(line)
    body = " ".join(lines)
    words = WORD.findall(body)
    if len(words) < MIN_WORDS:
        return None
    letters = sum(c.isalpha() for c in body)
    ascii_letters = sum(c.isascii() and c.isalpha() for c in body)
    if ascii_letters < MIN_ASCII_LETTERS * max(letters, 1):
        return None
    if sum(w.lower() in FUNCTION_WORDS for w in words) < MIN_FUNCTION_WORDS * len(words):
        return None
    return lines


def man_files() -> list[str]:
    found = []
    for section in sorted(os.listdir(MAN_ROOT)):
        folder = os.path.join(MAN_ROOT, section)
        if re.fullmatch(r"man\d", section) and os.path.isdir(folder):
            found += [os.path.join(folder, f) for f in sorted(os.listdir(folder))]
    return found


def info_files() -> list[str]:
    return [os.path.join(INFO_ROOT, f) for f in sorted(os.listdir(INFO_ROOT)) if ".info" in f]


def _doc_kind(name: str) -> str | None:
    """The extension a documentation file counts as (".gz" removed), or None to skip it."""
    base = name[:-3] if name.endswith(".gz") else name
    if DOC_SKIPPED_NAMES.search(base):
        return None
    ext = os.path.splitext(base)[1].lower()
    if ext in DOC_EXTENSIONS:
        return ext
    return "" if DOC_PLAIN_NAMES.match(base) and ext == "" else None


def doc_files() -> list[str]:
    """Documentation files; per directory and stem only the most plain-text format is kept."""
    found = []
    for dirpath, dirnames, filenames in os.walk(DOC_ROOT):
        dirnames.sort()
        chosen: dict[str, tuple[int, str]] = {}
        for name in sorted(filenames):
            kind = _doc_kind(name)
            path = os.path.join(dirpath, name)
            if kind is None or os.path.islink(path) or os.path.relpath(path, DOC_ROOT) in DOC_SKIPPED_PATHS:
                continue
            stem = os.path.splitext(name[:-3] if name.endswith(".gz") else name)[0].lower()
            rank = DOC_PREFERENCE[kind]
            if stem not in chosen or rank < chosen[stem][0]:
                chosen[stem] = (rank, path)
        found += sorted(path for _, path in chosen.values())
    return found


def _text_of(source: str, path: str) -> str | None:
    if source == "man":
        return render_man(path)
    if source == "info":
        return info_text(path)
    raw = _read_bytes(path).decode("utf-8", "replace")
    name = path[:-3] if path.endswith(".gz") else path
    return html_text(raw) if name.endswith((".html", ".htm")) else raw


def build(out_dir: str, limit: int | None = None) -> dict:
    """Write ``man.txt``, ``info.txt``, ``doc.txt`` and ``sources.json`` into ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    dedupe = Deduper()
    report: dict = {"sources": {}, "settings": {
        "min_words": MIN_WORDS, "min_ascii_letters": MIN_ASCII_LETTERS,
        "min_function_words": MIN_FUNCTION_WORDS, "dedupe_min_chars": DEDUPE_MIN_CHARS}}
    listing = {"man": man_files(), "info": info_files(), "doc": doc_files()}
    for source, files in listing.items():
        stats, start = SourceStats(), time.time()
        target = os.path.join(out_dir, f"{source}.txt")
        with open(target + ".tmp", "w", encoding="utf-8") as out:
            for i, path in enumerate(files[:limit]):
                stats.files_seen += 1
                name = os.path.basename(path)
                if os.path.islink(path):
                    stats.skip("symbolic link")
                    continue
                if source == "man" and SKIPPED_GCLOUD.match(name):
                    stats.skip("gcloud alpha/beta page")
                    continue
                stats.bytes_read += os.path.getsize(path)
                text = _text_of(source, path)
                lines = None if text is None else clean_document(text, dedupe)
                if lines is None:
                    stats.skip("alias, unrenderable, short or not English")
                    continue
                data = "\n".join(lines) + "\n\n"
                out.write(data)
                stats.files_kept += 1
                stats.bytes_written += len(data.encode("utf-8"))
                if i % 2000 == 0:
                    print(f"  {source}: {i}/{len(files)} files, {stats.bytes_written / 1e6:.1f} MB "
                          f"({time.time() - start:.0f}s)", flush=True)
        os.replace(target + ".tmp", target)
        report["sources"][source] = vars(stats) | {"root": {"man": MAN_ROOT, "info": INFO_ROOT,
                                                           "doc": DOC_ROOT}[source]}
        print(f"{source}: {stats.files_kept}/{stats.files_seen} files kept, "
              f"{stats.bytes_read / 1e6:.1f} MB read, {stats.bytes_written / 1e6:.1f} MB written", flush=True)
    report["dedupe_dropped_lines"] = dedupe.dropped_lines
    report["total_bytes"] = sum(s["bytes_written"] for s in report["sources"].values())
    with open(os.path.join(out_dir, "sources.json"), "w") as f:
        json.dump(report, f, indent=1)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="directory for man.txt, info.txt, doc.txt, sources.json")
    parser.add_argument("--limit", type=int, default=None, help="files per source (for a quick look)")
    args = parser.parse_args()
    report = build(args.out, args.limit)
    print(f"corpus: {report['total_bytes'] / 1e6:.1f} MB in {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
