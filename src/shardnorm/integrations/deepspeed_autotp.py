"""DeepSpeed AutoTP training: shardnorm owns the replicated-grad all-reduce of q/k-norm weights.

AutoTP (deepspeed >= 0.18, `"tensor_parallel": {"autotp_size": N}`) keeps some parameters
replicated while their module sees sharded activations (Qwen3's q_norm/k_norm normalize the local
attention heads). Their partition spec carries `grad_allreduce` (or the Hugging Face plan style
"replicated_with_grad_allreduce"), and `AutoTP.register_replicated_grad_hooks` then puts a tensor
hook on each: one synchronous all-reduce per parameter per micro-batch.

For the norm weights among them, shardnorm takes that job instead: it sets the flag DeepSpeed
checks (`_ds_grad_allreduce_registered`) before `deepspeed.initialize`, lets the local partial
sums accumulate in `.grad` over the micro-batches, and at the end of the last micro-batch's
backward the model's `NormGradReducer` (`attach_reducer(model, source=PartialGrads(...))`, the step
boundary being the engine's; `shardnorm.finalize_grads(model)` sees it like any other) harvests them
and all-reduces them over the tensor-parallel group in fp32 buckets: one collective per bucket per
optimizer step.

DeepSpeed internals, read here only (DeepSpeed has no public API for them): that flag, the partition
config (`_get_hf_tp_plan`) and the model type AutoTP matches specs by (`AutoTP._get_model_type`).

That timing needs the grads to stay in `.grad` until the accumulation boundary's backward ends,
which holds for ZeRO stage 0 and 1 (with `overlap_comm` off and grads accumulated in the parameter
dtype). ZeRO-2/3 and `overlap_comm` reduce each grad inside backward as soon as it is
accumulated; there shardnorm cannot own the reduction and asks for `"grad_reduce": "deepspeed"`.
"""

import types

import torch

from ..distributed.accumulation import attach_reducer
from ..distributed.grad_sources import PartialGrads
from ..distributed.reducer import NormGradReducer
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


def _check_engine(engine) -> None:
    """Raise unless grads stay in .grad until the boundary backward ends (see the module docstring)."""
    stage = engine.zero_optimization_stage()
    if stage >= 2 or engine.zero_overlap_comm() or getattr(engine.optimizer, "use_grad_accum_attribute", False):
        raise ShardnormConfigError(
            "shardnorm.grad_reduce",
            f'"step" under AutoTP needs ZeRO stage 0 or 1 with overlap_comm off and grads accumulated in the '
            f"parameter dtype (got stage {stage}, overlap_comm {engine.zero_overlap_comm()}): ZeRO reduces each "
            'grad during backward there, before shardnorm could. Set "grad_reduce": "deepspeed" to keep '
            "DeepSpeed's per-parameter all-reduce.")


class AutoTPNormGrads:
    """Takes the marked norm grads' tensor-parallel all-reduce from AutoTP and gives it to a `NormGradReducer`."""

    def __init__(self, params: list, bucket_cap_mb: float):
        self.params = params
        self.bucket_cap_mb = bucket_cap_mb
        self.reducer: NormGradReducer | None = None  # built by attach(), once the tp group exists

    def claim(self) -> None:
        """Before `deepspeed.initialize`: set the flag that makes AutoTP skip its per-parameter hook."""
        for p in self.params:
            setattr(p, _DS_FLAG, True)

    def attach(self, engine) -> None:
        """Start owning the reduction for `engine` (the one `deepspeed.initialize` returned)."""
        _check_engine(engine)
        from deepspeed.utils import groups

        source = PartialGrads(self.params, groups.get_tensor_model_parallel_group(),
                              boundary=engine.is_gradient_accumulation_boundary)
        self.reducer = attach_reducer(engine.module, source=source, bucket_cap_mb=self.bucket_cap_mb)


def own_marked_norm_grads(model: torch.nn.Module, ds_config: dict, section: ShardnormSection):
    """An AutoTPNormGrads for the marked norm params, or None when there are none or the config opts out."""
    if section.grad_reduce != "step":
        return None
    params = marked_norm_params(model, ds_config)
    return AutoTPNormGrads(params, section.bucket_cap_mb) if params else None
