"""Skips for the optional frameworks: not installed, or installed beside a torch older than they need (the GPU
image's torch 2.11 with torchtitan 0.3, which fails in its own imports there, as docs/integrations/torchtitan.md
says): neither is a defect of shardnorm's."""

import pytest
import torch
from torch.torch_version import TorchVersion

# the torch a framework needs beyond shardnorm's own floor: torchtitan 0.3 imports
# torch.distributed.fsdp.DataParallelMeshDims, which torch 2.11 lacks
TORCH_FLOORS = {"torchtitan": "2.13"}


def importorskip(package: str):
    """`pytest.importorskip(package)`, skipping also where this torch is older than the package needs."""
    floor = TORCH_FLOORS.get(package.split(".")[0])
    if floor is not None and TorchVersion(torch.__version__) < floor:
        pytest.skip(f"{package} needs torch >= {floor}; this is {torch.__version__}", allow_module_level=True)
    return pytest.importorskip(package)
