"""The in-memory classification data set every vision loader returns, and the validation they share.

Every loader (``data_idx``, ``data_cifar``, ``data_npz``, the embedded digits in ``data``) ends
by handing numpy arrays to ``from_arrays``: one place refuses data that would otherwise train
silently on wrong inputs or labels, whatever the file format.  Kept apart from ``data`` (the
entry point that picks a loader) so the loaders depend on this file and ``data`` on them, one way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..errors import DataError


@dataclass(frozen=True)
class VisionData:
    """A classification data set held in memory.

    Attributes:
        name: where it came from (kind and path), for logs and records.
        x_train, x_test: float32, ``(N, C, H, W)`` images or ``(N, D)`` feature vectors.
        y_train, y_test: int64 labels in ``[0, num_classes)``.
        num_classes: number of classes.
    """

    name: str
    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor
    num_classes: int

    @property
    def input_shape(self) -> tuple[int, ...]:
        """Shape of one example, e.g. ``(1, 28, 28)`` or ``(64,)``."""
        return tuple(self.x_train.shape[1:])

    @property
    def is_image(self) -> bool:
        return self.x_train.dim() == 4


# The largest class count accepted.  Far above any real label set (ImageNet-21k: 21,841), low
# enough that a stray huge label (a -1 "unlabelled" marker stored as uint32 reads 4294967295)
# is refused in one line instead of sizing an output layer, or a list of absent classes, by it.
MAX_CLASSES = 1 << 20


def from_arrays(
    name: str, x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, y_test: np.ndarray,
    num_classes: int | None = None,
) -> VisionData:
    """Validate numpy arrays and wrap them as (unnormalised) float32 / int64 tensors.

    Everything that would otherwise train silently on wrong data is refused with one line
    naming the array: counts that differ, empty splits or examples, inputs that are not real
    numbers or are not finite *as the model sees them* (float32: a float64 1e39 is inf there),
    labels that are not integers in [0, C), fewer than 2 classes (every test error would be 0),
    and class ids with gaps (a stray label 255 among 0..9 would widen the output layer to 256
    classes).  ``num_classes`` (C) may be given when some classes really never occur; otherwise
    C = the largest label + 1 and every class must occur.  Label checks are O(N) whatever the
    labels' values.  ``uint8`` pixels are scaled to [0, 1], so both splits must be uint8 or
    neither.
    """
    arrays = {"x_train": x_train, "y_train": y_train, "x_test": x_test, "y_test": y_test}
    for key in ("x_train", "x_test"):
        x = arrays[key]
        if x.dtype == np.bool_ or not (np.issubdtype(x.dtype, np.integer)
                                      or np.issubdtype(x.dtype, np.floating)):
            raise DataError(f"{name}: {key} has dtype {x.dtype}; inputs must be real numbers "
                            f"(uint8 pixels or floats)")
    for split in ("train", "test"):
        x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
        if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or y.dtype == np.bool_:
            raise DataError(f"{name}: y_{split} must be a 1-D array of integer class ids (got "
                            f"dtype {y.dtype}, shape {y.shape})")
        if x.ndim < 2 or x.shape[0] != y.shape[0]:
            raise DataError(
                f"{name}: x_{split} has {x.shape[0] if x.ndim else 0} examples but y_{split} "
                f"{y.shape[0]} labels; inputs and labels must have the same count")
        if x.shape[0] == 0:
            raise DataError(f"{name}: the {split} split is empty")
        if 0 in x.shape[1:]:
            raise DataError(f"{name}: x_{split} has shape {x.shape}, no input values per "
                            f"example; each example needs at least one feature or pixel")
        if y.min() < 0:
            raise DataError(f"{name}: y_{split} holds negative labels ({int(y.min())}); class ids "
                            f"are 0..C-1")
        if y.max() >= MAX_CLASSES:
            raise DataError(f"{name}: y_{split} holds label {int(y.max())}, beyond the "
                            f"{MAX_CLASSES} classes supported; class ids are 0..C-1: drop "
                            f"unlabelled examples (a -1 marker stored as uint32 reads 4294967295)")
    if x_train.shape[1:] != x_test.shape[1:]:
        raise DataError(
            f"{name}: x_train has shape {x_train.shape[1:]} per example but x_test "
            f"{x_test.shape[1:]}; both splits must have the same example shape"
        )
    if (x_train.dtype == np.uint8) != (x_test.dtype == np.uint8):  # only uint8 is scaled
        raise DataError(f"{name}: x_train is {x_train.dtype} but x_test {x_test.dtype}; uint8 pixels "
                        f"are scaled to [0, 1] and other inputs are not, so the splits would differ "
                        f"in scale: store both in one dtype")
    num_classes = _class_count(name, y_train, y_test, num_classes)
    return VisionData(
        name=name,
        x_train=torch.from_numpy(_as_float32(name, "x_train", x_train)),
        y_train=torch.from_numpy(y_train.astype(np.int64)),
        x_test=torch.from_numpy(_as_float32(name, "x_test", x_test)),
        y_test=torch.from_numpy(y_test.astype(np.int64)),
        num_classes=num_classes,
    )


def _class_count(name: str, y_train: np.ndarray, y_test: np.ndarray,
                 num_classes: int | None) -> int:
    """C: ``num_classes`` when given (every label below it), else the largest label + 1 with
    every class present.  Labels are already known to lie in [0, MAX_CLASSES)."""
    top = int(max(y_train.max(), y_test.max()))
    if num_classes is not None:
        if top >= num_classes:
            where = "y_train" if y_train.max() >= num_classes else "y_test"
            raise DataError(f"{name}: {where} holds label {top} but num_classes is {num_classes}; "
                            f"labels must be in [0, {num_classes})")
    else:
        present = np.union1d(np.unique(y_train), np.unique(y_test))
        if len(present) != top + 1:
            # the first 6 absent ids all lie below len(present) + 6: never a range of size top
            missing = np.setdiff1d(np.arange(min(top + 1, len(present) + 6)), present).tolist()
            shown = ", ".join(map(str, missing[:5])) + (" ..." if len(missing) > 5 else "")
            raise DataError(f"{name}: labels go up to {top} but classes {shown} never occur; "
                            f"labels must be 0..C-1 (store num_classes in the .npz if some "
                            f"classes really are absent)")
        num_classes = top + 1
    if num_classes < 2:
        raise DataError(f"{name}: every label is 0, a single class; a classifier needs at least "
                        f"2 classes (with one, every test error is 0)")
    return num_classes


def _as_float32(name: str, key: str, x: np.ndarray) -> np.ndarray:
    """``x`` as the model will see it (float32, uint8 scaled to [0, 1]), refused unless every
    value is finite *after* the cast: a float64 or longdouble value beyond float32's range
    (about 3.4e38) is finite in the file but inf in training, and would train on NaN silently."""
    with np.errstate(over="ignore"):  # overflow is reported below, in one line
        cast = np.array(x, dtype=np.float32, order="C")  # a copy: the tensor owns its memory
    if x.dtype == np.uint8:
        cast /= np.float32(255.0)
    if np.issubdtype(x.dtype, np.integer):  # any integer is finite in float32 (uint64 < 3.4e38)
        return cast
    finite = np.isfinite(cast).reshape(cast.shape[0], -1).all(axis=1)
    if finite.all():
        return cast
    if np.issubdtype(x.dtype, np.floating):
        broken = ~np.isfinite(x).reshape(x.shape[0], -1).all(axis=1)
        if broken.any():
            raise DataError(f"{name}: {key} holds NaN or inf in {int(broken.sum())} example(s); "
                            f"clean the data first")
    raise DataError(f"{name}: {key} holds values beyond float32's range (about 3.4e38) in "
                    f"{int((~finite).sum())} example(s), which become inf in training (inputs "
                    f"are float32); rescale the data first")
