"""Norm over a hidden dim split across ranks (``Shard(-1)``, e.g. a QK-norm over tensor-parallel heads).

The activation never moves; weight/bias are sharded like the hidden dim, so their grads are complete locally.
RMSNorm all-reduces a per-row sum of squares. LayerNorm's variance is not E[x^2] - mean^2, which fp32 loses
for a row whose mean is large against its spread: each rank gathers every slice's (count, mean, M2), shifted
by its own slice mean, and merges them in rank order (Chan et al.), keeping the row mean as (local shift,
offset). Backward all-reduces the two per-row sums that dx needs.
"""

import torch
import torch.distributed as dist

from ..reference import scale


def _normalized(xf, shift, offset, rstd):
    """(x - mean) * rstd with mean = shift + offset (None for RMSNorm: x * rstd)."""
    return xf * rstd if shift is None else ((xf - shift) - offset) * rstd


def _row_moments(xf: torch.Tensor, group):
    """This rank's (shift, offset, M2 / N) per row: shift its slice mean, offset the row mean minus it (accurate
    where the mean is far from zero against the spread), M2 / N the whole row's variance."""
    n_local = xf.shape[-1]
    if not xf.shape[0]:  # no rows here, nor on the group's other ranks (they hold the same rows)
        shift = xf.new_zeros(0, 1)
        return shift, shift, shift
    if n_local:
        shift = xf.mean(-1, keepdim=True)
        d = xf - shift  # exact where x is within a factor 2 of shift (the large-mean case)
        e = d.mean(-1, keepdim=True)  # what rounding shift to fp32 left out of the slice mean
        m2 = (d - e).square().sum(-1, keepdim=True)
    else:  # a rank with no columns of these rows (an uneven shard)
        shift = e = m2 = xf.new_zeros(xf.shape[0], 1)
    local = torch.cat([shift, e, m2, torch.full_like(m2, n_local)], dim=-1)
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local, group=group)
    shifts, es, m2s, counts = torch.stack(parts).unbind(-1)  # [ranks, M] each
    # the first rank with columns, the same on every rank (an index tensor: no device-to-host sync)
    ref_shift = shifts.index_select(0, (counts[:, :1] > 0).int().argmax(0))  # [1, M]
    # means relative to the reference rank's shift: small differences of nearby fp32 values, exact
    means = (shifts - ref_shift) + es
    total = counts.sum(0)
    mean = (counts * means).sum(0) / total
    m2_total = (m2s + counts * (means - mean).square()).sum(0)
    offset = (mean - (shift[:, 0] - ref_shift[0])).unsqueeze(-1)  # the row mean minus this rank's shift
    return shift, offset, (m2_total / total).unsqueeze(-1)


class HiddenShardedNorm(torch.autograd.Function):
    """y = norm(x) for x2d [M, N_local] whose rows continue on the other ranks of `group` (N in total)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool, zero_centered: bool, group, n: int):
        xf = x.float()
        if rms:
            sums = xf.square().sum(-1, keepdim=True)
            dist.all_reduce(sums, group=group)
            shift = offset = None
            var = sums / n
        else:
            shift, offset, var = _row_moments(xf, group)
        rstd = torch.rsqrt(var + eps)
        y = _normalized(xf, shift, offset, rstd)
        if weight is not None:
            y = y * scale(weight, zero_centered)
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x, weight, shift, offset, rstd)
        ctx.zero_centered, ctx.group, ctx.n, ctx.has_bias = zero_centered, group, n, bias is not None
        # not `y.to(x.dtype)` where that is y itself: torch 2.11's Dynamo then traces the backward with a zero grad
        # for that output (an fp32 x's grads all zero, compiled; torch 2.13 traces it right)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, shift, offset, rstd = ctx.saved_tensors
        dyf = dy.float()
        xhat = _normalized(x.float(), shift, offset, rstd)
        g = dyf if weight is None else dyf * scale(weight, ctx.zero_centered)
        sums = (g * xhat).sum(-1, keepdim=True)
        if shift is not None:
            sums = torch.cat([sums, g.sum(-1, keepdim=True)], dim=-1)
        dist.all_reduce(sums, group=ctx.group)
        dx = g - xhat * (sums[:, :1] / ctx.n)
        if shift is not None:
            dx = dx - sums[:, 1:] / ctx.n
        dx = (dx * rstd).to(x.dtype)
        dw = (dyf * xhat).sum(0).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = dyf.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None
