"""MNIST from its standard IDX files (LeCun et al. 1998), raw or gzipped; no torchvision.

IDX layout: two zero bytes, a type byte (0x08 = unsigned byte), a byte with the number of
dimensions, one big-endian uint32 per dimension, then the data.  Image files are 3-D (magic
0x00000803), label files 1-D (0x00000801).  Every check names the file it failed on.
"""

from __future__ import annotations

import gzip
import os

import numpy as np

from ..errors import DataError
from .dataset import VisionData, from_arrays

IMAGES_MAGIC = 0x00000803
LABELS_MAGIC = 0x00000801

MNIST_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


def _read_bytes(path: str) -> bytes:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            return handle.read()
    except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: cannot read ({err})") from None


def read_idx(path: str, expected_magic: int) -> np.ndarray:
    """Read one IDX file as a uint8 array, checking magic number and size against the header."""
    raw = _read_bytes(path)
    if len(raw) < 4:
        raise DataError(f"{path}: too short to be an IDX file")
    magic = int.from_bytes(raw[:4], "big")
    if magic != expected_magic:
        kind = "image" if expected_magic == IMAGES_MAGIC else "label"
        raise DataError(
            f"{path}: wrong IDX magic number 0x{magic:08x} (an MNIST {kind} file starts with "
            f"0x{expected_magic:08x}); is this the right file?"
        )
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise DataError(f"{path}: truncated IDX header")
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = header + int(np.prod(dims))
    if len(raw) != expected:
        raise DataError(
            f"{path}: header promises {dims} bytes of data ({expected} bytes in all) but the file "
            f"has {len(raw)} bytes; the file is truncated or corrupt"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def _find(directory: str, stem: str) -> str:
    for name in (
        stem,
        stem + ".gz",
        stem.replace("-idx", ".idx"),
        stem.replace("-idx", ".idx") + ".gz",
    ):
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate):
            return candidate
    raise DataError(
        f"{os.path.join(directory, stem)}[.gz]: missing; an MNIST directory needs "
        + ", ".join(MNIST_FILES.values())
    )


def load_mnist(directory: str) -> VisionData:
    """Load the four MNIST IDX files from ``directory`` as (N, 1, 28, 28) images in [0, 1]."""
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: not a directory (expected the MNIST IDX files inside)")
    paths = {key: _find(directory, stem) for key, stem in MNIST_FILES.items()}
    arrays = {}
    for split in ("train", "test"):
        images = read_idx(paths[f"{split}_images"], IMAGES_MAGIC)
        labels = read_idx(paths[f"{split}_labels"], LABELS_MAGIC)
        if images.shape[0] != labels.shape[0]:
            raise DataError(
                f"{paths[f'{split}_images']}: {images.shape[0]} images but "
                f"{paths[f'{split}_labels']} has {labels.shape[0]} labels; the counts must match"
            )
        arrays[split] = (images[:, None].copy(), labels.astype(np.int64))
    return from_arrays(f"mnist:{directory}", *arrays["train"], *arrays["test"], num_classes=10)
