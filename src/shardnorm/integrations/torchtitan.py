"""shardnorm in torchtitan 0.3: a model converter, a parallelize wrapper and a Trainer that accumulates.

- `ShardnormConverter` (a torchtitan `ModelConfigConverter`): every `RMSNorm.Config` becomes
  `ShardnormRMSNorm.Config`, which runs shardnorm's kernel and, where torchtitan's TP plan declares a
  sequence-parallel norm, is parallelized with `shardnorm.distributed.SequenceParallelNorm`.
- `parallelize_with_shardnorm(fn)`: the model's parallelize function, then the norm-grad reducer on the
  FSDP2-wrapped model (`shardnorm.fsdp.install_norm_grad_reducer`); where some norm has `keep_output=False`, the
  model is handed to `shardnorm.convert`, whose forward is then the scope in which the option acts.
- `ShardnormTrainer`: torchtitan's `Trainer`, whose non-final micro-batches run inside `shardnorm.accumulate`.

`with_shardnorm(config)` applies all three to a `Trainer.Config` (docs/integrations/torchtitan.md).
"""

import logging
from contextlib import ExitStack
from dataclasses import dataclass
from functools import wraps

try:
    import torchtitan
    from torchtitan.models.common import RMSNorm as TitanRMSNorm
    from torchtitan.config.override import derive
    from torchtitan.protocols.model import ModelConfigConverter
    from torchtitan.protocols.module import Module
    from torchtitan.protocols.sharding import resolve_placements
    from torchtitan.trainer import Trainer
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(f"shardnorm.integrations.torchtitan needs torchtitan 0.3: pip install 'shardnorm[torchtitan]' "
                      f"({e})") from e


from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import parallelize_module

import shardnorm
from shardnorm.distributed import DEFAULT_BUCKET_CAP_MB, SequenceParallelNorm
from shardnorm.fsdp import install_norm_grad_reducer

SUPPORTED_VERSIONS = ("0.3.",)
if not torchtitan.__version__.startswith(SUPPORTED_VERSIONS):  # pragma: no cover
    raise ImportError(f"shardnorm.integrations.torchtitan supports torchtitan {SUPPORTED_VERSIONS[0]}x, found "
                      f"torchtitan {torchtitan.__version__} (its converter and sharding protocols change between "
                      f"releases)")

# torchtitan logs through the root logger at INFO (torchtitan.tools.logging.init_logger): these lines appear in its log
_log = logging.getLogger(__name__)

SPMD_BACKEND = "partial_dtensor"  # DTensor on the model-parallel axes: what SequenceParallelNorm speaks
_SEQUENCE_PARALLEL = "_shardnorm_sequence_parallel"

__all__ = ["ShardnormConverter", "ShardnormRMSNorm", "ShardnormTrainer", "llama3_debugmodel",
           "parallelize_with_shardnorm", "with_shardnorm"]


class ShardnormRMSNorm(shardnorm.RMSNorm, Module):
    """torchtitan's configurable RMSNorm on shardnorm's kernel; same params, state dict and init."""

    @dataclass(kw_only=True, slots=True)
    class Config(TitanRMSNorm.Config):
        keep_output: bool = True  # false: the output is recomputed in backward (shardnorm.output_recompute)

    def __init__(self, config: Config):
        super().__init__(config.normalized_shape, eps=config.eps, elementwise_affine=config.elementwise_affine,
                         keep_output=config.keep_output)

    def forward(self, x):
        """torchtitan's signature: its `Module.parallelize` redistributes every parameter `forward` names, so a
        replicated norm (qwen3's q/k norms under TP) with an unpassed `residual` would fail there."""
        return shardnorm.RMSNorm.forward(self, x)

    def parallelize(self, parallel_dims) -> None:
        """Where torchtitan's plan makes this a sequence-parallel norm, apply `SequenceParallelNorm`."""
        plan = self._sharding_config
        if plan is None or not parallel_dims.tp_enabled:
            return Module.parallelize(self, parallel_dims)
        if parallel_dims.spmd_backend != SPMD_BACKEND:
            raise ValueError(f"shardnorm: parallelism.spmd_backend={parallel_dims.spmd_backend!r} is not supported "
                             f"under tensor parallelism; use --parallelism.spmd_backend {SPMD_BACKEND} (shardnorm's "
                             f"sequence-parallel norms are DTensor ParallelStyles)")
        tp_mesh = parallel_dims.get_mesh("tp")
        weight = resolve_placements(plan.state_shardings["weight"], tp_mesh)
        x = resolve_placements((plan.in_src_shardings or {}).get("input"), tp_mesh) \
            if (plan.in_src_shardings or {}).get("input") is not None else None
        if weight != (Replicate(),) or x is None or not (isinstance(x[0], Shard) and x[0].dim == 1):
            return Module.parallelize(self, parallel_dims)  # a replicated norm: nothing of ours to do
        if parallel_dims.cp_enabled:
            raise NotImplementedError("shardnorm: sequence-parallel norms with context parallelism "
                                      "(parallelism.context_parallel_degree > 1 and tensor_parallel_degree > 1) "
                                      "are not supported by the torchtitan adapter")
        if self._parallelized:
            raise ValueError(f"{type(self).__name__} has already been parallelized")
        self._parallelized = True
        # An output the plan redistributes to one placement (the final norm all-gathers for lm_head) is
        # redistributed by the style itself. keep_output=False frees that gathered output only for consumers
        # parallelized with RegatherColwiseParallel, which takes torch's nn.Linear; torchtitan's lm_head is its own
        # Linear, parallelized from its ShardingConfig, so it keeps the gathered input (shardnorm warns once).
        out = resolve_placements(plan.out_dst_shardings, tp_mesh) if plan.out_dst_shardings is not None else None
        output_layouts = out[0] if out is not None and len(out) == 1 else None
        parallelize_module(self, tp_mesh, SequenceParallelNorm(sequence_dim=1, output_layouts=output_layouts))
        setattr(self, _SEQUENCE_PARALLEL, True)
        if out is not None and output_layouts is None:
            self.register_forward_hook(lambda m, args, out: m._redistribute_outputs(parallel_dims, out))


class ShardnormConverter(ModelConfigConverter):
    """torchtitan model converter: its RMSNorms become shardnorm's (same parameters and sharding plan)."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        keep_output: bool = True  # false: the converted norms recompute their outputs in backward

    def __init__(self, config: Config, **kwargs):
        self.config = config

    def convert(self, model_config):
        converted = model_config
        count = 0
        for fqn, cfg, parent, attr in list(model_config.traverse(TitanRMSNorm.Config, recurse=True)):
            if type(cfg) is not TitanRMSNorm.Config:
                continue
            new = derive(cfg, ShardnormRMSNorm.Config, keep_output=self.config.keep_output)
            count += 1
            if parent is None:
                converted = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        if count == 0:
            raise ValueError(f"shardnorm: ShardnormConverter found no torchtitan RMSNorm.Config in "
                             f"{type(model_config).__qualname__}")
        _log.info("shardnorm: converted %d RMSNorm config(s) of %s to ShardnormRMSNorm (keep_output=%s)", count,
                  type(model_config).__qualname__, self.config.keep_output)
        return converted


def parallelize_with_shardnorm(parallelize_fn, *, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB):
    """Wrap a torchtitan parallelize function: after it (TP, AC, compile, FSDP2), attach the norm reducer."""

    @wraps(parallelize_fn)
    def parallelize(model, *, parallel_dims, **kwargs):
        model = parallelize_fn(model, parallel_dims=parallel_dims, **kwargs)
        norms = [(fqn, m, bool(getattr(m, _SEQUENCE_PARALLEL, False))) for fqn, m in model.named_modules()
                 if isinstance(m, ShardnormRMSNorm)]
        sequence_parallel = sum(sp for *_, sp in norms)
        if sequence_parallel:
            install_norm_grad_reducer(model, norms, parallel_dims.get_mesh("tp"), bucket_cap_mb=bucket_cap_mb)
        if any(not m.keep_output for _, m, _ in norms):  # keep_output=False acts in the forward of a converted model
            model = shardnorm.convert(model, classes=(), warn=False).model
        _log.info("shardnorm: %d ShardnormRMSNorm module(s) in the model, %d sequence-parallel%s", len(norms),
                  sequence_parallel, " (their grads reduced over tp by shardnorm's reducer, in fp32, once per step)"
                  if sequence_parallel else "")
        return model

    return parallelize


class ShardnormTrainer(Trainer):
    """torchtitan's Trainer; non-final micro-batches of a step accumulate shardnorm's norm grads."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        pass

    def train_step(self, data_iterator):
        self._shardnorm_microbatch = 0
        return Trainer.train_step(self, data_iterator)

    def forward_backward_step(self, **kwargs):
        index, self._shardnorm_microbatch = self._shardnorm_microbatch, self._shardnorm_microbatch + 1
        last = index == self.gradient_accumulation_steps - 1
        with ExitStack() as stack:
            if not last:  # FSDP still reduce-scatters each micro-batch (torchtitan's memory profile); tp waits
                for m in self.model_parts:
                    stack.enter_context(shardnorm.accumulate(m, fsdp_sync=True))
            return Trainer.forward_backward_step(self, **kwargs)


def with_shardnorm(config: Trainer.Config, *, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
                   keep_output: bool = True) -> ShardnormTrainer.Config:
    """A torchtitan `Trainer.Config` with shardnorm's norms, TP plan, reducer and accumulation (`keep_output=False`:
    the norms recompute their outputs in backward instead of keeping them)."""
    spec = config.model_spec
    if spec is None:
        raise ValueError("shardnorm: with_shardnorm needs a Trainer.Config whose model_spec is set")
    spec.model = ShardnormConverter.Config(keep_output=keep_output).build().convert(spec.model)
    spec.parallelize_fn = parallelize_with_shardnorm(spec.parallelize_fn, bucket_cap_mb=bucket_cap_mb)
    config.parallelism.spmd_backend = SPMD_BACKEND
    return derive(config, ShardnormTrainer.Config)


def llama3_debugmodel() -> ShardnormTrainer.Config:
    """torchtitan's `llama3_debugmodel` config with shardnorm (`--module shardnorm.integrations.torchtitan`)."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel as stock

    return with_shardnorm(stock())
