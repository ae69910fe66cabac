"""Every private torch API shardnorm relies on, in one file: a torch upgrade that moves one breaks here.

Checked on torch 2.11 (the GPU machine) and 2.13 (CI). `tests/test_torch_compat.py` exercises each
entry below and fails naming the internal that disappeared. Everything else in `src/` uses public torch
APIs only, with one exception torch itself documents: a `ParallelStyle` subclass implements `_apply`
(`distributed/parallel_style.py`; the test checks that torch still calls it).

Autograd engine (the reducer's "first grad of this backward" and "end of this backward"):
  `torch._C._current_graph_task_id`, `torch.autograd.Variable._execution_engine.queue_callback`.
  Output recompute (`output_recompute.py`): `torch._C._autograd._top_saved_tensors_default_hooks` (are
  saved-tensors hooks active), `torch._C._are_functorch_transforms_active`, `Tensor._version`, `Tensor._base`.
FSDP2 (`fully_shard`) state, for "does FSDP hold no-sync grads" (`fsdp_checkpoint.pending_grads`):
  `FSDPModule._get_fsdp_state`, `FSDPState._fsdp_param_groups` (torch >= 2.12; `_fsdp_param_group`
  before), `FSDPParamGroup.fsdp_params`, `FSDPParam.unsharded_accumulated_grad` / `_unsharded_param` /
  `_param_fqn`.
FSDP1: `ModuleWrapPolicy._run_policy` / `_module_classes` (a wrap policy that looks at the root module
  before choosing its classes), `MixedPrecision._module_classes_to_ignore` (norms kept in fp32).
Inductor: `torch._inductor.config.pre_grad_custom_pass` / `post_grad_custom_post_pass` and
  `torch._inductor.custom_graph_pass.CustomGraphPass` (`compile_fusion.py`'s graph passes).

Framework-specific internals (DeepSpeed's AutoTP) stay in their adapter, `shardnorm/deepspeed/autotp.py`;
Triton's launch internals in `shardnorm/kernels/launch.py`.
"""

import functools

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


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensors hooks (non-reentrant checkpoint, `save_on_cpu`, ...) apply to tensors saved now."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def functorch_transforms_active() -> bool:
    """Whether a functorch transform (vmap, grad) is running."""
    return torch._C._are_functorch_transforms_active()


def tensor_version(t) -> int:
    """`t`'s version counter (bumped by every in-place write; what autograd checks saved tensors against)."""
    return t._version


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


# ---- Inductor --------------------------------------------------------------------------------------------

INDUCTOR_PASS_SLOTS = ("pre_grad_custom_pass", "post_grad_custom_post_pass")


def add_inductor_graph_pass(slot: str, graph_pass, uuid) -> bool:
    """Run `graph_pass(graph)` on each graph Inductor compiles, at `slot`: "pre_grad_custom_pass" (the graph
    Dynamo hands Inductor, torch-level ops, before autograd is traced) or "post_grad_custom_post_pass" (the
    forward and backward graphs, aten ops, after Inductor's own passes), after any pass already set there
    (Inductor holds one per slot: an existing one is chained, not replaced). `uuid()` names what the pass
    does now (Inductor's caches key on it). Idempotent. Only where `torch._inductor.config` is already
    imported (importing it costs ~1.5 s; `torch.compile` with Inductor imports it before it traces):
    returns whether the pass is installed."""
    if slot not in INDUCTOR_PASS_SLOTS:
        raise ValueError(f"slot must be one of {INDUCTOR_PASS_SLOTS}, got {slot!r}")
    import sys

    config = sys.modules.get("torch._inductor.config")
    if config is None:
        return False
    from torch._inductor.custom_graph_pass import CustomGraphPass

    current = getattr(config, slot)
    previous = tuple(current) if isinstance(current, (list, tuple)) else () if current is None else (current,)
    if any(getattr(p, "wraps", None) is graph_pass for p in previous):
        return True

    class ChainedPass(CustomGraphPass):
        def __call__(self, graph):
            for earlier in previous:
                earlier(graph)
            graph_pass(graph)

        def uuid(self):
            keys = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in previous]
            return None if None in keys else (*keys, uuid())  # an earlier pass without a uuid: no caching

    chained = ChainedPass()
    chained.wraps = graph_pass  # on the instance: a class attribute would come back as a bound method
    setattr(config, slot, chained)
    return True
