"""Any data set saved as ``.npz`` with ``x_train, y_train, x_test, y_test`` (and optionally
``num_classes``, when some classes never occur in the file).

Inputs may be flat features ``(N, D)``, grayscale images ``(N, H, W)``, or colour images either
channel-first ``(N, C, H, W)`` or channel-last ``(N, H, W, C)`` with C in {1, 3} (the layout
numpy users usually have); images become channel-first.  A 4-D array whose channel axis cannot
be told (no axis of 1 or 3, as RGBA; or one at both ends) is refused, not guessed.
"""

from __future__ import annotations

import os
import zipfile
import zlib

import numpy as np

from ..errors import DataError, first_line
from .dataset import MAX_CLASSES, VisionData, from_arrays

REQUIRED_ARRAYS = ("x_train", "y_train", "x_test", "y_test")
LAYOUTS = ("(N, D) features, (N, H, W) grayscale, or (N, C, H, W) / (N, H, W, C) images with "
           "C in {1, 3}")
_NPY_MAGIC = b"\x93NUMPY"  # numpy.save's files; numpy.savez writes a zip archive of them
# What reading a damaged archive raises.  zipfile reports a member whose (garbled) header names
# a compression method it does not know as NotImplementedError("That compression method is not
# supported"): the file's fault, not missing code of ours, so it is caught with the others.
_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error,
                NotImplementedError)


def _unreadable(path: str, err: Exception) -> DataError:
    if isinstance(err, MemoryError):  # an array header promising more than this machine holds
        return DataError(f"{path}: cannot load its arrays ({first_line(err)}); the file is "
                         f"corrupt, or load it on a machine with more memory")
    return DataError(f"{path}: not a readable .npz file ({first_line(err)})")


def _channels_first(name: str, key: str, x: np.ndarray) -> np.ndarray:
    """``x`` with images channel-first.  A 4-D array is read by where its 1 or 3 channels are;
    one with no such axis (RGBA ``(N, 32, 32, 4)``), or with one at both ends
    (``(N, 3, 5, 3)``), is refused: guessing would silently train on scrambled pixels (32
    channels of 32x4 images)."""
    if x.ndim == 2:
        return x
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4:
        first, last = x.shape[1] in (1, 3), x.shape[-1] in (1, 3)
        if first and not last:
            return x
        if last and not first:
            return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
        if first:
            what, hint = "is ambiguous (channels first or last?)", "transpose to (N, C, H, W)"
        else:
            what, hint = "has no channel axis of size 1 or 3", "drop an alpha channel"
        raise DataError(f"{name}: {key} has shape {x.shape}, whose image layout {what}; inputs "
                        f"must be {LAYOUTS} ({hint}, or flatten to (N, D))")
    raise DataError(f"{name}: {key} has shape {x.shape}; inputs must be {LAYOUTS}")


def load_npz(path: str) -> VisionData:
    """Load ``path``; a missing array, a count mismatch or a bad shape is a one-line error."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such .npz file")
    needs = ("an .npz archive holding " + ", ".join(REQUIRED_ARRAYS)
             + f" (numpy.savez(path, {', '.join(f'{k}=...' for k in REQUIRED_ARRAYS)}))")
    try:
        with open(path, "rb") as handle:
            is_npy = handle.read(len(_NPY_MAGIC)) == _NPY_MAGIC
        # np.load hands back a bare ndarray for a .npy: refuse it before reading it whole
        if is_npy:
            raise DataError(f"{path}: a single .npy array; --vision-dataset npz needs {needs}")
        loaded = np.load(path, allow_pickle=False)
    except (*_READ_ERRORS, MemoryError) as err:
        raise _unreadable(path, err) from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise DataError(f"{path}: not an .npz archive; --vision-dataset npz needs {needs}")
    try:
        with loaded as archive:
            missing = [key for key in REQUIRED_ARRAYS if key not in archive.files]
            if missing:
                raise DataError(
                    f"{path}: missing array(s) {', '.join(missing)}; the .npz must hold "
                    + ", ".join(REQUIRED_ARRAYS)
                )
            arrays = {key: archive[key] for key in REQUIRED_ARRAYS}
            classes = archive["num_classes"] if "num_classes" in archive.files else None
    except (*_READ_ERRORS, MemoryError) as err:
        raise _unreadable(path, err) from None
    num_classes = None
    if classes is not None:
        if (classes.shape != () or not np.issubdtype(classes.dtype, np.integer)
                or not 2 <= classes <= MAX_CLASSES):
            raise DataError(f"{path}: num_classes must be one integer in [2, {MAX_CLASSES}] "
                            f"(got {classes!r})")
        num_classes = int(classes)
    x_train = _channels_first(path, "x_train", arrays["x_train"])
    x_test = _channels_first(path, "x_test", arrays["x_test"])
    return from_arrays(f"npz:{path}", x_train, arrays["y_train"], x_test, arrays["y_test"],
                       num_classes)
