"""Kernel launches that look the compiled kernel up in a cache of our own.

`kernel[grid](...)` binds and specializes every argument, reads Triton's knobs and builds a string
cache key before it launches: ~38 us of host time per launch on the H100 machine's CPU, of which
the launch itself is ~12 us (benchmarks/NOTES.md, v5). At small sizes a norm's whole kernel takes
that long, so a `Launcher` fixes a kernel's constexprs and launch options once and keys the compiled
kernel on what Triton specializes a runtime argument on (a tensor's dtype and 16-byte alignment; an
int's width, whether it is 1, whether 16 divides it) plus the device, and launches it as
JITFunction.run does after its own lookup. A key Triton has not seen goes through `kernel[grid]`
(which compiles or finds the kernel) and is remembered. The key is at least as fine as Triton's, so a
cached kernel is never reused where Triton would have specialized differently. The interpreter
(TRITON_INTERPRET=1) always takes the plain path.

A cached launch passes tensors as their addresses (INT_POINTERS): given a tensor, Triton's C launcher
calls its `data_ptr()` and then the driver (`cuPointerGetAttribute`) per pointer, which is also its only
check that the memory is on a GPU. So every tensor must reach a Launcher on the launch device already:
`functional._check` checks the forward's (weight, bias, residual against x), the autograd engine a
backward's incoming grads (dy, dz against the forward's outputs), and the custom ops their arguments
(`ops._check_devices`).
"""

import operator
import struct
import threading
from typing import Callable, Optional

import triton
from torch import Tensor
from torch.nn import Parameter
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

# Cached launches pass tensors as ints (data_ptr()); False passes the tensors, for an A/B of host time.
INT_POINTERS = True

# While host/record.py records a call on a thread: thread id -> the (launcher, compiled kernel, grid, runtime
# args) of every launch that thread makes (empty, and one dict lookup per launch, otherwise).
recording: dict = {}


def _spec(arg):
    """What Triton's specialization can depend on, for one runtime argument (`_key` inlines it)."""
    if isinstance(arg, Tensor):
        return arg.dtype, not arg.data_ptr() & 15
    if isinstance(arg, int):  # bool too: Triton types it i1, the value makes the key finer still
        return arg == 1, not arg & 15, -2**31 <= arg < 2**31, arg < 2**63
    return type(arg)  # None (a constexpr to Triton) or a float (always fp32)


# Exact types of the arguments passed on the fast paths below (`type(a) in` is ~2x cheaper than isinstance);
# subclasses (and bools) take `_spec` in the key, and stay tensors in a launch.
_TENSORS = frozenset((Tensor, Parameter))


def _key(device, args) -> tuple:
    """(device, *map(_spec, args)) without a Python call per argument: ~13 arguments per launch made
    the key most of a cached launch's host time."""
    return (device, *[(a.dtype, not a.data_ptr() & 15) if type(a) in _TENSORS else
                      (a == 1, not a & 15, -2**31 <= a < 2**31, a < 2**63) if type(a) is int else
                      type(a) if a is None or type(a) is float else _spec(a) for a in args])


class Launcher:
    """`kernel[grid](*args, num_warps=num_warps, num_ctas=num_ctas, **constexprs)` minus most of its
    host time. constexprs: all the kernel's constexpr parameters, which follow its runtime ones;
    num_ctas > 1 launches each program as a thread-block cluster of that many CTAs; cooperative, as a
    cooperative grid (the compiled kernel carries the flag, so the cached path keeps it). Built once per
    launch configuration (the launchers' plans hold them), called with the runtime arguments.

    `derived`: positions of runtime arguments left out of the cache key because the caller allocates
    them fresh (so 16-byte aligned) with a dtype and presence fixed by the keyed arguments and the
    plan, e.g. y = empty_like(x); each keyed tensor costs the key ~0.3 us of host time per launch."""

    def __init__(self, kernel, num_warps: int, num_ctas: int = 1, cooperative: bool = False, derived: tuple = (),
                 replayable: bool = True, **constexprs):
        self.kernel = kernel
        self.replayable = replayable  # False: its launches must not be replayed from C++ (host/record.py)
        self.options = dict(num_warps=num_warps, num_ctas=num_ctas) if num_ctas > 1 else dict(num_warps=num_warps)
        if cooperative:  # the driver's cooperative launch: all programs resident at once, or an error
            self.options["launch_cooperative_grid"] = True
        self.constexprs = constexprs
        self.compiled = {}  # (device, *argument specs) -> CompiledKernel
        if isinstance(kernel, JITFunction):  # not the interpreter's InterpretedFunction
            names = [p.name for p in kernel.params if p.is_constexpr]
            if set(names) != constexprs.keys() or kernel.arg_names[-len(names):] != names:
                raise TypeError(f"{kernel.__name__} takes trailing constexprs {names}, got {list(constexprs)}")
            self.trailing = tuple(constexprs[name] for name in names)
            kept = [i for i in range(len(kernel.arg_names) - len(names)) if i not in derived]
            self.keyed = operator.itemgetter(*kept) if derived and len(kept) > 1 else None

    def __call__(self, grid: tuple, *args) -> None:
        if not isinstance(self.kernel, JITFunction):
            if recording:  # no compiled kernel to replay: the recording is refused
                _record(self, None, grid, args)
            self.kernel[grid](*args, **self.options, **self.constexprs)
            return
        active = driver.active
        device = active.get_current_device()
        key = _key(device, args if self.keyed is None else self.keyed(args))
        compiled = self.compiled.get(key)
        if compiled is None:
            compiled = self.compiled[key] = self.kernel[grid](*args, **self.options, **self.constexprs)
            if recording:
                _record(self, compiled, grid, args)
            return
        if recording:
            _record(self, compiled, grid, args)
        stream = active.get_current_stream(device)
        grid3 = (grid[0], 1, 1) if len(grid) == 1 else (grid[0], grid[1], grid[2] if len(grid) > 2 else 1)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _installed(enter) or _installed(leave):  # e.g. a profiler's: what JITFunction.run passes them
            args = (*args, *self.trailing)  # tensors: launch_metadata may read them
            compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata(grid3, stream, *args), enter, leave, *args)
        else:  # building launch metadata nobody reads costs as much as the launch
            if INT_POINTERS:
                args = [a.data_ptr() if type(a) in _TENSORS else a for a in args]
            compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, None, None, None, *args,
                         *self.trailing)


def _record(launcher: "Launcher", compiled, grid: tuple, args: tuple) -> None:
    launches = recording.get(threading.get_ident())
    if launches is not None:
        launches.append((launcher, compiled, grid, args))


def _installed(hook) -> bool:
    """A launch hook is set: a callable, or (newer Triton) a HookChain with calls in it."""
    return hook is not None and bool(getattr(hook, "calls", True))


# ---- a launch as the C++ host path replays it (host/replay.cpp, recorded by host/record.py) ----------------

# Triton versions whose C launcher the replay mirrors: the kernel's non-constexpr arguments in order, then the
# scratch pointers it appends to every launch (global, profile), null where the kernel needs no scratch.
_REPLAY_SCRATCH_POINTERS = {"3.6": 2}


def replay_scratch_pointers() -> Optional[int]:
    """How many scratch pointers this Triton's launches end with, or None: a version the replay does not know."""
    return _REPLAY_SCRATCH_POINTERS.get(".".join(triton.__version__.split(".")[:2]))


def replay_args(launcher: Launcher, compiled, grid: tuple, args: tuple, role_of: Callable):
    """One recorded launch as `add_spec` takes it: (function, grid, threads, shared memory, scratch pointers,
    [(is_pointer, role or scalar bytes)]), tensors named by `role_of(tensor)`; or why the replay's plain
    cuLaunchKernel cannot stand in for Triton's launch (a string)."""
    if compiled is None:
        return "the interpreter's launch"
    if not launcher.replayable:
        return "a launcher with a workspace or a Gluon kernel"
    meta = compiled.metadata
    for field, value in (("num_ctas", 1), ("launch_cooperative_grid", False), ("launch_pdl", False),
                         ("global_scratch_size", 0), ("profile_scratch_size", 0)):
        if getattr(meta, field, value) != value:
            return f"{field} = {getattr(meta, field)}"
    if getattr(meta, "tensordesc_meta", None):
        return "tensor descriptors"
    params = []
    for (name, kind), arg in zip(compiled.src.signature.items(), args):  # the runtime args; constexprs follow
        if kind == "constexpr":  # declared constexprs, and None / ints of 1 that Triton specialized
            continue
        if kind.startswith("*"):
            role = role_of(arg) if isinstance(arg, Tensor) else None
            if role is None:
                return f"argument {name}: a tensor that is no input or allocation of the call"
            params.append((True, role))
        else:
            value = scalar_bytes(kind, arg)
            if value is None:
                return f"argument {name}: type {kind}"
            params.append((False, value))
    grid3 = tuple(grid) + (1,) * (3 - len(grid))
    return compiled.function, grid3, 32 * meta.num_warps, meta.shared, replay_scratch_pointers(), params


_FLOATS = {"fp32": "<f", "fp64": "<d", "fp16": "<e"}


def scalar_bytes(kind: str, value) -> Optional[int]:
    """A scalar argument of Triton type `kind` as the replay stores it: its little-endian bytes, zero-padded to
    8, read as a signed 64-bit int; None for a type it does not pack (bf16)."""
    if kind in _FLOATS:
        raw = int.from_bytes(struct.pack(_FLOATS[kind], value), "little")
    elif kind[0] in "iu" and kind[1:].isdigit():
        raw = int(value) & ((1 << int(kind[1:])) - 1)
    else:
        return None
    return raw - (1 << 64) if raw >= 1 << 63 else raw
