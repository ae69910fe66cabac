"""DeepSpeed AutoTP training: shardnorm owns the replicated-grad all-reduce of q/k-norm weights.

AutoTP all-reduces each parameter its partition spec marks `grad_allreduce` (Qwen3's q/k norms) once per
micro-batch. For the norm weights among them shardnorm sets the flag its hook registration checks, and the
model's reducer (source `PartialGrads`) all-reduces their `.grad` once per step in fp32 buckets: ZeRO stage
0/1 without `overlap_comm` only (docs/integrations/deepspeed.md). The DeepSpeed internals this needs (that
flag, `_get_hf_tp_plan`, `AutoTP._get_model_type`) are read here only.
"""

import types

import torch

from ..distributed.accumulation import attach_reducer
from ..distributed.grad_sources import PartialGrads
from .deepspeed_config import ShardnormConfigError, ShardnormSection
from .deepspeed_conversion import shardnorm_modules

_DS_FLAG = "_ds_grad_allreduce_registered"


def autotp_size(ds_config: dict) -> int:
    return int((ds_config.get("tensor_parallel") or {}).get("autotp_size", 0) or 0)


def _partition_config(model: torch.nn.Module, ds_config: dict):
    """The AutoTPConfig DeepSpeed will shard `model` with: preset/custom partition_config, else the HF tp_plan."""
    from deepspeed.module_inject.autotp_config import AutoTPConfig
    from deepspeed.module_inject.tp_plan_converter import TPPlanConverter
    from deepspeed.runtime.tensor_parallel.config import _get_hf_tp_plan, get_tensor_parallel_config

    config = get_tensor_parallel_config(ds_config).get_partition_config_object()
    if config is None:
        specs = TPPlanConverter.convert(_get_hf_tp_plan(model) or {})
        config = AutoTPConfig(layer_specs=specs) if specs else None
    return config


def marked_norm_params(model: torch.nn.Module, ds_config: dict, norms=None) -> list:
    """The weights/biases of `norms` (default: the model's shardnorm norms) that AutoTP marks for a
    tensor-parallel grad all-reduce."""
    if autotp_size(ds_config) <= 1:
        return []
    config = _partition_config(model, ds_config)
    if config is None:
        return []
    from deepspeed.module_inject.auto_tp import AutoTP

    model_type = AutoTP._get_model_type(types.SimpleNamespace(module=model))
    norm_params = {id(p) for m in (shardnorm_modules(model) if norms is None else norms) for p in m.parameters()}
    marked = []
    for name, param in model.named_parameters():
        spec = config.find_matching_spec(name, model_type)
        if id(param) in norm_params and spec is not None and spec.grad_allreduce:
            marked.append(param)
    return marked


def _step_error(stage, overlap_comm) -> ShardnormConfigError:
    return ShardnormConfigError(
        "shardnorm.grad_reduce",
        f'"step" under AutoTP needs ZeRO stage 0 or 1 with overlap_comm off and grads accumulated in the '
        f"parameter dtype (got stage {stage}, overlap_comm {overlap_comm}): ZeRO reduces each grad during "
        'backward there, before shardnorm could. Set "grad_reduce": "deepspeed" to keep DeepSpeed\'s '
        "per-parameter all-reduce.")


def check_step_config(ds_config: dict) -> None:
    """`_check_engine`'s conditions as the config states them, before the model changes: once DeepSpeed has
    sharded a model, a retry on it with "grad_reduce": "deepspeed" would not get DeepSpeed's all-reduce hooks."""
    zero = ds_config.get("zero_optimization") or {}
    stage, overlap_comm = int(zero.get("stage", 0) or 0), zero.get("overlap_comm")
    if stage >= 2 or overlap_comm is True:
        raise _step_error(stage, overlap_comm)


def _check_engine(engine) -> None:
    """Raise unless grads stay in .grad until the boundary backward ends (see the module docstring)."""
    stage = engine.zero_optimization_stage()
    if stage >= 2 or engine.zero_overlap_comm() or getattr(engine.optimizer, "use_grad_accum_attribute", False):
        raise _step_error(stage, engine.zero_overlap_comm())


def claim_marked_norm_grads(model: torch.nn.Module, ds_config: dict, section: ShardnormSection) -> list:
    """Before `deepspeed.initialize`: the marked norm params whose all-reduce shardnorm takes over (none when
    the config opts out), flagged so that AutoTP registers no per-parameter hook for them."""
    if section.grad_reduce != "step":
        return []
    params = marked_norm_params(model, ds_config)
    for p in params:
        setattr(p, _DS_FLAG, True)
    return params


def attach_marked_norm_grads(engine, params: list, bucket_cap_mb: float) -> None:
    """Start owning the claimed params' reduction for `engine` (the one `deepspeed.initialize` returned)."""
    _check_engine(engine)
    from deepspeed.utils import groups

    source = PartialGrads(params, groups.get_tensor_model_parallel_group(),
                          boundary=engine.is_gradient_accumulation_boundary)
    attach_reducer(engine.module, source=source, bucket_cap_mb=bucket_cap_mb)
