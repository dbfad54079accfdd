"""Any data set saved as ``.npz`` with ``x_train, y_train, x_test, y_test`` (and optionally
``num_classes``, when some classes never occur in the file).

Inputs may be flat features ``(N, D)``, grayscale images ``(N, H, W)``, or colour images either
channel-first ``(N, C, H, W)`` or channel-last ``(N, H, W, C)`` with C in {1, 3} (the layout
numpy users usually have); images become channel-first.
"""

from __future__ import annotations

import os
import zipfile

import numpy as np

from ..errors import DataError
from .dataset import VisionData, from_arrays

REQUIRED_ARRAYS = ("x_train", "y_train", "x_test", "y_test")


def _channels_first(name: str, x: np.ndarray) -> np.ndarray:
    if x.ndim == 2:
        return x
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4:
        if x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):
            return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        return x
    raise DataError(f"{name}: inputs must be (N, D), (N, H, W) or 4-D images, got shape {x.shape}")


def load_npz(path: str) -> VisionData:
    """Load ``path``; a missing array, a count mismatch or a bad shape is a one-line error."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such .npz file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            missing = [key for key in REQUIRED_ARRAYS if key not in archive.files]
            if missing:
                raise DataError(
                    f"{path}: missing array(s) {', '.join(missing)}; the .npz must hold "
                    + ", ".join(REQUIRED_ARRAYS)
                )
            arrays = {key: archive[key] for key in REQUIRED_ARRAYS}
            classes = archive["num_classes"] if "num_classes" in archive.files else None
    except (OSError, ValueError, zipfile.BadZipFile) as err:
        raise DataError(f"{path}: not a readable .npz file ({err})") from None
    num_classes = None
    if classes is not None:
        if classes.shape != () or not np.issubdtype(classes.dtype, np.integer) or classes < 1:
            raise DataError(f"{path}: num_classes must be one integer >= 1 (got {classes!r})")
        num_classes = int(classes)
    x_train = _channels_first(path, arrays["x_train"])
    x_test = _channels_first(path, arrays["x_test"])
    return from_arrays(f"npz:{path}", x_train, arrays["y_train"], x_test, arrays["y_test"],
                       num_classes)
