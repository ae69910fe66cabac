"""FSDP2 × tensor/sequence parallelism on a 2-D (dp, tp) DeviceMesh, torchtitan order: TP, compile, FSDP.

TP plan (Megatron-style with sequence parallelism): the residual stream and the norms are sharded on
the sequence dim (Shard(1)); attention and MLP inputs are all-gathered to Replicate, their first
linears split columns (heads / hidden units), their last linears split rows and reduce-scatter back
to Shard(1). Norm weights stay replicated over tp; their grads are partial sums over the tp ranks'
tokens, which the norm's ParallelStyle makes sure are reduced exactly once.
"""

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                               SequenceParallel, parallelize_module)

from shardnorm.distributed import SequenceParallelNorm
from shardnorm.fsdp import shard_model
from parallel.config import TrainConfig
from parallel.model import Block, Transformer


def norm_style(norm: str):
    """shardnorm's style routes the tp-partial norm grads to its reducer; torch's leaves `Partial`."""
    return SequenceParallelNorm() if norm == "shardnorm" else SequenceParallel()


def uses_norm_reducer(norm: str, tp: int) -> bool:
    """shardnorm's reducer owns the tp reduction of sequence-parallel shardnorm norm grads."""
    return norm == "shardnorm" and tp > 1


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, norm: str) -> None:
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": norm_style(norm),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    if model.cfg.tie_embeddings:  # both were sharded Shard(0) on the vocab dim: tie them again
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attention_norm": norm_style(norm),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                            desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": norm_style(norm),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


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
