"""Norm over a hidden dim split across ranks (``Shard(-1)``, e.g. a QK-norm over tensor-parallel heads).

Each rank holds a slice of every row. Forward all-reduces per-row fp32 partial sums (sum and sum of squares;
only the latter for RMS) to get mean/rstd; backward all-reduces the two per-row sums that dx needs. The
activation itself never moves. Weight/bias are sharded like the hidden dim, so their grads are complete
for the local slice.
"""

import torch
import torch.distributed as dist


def _scale(weight: torch.Tensor, zero_centered: bool) -> torch.Tensor:
    w = weight.float()
    return w + 1.0 if zero_centered else w


def _normalized(xf, mean, rstd):
    return (xf if mean is None else xf - mean) * rstd


class HiddenShardedNorm(torch.autograd.Function):
    """y = norm(x) for x2d [M, N_local] whose rows continue on the other ranks of `group` (N in total)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps: float, rms: bool, zero_centered: bool, group, n: int):
        xf = x.float()
        sums = xf.square().sum(-1, keepdim=True)
        if not rms:
            sums = torch.cat([xf.sum(-1, keepdim=True), sums], dim=-1)
        dist.all_reduce(sums, group=group)
        mean = None if rms else sums[:, :1] / n
        mean_sq = sums[:, -1:] / n
        var = mean_sq if rms else (mean_sq - mean.square()).clamp_min(0.0)
        rstd = torch.rsqrt(var + eps)
        y = _normalized(xf, mean, rstd)
        if weight is not None:
            y = y * _scale(weight, zero_centered)
        if bias is not None:
            y = y + bias.float()
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.zero_centered, ctx.group, ctx.n, ctx.has_bias = zero_centered, group, n, bias is not None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dyf = dy.float()
        xhat = _normalized(x.float(), mean, rstd)
        g = dyf if weight is None else dyf * _scale(weight, ctx.zero_centered)
        sums = (g * xhat).sum(-1, keepdim=True)
        if mean is not None:
            sums = torch.cat([sums, g.sum(-1, keepdim=True)], dim=-1)
        dist.all_reduce(sums, group=ctx.group)
        dx = g - xhat * (sums[:, :1] / ctx.n)
        if mean is not None:
            dx = dx - sums[:, 1:] / ctx.n
        dx = (dx * rstd).to(x.dtype)
        dw = (dyf * xhat).sum(0).to(weight.dtype) if weight is not None and ctx.needs_input_grad[1] else None
        db = dyf.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None
