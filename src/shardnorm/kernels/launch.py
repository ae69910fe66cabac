"""Kernel launches that look the compiled kernel up in a cache of our own.

`kernel[grid](...)` costs ~38 us of host time per launch on the H100 machine, as long as a small norm's whole
kernel (docs/performance.md). A `Launcher` keys the compiled kernel on what Triton specializes a runtime
argument on, plus the device: at least as fine as Triton's key (tests/test_launch.py holds it to
`triton_specialization`), so a cached kernel is never reused where Triton would specialize differently. It
passes the tensors themselves, so Triton's launcher still checks that their memory is on a GPU. The
interpreter always takes the plain path. Triton's internals stay in this file.

Another GPU current: a launch goes to the current device and its current stream (Triton's driver), so the plans' entry
points (`norm_fwd`, `norm_bwd`) move to their tensors' GPU first where it is another one: a model spread over GPUs
in one process (HF's `device_map="auto"`) calls norms on cuda:1 while cuda:0 is current, and the launch would
otherwise run on cuda:0, out of order with cuda:1's stream (or fail in Triton's pointer check). The check costs a
`torch.cuda.current_device()` per call, 0.4 us of host time (`torch_current_device` in
results/h200-torch2.11-triton3.6/host_time_layers.md).
"""

import operator

from torch import Tensor
from torch.library import wrap_triton
from torch.nn import Parameter
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction


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
    """`kernel[grid](*args, num_warps=num_warps, **constexprs)` minus most of its host time (15.3 vs 21.8 us per
    launch on the H100 machine). constexprs: all the kernel's constexpr parameters, which follow its runtime
    ones; cooperative: launched as a cooperative grid. Built once per launch configuration, called with the
    runtime arguments. `derived`: positions of runtime arguments left out of the cache key because the caller
    fixes their specialization: buffers it allocates fresh (so 16-byte aligned) with a dtype fixed by the keyed
    arguments and the plan (y = empty_like(x)), and values the plan fixes (N, which a plan is built for; eps,
    always a Python float). Each keyed argument costs ~0.15 us of host time per launch."""

    def __init__(self, kernel, num_warps: int, cooperative: bool = False, derived: tuple = (), **constexprs):
        self.kernel = kernel
        self.options = dict(num_warps=num_warps)
        if cooperative:  # the driver's cooperative launch: all programs resident at once, or an error
            self.options["launch_cooperative_grid"] = True
        self.constexprs = constexprs
        self.derived = derived
        self.compiled = {}  # (device, *argument specs) -> CompiledKernel
        self.jit = isinstance(kernel, JITFunction)
        if self.jit:  # not the interpreter's InterpretedFunction
            names = [p.name for p in kernel.params if p.is_constexpr]
            if set(names) != constexprs.keys() or kernel.arg_names[-len(names):] != names:
                raise TypeError(f"{kernel.__name__} takes trailing constexprs {names}, got {list(constexprs)}")
            self.trailing = tuple(constexprs[name] for name in names)
            kept = [i for i in range(len(kernel.arg_names) - len(names)) if i not in derived]
            self.keyed = operator.itemgetter(*kept) if derived and len(kept) > 1 else None

    def __call__(self, grid: tuple, *args) -> None:
        if not self.jit:
            self.kernel[grid](*args, **self.options, **self.constexprs)
            return
        active = driver.active
        device = active.get_current_device()
        key = _key(device, args if self.keyed is None else self.keyed(args))
        compiled = self.compiled.get(key)
        if compiled is None:
            self.compiled[key] = self.kernel[grid](*args, **self.options, **self.constexprs)
            return
        stream = active.get_current_stream(device)
        grid3 = (grid[0], 1, 1) if len(grid) == 1 else (grid[0], grid[1], grid[2] if len(grid) > 2 else 1)
        enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if _installed(enter) or _installed(leave):  # e.g. a profiler's: what JITFunction.run passes them
            args = (*args, *self.trailing)  # tensors: launch_metadata may read them
            compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata,
                         compiled.launch_metadata(grid3, stream, *args), enter, leave, *args)
        else:  # building launch metadata nobody reads costs as much as the launch
            compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, None, None, None, *args,
                         *self.trailing)

    def traced(self, grid: tuple, *args) -> None:
        """This launch recorded through `torch.library.wrap_triton`, for the ops' bodies while torch.compile traces
        them: Inductor launches the kernel from its generated code, with this num_warps and these constexprs. The
        staged kernels (Gluon, cooperative grids, a persistent exchange buffer) are not launched this way
        (ops.py)."""
        wrap_triton(self.kernel)[grid](*args, **self.options, **self.constexprs)


def triton_specialization(kernel: JITFunction, target, args: tuple, constexprs: dict) -> tuple:
    """What JITFunction.run keys a compiled kernel on for a launch of `kernel` with runtime `args` (constexprs
    aside) on `target` (a `triton.backends.compiler.GPUTarget`; no GPU needed): one (type, attribute) per
    argument, e.g. ("*bf16", "D") for a 16-byte aligned bf16 tensor, ("constexpr", 1) for the int 1."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(target))
    return tuple(binder(*args, **constexprs)[1][:len(args)])


def _installed(hook) -> bool:
    """A launch hook is set: a callable, or (newer Triton) a HookChain with calls in it."""
    return hook is not None and bool(getattr(hook, "calls", True))
