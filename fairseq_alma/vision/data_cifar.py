"""CIFAR-10 from its standard python pickle batches (Krizhevsky 2009); no torchvision.

``cifar-10-batches-py/`` holds ``data_batch_1`` … ``data_batch_5`` and ``test_batch``, each a
pickled dict with ``data`` (10000 x 3072 uint8, channel-major RGB) and ``labels``.  Pickle can run
code when loading, so the unpickler here only builds dicts, lists, numbers and numpy arrays.
"""

from __future__ import annotations

import os
import pickle

import numpy as np

from ..errors import DataError, first_line
from .dataset import VisionData, from_arrays

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"

_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("_codecs", "encode"),
}


class _ArrayOnlyUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def read_batch(path: str) -> tuple[np.ndarray, np.ndarray]:
    """One pickle batch as ``(images (N, 3, 32, 32) uint8, labels (N,) int64)``."""
    if not os.path.isfile(path):
        raise DataError(
            f"{path}: missing CIFAR-10 batch file; the directory needs "
            + ", ".join(TRAIN_BATCHES + (TEST_BATCH,))
        )
    try:
        with open(path, "rb") as handle:
            batch = _ArrayOnlyUnpickler(handle, encoding="bytes").load()
    except OSError as err:
        raise DataError(f"{path}: cannot read ({first_line(err)})") from None
    except Exception as err:  # any failure: see below
        # Damaged bytes make the unpickler fail in any way (an unknown codec name: LookupError;
        # a huge length: OverflowError or MemoryError; ...).  It only builds plain values
        # (find_class above), so a failure here is the file's, never a bug of ours.
        raise DataError(f"{path}: not a CIFAR-10 python pickle batch ({type(err).__name__}: "
                        f"{first_line(err)}); download it again") from None
    if not isinstance(batch, dict):
        raise DataError(f"{path}: not a CIFAR-10 batch (expected a pickled dict)")
    batch = {k.decode("utf-8", "replace") if isinstance(k, bytes) else k: v
             for k, v in batch.items()}
    if "data" not in batch or "labels" not in batch:
        raise DataError(f"{path}: CIFAR-10 batch lacks 'data' or 'labels'")
    data = _array(path, "data", batch["data"])
    labels = _array(path, "labels", batch["labels"])
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32 or data.dtype != np.uint8:
        raise DataError(f"{path}: 'data' must be N x 3072 uint8, got {data.shape} {data.dtype}")
    # int(0.5) would be class 0: float labels are refused, as the .npz loader refuses them
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer) or labels.dtype == np.bool_:
        raise DataError(f"{path}: 'labels' must be a list of integer class ids 0..9, got dtype "
                        f"{labels.dtype}, shape {labels.shape}")
    if data.shape[0] != labels.shape[0]:
        raise DataError(
            f"{path}: {data.shape[0]} images but {labels.shape[0]} labels; the counts must match"
        )
    return data.reshape(-1, 3, 32, 32), labels.astype(np.int64)


def _array(path: str, key: str, value: object) -> np.ndarray:
    """``value`` (a list or an array from the pickle) as an array; ragged lists are refused."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as err:  # inhomogeneous nested lists
        raise DataError(f"{path}: '{key}' is not a rectangular array ({first_line(err)})") from None


def load_cifar10(directory: str) -> VisionData:
    """Load CIFAR-10 from ``directory`` (the ``cifar-10-batches-py`` folder or its parent)."""
    nested = os.path.join(directory, "cifar-10-batches-py")
    if os.path.isdir(nested):
        directory = nested
    if not os.path.isdir(directory):
        raise DataError(f"{directory}: not a directory (expected the CIFAR-10 batch files inside)")
    train = [read_batch(os.path.join(directory, name)) for name in TRAIN_BATCHES]
    x_test, y_test = read_batch(os.path.join(directory, TEST_BATCH))
    x_train = np.concatenate([x for x, _ in train])
    y_train = np.concatenate([y for _, y in train])
    return from_arrays(f"cifar10:{directory}", x_train, y_train, x_test, y_test, num_classes=10)
