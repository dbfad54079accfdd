"""Vision loaders on tiny files written here, their one-line errors, and the augmentation."""

from __future__ import annotations

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

from fairseq_alma.errors import DataError, UsageError
from fairseq_alma.vision.augment import random_crop_flip
from fairseq_alma.vision.data import load_vision_data
from fairseq_alma.vision.data_cifar import load_cifar10
from fairseq_alma.vision.data_idx import load_mnist
from fairseq_alma.vision.data_npz import load_npz


@pytest.fixture(autouse=True, scope="module")
def _one_thread():  # tiny models: extra threads only spin-wait on a busy machine
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def write_idx(path, array: np.ndarray, magic: int, compress: bool = False) -> None:
    header = struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(str(path) + ".gz", "wb") as handle:
            handle.write(payload)
    else:
        path.write_bytes(payload)


def make_mnist(directory, n_train=6, n_test=4, compress=False, label_count=None):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        write_idx(
            directory / f"{prefix}-images-idx3-ubyte",
            rng.integers(0, 256, (n, 28, 28)),
            0x803,
            compress,
        )
        labels = rng.integers(0, 10, (label_count or n,))
        write_idx(directory / f"{prefix}-labels-idx1-ubyte", labels, 0x801, compress)


@pytest.mark.parametrize("compress", [False, True])
def test_mnist_idx_raw_and_gzip(tmp_path, compress):
    make_mnist(tmp_path, compress=compress)
    data = load_mnist(str(tmp_path))
    assert data.x_train.shape == (6, 1, 28, 28) and data.x_test.shape == (4, 1, 28, 28)
    assert (
        data.x_train.dtype == torch.float32 and 0 <= data.x_train.min() and data.x_train.max() <= 1
    )
    assert data.y_train.dtype == torch.int64


def test_mnist_wrong_magic_names_file(tmp_path):
    make_mnist(tmp_path)
    write_idx(
        tmp_path / "train-labels-idx1-ubyte", np.zeros((6, 28, 28)), 0x803
    )  # images as labels
    with pytest.raises(
        DataError, match="train-labels-idx1-ubyte: wrong IDX magic number 0x00000803"
    ):
        load_mnist(str(tmp_path))


def test_mnist_count_mismatch_and_truncation(tmp_path):
    make_mnist(tmp_path, label_count=5)
    with pytest.raises(DataError, match=r"train-images-idx3-ubyte: 6 images but .*5 labels"):
        load_mnist(str(tmp_path))
    path = tmp_path / "train-labels-idx1-ubyte"
    path.write_bytes(path.read_bytes()[:-1])
    with pytest.raises(DataError, match="train-labels-idx1-ubyte: header promises"):
        load_mnist(str(tmp_path))


def test_mnist_missing_file(tmp_path):
    make_mnist(tmp_path)
    (tmp_path / "t10k-images-idx3-ubyte").unlink()
    with pytest.raises(DataError, match=r"t10k-images-idx3-ubyte\[\.gz\]: missing"):
        load_mnist(str(tmp_path))


def write_cifar(directory, per_batch=3, skip=None):
    rng = np.random.default_rng(1)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        if name == skip:
            continue
        batch = {
            b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            b"labels": list(rng.integers(0, 10, per_batch).tolist()),
            b"batch_label": b"x",
        }
        with open(directory / name, "wb") as handle:
            pickle.dump(batch, handle, protocol=2)


def test_cifar_pickles(tmp_path):
    write_cifar(tmp_path)
    data = load_cifar10(str(tmp_path))
    assert data.x_train.shape == (15, 3, 32, 32) and data.x_test.shape == (3, 3, 32, 32)
    with open(tmp_path / "data_batch_1", "rb") as handle:
        raw = pickle.load(handle, encoding="bytes")
    # channel-major rows: the first 1024 bytes are the red plane of image 0
    assert torch.allclose(
        data.x_train[0, 0].flatten(), torch.tensor(raw[b"data"][0, :1024] / 255.0).float()
    )


def test_cifar_missing_batch_and_unsafe_pickle(tmp_path):
    write_cifar(tmp_path, skip="data_batch_3")
    with pytest.raises(DataError, match="data_batch_3: missing CIFAR-10 batch file"):
        load_cifar10(str(tmp_path))
    write_cifar(tmp_path)
    with open(tmp_path / "data_batch_3", "wb") as handle:
        pickle.dump({"data": __import__("os").getcwd}, handle)  # would call a function on load
    with pytest.raises(DataError, match="data_batch_3: not a CIFAR-10 python pickle batch"):
        load_cifar10(str(tmp_path))


def test_npz_layouts_and_missing_arrays(tmp_path):
    path = tmp_path / "d.npz"
    rng = np.random.default_rng(2)
    np.savez(
        path,
        x_train=rng.integers(0, 256, (5, 8, 8, 3), dtype=np.uint8),
        y_train=np.arange(5),
        x_test=rng.integers(0, 256, (2, 8, 8, 3), dtype=np.uint8),
        y_test=np.array([0, 1]),
    )
    data = load_npz(str(path))
    assert data.x_train.shape == (5, 3, 8, 8) and data.num_classes == 5
    np.savez(path, x_train=np.zeros((4, 7)), y_train=np.zeros(4, dtype=int))
    with pytest.raises(DataError, match="d.npz: missing array.*x_test, y_test"):
        load_npz(str(path))
    np.savez(
        path,
        x_train=np.zeros((4, 7)),
        y_train=np.zeros(3, dtype=int),
        x_test=np.zeros((1, 7)),
        y_test=np.zeros(1, dtype=int),
    )
    with pytest.raises(DataError, match="x_train has 4 examples but y_train 3 labels"):
        load_npz(str(path))


@pytest.mark.parametrize("arrays, needle", [
    ({"y_train": np.array([0, 1, 2, 255])}, "labels go up to 255 but classes 3, 4, 5, 6, 7 ... never occur"),
    ({"y_test": np.array([0, 9]), "x_test": np.zeros((2, 2))}, "labels go up to 9 but classes 3, 4, 5, 6, 7 ... never occur"),
    ({"y_train": np.array([0, 1, 2, 5]), "num_classes": np.array(4)}, "y_train holds label 5 but num_classes is 4"),
    ({"x_train": np.array([[0.0, np.nan], [1, 2], [3, 4], [5, 6]])}, "x_train holds NaN or inf in 1 example"),
    ({"x_test": np.array([[np.inf, 0.0]])}, "x_test holds NaN or inf in 1 example"),
    ({"x_train": np.array([["a", "b"]] * 4)}, "x_train has dtype <U1; inputs must be real numbers"),
    ({"y_train": np.array([0.0, 1.0, 2.0, 1.0])}, "y_train must be a 1-D array of integer class ids"),
    ({"y_train": np.array([0, -1, 2, 1])}, "y_train holds negative labels (-1)"),
    ({"x_test": np.zeros((1, 3))}, "x_train has shape (2,) per example but x_test (3,)"),
])
def test_npz_that_would_train_on_wrong_data_is_refused(tmp_path, arrays, needle):
    """Out-of-range labels, NaN/inf inputs, wrong dtypes and shapes: refused before training,
    naming the array (a stray label would otherwise widen the output layer silently)."""
    path = tmp_path / "d.npz"
    base = {"x_train": np.zeros((4, 2)), "y_train": np.array([0, 1, 2, 1]),
            "x_test": np.zeros((1, 2)), "y_test": np.array([2])}
    np.savez(path, **(base | arrays))
    with pytest.raises(DataError) as caught:
        load_npz(str(path))
    assert needle in str(caught.value) and "\n" not in str(caught.value)
    np.savez(path, **base, num_classes=np.array(5))  # a class that never occurs, declared
    assert load_npz(str(path)).num_classes == 5


def test_digits_load_unnormalised():
    """Loading does not normalise: statistics of the whole training set would leak later
    mega-batches into early stages (the learner normalises with the arrived ones)."""
    data = load_vision_data("digits")
    assert data.x_train.shape[1:] == (1, 8, 8) and data.num_classes == 10
    assert data.x_train.shape[0] + data.x_test.shape[0] == 1797
    assert float(data.x_train.min()) == 0.0 and float(data.x_train.max()) == 1.0  # pixels / 16
    with pytest.raises(UsageError, match="--vision-dataset mnist needs a path"):
        load_vision_data("mnist")


def test_augmentation_shapes_determinism_and_content():
    images = torch.arange(2 * 3 * 6 * 6, dtype=torch.float32).view(2, 3, 6, 6)
    a = random_crop_flip(images, torch.Generator().manual_seed(5))
    b = random_crop_flip(images, torch.Generator().manual_seed(5))
    assert a.shape == images.shape and torch.equal(a, b)
    # padding 0: only flips remain, so every output is the image or its mirror
    out = random_crop_flip(images, torch.Generator().manual_seed(0), padding=0)
    for i in range(2):
        assert torch.equal(out[i], images[i]) or torch.equal(out[i], images[i].flip(-1))
    # with padding, every output pixel is an input pixel of the same image/channel or the fill
    fill = torch.tensor([-1.0, -2.0, -3.0])
    out = random_crop_flip(images, torch.Generator().manual_seed(1), padding=4, fill=fill)
    for i in range(2):
        for c in range(3):
            allowed = set(images[i, c].flatten().tolist()) | {float(fill[c])}
            assert set(out[i, c].flatten().tolist()) <= allowed
