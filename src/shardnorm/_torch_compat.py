"""Every private torch API shardnorm relies on, in one file: a torch upgrade that moves one breaks here.

Checked on torch 2.11 (the GPU machine) and 2.13 (CI). `tests/test_torch_compat.py` exercises each
entry below and fails naming the internal that disappeared. Everything else in `src/` uses public torch
APIs only, with one exception torch itself documents: a `ParallelStyle` subclass implements `_apply`
(`distributed/parallel_style.py`; the test checks that torch still calls it).

Autograd engine (the reducer's "first grad of this backward" and "end of this backward"; a norm's "does this
backward reach the reducer's grad sink"):
  `torch._C._current_graph_task_id`, `torch.autograd.Variable._execution_engine.queue_callback`,
  `torch._C._will_engine_execute_node`.
  Output recompute (`output_recompute.py`): `torch._C._autograd._top_saved_tensors_default_hooks` (are
  saved-tensors hooks active), `torch._C._autograd._saved_tensors_hooks_is_enabled` (may they be pushed),
  `torch._C._are_functorch_transforms_active`, `Tensor._version`, `Tensor._base`.
FSDP2 (`fully_shard`) state, for "does FSDP hold no-sync grads" (`fsdp_checkpoint.pending_grads`):
  `FSDPModule._get_fsdp_state`, `FSDPState._fsdp_param_groups` (torch >= 2.12; `_fsdp_param_group`
  before), `FSDPParamGroup.fsdp_params`, `FSDPParam.unsharded_accumulated_grad` / `_unsharded_param` /
  `_param_fqn`.
FSDP1: `ModuleWrapPolicy._run_policy` / `_module_classes` (a wrap policy that looks at the root module
  before choosing its classes), `MixedPrecision._module_classes_to_ignore` (norms kept in fp32).
DeviceMesh: `_flatten` (several dims as one, FSDP over dp_shard x cp) and `_concatenate` (HSDP's 2-D mesh
  from a replicate dim and a flattened shard dim): torch has no public way to build either.
nn.Module hook dicts (`_forward_pre_hooks`, `_backward_hooks`, ...) and `Tensor._post_accumulate_grad_hooks`:
  to see the hooks a module or parameter carries (conversion refuses to drop them), and to remove the module
  backward hooks a framework installed without handing out their handles (transformers' tensor-parallel
  styles), leaving everyone else's.
Tensor and placement kinds, told apart without importing torch.distributed where no DTensor can exist yet:
  `DTensor`, a functional collective's pending result (`torch.distributed._functional_collectives.
  AsyncCollectiveTensor`), and `torch.distributed.tensor.placement_types._StridedShard` (on torch 2.11 a `Shard`
  whose `is_shard()` is true).
Dispatch: `torch._C._len_torch_dispatch_stack` and `torch._C._is_tracing` (is a TorchDispatchMode active, or the
  TorchScript tracer: eager norms then reach the kernels through the ops, so a mode such as selective activation
  checkpointing's sees the norm as one op, and a traced module records it).
autograd.Function: `torch._C._FunctionBase.apply`, what `Function.apply` calls after its Python checks
  (`function_apply`: the eager norm's host time).
`torch._library.triton.get_inner_triton_kernels`, replaced while `triton_op` registers the norm ops (their kernels
  listed, not found by reading source with Inductor's helpers: `import shardnorm` without importing Inductor).
Inductor's analysis of what a Triton kernel launched through `torch.library.wrap_triton` writes
  (`torch._higher_order_ops.triton_kernel_wrap.identify_mutated_tensors` on torch 2.11, `identify_accessed_tensors`
  on 2.13): the test that holds the traced ops' kernels to writing their outputs only (tests/test_traced_kernels.py).
DTensor: `DTensorSpec` / `TensorMeta`, the `DTensor(local, spec, requires_grad=)` constructor, `DTensor._spec`
  and `DTensor._local_tensor` (the local tensor without `to_local`'s autograd node): the eager
  sequence-parallel norm wraps its local results with a cached spec (`DTensor.from_local` builds and validates a
  new spec per call: ~15 us of host time per output on a CPU).

Process-group collectives: `ProcessGroup._allgather_base` / `_reduce_scatter_base` and the `Work` they return, the
  sequence-parallel norm's gather and its grad's reduce-scatter (`distributed/sequence_gather.py`) and the
  consumers' re-gather (`distributed/regather.py`, launched in the backward before the dgrad GEMM, waited for after
  it): the collective without the functional op's Python autograd wrapper or `torch.distributed`'s Python checks.

Framework-specific internals stay in their adapter (DeepSpeed's AutoTP partition specs and flag:
`shardnorm/integrations/deepspeed_autotp.py`); Triton's launch internals in `shardnorm/kernels/launch.py`.
`tests/test_layout.py` scans src/ for private torch names elsewhere.
"""

import functools
import sys

import torch

CHECKED_ON = ("2.11", "2.13")  # torch versions this file was checked against


# ---- autograd engine -------------------------------------------------------------------------------------

def current_graph_task_id() -> int:
    """Id of the autograd graph task running now (one per `backward()` call); -1 outside backward."""
    return torch._C._current_graph_task_id()


def queue_backward_callback(callback) -> None:
    """Run `callback()` when the running backward has finished (after every grad is accumulated).

    Must be called from inside a backward (a hook or an autograd Function's backward)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def backward_reaches(leaf) -> bool:
    """Whether the running backward accumulates a grad into `leaf` (false in `torch.autograd.grad`, or
    `backward(inputs=...)` without it). Must be called from inside a backward."""
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(leaf).node)
    except RuntimeError:  # asked about one of `torch.autograd.grad`'s inputs, which it captures instead
        return False


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensors hooks (non-reentrant checkpoint, `save_on_cpu`, ...) apply to tensors saved now."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def saved_tensors_hooks_enabled() -> bool:
    """Whether saved-tensors hooks may be pushed now (`torch.autograd.graph.disable_saved_tensors_hooks` makes a
    push raise)."""
    return torch._C._autograd._saved_tensors_hooks_is_enabled()


def saved_tensors_hooks_top():
    """The (pack, unpack) pair that applies to tensors saved now, or None."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


def functorch_transforms_active() -> bool:
    """Whether a functorch transform (vmap, grad) is running."""
    return torch._C._are_functorch_transforms_active()


def foreach_copy(dsts: list, srcs: list) -> None:
    """`d.copy_(s)` for each pair, by torch's multi-tensor kernels (a few launches for any number of pairs)."""
    torch._foreach_copy_(dsts, srcs)


def is_batched_grad(t) -> bool:
    """Whether `t` is a grad batched by `torch.autograd.grad(..., is_grads_batched=True)` (the vmap prototype it
    runs the backward under, which torch.func's interpreter stack does not show)."""
    return t is not None and torch._C._functorch.is_legacy_batchedtensor(t)


def innermost_functorch_transform() -> str | None:
    """The innermost running torch.func transform's kind ("Vmap", "Grad", "Jvp", "Functionalize"), None outside."""
    interpreter = torch._C._functorch.peek_interpreter_stack()
    return None if interpreter is None else interpreter.key().name


def tensor_version(t) -> int:
    """`t`'s version counter (bumped by every in-place write; what autograd checks saved tensors against)."""
    return t._version


def is_compiled_module(module) -> bool:
    """Whether `module` is what `torch.compile(module)` returns (its forward runs Dynamo's compiled code)."""
    return type(module).__name__ == "OptimizedModule"


def child_modules(module) -> list:
    """(name, child) for every child attribute of `module`, a child registered under two names twice
    (`named_children()` yields one module once)."""
    return [(name, child) for name, child in module._modules.items() if child is not None]


def own_buffers(module) -> list:
    """(name, buffer, persistent) for `module`'s own buffers (persistent: saved in its state_dict)."""
    return [(name, b, name not in module._non_persistent_buffers_set) for name, b in module._buffers.items()]


def view_base(t):
    """The tensor `t` is a view of (views share their base's storage and version counter), or `t` itself."""
    return t if t._base is None else t._base


# ---- FSDP2 ---------------------------------------------------------------------------------------------

def fsdp_params(module) -> list:
    """The FSDPParams that `module`'s `fully_shard` manages (torch >= 2.12 keeps a list of param groups,
    earlier versions one group or None)."""
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:
        groups = [g for g in [getattr(state, "_fsdp_param_group", None)] if g is not None]
    return [fsdp_param for group in groups for fsdp_param in group.fsdp_params]


def fsdp_param_fqn(fsdp_param) -> str:
    """The parameter's name in the module tree `fully_shard` was applied to."""
    return fsdp_param._param_fqn


def fsdp_param_holds_unreduced_grad(fsdp_param) -> bool:
    """Whether FSDP keeps a grad of this parameter that it has not reduce-scattered yet (no-sync
    accumulation: in `unsharded_accumulated_grad`, or on the unsharded parameter)."""
    unsharded = getattr(fsdp_param, "_unsharded_param", None)
    return fsdp_param.unsharded_accumulated_grad is not None or \
        unsharded is not None and unsharded.grad is not None


# ---- FSDP1 ---------------------------------------------------------------------------------------------

def deferred_module_wrap_policy(choose_classes):
    """An FSDP1 `ModuleWrapPolicy` whose module classes are chosen when FSDP applies it:
    `choose_classes(root_module, root_kwargs)` (FSDP1 shows a policy the root module only then)."""
    return _deferred_module_wrap_policy_class()(choose_classes)


@functools.cache
def _deferred_module_wrap_policy_class():
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    class DeferredModuleWrapPolicy(ModuleWrapPolicy):
        def __init__(self, choose_classes):
            super().__init__(())
            self.choose_classes = choose_classes

        def _run_policy(self, root_module, ignored_modules, root_kwargs):
            self._module_classes = set(self.choose_classes(root_module, root_kwargs))
            return super()._run_policy(root_module, ignored_modules, root_kwargs)

    return DeferredModuleWrapPolicy


def fsdp1_mixed_precision(param_dtype, reduce_dtype, buffer_dtype, full_precision_classes: tuple):
    """FSDP1 `MixedPrecision` that keeps modules of `full_precision_classes` in full precision (each
    becomes its own FSDP unit: FSDP1's only way to keep some params in another dtype)."""
    from torch.distributed.fsdp import MixedPrecision

    return MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype, buffer_dtype=buffer_dtype,
                          _module_classes_to_ignore=full_precision_classes)


# ---- DeviceMesh -----------------------------------------------------------------------------------------

def flatten_mesh(mesh, name: str):
    """`mesh`'s dims as one dim called `name` (reachable as `root_mesh[name]` afterwards)."""
    return mesh._flatten(name)


def concatenate_meshes(meshes: list):
    """One mesh whose dims are those of `meshes` (submeshes of one root mesh), in order."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


# ---- module and parameter hooks -----------------------------------------------------------------------------

MODULE_HOOK_KINDS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
                     ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"),
                     ("_state_dict_pre_hooks", "state_dict pre-hook"), ("_state_dict_hooks", "state_dict hook"),
                     ("_load_state_dict_pre_hooks", "load_state_dict pre-hook"),
                     ("_load_state_dict_post_hooks", "load_state_dict post-hook"))


def module_hooks(module) -> list:
    """(kind, hook) for every hook registered on `module` itself (forward, backward, state_dict), in
    registration order; kind as `MODULE_HOOK_KINDS` names it ("forward hook", "backward hook", ...)."""
    return [(kind, hook) for attr, kind in MODULE_HOOK_KINDS for hook in (getattr(module, attr, None) or {}).values()]


def remove_module_backward_hooks(module, installed_by) -> int:
    """Remove the backward hooks of `module` (`register_full_backward_hook` / `register_backward_hook`) for
    which `installed_by(hook)` is true; the others stay registered. For hooks whose handles their owner kept
    (torch removes a hook only through its handle). Returns how many were removed."""
    hooks = module._backward_hooks
    removed = [key for key, hook in hooks.items() if installed_by(hook)]
    for key in removed:
        del hooks[key]
    return len(removed)


def has_post_accumulate_grad_hooks(param) -> bool:
    """Whether `register_post_accumulate_grad_hook` put a hook on this parameter."""
    return bool(getattr(param, "_post_accumulate_grad_hooks", None))


# ---- tensor and placement kinds ----------------------------------------------------------------------------

_TENSOR = torch.Tensor


def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor (a subclass too). False without a lookup in torch.distributed while its tensor
    package is not imported: no DTensor exists then."""
    if type(t) is _TENSOR:  # the eager norm's common case (its host time), before the lookups
        return False
    cls = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return cls is not None and isinstance(t, cls)


def is_pending_collective(t) -> bool:
    """Whether `t` is a functional collective's result not waited on yet (`AsyncCollectiveTensor`: sequence
    parallel's norm input and grads); `t.wait()` gives the plain tensor once the collective has written it."""
    cls = getattr(sys.modules.get("torch.distributed._functional_collectives"), "AsyncCollectiveTensor", None)
    return cls is not None and isinstance(t, cls)


def is_block_shard(placement) -> bool:
    """Whether `placement` is `Shard(d)`: dim d cut into one contiguous block per rank. Not `_StridedShard`
    (FSDP2 over tensor parallelism: blocks interleaved), which is a `Shard` whose `is_shard()` is true on torch 2.11
    and neither on 2.13."""
    # imported here, not cached with functools: Dynamo warns about every lru_cache it traces through
    from torch.distributed.tensor.placement_types import _StridedShard

    return placement.is_shard() and not isinstance(placement, _StridedShard)


# ---- dispatch ----------------------------------------------------------------------------------------------

def ops_observed() -> bool:
    """Whether something on this thread sees only the ops dispatched under it, never a kernel launched directly: a
    TorchDispatchMode (selective activation checkpointing's caching mode, FlopCounterMode, FakeTensorMode, ...) or
    the TorchScript tracer (`torch.jit.trace` keeps the ops it sees as the traced module's program)."""
    return torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_tracing()


# ---- autograd.Function ------------------------------------------------------------------------------------

def function_apply(cls):
    """`cls.apply` without `torch.autograd.Function.apply`'s Python wrapper, which, with no functorch transform
    active and no `setup_context`, only unwraps dead functorch wrappers (tensors that escaped a transform) and
    calls `torch._C._FunctionBase.apply`: ~2 us of host time per eager norm call on a CPU (docs/performance.md).
    Under a functorch transform `cls.apply` runs as it is."""
    if "setup_context" in vars(cls):
        raise TypeError(f"{cls.__name__} defines setup_context: call {cls.__name__}.apply")
    base = torch._C._FunctionBase.__dict__["apply"].__get__(None, cls)
    transforms_active = torch._C._are_functorch_transforms_active

    def apply(*args):
        return cls.apply(*args) if transforms_active() else base(*args)

    return apply


# ---- Inductor ----------------------------------------------------------------------------------------------

class _KernelsWhenAsked(list):
    """The kernels of a Triton op, imported when first read (AOTAutograd's cache key reads them, at a compile)."""

    def __init__(self, kernels):
        super().__init__()
        self._kernels = kernels

    def _load(self) -> None:
        if self._kernels is not None:
            kernels, self._kernels = self._kernels, None
            self.extend(kernels())

    def __iter__(self):
        self._load()
        return super().__iter__()

    def __len__(self) -> int:
        self._load()
        return super().__len__()


def triton_op(name: str, fn, kernels):
    """`torch.library.triton_op(name, mutates_args=())(fn)` with its kernels listed by `kernels()` (a callable, called
    when a compile first reads them) instead of found by reading `fn`'s source: that reading imports Inductor (and
    Dynamo), ~1 s at `import shardnorm` on a CPU-only machine, and finds no kernel in a body that reaches them
    through a backend object. The list is what AOTAutograd's cache key hashes the kernels' source from
    (`torch._library.triton.get_triton_kernels_for_op`)."""
    from torch._library import triton as library_triton

    scan = library_triton.get_inner_triton_kernels
    library_triton.get_inner_triton_kernels = lambda fn: _KernelsWhenAsked(kernels)
    try:
        return torch.library.triton_op(name, mutates_args=())(fn)
    finally:
        library_triton.get_inner_triton_kernels = scan


def triton_kernel_writes(kernel, kwargs: dict) -> list:
    """The names of the tensor arguments that Inductor's analysis of `kernel` (a JITFunction; `kwargs`: every
    argument by name, constexprs included) finds it writes. For a kernel launched through `torch.library.wrap_triton`
    in a compiled graph these are copied before each launch, and an input among them that requires grad is an
    error; where the analysis fails it takes every tensor for written (and logs a warning). Compiles the kernel to
    TTIR for Triton's current target: a GPU, or a stand-in set as Triton's active driver."""
    from torch._higher_order_ops import triton_kernel_wrap

    if hasattr(triton_kernel_wrap, "identify_accessed_tensors"):
        accesses = triton_kernel_wrap.identify_accessed_tensors(kernel, kwargs, {})
        return [dep.name for dep in accesses.read_writes.writes]
    return list(triton_kernel_wrap.identify_mutated_tensors(kernel, kwargs, {}))


# ---- DTensor ------------------------------------------------------------------------------------------------

def dtensor_spec(mesh, placements: tuple, shape: torch.Size, stride: tuple, dtype: torch.dtype):
    """The layout record a DTensor carries: what `DTensor.from_local(local, mesh, placements, shape=shape,
    stride=stride)` would build for a local tensor of `dtype`."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype))


def dtensor_with_spec(local: torch.Tensor, spec):
    """A DTensor over `local` (used as it is, no copy, no autograd edge) with a spec from `dtensor_spec`: for an
    autograd.Function whose forward or backward returns DTensors."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, spec, requires_grad=False)


def dtensor_spec_of(t):
    """A DTensor's spec as it is (what `dtensor_with_spec` takes to make another DTensor laid out like it)."""
    return t._spec


def dtensor_local(t):
    """A DTensor's local tensor as it is (no autograd node: what `to_local()` returns with grad mode off)."""
    return t._local_tensor


# ---- collectives ---------------------------------------------------------------------------------------------

def all_gather_start(input: torch.Tensor, group):
    """Every rank's `input` concatenated along dim 0, launched and not waited for (`collective_result` waits): the
    process group's own collective, which the functional op (`torch.ops._c10d_functional`) reaches through a Python
    autograd wrapper: 42 against 62 us of host time per call on an H200 host (`benchmarks/host_time.py --dtensor`,
    its `(all_gather)` rows)."""
    output = input.new_empty((group.size() * input.shape[0], *input.shape[1:]))
    return output, group._allgather_base(output, input)


def reduce_scatter_start(input: torch.Tensor, group):
    """The sum over the group of every rank's `input`, each rank keeping its chunk of dim 0, launched and not waited
    for (as `all_gather_start`)."""
    output = input.new_empty((input.shape[0] // group.size(), *input.shape[1:]))
    return output, group._reduce_scatter_base(output, input)


def collective_result(started) -> torch.Tensor:
    """The output of a collective from `all_gather_start` or `reduce_scatter_start`, once written (on a GPU: the
    current stream waits for it; the host does not)."""
    output, work = started
    work.wait()
    return output
