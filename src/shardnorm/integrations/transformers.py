"""Hugging Face transformers / Accelerate adapter: shardnorm in `tp_plan` models, Trainer and DeepSpeed runs.

One line for a Trainer run, after building it: `shardnorm.integrations.transformers.enable(trainer)`. It
converts the model's norms (as the DeepSpeed config's "shardnorm" section says, when there is one), takes
over the tensor-parallel norm styles that `from_pretrained(tp_plan=...)` installed, and ties shardnorm's
norm-grad accumulation to the Trainer's (Accelerate's) `sync_gradients`. Accelerate loops use
`convert_model(model, accelerator=...)` + `bind_accumulation(model, accelerator)` the same way.

Why the tensor-parallel part exists: transformers' `replicated_with_grad_allreduce` style (Qwen3 / Gemma3 /
OLMo2 q/k norms) all-reduces `.grad` in a post-accumulate hook after every micro-batch, so with two
micro-batches the grad comes out 2*G1 + G2. Here those norms become shardnorm norms whose fp32 partial sums
go to the model's reducer: summed over the tensor-parallel group once per optimizer step, G1 + G2.

Needs the `hf` extra: pip install 'shardnorm[hf]'.
"""

import functools
import re

import torch
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

try:
    import transformers
    from transformers import TrainerCallback
    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES, TensorParallelLayer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("shardnorm.integrations.transformers needs transformers and accelerate: "
                      "pip install 'shardnorm[hf]'") from e

import shardnorm
from shardnorm._torch_compat import has_post_accumulate_grad_hooks, remove_module_backward_hooks
from shardnorm.distributed import (DEFAULT_BUCKET_CAP_MB, SequenceParallelNorm, attach_reducer,
                                   process_group_sequence_parallel, reducer_of)
from shardnorm.integrations.deepspeed_config import warn_near_miss_sections
from shardnorm.modules import LayerNorm, RMSNorm

KNOWN_TRANSFORMERS = ((5, 17), (5, 23))  # the versions whose tensor-parallel styles this adapter reads

REPLICATED_NORM_STYLE = "shardnorm_replicated_norm"
SEQUENCE_PARALLEL_NORM_STYLE = "shardnorm_sequence_parallel_norm"


def _check_version(version: str = transformers.__version__) -> None:
    parts = tuple(int(p) for p in re.findall(r"\d+", version)[:2])
    if not KNOWN_TRANSFORMERS[0] <= parts <= KNOWN_TRANSFORMERS[1]:
        low, high = (".".join(map(str, v)) for v in KNOWN_TRANSFORMERS)
        raise ImportError(f"shardnorm.integrations.transformers knows transformers {low} to {high} (how their "
                          f"tensor-parallel styles install), found transformers=={version}")


_check_version()


# ---- tensor-parallel styles ------------------------------------------------------------------------------


class _ShardnormNormStyle(TensorParallelLayer):
    """A plan entry that `convert_model` honours: it swaps the norm for shardnorm's and applies the mode.

    `from_pretrained` installs styles on the model's own norm modules before the weights load, so at that
    point the style only guards the forward: running the model before `convert_model` raises instead of
    computing grads that no one reduces.
    """

    kind = ""

    def install_forward(self, module, mesh):
        def not_converted(*args, **kwargs):
            raise RuntimeError(f"shardnorm: this {type(module).__name__} carries the tensor-parallel style "
                               f"{STYLE_OF_KIND[self.kind]!r}; call shardnorm.integrations.transformers."
                               f"convert_model(model) (or enable(trainer)) before running the model")

        module.forward = not_converted
        return module


class ShardnormReplicatedNorm(_ShardnormNormStyle):
    """For `replicated_with_grad_allreduce` norms: replicated params over tensor-parallel-local rows (per-head
    q/k norms). Grads are fp32 partial sums, reduced by the model's reducer once per optimizer step."""

    kind = "replicated"


class ShardnormSequenceParallelNorm(_ShardnormNormStyle):
    """For `sequence_parallel` norms: `shardnorm.distributed.SequenceParallelNorm` (sequence dim 1, local
    output, as transformers' style), grads to the model's reducer."""

    kind = "sequence_parallel"


STYLE_OF_KIND = {"replicated": REPLICATED_NORM_STYLE, "sequence_parallel": SEQUENCE_PARALLEL_NORM_STYLE}
# the norm styles convert_model takes over: transformers' own and shardnorm's
KIND_OF_STYLE = {"replicated_with_grad_allreduce": "replicated", "sequence_parallel": "sequence_parallel",
                 REPLICATED_NORM_STYLE: "replicated", SEQUENCE_PARALLEL_NORM_STYLE: "sequence_parallel"}


def register_styles() -> None:
    """Make the shardnorm styles usable by name in a `tp_plan` (done on import; idempotent)."""
    ALL_PARALLEL_STYLES.register(REPLICATED_NORM_STYLE, ShardnormReplicatedNorm())
    ALL_PARALLEL_STYLES.register(SEQUENCE_PARALLEL_NORM_STYLE, ShardnormSequenceParallelNorm())


register_styles()


def _apply_norm_mode(module: nn.Module, kind: str, mesh) -> nn.Module:
    """Put a shardnorm norm in the mode its tensor-parallel style asks for (grads to the model's reducer)."""
    if kind == "replicated":
        # rows (tokens x local heads) are all this rank's: any leading dim serves as the shard dim
        return process_group_sequence_parallel(module, mesh.get_group(), sequence_dim=0)
    return parallelize_module(module, mesh, SequenceParallelNorm(sequence_dim=1, use_local_output=True))


def _wildcard(name: str) -> str:
    """transformers' plan key for a module name: layer numbers become "*"."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)", "*", name)


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def _tp_mesh(model: nn.Module):
    manager = getattr(model, "_mesh_manager", None)
    if manager is not None:
        return manager.get_mesh("tp")
    mesh = getattr(model, "_device_mesh", None)
    if mesh is not None and mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names:
        return mesh["tp"]
    if mesh is not None and mesh.ndim == 1:  # older transformers: the tp mesh itself
        return mesh
    raise ValueError(f"shardnorm: {type(model).__name__} has tensor-parallel styles but no 'tp' device mesh "
                     f"(transformers=={transformers.__version__})")


def _is_transformers_hook(hook) -> bool:
    """Whether `hook` is transformers' own (defined in its package), seen through functools.partial."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return (getattr(hook, "__module__", None) or "").split(".")[0] == "transformers"


def _in_tensor_parallel_mode(module: nn.Module) -> bool:
    """A shardnorm norm that `_apply_norm_mode` put in a tensor-parallel mode (its params are marked)."""
    return isinstance(module, (LayerNorm, RMSNorm)) and \
        any(getattr(p, "sequence_parallel", False) for p in module.parameters(recurse=False))


def _check_rows_are_local(name: str, style: str, plan: dict) -> None:
    """A replicated norm's grads are partial sums over tensor-parallel ranks only where its rows are this rank's
    heads: where the plan shards a projection beside it (q_proj / k_proj "colwise"). Without one every rank holds
    every head, its grads are already whole, and summing them over the ranks would multiply them by tp. A
    `DistributedConfig(tp_plan=dict)` replaces the model's own plan on transformers 5.17 (5.23 updates it), so a plan
    of norm entries alone shards nothing else there."""
    parent = _wildcard(name).rpartition(".")[0]
    if any(key.startswith(f"{parent}.") and "colwise" in str(other) for key, other in plan.items()):
        return
    raise ValueError(f"shardnorm: tp_plan style {style!r} on norm {name!r} sums its grads over the tensor-parallel "
                     f"ranks, but the plan shards no projection beside it (no 'colwise' entry under {parent!r}), so "
                     f"every rank holds all of its rows and the sums would be tp times the grad. Shard the "
                     f"projections that feed it: on transformers {transformers.__version__}, a DistributedConfig"
                     f"(tp_plan=dict) may replace the model's own plan rather than update it; pass the model's plan "
                     f"with your entries ({{**{{f'model.{{k}}': v for k, v in config.base_model_tp_plan.items()}}, "
                     f"**yours}})")


def _take_tp_norms(model: nn.Module) -> dict:
    """{module name: kind} of the norms that carry a tensor-parallel norm style and are not in shardnorm's
    mode yet, with transformers' wrappers and hooks taken off so `convert` sees a plain norm (a hook of
    anyone else's stays, and `convert` refuses to drop it). Any other style on a norm raises (naming it)."""
    plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {}
    if not plan or (getattr(model, "_tp_size", None) or 1) <= 1:
        return {}
    if (getattr(model, "_fsdp_size", None) or 1) > 1:
        raise ValueError(f"shardnorm: tp_plan norms are supported with tensor parallelism alone; this model is "
                         f"also sharded by transformers' FSDP (DistributedConfig fsdp_size={model._fsdp_size})")
    found = []  # (name, module, kind), all checked before any is changed: a refusal leaves the model as it was
    for name, module in model.named_modules():
        style = plan.get(_wildcard(name))
        if style is None or not _is_norm(module):
            continue
        kind = KIND_OF_STYLE.get(style)
        if kind is None:
            raise ValueError(f"shardnorm: tp_plan style {style!r} on norm {name!r} is not one shardnorm can honour; "
                             f"norms take one of {sorted(KIND_OF_STYLE)}")
        if _in_tensor_parallel_mode(module):  # taken over by an earlier convert_model: nothing left to take
            continue
        if kind == "replicated":
            _check_rows_are_local(name, style, plan)
        for pname, param in module.named_parameters(recurse=False):
            if has_post_accumulate_grad_hooks(param):
                raise RuntimeError(f"shardnorm: {name}.{pname} already has transformers' per-micro-batch grad "
                                   f"all-reduce hook (the model ran a forward); call convert_model right after "
                                   f"from_pretrained")
        found.append((name, module, kind))
    for name, module, kind in found:
        for pname, param in list(module.named_parameters(recurse=False)):
            if isinstance(param, torch.distributed.tensor.DTensor):  # transformers' sequence_parallel replicates
                module.register_parameter(pname, nn.Parameter(param.to_local(), requires_grad=param.requires_grad))
        module.__dict__.pop("forward", None)  # the style's per-instance wrapper
        # older transformers (5.17-5.2x) all-reduce these grads from a module backward hook instead: that
        # one goes, any other backward hook stays (conversion then refuses to drop it, naming it)
        remove_module_backward_hooks(module, installed_by=_is_transformers_hook)
    return {name: kind for name, _, kind in found}


# ---- conversion ------------------------------------------------------------------------------------------


def _convert_norms(model: nn.Module, deepspeed_config) -> nn.Module:
    """The one place that converts: per the DeepSpeed "shardnorm" section when the run has one (the config as a
    dict or a JSON file's path, read as `apply` reads it)."""
    if deepspeed_config is not None:
        from shardnorm.integrations.deepspeed_config import load_config

        deepspeed_config = load_config(deepspeed_config)
    if deepspeed_config is not None and "shardnorm" in deepspeed_config:
        from shardnorm.integrations.deepspeed import apply  # for code that calls deepspeed.initialize itself

        return apply(model, deepspeed_config)
    if deepspeed_config is not None:
        warn_near_miss_sections(deepspeed_config)
    return shardnorm.convert(model)[0]


def deepspeed_config_of(accelerator) -> dict | None:
    """The DeepSpeed config dict an Accelerator (or a Trainer's) will hand to `deepspeed.initialize`."""
    plugin = getattr(getattr(accelerator, "state", None), "deepspeed_plugin", None)
    return None if plugin is None else plugin.deepspeed_config


def convert_model(model: nn.Module, *, accelerator=None, deepspeed_config: dict | None = None,
                  bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, keep_output: bool = True) -> nn.Module:
    """Convert `model`'s norms in place (same Parameters) before the framework wraps it; returns it.

    - DeepSpeed: the config's "shardnorm" section (from `accelerator` or `deepspeed_config`) decides what
      converts, exactly as `shardnorm.integrations.deepspeed.apply`; ZeRO-3 models built under `zero.Init` included.
    - `tp_plan` models: norms with `replicated_with_grad_allreduce` / `sequence_parallel` (or the shardnorm
      styles) become shardnorm norms whose grads go to one reducer (fp32 buckets, once per optimizer step);
      use `bind_accumulation` (or `shardnorm.accumulate` / `finalize_grads` in your own loop).
    - `keep_output=False` (or the DeepSpeed section's "keep_output": false): the norms recompute their outputs
      in backward instead of keeping them (`shardnorm.output_recompute`).
    """
    return _convert(model, accelerator, deepspeed_config, bucket_cap_mb, keep_output)[0]


def _convert(model, accelerator, deepspeed_config, bucket_cap_mb, keep_output=True) -> tuple[nn.Module, int]:
    """convert_model, also returning how many norms are in a tensor-parallel mode (now or from an earlier call:
    `enable(trainer)` after `convert_model(model)` converts nothing twice and keeps the reducer)."""
    if deepspeed_config is None and accelerator is not None:
        deepspeed_config = deepspeed_config_of(accelerator)
    tp_norms = _take_tp_norms(model)
    model = _convert_norms(model, deepspeed_config)
    if not keep_output:
        model = shardnorm.convert(model, classes=(), warn=False, keep_output=False).model
    if not tp_norms:
        return model, sum(_in_tensor_parallel_mode(m) for m in model.modules())
    mesh = _tp_mesh(model)
    for name, kind in tp_norms.items():
        module = model.get_submodule(name)
        if not isinstance(module, (LayerNorm, RMSNorm)):
            raise ValueError(f"shardnorm: tp_plan norm {name!r} ({type(module).__name__}) was not converted; it "
                             f"needs shardnorm's norm to honour its tensor-parallel style")
        _apply_norm_mode(module, kind, mesh)
    attach_reducer(model, bucket_cap_mb=bucket_cap_mb)
    return model, sum(_in_tensor_parallel_mode(m) for m in model.modules())


# ---- accumulation ----------------------------------------------------------------------------------------


def bind_accumulation(model: nn.Module, accelerator):
    """Reduce the norm grads in the backward of the micro-batch on which `accelerator.sync_gradients` is
    true (the Trainer's and `accelerator.accumulate`'s last micro-batch), before clipping reads them.

    A forward pre-hook sets the reducer's accumulate flag from `sync_gradients`, which both set before each
    micro-batch's forward. Returns the hook handle. A model without a reducer (no tensor-parallel norms)
    has nothing to follow; the hook looks the reducer up at each forward, so one attached later counts.
    """

    def follow_sync_gradients(module, args):
        reducer = reducer_of(model)
        if reducer is not None and torch.is_grad_enabled():
            reducer.accumulating = not accelerator.sync_gradients

    return model.register_forward_pre_hook(follow_sync_gradients)


class ShardnormCallback(TrainerCallback):
    """Checks, before each optimizer step, that the norm grads were reduced (by the last micro-batch's
    backward) and records the reducer's bucket count at that step (`num_buckets`: its norm-grad all-reduces
    per step)."""

    def __init__(self, model: nn.Module):
        self.reducer = reducer_of(model)
        if self.reducer is None:
            raise ValueError("shardnorm: ShardnormCallback needs a model with a norm-grad reducer (convert_model "
                             "attaches one to a tp_plan model with tensor-parallel norms)")
        self.num_buckets = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.reducer.has_pending:
            raise RuntimeError("shardnorm: norm grads were still accumulating at the optimizer step (the last "
                               "micro-batch ran with sync_gradients false); gradient clipping read partial grads")
        self.num_buckets = self.reducer.num_buckets


def enable(trainer, *, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, keep_output: bool = True) -> nn.Module:
    """The one line for a `transformers.Trainer` run: call after building the Trainer, before `train()`.

    Converts `trainer.model` (honouring the DeepSpeed "shardnorm" section when the run uses DeepSpeed:
    Trainer/Accelerate call `deepspeed.initialize` later, on the converted model), and for `tp_plan` models
    ties norm-grad reduction to the Trainer's micro-batches. `keep_output=False`: the norms recompute their outputs
    in backward instead of keeping them. Returns the model.
    """
    options = {"bucket_cap_mb": bucket_cap_mb, "keep_output": keep_output}
    enabled = getattr(trainer, "_shardnorm_enabled", None)
    if enabled is not None:  # the model is converted: a second call changes nothing, so it must ask for nothing new
        changed = [f"{k}={v!r} (enabled with {enabled[k]!r})" for k, v in options.items() if enabled[k] != v]
        if changed:
            raise ValueError(f"shardnorm: enable(trainer) ran for this Trainer already; its model is converted and "
                             f"the options stay those of that call: {', '.join(changed)}")
        return trainer.model
    if getattr(trainer, "model_init", None) is not None:
        raise ValueError("shardnorm: enable(trainer) converts trainer.model, but this Trainer has a model_init, "
                         "which train() calls to build a new model in its place (the converted one would not "
                         "train); convert inside model_init instead: return shardnorm.convert(model)[0]")
    if trainer.model_wrapped is not trainer.model:
        raise RuntimeError("shardnorm: enable(trainer) must run before train() wraps the model "
                           f"(trainer.model_wrapped is a {type(trainer.model_wrapped).__name__})")
    model, tp_norms = _convert(trainer.model, trainer.accelerator, None, bucket_cap_mb, keep_output)
    if tp_norms:
        bind_accumulation(model, trainer.accelerator)
        trainer.add_callback(ShardnormCallback(model))
    trainer._shardnorm_enabled = options
    return model
