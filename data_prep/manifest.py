"""``manifest.json``: what a prepared stream directory holds, and a cheap integrity check.

The manifest is the contract between data preparation and training (DESIGN.md): the number of
mega-batches B, tokens and documents per split, the dictionary and sentencepiece checksums, the
sources and the exact command. ``verify_stream_dir`` is what the ``alma_stream`` task calls
before training: it checks only file sizes and the dictionary's sha256 -- enough to catch a
missing or truncated shard or a swapped dictionary without reading gigabytes of binaries.
"""

from __future__ import annotations

import json
import os

from .fileio import sha256_file

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "alma-lm-stream/1"


class StreamDataError(Exception):
    """A prepared stream directory disagrees with its manifest; the message names the file."""


def load_manifest(data_dir: str) -> dict:
    """Read and minimally validate ``data_dir/manifest.json``."""
    path = os.path.join(data_dir, MANIFEST_NAME)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise StreamDataError(f"{path}: missing; prepare the data with alma-data-prep") from None
    except (OSError, ValueError) as exc:
        raise StreamDataError(f"{path}: unreadable ({exc}); re-run alma-data-prep") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise StreamDataError(f"{path}: format {found!r}, expected {MANIFEST_FORMAT!r}; "
                              "re-run alma-data-prep")
    for field, kind in (("num_megabatches", int), ("splits", dict), ("dictionary", dict)):
        if not isinstance(manifest.get(field), kind):
            raise StreamDataError(f"{path}: no valid {field!r} field; re-run alma-data-prep")
    if manifest["num_megabatches"] < 1:
        raise StreamDataError(f"{path}: num_megabatches must be >= 1; re-run alma-data-prep")
    return manifest


def expected_splits(num_megabatches: int) -> list[str]:
    return [*(f"megabatch{k}" for k in range(num_megabatches)), "eval", "valid"]


def verify_stream_dir(data_dir: str) -> dict:
    """Return the manifest after checking every shard's size and the dictionary checksum.

    Raises ``StreamDataError`` naming the offending file when the manifest is missing or
    unparsable, ``dict.txt`` differs from its recorded sha256, or a mega-batch / eval / valid
    ``.bin``/``.idx`` is missing or has another size than recorded (e.g. truncated)."""
    manifest = load_manifest(data_dir)
    manifest_path = os.path.join(data_dir, MANIFEST_NAME)
    dictionary = manifest["dictionary"]
    dict_path = os.path.join(data_dir, dictionary.get("file", "dict.txt"))
    if not os.path.isfile(dict_path):
        raise StreamDataError(f"{dict_path}: missing (listed in {manifest_path})")
    if sha256_file(dict_path) != dictionary.get("sha256"):
        raise StreamDataError(f"{dict_path}: sha256 differs from {manifest_path}; the shards "
                              "were binarized with another dictionary -- re-run alma-data-prep")
    for name in expected_splits(int(manifest["num_megabatches"])):
        split = manifest["splits"].get(name)
        if split is None:
            raise StreamDataError(f"{manifest_path}: no entry for split {name!r}")
        for ext in ("bin", "idx"):
            path = os.path.join(data_dir, f"{name}.{ext}")
            expected = split.get(f"{ext}_bytes")
            if not os.path.isfile(path):
                raise StreamDataError(f"{path}: missing (listed in {manifest_path})")
            size = os.path.getsize(path)
            if size != expected:
                raise StreamDataError(f"{path}: {size} bytes, {manifest_path} says {expected} "
                                      "(truncated or replaced); re-run alma-data-prep")
    return manifest
