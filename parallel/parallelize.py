"""FSDP2 × tensor/sequence parallelism on a 2-D (dp, tp) DeviceMesh, torchtitan order: TP, compile, FSDP.

TP plan (Megatron-style with sequence parallelism): the residual stream and the norms are sharded on
the sequence dim (Shard(1)); attention and MLP inputs are all-gathered to Replicate, their first
linears split columns (heads / hidden units), their last linears split rows and reduce-scatter back
to Shard(1). Norm weights stay replicated over tp; their grads are partial sums over the tp ranks'
tokens, which the norm's ParallelStyle makes sure are reduced exactly once.

Who gathers: torch's plan gathers in the consumers' `PrepareModuleInput` (each rank saves the gathered
input in full for backward); shardnorm's norms gather their own output (`SequenceParallelNorm(
output_layouts=Replicate())`), the same one all-gather, and their consumers are
`RegatherColwiseParallel` (torch's `ColwiseParallel` while the norms keep their outputs), so that with
`model.norm_keep_output = false` each rank keeps only the norm's shard and the consumers gather it again in their
backward, overlapped with their dgrad GEMM (docs/distributed.md).
"""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from shardnorm.distributed import RegatherColwiseParallel, SequenceParallelNorm
from shardnorm.fsdp import shard_model
from parallel.config import TrainConfig
from parallel.model import Block, Transformer


def uses_norm_reducer(norm: str, tp: int) -> bool:
    """shardnorm's reducer owns the tp reduction of sequence-parallel shardnorm norm grads."""
    return norm == "shardnorm" and tp > 1


def gathered_input(module_inputs: int, norm_gathers: bool) -> PrepareModuleInput | None:
    """The consumers' input plan: all-gather the sequence shards, unless the norm in front already did."""
    if norm_gathers:
        return None
    rest = (None,) * (module_inputs - 1)
    return PrepareModuleInput(input_layouts=(Shard(1), *rest), desired_input_layouts=(Replicate(), *rest))


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, norm: str) -> None:
    gathers = norm == "shardnorm"
    norm_style = SequenceParallelNorm(output_layouts=Replicate()) if gathers else SequenceParallel()
    # the linears reading a gathered norm output: with keep_output=False they keep the norm's shard, not its gather
    colwise = RegatherColwiseParallel if gathers else ColwiseParallel
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": norm_style,
        "output": colwise(input_layouts=Replicate() if gathers else Shard(1), output_layouts=Replicate()),
    })
    if model.cfg.tie_embeddings:  # both were sharded Shard(0) on the vocab dim: tie them again
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers:
        plan = {
            "attention_norm": norm_style,
            "attention": gathered_input(3, gathers),
            "attention.wq": colwise(),
            "attention.wk": colwise(),
            "attention.wv": colwise(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": norm_style,
            "feed_forward": gathered_input(1, gathers),
            "feed_forward.w1": colwise(),
            "feed_forward.w3": colwise(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        parallelize_module(block, tp_mesh, {name: style for name, style in plan.items() if style is not None})


def apply_fsdp(model: Transformer, mesh: DeviceMesh, dtype: torch.dtype) -> None:
    """One FSDP unit per block, the root unit holds embeddings, final norm and output; FSDP reduces
    over dp, shardnorm's reducer the sequence-parallel norm grads over tp (shardnorm.fsdp)."""
    mp_policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    shard_model(model, mesh, block_classes=(Block,), mp_policy=mp_policy)


def materialize_output(module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
    """A plain copy of the embedding's reduce-scatter result (an AsyncCollectiveTensor): a compiled
    block taking the async tensor as input silently drops its gradient (torch 2.13, gloo)."""
    return output.clone()


def apply_compile(model: Transformer) -> None:
    for block in model.layers:
        block.compile(fullgraph=True)
    model.tok_embeddings.register_forward_hook(materialize_output)


def parallelize(model: Transformer, mesh: DeviceMesh, train: TrainConfig) -> nn.Module:
    if mesh["tp"].size() > 1:
        apply_tensor_parallel(model, mesh["tp"], train.norm)
    if train.compile:
        apply_compile(model)
    apply_fsdp(model, mesh, getattr(torch, train.dtype))
    return model
