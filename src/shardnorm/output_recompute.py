"""Norm outputs not kept between forward and backward (`keep_output=False`): saved as a recompute handle.

In a pre-norm decoder the norm's output y is saved by every matmul that reads it (q/k/v; gate/up) while the
norm already keeps what recomputing y takes: its input x (or z = x + residual) and its statistics. With
`keep_output=False` the consumers save a handle instead of y, and y is made again, bitwise, when the first of
their backwards unpacks it (Megatron-Core's output-discarding recompute, `--recompute-modules layernorm`,
without naming the consumers).

Where: inside the forward of a model handed to `shardnorm.convert(model, keep_output=False)` (`scope`: a forward
pre-hook and a forward hook on that model, nothing process-wide), which pushes torch's
`torch.autograd.graph.saved_tensors_hooks` while some norm of the model discards and its consumers do not own the
saving. Under sequence parallelism with the norm gathering its own output they do: the consumers parallelized with
`RegatherColwiseParallel` keep the norm's shard and gather it again (`distributed/regather.py`), with no hooks; the
norm only leaves its `_Remake` on its output (`REMAKE_ATTR`).

Pack and unpack (docs/memory.md): a save of a tracked output (a view or an alias of it, or a DTensor made around
it), unchanged since the norm's forward, packs a handle; every other tensor packs a detached alias with its
version, which unpack checks as autograd itself would (hooks turn off autograd's own check). The first unpack of a
backward recomputes the output with the same kernel on the same input, the others share it. The user's tensor is
never touched: y's memory goes when nothing holds it any more, and stays, correct, where something does. An input
changed in place (version counter) raises `KeepOutputError`; so does a recompute that differs from what a consumer
read in its forward (a checksum of its bits): an output written behind autograd (`.data`, a detached alias) before
a consumer saved it, or an input written so after the forward (the checks: `output_checks.py`).

Under torch.compile the hooks step aside; a norm with keep_output=False is traced inside a selective
activation checkpoint that recomputes its forward op instead (`compiled_norm`), so AOTAutograd's partitioner
gives the compiled graph the same saving (without a residual).
"""

import threading
import warnings
import weakref
from functools import partial
from typing import Callable, Optional

import torch
from torch import Tensor
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from . import _torch_compat, ops, output_checks
from .output_checks import KeepOutputError  # noqa: F401 - raised here, and public as output_recompute's
from .rows import as_dtensor, as_param, as_rows


# ---- torch.compile: a selective checkpoint around the norm ----------------------------------------------------

def compiled_norm(norm, x: Tensor, *args):
    """`norm(x, *args)` while Dynamo traces a norm with keep_output=False and no residual: inside a selective
    activation checkpoint whose policy recomputes `shardnorm::norm_fwd`, so AOTAutograd's partitioner saves
    the norm's input (which its own backward keeps anyway) rather than y for the consumers' backward, and the
    backward graph runs the forward kernel again. The residual form is traced as it is: recomputing y there
    would need x and the residual, so the compiled graph keeps y."""
    return checkpoint(norm, x, *args, use_reentrant=False, context_fn=_recompute_norm_contexts)


def compiled_transform(transform, y: Tensor):
    """`transform(y)` (a norm output's redistribution, the SP all-gather) while Dynamo traces a norm with
    keep_output=False: inside a selective checkpoint that recomputes every op of it, so the partitioner saves
    neither the gathered output nor y (itself recomputed by `compiled_norm`) and the backward graph gathers again."""
    return checkpoint(transform, y, use_reentrant=False, context_fn=_recompute_all_contexts)


def _recompute_all_contexts():
    return create_selective_checkpoint_contexts(lambda ctx, op, *args, **kwargs: CheckpointPolicy.MUST_RECOMPUTE)


def _recompute_norm_policy(ctx, op, *args, **kwargs):
    if op is torch.ops.shardnorm.norm_fwd.default:
        return CheckpointPolicy.MUST_RECOMPUTE
    return CheckpointPolicy.PREFER_SAVE


def _recompute_norm_contexts():
    return create_selective_checkpoint_contexts(_recompute_norm_policy)


# ---- where the option acts: models handed to `convert(model, keep_output=False)` -----------------------------

def check_keep_output(keep: bool) -> None:
    """A norm's option as its setter takes it (the module stores it)."""
    if not isinstance(keep, bool):
        raise TypeError(f"keep_output must be a bool, got {type(keep).__name__}")


_SCOPE_ATTR = "_shardnorm_keep_output_scope"  # on a model handed to `scope`: its _ModelScope


class _ModelScope:
    """A model whose forward pushes the pack/unpack hooks: its norms, and the handles of its two module hooks."""

    __slots__ = ("norms", "handles")

    def __init__(self, norms: list):
        self.norms, self.handles = norms, []

    def needs_hooks(self) -> bool:
        """Some norm of the model discards its output and no sequence-parallel style owns what its consumers save
        (`SP_OUTPUT_ATTR`)."""
        for norm in self.norms:
            if not norm.keep_output and not norm.__dict__.get(SP_OUTPUT_ATTR, False):
                return True
        return False


# Set by SequenceParallelNorm on a norm whose consumers' saves of its output no hook would take: its gathered output's
# consumers own the saving (`distributed/regather.py`), or its sharded output's consumers gather it themselves.
SP_OUTPUT_ATTR = "_shardnorm_sp_output"


def scope(model: torch.nn.Module, norms) -> None:
    """Make `model`'s forward the scope of its norms' `keep_output=False`: while it runs, the consumers' saves of a
    discarding norm's output take a recompute handle (`convert` calls this on the model it is handed; calling it
    again updates the norms). Hooks go on `model` only, and push nothing while every norm keeps its output."""
    existing = model.__dict__.get(_SCOPE_ATTR)
    norms = list(norms)  # submodules of `model`: held as the model holds them (a deepcopy or pickle maps them)
    if existing is not None:
        existing.norms = norms
        return
    state = _ModelScope(norms)
    state.handles.append(model.register_forward_pre_hook(partial(_enter, state)))
    state.handles.append(model.register_forward_hook(partial(_leave, state), always_call=True))
    model.__dict__[_SCOPE_ATTR] = state


_counts = {"tracked": 0, "saved_as_handle": 0, "recomputed": 0}


def count(key: str) -> None:
    """One more of `counters()`'s `key` (the sequence-parallel consumers' re-gather counts as theirs)."""
    _counts[key] += 1


def counters(reset: bool = False) -> dict:
    """Outputs tracked, consumer saves that took a handle instead of the tensor, and recomputes, since the last
    reset, in this process."""
    out = dict(_counts)
    if reset:
        _counts.update(dict.fromkeys(_counts, 0))
    return out


# ---- the scope: the model's forward -----------------------------------------------------------------------------

class _Scope(threading.local):
    depth = 0
    hooks = None  # the saved_tensors_hooks context pushed at the outermost scoped call, or None
    root = None  # that call's model: a KeyboardInterrupt skips the forward hook that would pop the hooks


_scope = _Scope()


def _enter(state: _ModelScope, module, args) -> None:
    if torch.compiler.is_compiling():
        return
    scope = _scope
    if scope.depth and scope.root is module:  # the same model again: its last forward was interrupted
        _reset(scope)
    scope.depth += 1
    if scope.depth > 1:
        return
    scope.root = module
    # not under a torch.func transform: its grad and vjp refuse saved-tensors hooks (a norm itself raises its own
    # error there); nor where the user disabled saved-tensors hooks (`disable_saved_tensors_hooks`): its norms then
    # keep their outputs
    if torch.is_grad_enabled() and state.needs_hooks() and _torch_compat.saved_tensors_hooks_enabled() \
            and not _torch_compat.saved_tensors_hooks_active() \
            and _torch_compat.current_graph_task_id() == -1 and not _torch_compat.is_compiled_module(module) \
            and not _torch_compat.functorch_transforms_active():
        scope.hooks = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
        scope.hooks.__enter__()


def _leave(state: _ModelScope, module, args, output) -> None:
    if torch.compiler.is_compiling():
        return
    scope = _scope
    if scope.depth == 0:
        return
    scope.depth -= 1
    if scope.depth == 0:
        _reset(scope)


def _reset(scope: _Scope) -> None:
    hooks, scope.hooks, scope.root, scope.depth = scope.hooks, None, None, 0
    if hooks is not None and _torch_compat.saved_tensors_hooks_top() == (_pack, _unpack):
        hooks.__exit__(None, None, None)


# ---- the recompute handle ---------------------------------------------------------------------------------------

REMAKE_ATTR = "_shardnorm_remake"  # on a tracked DTensor output: its `_Remake` (this rank's rows again)
_ATTR = "_shardnorm_recompute"  # a tracked DTensor output's handle (a DTensor has no storage of its own)
# A tracked plain output's handle, by its storage: consumers may save an alias that is no view of it (a framework's
# module-output hook that returns `y.detach()`, as ZeRO-3's does), and the entry goes with the storage.
_by_storage: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _lookup(t: Tensor) -> tuple[Optional["_Recompute"], Tensor]:
    """(the handle of the tracked output `t` is, or views, or None; the tensor whose version the handle checks)."""
    if _torch_compat.is_dtensor(t):
        handle = getattr(_torch_compat.view_base(t), _ATTR, None)
        if handle is not None:
            return handle, t
        # a DTensor its consumer built around a tracked plain output (`DTensor.from_local`, as the styles of a
        # transformers tp_plan do with their input): the handle is the local tensor's
        local = _torch_compat.dtensor_local(t)
        return (None, t) if _torch_compat.is_dtensor(local) else (_lookup(local)[0], local)
    try:
        return _by_storage.get(t.untyped_storage()), t
    except (RuntimeError, NotImplementedError):  # a tensor subclass without storage
        return None, t


def _handle_of(t: Tensor) -> Optional["_Recompute"]:
    return _lookup(t)[0]


class _Recompute:
    """How to make a tracked output's base again, bitwise, and the copy shared by one backward's consumers."""

    __slots__ = ("make", "version", "saves", "value", "sums", "unread", "__weakref__")

    def __init__(self, make: Callable[[], Tensor], version: int):
        self.make, self.version = make, version
        self.saves, self.value, self.sums, self.unread = 0, None, None, 0

    def get(self) -> tuple[Tensor, dict]:
        """(the base again, the fingerprints its consumers' views took of it: {view: sum}, shared by this backward's
        consumers, who mostly save the same view)."""
        value = self.value
        if value is None:
            with torch.no_grad():
                value = self.make()
            _counts["recomputed"] += 1
            self.value, self.sums, self.unread = value, {}, self.saves
        sums = self.sums
        self.unread -= 1
        if self.unread <= 0:  # every consumer of this backward has it: the graph holds no copy between backwards
            self.value = self.sums = None
        return value, sums


def _track(out: Tensor, make: Callable[[], Tensor]) -> None:
    """Let saves of `out` (or of views of it) take a handle that calls `make()` for `out`'s base."""
    base = _torch_compat.view_base(out)
    if _torch_compat.is_dtensor(base):
        local = base.to_local()
        if not local.is_contiguous() or local.storage_offset() != 0:
            return
    elif not base.is_contiguous() or base.storage_offset() != 0:
        return
    handle = _Recompute(make, _torch_compat.tensor_version(base))
    if _torch_compat.is_dtensor(base):
        setattr(base, _ATTR, handle)
    else:
        _by_storage[base.untyped_storage()] = handle
    _counts["tracked"] += 1


def recompute_of(t: Tensor) -> Optional[Callable[[], Tensor]]:
    """What remakes `t`'s base (a tracked output's), or None."""
    handle = _handle_of(t)
    return None if handle is None else handle.make


def derive(out: Tensor, src: Tensor, transform: Callable[[Tensor], Tensor]) -> None:
    """`out = transform(src)` (exact: `to_local`, a redistribute that gathers nothing): saves of `out` inside a scope
    take a handle too, which remakes src and applies `transform` under no_grad. Under no_grad, transform must return
    a tensor laid out in memory as out's base (a view's storage: as_strided)."""
    make = recompute_of(src)
    if make is not None and _scope.hooks is not None:
        _track(out, lambda: transform(make()))


class _Saved:
    """A consumer's save of a tracked output: the handle, where in the base the saved view lies, and the view's
    fingerprint as the consumer saw it (a write through `.data` bumps no version counter)."""

    __slots__ = ("handle", "view", "dtensor", "fingerprint")

    def __init__(self, handle: _Recompute, t: Tensor):
        self.handle, self.view, self.dtensor = handle, None, None
        handle.saves += 1
        with torch.no_grad():
            self.fingerprint = output_checks.fingerprint(t)
        if _torch_compat.is_dtensor(t):
            if getattr(t, _ATTR, None) is handle:  # the tracked DTensor itself
                return
            local = _torch_compat.dtensor_local(t)
            self.view = (local.size(), local.stride(), local.storage_offset())
            self.dtensor = (t.device_mesh, t.placements, t.size(), t.stride())
        else:
            self.view = (t.size(), t.stride(), t.storage_offset())

    def unpack(self) -> Tensor:
        base, sums = self.handle.get()
        out = self._view(base)
        with torch.no_grad():
            recomputed = sums.get(self.view)
            if recomputed is None:
                recomputed = sums[self.view] = output_checks.fingerprint(out)
        output_checks.check_equal(recomputed, self.fingerprint, output_checks.changed_output_error)
        return out

    def _view(self, base: Tensor) -> Tensor:
        if self.view is None:
            return base
        if self.dtensor is None:
            return base.as_strided(*self.view)
        with torch.no_grad():
            local = base.to_local() if _torch_compat.is_dtensor(base) else base
            return as_dtensor(local.as_strided(*self.view), *self.dtensor)


def _pack(t: Tensor):
    handle, versioned = _lookup(t)
    if handle is not None and _torch_compat.tensor_version(versioned) == handle.version:
        _counts["saved_as_handle"] += 1
        return _Saved(handle, t)
    # A detached alias: the tensor itself would tie an op's saved output to its own grad_fn (a reference cycle
    # autograd cannot break). It shares t's version counter, checked at unpack as autograd checks it.
    return t.detach(), _torch_compat.tensor_version(t)


def _unpack(packed):
    if type(packed) is _Saved:
        return packed.unpack()
    t, version = packed
    if _torch_compat.tensor_version(t) != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.type()} {list(t.shape)}] is at version {_torch_compat.tensor_version(t)}; expected version "
            f"{version} instead (saved while shardnorm's keep_output=False hooks were active)")
    return t


# ---- the norm's side: track its output --------------------------------------------------------------------------

def track(owner, y: Tensor, src: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float, rms: bool,
          zero_centered: bool, n: int) -> None:
    """Called by a keep_output=False norm right after its forward: saves of y take a recompute handle. `src` is
    x, or z = x + residual (the kernels normalize the rounded z); `n` the normalized size."""
    if not y.requires_grad or y.numel() == 0 or not torch.is_grad_enabled() or torch.compiler.is_compiling():
        return
    output_checks.check_arrived()
    top = _torch_compat.saved_tensors_hooks_top()
    if top is not None and top != (_pack, _unpack):
        # hooks pushed inside the model (a checkpoint, an offload) take the consumers' saves: the option has nothing
        # to act on, and reading the norm node's saves below would run their unpack in the forward (a non-reentrant
        # checkpoint recomputes its region there; a single-use unpack leaves the backward without its tensor)
        return
    if _scope.hooks is None:
        sequence_parallel = owner is not None and owner.__dict__.get(SP_OUTPUT_ATTR, False)
        # (a reentrant checkpoint's recompute runs inside the backward, outside any forward: nothing to warn of)
        if not sequence_parallel and _scope.depth == 0 and _torch_compat.current_graph_task_id() == -1:
            _warn_unscoped(owner)
        if not (sequence_parallel and _torch_compat.is_dtensor(y)):  # nothing would take a handle
            return
    versioned = src  # what an in-place write bumps: a DTensor's own counter, not its local tensor's
    if _torch_compat.is_dtensor(y):
        local = _dtensor_locals(y, src, weight, bias, n)
        if local is None:
            return
        y_local, src, weight, bias = local
    elif all(type(t) in ops._PLAIN for t in (src, weight, bias)):
        y_local = y
    else:
        return
    node = _norm_node(y, y_local)
    if node is None:
        return
    kernel_weight = node.saved_tensors[1]  # the weight as the kernel read it (`ops._save`: src, weight, mean, rstd)
    # The parameters as the kernel read them (an fp32 copy where the grads go to a reducer: the same launch again),
    # copied (N elements each): FSDP2 and ZeRO-3 free a gathered parameter after the forward and gather it again
    # only when the backward reaches its own module. The norm's own fp32 copy is no parameter: its node holds it.
    with torch.no_grad():
        if kernel_weight is not None and weight is not None and kernel_weight.dtype != weight.dtype:
            weight = kernel_weight
            bias = as_param(bias.detach(), n).to(kernel_weight.dtype, copy=True) if bias is not None else None
        else:
            weight, bias = (as_param(p.detach(), n).clone() if p is not None else None for p in (weight, bias))
    remake = _Remake(owner, src, versioned, weight, bias, eps, rms, zero_centered, n, y_local.dtype)
    if _torch_compat.is_dtensor(y):
        setattr(y, REMAKE_ATTR, remake)  # what a gathering style's consumers re-gather from (distributed/regather.py)
        if _scope.hooks is None:
            return
        mesh, placements, shape, stride, local_shape = y.device_mesh, y.placements, y.shape, y.stride(), y_local.shape

        def make():
            return as_dtensor(remake().view(local_shape), mesh, placements, shape, stride)

        _track(y, make)
    else:
        _track(y, remake)


def _norm_node(y: Tensor, y_local: Tensor):
    """The autograd node of the norm call that made y (its saves begin src, weight as read, mean, rstd:
    `ops._save`), or None where y's node is no norm node."""
    node = y.grad_fn if _torch_compat.is_dtensor(y) else None
    if getattr(node, "flags", None) is None:
        node = _torch_compat.view_base(y_local).grad_fn
    return node if getattr(node, "flags", None) is not None else None


class _Remake:
    """The norm's output again, from the kept input, as the base [M, N] tensor the op returned."""

    __slots__ = ("owner", "src", "versioned", "src_version", "weight", "bias", "eps", "rms", "zero_centered", "n",
                 "dtype")

    def __init__(self, owner, src, versioned, weight, bias, eps, rms, zero_centered, n, dtype):
        """`versioned`: the norm's input as the user holds it (a DTensor's in-place ops bump the DTensor's own
        version counter, not its local tensor's)."""
        self.owner, self.weight, self.bias, self.eps, self.rms, self.zero_centered = \
            owner, weight, bias, float(eps), rms, zero_centered
        self.src, self.versioned, self.n, self.dtype = src, versioned, n, dtype
        self.src_version = (_torch_compat.tensor_version(versioned), _torch_compat.tensor_version(src))

    def __call__(self) -> Tensor:
        """y again. An input changed in place raises here; one changed behind autograd (`.data`) changes y, which
        the consumers' checks see: every use of the recompute compares it with what its consumer's forward read
        (`output_checks.fingerprint`), so the recompute's statistics need no check of their own."""
        src = self.src
        if (_torch_compat.tensor_version(self.versioned), _torch_compat.tensor_version(src)) != self.src_version:
            raise KeepOutputError(f"{self.name()}: the norm's input (x, or x + residual) was modified in place "
                                  "after the forward; its output cannot be recomputed")
        return ops.recompute_output(as_rows(src.detach(), self.n), self.weight, self.bias, self.eps, self.rms,
                                    self.zero_centered, self.dtype)[0]

    def name(self) -> str:
        return f"{type(self.owner).__name__} (keep_output=False)" if self.owner is not None else "a norm"


def warn_once(norm: torch.nn.Module, what: str, message: str, stacklevel: int = 1) -> None:
    """`message` as a UserWarning, once per norm module and `what` (the option's effect, said where it has none);
    `stacklevel` as `warnings.warn` counts it from the caller."""
    said = norm.__dict__.setdefault("_shardnorm_warned", set())
    if what not in said:
        said.add(what)
        warnings.warn(message, stacklevel=stacklevel + 1)


def warned(norm: torch.nn.Module, what: str) -> bool:
    return what in norm.__dict__.get("_shardnorm_warned", ())


def _warn_unscoped(owner) -> None:
    """Its option has no effect where no model of its was handed to `convert(model, keep_output=False)` (the scope
    its consumers' saves are taken in)."""
    if owner is not None:
        warn_once(owner, "unscoped", f"shardnorm: {type(owner).__name__} has keep_output=False but runs outside a "
                  "model handed to shardnorm.convert(model, keep_output=False), so its consumers keep its output: "
                  "pass the model that calls it (the outermost one you call) to convert", stacklevel=4)


def _dtensor_locals(y, src, weight, bias, n: int) -> Optional[tuple]:
    """(y, src, weight, bias) as this rank's tensors when each rank's norm is its own (rows sharded or
    replicated, parameters replicated); None otherwise (hidden-sharded: the recompute needs collectives)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    for t in (y, src):
        if not isinstance(t, DTensor) or t.shape[-1:].numel() == 0:
            return None
        normalized_from = t.dim() - 1 if t.shape[-1] == n else None
        for p in t.placements:
            if not (isinstance(p, Replicate) or isinstance(p, Shard) and normalized_from is not None
                    and p.dim % t.dim() < normalized_from):
                return None
    for p in (weight, bias):
        if isinstance(p, DTensor) and not all(isinstance(q, Replicate) for q in p.placements):
            return None
    # a collective's pending result (the embedding's reduce-scatter) as the op saw it: waited
    local = tuple(ops._ready(_torch_compat.dtensor_local(t)) if isinstance(t, DTensor) else t
                  for t in (y, src, weight, bias))
    return local if all(type(t) in ops._PLAIN for t in local[1:]) else None
