"""Hand a norm's fp32 weight/bias grads to the reducer instead of autograd.

`_RouteToReducer` gives the op fp32 copies of the weight/bias and, in backward, adds their grads into the
reducer bound to the parameters. Its inputs are detached from the parameters: a graph still connected to a
parameter would let autograd accumulate a `Partial` grad into its `.grad` besides.
"""

import torch

from shardnorm.distributed.grad_sources import bound_reducer


class _RouteToReducer(torch.autograd.Function):
    @staticmethod
    def forward(ctx, reducer, params, group, *local):
        ctx.reducer, ctx.params, ctx.group = reducer, params, group
        ctx.set_materialize_grads(False)
        return tuple(t.view_as(t) if t.dtype == torch.float32 else t.float() for t in local)

    @staticmethod
    def backward(ctx, *grads):
        arrived = [(p, g) for p, g in zip(ctx.params, grads) if g is not None]
        if arrived:
            ctx.reducer.add([p for p, _ in arrived], [g for _, g in arrived], ctx.group)
        return (None, None, None) + (None,) * len(grads)


def routed_params(params: tuple) -> tuple:
    """(reducer, indices of `params` whose grads go to it): those that will get a grad, bound to a reducer;
    (None, []) where there are none or grad mode is off."""
    routed = [i for i, p in enumerate(params) if p is not None and p.requires_grad and bound_reducer(p)] \
        if torch.is_grad_enabled() else []
    if not routed:
        return None, []
    reducer = bound_reducer(params[routed[0]])
    if any(bound_reducer(params[i]) is not reducer for i in routed):
        raise ValueError("shardnorm: a norm's weight and bias are bound to two different reducers")
    return reducer, routed


def route_to_reducer(params: tuple, local: tuple, group) -> tuple:
    """`local` (the ranks' copies of `params`), with the grads of `routed_params` going to their reducer; the
    rest pass through."""
    reducer, routed = routed_params(params)
    if reducer is None:
        return local
    leaves = [local[i].detach().requires_grad_() for i in routed]
    out = _RouteToReducer.apply(reducer, [params[i] for i in routed], group, *leaves)
    local = list(local)
    for i, t in zip(routed, out):
        local[i] = t
    return tuple(local)
