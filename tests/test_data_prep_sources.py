"""``alma-data-prep --bpe gpt2`` and ``--from-binarized``, end to end on a tiny corpus.

The GPT-2 BPE is one we build here (every byte symbol plus a few merges), so nothing is
downloaded; ids are checked against fairseq's own encoder. The binarized route is checked
against the text route: ``fairseq-preprocess`` of our encoded text, cut with the same seed,
must give the same shards.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

from fairseq_alma.stream.manifest import data_identity, verify_stream_dir

pytestmark = pytest.mark.slow

NUM_DOCS = 30
SPLIT_FLAGS = ["--valid-size", "0.1", "--seed", "5"]
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("a", "n"), ("Ġ", "s"), ("o", "r"), ("Ġs", "t"),
          ("e", "r"), ("Ġ", "a"), ("Ġa", "n")]


def run_prep(*args: str) -> subprocess.CompletedProcess:
    """The CLI of the code under test (``python -m``: the checkout on PYTHONPATH, whatever
    the installed console script points to)."""
    return subprocess.run([sys.executable, "-m", "data_prep.cli", *args], capture_output=True,
                          text=True, timeout=300, check=False)


def fairseq_preprocess(text: str, dest: str, *extra: str) -> None:
    command = [sys.executable, "-m", "fairseq_cli.preprocess", "--only-source", "--trainpref",
               text, "--destdir", dest, "--workers", "1", *extra]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr


def _assert_one_line_error(result: subprocess.CompletedProcess, *named: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert "Traceback" not in result.stderr and "error:" in lines[-1], result.stderr
    assert sum("error:" in line for line in lines) == 1, result.stderr
    for text in named:
        assert text in lines[-1], lines[-1]


def _load(out: str) -> dict:
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@pytest.fixture(scope="module")
def gpt2_files(tmp_path_factory):
    """A tiny GPT-2 BPE in fairseq's file formats: ids 0-255 for the byte symbols, then one
    per merge, and ``vocab.bpe`` with its ``#version`` header."""
    from fairseq.data.encoders.gpt2_bpe_utils import bytes_to_unicode

    root = tmp_path_factory.mktemp("gpt2")
    encoder = {symbol: i for i, symbol in enumerate(bytes_to_unicode().values())}
    for a, b in MERGES:
        encoder[a + b] = len(encoder)
    (root / "encoder.json").write_text(json.dumps(encoder), encoding="utf-8")
    (root / "vocab.bpe").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in MERGES),
                                    encoding="utf-8")
    return str(root / "encoder.json"), str(root / "vocab.bpe")


def _documents() -> list[list[str]]:
    rng = random.Random(1)
    words = ["the", "stream", "and", "a", "storm", "ant", "sea", "order", "über", "naïve", "x"]
    return [[f"doc {i} starts"] + [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9)))
                                   for _ in range(rng.randint(1, 3))] for i in range(NUM_DOCS)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n\n".join("\n".join(doc) for doc in _documents()) + "\n", encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def gpt2_stream(corpus, gpt2_files, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("gpt2_stream") / "out")
    result = run_prep(corpus, "--out", out, "--bpe", "gpt2", "--gpt2-encoder-json",
                      gpt2_files[0], "--gpt2-vocab-bpe", gpt2_files[1], *SPLIT_FLAGS)
    assert result.returncode == 0, result.stderr
    assert "GPT-2 BPE vocabulary: 266" in result.stdout
    return out


def _encoded_text(out: str, target) -> str:
    """The stream's encoded corpus (work/encoded.*) as text: GPT-2 ids in decimal, one line per
    line, a blank line after each document; what multiprocessing_bpe_encoder.py writes."""
    from data_prep.encoded import Encoded

    with open(os.path.join(out, "dict.txt"), encoding="utf-8") as f:
        gpt2_ids = sorted({int(line.split()[0]) for line in f if not line.startswith("madeup")})
    encoded = Encoded.open(os.path.join(out, "work", "encoded"))
    lines = np.split(np.fromfile(f"{encoded.prefix}.ids", dtype=np.int32),
                     np.cumsum(np.fromfile(f"{encoded.prefix}.lens", dtype=np.int32))[:-1])
    text, start = [], 0
    for count in encoded.docs:
        text.append("".join(" ".join(str(gpt2_ids[i]) for i in line) + "\n"
                            for line in lines[start:start + count]) + "\n")
        start += count
    target.write_text("".join(text), encoding="utf-8")
    return str(target)


@pytest.fixture(scope="module")
def encoded_text(gpt2_stream, tmp_path_factory):
    return _encoded_text(gpt2_stream, tmp_path_factory.mktemp("encoded") / "encoded.txt")


def test_gpt2_tokens_are_fairseqs_gpt2_ids(gpt2_stream, gpt2_files, encoded_text):
    from fairseq.data import Dictionary, data_utils
    from fairseq.data.encoders.gpt2_bpe_utils import get_encoder

    encoder = get_encoder(*gpt2_files)
    expected = ["\n".join(" ".join(map(str, encoder.encode(line))) for line in doc)
                for doc in _documents()]
    with open(encoded_text, encoding="utf-8") as f:
        assert f.read().split("\n\n")[:-1] == expected  # what multiprocessing_bpe_encoder writes
    assert any(len(encoder.encode(" " + w)) == 1 for w in ("the", "storm", "an"))  # merges used
    # The binaries hold those ids, and decode back to the text.
    dictionary = Dictionary.load(os.path.join(gpt2_stream, "dict.txt"))
    assert all(str(i) in dictionary.indices for i in range(266))  # every GPT-2 id has a symbol
    originals, seen = {"\n".join(doc) for doc in _documents()}, []
    for name in _load(gpt2_stream)["splits"]:
        dataset = data_utils.load_indexed_dataset(os.path.join(gpt2_stream, name), dictionary)
        lines = []
        for i in range(len(dataset)):
            ids = dataset[i].tolist()[:-1]
            if not ids:
                seen.append("\n".join(lines))
                lines = []
            else:
                lines.append(encoder.decode([int(dictionary[t]) for t in ids]))
    assert sorted(seen) == sorted(originals)


def test_gpt2_manifest_records_the_tokenizer(gpt2_stream, gpt2_files):
    manifest = _load(gpt2_stream)
    tokenizer = manifest["tokenizer"]
    assert tokenizer["kind"] == "gpt2" and "sentencepiece" not in manifest
    assert tokenizer["encoder_json_sha256"] == _sha(gpt2_files[0])
    assert tokenizer["vocab_bpe_sha256"] == _sha(gpt2_files[1])
    assert tokenizer["vocab_size"] == 266 and tokenizer["merges"] == len(MERGES)
    assert not os.path.exists(os.path.join(gpt2_stream, "spm.model"))
    assert verify_stream_dir(gpt2_stream, hashes=True) == manifest
    assert "encoder_json" not in data_identity(manifest)["tokenizer"]  # where is not what


def test_gpt2_rerun_reuses_every_step(gpt2_stream, corpus, gpt2_files):
    result = run_prep(corpus, "--out", gpt2_stream, "--bpe", "gpt2", "--gpt2-encoder-json",
                      gpt2_files[0], "--gpt2-vocab-bpe", gpt2_files[1], *SPLIT_FLAGS)
    assert result.returncode == 0 and "building" not in result.stderr, result.stderr


def test_gpt2_flags_fail_with_one_line(forked_prep, corpus, gpt2_files, tmp_path):
    out = ["--out", str(tmp_path / "o")]
    encoder, vocab = gpt2_files
    _assert_one_line_error(forked_prep(corpus, *out, "--bpe", "gpt2", "--gpt2-encoder-json",
                                    encoder), "--gpt2-vocab-bpe")
    _assert_one_line_error(forked_prep(corpus, *out, "--bpe", "gpt2", "--gpt2-vocab-bpe", vocab),
                           "--gpt2-encoder-json")
    missing = str(tmp_path / "nope.json")
    _assert_one_line_error(forked_prep(corpus, *out, "--bpe", "gpt2", "--gpt2-encoder-json",
                                    missing, "--gpt2-vocab-bpe", vocab),
                           "--gpt2-encoder-json", missing)
    _assert_one_line_error(forked_prep(corpus, *out, "--gpt2-vocab-bpe", vocab), "--bpe gpt2")
    _assert_one_line_error(forked_prep(corpus, *out, "--bpe", "gpt2", "--gpt2-encoder-json",
                                    encoder, "--gpt2-vocab-bpe", vocab, "--vocab-size", "400"),
                           "--vocab-size", "--bpe gpt2")
    partial = tmp_path / "partial.json"  # lacks the id of the last merge
    with open(encoder, encoding="utf-8") as f:
        partial.write_text(json.dumps(dict(list(json.load(f).items())[:-1])), encoding="utf-8")
    _assert_one_line_error(forked_prep(corpus, *out, "--bpe", "gpt2", "--gpt2-encoder-json",
                                    str(partial), "--gpt2-vocab-bpe", vocab),
                           str(partial), "'Ġan'")
    assert not os.path.exists(tmp_path / "o" / "work" / "docs.txt")  # checked before extracting


def alma_data_prep(*args: str) -> subprocess.CompletedProcess:
    """The installed ``alma-data-prep`` console script (it imports the checkout on PYTHONPATH)."""
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "alma-data-prep"),
                           *args], capture_output=True, text=True, timeout=300, check=False)


# What fairseq's reader would make of each vocab.bpe, and the words the one error line names.
BAD_VOCAB_BPE = {
    "empty": ("", "empty"),
    "header only": ("#version: 0.2\n", "no merges"),
    "garbage": ("this is not a BPE file at all\n", "'#version' header"),
    "no header": ("".join(f"{a} {b}\n" for a, b in MERGES), "'#version' header"),
    "three symbols": ("#version: 0.2\nĠ t\nh e r\n", "line 3 is not two symbols"),
    "no final newline": ("#version: 0.2\nĠ t\nh e", "newline"),
    # The merge's result is in the encoder (Ġt + he), one of its parts is not.
    "part not in encoder": ("#version: 0.2\nĠ t\nĠth e\n", "'Ġth'"),
}


@pytest.mark.parametrize("case", sorted(BAD_VOCAB_BPE))
def test_gpt2_vocab_bpe_that_fairseq_would_misread_is_refused(case, forked_prep, corpus,
                                                              gpt2_files, tmp_path):
    """Each of these used to be accepted: the corpus encoded byte by byte (no merges), a
    merge silently dropped, or a bare KeyError in the middle of encoding."""
    text, named = BAD_VOCAB_BPE[case]
    vocab = tmp_path / "vocab.bpe"
    vocab.write_bytes(text.encode("utf-8"))
    inputs = [corpus, gpt2_files[0], str(vocab)]
    before = {path: _sha(path) for path in inputs}
    result = forked_prep(corpus, "--out", str(tmp_path / "o"), "--bpe", "gpt2",
                         "--gpt2-encoder-json", gpt2_files[0], "--gpt2-vocab-bpe", str(vocab),
                         *SPLIT_FLAGS)
    _assert_one_line_error(result, "alma-data-prep: error:", str(vocab), named)
    assert {path: _sha(path) for path in inputs} == before


@pytest.mark.parametrize("text, named", [("", "not JSON"), ("{}", "not a JSON object"),
                                         ('{"a": "1"}', "not a JSON object")])
def test_gpt2_encoder_json_that_is_empty_or_not_a_mapping_is_refused(text, named, forked_prep,
                                                                     corpus, gpt2_files,
                                                                     tmp_path):
    encoder = tmp_path / "encoder.json"
    encoder.write_text(text, encoding="utf-8")
    inputs = [corpus, str(encoder), gpt2_files[1]]
    before = {path: _sha(path) for path in inputs}
    result = forked_prep(corpus, "--out", str(tmp_path / "o"), "--bpe", "gpt2",
                         "--gpt2-encoder-json", str(encoder), "--gpt2-vocab-bpe", gpt2_files[1],
                         *SPLIT_FLAGS)
    _assert_one_line_error(result, "alma-data-prep: error:", str(encoder), named)
    assert {path: _sha(path) for path in inputs} == before


def _reseparated(encoded: str, target) -> str:
    """Our encoded text with two blank lines between documents and none after the last: the
    same documents, as a user's file might separate them."""
    with open(encoded, encoding="utf-8") as f:
        docs = f.read().split("\n\n")[:-1]
    target.write_text("\n\n\n".join(docs) + "\n", encoding="utf-8")
    return str(target)


@pytest.mark.parametrize("reseparate", [False, True])
def test_from_binarized_gives_the_text_paths_shards(gpt2_stream, encoded_text, tmp_path,
                                                    reseparate):
    encoded = encoded_text
    if reseparate:
        encoded = _reseparated(encoded, tmp_path / "encoded.txt")
    data_bin = str(tmp_path / "bin")
    fairseq_preprocess(encoded, data_bin, "--srcdict", os.path.join(gpt2_stream, "dict.txt"))
    out = str(tmp_path / "cut")
    result = run_prep("--from-binarized", data_bin, "--out", out, *SPLIT_FLAGS)
    assert result.returncode == 0, result.stderr
    manifest, text_manifest = _load(out), _load(gpt2_stream)
    assert manifest["splits"] == text_manifest["splits"]  # sizes, counts and sha256 of shards
    assert manifest["dictionary"] == text_manifest["dictionary"]
    assert manifest["tokenizer"] == {"kind": "from-binarized", "source": data_bin,
                                     "dict_sha256": _sha(os.path.join(data_bin, "dict.txt"))}
    assert verify_stream_dir(out, hashes=True) == manifest
    again = run_prep("--from-binarized", data_bin, "--out", out, *SPLIT_FLAGS)
    assert again.returncode == 0 and "building" not in again.stderr, again.stderr
    if reseparate:
        return
    # A shard corrected in place with its size and mtime kept (cp -p, rsync -a) is cut again:
    # its ctime moved. Keyed on size and mtime alone, the stale cut was reused.
    from fairseq.data.indexed_dataset import MMapIndexedDataset
    dtype = MMapIndexedDataset(os.path.join(data_bin, "train"))._index.dtype
    train_bin = os.path.join(data_bin, "train.bin")
    before = os.stat(train_bin)
    tokens = np.fromfile(train_bin, dtype=dtype)
    i = next(i for i in range(len(tokens) - 1)
             if tokens[i] != tokens[i + 1] and min(tokens[i], tokens[i + 1]) > 3)
    tokens[[i, i + 1]] = tokens[[i + 1, i]]
    time.sleep(0.05)  # past the file system's timestamp granularity
    tokens.tofile(train_bin)
    os.utime(train_bin, ns=(before.st_atime_ns, before.st_mtime_ns))
    edited = run_prep("--from-binarized", data_bin, "--out", out, *SPLIT_FLAGS)
    assert edited.returncode == 0 and "building" in edited.stderr, edited.stderr
    assert _load(out)["splits"] != manifest["splits"]


def test_from_binarized_periods_give_the_text_paths_shards(corpus, gpt2_files, encoded_text,
                                                          tmp_path):
    """--order given and --eval-per-megabatch cut a data-bin as they cut the text."""
    periods = ["--order", "given", "--eval-per-megabatch", "0.2", "-B", "3"]
    text_out = str(tmp_path / "text")
    result = run_prep(corpus, "--out", text_out, "--bpe", "gpt2", "--gpt2-encoder-json",
                      gpt2_files[0], "--gpt2-vocab-bpe", gpt2_files[1], *SPLIT_FLAGS, *periods)
    assert result.returncode == 0, result.stderr
    data_bin = str(tmp_path / "bin")
    fairseq_preprocess(encoded_text, data_bin, "--srcdict", os.path.join(text_out, "dict.txt"))
    out = str(tmp_path / "cut")
    result = run_prep("--from-binarized", data_bin, "--out", out, *SPLIT_FLAGS, *periods)
    assert result.returncode == 0, result.stderr
    manifest, text_manifest = _load(out), _load(text_out)
    assert [name for name in manifest["splits"] if name.startswith("evalmb")] == \
        ["evalmb0", "evalmb1", "evalmb2"]
    assert manifest["splits"] == text_manifest["splits"]  # sizes, counts and sha256 of shards
    assert (manifest["order"], manifest["eval_per_megabatch"]) == ("given", "0.2")
    assert verify_stream_dir(out, hashes=True) == manifest


def _split_documents(out: str, name: str) -> list[tuple[str, ...]]:
    """A split's documents as tuples of lines of symbols (dictionary-independent)."""
    from fairseq.data import Dictionary, data_utils

    dictionary = Dictionary.load(os.path.join(out, "dict.txt"))
    dataset = data_utils.load_indexed_dataset(os.path.join(out, name), dictionary)
    docs, lines = [], []
    for i in range(len(dataset)):
        ids = dataset[i].tolist()[:-1]
        if ids:
            lines.append(dictionary.string(np.array(ids)))
        else:
            docs.append(tuple(lines))
            lines = []
    return docs


def test_from_binarized_keeps_the_data_bins_own_dictionary(gpt2_stream, encoded_text, tmp_path):
    data_bin = str(tmp_path / "bin")
    fairseq_preprocess(encoded_text, data_bin)
    out = str(tmp_path / "cut")
    result = run_prep("--from-binarized", data_bin, "--out", out, *SPLIT_FLAGS, "-B", "2")
    assert result.returncode == 0, result.stderr
    assert _sha(os.path.join(out, "dict.txt")) == _sha(os.path.join(data_bin, "dict.txt"))
    # Other ids, same documents: compare with the cut of a data-bin made with our dictionary.
    reference = str(tmp_path / "ref")
    fairseq_preprocess(encoded_text, reference, "--srcdict",
                       os.path.join(gpt2_stream, "dict.txt"))
    cut_ref = str(tmp_path / "cut_ref")
    assert run_prep("--from-binarized", reference, "--out", cut_ref, *SPLIT_FLAGS,
                    "-B", "2").returncode == 0
    for name in _load(out)["splits"]:
        assert _split_documents(out, name) == _split_documents(cut_ref, name), name
        assert _load(out)["splits"][name]["tokens"] == _load(cut_ref)["splits"][name]["tokens"]


def test_from_binarized_errors_name_the_path_and_the_next_step(forked_prep, encoded_text, corpus,
                                                              tmp_path):
    data_bin = tmp_path / "bin"
    fairseq_preprocess(encoded_text, str(data_bin))
    out = ["--out", str(tmp_path / "o")]
    _assert_one_line_error(forked_prep("--from-binarized", str(data_bin), corpus, *out), "INPUT")
    _assert_one_line_error(forked_prep("--from-binarized", str(data_bin), "--bpe", "gpt2", *out),
                           "--bpe")
    _assert_one_line_error(forked_prep("--from-binarized", str(data_bin), "--no-byte-fallback",
                                    *out), "--byte-fallback", "--from-binarized")
    _assert_one_line_error(forked_prep("--from-binarized", str(tmp_path / "none"), *out),
                           "--from-binarized", "fairseq-preprocess")

    small = tmp_path / "small"  # a dictionary with fewer symbols than the binaries use
    small.mkdir()
    for name in ("train.bin", "train.idx"):
        (small / name).write_bytes((data_bin / name).read_bytes())
    (small / "dict.txt").write_text("5 1\n", encoding="utf-8")
    _assert_one_line_error(forked_prep("--from-binarized", str(small), *out),
                           str(small / "train.bin"), "dict.txt")

    (data_bin / "train.bin").unlink()
    _assert_one_line_error(forked_prep("--from-binarized", str(data_bin), *out),
                           str(data_bin / "train.bin"), "fairseq-preprocess")
    (data_bin / "dict.txt").unlink()
    _assert_one_line_error(forked_prep("--from-binarized", str(data_bin), *out),
                           str(data_bin / "dict.txt"))


def _tree(path: str) -> dict[str, str]:
    return {os.path.join(d, f): _sha(os.path.join(d, f)) for d, _, names in os.walk(path)
            for f in names}


def test_from_binarized_never_replaces_another_stream_or_takes_an_absurd_b(
        forked_prep, gpt2_stream, gpt2_files, corpus, encoded_text, tmp_path):
    data_bin = str(tmp_path / "bin")
    fairseq_preprocess(encoded_text, data_bin)
    watched = {path: _tree(path) for path in (data_bin, gpt2_stream)}
    fresh = str(tmp_path / "fresh")
    _assert_one_line_error(forked_prep("--from-binarized", data_bin, "--out", fresh,
                                          "-B", str(10**12)),
                           "--num-megabatches 1000000000000", data_bin, "lower it")
    assert not os.path.exists(fresh)
    # The text route's stream is another stream for the binarized route, and back.
    _assert_one_line_error(forked_prep("--from-binarized", data_bin, "--out", gpt2_stream,
                                          *SPLIT_FLAGS),
                           f"--out {gpt2_stream} holds another stream", corpus, "--clean")
    cut = str(tmp_path / "cut")
    assert alma_data_prep("--from-binarized", data_bin, "--out", cut, *SPLIT_FLAGS,
                          "-B", "2").returncode == 0
    watched[cut] = _tree(cut)
    _assert_one_line_error(forked_prep(corpus, "--out", cut, "--bpe", "gpt2",
                                          "--gpt2-encoder-json", gpt2_files[0],
                                          "--gpt2-vocab-bpe", gpt2_files[1], *SPLIT_FLAGS),
                           f"--out {cut} holds another stream", f"--from-binarized {data_bin}")
    assert {path: _tree(path) for path in watched} == watched
    again = alma_data_prep("--from-binarized", data_bin, "--out", cut, *SPLIT_FLAGS, "-B", "2")
    assert again.returncode == 0 and "building" not in again.stderr, again.stderr


def test_from_binarized_reads_train1_after_train(gpt2_stream, encoded_text, tmp_path):
    """fairseq's ``combine`` reads train, train1, ...: a data-bin split in two cuts as one."""
    with open(encoded_text, encoding="utf-8") as f:
        docs = f.read().split("\n\n")[:-1]
    halves = [tmp_path / "first.txt", tmp_path / "second.txt"]
    for half, part in zip(halves, (docs[:11], docs[11:])):
        half.write_text("".join(doc + "\n\n" for doc in part), encoding="utf-8")
    srcdict = ["--srcdict", os.path.join(gpt2_stream, "dict.txt")]
    two = tmp_path / "two"
    fairseq_preprocess(str(halves[0]), str(two), *srcdict)
    fairseq_preprocess(str(halves[1]), str(tmp_path / "other"), *srcdict)
    for ext in ("bin", "idx"):
        os.replace(tmp_path / "other" / f"train.{ext}", two / f"train1.{ext}")
    out = str(tmp_path / "cut")
    result = run_prep("--from-binarized", str(two), "--out", out, *SPLIT_FLAGS)
    assert result.returncode == 0, result.stderr
    assert _load(out)["splits"] == _load(gpt2_stream)["splits"]
    assert [os.path.basename(s["path"]) for s in _load(out)["sources"]] == \
        ["train.bin", "train.idx", "train1.bin", "train1.idx"]


def _gpt2_flags(gpt2_files) -> list[str]:
    return ["--bpe", "gpt2", "--gpt2-encoder-json", gpt2_files[0], "--gpt2-vocab-bpe",
            gpt2_files[1], *SPLIT_FLAGS]


def test_repeated_documents_are_dropped_before_the_split(forked_prep, corpus, gpt2_files,
                                                        gpt2_stream, tmp_path):
    """A third of the corpus again, in another file and with other whitespace, adds only
    repeats: they are dropped and the stream is the corpus's own, byte for byte, so no copy can
    sit in the evaluation mega-batch and in a training one at once. --keep-duplicates keeps
    them, and says what that risks."""
    copies = _documents()[::3]
    again = tmp_path / "again.txt"
    again.write_text("\n\n\n".join("\n".join("  " + line.replace(" ", "\t") for line in doc)
                                   for doc in copies) + "\n", encoding="utf-8")
    out = str(tmp_path / "dropped")
    result = forked_prep(corpus, str(again), "--out", out, *_gpt2_flags(gpt2_files))
    assert result.returncode == 0, result.stderr
    assert f"dropped {len(copies)} of {NUM_DOCS + len(copies)} documents" in result.stderr
    assert _load(out)["repeated_documents"] == {"count": len(copies), "dropped": True}
    assert _load(out)["splits"] == _load(gpt2_stream)["splits"]
    kept = str(tmp_path / "kept")
    result = forked_prep(corpus, str(again), "--out", kept, "--keep-duplicates",
                         *_gpt2_flags(gpt2_files))
    assert result.returncode == 0, result.stderr
    assert "warning:" in result.stderr and "lowers the evaluation perplexity" in result.stderr
    manifest = _load(kept)
    assert manifest["repeated_documents"] == {"count": len(copies), "dropped": False}
    assert sum(s["documents"] for s in manifest["splits"].values()) == NUM_DOCS + len(copies)
    # --verify counts, from the binaries, the held-out documents that training also holds
    for stream in (out, kept):
        verified = forked_prep("--verify", stream)
        assert verified.returncode == 0, verified.stderr
        shared, any_shared = _shared_held_out_documents(stream)
        assert f"also in a training mega-batch: {shared}\n" in verified.stdout, verified.stdout
        assert ("warning:" in verified.stdout) == any_shared == (stream == kept), shared


def test_a_stream_that_kept_repeats_is_named_when_a_task_opens_it(caplog, tmp_path):
    from omegaconf import OmegaConf
    from test_sweep import write_stream_skeleton

    from fairseq_alma.tasks.alma_stream import AlmaStreamConfig, AlmaStreamTask

    write_stream_skeleton(tmp_path / "data")
    manifest = _load(str(tmp_path / "data"))
    for repeats, warned in [({"count": 3, "dropped": False}, True),
                            ({"count": 3, "dropped": True}, False), (None, False)]:
        (tmp_path / "data" / "manifest.json").write_text(json.dumps(
            {**manifest, "repeated_documents": repeats}))
        caplog.clear()
        AlmaStreamTask.setup_task(OmegaConf.structured(AlmaStreamConfig(data=str(tmp_path /
                                                                                "data"))))
        assert ("3 documents that repeat an earlier one were kept" in caplog.text) == warned


def _shared_held_out_documents(stream: str) -> tuple[str, bool]:
    """The reference count, on fairseq's own reader: the documents of each split as tuples of
    token ids (items up to an end-of-sentence-only separator), held-out ones in training."""
    from fairseq.data.indexed_dataset import MMapIndexedDataset

    def documents(name: str) -> list[tuple[int, ...]]:
        data, docs, doc = MMapIndexedDataset(os.path.join(stream, name)), [], []
        for i in range(len(data)):
            item = data[i].tolist()
            if len(item) == 1:
                docs.append(tuple(doc))
                doc = []
            else:
                doc += item
        return docs

    megabatches = _load(stream)["num_megabatches"]
    training = {doc for k in range(megabatches) for doc in documents(f"megabatch{k}")}
    counts = {name: (sum(doc in training for doc in documents(name)), len(documents(name)))
              for name in ("eval", "valid")}
    return (", ".join(f"{name} {shared} of {total}" for name, (shared, total) in counts.items()),
            any(shared for shared, _ in counts.values()))


def test_from_binarized_drops_repeated_documents(forked_prep, gpt2_stream, encoded_text,
                                                 tmp_path):
    """The same on token ids: a data-bin whose last documents repeat its first ones cuts into
    the stream of the data-bin without them."""
    with open(encoded_text, encoding="utf-8") as f:
        docs = f.read().split("\n\n")[:-1]
    text = tmp_path / "repeated.txt"
    text.write_text("".join(doc + "\n\n" for doc in docs + docs[:5]), encoding="utf-8")
    data_bin = str(tmp_path / "bin")
    fairseq_preprocess(str(text), data_bin, "--srcdict", os.path.join(gpt2_stream, "dict.txt"))
    out = str(tmp_path / "cut")
    result = forked_prep("--from-binarized", data_bin, "--out", out, *SPLIT_FLAGS)
    assert result.returncode == 0, result.stderr
    assert _load(out)["repeated_documents"] == {"count": 5, "dropped": True}
    assert _load(out)["splits"] == _load(gpt2_stream)["splits"]
    kept = str(tmp_path / "kept")
    result = forked_prep("--from-binarized", data_bin, "--out", kept, "--keep-duplicates",
                         *SPLIT_FLAGS)
    assert result.returncode == 0, result.stderr
    assert sum(s["documents"] for s in _load(kept)["splits"].values()) == NUM_DOCS + 5


def _write_data_bin(root, num_docs: int = 30) -> str:
    """A data-bin as fairseq-preprocess --only-source writes it (dict.txt, train.bin/.idx in
    the mmap format: uint16 ids, a line per item ending in </s> = 2, an item of only </s>
    after each document), written here without the seconds fairseq-preprocess costs."""
    rng = random.Random(2)
    root.mkdir()
    (root / "dict.txt").write_text("".join(f"w{i} {100 - i}\n" for i in range(20)))
    items = []
    for _ in range(num_docs):
        items += [[rng.randrange(4, 24) for _ in range(rng.randint(3, 8))] + [2]
                  for _ in range(rng.randint(1, 3))] + [[2]]
    sizes = np.array([len(item) for item in items], dtype=np.int32)
    (root / "train.bin").write_bytes(np.array(sum(items, []), dtype=np.uint16).tobytes())
    pointers = np.concatenate([[0], np.cumsum(sizes[:-1], dtype=np.int64) * 2])
    header = b"MMIDIDX\x00\x00" + struct.pack("<QBQ", 1, 8, len(sizes))
    (root / "train.idx").write_bytes(header + sizes.tobytes() + pointers.tobytes())
    return str(root)


def test_from_binarized_refused_rerun_and_damaged_shards(forked_prep, tmp_path):
    """A re-run whose split is refused withdrew the finished stream's manifest first; a
    truncated train.idx was fairseq's ValueError traceback; train1.idx without its .bin was
    called 'not mmap'."""
    data_bin = _write_data_bin(tmp_path / "bin")
    cut = str(tmp_path / "cut")
    flags = ["--valid-size", "0.1", "-B", "2"]
    made = forked_prep("--from-binarized", data_bin, "--out", cut, *flags)
    assert made.returncode == 0, made.stderr
    before = _tree(cut)
    _assert_one_line_error(forked_prep("--from-binarized", data_bin, "--out", cut, *flags,
                                       "--valid-size", "50k"), "--valid-size (50,000 tokens)")
    assert _tree(cut) == before
    verify_stream_dir(cut, hashes=True)

    out = ["--out", str(tmp_path / "o"), *flags]
    truncated = tmp_path / "truncated"
    shutil.copytree(data_bin, truncated)
    (truncated / "train.idx").write_bytes((truncated / "train.idx").read_bytes()[:40])
    _assert_one_line_error(forked_prep("--from-binarized", str(truncated), *out),
                           f"{truncated / 'train.idx'}: truncated (40 bytes",
                           "re-run fairseq-preprocess")
    for present, missing in (("idx", "bin"), ("bin", "idx")):
        half = tmp_path / f"train1_{present}"
        shutil.copytree(data_bin, half)
        shutil.copy(half / f"train.{present}", half / f"train1.{present}")
        _assert_one_line_error(forked_prep("--from-binarized", str(half), *out),
                               f"{half / f'train1.{missing}'}: missing, while "
                               f"{half / f'train1.{present}'} is there")
    assert not os.path.exists(tmp_path / "o")
