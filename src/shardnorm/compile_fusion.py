"""Under torch.compile, the adds around a shardnorm norm run inside kernels that exist anyway.

Inductor fuses the adds next to its own norm kernels, but cannot look inside a custom op, so two graph
passes do it for ours:

- `fuse_residual_adds` (before autograd is traced): a pre-norm decoder layer computes `h = residual + out`,
  normalizes h and keeps h as the next residual. Each such pair becomes one
  `shardnorm::norm_fwd(out, ..., residual=residual)` that returns y and h: the forward reads the two inputs
  once and writes h and y; the backward adds h's other grads inside the norm's backward kernel (`dz`).
  Exact: the kernel rounds h to its dtype before it normalizes, as the add does.
- `fuse_grad_sums` (the backward graph): a norm's output feeds several projections (q, k, v; gate, up),
  so its grad dy is a sum of matmuls, `dq @ Wq + dk @ Wk + dv @ Wv`, summed by an add kernel that reads
  and writes every term. The sum moves into the matmuls' epilogues (`addmm`: the previous term is read
  as C), which costs next to nothing in a compute-bound GEMM. One rounding instead of one per add.

Installed by the op's first trace under Inductor (`ops._norm_fwd_fake`); `SHARDNORM_COMPILE_FUSION=0`
turns both off. `counts` holds what they did (graphs seen, adds fused) for logs and tests.
"""

import collections
import functools
import hashlib
import logging
import operator
import os

import torch
from torch import fx

from . import _torch_compat

ENV = "SHARDNORM_COMPILE_FUSION"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
counts = collections.Counter()
_log = logging.getLogger(__name__)
_installed = False


def install() -> bool:
    """Hand the pass to Inductor (once; cheap to call again). False while Inductor is not loaded."""
    global _installed
    if not _installed:
        _installed = (_torch_compat.add_inductor_graph_pass("pre_grad_custom_pass", fuse_residual_adds, _uuid)
                      and _torch_compat.add_inductor_graph_pass("post_grad_custom_post_pass", fuse_grad_sums, _uuid))
    return _installed


def _enabled() -> bool:
    return os.environ.get(ENV, "1") != "0"


def _uuid() -> str:
    """This file's contents and the on/off switch: what Inductor's caches must see change."""
    return f"{_source_hash()}-{int(_enabled())}"


@functools.cache
def _source_hash() -> str:
    with open(__file__, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def fuse_residual_adds(graph: fx.Graph) -> int:
    """Rewrite each `norm_fwd(rows(a + b))` without a residual into `norm_fwd(rows(a), residual=rows(b))`
    whose second output replaces a + b everywhere. Returns the number fused in `graph`."""
    if not _enabled():
        return 0
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
    y, z, mean, rstd = torch.ops.shardnorm.norm_fwd(_rows(x, n), weight, bias, _rows(residual, n), eps, rms,
                                                    zero_centered)
    return y, z.view(x.shape), mean, rstd


def _rows(t, n):
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 else t.contiguous()


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
    if h is None or va is None or vb is None or h.dtype not in SUPPORTED_DTYPES or h.dim() == 0:
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


# ---- the backward: dy = a sum of matmuls ------------------------------------------------------------------

_aten = torch.ops.aten
_ATEN_VIEWS = (_aten.view.default, _aten.reshape.default, _aten._unsafe_view.default)


def fuse_grad_sums(graph: fx.Graph) -> int:
    """Rewrite each norm backward's `dy = reshape(mm_1 + ... + mm_k)` (k >= 2, every term used only there)
    into a chain of `addmm`s after the last of those matmuls. Returns the number of adds removed."""
    if not _enabled():
        return 0
    norm_bwd = torch.ops.shardnorm.norm_bwd.default
    order = {node: i for i, node in enumerate(graph.nodes)}
    removed = 0
    for norm in [n for n in graph.nodes if n.op == "call_function" and n.target is norm_bwd]:
        dy = norm.args[0]
        terms = _matmul_terms(_strip_views(dy)) if isinstance(dy, fx.Node) else None
        if not terms or len(terms) < 2 or not _same_layout(terms, dy):
            continue
        terms.sort(key=order.__getitem__)
        total, total_value = terms[-1], terms[-1].meta["val"]
        point = terms[-1]
        for mm in terms[:-1]:
            with graph.inserting_after(point):
                point = graph.call_function(_aten.addmm.default, (total, *mm.args))
            total_value = _aten.addmm.default(total_value, *(a.meta["val"] for a in mm.args))
            point.meta["val"] = total_value
            total = point
        with graph.inserting_before(norm):
            new_dy = graph.call_function(_aten.reshape.default, (total, list(dy.meta["val"].shape)))
        new_dy.meta["val"] = total_value.reshape(dy.meta["val"].shape)
        old_chain = _chain(dy)
        norm.replace_input_with(dy, new_dy)
        for node in old_chain + terms[:-1]:  # users first: the adds and views, then the replaced matmuls
            if not node.users:
                graph.erase_node(node)
        removed += len(terms) - 1
    counts["fused_grad_sums"] += removed
    if removed:
        _log.info("shardnorm: summed %d norm-grad term(s) in matmul epilogues", removed)
    return removed


def _strip_views(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and node.target in _ATEN_VIEWS and len(node.users) == 1:
        node = node.args[0]
    return node


def _matmul_terms(node: fx.Node):
    """The mm nodes whose sum `node` is, through adds and reshapes each used once; None if anything else."""
    if node.op != "call_function" or len(node.users) != 1:
        return None
    if node.target is _aten.mm.default:
        return [node]
    if node.target is _aten.add.Tensor and len(node.args) == 2 and not node.kwargs and \
            all(isinstance(a, fx.Node) for a in node.args):
        left, right = (_matmul_terms(_strip_views(a)) for a in node.args)
        return left + right if left and right else None
    return None


def _same_layout(terms, dy: fx.Node) -> bool:
    """Every term an [M, N] matmul of dy's dtype and size: their sum, reshaped, is dy."""
    values = [t.meta.get("val") for t in terms] + [dy.meta.get("val")]
    if any(v is None for v in values):
        return False
    first, want = values[0], values[-1]
    return all(v.shape == first.shape and v.dtype == want.dtype for v in values[:-1]) and \
        first.dim() == 2 and first.numel() == want.numel()


def _chain(dy: fx.Node) -> list:
    """dy and the views and adds below it, users before what they use (the order to erase them in)."""
    out, stack = [], [dy]
    while stack:
        node = stack.pop()
        if node.op == "call_function" and node.target is not _aten.mm.default and node not in out:
            out.append(node)
            stack.extend(a for a in node.args if isinstance(a, fx.Node))
    return out
