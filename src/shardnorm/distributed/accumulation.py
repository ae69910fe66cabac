"""Model-level control of norm-grad reduction: one reducer per model, stored on it by `attach_reducer` (the
one constructor, whatever the grad source), so `accumulate`, `finalize_grads` and `discard_pending` find it
whoever built it."""

import warnings
from contextlib import ExitStack, contextmanager

from torch import nn
from torch.distributed.tensor import DTensor

from shardnorm.distributed.grad_sources import (REDUCER_ATTR, GradSource, NormBackward, grad_sink, mark_bound,
                                               restore_marks)
from shardnorm.distributed.reducer import DEFAULT_BUCKET_CAP_MB, NormGradReducer, ReduceMode
from shardnorm.modules import LayerNorm, RMSNorm


def attach_reducer(model: nn.Module, *, source: GradSource | None = None,
                   bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, reduce: ReduceMode = "bucketed") -> NormGradReducer:
    """Give `model` its one reducer for the norm grads that are partial sums over ranks; after parallelizing.

    `source`: where the partial sums come from (default: the norms' own backward; `grad_sources.py`). The
    reducer owns the parameters of the model's shardnorm norms (`norm_params`), the only ones it marks.
    Call it again after replacing norm parameters (`model.to(dtype)`, `load_state_dict(assign=True)`): the new
    ones lack the marks, and a norm whose parameters went to the reducer refuses to run without them.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shardnorm: attach_reducer needs the model (a torch.nn.Module), got {type(model).__name__}")
    refuse_pending(model, "attaching a new reducer")
    reducer = NormGradReducer(bucket_cap_mb=bucket_cap_mb, reduce=reduce, source=source)
    setattr(model, REDUCER_ATTR, reducer)
    norms = _norms(model)
    for norm in norms:
        restore_marks(norm)
    params = [p for norm in norms for p in norm.parameters(recurse=False)]
    reducer.source.bind(params)
    for norm in norms:
        mark_bound(norm, reducer)
    if isinstance(reducer.source, NormBackward) and params and all(grad_sink(p) is None for p in params):
        # e.g. attached before parallelize_module: the plan's new parameters are not the ones offered here
        warnings.warn(f"shardnorm: attach_reducer found no sequence-parallel norm parameter among the "
                      f"{len(params)} of {type(model).__name__}'s {len(norms)} shardnorm norm(s), so its reducer "
                      f"reduces nothing (their grads stay as without it). Call attach_reducer after parallelizing "
                      f"the model (parallelize_module with SequenceParallelNorm), and again after re-parallelizing",
                      UserWarning, stacklevel=2)
    return reducer


def _norms(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, (LayerNorm, RMSNorm))]


def norm_params(model: nn.Module) -> list[nn.Parameter]:
    """The weights and biases of `model`'s shardnorm norms: the only parameters a reducer may own."""
    return [p for m in _norms(model) for p in m.parameters(recurse=False)]


def reducer_of(model: nn.Module) -> NormGradReducer | None:
    """The reducer `attach_reducer` gave `model`, or None. Never creates one."""
    return getattr(model, REDUCER_ATTR, None)


def refuse_pending(model: nn.Module, before: str) -> None:
    """Raise if `model`'s reducer holds accumulated grads, which replacing or rewrapping it would lose."""
    old = reducer_of(model)
    if old is not None and old.has_pending:
        raise RuntimeError(f"shardnorm: the model's norm-grad reducer holds accumulated grads; call "
                           f"shardnorm.finalize_grads(model) before {before}")


def _skip_fsdp_reduction(model: nn.Module, stack: ExitStack) -> None:
    """Turn off FSDP's gradient reduction for the backward passes run before `stack` closes."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        stack.callback(model.set_requires_gradient_sync, True)
    elif isinstance(model, FullyShardedDataParallel):
        stack.enter_context(model.no_sync())


@contextmanager
def accumulate(model: nn.Module, *, fsdp_sync: bool = False):
    """Backward passes run inside this context accumulate grads without reducing them across ranks.

    The first backward outside it (or `finalize_grads`) reduces everything accumulated, each reduction once:
    the norm-grad reducer's and FSDP's (`fsdp_sync=True`: FSDP's still in every backward). Raises for
    sequence-parallel norms without a reducer, whose `Partial` grads nothing would reduce. Yields the reducer
    (None without one).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"shardnorm: accumulate needs the model (a torch.nn.Module), got {type(model).__name__}")
    reducer = reducer_of(model)
    if reducer is None:
        _refuse_unreduced_norms(model)
    with ExitStack() as stack:
        if not fsdp_sync:
            _skip_fsdp_reduction(model, stack)
        if reducer is not None:
            stack.callback(setattr, reducer, "accumulating", reducer.accumulating)
            reducer.accumulating = True
        yield reducer


def _refuse_unreduced_norms(model: nn.Module) -> None:
    """Raise if `model` has sequence-parallel DTensor norm params: without a reducer their grads stay `Partial`."""
    for name, p in model.named_parameters():
        if isinstance(p, DTensor) and getattr(p, "sequence_parallel", False) and p.device_mesh.size() > 1:
            raise RuntimeError(f"shardnorm: accumulate(model) on a model with sequence-parallel norms ({name} is a "
                               f"Replicate DTensor whose grads are partial sums over {p.device_mesh}) and no "
                               f"norm-grad reducer: nothing would reduce the accumulated grads; call "
                               f"shardnorm.distributed.attach_reducer(model) after parallelizing")


def finalize_grads(model: nn.Module) -> None:
    """Reduce the accumulated norm grads now and write `.grad` (Megatron-style explicit control); a no-op
    when the last backward already did it, or without a reducer."""
    reducer = reducer_of(model)
    if reducer is not None:
        reducer.finalize()


def discard_pending(model: nn.Module) -> None:
    """Drop the norm-grad partial sums accumulated for a step that will not be taken (call it on every rank);
    a `zero_grad` does the same on its own. A no-op without a reducer."""
    reducer = reducer_of(model)
    if reducer is not None:
        reducer.discard_pending()
