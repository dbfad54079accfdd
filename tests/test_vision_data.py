"""Vision loaders on tiny files written here, their one-line errors, and the augmentation."""

from __future__ import annotations

import contextlib
import gzip
import os
import pickle
import struct

import numpy as np
import pytest
import torch

from fairseq_alma.errors import DataError, UsageError
from fairseq_alma.stream.progress import StreamPlan
from fairseq_alma.stream.run_dir import RunDirectory
from fairseq_alma.vision.augment import random_crop_flip
from fairseq_alma.vision.data import load_vision_data
from fairseq_alma.vision.data_cifar import load_cifar10
from fairseq_alma.vision.data_idx import load_mnist
from fairseq_alma.vision.data_npz import load_npz
from fairseq_alma.vision.dataset import MAX_CLASSES, VisionData, from_arrays
from fairseq_alma.vision.learners import LearnerSpec
from fairseq_alma.vision.runner import VisionRun, run_vision_stream
from fairseq_alma.vision.stage_trainer import StageTrainConfig
from fairseq_alma.vision.stream_stage import check_validation_parts, make_partition


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
    # finite in float64, inf in the float32 the model computes in
    ({"x_train": np.array([[0.0, 1e39], [1, 2], [3, 4], [5, 6]])},
     "x_train holds values beyond float32's range (about 3.4e38) in 1 example(s)"),
    ({"x_test": np.full((1, 2), np.longdouble(np.finfo(np.float64).max))},
     "x_test holds values beyond float32's range (about 3.4e38) in 1 example(s)"),
    ({"x_train": np.array([[np.nan, 1e39], [1, 2], [3, 4], [5, 6]])},
     "x_train holds NaN or inf in 1 example"),
    ({"y_train": np.array(1)},
     "y_train must be a 1-D array of integer class ids (got dtype int64, shape ())"),
    ({"x_train": np.zeros((4, 0)), "x_test": np.zeros((1, 0))},
     "x_train has shape (4, 0), no input values per example"),
    ({"y_train": np.zeros(4, dtype=int), "y_test": np.array([0])}, "every label is 0, a single "
                                                                   "class"),
    ({"y_train": np.array([0, 1, 2, 1]), "num_classes": np.array(1)},
     "num_classes must be one integer in [2, 1048576]"),
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


@contextlib.contextmanager
def _address_space_limit(extra_bytes: int):
    """At most ``extra_bytes`` more virtual memory in this block (Linux): code that would size
    a set by a label's value then fails with MemoryError instead of swapping the machine."""
    resource = pytest.importorskip("resource")
    with open("/proc/self/statm") as handle:
        used = int(handle.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = used + extra_bytes
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_huge_label_is_refused_in_one_line_without_sizing_anything_by_it():
    """A -1 'unlabelled' marker stored as uint32 (4294967295): listing the absent classes used to
    build set(range(4294967296)), tens of GB.  Now labels beyond MAX_CLASSES are refused and the
    absent-class check costs O(N) whatever the labels' values."""
    x = np.zeros((4, 2), dtype=np.float32)
    with _address_space_limit(1 << 30), pytest.raises(DataError) as caught:
        from_arrays("t", x, np.array([0, 1, 0xFFFFFFFF, 1], np.uint32), x[:1], np.array([0]))
    assert "y_train holds label 4294967295, beyond the 1048576 classes supported" in str(
        caught.value)
    absent = r"labels go up to 1048575 but classes 2, 3, 4, 5, 6 \.\.\."
    with pytest.raises(DataError, match=absent):
        from_arrays("t", x, np.array([0, 1, MAX_CLASSES - 1, 1]), x[:1], np.array([0]))


@pytest.mark.parametrize("shape, loaded", [
    ((3, 8, 8), (3, 8, 8)), ((8, 8, 3), (3, 8, 8)), ((1, 8, 8), (1, 8, 8)),
    ((8, 8, 1), (1, 8, 8)), ((8, 8), (1, 8, 8)), ((5,), (5,)),
])
def test_npz_image_layouts_accepted(tmp_path, shape, loaded):
    path = tmp_path / "d.npz"
    x = np.arange(2 * int(np.prod(shape)), dtype=np.float32).reshape(2, *shape)
    np.savez(path, x_train=x, y_train=np.array([0, 1]), x_test=x[:1], y_test=np.array([1]))
    data = load_npz(str(path))
    assert data.input_shape == loaded
    if shape[-1] == 3 and len(shape) == 3:  # channel-last: pixel (0, 1, 2) of channel 2
        assert float(data.x_train[0, 2, 1, 2]) == float(x[0, 1, 2, 2])


@pytest.mark.parametrize("shape, needle", [
    ((32, 32, 4), "has no channel axis of size 1 or 3"),  # RGBA: was 32 channels of 32x4
    ((3, 5, 3), "is ambiguous (channels first or last?)"),
    ((4, 8, 8), "has no channel axis of size 1 or 3"),
])
def test_npz_image_layout_that_cannot_be_told_is_refused(tmp_path, shape, needle):
    path = tmp_path / "d.npz"
    x = np.zeros((2, *shape), dtype=np.uint8)
    np.savez(path, x_train=x, y_train=np.array([0, 1]), x_test=x[:1], y_test=np.array([1]))
    with pytest.raises(DataError) as caught:
        load_npz(str(path))
    message = str(caught.value)
    assert needle in message and "(N, C, H, W) / (N, H, W, C) images with C in {1, 3}" in message
    assert message.startswith(f"{path}: x_train has shape (2, {', '.join(map(str, shape))})")


def test_npy_file_given_as_npz_says_what_is_needed(tmp_path):
    path = tmp_path / "plain.npy"
    np.save(path, np.zeros((3, 3)))
    with pytest.raises(DataError, match=r"plain.npy: a single .npy array; --vision-dataset npz "
                                        r"needs an .npz archive holding x_train, y_train"):
        load_vision_data("npz", str(path))


def _corrupt_codec(raw: bytes) -> bytes:
    return raw.replace(b"latin1", b"fatin1", 1)  # numpy arrays pickle via _codecs.encode


@pytest.mark.parametrize("change, needle", [
    ({b"labels": ["cat", "dog", "cat"]}, "'labels' must be a list of integer class ids 0..9, got "
                                         "dtype <U3"),
    ({b"labels": None}, "'labels' must be a list of integer class ids 0..9, got dtype object"),
    ({b"labels": [0.5, 1.5, 2.0]}, "'labels' must be a list of integer class ids 0..9, got dtype "
                                   "float64"),  # int(0.5) was class 0
    ({b"data": [[1, 2], [3]]}, "'data' is not a rectangular array"),
    (_corrupt_codec, "not a CIFAR-10 python pickle batch (LookupError: unknown encoding: fatin1)"),
    (lambda raw: raw[:2] + b"\x96" + b"\xff" * 8 + raw[2:],
     "not a CIFAR-10 python pickle batch (OverflowError"),
])
def test_damaged_cifar_batch_is_one_line_naming_the_file(tmp_path, change, needle):
    write_cifar(tmp_path)
    path = tmp_path / "data_batch_2"
    if callable(change):
        path.write_bytes(change(path.read_bytes()))
    else:
        with open(path, "rb") as handle:
            batch = pickle.load(handle, encoding="bytes")
        with open(path, "wb") as handle:
            pickle.dump(batch | change, handle, protocol=2)
    with pytest.raises(DataError) as caught:
        load_cifar10(str(tmp_path))
    assert str(caught.value).startswith(f"{path}: ") and needle in str(caught.value)
    assert "\n" not in str(caught.value)


def _tiny(n: int) -> VisionData:
    x = np.arange(n * 2, dtype=np.float32).reshape(n, 2)
    return from_arrays("tiny", x, np.arange(n) % 2, x[:2], np.array([0, 1]))


@pytest.mark.parametrize("n, plan, fraction, method, needle", [
    # 4-example mega-batches: 10% rounds to 0, --wait auto divided by 0 at its first decision
    (40, StreamPlan(10, "auto"), 0.1, "sm", "--wait auto would have none to decide on at "
                                            "arrival 1; use --num-megabatches 8 or fewer, or "
                                            "--valid-fraction 0.13 or more"),
    (45, StreamPlan(10, "auto"), 0.1, "sm", "a --wait auto stage on mega-batch 5 alone would "
                                            "have none"),
    (40, StreamPlan(4, "auto"), 0.0, "sm", "--wait auto decides on the validation parts"),
    # fixed --wait: the stage silently kept its last epoch
    (40, StreamPlan(10, 2), 0.1, "sm", "stage 1 (mega-batches [0, 1]) would have none for its "
                                       "best-epoch selection"),
    (45, StreamPlan(10, 1), 0.1, "sm", "stage 6 (mega-batches [5]) would have none"),
    (40, StreamPlan(4, 1), 0.0, "gmoe", "--vision-method gmoe picks the expert to split"),
    # accepted: every stage's validation data is non-empty, or none is asked for
    (45, StreamPlan(10, 1, replay=True), 0.1, "sm", None),
    (45, StreamPlan(10, "auto", replay=True), 0.1, "sm", None),
    (40, StreamPlan(4, 1), 0.0, "sm", None),
    (40, StreamPlan(4, 4), 0.0, "gmoe", None),
])
def test_stream_needing_validation_data_it_lacks_is_refused(n, plan, fraction, method, needle):
    data = _tiny(n)
    partition = make_partition(data, plan, seed=0, valid_fraction=fraction)
    if needle is None:
        check_validation_parts(data, partition, plan, fraction, method)
        return
    with pytest.raises(UsageError) as caught:
        check_validation_parts(data, partition, plan, fraction, method)
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_wait_auto_without_validation_stops_before_training(tmp_path):
    """Through the runner: refused before the first stage, no record written."""
    run = VisionRun(dataset="npz", data_path=None, plan=StreamPlan(10, "auto"),
                    learner=LearnerSpec("sm", "mlp", 2, seed=0),
                    training=StageTrainConfig(epochs=1), seed=0)
    with RunDirectory.for_training(tmp_path / "run") as run_dir, \
            pytest.raises(UsageError, match="--valid-fraction 0.1 rounds to 0 validation"):
        run_vision_stream(run, run_dir, _tiny(40))
    assert not (tmp_path / "run" / "stream.jsonl").exists()


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
