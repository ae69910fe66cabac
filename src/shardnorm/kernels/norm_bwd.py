"""Backward kernels of the norm family and their launcher.

Rows that fit in registers take `norm_bwd_kernel`, one pass over x and dy by persistent programs that keep
dgamma/dbeta partial sums in fp32 registers; longer rows the split backward (`row_sums_kernel`, then
`dx_kernel`), or on Hopper the staged one (`norm_bwd_staged.py`). Each program (row group) owns one row of a
[P, G*N] fp32 partial buffer, written even when it got no rows, which `column_sum_kernel` reduces in a fixed
order: bitwise repeatable, no atomics. Tiny inputs (`config.direct_grads`) take one program that stores
dgamma/dbeta itself.
"""

import functools

import torch
import triton
import triton.language as tl

from . import config
from .bwd_tiles import _accumulate, _column_tile, _program_state, _row_tile, _store_dx, _store_partials, _tile_rows
from .launch import Launcher


@triton.jit(do_not_specialize=["M"])
def norm_bwd_kernel(SRC, DY, DZ, W, MEAN, RSTD, DX, DW_OUT, DB_OUT,
                    stride_src, stride_dy, stride_dz, M, N,
                    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_DZ: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr, NUM_STAGES: tl.constexpr,
                    HOIST_PARAMS: tl.constexpr, DIRECT_GRADS: tl.constexpr):
    """One pass: whole rows in registers (the tile `cols` and, with TAIL_N, the narrower tile after
    it), dgamma/dbeta accumulated across row blocks.
    DW_OUT and DB_OUT: the partial buffer (both), or with DIRECT_GRADS (one program) dgamma and dbeta."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w, dw_acc, db_acc = _program_state(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED, HOIST_PARAMS, BLOCK_M, BLOCK_N)
    if TAIL_N > 0:
        tail_cols = BLOCK_N + tl.arange(0, TAIL_N)
        tail_mask = tail_cols < N
        tail_w, tail_dw, tail_db = _program_state(W, tail_cols, tail_mask, HAS_WEIGHT, ZERO_CENTERED, HOIST_PARAMS,
                                                  BLOCK_M, TAIL_N)
    for block in tl.range(pid, tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=NUM_STAGES):
        rows64, row_mask, mask = _tile_rows(block, col_mask, M, BLOCK_M)
        xhat, dy, wdy, rstd = _row_tile(SRC, DY, W, w, MEAN, RSTD, rows64, row_mask, mask, cols, col_mask,
                                        stride_src, stride_dy, IS_RMS, HAS_WEIGHT, ZERO_CENTERED, HOIST_PARAMS)
        sum_xwdy = tl.sum(xhat * wdy, axis=1)
        sum_wdy = tl.sum(wdy, axis=1)
        if TAIL_N > 0:
            _, _, tail_tile_mask = _tile_rows(block, tail_mask, M, BLOCK_M)
            tail_xhat, tail_dy, tail_wdy, _ = _row_tile(SRC, DY, W, tail_w, MEAN, RSTD, rows64, row_mask,
                                                        tail_tile_mask, tail_cols, tail_mask, stride_src, stride_dy,
                                                        IS_RMS, HAS_WEIGHT, ZERO_CENTERED, HOIST_PARAMS)
            sum_xwdy += tl.sum(tail_xhat * tail_wdy, axis=1)
            sum_wdy += tl.sum(tail_wdy, axis=1)
        c1 = sum_xwdy / N
        c2 = sum_wdy / N
        _store_dx(xhat, wdy, rstd, c1, c2, DX, DZ, rows64, cols, mask, N, stride_dz, IS_RMS, HAS_DZ)
        dw_acc, db_acc = _accumulate(dw_acc, db_acc, dy, xhat, HAS_WEIGHT, HAS_BIAS)
        if TAIL_N > 0:
            _store_dx(tail_xhat, tail_wdy, rstd, c1, c2, DX, DZ, rows64, tail_cols, tail_tile_mask, N, stride_dz,
                      IS_RMS, HAS_DZ)
            tail_dw, tail_db = _accumulate(tail_dw, tail_db, tail_dy, tail_xhat, HAS_WEIGHT, HAS_BIAS)
    _store_grads(dw_acc, db_acc, DW_OUT, DB_OUT, pid, cols, col_mask, N, HAS_WEIGHT, HAS_BIAS, DIRECT_GRADS)
    if TAIL_N > 0:
        _store_grads(tail_dw, tail_db, DW_OUT, DB_OUT, pid, tail_cols, tail_mask, N, HAS_WEIGHT, HAS_BIAS,
                     DIRECT_GRADS)


@triton.jit
def _store_grads(dw_acc, db_acc, DW_OUT, DB_OUT, pid, cols, col_mask, N, HAS_WEIGHT: tl.constexpr,
                 HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr):
    """Program `pid`'s dgamma/dbeta sums of columns `cols`: its row of the partial buffer DW_OUT, or
    (DIRECT, the only program) dgamma and dbeta themselves, rounded once from fp32 to their dtype as
    `column_sum_kernel` does."""
    if DIRECT:
        if HAS_WEIGHT:
            tl.store(DW_OUT + cols, tl.sum(dw_acc, axis=0).to(DW_OUT.dtype.element_ty), mask=col_mask)
        if HAS_BIAS:
            tl.store(DB_OUT + cols, tl.sum(db_acc, axis=0).to(DB_OUT.dtype.element_ty), mask=col_mask)
    else:
        _store_partials(dw_acc, db_acc, DW_OUT, pid, cols, col_mask, N, HAS_WEIGHT, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def row_sums_kernel(SRC, DY, W, MEAN, RSTD, ROW_SUMS, PARTIAL, stride_src, stride_dy, M, N,
                    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    ZERO_CENTERED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    NUM_STAGES: tl.constexpr, HOIST_PARAMS: tl.constexpr):
    """Split backward, pass 1. Program (t, g) takes column tile t of row groups g, g + G, ...: per row
    it writes the tile's sums of xhat*w*dy and w*dy (LayerNorm) to ROW_SUMS[0|1, row, t]; it keeps the
    tile's dgamma/dbeta sums in registers and writes them as row g of the partial buffer."""
    tile, group, cols, col_mask = _column_tile(N, BLOCK_N)
    w, dw_acc, db_acc = _program_state(W, cols, col_mask, HAS_WEIGHT, ZERO_CENTERED, HOIST_PARAMS, BLOCK_M, BLOCK_N)
    num_tiles = tl.num_programs(0)
    for block in tl.range(group, tl.cdiv(M, BLOCK_M), tl.num_programs(1), num_stages=NUM_STAGES):
        rows64, row_mask, mask = _tile_rows(block, col_mask, M, BLOCK_M)
        xhat, dy, wdy, rstd = _row_tile(SRC, DY, W, w, MEAN, RSTD, rows64, row_mask, mask, cols, col_mask,
                                        stride_src, stride_dy, IS_RMS, HAS_WEIGHT, ZERO_CENTERED, HOIST_PARAMS)
        sums_at = ROW_SUMS + rows64 * num_tiles + tile
        tl.store(sums_at, tl.sum(xhat * wdy, axis=1), mask=row_mask)
        if not IS_RMS:
            # tl.cast, not M.to: Inductor's write analysis (torch 2.11) compiles the kernel with its scalar
            # arguments as Python constants, which have no .to (dx_kernel's load too)
            tl.store(sums_at + tl.cast(M, tl.int64) * num_tiles, tl.sum(wdy, axis=1), mask=row_mask)
        dw_acc, db_acc = _accumulate(dw_acc, db_acc, dy, xhat, HAS_WEIGHT, HAS_BIAS)
    _store_partials(dw_acc, db_acc, PARTIAL, group, cols, col_mask, N, HAS_WEIGHT, HAS_BIAS)


@triton.jit(do_not_specialize=["M"])
def dx_kernel(SRC, DY, DZ, W, MEAN, RSTD, ROW_SUMS, DX, stride_src, stride_dy, stride_dz, M, N,
              NUM_SUM_TILES, IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_DZ: tl.constexpr,
              ZERO_CENTERED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              SUM_TILES: tl.constexpr):
    """Split backward, pass 2: one [BLOCK_M, BLOCK_N] tile of dx, the rows' sums added up from
    ROW_SUMS in a fixed order (SUM_TILES = next_pow2(NUM_SUM_TILES))."""
    col_tiles = tl.cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    cols = (pid % col_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    rows64, row_mask, mask = _tile_rows(pid // col_tiles, col_mask, M, BLOCK_M)
    xhat, dy, wdy, rstd = _row_tile(SRC, DY, W, 1.0, MEAN, RSTD, rows64, row_mask, mask, cols, col_mask, stride_src,
                                    stride_dy, IS_RMS, HAS_WEIGHT, ZERO_CENTERED, False)
    tiles = tl.arange(0, SUM_TILES)
    sums_at = ROW_SUMS + rows64[:, None] * NUM_SUM_TILES + tiles[None, :]
    sums_mask = row_mask[:, None] & (tiles < NUM_SUM_TILES)[None, :]
    c1 = tl.sum(tl.load(sums_at, mask=sums_mask, other=0.0), axis=1) / N
    if IS_RMS:
        c2 = c1
    else:
        c2 = tl.sum(tl.load(sums_at + tl.cast(M, tl.int64) * NUM_SUM_TILES, mask=sums_mask, other=0.0), axis=1) / N
    _store_dx(xhat, wdy, rstd, c1, c2, DX, DZ, rows64, cols, mask, N, stride_dz, IS_RMS, HAS_DZ)


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


def norm_bwd(dy, dz, src, weight, mean, rstd, has_bias: bool, rms: bool, zero_centered: bool):
    """Launch the backward on 2-D tensors. Returns dx (src's dtype) and dweight, dbias in the
    weight's dtype (fp32 without a weight), reduced in fp32; None where there is no weight / bias."""
    device = src.device
    if device.type == "cuda" and device.index != torch.cuda.current_device():  # another GPU is current: launch.py
        with torch.cuda.device(device):
            return norm_bwd(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered)
    n = src.shape[1]
    kernels = config.specialized(device) if n >= config.MIN_LONG_N_BWD else ""  # short rows: one pass either way
    plan = _plan(n, weight.dtype if weight is not None else None, has_bias, dz is not None, rms, zero_centered,
                 device, kernels)
    return plan(dy, dz, src, weight, mean, rstd)


def norm_bwd_traced(dy, dz, src, weight, mean, rstd, has_bias: bool, rms: bool, zero_centered: bool):
    """`norm_bwd` as torch.compile traces it (fake or functional CUDA tensors): the same plan's outputs allocated
    with torch ops and its kernels recorded through `torch.library.wrap_triton`, so that Inductor launches them.
    None where the plan is the staged backward (a cooperative Gluon launch with a persistent exchange buffer,
    chosen per call by the tensors' alignment, which a trace does not know): the caller then records an opaque
    call of the launchers instead."""
    n = int(src.shape[1])  # a symbolic N specialized: plans are per N
    kernels = config.specialized(src.device) if n >= config.MIN_LONG_N_BWD else ""
    plan = _plan(n, weight.dtype if weight is not None else None, has_bias, dz is not None, rms, zero_centered,
                 src.device, kernels)
    if isinstance(plan.cfg, config.StagedConfig):
        if src.element_size() == 2 and dy.element_size() == 2:
            return None
        plan = plan.portable()  # what the staged plan hands these rows to
    return plan.traced(dy, dz, src, weight, mean, rstd)


def _stageable(src, dy, weight) -> bool:
    """What the staged backward needs of a call: x and dy its copies take (`config.staged_rows`), a
    16-byte aligned weight (it is copied too)."""
    return config.staged_rows(src, dy) and config.staged_params(weight)


@functools.lru_cache(maxsize=None)
def _plan(n: int, weight_dtype, has_bias: bool, has_dz: bool, rms: bool, zero_centered: bool, device,
          kernels: str = "") -> "_BwdPlan":
    return _BwdPlan(n, weight_dtype, has_bias, has_dz, rms, zero_centered, device, kernels)


class _BwdPlan:
    """A backward's launches for one N, weight dtype, variant and device, chosen once so that a call does only
    what depends on the tensors (host time: docs/performance.md). kernels: `config.specialized(device)`; a
    staged plan hands the calls its copies cannot take (`_stageable`) to the portable plan of the same shape."""

    def __init__(self, n, weight_dtype, has_bias, has_dz, rms, zero_centered, device, kernels):
        has_weight = weight_dtype is not None
        self.n = n
        self.has_bias, self.row_sum_kinds = has_bias, 1 if rms else 2  # LayerNorm: two sums per row
        self.num_grads = int(has_weight) + int(has_bias)
        self.grad_dtype = weight_dtype if has_weight else torch.float32
        param_size = weight_dtype.itemsize if has_weight else 2
        self.cfg = config.bwd_config(n, self.num_grads, param_size, rms, kernels)
        if isinstance(self.cfg, config.StagedConfig) and kernels != "staged":  # a forced config (tests, sweeps)
            self.cfg = config.BWD_SPLIT
        self.sms = config.sm_count(device)
        flags = dict(IS_RMS=rms, HAS_WEIGHT=has_weight, ZERO_CENTERED=zero_centered)
        if isinstance(self.cfg, config.StagedConfig):
            from .norm_bwd_staged import EXCHANGE_RING, exchange_words, stage_weight, staged_slices_bwd_kernel

            cfg = self.cfg
            self.portable = functools.partial(_plan, n, weight_dtype, has_bias, has_dz, rms, zero_centered, device,
                                              "")
            self.slices = config.cdiv(n, cfg.slice_n)
            self.exchange_words = exchange_words
            self.staged = Launcher(staged_slices_bwd_kernel, cfg.num_warps, cooperative=True, derived=(6, 7),
                                   HAS_BIAS=has_bias, HAS_DZ=has_dz, VEC=cfg.vec, CHUNKS=cfg.slice_n // cfg.chunk,
                                   STAGE_W=stage_weight(cfg.slice_n, cfg.chunk,
                                                        weight_dtype.itemsize if has_weight else 0, cfg.slots),
                                   SLICES=config.next_pow2(self.slices), RING=EXCHANGE_RING, SLOTS=cfg.slots, **flags)
        elif isinstance(self.cfg, config.SplitBwdConfig):
            sums, dx = self.cfg.row_sums, self.cfg.dx
            self.sum_tiles = config.cdiv(n, sums.block_n)
            self.row_sums = Launcher(row_sums_kernel, sums.num_warps, derived=(5, 6, 10), HAS_BIAS=has_bias,
                                     BLOCK_M=sums.block_m, BLOCK_N=sums.block_n, NUM_STAGES=sums.num_stages,
                                     HOIST_PARAMS=sums.hoist_params, **flags)
            self.dx = Launcher(dx_kernel, dx.num_warps, derived=(6, 7, 12, 13), HAS_DZ=has_dz, BLOCK_M=dx.block_m,
                               BLOCK_N=dx.block_n, SUM_TILES=config.next_pow2(self.sum_tiles), **flags)
        else:
            cfg = self.cfg
            fused = dict(derived=(6, 7, 8, 13), HAS_BIAS=has_bias, HAS_DZ=has_dz,
                         BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TAIL_N=cfg.tail_n, NUM_STAGES=cfg.num_stages,
                         HOIST_PARAMS=cfg.hoist_params, **flags)
            self.fused = Launcher(norm_bwd_kernel, cfg.num_warps, DIRECT_GRADS=False, **fused)
            self.direct = Launcher(norm_bwd_kernel, cfg.num_warps, DIRECT_GRADS=True, **fused)
        self.split = isinstance(self.cfg, config.SplitBwdConfig)
        self.staged_cfg = isinstance(self.cfg, config.StagedConfig)
        self.one_pass = isinstance(self.cfg, config.TileConfig)
        self.grids = {}  # M -> _grid(M), host time per call (bounded: MAX_CACHED_M)
        block_k = config.column_sum_block(self.num_grads * n, self.sms)
        self.column_programs = config.cdiv(self.num_grads * n, block_k)
        self.column_sum = Launcher(column_sum_kernel, 4, derived=(0, 1, 2, 4, 5), BLOCK_P=16, BLOCK_K=block_k)

    def _grid(self, M):
        """(programs, dx tiles, direct) for M rows; direct: one program writes dgamma/dbeta itself
        (`config.direct_grads`), no partial buffer and no column sum."""
        N = self.n
        if self.one_pass and self.num_grads and config.direct_grads(self.cfg, M, N):
            return 1, 0, True
        dx_tiles = config.cdiv(M, self.cfg.dx.block_m) * config.cdiv(N, self.cfg.dx.block_n) if self.split else 0
        return config.partial_rows(self.cfg, M, N, self.sms), dx_tiles, False

    def __call__(self, dy, dz, src, weight, mean, rstd):
        M, N = src.shape
        staged = self.staged_cfg
        if staged and not (M and _stageable(src, dy, weight)):
            return self.portable()(dy, dz, src, weight, mean, rstd)  # (no rows: zero partials there)
        dx = torch.empty_like(src)  # src is [M, N] with unit column stride: dense means contiguous
        num_grads = self.num_grads
        partial_rows, dx_tiles, direct = config.per_m(self.grids, M, self._grid)
        # dgamma, dbeta: separate tensors (an op's outputs may not alias); src.new_empty: no torch.device per call
        dweight = src.new_empty(N, dtype=self.grad_dtype) if weight is not None else None
        dbias = src.new_empty(N, dtype=self.grad_dtype) if self.has_bias else None
        partial = src.new_empty((partial_rows, num_grads * N), dtype=torch.float32) if num_grads and not direct \
            else None
        dz_stride = dz.stride()[0] if dz is not None else 0
        if staged:
            device = src.device
            exchange = self.exchange_words(device, torch.cuda.current_stream(device).cuda_stream, self.sms)
            self.staged((self.slices, partial_rows), src, dy, dz, weight, mean, rstd, dx, partial, exchange,
                        src.stride()[0], dy.stride()[0], dz_stride, M, N)
        elif self.split:
            row_sums = src.new_empty((self.row_sum_kinds, M, self.sum_tiles), dtype=torch.float32)
            if M or num_grads:
                self.row_sums((self.sum_tiles, partial_rows), src, dy, weight, mean, rstd, row_sums, partial,
                              src.stride()[0], dy.stride()[0], M, N)
            if M:
                self.dx((dx_tiles,), src, dy, dz, weight, mean, rstd, row_sums, dx, src.stride()[0], dy.stride()[0],
                        dz_stride, M, N, self.sum_tiles)
        elif M or num_grads:
            launch, grads = (self.direct, (dweight, dbias)) if direct else (self.fused, (partial, partial))
            launch((partial_rows,), src, dy, dz, weight, mean, rstd, dx, *grads, src.stride()[0],
                   dy.stride()[0], dz_stride, M, N)
        if not num_grads or direct:
            return dx, dweight, dbias
        # with no weight the partial columns hold dbeta only, so OUT_W gets them
        out_w = dweight if weight is not None else dbias
        self.column_sum((self.column_programs,), partial, out_w, out_w if dbias is None else dbias, partial_rows, N,
                        num_grads * N)
        return dx, dweight, dbias

    def traced(self, dy, dz, src, weight, mean, rstd):
        """`__call__`'s portable launches through `Launcher.traced` (M may be symbolic: no per-M cache). Arguments
        a kernel does not write are never outputs of another launch in it: the fused backward's DB_OUT is None
        unless it stores dbias itself, and the column sum's OUT_B a buffer of its own where there is one grad
        (Inductor copies every written argument, and two written arguments must not alias)."""
        M, N = src.shape
        device = src.device
        num_grads = self.num_grads
        dx = torch.empty_like(src)
        partial_rows, dx_tiles, direct = self._grid(M)
        dweight = torch.empty(N, dtype=self.grad_dtype, device=device) if weight is not None else None
        dbias = torch.empty(N, dtype=self.grad_dtype, device=device) if self.has_bias else None
        partial = torch.empty((partial_rows, num_grads * N), dtype=torch.float32, device=device) \
            if num_grads and not direct else None
        dz_stride = dz.stride()[0] if dz is not None else 0
        if self.split:
            row_sums = torch.empty((self.row_sum_kinds, M, self.sum_tiles), dtype=torch.float32, device=device)
            if M or num_grads:
                self.row_sums.traced((self.sum_tiles, partial_rows), src, dy, weight, mean, rstd, row_sums, partial,
                                     src.stride()[0], dy.stride()[0], M, N)
            if M:
                self.dx.traced((dx_tiles,), src, dy, dz, weight, mean, rstd, row_sums, dx, src.stride()[0],
                               dy.stride()[0], dz_stride, M, N, self.sum_tiles)
        elif M or num_grads:
            launch, grads = (self.direct, (dweight, dbias)) if direct else (self.fused, (partial, None))
            launch.traced((partial_rows,), src, dy, dz, weight, mean, rstd, dx, *grads, src.stride()[0],
                          dy.stride()[0], dz_stride, M, N)
        if not num_grads or direct:
            return dx, dweight, dbias
        out_w, out_b = (dweight, dbias) if num_grads == 2 else (dweight if weight is not None else dbias, None)
        if out_b is None:
            out_b = torch.empty(0, dtype=out_w.dtype, device=device)
        self.column_sum.traced((self.column_programs,), partial, out_w, out_b, partial_rows, N, num_grads * N)
        return dx, dweight, dbias
