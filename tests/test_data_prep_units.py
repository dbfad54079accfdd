"""Unit tests of data_prep's pieces, with hand-computed expectations (fast, in-process)."""

from __future__ import annotations

import hashlib
import os
import signal
import textwrap
import time
from itertools import pairwise

import numpy as np
import pytest

from data_prep.corpus import discover_sources, iter_documents
from data_prep.demo_corpus import build_demo_corpus, documents_of_file
from data_prep.repeats import document_digest, later_copies
from data_prep.split import SizeSpec, assign_documents, carve, parse_size, split_names
from data_prep.steps import StepRunner
from fairseq_alma.errors import DataError


@pytest.mark.parametrize("text, expected", [
    ("0.2", SizeSpec(fraction=0.2)),
    (".05", SizeSpec(fraction=0.05)),
    ("500000", SizeSpec(tokens=500_000)),
    ("500k", SizeSpec(tokens=500_000)),
    ("0.5M", SizeSpec(tokens=500_000)),
    ("2G", SizeSpec(tokens=2_000_000_000)),
    ("1", SizeSpec(tokens=1)),
    ("megabatch", SizeSpec()),
])
def test_parse_size_accepts_fractions_and_token_counts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["1.5", "0", "0.0", "1.0", "-3", "abc", "1.5k5", "0.0001k"])
def test_parse_size_rejects_ambiguous_or_empty_sizes(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_carve_cuts_at_the_nearest_document_boundaries():
    # Ten documents of 10 tokens. valid = 10 tokens -> 1 document. eval = one mega-batch:
    # (100 - 10) / 5 = 18 tokens after token 10 -> boundary 30 is nearest to 28 -> 2 documents.
    # The 70 tokens left, in 4 parts of 17.5: ideal cuts at 47.5, 65, 82.5 -> boundaries
    # 50, 60 (tie between 60 and 70: the earlier), 80.
    cuts = carve(np.full(10, 10), 4, SizeSpec(tokens=10), SizeSpec())
    assert cuts == [0, 1, 3, 5, 6, 8, 10]


def test_carve_keeps_every_part_within_one_document_of_its_share():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 200, size=500)
    cuts = carve(tokens, 7, SizeSpec(fraction=0.05), SizeSpec(fraction=0.1))
    parts = [int(tokens[a:b].sum()) for a, b in pairwise(cuts[2:])]
    assert len(parts) == 7
    assert all(abs(p - sum(parts) / 7) <= tokens.max() for p in parts)
    assert abs(int(tokens[:cuts[1]].sum()) - 0.05 * tokens.sum()) <= tokens.max()


def test_carve_gives_each_split_a_document_even_when_sizes_are_tiny():
    cuts = carve(np.array([100, 1, 1, 1, 1, 100]), 4, SizeSpec(tokens=1), SizeSpec(tokens=1))
    assert cuts == [0, 1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("tokens, parts, valid, eval_size, named", [
    (np.full(5, 10), 4, SizeSpec(tokens=1), SizeSpec(), "--num-megabatches"),
    (np.full(10, 10), 2, SizeSpec(tokens=60), SizeSpec(tokens=40), "--valid-size"),
    (np.full(10, 10), 2, SizeSpec(tokens=100), SizeSpec(), "--eval-size"),
])
def test_carve_refuses_impossible_splits_naming_the_flag(tokens, parts, valid, eval_size, named):
    with pytest.raises(DataError, match=named):
        carve(tokens, parts, valid, eval_size)


def test_assign_documents_uses_a_local_seeded_generator():
    tokens = np.arange(1, 41)
    np.random.seed(123)
    global_state = np.random.get_state()[1].copy()
    labels, stats = assign_documents(tokens, 7, 3, SizeSpec(fraction=0.1), SizeSpec())
    assert np.array_equal(np.random.get_state()[1], global_state)  # global RNG untouched
    again, _ = assign_documents(tokens, 7, 3, SizeSpec(fraction=0.1), SizeSpec())
    other, _ = assign_documents(tokens, 8, 3, SizeSpec(fraction=0.1), SizeSpec())
    assert np.array_equal(labels, again) and not np.array_equal(labels, other)
    assert sorted(stats) == ["eval", "megabatch0", "megabatch1", "megabatch2", "valid"]
    assert sum(s["tokens"] for s in stats.values()) == tokens.sum()
    for index, name in enumerate(["valid", "eval", "megabatch0", "megabatch1", "megabatch2"]):
        assert stats[name]["documents"] == int((labels == index).sum())
        assert stats[name]["tokens"] == int(tokens[labels == index].sum())


def _members(labels: np.ndarray, names: list[str]) -> dict[str, set[int]]:
    return {name: set(np.flatnonzero(labels == index).tolist()) for index, name in enumerate(names)}


def test_given_order_cuts_the_training_documents_in_corpus_order():
    rng = np.random.default_rng(0)
    tokens = rng.integers(2, 30, size=90)
    valid, eval_size = SizeSpec(fraction=0.1), SizeSpec(tokens=200)
    shuffled, _ = assign_documents(tokens, 5, 4, valid, eval_size)
    given, stats = assign_documents(tokens, 5, 4, valid, eval_size, "given")
    names = split_names(4)
    # valid and eval: the very documents the shuffle holds out with this seed
    for index in (0, 1):
        assert np.array_equal(given == index, shuffled == index)
    train = given[given >= 2]  # the training documents' mega-batches, in corpus order
    assert np.all(np.diff(train) >= 0) and sorted(set(train.tolist())) == [2, 3, 4, 5]
    counts = [stats[name]["tokens"] for name in names[2:]]
    assert max(counts) - min(counts) <= 2 * tokens.max()  # equal within a document each side
    assert not np.array_equal(given, shuffled)


@pytest.mark.parametrize("order", ["shuffle", "given"])
def test_eval_per_megabatch_holds_out_a_seeded_slice_of_each_megabatch(order):
    rng = np.random.default_rng(1)
    tokens = rng.integers(2, 20, size=120)
    args = (tokens, 3, 3, SizeSpec(fraction=0.05), SizeSpec(fraction=0.1))
    plain, _ = assign_documents(*args, order)
    labels, stats = assign_documents(*args, order, SizeSpec(fraction=0.25))
    names = split_names(3, True)
    assert names[-3:] == ["evalmb0", "evalmb1", "evalmb2"]
    before, after = _members(plain, split_names(3)), _members(labels, names)
    for name in ("valid", "eval"):
        assert before[name] == after[name]
    for k in range(3):
        train, held = after[f"megabatch{k}"], after[f"evalmb{k}"]
        assert train | held == before[f"megabatch{k}"] and not train & held and held
        period = stats[f"megabatch{k}"]["tokens"] + stats[f"evalmb{k}"]["tokens"]
        assert abs(stats[f"evalmb{k}"]["tokens"] - 0.25 * period) <= tokens.max() / 2
        assert stats[f"evalmb{k}"]["tokens"] == int(tokens[sorted(held)].sum())
    again, _ = assign_documents(*args, order, SizeSpec(fraction=0.25))
    other, _ = assign_documents(tokens, 4, 3, SizeSpec(fraction=0.05), SizeSpec(fraction=0.1),
                                order, SizeSpec(fraction=0.25))
    assert np.array_equal(labels, again) and not np.array_equal(labels, other)
    counted, _ = assign_documents(*args, order, SizeSpec(tokens=60))
    for k in range(3):
        held = tokens[counted == names.index(f"evalmb{k}")].sum()
        assert abs(int(held) - 60) <= tokens.max() / 2


def test_eval_per_megabatch_refuses_to_empty_a_megabatch():
    tokens = np.full(12, 10)
    with pytest.raises(DataError, match="--eval-per-megabatch .*megabatch"):
        assign_documents(tokens, 1, 2, SizeSpec(tokens=10), SizeSpec(tokens=10), "shuffle",
                         SizeSpec(tokens=10_000))
    with pytest.raises(DataError, match="needs at least 6 .*--eval-per-megabatch"):
        assign_documents(np.full(5, 10), 1, 2, SizeSpec(tokens=10), SizeSpec(tokens=10),
                         "given", SizeSpec(fraction=0.5))


def test_documents_are_blank_line_separated_blocks_with_whitespace_collapsed():
    lines = ["\n", "  first   line\n", "second\tline\n", " \t\n", "\n", "next doc\n", "  \n",
             "last\n"]
    assert list(iter_documents(lines)) == [["first line", "second line"], ["next doc"],
                                           ["last"]]


def test_later_copies_marks_every_repeat_after_the_first_in_corpus_order():
    digests = b"".join(document_digest(text) for text in [b"a", b"b", b"a", b"c", b"b", b"a"])
    assert later_copies(digests).tolist() == [False, False, True, False, True, True]
    assert later_copies(b"").tolist() == []


def test_discover_sources_sorts_dedupes_and_skips_hidden(tmp_path):
    (tmp_path / "d" / "b").mkdir(parents=True)
    for rel in ["d/z.txt", "d/a.txt", "d/b/m.txt", "d/.skip.txt", "top.txt"]:
        (tmp_path / rel).write_text("x\n")
    found = discover_sources([str(tmp_path / "top.txt"), str(tmp_path / "d"),
                              str(tmp_path / "d" / "a.txt")])
    assert [os.path.relpath(s.path, tmp_path) for s in found] == [
        "top.txt", "d/a.txt", "d/z.txt", "d/b/m.txt"]
    with pytest.raises(DataError, match="nope"):
        discover_sources([str(tmp_path / "nope")])


def test_step_runner_reuses_until_key_or_outputs_change(tmp_path):
    withdrawn = []
    runner = StepRunner(str(tmp_path), lambda: withdrawn.append(1))
    builds = []

    def build():
        builds.append(1)
        (tmp_path / "out.txt").write_text("x" * len(builds))
        return {"n": len(builds)}

    assert runner.ensure("s", {"a": 1}, ["out.txt"], build) == {"n": 1}
    assert runner.ensure("s", {"a": 1}, ["out.txt"], build) == {"n": 1}  # reused
    assert withdrawn == [1]  # the manifest is withdrawn once, before the first build
    (tmp_path / "out.txt").write_text("")  # truncated output -> rebuilt
    assert runner.ensure("s", {"a": 1}, ["out.txt"], build) == {"n": 2}
    assert StepRunner(str(tmp_path)).ensure("s", {"a": 2}, ["out.txt"], build) == {"n": 3}
    (tmp_path / "out.txt").unlink()  # facts only: a current key suffices
    assert runner.ensure("s", {"a": 2}, ["out.txt"], build, need_outputs=False) == {"n": 3}
    assert runner.ensure("s", {"a": 2}, ["out.txt"], build) == {"n": 4}
    assert withdrawn == [1]
    quiet = []
    StepRunner(str(tmp_path), lambda: quiet.append(1)).ensure("s", {"a": 2}, ["out.txt"], build)
    assert quiet == []  # a run that rebuilds nothing changes nothing


def test_documents_of_file_takes_docstrings_comments_and_long_strings(tmp_path):
    source = tmp_path / "mod.py"
    source.write_text(textwrap.dedent('''\
        """Module summary line here.

            Indented second paragraph of the module."""
        # A comment block that explains
        #   the function below it.
        def f():
            """Return nothing useful at all."""
            x = "short string"
            return "this literal string is long enough to count as prose for the corpus ok"
        # two words
        '''))
    assert documents_of_file(str(source)) == [
        "Module summary line here.\nIndented second paragraph of the module.",
        "A comment block that explains\nthe function below it.",
        "Return nothing useful at all.",
        "this literal string is long enough to count as prose for the corpus ok",
    ]


def test_demo_corpus_is_deterministic_real_text():
    text, docs, files = build_demo_corpus(20_000)
    assert (text, docs, files) == build_demo_corpus(20_000)
    decoded = text.decode("utf-8")
    assert len(text) >= 20_000 and docs >= 10 and files >= 1
    assert decoded.endswith("\n\n") and "\n\n\n" not in decoded
    assert all(len(doc.split()) >= 4 for doc in decoded.strip().split("\n\n"))


def _write_encoded(prefix: str, documents: list[list[list[int]]], extra=()) -> None:
    """An encoded corpus (encoded.py's files) holding ``documents`` (lines of ids)."""
    from data_prep.encoded import PartWriter

    writer = PartWriter(prefix)
    for doc in documents:
        lens = np.array([len(line) for line in doc])
        writer.write(np.array([i for line in doc for i in line]), lens, np.array([len(doc)]),
                     np.array([lens.sum() + len(doc) + 1]))
    writer.extra.update({piece: k for k, piece in enumerate(extra)})
    writer.close()


@pytest.mark.parametrize("chunk_ids", [3, 1 << 20])
def test_binarizer_writes_the_same_bytes_as_fairseq_preprocess(tmp_path, monkeypatch,
                                                               chunk_ids):
    """The numpy pass over ids must give what fairseq-preprocess gives for the split's text."""
    from fairseq.binarizer import FileBinarizer, VocabularyDatasetBinarizer
    from fairseq.data import Dictionary

    import data_prep.binarize
    from data_prep.binarize import binarize_splits
    from data_prep.encoded import Encoded

    monkeypatch.setattr(data_prep.binarize, "CHUNK_IDS", 2)  # the index in several chunks
    symbols = ["▁a", "b", "▁c", "zz", "▁é"]  # zz: not in the dictionary -> <unk>
    documents = [[[0, 1, 2]], [[2, 2, 3], [1]], [[0, 4]], [[3], [3, 3, 0]]] * 5
    labels = np.array([0, 1, 1, 0] * 5, dtype=np.int32)
    _write_encoded(str(tmp_path / "enc"), documents)
    dictionary = Dictionary()
    for piece, count in [("▁a", 3), ("b", 2), ("▁c", 5), ("▁é", 1)]:
        dictionary.add_symbol(piece, n=count)
    dictionary.finalize(padding_factor=8)
    dictionary.save(str(tmp_path / "dict.txt"))
    encoded = Encoded.open(str(tmp_path / "enc"))
    encoded.chunk_ids = chunk_ids
    info = binarize_splits(encoded, labels, ["x", "y"], symbols, str(tmp_path / "dict.txt"),
                           str(tmp_path))
    for index, name in enumerate(["x", "y"]):
        docs = [doc for doc, label in zip(documents, labels) if label == index]
        text = tmp_path / f"{name}.txt"
        text.write_text("".join("".join(" ".join(symbols[i] for i in line) + "\n" for line in doc)
                                + "\n" for doc in docs), encoding="utf-8")
        FileBinarizer.multiprocess_dataset(
            str(text), "mmap", VocabularyDatasetBinarizer(dictionary, append_eos=True),
            str(tmp_path / f"fairseq_{name}"), vocab_size=len(dictionary), num_workers=1)
        lines = sum(len(doc) + 1 for doc in docs)
        ids = sum(len(line) for doc in docs for line in doc)
        unk = sum(line.count(3) for doc in docs for line in doc)
        counts = {k: v for k, v in info[name].items() if not k.endswith("_sha256")}
        assert counts == {"tokens": ids + lines, "lines": lines, "unk_tokens": unk}
        for ext in ("bin", "idx"):
            ours = (tmp_path / f"{name}.{ext}").read_bytes()
            assert ours == (tmp_path / f"fairseq_{name}.{ext}").read_bytes(), (name, ext)
            # the checksums the manifest records are of what was written
            assert info[name][f"{ext}_sha256"] == hashlib.sha256(ours).hexdigest()
    assert not list(tmp_path.glob("*.partial"))


@pytest.mark.parametrize("vocab_size", [300, 70_000])
def test_mmap_writer_matches_fairseqs_builder(tmp_path, vocab_size):
    """Both dtypes fairseq picks (uint16 below 65,500 symbols, uint32 above)."""
    import torch
    from fairseq.data import indexed_dataset

    from data_prep.binarize import MMapWriter

    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 9, size=200)
    data = rng.integers(0, vocab_size, size=int(sizes.sum()))
    dtype = indexed_dataset.best_fitting_int_dtype(vocab_size)
    builder = indexed_dataset.make_builder(str(tmp_path / "ref.bin"), "mmap", vocab_size)
    for item in np.split(data, np.cumsum(sizes)[:-1]):
        builder.add_item(torch.from_numpy(item))
    builder.finalize(str(tmp_path / "ref.idx"))
    writer = MMapWriter(str(tmp_path / "ours"), dtype)
    for part in (slice(0, 50), slice(50, 200)):  # two chunks of whole items
        start, end = int(sizes[:part.start].sum()), int(sizes[:part.stop].sum())
        writer.add(data[start:end], sizes[part])
    writer.finalize()
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ours.{ext}").read_bytes() == (tmp_path / f"ref.{ext}").read_bytes()


def test_encode_keeps_unknown_pieces_as_their_surface_strings(tmp_path):
    """Without byte fallback sentencepiece says <unk>; the ids route names each such piece by
    the string encode(out_type=str) gives there, as the text route stored it."""
    import sentencepiece as spm

    from data_prep.bpe import SentencepieceLines, encode_documents, train_sentencepiece
    from data_prep.encoded import Encoded, read_extra

    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    rng = np.random.default_rng(0)
    docs = tmp_path / "docs.txt"
    train_text = "".join(" ".join(rng.choice(words, 6)) + "\n\n" for _ in range(200))
    docs.write_text(train_text, encoding="utf-8")
    train_sentencepiece(str(docs), str(tmp_path), 60, 0, 1, byte_fallback=False)
    lines = ["alpha ☃ beta", "ж", "gamma ☃☃ ж", "☃ delta"]
    docs.write_text("alpha beta\n\n" + "\n".join(lines[:2]) + "\n\n" + "\n".join(lines[2:])
                    + "\n\n", encoding="utf-8")
    model = spm.SentencePieceProcessor(model_file=str(tmp_path / "spm.model"))
    table = SentencepieceLines(str(tmp_path / "spm.model")).piece_table()
    for workers in (1, 2):
        out = tmp_path / f"enc{workers}"
        encode_documents(str(docs), SentencepieceLines(str(tmp_path / "spm.model")), str(out),
                         workers)
        encoded = Encoded.open(str(out))
        symbols = table + read_extra(str(out))
        ids = np.fromfile(f"{out}.ids", dtype=np.int32)
        expected = [p for line in ["alpha beta", *lines] for p in model.encode(line, out_type=str)]
        assert [symbols[i] for i in ids] == expected
        assert read_extra(str(out)) == ["☃", "ж", "☃☃"]  # first occurrence order
        assert encoded.docs.tolist() == [1, 2, 2]
        assert encoded.tokens.tolist() == [len(model.encode("alpha beta")) + 2] + [
            sum(len(model.encode(line)) + 1 for line in part) + 1
            for part in (lines[:2], lines[2:])]


def test_aligned_offsets_cut_at_line_or_document_starts(tmp_path):
    from data_prep.fileio import aligned_offsets

    path = tmp_path / "docs.txt"
    data = b"aa\nbbbb\n\nc\n\nddddddd\ne\n\nf\n\n"
    path.write_bytes(data)
    assert aligned_offsets(str(path), 1) == [0, 26]
    # Lines start at 0 3 8 9 11 12 20 22 23 25; documents (after a blank line) at 9 12 23.
    # Cut targets 6, 13, 19 -> next line starts 8, 20, 20 (a repeated cut is dropped).
    assert aligned_offsets(str(path), 4) == [0, 8, 20, 26]
    # -> next document starts 9, 23 (the third target lies before 23 and is dropped).
    assert aligned_offsets(str(path), 4, at_blank_line=True) == [0, 9, 23, 26]
    assert aligned_offsets(str(path), 100, at_blank_line=True) == [0, 9, 12, 23, 26]


def _unreadable_dir(path, monkeypatch) -> None:
    """``path`` cannot be listed: ``chmod 000``, and where that does not stop this process
    (root reads every directory) ``os.walk`` is shown the PermissionError others would get."""
    path.chmod(0)
    if os.access(path, os.R_OK):
        real_scandir = os.scandir

        def scandir(where="."):
            if os.fspath(where) == str(path):
                raise PermissionError(13, "Permission denied", os.fspath(where))
            return real_scandir(where)
        monkeypatch.setattr(os, "scandir", scandir)


def test_discover_sources_refuses_what_a_directory_holds_but_cannot_be_read(tmp_path,
                                                                            monkeypatch):
    """Each of these was skipped in silence (exit 0, fewer documents), a traceback, or a hang
    (a FIFO blocks the extraction's open forever): now one DataError naming it."""
    def corpus(name: str):
        root = tmp_path / name
        (root / "sub").mkdir(parents=True)
        (root / "a.txt").write_text("x\n")
        (root / "sub" / "b.txt").write_text("y\n")
        return root

    locked = corpus("locked")
    _unreadable_dir(locked / "sub", monkeypatch)
    try:
        with pytest.raises(DataError, match=f"cannot read directory {locked / 'sub'} "
                                            r"\(Permission denied\); make it readable"):
            discover_sources([str(locked)])
    finally:
        (locked / "sub").chmod(0o755)
        monkeypatch.undo()

    dangling = corpus("dangling")
    os.symlink(tmp_path / "nowhere.txt", dangling / "sub" / "c.txt")
    with pytest.raises(DataError, match=f"input {dangling / 'sub' / 'c.txt'} \\(in input "
                                        f"directory {dangling}\\): a symbolic link to "
                                        f"{tmp_path / 'nowhere.txt'}, which does not exist"):
        discover_sources([str(dangling)])

    # a link loop: a file that links to itself, and a directory linked back to its parent
    # (followed, it nested "sub/up/sub/up/..." until the path was "a special file")
    looped = corpus("looped")
    os.symlink("self", looped / "self")
    with pytest.raises(DataError, match=f"input {looped / 'self'} .*a loop of symbolic links"):
        discover_sources([str(looped)])
    (looped / "self").unlink()
    os.symlink("..", looped / "sub" / "up")
    with pytest.raises(DataError, match=f"directory {looped / 'sub' / 'up'} is a link back to "
                                        f"{os.path.realpath(looped)}, which holds it"):
        discover_sources([str(looped)])
    (looped / "sub" / "up").unlink()
    os.symlink(looped / "sub", looped / "again")  # the same files twice: read once, no loop
    assert len(discover_sources([str(looped)])) == 2

    fifo = corpus("fifo")
    os.mkfifo(fifo / "sub" / "pipe")
    with pytest.raises(DataError, match=f"input {fifo / 'sub' / 'pipe'} .*a FIFO \\(named "
                                        "pipe\\), not a regular file.*move it out"):
        discover_sources([str(fifo)])
    with pytest.raises(DataError, match="a FIFO .* write its text to a file"):
        discover_sources([str(fifo / "sub" / "pipe")])


def test_extract_rereads_a_source_replaced_with_its_size_and_mtime_kept(tmp_path):
    """cp -p, rsync -a or touch -r of a corrected file keeps size and mtime: the extraction
    keyed by those alone was reused, and the old text prepared (its ctime moves)."""
    from data_prep.options import PrepOptions
    from data_prep.pipeline import Pipeline

    source = tmp_path / "c.txt"
    source.write_text("first doc\n\nsecond doc\n")
    before = source.stat()
    options = PrepOptions(inputs=[str(source)], out=str(tmp_path / "out"))
    os.makedirs(tmp_path / "out" / "work")
    Pipeline(options, None).extract(need_outputs=True)
    time.sleep(0.05)  # past the file system's timestamp granularity
    source.write_text("first doc\n\nsecond DOC\n")
    os.utime(source, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert (source.stat().st_size, source.stat().st_mtime_ns) == (before.st_size,
                                                                  before.st_mtime_ns)
    Pipeline(options, None).extract(need_outputs=True)
    assert "second DOC" in (tmp_path / "out" / "work" / "docs.txt").read_text()


def test_default_eval_size_is_named_as_what_it_is_when_valid_takes_everything():
    with pytest.raises(DataError) as info:
        carve(np.full(10, 10), 2, SizeSpec(tokens=500), SizeSpec())
    message = str(info.value)
    assert "--valid-size (500 tokens) leaves nothing of the corpus's 100 tokens" in message
    assert "--eval-size megabatch" in message and "(0 tokens)" not in message


def test_bad_utf8_names_its_exact_line_and_compressed_files_are_told_to_decompress(tmp_path):
    """The text layer decodes 8 KB at a time: the line it had reached was up to a chunk short
    of the bad byte. A compressed file was told to use iconv."""
    import bz2
    import gzip
    import lzma

    from data_prep.corpus import iter_lines

    lines = [f"line {i} with some words to fill the chunk".encode() for i in range(1, 3001)]
    lines[1499] = b"bad \xff byte"
    text = b"\n".join(lines) + b"\n"
    for name, data in [("bad.txt", text), ("bad.txt.gz", gzip.compress(text))]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match=r"not valid UTF-8 on line 1,500 \(byte 5 of the "
                                            r"line: invalid start byte\); convert it to UTF-8"):
            list(iter_lines(str(tmp_path / name)))
    good = b"plain text\n" * 50
    for name, data, named in [("c.txt.bz2", bz2.compress(good), "a bzip2-compressed file"),
                              ("c.txt.xz", lzma.compress(good), "an xz-compressed file"),
                              ("c.txt", gzip.compress(good), "a gzip file without the .gz"),
                              ("c2.txt.gz", gzip.compress(gzip.compress(good)),
                               "content is gzip-compressed again")]:
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError, match="decompress it") as info:
            list(iter_lines(str(tmp_path / name)))
        assert named in str(info.value) and "iconv" not in str(info.value)


def test_lines_too_long_for_the_bpe_trainer_are_named(tmp_path, capsys):
    """sentencepiece skips lines over 4192 bytes in silence: a corpus of one-line documents
    failed with its internal '!sentences_.empty()', and a few long lines were left out of
    the BPE training unsaid."""
    from data_prep.bpe import train_sentencepiece

    docs = tmp_path / "docs.txt"
    long = " ".join(["word"] * 1000)  # 4,999 bytes
    docs.write_text("".join(f"{long} {i}\n\n" for i in range(5)), encoding="utf-8")
    with pytest.raises(DataError, match=r"every line of the corpus \(5\) is longer than 4,192 "
                                        "bytes.*documents one per line"):
        train_sentencepiece(str(docs), str(tmp_path), 60, 0, 1, byte_fallback=False)
    assert not (tmp_path / "spm.model").exists()
    short = "".join(f"alpha beta gamma {i % 7} delta\n\n" for i in range(200))
    docs.write_text(short + f"{long}\n\n" * 3, encoding="utf-8")
    withdrawn = []
    train_sentencepiece(str(docs), str(tmp_path), 60, 0, 1, byte_fallback=False,
                        before_writing=lambda: withdrawn.append(1))
    assert "warning: 3 of 203 lines are longer than 4,192 bytes" in capsys.readouterr().err
    assert withdrawn == [1] and (tmp_path / "spm.model").exists()


def test_step_runner_withdraws_the_manifest_only_before_stream_files_change(tmp_path):
    """Work files (DIR/work) change under a manifest harmlessly; a step writing stream files
    with checks_first says when its checks have passed. A refused re-run withdrew nothing."""
    withdrawn = []
    runner = StepRunner(str(tmp_path), lambda: withdrawn.append(1))
    (tmp_path / "work").mkdir()

    def work() -> dict:
        (tmp_path / "work" / "w.txt").write_text("w")
        return {}
    runner.ensure("w", {"a": 1}, ["work/w.txt"], work)
    assert withdrawn == []

    def refused() -> dict:
        raise DataError("refused")
    with pytest.raises(DataError):
        runner.ensure("s", {"a": 1}, ["s.txt"], refused, checks_first=True)
    assert withdrawn == []

    def checked() -> dict:
        runner.changing_stream()
        (tmp_path / "s.txt").write_text("s")
        return {}
    runner.ensure("s", {"a": 1}, ["s.txt"], checked, checks_first=True)
    assert withdrawn == [1]


def test_sentencepiece_errors_are_explained_in_the_flag_terms():
    """--vocab-size 1 passed the parser and ended in sentencepiece's internal error text."""
    from data_prep.bpe import _explain_spm_error

    internal = ("Internal: src/trainer_interface.cc(758) [insert_id(trainer_spec_.bos_id(), "
                "trainer_spec_.bos_piece())]")
    assert _explain_spm_error(internal, 1).startswith("--vocab-size 1 is too small")
    assert "342 pieces" in _explain_spm_error("smaller than required_chars. 4 vs 342.", 4)


class _DyingEncoder:
    """A tokenizer whose worker process is killed as it starts a range (the OOM killer)."""

    def __init__(self, parent: int) -> None:
        self.parent = parent

    def load(self):
        if os.getpid() != self.parent:
            os.kill(os.getpid(), signal.SIGKILL)
        return lambda lines: [[1] for _ in lines]

    def piece_table(self) -> list[str]:
        return ["a", "b"]


def test_a_killed_encode_worker_is_one_line_not_a_hang(tmp_path):
    """multiprocessing.Pool waited forever for a dead worker's result (no message, no exit)."""
    from data_prep.bpe import encode_ranges

    docs = tmp_path / "docs.txt"
    docs.write_text("a b\n\nb a\n\n", encoding="utf-8")
    signal.alarm(60)  # the old hang ends the test process instead of the CI job
    try:
        with pytest.raises(DataError, match=r"a --workers process died .*run the same command"):
            encode_ranges(str(docs), _DyingEncoder(os.getpid()), [(0, 5), (5, 10)],
                          [str(tmp_path / "p0"), str(tmp_path / "p1")], workers=2)
    finally:
        signal.alarm(0)
