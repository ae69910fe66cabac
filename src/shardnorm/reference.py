"""The same math as the Triton kernels in plain torch (fp32): the CPU backend, with the signatures and outputs
of `kernels.norm_fwd` / `kernels.norm_bwd` (absent outputs are None), so `ops` can pick either."""

import torch


def _xhat(src, mean, rstd, rms: bool):
    x = src.float()
    return x * rstd[:, None] if rms else (x - mean[:, None]) * rstd[:, None]


def scale(weight, zero_centered: bool):
    """What y is multiplied by, in fp32: the weight, or 1 + weight with zero-centered gamma."""
    w = weight.float()
    return w + 1.0 if zero_centered else w


def statistics(src, eps: float, rms: bool):
    """(mean, rstd) of each row in fp32; mean is None for RMSNorm. Differentiable: the backward's create_graph
    path recomputes them from the saved input."""
    xf = src.float()
    if rms:
        return None, torch.rsqrt(xf.square().mean(-1) + eps)
    mean = xf.mean(-1)
    return mean, torch.rsqrt((xf - mean[:, None]).square().mean(-1) + eps)


def norm_fwd(x, weight, bias, residual, eps: float, rms: bool, zero_centered: bool):
    z = x + residual if residual is not None else None
    src = x if z is None else z
    mean, rstd = statistics(src, eps, rms)
    y = _xhat(src, mean, rstd, rms)
    if weight is not None:
        y = y * scale(weight, zero_centered)
    if bias is not None:
        y = y + bias.float()
    y = y.to(x.dtype)
    return y, z, mean, rstd


def norm_bwd(dy, dz, src, weight, mean, rstd, has_bias: bool, rms: bool, zero_centered: bool):
    xhat = _xhat(src, mean, rstd, rms)
    dyf = dy.float()
    wdy = dyf * scale(weight, zero_centered) if weight is not None else dyf
    n = src.shape[-1]
    dx = wdy - xhat * ((xhat * wdy).sum(-1, keepdim=True) / n)
    if not rms:
        dx = dx - wdy.sum(-1, keepdim=True) / n
    if rms or n > 1:
        dx = dx * rstd[:, None]
    else:  # LayerNorm over one element: y is the bias whatever x is, dx exactly 0 (kernels/bwd_tiles._store_dx)
        dx = torch.zeros_like(dx)
    if dz is not None:
        dx = dx + dz.float()
    param_dtype = weight.dtype if weight is not None else torch.float32
    dweight = (dyf * xhat).sum(0).to(param_dtype) if weight is not None else None
    dbias = dyf.sum(0).to(param_dtype) if has_bias else None
    return dx.to(src.dtype), dweight, dbias


def fingerprint(words, rows_per_block: int):
    """`kernels.fingerprint`'s block sums (int32, their uint32 bits) of 4-D `words` (int32 or int16), in int64 torch
    ops kept to 32 bits: bitwise the kernel's."""
    d0, d1, d2, n = words.shape
    r = d0 * d1 * d2
    w = words.reshape(r, n).to(torch.int64) & ((1 << 8 * words.element_size()) - 1)  # the words unsigned
    index = torch.arange(r * n, device=w.device, dtype=torch.int64).view(r, n)
    h = (w + _mul32(index & _MASK, 0x9E3779B9)) & _MASK
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    h = (h ^ (h >> 16)).sum(1) & _MASK
    blocks = -(-r // rows_per_block)
    sums = torch.cat([h, h.new_zeros(blocks * rows_per_block - r)]).view(blocks, rows_per_block).sum(1) & _MASK
    return (sums - ((sums >> 31) << 32)).to(torch.int32)


_MASK = 0xFFFFFFFF


def _mul32(h, constant: int):
    """h * constant modulo 2**32 for h < 2**32, in halves, every intermediate within int64's range (a full product,
    or the high half's product shifted unmasked, would pass it)."""
    return (h * (constant & 0xFFFF) + (((h * (constant >> 16)) & 0xFFFF) << 16)) & _MASK
