"""kernels/launch.py: every property Triton specializes an argument on must change the launch
cache's key, or a kernel compiled for one argument would be reused for another; a Launcher's
constexprs must match its kernel's."""

import inspect

import pytest
import torch
import triton.language as tl
from triton.runtime.jit import JITFunction

from shardnorm.kernels.launch import Launcher, _key, _spec


def test_tensor_key_has_dtype_and_alignment():
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert _spec(base) != _spec(base[1:])  # 2-byte offset: not 16-byte aligned
    assert _spec(base) == _spec(base[8:])  # 16-byte offset: aligned again
    assert _spec(base) != _spec(base.float())


def test_int_key_has_one_divisibility_and_width():
    assert _spec(1) != _spec(17)
    assert _spec(16) == _spec(48) != _spec(40)
    assert _spec(2**31 - 16) != _spec(2**31)  # i32 vs i64
    assert _spec(2**63 - 16) != _spec(2**63)  # i64 vs u64
    assert _spec(None) != _spec(0.5)


def test_inlined_key_is_the_specs():
    """The launch key (`_key`, inlined for host time) is the device and each argument's `_spec`."""
    base = torch.randn(64, dtype=torch.bfloat16)
    sub = type("Sub", (torch.Tensor,), {})
    args = (base, base[1:], base[8:].float(), None, 1, 17, 48, -16, 2**31, 2**63, True, False, 0.5, 0,
            torch.nn.Parameter(base[1:]), base[1:].as_subclass(sub))  # exact types take a fast path, others _spec
    assert _key(3, args) == (3, *map(_spec, args))
    assert len(set(_key(0, (a,)) for a in (base, base[1:], 1, 17, 16, 2**31, None, 0.5))) == 8


def test_launch_hooks_are_seen():
    from triton import knobs

    from shardnorm.kernels.launch import _installed

    assert not _installed(None)
    assert _installed(lambda *a: None)
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "calls"):  # a HookChain: empty by default, installed once a hook is added
        assert not _installed(hook)
        probe = lambda *a: None  # noqa: E731
        hook.add(probe)
        try:
            assert _installed(hook)
        finally:
            hook.remove(probe)


def _kernel_source(X, N, BLOCK: tl.constexpr, EVEN: tl.constexpr):
    pass


def _constexpr_first(BLOCK: tl.constexpr, X, N):
    pass


def test_launcher_checks_constexprs():
    """A Launcher appends the constexpr values after the runtime arguments in signature order, so it
    must be given exactly the kernel's constexprs, and they must come last in its signature."""
    kernel = JITFunction(_kernel_source)  # a compiled-mode kernel even under TRITON_INTERPRET
    assert Launcher(kernel, 4, BLOCK=64, EVEN=True).trailing == (64, True)
    assert Launcher(kernel, 4, EVEN=False, BLOCK=32).trailing == (32, False)  # signature order
    with pytest.raises(TypeError, match="EVEN"):
        Launcher(kernel, 4, BLOCK=64)
    with pytest.raises(TypeError, match="BLOCK"):
        Launcher(JITFunction(_constexpr_first), 4, BLOCK=64)


def _three_args(X, Y, N, BLOCK: tl.constexpr):
    pass


def test_derived_arguments_are_left_out_of_the_key(monkeypatch):
    """A Launcher keys only the arguments not marked derived (buffers its caller allocates), and still
    passes every argument to the kernel; any change of a keyed argument's specialization misses."""
    from shardnorm.kernels import launch

    class Active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 0)

    monkeypatch.setattr(launch, "driver", type("Driver", (), {"active": Active()}))
    launcher = Launcher(JITFunction(_three_args), 4, derived=(1,), BLOCK=16)
    runs, misses = [], []

    class Compiled:
        function = packed_metadata = None

        @staticmethod
        def run(*args):
            runs.append(args[-4:])

        @staticmethod
        def launch_metadata(*args):
            return None

    monkeypatch.setattr(JITFunction, "__getitem__", lambda self, grid: lambda *a, **k: misses.append(a) or Compiled)
    x = torch.randn(40, dtype=torch.bfloat16)
    launcher((1,), x, torch.empty(8), 8)  # miss: compiles (here: records) and remembers
    assert len(misses) == 1 and list(launcher.compiled) == [_key(0, (x, 8))]
    y = torch.empty(9)[1:]  # misaligned, a derived position: same key, launched with it
    launcher((1,), x, y, 8)
    assert len(misses) == 1 and runs[-1][0] is x and runs[-1][1] is y and runs[-1][2:] == (8, 16)  # the tensors
    monkeypatch.setattr(launch, "_installed", lambda hook: True)  # a profiler's hook: it gets the tensors
    launcher((1,), x, y, 8)
    assert runs[-1][0] is x and runs[-1][1] is y
    launcher((1,), x[1:], y, 8)  # a keyed tensor misaligned: a new key
    launcher((1,), x, y, 16)  # a keyed int now divisible by 16: a new key
    assert len(misses) == 3


def _plan_launchers():
    """Every Launcher of the forward and backward plans of a few shapes (portable kernels; CPU plans)."""
    import importlib

    fwd = importlib.import_module("shardnorm.kernels.norm_fwd")
    bwd = importlib.import_module("shardnorm.kernels.norm_bwd")
    cpu = torch.device("cpu")
    plans = [fwd._FwdPlan(n, 2, True, bias, residual, rms, False, cpu) for n in (1024, 65536)
             for bias in (False, True) for residual in (False, True) for rms in (False, True)]
    plans += [bwd._BwdPlan(n, torch.bfloat16, bias, dz, rms, False, cpu, "") for n in (1024, 65536)
              for bias in (False, True) for dz in (False, True) for rms in (False, True)]
    return [launcher for plan in plans for launcher in vars(plan).values() if isinstance(launcher, Launcher)]


def test_plans_leave_out_of_the_key_only_outputs_and_plan_constants():
    """A plan's Launchers key every argument whose specialization a call can change: the unkeyed ones are the
    buffers the plan allocates and N, K, the tile count and eps, which the plan fixes (it is built per N)."""
    fixed = {"N", "K", "NUM_SUM_TILES", "eps"}
    allocated = {"norm_fwd_kernel": {"Y", "Z", "MEAN", "RSTD"}}  # the backward's: its outputs and fp32 buffers
    launchers = _plan_launchers()
    assert {launcher.kernel.fn.__name__ for launcher in launchers} == {
        "norm_fwd_kernel", "norm_bwd_kernel", "row_sums_kernel", "dx_kernel", "column_sum_kernel"}
    for launcher in launchers:
        names = list(inspect.signature(launcher.kernel.fn).parameters)
        unkeyed = {names[i] for i in launcher.derived}
        buffers = allocated.get(launcher.kernel.fn.__name__, {"DX", "DW_OUT", "DB_OUT", "ROW_SUMS", "PARTIAL", "OUT_W",
                                                               "OUT_B"})
        assert unkeyed <= fixed | buffers, (launcher.kernel.fn.__name__, unkeyed - fixed - buffers)


def _compiled_mode(kernel):
    """The kernel as a JITFunction (under TRITON_INTERPRET=1 @triton.jit gives an InterpretedFunction)."""
    return kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)


def _random_launches(kernel, rng, count):
    """`count` runtime-argument tuples for `kernel`: tensors of three dtypes at 16-byte aligned and misaligned
    offsets (Tensor or Parameter) or None for pointers, ints around Triton's boundaries (1, multiples of 16, the
    i32/i64/u64 ranges), floats for eps."""
    base = torch.zeros(64)
    tensors = [base.to(dtype)[offset:] for dtype in (torch.bfloat16, torch.float16, torch.float32) for offset in (0, 1, 8)]
    tensors += [torch.nn.Parameter(t) for t in tensors[:3]] + [None]
    ints = [0, 1, 2, 16, 17, 48, -16, -1, 2**31 - 16, 2**31 - 1, 2**31, 2**40, 2**40 + 8, 2**63 - 16, 2**63, 2**64 - 16]
    runtime = [p for p in kernel.params if not p.is_constexpr]
    pick = lambda p: (rng.choice(tensors) if p.name.isupper() and p.name not in ("M", "N", "P", "K")  # noqa: E731
                      else rng.choice([1e-5, 0.5]) if p.name == "eps" else rng.choice(ints))
    return [tuple(pick(p) for p in runtime) for _ in range(count)]


def _coarser_than_triton(key, kernel, launches):
    """Launches that `key` maps to one cache entry although Triton specializes them differently."""
    from triton.backends.compiler import GPUTarget

    from shardnorm.kernels.launch import triton_specialization

    constexprs = {p.name: 1 for p in kernel.params if p.is_constexpr}
    seen, found = {}, []
    for args in launches:
        spec = triton_specialization(kernel, GPUTarget("cuda", 90, 32), args, constexprs)
        first = seen.setdefault(key(args), (spec, args))
        if first[0] != spec:
            describe = lambda a: f"{a.dtype} at {a.data_ptr() % 16} mod 16" if isinstance(a, torch.Tensor) else a  # noqa: E731
            found.append([(s, [describe(a) for a in launch]) for s, launch in (first, (spec, args))])
    return found, len(seen)


def _kernels():
    import importlib

    fwd = importlib.import_module("shardnorm.kernels.norm_fwd")
    bwd = importlib.import_module("shardnorm.kernels.norm_bwd")
    return [fwd.norm_fwd_kernel, bwd.norm_bwd_kernel, bwd.row_sums_kernel, bwd.dx_kernel, bwd.column_sum_kernel]


@pytest.mark.parametrize("kernel", _kernels(), ids=lambda k: k.__name__)
def test_key_is_at_least_as_fine_as_tritons_specialization(kernel):
    """Two launches of a shardnorm kernel that share a launch-cache key get the same specialization from Triton's
    own binder (divisibility by 16, ints equal to 1, integer widths, dtypes, None), so a cached kernel is never run
    where Triton would have compiled another. A key without alignment is caught (the check can fail)."""
    import random

    seed = random.randrange(2**32)
    print(f"seed {seed}")
    kernel, rng = _compiled_mode(kernel), random.Random(seed)
    bases, others = _random_launches(kernel, rng, 40), _random_launches(kernel, rng, 40)
    # each base launch, and it with one argument taken from another launch (often one of the same key: 16 and 48,
    # offsets 0 and 8, a Parameter for a Tensor)
    launches = [v for base, other in zip(bases, others) for i in range(len(base))
                for v in (base, base[:i] + other[i:i + 1] + base[i + 1:])]
    coarser, keys = _coarser_than_triton(lambda args: _key(0, args), kernel, launches)
    assert not coarser, f"seed {seed}: one launch-cache key, two Triton specializations: {coarser[0]}"
    assert keys < len(launches)  # some launches shared a key

    def without_alignment(args):
        return tuple(a.dtype if isinstance(a, torch.Tensor) else _spec(a) for a in args)

    assert _coarser_than_triton(without_alignment, kernel, launches)[0], f"seed {seed}"
