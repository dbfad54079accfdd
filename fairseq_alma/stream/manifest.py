"""Reading a prepared stream directory's ``manifest.json``: the contract between data
preparation and training (DESIGN.md), read wherever a run's stream must be known.

Here, below both ``data_prep`` (which writes and verifies manifests, ``data_prep/manifest.py``)
and the readers in ``fairseq_alma``, so a reader such as ``alma-sweep score`` learns B from the
manifest without importing the data preparation package above it.
"""

from __future__ import annotations

import json
import os

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
