"""Recording one norm call for the C++ replay (replay.cpp): what it allocates and what it launches.

The Python path runs once per call signature (the key replay.cpp builds: device, M, N, eps, flags, each
tensor's dtype, 16-byte alignment and row stride, which inputs share an address) with two observers on this
thread: a TorchDispatchMode that sees every aten op, and `kernels.launch.recording`, where every Launcher
reports its launches. A call is replayable when its ops are only allocations (`empty`, `empty_like`,
`empty_strided`; `detach` aside) and its launches take nothing but the call's tensors, those allocations and
scalars, on kernels the replay can launch (plain `cuLaunchKernel`: one CTA a program, no cooperative grid, no
scratch buffers). Anything else, e.g. a `contiguous()` copy or a persistent workspace, leaves the signature to
the Python path. The replay then allocates the same buffers and launches the same compiled kernels with the
new call's addresses: bitwise the Python path's results.
"""

import threading
from typing import Callable

import torch

from .. import _torch_compat
from ..kernels import launch

TORCH_OPS = "torch ops other than allocations"
ALLOC_BASE = 8  # roles: the call's inputs by position, then its allocations (replay.cpp's kAllocBase)
_ALLOCATING = frozenset((torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default,
                         torch.ops.aten.empty_strided.default))
# Ops that neither write nor read data (on the GPU path a tensor that needs grad gets detached on its way in):
# a launch that took their result would name a tensor that is no input or allocation, and be refused.
_HARMLESS = frozenset((torch.ops.aten.detach.default,))


class _AtenOps(_torch_compat.aten_op_mode()):
    """The aten ops a call runs on this thread: allocations kept (in order), anything else noted."""

    def __init__(self):
        super().__init__()
        self.allocations, self.others = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATING:
            self.allocations.append(out)
        elif func not in _HARMLESS:
            self.others.append(func)
        return out


def record(inputs: tuple, run: Callable[[], tuple]):
    """Run `run()` (the Python path on `inputs`), returning (its outputs, the spec of `add_spec`'s arguments
    after the key and the replay flag, or why the call is not replayable: a string)."""
    ops = _AtenOps()
    thread = threading.get_ident()
    launch.recording[thread] = launches = []
    try:
        with ops:
            outputs = run()
    finally:
        del launch.recording[thread]
    if ops.others:
        return outputs, f"{TORCH_OPS}: {sorted(set(map(str, ops.others)))}"
    try:
        return outputs, _spec(inputs, outputs, launches, ops.allocations)
    except Exception as error:  # e.g. a scalar that does not pack: the call stays the Python path's
        return outputs, f"cannot describe the launches: {type(error).__name__}: {error}"


def _spec(inputs, outputs, launches, allocations):
    # Tensors are named by what they are (address, dtype, shape, strides), not by Python object: the object an
    # allocation returns to its caller need not be the one the dispatch mode saw. Fresh allocations never share
    # an address with a live input; inputs that do (the same grad passed twice) share the first one's role,
    # which is right for every replay of this key (replay.cpp keys which inputs share an address).
    roles = {}
    for i, t in enumerate(inputs):
        if t is not None:
            roles.setdefault(_identity(t), i)
    allocs = []
    for t in allocations:
        if roles.setdefault(_identity(t), ALLOC_BASE + len(allocs)) != ALLOC_BASE + len(allocs):
            return "an allocation that cannot be told from another tensor (empty?)"
        allocs.append((list(t.shape), list(t.stride()), t.dtype))
    recorded = []
    for launcher, compiled, grid, args in launches:
        launched = launch.replay_args(launcher, compiled, grid, args, lambda t: roles.get(_identity(t)))
        if isinstance(launched, str):
            return f"{getattr(launcher.kernel, '__name__', 'a kernel')}: {launched}"
        recorded.append(launched)
    output_roles = []
    for t in outputs:
        role = -1 if t is None else roles.get(_identity(t))
        if role is None:
            return "an output that is neither an input nor an allocation"
        output_roles.append(role)
    return allocs, recorded, output_roles


def _identity(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.dtype, tuple(t.shape), t.stride()
