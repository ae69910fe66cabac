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


def route_to_reducer(params: tuple, local: tuple, group) -> tuple:
    """`local` (the ranks' copies of `params`), with grads routed to the params' reducer if one is bound.

    Only parameters that will get a grad and are bound to a reducer are routed; the rest pass through.
    """
    if not torch.is_grad_enabled():
        return local
    routed = [i for i, p in enumerate(params) if p is not None and p.requires_grad and bound_reducer(p)]
    reducers = {id(bound_reducer(params[i])) for i in routed}
    if not routed:
        return local
    if len(reducers) > 1:
        raise ValueError("shardnorm: a norm's weight and bias are bound to two different reducers")
    leaves = [local[i].detach().requires_grad_() for i in routed]
    out = _RouteToReducer.apply(bound_reducer(params[routed[0]]), [params[i] for i in routed], group, *leaves)
    local = list(local)
    for i, t in zip(routed, out):
        local[i] = t
    return tuple(local)
