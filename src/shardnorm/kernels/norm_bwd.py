"""Backward kernels of the norm family and their launcher.

`norm_bwd_kernel` is persistent: P programs walk the row blocks grid-stride, write dx, and keep
dgamma/dbeta partial sums in fp32 (in registers on the one-pass path, in the program's own row of
the partial buffer on the chunked path). Each program owns one row of a [P, G*N] fp32 buffer and
writes it even when it got no rows. `column_sum_kernel` then reduces that buffer over P in a fixed
order. Together: deterministic (bitwise repeatable), no atomics, no locks.
"""

import functools

import torch
import triton
import triton.language as tl

from . import config


@triton.jit
def _row_tile(SRC, DY, W, MEAN, RSTD, rows64, cols, mask, col_mask, row_mask, stride_src, stride_dy,
              IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """Load one tile; return (xhat, dy, w * dy, rstd), all fp32, zero outside the mask."""
    x = tl.load(SRC + rows64[:, None] * stride_src + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)
    if IS_RMS:
        xhat = x * rstd[:, None]
    else:
        mean = tl.load(MEAN + rows64, mask=row_mask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        wdy = dy * w[None, :]
    else:
        wdy = dy
    return xhat, dy, wdy, rstd


@triton.jit
def _store_dx(xhat, wdy, rstd, c1, c2, DX, DZ, rows64, cols, mask, stride_dx, stride_dz,
              IS_RMS: tl.constexpr, HAS_DZ: tl.constexpr):
    """dx = rstd * (w*dy - xhat * mean(xhat*w*dy) - mean(w*dy)), the last term for LayerNorm only."""
    if IS_RMS:
        dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
    else:
        dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
    if HAS_DZ:
        dx += tl.load(DZ + rows64[:, None] * stride_dz + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def norm_bwd_kernel(SRC, DY, DZ, W, MEAN, RSTD, DX, PARTIAL,
                    stride_src, stride_dy, stride_dz, stride_dx, M, N,
                    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_DZ: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_PASS: tl.constexpr,
                    NUM_STAGES: tl.constexpr):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    num_blocks = tl.cdiv(M, BLOCK_M)
    # Partial buffer row of this program: [dgamma (N) | dbeta (N)], fp32.
    dw_out = PARTIAL + pid.to(tl.int64) * (N * (HAS_WEIGHT + HAS_BIAS))
    db_out = dw_out + N * HAS_WEIGHT
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for block in tl.range(pid, num_blocks, num_programs, num_stages=NUM_STAGES):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            rows64 = rows.to(tl.int64)
            mask = row_mask[:, None] & col_mask[None, :]
            xhat, dy, wdy, rstd = _row_tile(SRC, DY, W, MEAN, RSTD, rows64, cols, mask, col_mask, row_mask,
                                            stride_src, stride_dy, IS_RMS, HAS_WEIGHT, ZERO_CENTERED)
            c1 = tl.sum(xhat * wdy, axis=1) / N
            c2 = tl.sum(wdy, axis=1) / N
            _store_dx(xhat, wdy, rstd, c1, c2, DX, DZ, rows64, cols, mask, stride_dx, stride_dz, IS_RMS, HAS_DZ)
            if HAS_WEIGHT:
                dw_acc += dy * xhat
            if HAS_BIAS:
                db_acc += dy
        if HAS_WEIGHT:
            tl.store(dw_out + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
        if HAS_BIAS:
            tl.store(db_out + cols, tl.sum(db_acc, axis=0), mask=col_mask)
    else:
        # Chunked rows: pass 1 gathers the two row reductions, pass 2 writes dx and adds this
        # block's dgamma/dbeta into the program's own partial row (re-read from L2).
        for start in range(0, N, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            zero = tl.zeros([BLOCK_N], dtype=tl.float32)
            if HAS_WEIGHT:
                tl.store(dw_out + cols, zero, mask=col_mask)
            if HAS_BIAS:
                tl.store(db_out + cols, zero, mask=col_mask)
        for block in range(pid, num_blocks, num_programs):
            rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
            row_mask = rows < M
            rows64 = rows.to(tl.int64)
            c1 = tl.zeros([BLOCK_M], dtype=tl.float32)
            c2 = tl.zeros([BLOCK_M], dtype=tl.float32)
            for start in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                xhat, dy, wdy, rstd = _row_tile(SRC, DY, W, MEAN, RSTD, rows64, cols, mask, col_mask, row_mask,
                                                stride_src, stride_dy, IS_RMS, HAS_WEIGHT, ZERO_CENTERED)
                c1 += tl.sum(xhat * wdy, axis=1)
                c2 += tl.sum(wdy, axis=1)
            c1 = c1 / N
            c2 = c2 / N
            for start in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
                cols = start + tl.arange(0, BLOCK_N)
                col_mask = cols < N
                mask = row_mask[:, None] & col_mask[None, :]
                xhat, dy, wdy, rstd = _row_tile(SRC, DY, W, MEAN, RSTD, rows64, cols, mask, col_mask, row_mask,
                                                stride_src, stride_dy, IS_RMS, HAS_WEIGHT, ZERO_CENTERED)
                _store_dx(xhat, wdy, rstd, c1, c2, DX, DZ, rows64, cols, mask, stride_dx, stride_dz, IS_RMS, HAS_DZ)
                if HAS_WEIGHT:
                    dw = tl.load(dw_out + cols, mask=col_mask, other=0.0)
                    tl.store(dw_out + cols, dw + tl.sum(dy * xhat, axis=0), mask=col_mask)
                if HAS_BIAS:
                    db = tl.load(db_out + cols, mask=col_mask, other=0.0)
                    tl.store(db_out + cols, db + tl.sum(dy, axis=0), mask=col_mask)


@triton.jit
def column_sum_kernel(PARTIAL, OUT_W, OUT_B, P, N, K, BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr):
    """Column k of the [P, K] partials, summed in fp32 over P always in the same order (fixed tiles,
    fixed tree), goes to OUT_W[k] for k < N and OUT_B[k - N] above (dgamma and dbeta in one launch),
    rounded once to the output's dtype (the parameter's)."""
    cols = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    col_mask = cols < K
    acc = tl.zeros([BLOCK_P, BLOCK_K], dtype=tl.float32)
    for start in range(0, P, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        mask = (rows < P)[:, None] & col_mask[None, :]
        acc += tl.load(PARTIAL + rows.to(tl.int64)[:, None] * K + cols[None, :], mask=mask, other=0.0)
    out = tl.where(cols < N, OUT_W + cols, OUT_B + (cols - N))
    tl.store(out, tl.sum(acc, axis=0).to(OUT_W.dtype.element_ty), mask=col_mask)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return config.INTERPRETER_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count


def norm_bwd(dy, dz, src, weight, mean, rstd, has_bias: bool, rms: bool, zero_centered: bool):
    """Launch the backward on 2-D tensors. Returns dx (src's dtype) and dweight, dbias in the
    weight's dtype (fp32 without a weight), reduced in fp32."""
    M, N = src.shape
    dx = torch.empty((M, N), dtype=src.dtype, device=src.device)
    num_grads = int(weight is not None) + int(has_bias)
    cfg = config.bwd_config(N, num_grads)
    programs = config.bwd_programs(cfg, triton.cdiv(M, cfg.block_m), _sm_count(src.device))
    partial = torch.empty((programs, num_grads * N), dtype=torch.float32, device=src.device)
    norm_bwd_kernel[(programs,)](
        src, dy, dz, weight, mean, rstd, dx, partial,
        src.stride(0), dy.stride(0), dz.stride(0) if dz is not None else 0, dx.stride(0), M, N,
        IS_RMS=rms, HAS_WEIGHT=weight is not None, HAS_BIAS=has_bias, HAS_DZ=dz is not None,
        ZERO_CENTERED=zero_centered, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        SINGLE_PASS=cfg.single_pass, NUM_STAGES=cfg.num_stages, num_warps=cfg.num_warps,
    )
    # dgamma, dbeta: separate tensors (custom-op outputs may not alias); with no weight the
    # partial columns hold dbeta only, so OUT_W gets them.
    param_dtype = weight.dtype if weight is not None else torch.float32
    dweight, dbias = (torch.empty(N if present else 0, dtype=param_dtype, device=src.device)
                      for present in (weight is not None, has_bias))
    if num_grads:
        block_k = 256
        column_sum_kernel[(triton.cdiv(num_grads * N, block_k),)](
            partial, dweight if weight is not None else dbias, dbias, programs, N, num_grads * N,
            BLOCK_P=16, BLOCK_K=block_k, num_warps=4)
    return dx, dweight, dbias
