"""Tile helpers of the backward kernels (`norm_bwd.py`: fused, split): one
[BLOCK_M, BLOCK_N] tile's loads, its dx, and the dgamma/dbeta partial sums a program keeps.

Row and column indices (`_tile_rows`, `_column_tile`) come from helpers that take no pointer, and the helpers
that take pointers return loaded values only: Inductor's analysis of which arguments a kernel writes
(`torch.library.wrap_triton`, the compiled path of `ops`) follows a stored address back through the call that
made any part of it, and an index returned by a helper that also read SRC, DY or W would mark those as written
(Inductor then copies them before every launch, or fails on a leaf that requires grad). tests/test_traced_kernels.py
holds the analysis to each kernel's outputs."""

import triton
import triton.language as tl

from .norm_fwd import _load_params


@triton.jit
def _tile_rows(block, col_mask, M, BLOCK_M: tl.constexpr):
    """Rows of row block `block` (int64), their mask and the tile's mask over columns `col_mask`."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    mask = row_mask[:, None] & col_mask[None, :]
    return rows64, row_mask, mask


@triton.jit
def _row_tile(SRC, DY, W, w, MEAN, RSTD, rows64, row_mask, mask, cols, col_mask, stride_src, stride_dy,
              IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr,
              PARAMS_LOADED: tl.constexpr):
    """Load the tile of rows `rows64` (`_tile_rows`) and columns `cols`; return (xhat, dy, w * dy, rstd), all
    fp32, zero outside the mask. The weights are read here, after x and dy, unless the caller holds them
    (PARAMS_LOADED: w)."""
    x, dy, mean, rstd = _load_tile(SRC, DY, MEAN, RSTD, rows64, row_mask, mask, cols, stride_src, stride_dy, IS_RMS)
    xhat, dy, wdy = _tile_values(x, dy, mean, rstd, mask, W, w, cols, col_mask, IS_RMS, HAS_WEIGHT, ZERO_CENTERED,
                                 PARAMS_LOADED)
    return xhat, dy, wdy, rstd


@triton.jit
def _load_tile(SRC, DY, MEAN, RSTD, rows64, row_mask, mask, cols, stride_src, stride_dy, IS_RMS: tl.constexpr):
    """The loads of `_row_tile`: x and dy as stored, the rows' mean (LayerNorm; else rstd again) and
    rstd. Apart so that a caller can have them in flight across a wait before using them."""
    x = tl.load(SRC + rows64[:, None] * stride_src + cols[None, :], mask=mask, other=0.0)
    dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
    rstd = tl.load(RSTD + rows64, mask=row_mask, other=0.0)
    mean = rstd
    if not IS_RMS:
        mean = tl.load(MEAN + rows64, mask=row_mask, other=0.0)
    return x, dy, mean, rstd


@triton.jit
def _tile_values(x, dy, mean, rstd, mask, W, w, cols, col_mask, IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                 ZERO_CENTERED: tl.constexpr, PARAMS_LOADED: tl.constexpr):
    """The math of `_row_tile` on loaded x, dy: (xhat, dy, w * dy) in fp32."""
    x = x.to(tl.float32)
    dy = dy.to(tl.float32)
    if IS_RMS:
        xhat = x * rstd[:, None]
    else:
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    if not PARAMS_LOADED:
        w = _load_params(W, W, cols, col_mask, HAS_WEIGHT, False, ZERO_CENTERED)[0]
    if HAS_WEIGHT:
        wdy = dy * w[None, :]
    else:
        wdy = dy
    return xhat, dy, wdy


@triton.jit
def _store_dx(xhat, wdy, rstd, c1, c2, DX, DZ, rows64, cols, mask, N, stride_dz,
              IS_RMS: tl.constexpr, HAS_DZ: tl.constexpr):
    """dx = rstd * (w*dy - xhat * mean(xhat*w*dy) - mean(w*dy)), the last term for LayerNorm only; rows of
    dx are N apart."""
    if IS_RMS:
        dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
    else:
        # At N = 1 LayerNorm's y is its bias whatever x is, so dx is exactly 0, as torch's. The formula gives
        # w*dy - mean(w*dy) = 0 only if both are rounded alike: with N = 1 (a constexpr to Triton) the mean is
        # w*dy itself, which the compiler fuses into an FMA, leaving w*dy's rounding error times rstd
        # (up to 2.3 at eps = 1e-12 on an H100). Scaling by 0 there costs one select per row.
        dx = (wdy - xhat * c1[:, None] - c2[:, None]) * tl.where(N > 1, rstd, 0.0)[:, None]
    if HAS_DZ:
        dx += tl.load(DZ + rows64[:, None] * stride_dz + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + rows64[:, None] * N + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _column_tile(N, BLOCK_N: tl.constexpr):
    """Program (column tile t, row group g) of a 2-D grid: t, g, its columns and their mask."""
    tile = tl.program_id(0)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    return tile, tl.program_id(1), cols, col_mask


@triton.jit
def _program_state(W, cols, col_mask, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                   HOIST_PARAMS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """What a backward program keeps across its row blocks: the weights of its columns when
    HOIST_PARAMS (else 1.0, and `_row_tile` reads them per tile) and zeroed dgamma/dbeta accumulators."""
    w = 1.0
    if HOIST_PARAMS:
        w = _load_params(W, W, cols, col_mask, HAS_WEIGHT, False, ZERO_CENTERED)[0]
    return w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)


@triton.jit
def _accumulate(dw_acc, db_acc, dy, xhat, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """dgamma += dy * xhat, dbeta += dy, per column, over the tile's rows (kept per row until the end)."""
    if HAS_WEIGHT:
        dw_acc += dy * xhat
    if HAS_BIAS:
        db_acc += dy
    return dw_acc, db_acc


@triton.jit
def _store_partials(dw_acc, db_acc, PARTIAL, row, cols, col_mask, N,
                    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Row `row` of the partial buffer: [dgamma (N) | dbeta (N)], fp32, the columns `cols` of it."""
    if HAS_WEIGHT:
        dw_out = PARTIAL + row.to(tl.int64) * (N * (1 + HAS_BIAS))
        tl.store(dw_out + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if HAS_BIAS:
        db_out = PARTIAL + row.to(tl.int64) * (N * (1 + HAS_WEIGHT)) + N * HAS_WEIGHT
        tl.store(db_out + cols, tl.sum(db_acc, axis=0), mask=col_mask)
