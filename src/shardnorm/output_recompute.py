"""Norm outputs not kept between forward and backward (`keep_output=False`), recomputed into their own storage.

In a pre-norm decoder the norm's output y is saved by every matmul that reads it (q/k/v; gate/up) while the
norm already keeps what recomputing y takes: its input x (or z = x + residual) and the parameters. With
`keep_output=False` y's storage is freed once every consumer's forward has run and refilled, bitwise, right
before any backward that may read it (Megatron-Core's output-discarding recompute, `--recompute-modules
layernorm`, without naming the consumers):

- Release: when the forward of the module that called the norm (its *parent*: the decoder layer) returns,
  every consumer inside it has saved y. The norm's storage is then resized to 0 bytes; the tensor objects
  (y, the views and aliases the matmuls saved) stay, so autograd's saved-tensor bookkeeping and version
  counters are untouched. y is held through a weak reference to its storage only. Kept instead of released:
  y (or a view of it) is part of the parent's output (a final norm whose output goes to lm_head outside),
  grad is off or y needs no grad, the call is inside a backward (a checkpoint's recompute) or under
  saved-tensors hooks (non-reentrant `torch.utils.checkpoint`, `save_on_cpu`: they manage the saved tensors
  themselves), under torch.compile or a functorch transform, the parent's forward raised, no output of the
  parent carries a grad_fn of its own, or a DTensor output is sharded over the normalized dims (its
  recompute needs collectives). Nothing to release (nor recompute): nothing holds y's storage at the
  parent's return (sequence parallel: the matmuls save the all-gathered input, not the norm's shard).
- Refill: a pre-hook on the autograd node of each of the parent's outputs (`Node.register_prehook`, which
  runs after the tensor hooks that FSDP2 puts on the same outputs to unshard the parameters) resizes the
  storage back and runs the norm's forward into it (`ops.norm_forward_into`, same backend and kernel on the
  same src, under no_grad): every backward inside the parent's graph comes after that node, so y is whole
  again before the first consumer's backward reads it. One recompute for all consumers; no second buffer.
- Parents are known from a module-call stack kept by global module forward hooks
  (`torch.nn.modules.module.register_module_forward_pre_hook` / `register_module_forward_hook`), installed
  only while some norm has keep_output=False.

What is detected and raised (`KeepOutputError`): y modified in place between the norm's forward and the
parent's return (the recompute would lose the change), or after its release; the norm's src modified in
place, or its storage freed, before the refill. The weight and bias are copied at the forward (N elements
each), so FSDP2 / ZeRO-3 freeing the gathered parameters after the forward does not matter.
What cannot be detected: code that reads y outside autograd after the parent returned and before its
backward (a forward hook of an outer module that reads it, a cache attribute, a custom autograd Function
that keeps y on ctx by reference and reads it in a backward that does not come after the parent's outputs),
or a backward that enters the parent's graph other than through its outputs (a loss on tensors the parent
stored aside, such as a KV cache): the storage is empty then and the read is invalid memory. Such models
keep keep_output=True.

Timing: a parent's released outputs all come back when its backward starts (a decoder layer's two norm
outputs at the start of that layer's backward), not each right before its own first consumer; the peak
saving is therefore the released outputs of every layer but the one in backward.

Under torch.compile the hooks return at once while Dynamo traces; a norm with keep_output=False is traced inside a
selective activation checkpoint that recomputes its forward op instead (`compiled_norm`), so AOTAutograd's
partitioner gives the compiled graph the same saving (without a residual).
"""

import math
import threading
import weakref
from typing import Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from . import _torch_compat, ops
from .rows import as_param, as_rows


def compiled_norm(norm, x: Tensor, *args):
    """`norm(x, *args)` while Dynamo traces a norm with keep_output=False and no residual: inside a selective
    activation checkpoint whose policy recomputes `shardnorm::norm_fwd`, so AOTAutograd's partitioner saves
    the norm's input (which its own backward keeps anyway) rather than y for the consumers' backward, and the
    backward graph runs the forward kernel again. The residual form is traced as it is: recomputing y there
    would need x and the residual where the eager route refills from z, so the compiled graph keeps y."""
    return checkpoint(norm, x, *args, use_reentrant=False, context_fn=_recompute_norm_contexts)


def _recompute_norm_policy(ctx, op, *args, **kwargs):
    if op is torch.ops.shardnorm.norm_fwd.default:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


def _recompute_norm_contexts():
    return create_selective_checkpoint_contexts(_recompute_norm_policy)


class KeepOutputError(RuntimeError):
    """A norm with keep_output=False could not recompute its output faithfully."""


# ---- which norms have the option on, and the global hooks that exist only while some do ----------------------

_discarding: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
_handles: list = []
_lock = threading.RLock()  # re-entrant: a module's finalizer may run (garbage collection) while it is held


def set_keep_output(module: torch.nn.Module, keep: bool) -> None:
    """Record `module`'s option; the module-call hooks are installed while at least one module discards."""
    if not isinstance(keep, bool):
        raise TypeError(f"keep_output must be a bool, got {type(keep).__name__}")
    with _lock:
        if keep:
            _discarding.discard(module)
        elif module not in _discarding:
            _discarding.add(module)
            weakref.finalize(module, _uninstall_if_unused)
        _install() if len(_discarding) else _uninstall()


def _uninstall_if_unused() -> None:
    with _lock:
        if not len(_discarding):
            _uninstall()


def _install() -> None:
    if not _handles:
        hooks = torch.nn.modules.module
        _handles.append(hooks.register_module_forward_pre_hook(_enter))
        _handles.append(hooks.register_module_forward_hook(_leave, with_kwargs=True, always_call=True))


def _uninstall() -> None:
    while _handles:
        _handles.pop().remove()


def hooks_installed() -> bool:
    return bool(_handles)


_counts = {"released": 0, "released_bytes": 0, "recomputed": 0}


def counters(reset: bool = False) -> dict:
    """How many outputs were released (and their bytes) and recomputed since the last reset, in this process."""
    out = dict(_counts)
    if reset:
        _counts.update(dict.fromkeys(_counts, 0))
    return out


# ---- the module-call stack ------------------------------------------------------------------------------------

class _Frame:
    """One module whose forward is running, and the norm outputs waiting for its return."""

    __slots__ = ("module", "pending")

    def __init__(self, module):
        self.module, self.pending = module, None


_local = threading.local()


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


def _enter(module, args):
    if torch.compiler.is_compiling():
        return
    _stack().append(_Frame(module))


def _leave(module, args, *kwargs_and_output):
    """Forward hook (with kwargs; an exception in forward calls it as (module, args, result))."""
    if torch.compiler.is_compiling():
        return
    stack = _stack()
    for i in range(len(stack) - 1, -1, -1):  # the top, unless a module's forward hooks did not run (an exception)
        if stack[i].module is module:
            frame = stack[i]
            del stack[i:]
            break
    else:  # entered before the hooks were installed
        return
    if not frame.pending:
        return
    if len(kwargs_and_output) == 2:
        kwargs, output = kwargs_and_output
    else:
        kwargs, output = {}, kwargs_and_output[0]
    _release(frame.pending, args, kwargs, output)


# ---- one norm output ------------------------------------------------------------------------------------------

class _Output:
    """A norm output whose storage may be released, with what recomputing it takes (local tensors for DTensors).

    The output is held weakly, through its storage: when nothing saved it, a view or an alias of it (sequence
    parallel's matmuls save the all-gathered tensor, not the norm's shard), the storage is gone by the parent's
    return and there is nothing to release or recompute. The tensor itself (for its version counter, which its
    views and detached aliases share) is held weakly too."""

    __slots__ = ("owner", "storage", "base", "dtype", "offset", "rows", "src", "weight", "bias", "eps", "rms",
                 "zero_centered", "n", "y_version", "src_version", "nbytes", "released")

    def __init__(self, owner, base, src, weight, bias, eps, rms, zero_centered, n):
        self.owner, self.src, self.weight, self.bias = owner, src, weight, bias
        self.storage, self.base = weakref.ref(base.untyped_storage()), weakref.ref(base)
        self.dtype, self.offset, self.rows = base.dtype, base.storage_offset(), base.numel() // n
        self.eps, self.rms, self.zero_centered, self.n = eps, rms, zero_centered, n
        self.y_version, self.src_version = _torch_compat.tensor_version(base), _torch_compat.tensor_version(src)
        self.nbytes, self.released = 0, False

    def name(self) -> str:
        return f"{type(self.owner).__name__} (keep_output=False)" if self.owner is not None else "a norm"

    def _check_version(self, when: str) -> None:
        y = self.base()
        version = self.y_version if y is None else _torch_compat.tensor_version(y)
        if version != self.y_version:
            raise KeepOutputError(
                f"{self.name()}: its output was modified in place {when} (version {self.y_version} -> {version}); "
                "the backward would recompute it without that change. Keep this norm's output (keep_output=True) "
                "or modify a copy.")

    def release(self, storage) -> None:
        self._check_version("after the norm's forward")
        self.nbytes = storage.nbytes()
        storage.resize_(0)
        self.released = True
        _counts["released"] += 1
        _counts["released_bytes"] += self.nbytes

    def refill(self) -> None:
        storage = self.storage()
        if not self.released or storage is None:  # nothing holds the output any more: no backward reads it
            return
        self._check_version("after its storage was released")
        if _torch_compat.tensor_version(self.src) != self.src_version:
            raise KeepOutputError(f"{self.name()}: the norm's input (x, or x + residual) was modified in place "
                                  "after the forward; its output cannot be recomputed")
        src = self.src
        if src.untyped_storage().nbytes() < (src.storage_offset() + src.numel()) * src.element_size():
            raise KeepOutputError(f"{self.name()}: its input's storage was freed before the backward (by another "
                                  "keep_output=False norm or by the caller); its output cannot be recomputed")
        storage.resize_(self.nbytes)
        self.released = False
        # A tensor of its own over y's storage: writing through it leaves y's version counter (which the saved
        # copies of y are checked against) as it is.
        into = torch.empty(0, dtype=self.dtype, device=src.device).set_(storage, self.offset, (self.rows, self.n),
                                                                         (self.n, 1))
        ops.norm_forward_into(into, as_rows(src, self.n), as_param(self.weight, self.n), as_param(self.bias, self.n),
                              self.eps, self.rms, self.zero_centered)
        _counts["recomputed"] += 1


# ---- registration (the norm's forward) -------------------------------------------------------------------------

def track(owner, y: Tensor, src: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, rms: bool,
          zero_centered: bool, normalized_shape: tuple) -> None:
    """Called by a keep_output=False norm right after its forward: y (the output) waits for its parent's forward
    to return, then is released until the parent's backward starts. `src` is x, or z = x + residual."""
    if owner is not None and owner not in _discarding:  # a copy (deepcopy, pickle) of a registered module
        set_keep_output(owner, False)
        return
    if not torch.is_grad_enabled() or not y.requires_grad or torch.compiler.is_compiling() \
            or _torch_compat.current_graph_task_id() != -1 or _torch_compat.saved_tensors_hooks_active() \
            or _torch_compat.functorch_transforms_active():
        return
    stack = _stack()
    depth = len(stack) - (2 if stack and stack[-1].module is owner else 1)  # called as a module, or inside one
    if depth < 0:
        return
    n = math.prod(normalized_shape)
    if type(y).__name__ == "DTensor":
        local = _dtensor_locals(y, src, weight, bias, len(normalized_shape))
        if local is None:
            return
        y, src, weight, bias = local
    elif not _plain(y, src, weight, bias):
        return
    # The parameters as the forward read them, copied (N elements each): FSDP2 and ZeRO-3 free a gathered
    # parameter after the forward and gather it again only when the backward reaches its own module.
    with torch.no_grad():
        weight, bias = (p if p is None else p.detach().clone() for p in (weight, bias))
    base = _torch_compat.view_base(y)  # y may be a view ([..., N] of the kernel's [M, N])
    if not base.is_contiguous() or base.numel() != y.numel() or y.numel() == 0:
        return
    frame = stack[depth]
    if frame.pending is None:
        frame.pending = []
    frame.pending.append(_Output(owner, base, src, weight, bias, float(eps), rms, zero_centered, n))


def _plain(*tensors) -> bool:
    return all(type(t) in ops._PLAIN for t in tensors)


def _dtensor_locals(y, src, weight, bias, normalized_ndim: int) -> Optional[tuple]:
    """(y, src, weight, bias) as this rank's tensors when each rank's norm is its own (rows sharded or
    replicated, parameters replicated); None otherwise (hidden-sharded: the recompute needs collectives)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    first_normalized = y.dim() - normalized_ndim
    for t in (y, src):
        if not isinstance(t, DTensor):
            return None
        for p in t.placements:
            if not (isinstance(p, Replicate) or isinstance(p, Shard) and p.dim % t.dim() < first_normalized):
                return None
    for p in (weight, bias):
        if isinstance(p, DTensor) and not all(isinstance(q, Replicate) for q in p.placements):
            return None
    with torch.no_grad():
        local = tuple(t.to_local() if isinstance(t, DTensor) else t for t in (y, src, weight, bias))
    return local if _plain(*local[1:]) else None


# ---- release at the parent's return, refill before its backward -------------------------------------------------

def _tensors(obj, found: list, depth: int = 0) -> list:
    """Every tensor in a module's output (tuples, lists, dicts and ModelOutput-like mappings, dataclasses)."""
    if isinstance(obj, Tensor):
        found.append(obj)
    elif depth > 8:
        return found
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            _tensors(item, found, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            _tensors(item, found, depth + 1)
    elif hasattr(obj, "__dataclass_fields__"):
        for field in obj.__dataclass_fields__:
            _tensors(getattr(obj, field, None), found, depth + 1)
    return found


def _storage_key(t: Tensor):
    if type(t).__name__ == "DTensor":
        t = t.to_local()
    try:
        return t.untyped_storage().data_ptr(), t.device
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None


def _release(pending: list, args, kwargs, output) -> None:
    outputs = _tensors(output, [])
    input_nodes = {t.grad_fn for t in _tensors((args, kwargs), []) if t.grad_fn is not None}
    nodes = []
    for t in outputs:  # the parent's own outputs' nodes (an input handed back unchanged is not the parent's graph)
        node = t.grad_fn
        if node is not None and node not in input_nodes and node not in nodes:
            nodes.append(node)
    if not nodes:
        return
    with torch.no_grad():
        kept = {_storage_key(t) for t in outputs}
    released = []
    for out in pending:
        storage = out.storage()
        if storage is None or (storage.data_ptr(), storage.device) in kept:  # nothing holds y; y is an output
            continue
        out.release(storage)
        released.append(out)
    if not released:
        return
    refill = _Refill(released)
    for node in nodes:
        node.register_prehook(refill)


class _Refill:
    """Pre-hook on the parent's output nodes: the first to run recomputes every released output."""

    __slots__ = ("outputs",)

    def __init__(self, outputs: list):
        self.outputs = outputs

    def __call__(self, grad_outputs):
        outputs, self.outputs = self.outputs, None
        if outputs:
            for out in outputs:
                out.refill()
