"""make check-torch: a GPU that torch has no kernels for is named, with the wheel to install."""

from types import SimpleNamespace

import pytest

from fairseq_alma.cli.check_torch import check, missing_kernels
from fairseq_alma.errors import UsageError


def fake_torch(arch_list, capability=(7, 0), name="Tesla V100-SXM2-32GB"):
    cuda = SimpleNamespace(is_available=lambda: True, get_device_capability=lambda i: capability,
                           get_device_name=lambda i: name, get_arch_list=lambda: arch_list)
    return SimpleNamespace(__version__="2.13.0", cuda=cuda, version=SimpleNamespace(cuda="12.8"))


def test_v100_without_sm70_kernels_is_refused_with_the_wheel_to_use():
    with pytest.raises(UsageError) as caught:
        check(fake_torch(["sm_80", "sm_90", "sm_100", "compute_100"]))
    message = str(caught.value)
    assert "no kernels for Tesla V100-SXM2-32GB (sm_70" in message and "cu126" in message


def test_supported_gpus_pass():
    assert "supported" in check(fake_torch(["sm_70", "sm_80", "sm_90"]))
    assert not missing_kernels(["sm_80", "compute_80"], (8, 6))  # PTX of the same major compiles
    assert missing_kernels(["sm_80", "compute_80"], (7, 0))
