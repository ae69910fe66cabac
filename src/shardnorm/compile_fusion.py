"""Under torch.compile, the adds around a shardnorm norm run inside the norm's kernels: two Inductor graph passes,
installed by `enable()`, off by default.

Inductor fuses neighbouring adds into its own norm kernels, but cannot look inside a custom op. Two graph
passes give ours the same:

- `fuse_residual_adds` (forward; the graph Dynamo hands Inductor, before autograd is traced). A pre-norm
  decoder layer computes `h = residual + out`, normalizes h and keeps h as the next residual: each such
  pair becomes one `shardnorm::norm_fwd(out, ..., residual=residual)` returning y and h. The forward reads
  the two inputs once and writes h and y; the backward adds h's other grads inside the norm's backward
  kernel (`dz`). Exact: the kernel rounds h to its dtype before it normalizes, as the add does.
- `fuse_grad_terms` (backward; aten graphs after Inductor's own passes). The norm's output feeds several
  matmuls (q, k, v; gate, up), so its grad is an add of their input grads: `norm_bwd(dy1 + dy2 + dy3)`
  becomes `norm_bwd(dy1, ..., dy2=dy2, dy3=dy3)`, summed in fp32 inside the kernel (no add kernel that
  writes the sum and reads it back).

Turning them on:

    import shardnorm.compile_fusion
    shardnorm.compile_fusion.enable()   # before torch.compile runs; disable() takes them out again

or `SHARDNORM_COMPILE_FUSION=1`, which enables them the first time Inductor traces a shardnorm norm (for scripts
you do not edit). They go into Inductor's config (`pre_grad_custom_pass`,
`post_grad_custom_post_pass`; on torch >= 2.13 a config value set in code holds for the thread that set it),
after any pass of your own already there, which is kept and runs first; `disable()` puts back what was there.

Off by default because they change a global compiler setting and their measured end-to-end gain is within run-to-run
noise. On an H100 (torch 2.11; compiled Hugging Face Llama, Qwen3 and Gemma training steps) they cut the GPU time
outside the GEMMs of a Llama step from 9.88 to 9.03 ms (native compile: 9.11 ms; `benchmarks/profile_hf_step.py`),
but the whole ~104 ms step moved by -1.9 to +1.3 ms with them across interleaved runs (mean +0.1 ms), and the paired
per-run effect was significant in both directions (-0.61 to +1.00 ms; `benchmarks/bench_hf_models.py`, then
`benchmarks/paired_steps.py`). The main job compiled on one H100 (`launch/train.sh configs/llama_small_fsdp_tp.toml
parallel.tp=1 train.steps=30 --compile`, one run each, not interleaved): 191.8 ms per step without them, 186.2 ms
with them. docs/performance.md has the tables.

The passes are module-level `CustomGraphPass` objects with a stable `uuid()` (this file's contents): Inductor's FX
graph cache keys on it, and a compile in a fresh process hits the cache entries an earlier process wrote (with a
pass that has no uuid, such as a plain function of yours, Inductor bypasses its cache). `counts` holds what they did
(graphs seen, adds fused, grad terms fused) for logs and tests.
"""

import collections
import functools
import hashlib
import logging
import operator

import torch
from torch import fx

from . import _torch_compat, settings
from .rows import as_rows

counts = collections.Counter()
_log = logging.getLogger(__name__)

# Inductor's base class for a graph pass its caches can key on. This module is imported for torch.compile only
# (Dynamo has imported Inductor by the time it traces a norm), so the import costs nothing there.
_GraphPass = _torch_compat.inductor_graph_pass_base()


class FusionPass(_GraphPass):
    """Shardnorm's pass `name` at its Inductor slot, run after `previous`: what the slot held when it was enabled
    (None, one pass, or a list of passes), kept and run first.

    Pickles as (name, previous), the same bytes in every process: torch 2.11 pickles the pre-grad slot with the rest
    of Inductor's config into the FX graph cache key (2.13 leaves the slots out and keys on `uuid()` alone). A pass
    of a local class cannot be pickled: Inductor 2.11 then logs "Failed to pickle cache key" and bypasses the
    cache, compiling every graph anew."""

    def __init__(self, name: str, previous=None):
        if name not in PASSES:
            raise ValueError(f"name must be one of {tuple(PASSES)}, got {name!r}")
        self.name, self.previous = name, previous

    def __call__(self, graph: fx.Graph) -> None:
        for earlier in _as_tuple(self.previous):
            earlier(graph)
        PASSES[self.name][1](graph)

    def uuid(self):
        """The earlier passes' uuids and this pass's name and source; None (no caching) if an earlier pass has none:
        Inductor could not tell when that pass changes."""
        keys = [p.uuid() if isinstance(p, _GraphPass) else None for p in _as_tuple(self.previous)]
        if any(key is None for key in keys):
            return None
        return (*keys, f"shardnorm.compile_fusion.{self.name}:{_source_hash()}")

    def __reduce__(self):
        return FusionPass, (self.name, self.previous)

    def __repr__(self):
        return f"FusionPass({self.name!r}, previous={self.previous!r})"


def enable() -> None:
    """Run both passes in every graph Inductor compiles from now on, after the passes already set in their slots.
    Idempotent. Takes effect for compiles that start afterwards (a function compiled before keeps its code until
    Dynamo recompiles it, e.g. after `torch._dynamo.reset()`)."""
    installed = []
    for name, (slot, _) in PASSES.items():
        current = _torch_compat.inductor_graph_pass(slot)
        if not _holds(current, name):
            _torch_compat.set_inductor_graph_pass(slot, FusionPass(name, current))
            installed.append(name)
    if installed:
        _log.info("shardnorm.compile_fusion: Inductor passes %s enabled (residual adds into norm_fwd, grad sums into "
                  "norm_bwd; shardnorm.compile_fusion.disable() removes them)", ", ".join(installed))


def disable() -> None:
    """Take both passes out of Inductor's config, leaving the passes that were set before or after them."""
    if not _torch_compat.inductor_loaded():  # nothing can have been installed
        return
    for name, (slot, _) in PASSES.items():
        current = _torch_compat.inductor_graph_pass(slot)
        if _holds(current, name):
            _torch_compat.set_inductor_graph_pass(slot, _without(current, name))


def is_enabled() -> bool:
    """Whether both passes are in Inductor's config (for this thread on torch >= 2.13)."""
    return _torch_compat.inductor_loaded() and all(
        _holds(_torch_compat.inductor_graph_pass(slot), name) for name, (slot, _) in PASSES.items())


def enable_if_requested() -> None:
    """`enable()` if SHARDNORM_COMPILE_FUSION=1. The op's fake impl calls this each time Dynamo traces a norm."""
    if settings.get().compile_fusion and not is_enabled():
        enable()


def _as_tuple(passes) -> tuple:
    return () if passes is None else tuple(passes) if isinstance(passes, (list, tuple)) else (passes,)


def _holds(passes, name: str) -> bool:
    """Whether shardnorm's pass `name` is among `passes` (a slot's value), before or after other passes."""
    for p in _as_tuple(passes):
        if isinstance(p, FusionPass) and (p.name == name or _holds(p.previous, name)):
            return True
    return False


def _without(passes, name: str):
    """A slot's value without shardnorm's pass `name`: the passes around it stay, in order."""
    if isinstance(passes, FusionPass):
        if passes.name == name:
            return _without(passes.previous, name)
        return FusionPass(passes.name, _without(passes.previous, name))
    if isinstance(passes, (list, tuple)):
        kept = [q for p in passes for q in _as_tuple(_without(p, name))]
        return type(passes)(kept) if kept else None
    return passes


@functools.cache
def _source_hash() -> str:
    """This file's contents: what Inductor's caches must see change."""
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def fuse_residual_adds(graph: fx.Graph) -> int:
    """Rewrite each `norm_fwd(rows(a + b))` without a residual into `norm_fwd(rows(a), residual=rows(b))`
    whose second output replaces a + b everywhere. Returns the number fused in `graph`."""
    norm_op = torch.ops.shardnorm.norm_fwd.default
    fused = 0
    for norm in [n for n in graph.nodes if n.op == "call_function" and n.target is norm_op]:
        add, rows = _fusable(norm)
        if add is None:
            continue
        x, weight, bias, _, eps, rms, zero_centered = norm.args
        a, b = add.args
        with graph.inserting_before(norm):
            new = graph.call_function(_add_then_norm, (a, b, weight, bias, eps, rms, zero_centered))
            h = graph.call_function(operator.getitem, (new, 1))
        old_outputs = norm.meta.get("example_value")
        if old_outputs is not None:
            new.meta["example_value"] = (old_outputs[0], add.meta["example_value"], *old_outputs[2:])
        h.meta["example_value"] = add.meta["example_value"]
        norm.replace_all_uses_with(new)  # y, mean, rstd keep their indices; index 1 (z) had no user
        add.replace_all_uses_with(h)
        for dead in (norm, rows, add):
            if dead is not None and not dead.users:
                graph.erase_node(dead)
        fused += 1
    counts["graphs"] += 1
    counts["fused_adds"] += fused
    if fused:
        _log.info("shardnorm: fused %d residual add(s) into norm kernels", fused)
    return fused


def _add_then_norm(x, residual, weight, bias, eps, rms, zero_centered):
    """(y, x + residual in x's shape, mean, rstd): the fused op on [M, N] rows."""
    n = x.shape[-1]
    y, z, mean, rstd = torch.ops.shardnorm.norm_fwd(as_rows(x, n), weight, bias, as_rows(residual, n), eps, rms,
                                                    zero_centered)
    return y, z.view(x.shape), mean, rstd


_ADD_FUNCTIONS = (operator.add, torch.add)
_RESHAPES = ("reshape", "view")


def _fusable(norm: fx.Node):
    """(the add node, the reshape between it and the norm or None) if `norm` can take the add in, else
    (None, None). Only a plain same-shape, same-dtype add of two tensors whose every other use comes after
    the norm (where h will be defined), feeding a norm without a residual."""
    if len(norm.args) != 7 or norm.kwargs or norm.args[3] is not None:
        return None, None
    if any(user.op != "call_function" or user.target is not operator.getitem or user.args[1] == 1
           for user in norm.users):
        return None, None
    x = norm.args[0]
    rows = None
    if isinstance(x, fx.Node) and x.op == "call_method" and x.target in _RESHAPES and len(x.users) == 1:
        rows, x = x, x.args[0]
    if not (isinstance(x, fx.Node) and _is_add(x)):
        return None, None
    a, b = x.args
    h, va, vb = (_value(n) for n in (x, a, b))
    if h is None or va is None or vb is None or h.dim() == 0:  # h's dtype: the norm's own checks passed it
        return None, None
    if any(v.shape != h.shape or v.dtype != h.dtype or v.device != h.device for v in (va, vb)):
        return None, None
    rows_value = _value(rows if rows is not None else x)
    if rows_value is None or rows_value.dim() != 2 or rows_value.shape[1] != h.shape[-1]:
        return None, None
    for node in _between(x, norm):  # h's other uses must come after the norm, where the fused op defines it
        if x in node.all_input_nodes and node is not rows:
            return None, None
    return x, rows


def _is_add(node: fx.Node) -> bool:
    is_add = (node.op == "call_function" and node.target in _ADD_FUNCTIONS
              or node.op == "call_method" and node.target == "add")
    return is_add and len(node.args) == 2 and not node.kwargs and all(isinstance(a, fx.Node) for a in node.args)


def _value(node):
    """The plain (fake) tensor Dynamo recorded for `node`; None for anything else (a DTensor, a tuple)."""
    value = node.meta.get("example_value") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor) or hasattr(type(value), "__tensor_flatten__"):
        return None
    return value


def _between(first: fx.Node, last: fx.Node):
    node = first.next
    while node is not last:
        yield node
        node = node.next


# ---- the backward: the norm's grad is a sum ---------------------------------------------------------------

_aten = torch.ops.aten
_ATEN_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)
MAX_GRAD_TERMS = 3  # dy, dy2, dy3 of `shardnorm::norm_bwd`
_BWD_ARGS = 9  # norm_bwd's arguments before dy2, dy3 (dy ... zero_centered)


def fuse_grad_terms(graph: fx.Graph) -> int:
    """Rewrite each `norm_bwd(view(t1 + t2 [+ t3]), ...)` (every add and view used only there) into
    `norm_bwd(view(t1), ..., dy2=view(t2)[, dy3=view(t3)])`. Returns the number of adds removed."""
    norm_bwd = torch.ops.shardnorm.norm_bwd.default
    removed = 0
    for norm in [n for n in graph.nodes if n.op == "call_function" and n.target is norm_bwd]:
        dy = norm.args[0]
        if len(norm.args) != _BWD_ARGS or norm.kwargs or not isinstance(dy, fx.Node):  # already given terms
            continue
        terms = _sum_terms(_strip_views(dy))
        if not 2 <= len(terms) <= MAX_GRAD_TERMS or not _same_rows(terms, dy):
            continue
        dy_value = dy.meta["val"]
        views = []
        with graph.inserting_before(norm):
            for term in terms:
                view = graph.call_function(_aten.view.default, (term, list(dy_value.shape)))
                view.meta["val"] = term.meta["val"].view(dy_value.shape)
                views.append(view)
        views += [None] * (MAX_GRAD_TERMS - len(views))
        old_chain = _chain(dy, stop=set(terms))
        norm.args = (views[0], *norm.args[1:], *views[1:])
        if "eager_input_vals" in norm.meta:  # the inputs' layouts Inductor holds the op to: now with the terms
            (_, *rest), kwargs = norm.meta["eager_input_vals"]
            vals = [None if v is None else v.meta["val"] for v in views]
            norm.meta["eager_input_vals"] = ((vals[0], *rest[:_BWD_ARGS - 1], *vals[1:]), kwargs)
        for node in old_chain:  # users before what they use
            if not node.users:
                graph.erase_node(node)
        removed += len(terms) - 1
    counts["fused_grad_terms"] += removed
    if removed:
        _log.info("shardnorm: %d grad add(s) summed inside norm backward kernels", removed)
    return removed


def _strip_views(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _ATEN_VIEWS and len(node.users) == 1:
        node = node.args[0]
    return node


def _sum_terms(node: fx.Node) -> list:
    """The leaves of the add tree `node` is (through adds and views used once), left to right; [node] if it
    is no add."""
    if node.op == "call_function" and node.target is _aten.add.Tensor and len(node.users) == 1 and \
            len(node.args) == 2 and not node.kwargs and all(isinstance(a, fx.Node) for a in node.args):
        return [leaf for a in node.args for leaf in _sum_terms(_strip_views(a))]
    return [node]


def _same_rows(terms, dy: fx.Node) -> bool:
    """Every term a contiguous tensor of dy's dtype, device, size and row length: a view of it is dy's term."""
    want = dy.meta.get("val")
    values = [t.meta.get("val") for t in terms]
    if not isinstance(want, torch.Tensor) or not want.is_contiguous() or \
            any(not isinstance(v, torch.Tensor) for v in values):
        return False
    return all(v.dtype == want.dtype and v.device == want.device and v.numel() == want.numel() and v.dim() > 0
               and v.shape[-1] == want.shape[-1] and v.is_contiguous() for v in values)


def _chain(dy: fx.Node, stop: set) -> list:
    """dy and the views and adds below it down to the terms, users before what they use."""
    out, stack = [], [dy]
    while stack:
        node = stack.pop()
        if node not in stop and node not in out:
            out.append(node)
            stack.extend(a for a in node.args if isinstance(a, fx.Node))
    return out


# name -> (Inductor slot, the rewrite)
PASSES = {"fuse_residual_adds": (_torch_compat.INDUCTOR_PRE_GRAD_SLOT, fuse_residual_adds),
          "fuse_grad_terms": (_torch_compat.INDUCTOR_POST_GRAD_SLOT, fuse_grad_terms)}
