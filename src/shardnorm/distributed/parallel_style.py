"""Sequence parallelism for shardnorm norms, two ways in: `SequenceParallelNorm`, a ParallelStyle for
`parallelize_module` plans (DTensor params and activations over a DeviceMesh), and
`process_group_sequence_parallel(module, group)`, applied to one module for Megatron-style code (plain
tensors in and out, plain params, a ProcessGroup).

Both run the kernel on the local tokens and mark
weight/bias `sequence_parallel = True` (Megatron-Core's flag for "grads are partial over the tp group").
Their reduction belongs to the model's reducer (`shardnorm.distributed.attach_reducer`,
`shardnorm.accumulate`, `shardnorm.finalize_grads`) or, without one, to whoever reduces DTensor `Partial`
grads or Megatron's `finalize_model_grads`: exactly one of them.
"""

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from shardnorm import output_recompute
from shardnorm.distributed import regather
from shardnorm.distributed.grad_sources import GROUP_ATTR
from shardnorm.distributed.sequence_gather import gather_sequence

_REPLICATE = (Replicate(),)


class SequenceParallelNorm(ParallelStyle):
    """Use where torch's `SequenceParallel` goes in a `parallelize_module` plan, on shardnorm norms.

    Params become `Replicate` DTensors (broadcast from `src_data_rank`, so any init is fine). Inputs
    `x` and `residual` become DTensors sharded on `sequence_dim` (plain tensors are taken as this rank's
    shard; DTensors are redistributed if needed). The output y keeps that sharding, or is redistributed to
    `output_layouts` (`Replicate()`: the norm all-gathers its own output, so the next module's plan takes
    `Replicate` input and gathers nothing); the residual form's z = x + residual stays sharded. Outputs are
    local tensors if `use_local_output`.

    With `output_layouts=Replicate()` and the norm's `keep_output=False`, its consumers parallelized with
    `RegatherColwiseParallel` keep only this rank's shard: their backward recomputes the norm's local output and
    all-gathers it again while its dgrad GEMM runs (Megatron-Core's sequence-parallel activation memory; one extra
    all-gather of y per norm in the backward; `regather.py`).
    """

    def __init__(self, *, sequence_dim: int = 1, output_layouts: Placement | None = None,
                 use_local_output: bool = False):
        super().__init__()
        self.sequence_sharding = (Shard(sequence_dim),)
        if output_layouts is not None and not isinstance(output_layouts, Placement):
            raise TypeError(f"shardnorm: SequenceParallelNorm(output_layouts=...) takes one Placement "
                            f"(Shard(dim) or Replicate()), got {output_layouts!r}")
        self.output_layouts = (output_layouts,) if output_layouts is not None else self.sequence_sharding
        self.use_local_output = use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        # torch's ParallelStyle extension point (parallelize_module calls it); see shardnorm._torch_compat
        if device_mesh.ndim != 1:
            raise ValueError(f"shardnorm: SequenceParallelNorm needs a 1-D (tensor-parallel) mesh, got "
                             f"{device_mesh.ndim}-D {device_mesh}; pass mesh['tp'] to parallelize_module")
        self._prepare_params(module, device_mesh)
        # keep_output=False without saved-tensor hooks: a gathered output's consumers own its saving
        # (RegatherColwiseParallel); a sharded DTensor output's consumers gather it themselves and save what they
        # gathered, which no hook could recompute (warned at the forward)
        if self.output_layouts == (Replicate(),) or not self.use_local_output:
            module.__dict__[output_recompute.SP_OUTPUT_ATTR] = True
        module.register_forward_pre_hook(partial(self._shard_inputs, device_mesh), with_kwargs=True)
        module.register_forward_hook(self._prepare_outputs)
        return module

    def _prepare_params(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            replicated = distribute_tensor(param.detach(), device_mesh, [Replicate()],
                                           src_data_rank=self.src_data_rank)
            new = nn.Parameter(replicated, requires_grad=param.requires_grad)
            new.sequence_parallel = True
            module.register_parameter(name, new)

    def _shard_inputs(self, device_mesh, module, args, kwargs):
        # forward(x, residual=None): shard the first two positionals (no list mutation: dynamo
        # traces star-unpacking as a tuple)
        args = tuple(self._shard(a, device_mesh) if i < 2 and a is not None else a for i, a in enumerate(args))
        if kwargs.get("residual") is not None:
            kwargs = {**kwargs, "residual": self._shard(kwargs["residual"], device_mesh)}
        return args, kwargs

    def _shard(self, t, device_mesh: DeviceMesh) -> DTensor:
        if isinstance(t, DTensor):
            if t.device_mesh != device_mesh:
                raise ValueError(f"shardnorm: SequenceParallelNorm was parallelized on {device_mesh}, but its input "
                                 f"is a DTensor on {t.device_mesh}; pass it as a DTensor on the norm's mesh (e.g. "
                                 f"the output of a module parallelized on that mesh) or as a plain local tensor")
            if tuple(t.placements) != self.sequence_sharding:
                t = t.redistribute(placements=self.sequence_sharding)
            return t
        if isinstance(t, torch.Tensor):
            return DTensor.from_local(t, device_mesh, self.sequence_sharding, run_check=False)
        raise TypeError(f"shardnorm: SequenceParallelNorm expects tensor inputs, got {type(t).__name__}")

    def _prepare_outputs(self, module, args, outputs):
        if isinstance(outputs, tuple):  # (y, z): the residual stream z stays sharded
            return (self._prepare_output(module, outputs[0], self.output_layouts),
                    self._prepare_output(module, outputs[1], self.sequence_sharding, normalized=False))
        return self._prepare_output(module, outputs, self.output_layouts)

    def _prepare_output(self, module, y: DTensor, placements: tuple, normalized: bool = True):
        """y (or, `normalized` False, the residual stream z) as the plan's next module takes it."""
        if tuple(y.placements) == placements and not self.use_local_output:
            if normalized and not getattr(module, "keep_output", True) and y.requires_grad \
                    and not torch.compiler.is_compiling():
                _warn_consumers_gather(module)
            return y

        def transform(t: DTensor):
            if placements == _REPLICATE and tuple(t.placements) != placements:
                t = gather_sequence(t, module)
            elif tuple(t.placements) != placements:
                t = t.redistribute(placements=placements)
            return t.to_local() if self.use_local_output else t

        if getattr(module, "keep_output", True):
            return transform(y)
        if torch.compiler.is_compiling():  # only a gather needs the selective checkpoint that recomputes it
            if tuple(y.placements) == placements:
                return transform(y)
            return output_recompute.compiled_transform(transform, y)
        out = transform(y)
        if placements == (Replicate(),):  # its RegatherColwiseParallel consumers keep the norm's shard instead
            regather.attach(module, out, y)
        elif self.use_local_output:  # inside a convert scope, saves of the local output take y's recompute handle
            output_recompute.derive(out, y, transform)
        return out

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(sequence_dim={self.sequence_sharding[0].dim}, "
                f"output_layouts={self.output_layouts[0]}, use_local_output={self.use_local_output})")


def _warn_consumers_gather(module: nn.Module) -> None:
    """keep_output=False saves nothing where the norm's output stays sharded and its consumers gather it (torch's
    `PrepareModuleInput`): they save the gathered tensor, which is theirs."""
    output_recompute.warn_once(
        module, "sharded output", f"shardnorm: {type(module).__name__} has keep_output=False, but its "
        "SequenceParallelNorm output stays sequence-sharded and its consumers gather it themselves, so they keep the "
        "gathered tensor and the option saves nothing here: use SequenceParallelNorm(output_layouts=Replicate()) with "
        "RegatherColwiseParallel consumers, or keep_output=True", stacklevel=2)


class _ProcessGroupSequenceParallelNorm(SequenceParallelNorm):
    """Plain tensors in and out, plain (Megatron-style) params: only the params' flag changes."""

    def _prepare_params(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param in module.parameters(recurse=False):
            param.sequence_parallel = True
            setattr(param, GROUP_ATTR, device_mesh.get_group())  # the group a reducer sums its grads over


def process_group_sequence_parallel(module: nn.Module, group: dist.ProcessGroup, *,
                                    sequence_dim: int = 0) -> nn.Module:
    """Megatron-style sequence parallelism for a shardnorm norm, without DTensors in user code.

    `module` takes and returns this rank's sequence shard as plain tensors (Megatron's [s, b, h] layout by
    default); its params stay plain tensors, replicated across `group`, marked `sequence_parallel = True`.
    Their grads are local partial sums until the model's reducer (or Megatron's `finalize_model_grads`)
    all-reduces them over `group`.
    """
    params = list(module.parameters(recurse=False))
    device_type = params[0].device.type if params else ("cuda" if dist.get_backend(group) == "nccl" else "cpu")
    mesh = DeviceMesh.from_group(group, device_type)
    return parallelize_module(module, mesh, _ProcessGroupSequenceParallelNorm(sequence_dim=sequence_dim,
                                                                               use_local_output=True))
