"""Every private torch API in shardnorm/_torch_compat.py still exists and still means what shardnorm relies on.

A torch upgrade that drops or changes one fails here, naming the internal, before it breaks the reducer,
FSDP checkpoints or the FSDP1 policy in some longer test.
"""

import pytest
import torch
import triton.language as tl
from spawn_ranks import DEVICE, rank_device, spawn
from torch import nn

from shardnorm import _torch_compat as compat


def _gone(internal: str) -> str:
    return (f"torch {torch.__version__}: {internal} is gone or changed meaning; update shardnorm/_torch_compat.py "
            f"(checked on torch {', '.join(compat.CHECKED_ON)})")


def test_ops_observed_by_dispatch_modes_and_the_tracer():
    """`ops_observed`: false in plain eager code; true under a TorchDispatchMode and while torch.jit.trace runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert not compat.ops_observed()
    with Mode():
        assert compat.ops_observed()
    seen = []
    torch.jit.trace(lambda t: seen.append(compat.ops_observed()) or t * 2, torch.ones(2), check_trace=False)
    assert seen == [True] and not compat.ops_observed()


def test_autograd_engine_task_id_and_end_of_backward_callback():
    """One task id per backward, the same for every hook of it; a queued callback runs after every grad
    of that backward was accumulated."""
    w1, w2 = (torch.randn(5, requires_grad=True) for _ in range(2))
    seen, ended = [], []

    def hook(grad):
        seen.append(compat.current_graph_task_id())
        if len(seen) % 2 == 1:
            compat.queue_backward_callback(lambda: ended.append((w1.grad is not None, w2.grad is not None)))
        return grad

    w1.register_hook(hook)
    w2.register_hook(hook)
    assert compat.current_graph_task_id() == -1, _gone("torch._C._current_graph_task_id (outside backward)")
    for _ in range(2):
        (w1 * w2 * torch.randn(5)).sum().backward()
    assert len(seen) == 4 and seen[0] == seen[1] and seen[2] == seen[3] and seen[0] != seen[2] \
        and -1 not in seen, _gone(f"torch._C._current_graph_task_id (ids {seen})")
    assert ended == [(True, True), (True, True)], _gone(
        f"Variable._execution_engine.queue_callback (ran {ended}: once per backward, after accumulation)")


def test_backward_reaches_only_the_leaves_it_accumulates_into():
    """Inside a backward: a leaf the backward accumulates a grad into is reached; not in `autograd.grad` or
    `backward(inputs=...)` without it."""
    w1, w2 = (torch.randn(5, requires_grad=True) for _ in range(2))
    seen = []

    def hook(grad):
        seen.append((compat.backward_reaches(w1), compat.backward_reaches(w2)))
        return grad

    def loss():
        return (w1 * w2 * torch.randn(5)).sum()

    w2.register_hook(hook)
    loss().backward()
    torch.autograd.grad(loss(), [w2])
    loss().backward(inputs=[w2])
    assert seen == [(True, True), (False, False), (False, True)], _gone(f"torch._C._will_engine_execute_node ({seen})")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.lin(x))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def test_fsdp1_wrap_policy_and_mixed_precision_hooks():
    """FSDP1 asks a policy for its units through `_run_policy(root, ignored, root_kwargs)`, which reads
    `_module_classes`; MixedPrecision still takes `_module_classes_to_ignore`."""
    model, asked = _Model(), []

    def choose(root, root_kwargs):
        asked.append(root)
        return (_Block,)

    policy = compat.deferred_module_wrap_policy(choose)
    try:
        units = policy._run_policy(model, set(), {})
    except AttributeError as e:
        raise AssertionError(_gone("ModuleWrapPolicy._run_policy")) from e
    assert asked == [model] and set(units) == set(model.blocks), _gone(
        f"ModuleWrapPolicy._run_policy / _module_classes (units {list(units)})")
    mp = compat.fsdp1_mixed_precision(torch.bfloat16, torch.float32, torch.bfloat16, (nn.LayerNorm,))
    assert mp._module_classes_to_ignore == (nn.LayerNorm,), _gone("MixedPrecision._module_classes_to_ignore")


def test_parallel_style_extension_point():
    """shardnorm's styles implement `ParallelStyle._apply`, the method `parallelize_module` calls."""
    from torch.distributed.tensor.parallel import ParallelStyle

    assert "_apply" in getattr(ParallelStyle, "__abstractmethods__", ()), _gone("ParallelStyle._apply")


def test_module_hooks_listed_and_backward_hooks_removed_by_owner():
    """The hook dicts of nn.Module list every hook by kind; removing the backward hooks one owner installed
    leaves the others registered and firing; a parameter shows its post-accumulate-grad hooks."""
    module, fired = nn.Linear(4, 4), []

    def theirs(m, grad_input, grad_output):
        fired.append("theirs")

    def ours(m, grad_input, grad_output):
        fired.append("ours")

    module.register_forward_pre_hook(lambda m, args: None)
    module.register_forward_hook(lambda m, args, out: None)
    module.register_full_backward_hook(theirs)
    module.register_full_backward_hook(ours)
    kinds = [kind for kind, _ in compat.module_hooks(module)]
    assert kinds == ["forward pre-hook", "forward hook", "backward hook", "backward hook"], _gone(
        f"nn.Module hook dicts (listed {kinds})")
    assert compat.remove_module_backward_hooks(module, installed_by=lambda hook: hook is theirs) == 1
    module(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert fired == ["ours"], _gone(f"nn.Module._backward_hooks (fired {fired})")
    assert [h for kind, h in compat.module_hooks(module) if kind == "backward hook"] == [ours]
    assert not compat.has_post_accumulate_grad_hooks(module.weight)
    module.weight.register_post_accumulate_grad_hook(lambda p: None)
    assert compat.has_post_accumulate_grad_hooks(module.weight), _gone("Tensor._post_accumulate_grad_hooks")


def _device_meshes(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(DEVICE, (1, 1, world_size), mesh_dim_names=("replicate", "shard", "cp"))
    flat = compat.flatten_mesh(mesh[("shard", "cp")], "shard_cp")
    assert flat.ndim == 1 and flat.size() == world_size and mesh["shard_cp"].size() == world_size, _gone(
        "DeviceMesh._flatten")
    hsdp = compat.concatenate_meshes([mesh["replicate"], flat])
    assert hsdp.ndim == 2 and hsdp.mesh_dim_names == ("replicate", "shard_cp"), _gone(
        f"DeviceMesh._concatenate (dims {hsdp.mesh_dim_names})")


@pytest.mark.distributed
def test_device_mesh_flatten_and_concatenate():
    """Several mesh dims flattened into one (FSDP over dp_shard x cp), and HSDP's 2-D mesh built from a
    replicate dim and that flattened dim."""
    spawn(_device_meshes, 1)


def _fsdp2_state(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    device = rank_device(rank)
    model = _Model().to(device)
    mesh = init_device_mesh(DEVICE, (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    params = compat.fsdp_params(model.blocks[0])
    assert len(params) == 4 and not any(compat.fsdp_param_holds_unreduced_grad(p) for p in params), _gone(
        "FSDPModule._get_fsdp_state / _fsdp_param_groups / FSDPParam.unsharded_accumulated_grad / "
        "_unsharded_param (before any backward)")
    model.set_requires_gradient_sync(False)
    model(torch.randn(4, 8, device=device)).sum().backward()
    names = sorted(str(compat.fsdp_param_fqn(p)) for p in params)  # named at FSDP's lazy init (first forward)
    assert names == sorted(f"blocks.0.{n}" for n, _ in model.blocks[0].named_parameters()), _gone(
        f"FSDPParam._param_fqn (got {names})")
    assert all(compat.fsdp_param_holds_unreduced_grad(p) for p in params), _gone(
        "FSDPParam.unsharded_accumulated_grad / _unsharded_param (after a no-sync backward)")
    model.set_requires_gradient_sync(True)
    model(torch.randn(4, 8, device=device)).sum().backward()
    assert not any(compat.fsdp_param_holds_unreduced_grad(p) for p in params), _gone(
        "FSDPParam.unsharded_accumulated_grad / _unsharded_param (after the synced backward)")


@pytest.mark.distributed
def test_fsdp2_state_internals():
    """FSDP2's per-module state lists its params by name and shows no-sync grads until they are reduced."""
    spawn(_fsdp2_state, 1)


def test_pending_collective_and_block_shard():
    """A functional collective's pending result is told from plain tensors (and is plain once waited on);
    `Shard(d)` is a block shard, `_StridedShard` (torch 2.11: a Shard subclass) and Replicate are not."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    pending = AsyncCollectiveTensor(torch.randn(3))
    assert compat.is_pending_collective(pending), _gone("torch.distributed._functional_collectives.AsyncCollectiveTensor")
    assert not compat.is_pending_collective(pending.wait()) and not compat.is_pending_collective(torch.randn(3))
    assert not compat.is_pending_collective(None) and not compat.is_dtensor(pending)
    assert compat.is_block_shard(Shard(0)) and compat.is_block_shard(Shard(-1))
    assert not compat.is_block_shard(_StridedShard(0, split_factor=2)), _gone("placement_types._StridedShard")
    assert not compat.is_block_shard(Replicate())


def _dtensor_kinds(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    mesh = init_device_mesh(DEVICE, (world_size,))
    x = DTensor.from_local(torch.randn(2, 4, device=rank_device(rank)), mesh, [Replicate()])
    assert compat.is_dtensor(x) and compat.is_dtensor(nn.Parameter(x))
    assert not compat.is_dtensor(x.to_local()) and not compat.is_dtensor(nn.Parameter(torch.randn(2)))
    assert not compat.is_dtensor(None) and not compat.is_pending_collective(x)


@pytest.mark.distributed
def test_dtensor_told_from_plain_tensors():
    """A DTensor and a DTensor parameter are DTensors; their local shards and plain tensors or parameters are not."""
    spawn(_dtensor_kinds, 1)


def test_function_apply_matches_apply_and_defers_to_it_under_functorch():
    """function_apply(cls)(*args) is cls.apply(*args): same output, same grads, same graph node type; under a
    functorch transform it is cls.apply itself (which refuses a Function without setup_context)."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, s: float):
            ctx.s = s
            return x * s

        @staticmethod
        def backward(ctx, dy):
            return dy * ctx.s, None

    apply = compat.function_apply(Scale)
    x = torch.randn(5, requires_grad=True, dtype=torch.float64)
    y = apply(x, 3.0)
    assert type(y.grad_fn) is type(Scale.apply(x, 3.0).grad_fn)
    y.square().sum().backward()
    torch.testing.assert_close(x.grad, 18.0 * x.detach(), rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda t: apply(t, 2.0).sum())(x.detach())

    class WithSetup(Scale):
        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.s = inputs[1]

    with pytest.raises(TypeError, match="setup_context"):
        compat.function_apply(WithSetup)


def test_innermost_functorch_transform_names_the_running_transform():
    seen = []

    def probe(x):
        seen.append(compat.innermost_functorch_transform())
        return x.sum()

    assert compat.innermost_functorch_transform() is None
    torch.func.vmap(probe)(torch.randn(2, 3))
    torch.func.grad(probe)(torch.randn(3))
    torch.func.jvp(probe, (torch.randn(3),), (torch.randn(3),))
    assert seen == ["Vmap", "Grad", "Jvp"]


def _dtensor_spec_and_wrap(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Shard

    mesh = init_device_mesh(DEVICE, (world_size,))
    local = torch.randn(2, 3, 4, device=rank_device(rank))
    for placements in ((Shard(1),), (Partial(),)):
        expected = DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size((2, 3 * world_size, 4)),
                                      stride=(12 * world_size, 4, 1))
        spec = compat.dtensor_spec(mesh, placements, expected.shape, expected.stride(), local.dtype)
        wrapped = compat.dtensor_with_spec(local, spec)
        assert type(wrapped) is DTensor and wrapped.placements == expected.placements \
            and wrapped.shape == expected.shape and wrapped.stride() == expected.stride() \
            and wrapped.device_mesh == mesh and not wrapped.requires_grad, _gone(
                f"DTensorSpec / TensorMeta / DTensor(local, spec) ({wrapped.placements}, {wrapped.shape})")
        assert compat.dtensor_local(wrapped) is local, _gone("DTensor._local_tensor")
        assert compat.dtensor_spec_of(wrapped) is spec, _gone("DTensor._spec")
        with torch.no_grad():
            assert expected.to_local() is compat.dtensor_local(expected), _gone("DTensor._local_tensor")


        gathered = compat.collective_result(compat.all_gather_start(local, mesh.get_group()))
        assert gathered.shape == (world_size * 2, 3, 4) and torch.equal(gathered[2 * rank:2 * rank + 2], local), \
            _gone("ProcessGroup._allgather_base")
        summed = compat.collective_result(compat.reduce_scatter_start((rank + 1) * gathered, mesh.get_group()))
        total = sum(range(1, world_size + 1))
        assert summed.shape == local.shape and torch.equal(summed, total * local), \
            _gone("ProcessGroup._reduce_scatter_base")


@pytest.mark.distributed
def test_dtensor_spec_wraps_a_local_tensor_like_from_local():
    """dtensor_with_spec(local, dtensor_spec(...)) is the DTensor from_local builds, over the same local tensor."""
    spawn(_dtensor_spec_and_wrap, 2)


def test_saved_tensors_hooks_top_and_compiled_module():
    assert compat.saved_tensors_hooks_top() is None
    pack, unpack = (lambda t: t), (lambda t: t)
    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert compat.saved_tensors_hooks_top() == (pack, unpack), _gone("_top_saved_tensors_default_hooks")
    module = torch.nn.Linear(2, 2)
    assert not compat.is_compiled_module(module)
    assert compat.is_compiled_module(torch.compile(module)), _gone("OptimizedModule")


def test_child_modules_and_own_buffers():
    parent = torch.nn.Module()
    parent.norm = torch.nn.LayerNorm(4)
    parent.final_norm = parent.norm  # one module, two names
    assert [name for name, _ in compat.child_modules(parent)] == ["norm", "final_norm"], _gone("Module._modules")
    parent.norm.register_buffer("kept", torch.zeros(1))
    parent.norm.register_buffer("scratch", torch.zeros(1), persistent=False)
    assert [(n, p) for n, _, p in compat.own_buffers(parent.norm)] == [("kept", True), ("scratch", False)], \
        _gone("Module._buffers / _non_persistent_buffers_set")


def _copy_kernel(X, Y, N, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    tl.store(Y + cols, tl.load(X + cols, mask=cols < N), mask=cols < N)


def _copy_kernel_writes() -> list:
    """What `triton_kernel_writes` finds `_copy_kernel` writes, compiled for an sm_90 target given to Triton as its
    active driver (no GPU needed)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    class Hopper:
        get_current_target = staticmethod(lambda: GPUTarget("cuda", 90, 32))

    triton.runtime.driver.set_active(Hopper())
    return compat.triton_kernel_writes(JITFunction(_copy_kernel), dict(X=torch.zeros(8), Y=torch.zeros(8), N=8, BLOCK=8))


def test_triton_kernel_writes_names_what_inductor_copies():
    """Inductor's analysis of a wrap_triton kernel, in a process without TRITON_INTERPRET: a kernel interpreted
    earlier in the same process leaves Triton's language patched, and every later compile of a kernel fails."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "import json, test_torch_compat as t; print(json.dumps(t._copy_kernel_writes()))"
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    writes = json.loads(run.stdout.splitlines()[-1])
    assert writes == ["Y"], _gone(f"triton_kernel_wrap.identify_mutated_tensors / identify_accessed_tensors ({writes})")


def test_triton_op_lists_its_kernels_without_importing_inductor():
    """`triton_op` registers through torch.library.triton_op with the kernel list given (the source scan it replaces
    is `torch._library.triton.get_inner_triton_kernels`), and `import shardnorm` imports neither Inductor nor
    Triton."""
    import subprocess
    import sys

    from torch._library import triton as library_triton

    assert callable(getattr(library_triton, "get_inner_triton_kernels", None)), \
        _gone("torch._library.triton.get_inner_triton_kernels")
    code = ("import sys, shardnorm, torch; assert 'torch._inductor' not in sys.modules and 'triton' not in sys.modules;"
            "from torch._library.triton import get_triton_kernels_for_op as k;"
            "print(len(k('shardnorm::norm_fwd')), len(k('shardnorm::norm_bwd')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "4"], out.stdout
