"""Vision data sets for ALMA streams: one entry point that loads a data set by kind.

The paper's vision streams (§5) cut a fixed training set into B mega-batches and evaluate every
learner on one fixed test set after every arrival (Eq. 1).  Everything here therefore loads the
whole data set into tensors once: MNIST is 47 MB as float32, CIFAR-10 600 MB, the embedded
scikit-learn digits 0.5 MB.  Inputs stay as loaded (pixels in [0, 1]): the learner normalises
them with the statistics of the mega-batches arrived by its stage (``normalization``), never with
those of the whole training set, which would leak later mega-batches into early stages (§3).
"""

from __future__ import annotations

import numpy as np

from ..errors import UsageError
from .data_cifar import load_cifar10
from .data_idx import load_mnist
from .data_npz import load_npz
from .dataset import VisionData, from_arrays

DATASET_KINDS = ("digits", "mnist", "cifar10", "npz")

# The embedded digits have no official split; a fixed one keeps results comparable across runs.
_DIGITS_TEST_FRACTION = 0.2
_DIGITS_SPLIT_SEED = 0


def load_digits_data() -> VisionData:
    """scikit-learn's bundled 8x8 handwritten digits (1,797 images; nothing is downloaded).

    A fixed seeded 80/20 split (independent of any stream seed) stands in for a test set.
    """
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images.astype(np.float32)[:, None] / 16.0  # (N, 1, 8, 8), pixel range 0..16
    labels = bunch.target.astype(np.int64)
    order = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(labels))
    num_test = round(len(labels) * _DIGITS_TEST_FRACTION)
    test, train = order[:num_test], order[num_test:]
    return from_arrays("digits", images[train], labels[train], images[test], labels[test],
                       num_classes=10)


def load_vision_data(kind: str, path: str | None = None) -> VisionData:
    """Load a data set by kind: ``digits`` (embedded), ``mnist`` (IDX dir), ``cifar10``
    (python pickle batches dir) or ``npz`` (file with x_train, y_train, x_test, y_test).
    Not normalised (module doc)."""
    if kind == "digits":
        return load_digits_data()
    if kind not in DATASET_KINDS:
        raise UsageError(
            f"--vision-dataset {kind!r} is unknown; use one of {', '.join(DATASET_KINDS)}"
        )
    if not path:
        raise UsageError(f"--vision-dataset {kind} needs a path (--vision-data-path)")
    if kind == "mnist":
        return load_mnist(path)
    if kind == "cifar10":
        return load_cifar10(path)
    return load_npz(path)
