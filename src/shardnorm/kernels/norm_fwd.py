"""Forward kernel of the norm family and its launcher.

One kernel serves LayerNorm and RMSNorm, with or without weight, bias, residual add and
zero-centered gamma, through constexpr switches. Math is fp32 whatever the storage dtypes.
With a residual, z = x + residual is rounded to z's dtype and stored first, and the norm is taken of
that rounded z, so forward and backward (which re-reads z) see the same input.
"""

import torch
import triton
import triton.language as tl

from . import config
from .launch import launch


@triton.jit
def _load_src(X, RES, Z, rows64, cols, mask, stride_x, stride_res, stride_z,
              HAS_RESIDUAL: tl.constexpr, STORE_Z: tl.constexpr):
    """Load one tile of the norm's input in fp32: x, or z = x + residual (stored when STORE_Z)."""
    if HAS_RESIDUAL and not STORE_Z:
        x = tl.load(Z + rows64[:, None] * stride_z + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    else:
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(RES + rows64[:, None] * stride_res + cols[None, :], mask=mask, other=0.0)
            z = (x + r.to(tl.float32)).to(Z.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(Z + rows64[:, None] * stride_z + cols[None, :], z, mask=mask)
            x = z.to(tl.float32)
    return x


@triton.jit
def _store_normalized(x, mean, rstd, W, B, Y, rows64, cols, mask, col_mask, stride_y,
                      IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      ZERO_CENTERED: tl.constexpr):
    if IS_RMS:
        y = x * rstd[:, None]
    else:
        y = (x - mean[:, None]) * rstd[:, None]
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        y = y * w[None, :]
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def norm_fwd_kernel(X, RES, W, B, Y, Z, MEAN, RSTD,
                    stride_x, stride_res, M, N, eps,
                    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        mask = row_mask[:, None] & col_mask[None, :]
        x = _load_src(X, RES, Z, rows64, cols, mask, stride_x, stride_res, N, HAS_RESIDUAL, True)
        if IS_RMS:
            mean = tl.zeros([BLOCK_M], dtype=tl.float32)
            var = tl.sum(x * x, axis=1) / N
        else:
            mean = tl.sum(x, axis=1) / N
            centered = tl.where(mask, x - mean[:, None], 0.0)
            var = tl.sum(centered * centered, axis=1) / N
        rstd = 1.0 / tl.sqrt(var + eps)
        _store_normalized(x, mean, rstd, W, B, Y, rows64, cols, mask, col_mask, N,
                          IS_RMS, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED)
    else:
        # Pass 1: statistics chunk by chunk (Chan's parallel merge of per-chunk mean/M2, stable for
        # large N and large means); z is written here. Pass 2: re-read (from L2) and normalize.
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        m2 = tl.zeros([BLOCK_M], dtype=tl.float32)
        for start in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_src(X, RES, Z, rows64, cols, mask, stride_x, stride_res, N, HAS_RESIDUAL, True)
            if IS_RMS:
                m2 += tl.sum(x * x, axis=1)
            else:
                count = tl.minimum(N - start, BLOCK_N).to(tl.float32)
                chunk_mean = tl.sum(x, axis=1) / count
                centered = tl.where(mask, x - chunk_mean[:, None], 0.0)
                chunk_m2 = tl.sum(centered * centered, axis=1)
                seen = start * 1.0  # loop index as fp32
                total = seen + count
                delta = chunk_mean - mean
                mean += delta * (count / total)
                m2 += chunk_m2 + delta * delta * (seen * count / total)
        rstd = 1.0 / tl.sqrt(m2 / N + eps)
        for start in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_src(X, RES, Z, rows64, cols, mask, stride_x, stride_res, N, HAS_RESIDUAL, False)
            _store_normalized(x, mean, rstd, W, B, Y, rows64, cols, mask, col_mask, N,
                              IS_RMS, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED)
    if not IS_RMS:
        tl.store(MEAN + rows64, mean, mask=row_mask)
    tl.store(RSTD + rows64, rstd, mask=row_mask)


def norm_fwd(x, weight, bias, residual, eps: float, rms: bool, zero_centered: bool):
    """Launch the forward kernel on 2-D x [M, N] (last dim contiguous). Returns y, z, mean, rstd;
    z is None without a residual, mean None for RMSNorm."""
    M, N = x.shape
    device = x.device
    y = torch.empty((M, N), dtype=x.dtype, device=device)
    z = torch.empty((M, N), dtype=torch.result_type(x, residual), device=device) if residual is not None else None
    mean = None if rms else torch.empty(M, dtype=torch.float32, device=device)
    rstd = torch.empty(M, dtype=torch.float32, device=device)
    if M == 0:
        return y, z, mean, rstd
    param = weight if weight is not None else bias
    cfg = config.fwd_config(N, param.element_size() if param is not None else 2, bias is not None)
    launch(norm_fwd_kernel, (config.cdiv(M, cfg.block_m),),
           (x, residual, weight, bias, y, z, mean, rstd,
            x.stride(0), residual.stride(0) if residual is not None else 0, M, N, eps),
           num_warps=cfg.num_warps, IS_RMS=rms, HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None,
           HAS_RESIDUAL=residual is not None, ZERO_CENTERED=zero_centered,
           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SINGLE_PASS=cfg.single_pass, NUM_STAGES=cfg.num_stages)
    return y, z, mean, rstd
