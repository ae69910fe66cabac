"""Sequence-parallel norm outputs that their consumers gather again in backward (`keep_output=False`).

A norm under `SequenceParallelNorm(output_layouts=Replicate())` all-gathers its output for the column-parallel
linears that read it (q/k/v, gate/up). Those linears would save the gathered tensor for their weight grads: every
rank would keep the whole [b, s, h] per norm. With the norm's `keep_output=False`, the consumers parallelized with
`RegatherColwiseParallel` save a `GatheredOutput` instead: in backward the first of them recomputes the norm's local
output (same kernel, same input, bitwise) and all-gathers it again, asynchronously, while its dgrad GEMM runs; the
others share that copy and the last drops it (Megatron-Core's column-parallel linear under sequence parallelism,
one gather serving every consumer as in torchtitan's `AllGatherLinearMulti`). Nothing else is intercepted: the
consumers own their saves, and a model without such consumers runs as torch runs it.

Checked, not assumed: the norm's input changed in place after the forward (version counter), and a re-gathered copy
that differs from what a consumer read (a checksum of the bits each consumer read against the copy's: the gathered
output, or the norm's input, written behind autograd); either raises `KeepOutputError`
(on a GPU as soon as the backward's flags reach the host: `output_checks.check_equal`).

Under torch.compile the consumers run torch's linear and a selective checkpoint recomputes the norm and the gather
(`output_recompute.compiled_transform`): the partitioner keeps the same shard.
"""

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

from shardnorm import _torch_compat, ops, output_checks, output_recompute
from shardnorm.distributed import sequence_gather
from shardnorm.rows import as_dtensor, cached_spec

_ATTR = "_shardnorm_gathered"  # on the norm's gathered output DTensor: its GatheredOutput


class GatheredOutput:
    """One forward's gathered norm output as its consumers keep it: how to make it again, and the copy one backward's
    consumers share."""

    __slots__ = ("remake", "norm", "dim", "local_shape", "spec", "consumers", "unread", "work", "value",
                 "fingerprint")

    def __init__(self, remake: Callable[[], Tensor], y: DTensor, norm: "_NormGathers"):
        self.remake = remake  # () -> the norm's local output rows, bitwise the forward's (`output_recompute._Remake`)
        self.norm, self.dim = norm, y.placements[0].dim % y.dim()
        self.local_shape = _torch_compat.dtensor_local(y).shape
        self.spec = (y.device_mesh, y.placements, y.shape, y.stride())
        self.consumers = self.unread = 0
        self.work = self.value = self.fingerprint = None

    def taken(self) -> None:
        """A consumer's forward saved this instead of the gathered tensor."""
        self.norm.taken = True
        self.consumers += 1
        output_recompute.count("saved_as_handle")

    def start(self) -> None:
        """Recompute the local output and launch its all-gather, once per backward (the consumer's dgrad GEMM runs
        while it travels)."""
        if self.value is not None or self.work is not None:
            return
        with torch.no_grad():
            local = self.remake().view(self.local_shape)
            output_recompute.count("recomputed")
            self.unread = self.consumers
            if self.local_shape[self.dim] * self.norm.world == self.spec[2][self.dim]:  # even: one async gather
                self.work = sequence_gather.start_gather(local, self.norm.group)
            else:  # uneven shards: DTensor's own padded gather, as the forward's
                self.value = as_dtensor(local, *self.spec).redistribute(placements=(Replicate(),)).to_local()

    def take(self, seen: Tensor) -> Tensor:
        """The gathered output again; `seen`: the checksum of what this consumer's forward read (`fingerprint`)."""
        if self.value is None:
            self.value = sequence_gather.gathered(self.work, self.dim, self.norm.world, self.local_shape, self.spec[2])
            self.work = None
        value = self.value
        if self.fingerprint is None:
            self.fingerprint = output_checks.fingerprint(value)
        output_checks.check_equal(self.fingerprint, seen, output_checks.changed_output_error)
        self.unread -= 1
        if self.unread <= 0:  # every consumer of this backward has it: nothing holds a copy between backwards
            self.value = self.fingerprint = None
        return value


class _NormGathers:
    """What a gathering norm's forwards share: its tensor-parallel group and size (DeviceMesh.size costs ~30 us a
    call), and whether a consumer has taken one of its gathered outputs yet (`_warn_if_unused` watches until then)."""

    __slots__ = ("group", "world", "taken")

    def __init__(self, mesh):
        self.group, self.world, self.taken = mesh.get_group(0), mesh.size(), False

    def __deepcopy__(self, memo):
        return None  # a copied norm makes its own at its first gathering forward (`attach`): groups do not copy


class _RegatherLinear(torch.autograd.Function):
    """F.linear of a `Replicate` DTensor `x` and this rank's column shard (`weight`, `bias`: `Shard(0)` DTensors) on
    their local tensors, taking and returning DTensors with specs cached per module (`rows.cached_spec`: no
    `to_local` / `from_local` nodes, no DTensor dispatch). Saves the weight and either x's local tensor or, for a
    keep_output=False norm's gathered output, its `GatheredOutput` instead. The backward computes what autograd's
    own linear backward computes, with the same ops in the same layouts (bitwise the grads of torch's linear under
    `ColwiseParallel`): dx = dy @ w (a `Partial` sum over the tensor-parallel ranks), dw = dy^T @ x, db = sum(dy)."""

    @staticmethod
    def forward(ctx, x, weight, bias, gathered: Optional[GatheredOutput], specs: dict):
        local = _torch_compat.dtensor_local
        x_local, w = ops._ready(local(x)), local(weight)
        ctx.gathered, ctx.specs, ctx.x_meta = gathered, specs, (x.shape, x.dtype, x_local.shape)
        ctx.param_meta = [(p.shape, p.stride()) if p is not None else None for p in (weight, bias)]
        if gathered is not None:
            gathered.taken()
            ctx.seen = output_checks.fingerprint(x_local)
            ctx.save_for_backward(w)
        else:
            ctx.save_for_backward(w, x_local)
        y = F.linear(x_local, w, local(bias) if bias is not None else None)
        spec = cached_spec(specs, "y", weight.device_mesh, (Shard(y.dim() - 1),), (*x.shape[:-1], weight.shape[0]),
                           None, y.dtype)  # y is contiguous: its global stride follows from its shape
        return _torch_compat.dtensor_with_spec(y, spec)

    @staticmethod
    def backward(ctx, dy):
        gathered, specs = ctx.gathered, ctx.specs
        saved = ctx.saved_tensors
        w = saved[0]
        mesh = dy.device_mesh
        if dy.placements[0] != Shard(dy.dim() - 1):
            dy = dy.redistribute(placements=(Shard(dy.dim() - 1),))
        if gathered is not None:
            gathered.start()
        dy_local = _torch_compat.dtensor_local(dy)
        dy2 = dy_local.reshape(-1, dy_local.shape[-1])
        dx = None
        if ctx.needs_input_grad[0]:
            shape, dtype, local_shape = ctx.x_meta  # dx is contiguous, whatever x's stride: its spec's is too
            dx = _torch_compat.dtensor_with_spec(dy2.mm(w).view(local_shape),
                                                 cached_spec(specs, "dx", mesh, (Partial(),), shape, None, dtype))
        x = gathered.take(ctx.seen) if gathered is not None else saved[1]
        (w_shape, w_stride), b_meta = ctx.param_meta
        dw = db = None
        if ctx.needs_input_grad[1]:
            dw = dy2.t().mm(x.reshape(-1, x.shape[-1]))
            dw = _torch_compat.dtensor_with_spec(dw, cached_spec(specs, "dw", mesh, (Shard(0),), w_shape, w_stride,
                                                                 dw.dtype))
        if ctx.needs_input_grad[2]:
            db = dy2.sum(0)
            db = _torch_compat.dtensor_with_spec(db, cached_spec(specs, "db", mesh, (Shard(0),), *b_meta, db.dtype))
        return dx, dw, db, None, None


def _local_path(x, weight, bias) -> bool:
    """Whether `_RegatherLinear` takes an input that is no keep_output=False norm's gathered output: x a `Replicate`
    DTensor and the parameters `Shard(0)` DTensors on one 1-D mesh, with plain local tensors (a pending collective's
    result is waited for), and no dispatch mode (which expects DTensor's ops, and would see the local ones)."""
    if type(x) is not DTensor or type(weight) is not DTensor or x.placements != _REPLICATE \
            or weight.placements != _SHARD0 or x.device_mesh.ndim != 1 \
            or x.device_mesh is not weight.device_mesh and x.device_mesh != weight.device_mesh:
        return False
    if bias is not None and (type(bias) is not DTensor or bias.placements != _SHARD0):
        return False
    if _torch_compat.ops_observed():
        return False
    return all(type(_torch_compat.dtensor_local(t)) in ops._PLAIN or ops._is_pending(_torch_compat.dtensor_local(t))
               for t in (x, weight, bias) if t is not None)


_REPLICATE, _SHARD0 = (Replicate(),), (Shard(0),)


class RegatherLinear(nn.Linear):
    """An `nn.Linear` parallelized by `RegatherColwiseParallel`: its forward runs on the local tensors
    (`_RegatherLinear`), keeping a keep_output=False norm's handle instead of its gathered output (under a dispatch
    mode too); other inputs it takes that way where `_local_path` holds. Autocast and torch.compile go through
    torch's linear on DTensors."""

    def forward(self, x: Tensor) -> Tensor:
        # under autocast the casts are the dispatcher's, on DTensors
        if torch.compiler.is_compiling() or torch.is_autocast_enabled(x.device.type):
            return super().forward(x)
        gathered = getattr(x, _ATTR, None) if torch.is_grad_enabled() else None
        if gathered is None and not _local_path(x, self.weight, self.bias):
            return super().forward(x)
        specs = self.__dict__.get("_shardnorm_specs")
        if specs is None:
            specs = self.__dict__["_shardnorm_specs"] = {}
        return _RegatherLinear.apply(x, self.weight, self.bias, gathered, specs)


class RegatherColwiseParallel(ColwiseParallel):
    """torch's `ColwiseParallel`, for the linears that read a `SequenceParallelNorm(output_layouts=Replicate())`
    norm's output. With the norm's `keep_output=False` they keep only the norm's shard for their backward and
    gather it again there (module docstring); otherwise they save their input as torch's do. Either way the forward
    and backward run on the local tensors with the ops and layouts of torch's linear (outputs and grads bitwise
    torch's `ColwiseParallel`'s) without DTensor's dispatch, which costs an eager sublayer's host most of its time.
    Takes `nn.Linear` modules (their class becomes `RegatherLinear`, a subclass)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        # torch's ParallelStyle extension point (parallelize_module calls it); see shardnorm._torch_compat
        if type(module) not in (nn.Linear, RegatherLinear):
            raise TypeError(f"shardnorm: RegatherColwiseParallel takes torch.nn.Linear modules, got "
                            f"{type(module).__name__}; use torch's ColwiseParallel for it")
        torch_style = ColwiseParallel(input_layouts=self.input_layouts[0], output_layouts=self.output_layouts[0],
                                      use_local_output=self.use_local_output)
        module = parallelize_module(module, device_mesh, torch_style, src_data_rank=self.src_data_rank)
        module.__class__ = RegatherLinear
        return module


def attach(norm: nn.Module, out: Tensor, y: DTensor) -> None:
    """After a keep_output=False norm's eager forward gathered its output `y` into `out`: let `RegatherLinear`
    consumers of `out` keep a `GatheredOutput` instead of `out`."""
    remake = getattr(y, output_recompute.REMAKE_ATTR, None)
    if remake is None or not isinstance(out, DTensor) or y.device_mesh.ndim != 1 or not out.requires_grad:
        return
    gathers = norm.__dict__.get("_shardnorm_gathers")
    if gathers is None:
        gathers = norm.__dict__["_shardnorm_gathers"] = _NormGathers(y.device_mesh)
    gathered = GatheredOutput(remake, y, gathers)
    setattr(out, _ATTR, gathered)
    if not gathers.taken and not output_recompute.warned(norm, "unused"):
        out.register_hook(lambda grad: _warn_if_unused(norm, gathered))


def _warn_if_unused(norm: nn.Module, gathered: GatheredOutput) -> None:
    """When the gathered output's grad is complete (every consumer's backward ran): no `RegatherLinear` consumer took
    it."""
    if gathered.consumers:
        return
    output_recompute.warn_once(
        norm, "unused", f"shardnorm: {type(norm).__name__} has keep_output=False and gathers its output "
        "(SequenceParallelNorm(output_layouts=Replicate())), but no consumer parallelized with "
        "shardnorm.distributed.RegatherColwiseParallel read it: a consumer that saves it for its backward keeps the "
        "whole gathered output. Use RegatherColwiseParallel for the linears that read it")
