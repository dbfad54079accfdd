"""End-to-end tests of ``alma-data-prep`` through its console script, on a tiny corpus.

The corpus (60 documents, each opening with a unique "doc N begins" line) is spread over a
plain file, a .gz file and a directory tree with a hidden file that must be skipped.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable

import numpy as np
import pytest

from fairseq_alma.errors import DataError
from fairseq_alma.stream.manifest import verify_stream_dir

pytestmark = pytest.mark.slow

NUM_DOCS = 60
FLAGS = ["--vocab-size", "400", "--valid-size", "0.1"]
ARGS = [*FLAGS, "--seed", "3"]
TRAIN = [f"megabatch{k}" for k in range(4)]


def _cli(name: str) -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), name)
    module = {"alma-data-prep": "data_prep.cli", "alma-demo-corpus": "data_prep.demo_corpus"}
    return [script] if os.path.exists(script) else [sys.executable, "-m", module[name]]


def run_prep(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*_cli("alma-data-prep"), *args], capture_output=True, text=True,
                          timeout=300, check=False)


def _documents() -> list[list[str]]:
    rng = random.Random(0)
    syllables = ["ka", "lo", "mi", "ne", "ru", "ta", "shi", "po", "gen", "dar", "vel", "quo"]
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 3))) for _ in range(150)]
    docs = []
    for i in range(NUM_DOCS):
        lines = [f"doc {i} begins"]
        for _ in range(rng.randint(2, 4)):
            lines.append(" ".join(rng.choice(words) for _ in range(rng.randint(4, 10))) + ".")
        docs.append(lines)
    return docs


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    text = ["\n".join(doc) for doc in _documents()]
    (root / "a.txt").write_text("\n\n".join(text[:20]) + "\n")
    with gzip.open(root / "b.txt.gz", "wt", encoding="utf-8") as f:
        f.write("\n\n\n".join(text[20:40]))
    (root / "d" / "sub").mkdir(parents=True)
    (root / "d" / "c.txt").write_text("\n\n".join(text[40:50]))
    # Whitespace-only separator lines and messy spacing inside lines are normalised.
    (root / "d" / "sub" / "e.txt").write_text("\n \t\n".join(t.replace(" ", "  \t") for t in
                                                            text[50:60]))
    (root / "d" / ".hidden").write_text("a hidden file is not part of the corpus\n")
    return [str(root / "a.txt"), str(root / "b.txt.gz"), str(root / "d")]


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prep") / "stream")
    result = run_prep(*corpus, "--out", out, *ARGS)
    assert result.returncode == 0, result.stderr
    return out, result


def _load(out: str) -> dict:
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def _decoded_documents(out: str, split: str) -> list[str]:
    """Read a split back through fairseq's own loader; return its documents as text."""
    from fairseq.data import Dictionary, data_utils

    dictionary = Dictionary.load(os.path.join(out, "dict.txt"))
    dataset = data_utils.load_indexed_dataset(os.path.join(out, split), dictionary)
    docs, lines = [], []
    for i in range(len(dataset)):
        ids = dataset[i].tolist()
        assert ids[-1] == dictionary.eos()
        if len(ids) == 1:  # an empty line: the document separator
            docs.append("\n".join(lines))
            lines = []
        else:
            lines.append("".join(dictionary[t] for t in ids[:-1]).replace("\u2581", " ").strip())
    assert not lines, "a split must end with a document separator"
    return docs


def test_manifest_describes_the_stream(prepared, corpus):
    out, result = prepared
    manifest = _load(out)
    assert manifest["format"] == "alma-lm-stream/1" and manifest["kind"] == "lm"
    assert manifest["num_megabatches"] == 4 and manifest["seed"] == 3
    assert list(manifest["splits"]) == [*TRAIN, "eval", "valid"]
    assert sum(s["documents"] for s in manifest["splits"].values()) == NUM_DOCS
    for name, split in manifest["splits"].items():
        assert split["bin_bytes"] == os.path.getsize(os.path.join(out, f"{name}.bin"))
        assert split["idx_bytes"] == os.path.getsize(os.path.join(out, f"{name}.idx"))
        assert split["unk_tokens"] == 0
    files = [os.path.basename(s["path"]) for s in manifest["sources"]]
    assert files == ["a.txt", "b.txt.gz", "c.txt", "e.txt"]  # sorted walk, hidden skipped
    assert all(s["bytes"] == os.path.getsize(s["path"]) for s in manifest["sources"])
    assert manifest["sentencepiece"]["vocab_size"] == 400
    assert manifest["dictionary"]["size"] % 8 == 0
    assert manifest["options"]["valid_size"] == "0.1" and manifest["options"]["workers"] == 1
    assert manifest["command"].startswith("alma-data-prep ") and "--seed 3" in manifest["command"]
    assert manifest["inputs"] == [os.path.realpath(path) for path in corpus]  # what --out holds
    assert verify_stream_dir(out) == manifest
    assert "megabatch0" in result.stdout and "total" in result.stdout  # the summary table


# sha256 over every shard's recorded sha256, and of dict.txt, for ARGS on this corpus: written
# before --bpe gpt2 and --from-binarized were added, which must leave the default path alone.
# (A sentencepiece or fairseq upgrade that changes them needs a look, then new values.)
PINNED_SHARDS = "9d76073c5486157ab498026b3b33e3c0dcfe443116701266c67c6cc92ddeac18"
PINNED_DICT = "5f25ea26c81d1cce2baf3ce867ca336a233bfb81dbabd729634967345992387a"
# spm.model too: it stores the trainer's spec, so an option passed with its default value (as
# max_sentence_length once was, to count the lines it skips) changes the model's bytes and, by
# its sha256 in the encode key, every stream prepared after it.
PINNED_SPM = "74ce4b970ac71a3454f9fea7db2660eb3a472a357c02fa221241508c294b90c8"


def test_default_sentencepiece_outputs_are_unchanged(prepared):
    manifest = _load(prepared[0])
    shards = {name: [s["bin_sha256"], s["idx_sha256"]] for name, s in manifest["splits"].items()}
    digest = hashlib.sha256(json.dumps(shards, sort_keys=True).encode()).hexdigest()
    assert (digest, manifest["dictionary"]["sha256"]) == (PINNED_SHARDS, PINNED_DICT)
    assert manifest["sentencepiece"]["sha256"] == PINNED_SPM
    assert "tokenizer" not in manifest and manifest["options"]["bpe"] == "sentencepiece"


def test_binaries_round_trip_every_document_once(prepared):
    out, _ = prepared
    from fairseq.data import Dictionary, data_utils

    manifest = _load(out)
    dictionary = Dictionary.load(os.path.join(out, "dict.txt"))
    assert len(dictionary) == manifest["dictionary"]["size"]
    originals = {"\n".join(doc) for doc in _documents()}
    seen: dict[str, str] = {}
    for name, split in manifest["splits"].items():
        dataset = data_utils.load_indexed_dataset(os.path.join(out, name), dictionary)
        assert int(dataset.sizes.sum()) == split["tokens"] and len(dataset) == split["lines"]
        docs = _decoded_documents(out, name)
        assert len(docs) == split["documents"]
        for doc in docs:
            assert doc in originals, doc  # the text survives BPE + binarization intact
            assert doc not in seen, f"{doc[:20]} in {seen.get(doc)} and {name}"
            seen[doc] = name
    assert len(seen) == NUM_DOCS


def test_megabatches_have_equal_tokens_within_one_document(prepared):
    out, _ = prepared
    manifest = _load(out)
    longest = max(max(_doc_tokens(out, name)) for name in manifest["splits"])
    train = [manifest["splits"][name]["tokens"] for name in TRAIN]
    for tokens in train:
        assert abs(tokens - sum(train) / 4) <= longest
    # The default --eval-size: as large as one training mega-batch (paper §5).
    eval_tokens = manifest["splits"]["eval"]["tokens"]
    assert abs(eval_tokens - (sum(train) + eval_tokens) / 5) <= longest
    total = sum(s["tokens"] for s in manifest["splits"].values())
    assert abs(manifest["splits"]["valid"]["tokens"] - 0.1 * total) <= longest


def _doc_tokens(out: str, split: str) -> list[int]:
    from fairseq.data import data_utils

    dataset = data_utils.load_indexed_dataset(os.path.join(out, split), None, "mmap")
    counts, current = [], 0
    for size in dataset.sizes.tolist():  # sizes views the dataset's mmap: keep it referenced
        current += size
        if size == 1:
            counts.append(current)
            current = 0
    return counts


def _binary_outputs(out: str) -> dict[str, bytes]:
    names = sorted(f for f in os.listdir(out) if f.endswith((".bin", ".idx", ".txt", ".model",
                                                             ".vocab")))
    return {name: open(os.path.join(out, name), "rb").read() for name in names}


def test_same_seed_gives_identical_outputs_whatever_the_workers(prepared, corpus, tmp_path):
    out, _ = prepared
    other = str(tmp_path / "again")
    result = run_prep(*corpus, "--out", other, *ARGS, "--workers", "2")
    assert result.returncode == 0, result.stderr
    assert _binary_outputs(other) == _binary_outputs(out)
    assert _load(other)["splits"] == _load(out)["splits"]


def test_rerun_reuses_and_changed_flags_rebuild_only_what_depends_on_them(
        prepared, corpus, tmp_path):
    out, _ = prepared
    mtimes = {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in os.listdir(out)
              if f != "manifest.json"}
    again = run_prep(*corpus, "--out", out, *ARGS)
    assert again.returncode == 0, again.stderr
    assert "building" not in again.stderr and again.stderr.count("up to date, reused") == 6
    assert mtimes == {f: os.stat(os.path.join(out, f)).st_mtime_ns for f in mtimes}

    changed = str(tmp_path / "changed")
    shutil.copytree(out, changed)
    args = [*corpus, "--out", changed, *FLAGS, "--seed", "4", "--num-megabatches", "3", "--clean"]
    result = run_prep(*args)
    assert result.returncode == 0, result.stderr
    for step in ("extract", "sentencepiece", "encode"):
        assert f"{step}: up to date, reused" in result.stderr
    for step in ("split", "dictionary", "binarize"):
        assert f"{step}: building" in result.stderr
    assert _load(changed)["num_megabatches"] == 3 and _load(changed)["seed"] == 4
    assert not os.path.exists(os.path.join(changed, "megabatch3.bin"))  # stale shard removed
    assert not os.path.exists(os.path.join(changed, "work"))  # --clean
    # The validation set is carved first with the same target: only the seed moved documents.
    assert set(_decoded_documents(changed, "valid")) != set(_decoded_documents(out, "valid"))
    verify_stream_dir(changed)
    # After --clean, the same command still reuses every step (stamps outlive work/).
    rerun = run_prep(*args)
    assert rerun.returncode == 0 and "building" not in rerun.stderr, rerun.stderr


@pytest.fixture
def stream_copy(prepared, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(prepared[0], copy)
    return copy


@pytest.mark.parametrize("damage, named", [
    (lambda d: (d / "dict.txt").open("a").write("extra 1\n"), "dict.txt"),
    (lambda d: (d / "megabatch2.idx").unlink(), "megabatch2.idx"),
    (lambda d: os.truncate(d / "eval.bin", 10), "eval.bin"),
    (lambda d: (d / "manifest.json").unlink(), "manifest.json"),
    (lambda d: (d / "manifest.json").write_text("{not json"), "manifest.json"),
    (lambda d: (d / "manifest.json").write_text('{"format": "alma-lm-stream/1"}'),
     "manifest.json"),
])
def test_verify_stream_dir_names_the_damaged_file(stream_copy, damage, named):
    verify_stream_dir(str(stream_copy))
    damage(stream_copy)
    with pytest.raises(DataError) as info:
        verify_stream_dir(str(stream_copy))
    message = str(info.value)
    assert named in message and "\n" not in message


def _assert_one_line_error(result: subprocess.CompletedProcess, *named: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and result.stderr.splitlines()[-1] == errors[0], result.stderr
    for text in named:
        assert text in errors[0], errors[0]


@pytest.mark.parametrize("extra, named", [
    (["--num-megabatches", "0"], ["--num-megabatches"]),
    (["--eval-size", "1.5"], ["--eval-size"]),
    (["--valid-size", "0.6", "--eval-size", "0.5"], ["--valid-size", "--eval-size"]),
    (["--workers", "two"], ["--workers"]),
])
def test_bad_flags_fail_upfront_with_one_line(forked_prep, corpus, tmp_path, extra, named):
    result = forked_prep(*corpus, "--out", str(tmp_path / "o"), *extra)
    _assert_one_line_error(result, *named)
    assert len(result.stderr.splitlines()) == 1


def test_bad_inputs_fail_with_one_line_naming_the_file(forked_prep, corpus, tmp_path):
    missing = str(tmp_path / "nope.txt")
    _assert_one_line_error(forked_prep(missing, "--out", str(tmp_path / "o")), missing)

    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    _assert_one_line_error(forked_prep(*corpus, str(latin1), "--out", str(tmp_path / "o")),
                           str(latin1), "UTF-8")

    shard = tmp_path / "train.bin"  # token ids below 128 as uint16: valid UTF-8, yet binary
    shard.write_bytes(np.array([5, 17, 2, 9, 2], dtype=np.uint16).tobytes())
    _assert_one_line_error(forked_prep(*corpus, str(shard), "--out", str(tmp_path / "o")),
                           str(shard), "binary", "--from-binarized")

    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n\n")
    _assert_one_line_error(forked_prep(str(blank), "--out", str(tmp_path / "o")), "no text")

    inside = os.path.join(corpus[2], "out")
    _assert_one_line_error(forked_prep(corpus[2], "--out", inside), "--out")


@pytest.mark.parametrize("extra, named", [
    (["--num-megabatches", "59"], ["--num-megabatches", "60 documents"]),
    (["--valid-size", "2k", "--eval-size", "2k"], ["--valid-size", "--eval-size"]),
    (["--vocab-size", "100000"], ["--vocab-size"]),
    (["--vocab-size", "100"], ["--vocab-size"]),
])
def test_corpus_too_small_for_the_flags_fails_with_one_line(forked_prep, corpus, tmp_path, extra,
                                                            named):
    args = [*corpus, "--out", str(tmp_path / "o"), "--vocab-size", "400", *extra]
    _assert_one_line_error(forked_prep(*args), *named)


def _tree(*paths) -> dict[str, str]:
    """sha256 of every file (hidden ones too) at or under ``paths``: what must not change."""
    files = []
    for path in map(str, paths):
        files += [path] if os.path.isfile(path) else \
            [os.path.join(d, f) for d, _, names in os.walk(path) for f in names]
    return {f: hashlib.sha256(open(f, "rb").read()).hexdigest() for f in sorted(files)}


def _refused_and_unchanged(prep: Callable[..., subprocess.CompletedProcess], args: list[str],
                           watched: list, *named: str) -> None:
    """``prep(*args)`` fails with one line naming ``named`` and leaves ``watched`` as it was."""
    before = _tree(*watched)
    _assert_one_line_error(prep(*args), *named)
    assert _tree(*watched) == before


def test_out_holding_another_stream_is_refused_unless_clean(forked_prep, prepared, corpus,
                                                            tmp_path):
    theirs = str(tmp_path / "theirs")
    shutil.copytree(prepared[0], theirs)
    other = tmp_path / "other.txt"
    other.write_text("another corpus\n\nof two documents\n")
    for inputs in ([str(other)], corpus[:2]):  # other text; some of the same text is another too
        _refused_and_unchanged(forked_prep, [*inputs, "--out", theirs, *ARGS],
                               [theirs, *corpus, other],
                               f"--out {theirs} holds another stream", corpus[0], "--clean")
    # A manifest from before "inputs" was recorded: the files it read say which stream it is.
    manifest = _load(theirs)
    del manifest["inputs"]
    with open(os.path.join(theirs, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(manifest, f)
    _refused_and_unchanged(forked_prep, [str(other), "--out", theirs, *ARGS],
                           [theirs, *corpus, other],
                           "holds another stream", "--clean")
    same = run_prep(*corpus, "--out", theirs, *ARGS)  # the same command: a re-run
    assert same.returncode == 0 and "building" not in same.stderr, same.stderr

    # --clean replaces it: here with a copy of the corpus elsewhere (other paths, same text).
    copy = tmp_path / "copy"
    shutil.copytree(os.path.dirname(corpus[0]), copy)
    moved = [str(copy / os.path.basename(path)) for path in corpus]
    _refused_and_unchanged(forked_prep, [*moved, "--out", theirs, *ARGS], [theirs],
                           "holds another stream")
    replaced = run_prep(*moved, "--out", theirs, *ARGS, "--clean")
    assert replaced.returncode == 0, replaced.stderr
    assert _load(theirs)["inputs"] == [os.path.realpath(path) for path in moved]
    assert not os.path.exists(os.path.join(theirs, "work"))  # --clean as documented


def test_out_that_is_a_file_or_holds_other_files_is_refused(forked_prep, corpus, tmp_path):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine\n")
    for out in (a_file, a_file / "stream"):
        _refused_and_unchanged(forked_prep, [*corpus, "--out", str(out), *ARGS], [a_file, *corpus],
                               f"--out {out}", f"{a_file} is" if out != a_file else "a directory")
    mine = tmp_path / "mine"  # a directory that is no stream: outputs would mix with (and
    (mine / "work").mkdir(parents=True)  # --clean, remove_stale_megabatches delete) its files
    (mine / "work" / "draft.txt").write_text("mine\n")
    (mine / "megabatch-notes.txt").write_text("mine\n")
    for clean in ([], ["--clean"]):
        _refused_and_unchanged(forked_prep, [*corpus, "--out", str(mine), *ARGS, *clean],
                               [mine, *corpus],
                               f"--out {mine} holds files that are not an alma-data-prep stream",
                               "megabatch-notes.txt")


def test_absurd_num_megabatches_is_refused_before_any_work(forked_prep, prepared, corpus, tmp_path):
    """B = 10**12 used to end in a MemoryError after creating --out; B beyond the inputs' bytes
    (.gz at deflate's largest expansion) can never find a document per mega-batch."""
    fresh = tmp_path / "fresh"
    absurd = ["--num-megabatches", str(10**12)]
    _refused_and_unchanged(forked_prep, [*corpus, "--out", str(fresh), *ARGS, *absurd], corpus,
                           "--num-megabatches 1000000000000", "can hold at most", "lower it")
    assert not os.path.exists(fresh)
    theirs = str(tmp_path / "theirs")
    shutil.copytree(prepared[0], theirs)
    _refused_and_unchanged(forked_prep, [*corpus, "--out", theirs, *ARGS, *absurd,
                                         "--eval-per-megabatch", "0.1"],
                           [theirs, *corpus], "2,000,000,000,002 documents")
    plain = [path for path in corpus if path.endswith(".txt")]  # no .gz: at most its bytes
    size = os.path.getsize(plain[0])
    _refused_and_unchanged(forked_prep, [plain[0], "--out", str(fresh), *ARGS, "--num-megabatches",
                            str(size + 1)], plain, f"({size:,} bytes) can hold at most {size:,}")
    assert not os.path.exists(fresh)


def test_demo_corpus_cli_is_deterministic_and_leaves_identical_files_alone(tmp_path):
    target = tmp_path / "demo.txt.gz"
    command = [*_cli("alma-demo-corpus"), "--out", str(target), "--max-mb", "0.05"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert first.returncode == 0, first.stderr
    data, mtime = target.read_bytes(), target.stat().st_mtime_ns
    second = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert second.returncode == 0 and "unchanged" in second.stderr
    assert target.read_bytes() == data and target.stat().st_mtime_ns == mtime
    text = gzip.decompress(data).decode("utf-8")
    assert len(text) >= 50_000 and text.count("\n\n") >= 20 and " the " in text


def test_refused_rerun_leaves_the_finished_stream_as_it_was(forked_prep, prepared, corpus,
                                                            tmp_path):
    """A re-run refused at the split (a --valid-size beyond the corpus) or at the tokenizer (a
    --vocab-size beyond it) withdrew manifest.json before its checks: the finished stream it
    was pointed at no longer verified. Now nothing in it changes."""
    stream = str(tmp_path / "stream")
    shutil.copytree(prepared[0], stream)
    args = [*corpus, "--out", stream, *ARGS]
    _refused_and_unchanged(forked_prep, [*args, "--valid-size", "50k"], [stream],
                           "--valid-size (50,000 tokens) leaves nothing",
                           "--eval-size megabatch")
    _refused_and_unchanged(forked_prep, [*args, "--vocab-size", "100000"], [stream],
                           "--vocab-size 100000 is too large")
    verify_stream_dir(stream, hashes=True)


def test_fifo_in_an_input_directory_is_refused_not_waited_on(forked_prep, tmp_path):
    """Its open blocked the extraction forever."""
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("one document\n\nanother one\n")
    os.mkfifo(root / "pipe")
    _assert_one_line_error(forked_prep(str(root), "--out", str(tmp_path / "o")),
                           f"input {root / 'pipe'} (in input directory {root}): a FIFO")
    assert not os.path.exists(tmp_path / "o")
