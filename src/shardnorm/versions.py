"""The torch and Triton releases shardnorm runs on, checked when the package is imported: an older release
stops `import shardnorm` with both versions named, rather than failing later inside a kernel or a hook.
"""

import re
from importlib import metadata

# the oldest releases the suite runs on: torch 2.11 (FSDP2's public `fully_shard`, the internals _torch_compat
# reads), Triton 3.6 (`triton.knobs`, the Gluon kernels)
TORCH_FLOOR = (2, 11)
TRITON_FLOOR = (3, 6)
# the distributions that install the `triton` module (PyTorch's ROCm builds ship it under another name)
TRITON_DISTRIBUTIONS = ("triton", "pytorch-triton", "pytorch-triton-rocm")


def release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '2.11.0+cu130' or '3.6.0.dev20260101'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ImportError(f"shardnorm cannot read the release of version {version!r}")
    return int(match[1]), int(match[2])


def check(package: str, installed: str, floor: tuple[int, int]) -> None:
    """Raise ImportError naming the installed and the needed version when `installed` is below `floor`."""
    if release(installed) < floor:
        needed = ".".join(map(str, floor))
        raise ImportError(f"shardnorm needs {package}>={needed}, but {package} {installed} is installed: "
                          f"pip install '{package}>={needed}'")


def installed_triton() -> str | None:
    """The installed Triton's version, read without importing Triton; None where none is installed."""
    for distribution in TRITON_DISTRIBUTIONS:
        try:
            return metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return None


def check_installed() -> None:
    """Check the installed torch and Triton against the floors (Triton only where one is installed: without
    it the torch backend still runs, and the kernels' `import triton` names what is missing)."""
    import torch

    check("torch", torch.__version__, TORCH_FLOOR)
    triton_version = installed_triton()
    if triton_version is not None:
        check("triton", triton_version, TRITON_FLOOR)
