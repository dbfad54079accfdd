"""``alma-data-prep --order given`` and ``--eval-per-megabatch``: a stream in time order, with a
held-out slice of every period, through the real CLI on a tiny corpus.

The corpus is three files (periods) of 14 documents each; every document opens with a unique
"period P doc I" line, so decoding a split tells which file and position each document came
from. The reference is the default (shuffled) stream of the same corpus and seed.
"""

from __future__ import annotations

import json
import os
import random
import shutil

import numpy as np
import pytest
from test_data_prep import (
    _assert_one_line_error,
    _binary_outputs,
    _decoded_documents,
    _doc_tokens,
    run_prep,
)

from fairseq_alma.errors import DataError
from fairseq_alma.stream.manifest import verify_stream_dir

pytestmark = pytest.mark.slow

B, PER_FILE = 3, 14
ARGS = ["--vocab-size", "300", "--valid-size", "1", "--eval-size", "1", "-B", str(B),
        "--seed", "5"]
PERIODS = ["--order", "given", "--eval-per-megabatch", "0.25"]


def _period_documents() -> list[list[str]]:
    """Per file, its documents (text as the splits decode it)."""
    rng = random.Random(1)
    words = ["".join(rng.choice(["ka", "lo", "mi", "ne", "ru", "ta", "po", "gen"])
                     for _ in range(rng.randint(1, 3))) for _ in range(60)]
    return [["\n".join([f"period {p} doc {i}"]
                       + [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8))) + "."
                          for _ in range(rng.randint(1, 3))])
             for i in range(PER_FILE)] for p in range(B)]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("periods")
    paths = []
    for p, docs in enumerate(_period_documents()):
        path = root / f"2020-0{p + 1}.txt"
        path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
        paths.append(str(path))
    return paths


def _prepare(out: str, *args: str) -> str:
    result = run_prep(*args, "--out", out)
    assert result.returncode == 0, result.stderr
    return out


@pytest.fixture(scope="module")
def shuffled(files, tmp_path_factory) -> str:
    return _prepare(str(tmp_path_factory.mktemp("p") / "shuffled"), *files, *ARGS)


@pytest.fixture(scope="module")
def periods(files, tmp_path_factory) -> str:
    return _prepare(str(tmp_path_factory.mktemp("p") / "periods"), *files, *ARGS, *PERIODS)


def _manifest(out: str) -> dict:
    with open(os.path.join(out, "manifest.json"), encoding="utf-8") as f:
        return json.load(f)


def _where(doc: str) -> tuple[int, int]:
    """(period, index) from a document's first line."""
    words = doc.split("\n")[0].split()
    return int(words[1]), int(words[3])


def _splits(out: str) -> dict[str, list[tuple[int, int]]]:
    return {name: [_where(doc) for doc in _decoded_documents(out, name)]
            for name in _manifest(out)["splits"]}


def test_given_order_puts_period_k_in_megabatch_k(periods, shuffled):
    manifest = _manifest(periods)
    assert manifest["order"] == "given" and manifest["eval_per_megabatch"] == "0.25"
    assert manifest["options"]["order"] == "given"
    assert list(manifest["splits"]) == [*(f"megabatch{k}" for k in range(B)),
                                        *(f"evalmb{k}" for k in range(B)), "eval", "valid"]
    got = _splits(periods)
    # valid and eval (one document each here) are the shuffle's, drawn from the whole corpus
    assert got["valid"] == _splits(shuffled)["valid"] and got["eval"] == _splits(shuffled)["eval"]
    held_out = set(got["valid"] + got["eval"])
    for k in range(B):
        period = sorted(got[f"megabatch{k}"] + got[f"evalmb{k}"])
        assert got[f"megabatch{k}"] == sorted(got[f"megabatch{k}"])  # input order kept
        # period k is file k's documents: each equal-token cut lies within the held-out
        # documents plus one of the file boundary (split.py), on either side
        inside = [doc for doc in period if doc[0] == k]
        slack = len(held_out) + 1
        assert len(inside) >= PER_FILE - len([d for d in held_out if d[0] == k]) - 2 * slack
        assert all(abs(doc[0] - k) <= 1 for doc in period), period
        if k:  # contiguous: every document of period k comes after every one of period k-1
            previous = got[f"megabatch{k - 1}"] + got[f"evalmb{k - 1}"]
            assert max(previous) < min(period)
    everything = [doc for docs in got.values() for doc in docs]
    assert sorted(everything) == [(p, i) for p in range(B) for i in range(PER_FILE)]


def test_given_order_alone_cuts_the_files_in_order(files, tmp_path):
    """Without --eval-per-megabatch: mega-batch k is file k's training documents in input
    order, up to the cut's slack (the held-out documents plus one) at each end."""
    out = _prepare(str(tmp_path / "o"), *files, *ARGS, "--order", "given")
    got = _splits(out)
    held_out = got["valid"] + got["eval"]
    train = [doc for k in range(B) for doc in got[f"megabatch{k}"]]
    assert train == sorted(set((p, i) for p in range(B) for i in range(PER_FILE)) - set(held_out))
    for k in range(B):
        expected = [(k, i) for i in range(PER_FILE) if (k, i) not in held_out]
        mismatched = set(got[f"megabatch{k}"]) ^ set(expected)
        assert len(mismatched) <= 2 * (len(held_out) + 1), (k, got[f"megabatch{k}"])
    assert [_where(d)[0] for d in _decoded_documents(out, "megabatch0")][:3] == [0, 0, 0]
    assert [_where(d)[0] for d in _decoded_documents(out, f"megabatch{B - 1}")][-3:] == [B - 1] * 3


def test_period_splits_are_held_out_and_sized_as_asked(periods, shuffled):
    manifest = _manifest(periods)
    got = _splits(periods)
    longest = max(max(_doc_tokens(periods, name)) for name in manifest["splits"])
    train = {doc for k in range(B) for doc in got[f"megabatch{k}"]}
    for k in range(B):
        held, split = set(got[f"evalmb{k}"]), manifest["splits"][f"evalmb{k}"]
        assert held and not held & train  # never trained on
        assert split["documents"] == len(held) and split["unk_tokens"] == 0
        period = split["tokens"] + manifest["splits"][f"megabatch{k}"]["tokens"]
        assert abs(split["tokens"] - 0.25 * period) <= longest / 2
        assert sum(_doc_tokens(periods, f"evalmb{k}")) == split["tokens"]
    assert verify_stream_dir(periods, hashes=True) == manifest
    # the same flag with the default order and a token count: the shuffle's mega-batch k is
    # split into mega-batch k and evalmb{k}; valid and eval are untouched
    out = _prepare(os.path.join(os.path.dirname(periods), "counted"), *_sources(shuffled),
                   *ARGS, "--eval-per-megabatch", "60")
    counted, before = _splits(out), _splits(shuffled)
    for name in ("valid", "eval"):
        assert counted[name] == before[name]
    for k in range(B):
        assert sorted(counted[f"megabatch{k}"] + counted[f"evalmb{k}"]) == before[f"megabatch{k}"]
        tokens = _manifest(out)["splits"][f"evalmb{k}"]["tokens"]
        assert abs(tokens - 60) <= longest / 2
    assert _manifest(out)["order"] == "shuffle"


def _sources(out: str) -> list[str]:
    return [source["path"] for source in _manifest(out)["sources"]]


def test_dictionary_counts_only_the_training_megabatches(periods):
    from fairseq.data import Dictionary, data_utils

    dictionary = Dictionary.load(os.path.join(periods, "dict.txt"))
    counts = np.zeros(len(dictionary), dtype=np.int64)
    held = np.zeros(len(dictionary), dtype=np.int64)
    for name in _manifest(periods)["splits"]:
        dataset = data_utils.load_indexed_dataset(os.path.join(periods, name), dictionary)
        ids = np.concatenate([dataset[i].numpy() for i in range(len(dataset))])
        target = counts if name.startswith("megabatch") else held
        target += np.bincount(ids, minlength=len(dictionary))
    first = dictionary.nspecial
    assert np.array_equal(np.array(dictionary.count[first:]), counts[first:])
    assert held[first:].sum() > 0  # the held-out splits have tokens the counts leave out


def test_workers_and_reruns_do_not_change_the_bytes(periods, files, tmp_path):
    other = _prepare(str(tmp_path / "two"), *files, *ARGS, *PERIODS, "--workers", "2")
    assert _binary_outputs(other) == _binary_outputs(periods)
    assert _manifest(other)["splits"] == _manifest(periods)["splits"]
    again = run_prep(*files, "--out", periods, *ARGS, *PERIODS)
    assert again.returncode == 0 and "building" not in again.stderr, again.stderr
    # another order redoes the split and what follows, never the tokenizer or the encoding
    copy = str(tmp_path / "copy")
    shutil.copytree(periods, copy)
    changed = run_prep(*files, "--out", copy, *ARGS, "--eval-per-megabatch", "0.25")
    assert changed.returncode == 0, changed.stderr
    for step in ("extract", "sentencepiece", "encode"):
        assert f"{step}: up to date, reused" in changed.stderr
    for step in ("split", "dictionary", "binarize"):
        assert f"{step}: building" in changed.stderr
    assert _manifest(copy)["order"] == "shuffle"
    dropped = run_prep(*files, "--out", copy, *ARGS)
    assert dropped.returncode == 0, dropped.stderr
    assert not [f for f in os.listdir(copy) if f.startswith("evalmb")]  # stale splits removed
    assert _manifest(copy)["eval_per_megabatch"] is None
    verify_stream_dir(copy, hashes=True)


def test_a_damaged_period_split_is_named(periods, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(periods, copy)
    os.remove(copy / "evalmb1.idx")
    with pytest.raises(DataError, match="evalmb1.idx: missing"):
        verify_stream_dir(str(copy))


def test_alma_score_matrix_accepts_the_stream(periods, shuffled):
    """What ``alma-score --matrix`` checks of the data before scoring, then the alma_stream
    task (which verifies the stream first) loading every period split as scoring does, with
    the manifest's tokens (tests/test_eval_matrix.py scores a stream of this layout)."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_alma.fairseq_glue.user_dir import load_plugin
    from fairseq_alma.lm.score_matrix import check_period_splits, period_split

    assert check_period_splits(periods, B) == {"eval_per_megabatch": "0.25"}
    with pytest.raises(DataError, match="has none of the per-mega-batch"):
        check_period_splits(shuffled, B)
    load_plugin()
    args = options.parse_args_and_arch(options.get_training_parser(), [
        periods, "--task", "alma_stream", "--arch", "switch_transformer_lm_tiny",
        "--moe-experts", "2", "--criterion", "switch_cross_entropy", "--updates-per-stage", "2",
        "--tokens-per-sample", "32", "--cpu"])
    task = tasks.setup_task(convert_namespace_to_omegaconf(args).task)
    splits = _manifest(periods)["splits"]
    for period in range(1, B + 1):
        name = period_split(period)
        task.load_dataset(name)
        assert int(task.dataset(name).sizes.sum()) == splits[name]["tokens"]
        # fairseq-validate's batches hold every block, whatever the batch multiple (fairseq's
        # default of 8 left out the last blocks that filled none: a perplexity that moved with
        # --batch-size)
        batches = task.get_batch_iterator(task.dataset(name), max_sentences=3,
                                          required_batch_size_multiple=8).next_epoch_itr(shuffle=False)
        assert sum(len(batch["id"]) for batch in batches) == len(task.dataset(name))


@pytest.mark.parametrize("extra, named", [
    (["--order", "sideways"], ["--order", "sideways"]),
    (["--eval-per-megabatch", "megabatch"], ["--eval-per-megabatch"]),
    (["--eval-per-megabatch", "1.5"], ["--eval-per-megabatch"]),
    (["--eval-per-megabatch", "0"], ["--eval-per-megabatch"]),
    (["--eval-per-megabatch", "100k"], ["--eval-per-megabatch", "megabatch0"]),
    (["--eval-per-megabatch", "0.2", "-B", "21"], ["--num-megabatches 21", "42 documents",
                                                   "at least 44", "--eval-per-megabatch"]),
])
def test_bad_values_fail_with_one_line(files, tmp_path, extra, named):
    _assert_one_line_error(run_prep(*files, "--out", str(tmp_path / "o"), *ARGS, *extra), *named)
