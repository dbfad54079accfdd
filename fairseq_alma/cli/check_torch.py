"""``make check-torch``: which torch is installed, which GPU it sees, and whether it has kernels
for that GPU.

Why: since torch 2.11, V100 (sm_70) kernels ship only in the CUDA 12.6 wheels; with another
build the first kernel fails with "no kernel image is available for execution on the device",
minutes into a job.  This checks ``torch.cuda.get_arch_list()`` against the GPU's compute
capability at install time and names the wheel to install instead.
"""

from __future__ import annotations

import sys

WHEELS = {  # compute capability major -> the CUDA wheel index that has kernels for it
    7: "https://download.pytorch.org/whl/cu126",  # V100 (sm_70), T4 (sm_75)
    8: "https://download.pytorch.org/whl/cu126",  # A100 (sm_80), A10/A40/3090 (sm_86)
    9: "https://download.pytorch.org/whl/cu126",  # H100/H200 (sm_90)
}


def missing_kernels(arch_list: list[str], capability: tuple[int, int]) -> bool:
    """True when the build has neither the GPU's own kernels (``sm_XY``) nor PTX it can compile
    (``compute_XY`` of an equal or lower capability within the same major version)."""
    major, minor = capability
    if f"sm_{major}{minor}" in arch_list:
        return False
    ptx = [a for a in arch_list if a.startswith("compute_")]
    return not any(int(a[len("compute_"):]) // 10 == major and int(a[len("compute_"):]) % 10 <= minor
                   for a in ptx)


def check(torch_module: object = None) -> str:
    """One line describing torch and the GPU; raises ``UsageError`` when kernels are missing."""
    import torch

    from ..errors import UsageError

    torch = torch_module or torch
    line = f"torch {torch.__version__}"
    if not torch.cuda.is_available():
        return line + " | no CUDA device visible: CPU only"
    capability = torch.cuda.get_device_capability(0)
    name = torch.cuda.get_device_name(0)
    arch_list = list(torch.cuda.get_arch_list())
    sm = f"sm_{capability[0]}{capability[1]}"
    if missing_kernels(arch_list, capability):
        wheel = WHEELS.get(capability[0], "a CUDA build that lists it in torch.cuda.get_arch_list()")
        raise UsageError(f"torch {torch.__version__} (CUDA {torch.version.cuda}) has no kernels for "
                         f"{name} ({sm}; it has {', '.join(arch_list) or 'none'}): install "
                         f"torch from {wheel} before make install")
    return line + f" | CUDA {torch.version.cuda} | {name} ({sm}) supported"


def main() -> int:
    from ..console import run_console

    return run_console("check-torch", lambda: print(check()))


if __name__ == "__main__":
    sys.exit(main())
