"""Model-level control of norm-grad reduction: attach a reducer, accumulate micro-batches, finalize."""

from contextlib import contextmanager

from torch import nn

from shardnorm.distributed.reducer import NormGradReducer, ReduceMode

_ATTR = "_shardnorm_reducer"


def attach_reducer(model: nn.Module, *, bucket_cap_mb: float = 1.0,
                   reduce: ReduceMode = "bucketed") -> NormGradReducer:
    """Give `model` one reducer for all its sequence-parallel norm grads; call after parallelizing it.

    Without a reducer the grads are still right, reduced the way torch does it: DTensor params get
    `Partial` grads (one all-reduce per parameter when redistributed), plain Megatron-style params keep
    their local partial sums for Megatron's `finalize_model_grads`.
    """
    old = getattr(model, _ATTR, None)
    if old is not None and old.has_pending:
        raise RuntimeError("shardnorm: the model's reducer holds accumulated grads; call "
                           "shardnorm.finalize_grads(model) before attaching a new reducer")
    reducer = NormGradReducer(bucket_cap_mb=bucket_cap_mb, reduce=reduce)
    setattr(model, _ATTR, reducer)
    reducer.bind(model.parameters())
    return reducer


def reducer_of(model: nn.Module) -> NormGradReducer:
    """The model's reducer (attached with defaults on first use), bound to the model's current params."""
    reducer = getattr(model, _ATTR, None)
    if reducer is None:
        return attach_reducer(model)
    reducer.bind(model.parameters())
    return reducer


@contextmanager
def accumulate(model: nn.Module):
    """Backward passes run inside this context add to the norm-grad buffer without reducing it.

    The first backward outside it (or `finalize_grads`) reduces everything accumulated, once.
    """
    reducer = reducer_of(model)
    previous, reducer.accumulating = reducer.accumulating, True
    try:
        yield reducer
    finally:
        reducer.accumulating = previous


def finalize_grads(model: nn.Module) -> None:
    """Reduce the accumulated norm grads now and write `.grad` (Megatron-style explicit control).

    A no-op when the last backward already did it.
    """
    reducer_of(model).finalize()
