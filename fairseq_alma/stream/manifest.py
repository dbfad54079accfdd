"""``manifest.json``: what a prepared stream directory holds, read and cheaply checked.

The manifest is the contract between data preparation and training (DESIGN.md): the number of
mega-batches B, tokens and documents per split, the dictionary's checksum, the tokenizer (a
``sentencepiece`` entry, or a ``tokenizer`` entry of kind ``gpt2`` or ``from-binarized``), the
sources and the exact command. ``verify_stream_dir`` is what the ``alma_stream`` task calls
before training: it checks only file sizes and the dictionary's sha256 -- enough to catch a
missing or truncated shard or a swapped dictionary without reading gigabytes of binaries.

Here, in the stream core below both ``data_prep`` (which writes manifests) and every reader in
``fairseq_alma`` (the task, scoring, reports, sweeps), so no reader imports the data
preparation package above it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from ..errors import DataError

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "alma-lm-stream/1"


def load_manifest(data_dir: str) -> dict:
    """Read and minimally validate ``data_dir/manifest.json``."""
    path = os.path.join(data_dir, MANIFEST_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise DataError(f"{path}: missing; prepare the data with alma-data-prep") from None
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: unreadable ({exc}); re-run alma-data-prep") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise DataError(f"{path}: format {found!r}, expected {MANIFEST_FORMAT!r}; "
                              "re-run alma-data-prep")
    for field, kind in (("num_megabatches", int), ("splits", dict), ("dictionary", dict)):
        if not isinstance(manifest.get(field), kind):
            raise DataError(f"{path}: no valid {field!r} field; re-run alma-data-prep")
    if manifest["num_megabatches"] < 1:
        raise DataError(f"{path}: num_megabatches must be >= 1; re-run alma-data-prep")
    return manifest


def sha256_file(path: str, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def data_identity(manifest: dict) -> dict:
    """What the data of a stream is, without where it lives or when it was made: the fields of
    the manifest that change the tokens (a run's fingerprint holds them). ``tokenizer`` only
    where present, so runs on sentencepiece streams keep the fingerprint they had."""
    identity = {key: manifest.get(key) for key in ("num_megabatches", "seed", "splits",
                                                   "dictionary", "sentencepiece")}
    if "tokenizer" in manifest:  # its sha256s, not where the files were
        identity["tokenizer"] = {key: value for key, value in manifest["tokenizer"].items()
                                 if key not in ("encoder_json", "vocab_bpe", "source")}
    return identity


def expected_splits(num_megabatches: int, per_megabatch_eval: bool = False) -> list[str]:
    """Every split a stream must hold: with ``--eval-per-megabatch`` (the manifest's
    ``eval_per_megabatch`` set) also the held-out ``evalmb{k}`` of every mega-batch."""
    periods = [f"evalmb{k}" for k in range(num_megabatches)] if per_megabatch_eval else []
    return [*(f"megabatch{k}" for k in range(num_megabatches)), *periods, "eval", "valid"]


def split_note(split: str) -> str | None:
    """The line under a table of perplexities measured on ``split``: None for the evaluation
    mega-batch (``eval``, Table 2's), else what the split is, so a table scored on training text
    (``megabatch{k}``) never reads as Table 2."""
    if split == "eval":
        return None
    if re.fullmatch(r"megabatch\d+", split):
        what = "a training mega-batch: text the models are trained on"
    elif re.fullmatch(r"evalmb\d+", split):
        what = f"the held-out part of mega-batch {split[len('evalmb'):]}"
    elif split == "valid":
        what = "the validation set"
    else:
        what = "not a split of an alma-data-prep stream"
    return f"perplexity on split '{split}' ({what}), not on the evaluation mega-batch 'eval'"


def verify_stream_dir(data_dir: str, hashes: bool = False) -> dict:
    """Return the manifest after checking the dictionary and every shard against it.

    Always: ``dict.txt``'s sha256, and every mega-batch / eval / valid (and per-mega-batch
    ``evalmb{k}``, where the manifest records ``eval_per_megabatch``) ``.bin``/``.idx`` present
    with its recorded size (cheap: catches a missing, truncated or swapped file).  With
    ``hashes``, also every shard's sha256 (reads all of them: catches a flipped byte); manifests
    written before shards had checksums are checked for sizes only.  Raises ``DataError``
    naming the offending file and what to do."""
    manifest = load_manifest(data_dir)
    manifest_path = os.path.join(data_dir, MANIFEST_NAME)
    dictionary = manifest["dictionary"]
    dict_path = os.path.join(data_dir, dictionary.get("file", "dict.txt"))
    if not os.path.isfile(dict_path):
        raise DataError(f"{dict_path}: missing (listed in {manifest_path})")
    if sha256_file(dict_path) != dictionary.get("sha256"):
        raise DataError(f"{dict_path}: sha256 differs from {manifest_path}; the shards "
                        "were binarized with another dictionary -- re-run alma-data-prep")
    per_megabatch_eval = manifest.get("eval_per_megabatch") is not None
    for name in expected_splits(int(manifest["num_megabatches"]), per_megabatch_eval):
        split = manifest["splits"].get(name)
        if split is None:
            raise DataError(f"{manifest_path}: no entry for split {name!r}")
        for ext in ("bin", "idx"):
            path = os.path.join(data_dir, f"{name}.{ext}")
            expected = split.get(f"{ext}_bytes")
            if not os.path.isfile(path):
                raise DataError(f"{path}: missing (listed in {manifest_path})")
            size = os.path.getsize(path)
            if size != expected:
                raise DataError(f"{path}: {size} bytes, {manifest_path} says {expected} "
                                "(truncated or replaced); re-run alma-data-prep")
            recorded = split.get(f"{ext}_sha256")
            if hashes and recorded and sha256_file(path) != recorded:
                raise DataError(f"{path}: sha256 differs from {manifest_path} (the file was "
                                f"changed or damaged); {REBUILD_ADVICE}")
    return manifest


def check_same_dictionary(trained: str | None, here: str, path: str) -> None:
    """Refuse a checkpoint trained with the dictionary of sha256 ``trained`` on the one at
    ``path`` (sha256 ``here``): every id would name another piece, and the perplexity would
    look like any other.  None: a checkpoint that records no dictionary, nothing to check."""
    if trained and trained != here:
        raise DataError(f"the checkpoint was trained with another dictionary (sha256 {trained[:12]}) "
                        f"than {path} (sha256 {here[:12]}); score it on the stream it was trained on")


# a re-run reuses every step whose files have the sizes it wrote (hashing a large stream at
# every re-run would cost minutes), so a same-size damaged file must be deleted to be rebuilt
REBUILD_ADVICE = "delete it and re-run alma-data-prep with the flags that made the stream"


def verify_split_hashes(data_dir: str, names: list[str]) -> None:
    """Every ``.bin``/``.idx`` of the splits ``names`` against its size and sha256 in the
    manifest (a manifest without checksums: sizes only); ``DataError`` naming the file.

    Why (alma-score): sizes alone let a flipped byte in the evaluation split through, and a
    table scored on it printed other perplexities (181.09 for 181.20) with exit 0; the split a
    scoring reads is hashed first (it reads every byte of it anyway)."""
    manifest = load_manifest(data_dir)
    manifest_path = os.path.join(data_dir, MANIFEST_NAME)
    for name in names:
        split = manifest["splits"].get(name) or {}
        for ext in ("bin", "idx"):
            path = os.path.join(data_dir, f"{name}.{ext}")
            if not os.path.isfile(path) or f"{ext}_bytes" not in split:
                continue  # a split the manifest or the directory lacks: loading names it
            size = os.path.getsize(path)
            if size != split[f"{ext}_bytes"]:
                raise DataError(f"{path}: {size} bytes, {manifest_path} says {split[f'{ext}_bytes']} "
                                "(truncated or replaced); re-run alma-data-prep")
            recorded = split.get(f"{ext}_sha256")
            if recorded and sha256_file(path) != recorded:
                raise DataError(f"{path}: sha256 differs from {manifest_path} (the file was "
                                f"changed or damaged); {REBUILD_ADVICE}, or score on an intact "
                                f"copy with --data")


def kept_repeats(manifest: dict) -> int:
    """Documents of the corpus that repeat an earlier one and were kept in the stream
    (``alma-data-prep --keep-duplicates``; 0 when dropped, or for a stream prepared before
    repeats were counted): copies that may sit in a held-out split and in training at once."""
    repeats = manifest.get("repeated_documents")
    if not isinstance(repeats, dict) or repeats.get("dropped", True):
        return 0
    return int(repeats.get("count") or 0)


def has_shard_checksums(manifest: dict) -> bool:
    return all("bin_sha256" in split for split in manifest["splits"].values())
