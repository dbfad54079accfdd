"""A stand-in for ``alma-data-prep --eval-per-megabatch SIZE`` on a prepared tiny stream.

Why a test helper: it was written before the flag, and it keeps tests/test_eval_matrix.py's
trainings on the stream they were checked on (the real flag's output is checked against what
``alma-score --matrix`` and the alma_stream task need in tests/test_data_prep_periods.py).
For every mega-batch k the last ``documents`` documents of ``megabatch{k}`` move to a new split
``evalmb{k}`` (held out: the mega-batch keeps the rest), both are rewritten with fairseq's own
``MMapIndexedDatasetBuilder``, and ``manifest.json`` lists ``evalmb{k}`` like the other splits
(tokens, lines, documents, sizes and sha256 of .bin/.idx), the mega-batches' entries updated,
and ``eval_per_megabatch`` set; ``verify_stream_dir(hashes=True)`` must pass afterwards.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _write(prefix: Path, items: list, dtype: type) -> dict:
    from fairseq.data.indexed_dataset import MMapIndexedDatasetBuilder

    builder = MMapIndexedDatasetBuilder(str(prefix.with_suffix(".bin")), dtype=dtype)
    for item in items:
        builder.add_item(item)
    builder.finalize(str(prefix.with_suffix(".idx")))
    sizes = [len(item) for item in items]
    facts = {"tokens": int(sum(sizes)), "documents": sum(1 for n in sizes if n == 1),
             "lines": len(items), "unk_tokens": int(sum(int((item == 3).sum()) for item in items))}
    for ext in ("bin", "idx"):
        path = prefix.with_suffix(f".{ext}")
        facts |= {f"{ext}_bytes": path.stat().st_size, f"{ext}_sha256": _sha256(path)}
    return facts


def add_period_splits(data: Path, documents: int = 12) -> Path:
    """Hold out the last ``documents`` documents of every mega-batch as ``evalmb{k}`` (module
    doc).  A document ends with its blank line (an item of one token, the end of line)."""
    from data_prep.manifest import verify_stream_dir
    from fairseq.data import MMapIndexedDataset

    manifest_path = data / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    for k in range(manifest["num_megabatches"]):
        name = f"megabatch{k}"
        dataset = MMapIndexedDataset(str(data / name))
        items = [dataset[i].clone() for i in range(len(dataset))]
        dtype = dataset._index.dtype
        assert int(np.sum(dataset.sizes)) == manifest["splits"][name]["tokens"]
        ends = np.flatnonzero(dataset.sizes == 1)  # the blank line closing each document
        assert len(ends) == manifest["splits"][name]["documents"] > documents
        cut = int(ends[len(ends) - documents - 1]) + 1
        del dataset
        manifest["splits"][f"evalmb{k}"] = _write(data / f"evalmb{k}", items[cut:], dtype)
        manifest["splits"][name] = _write(data / name, items[:cut], dtype)
    manifest["eval_per_megabatch"] = f"{documents} documents (tests/period_splits.py)"
    manifest_path.write_text(json.dumps(manifest, indent=1))
    verify_stream_dir(str(data), hashes=True)
    return data
