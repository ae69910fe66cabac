"""Forward kernel of the norm family (LayerNorm and RMSNorm, weight, bias, residual add and zero-centered gamma
through constexpr switches; fp32 math) and its launcher. With a residual, z = x + residual is rounded to z's
dtype and stored first, and the norm is taken of that rounded z, so that the backward (which re-reads z) sees
the forward's input.
"""

import functools

import torch
import triton
import triton.language as tl

from . import config
from .launch import Launcher


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
def _load_params(W, B, cols, col_mask, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ZERO_CENTERED: tl.constexpr):
    """Weight (+ 1 when zero-centered) and bias of columns `cols` in fp32; 1 and 0 where absent."""
    w = 1.0
    b = 0.0
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0).to(tl.float32)
    return w, b


@triton.jit
def _store_normalized(x, mean, rstd, W, B, w, b, Y, rows64, cols, col_mask, mask, stride_y,
                      IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                      ZERO_CENTERED: tl.constexpr, PARAMS_LOADED: tl.constexpr):
    """y of one tile. Without PARAMS_LOADED the weight and bias (w, b) are read here, after the
    row reductions, so they are not live in registers across them."""
    if not PARAMS_LOADED:
        w, b = _load_params(W, B, cols, col_mask, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED)
    if IS_RMS:
        y = x * rstd[:, None]
    else:
        y = (x - mean[:, None]) * rstd[:, None]
    if HAS_WEIGHT:
        y = y * w[None, :]
    if HAS_BIAS:
        y = y + b[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _normalize_rows(X, RES, W, B, Y, Z, MEAN, RSTD, block, cols, col_mask, w, b, tail_cols, tail_mask, tail_w, tail_b,
                    stride_x, stride_res, M, N, eps,
                    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_M: tl.constexpr,
                    TAIL_N: tl.constexpr, PARAMS_LOADED: tl.constexpr):
    """One pass over row block `block`: statistics, then y. The row is the tile `cols` and, with
    TAIL_N, the narrower tile `tail_cols` after it (N = 5120 as 4096 + 1024 instead of 8192)."""
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)
    mask = row_mask[:, None] & col_mask[None, :]
    x = _load_src(X, RES, Z, rows64, cols, mask, stride_x, stride_res, N, HAS_RESIDUAL, True)
    total = tl.sum(x * x if IS_RMS else x, axis=1)
    if TAIL_N > 0:
        tail_tile_mask = row_mask[:, None] & tail_mask[None, :]
        x_tail = _load_src(X, RES, Z, rows64, tail_cols, tail_tile_mask, stride_x, stride_res, N, HAS_RESIDUAL, True)
        total += tl.sum(x_tail * x_tail if IS_RMS else x_tail, axis=1)
    if IS_RMS:
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        var = total / N
    else:
        mean = total / N
        centered = tl.where(mask, x - mean[:, None], 0.0)
        m2 = tl.sum(centered * centered, axis=1)
        if TAIL_N > 0:
            centered = tl.where(tail_tile_mask, x_tail - mean[:, None], 0.0)
            m2 += tl.sum(centered * centered, axis=1)
        var = m2 / N
    rstd = 1.0 / tl.sqrt(var + eps)
    _store_normalized(x, mean, rstd, W, B, w, b, Y, rows64, cols, col_mask, mask, N,
                      IS_RMS, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED, PARAMS_LOADED)
    if TAIL_N > 0:
        _store_normalized(x_tail, mean, rstd, W, B, tail_w, tail_b, Y, rows64, tail_cols, tail_mask, tail_tile_mask,
                          N, IS_RMS, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED, PARAMS_LOADED)
    _store_stats(MEAN, RSTD, rows64, row_mask, mean, rstd, IS_RMS)


@triton.jit(do_not_specialize=["M"])
def norm_fwd_kernel(X, RES, W, B, Y, Z, MEAN, RSTD,
                    stride_x, stride_res, M, N, eps,
                    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_RESIDUAL: tl.constexpr, ZERO_CENTERED: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TAIL_N: tl.constexpr,
                    SINGLE_PASS: tl.constexpr, NUM_STAGES: tl.constexpr, PERSISTENT: tl.constexpr):
    # eps in fp32 whatever its type here: Triton's launcher passes a Python float as fp32, Inductor's generated
    # launch (the compiled ops) as fp64, which would carry the statistics and y into fp64
    eps = tl.cast(eps, tl.float32)
    if SINGLE_PASS:
        cols = tl.arange(0, BLOCK_N)
        col_mask = cols < N
        tail_cols = cols  # stand-ins, unused without a tail tile
        tail_mask = col_mask
        if TAIL_N > 0:
            tail_cols = BLOCK_N + tl.arange(0, TAIL_N)
            tail_mask = tail_cols < N
        if PERSISTENT:
            # Programs walk the row blocks grid-stride with the weight and bias in registers: read
            # once per program, not once per row block (fp32 parameters are twice a bf16 row's
            # own traffic). Otherwise straight-line code: the loop alone costs registers.
            w, b = _load_params(W, B, cols, col_mask, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED)
            tail_w, tail_b = w, b
            if TAIL_N > 0:
                tail_w, tail_b = _load_params(W, B, tail_cols, tail_mask, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED)
            for block in tl.range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0), num_stages=NUM_STAGES):
                _normalize_rows(X, RES, W, B, Y, Z, MEAN, RSTD, block, cols, col_mask, w, b, tail_cols, tail_mask,
                                tail_w, tail_b, stride_x, stride_res, M, N, eps, IS_RMS, HAS_WEIGHT, HAS_BIAS,
                                HAS_RESIDUAL, ZERO_CENTERED, BLOCK_M, TAIL_N, True)
        else:
            _normalize_rows(X, RES, W, B, Y, Z, MEAN, RSTD, tl.program_id(0), cols, col_mask, 1.0, 0.0, tail_cols,
                            tail_mask, 1.0, 0.0, stride_x, stride_res, M, N, eps, IS_RMS, HAS_WEIGHT, HAS_BIAS,
                            HAS_RESIDUAL, ZERO_CENTERED, BLOCK_M, TAIL_N, False)
    else:
        # One row block per program. Pass 1: statistics chunk by chunk (Chan's parallel merge of
        # per-chunk mean/M2, stable for large N and large means); z is written here. Pass 2:
        # normalize, walking the chunks backwards so the most recently read ones, the likeliest
        # still in L2, are read again first.
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)
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
        last = (tl.cdiv(N, BLOCK_N) - 1) * BLOCK_N
        for back in tl.range(0, N, BLOCK_N, num_stages=NUM_STAGES):
            cols = (last - back) + tl.arange(0, BLOCK_N)
            col_mask = cols < N
            mask = row_mask[:, None] & col_mask[None, :]
            x = _load_src(X, RES, Z, rows64, cols, mask, stride_x, stride_res, N, HAS_RESIDUAL, False)
            _store_normalized(x, mean, rstd, W, B, 1.0, 0.0, Y, rows64, cols, col_mask, mask, N,
                              IS_RMS, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED, False)
        _store_stats(MEAN, RSTD, rows64, row_mask, mean, rstd, IS_RMS)


@triton.jit
def _store_stats(MEAN, RSTD, rows64, row_mask, mean, rstd, IS_RMS: tl.constexpr):
    if not IS_RMS:
        tl.store(MEAN + rows64, mean, mask=row_mask)
    tl.store(RSTD + rows64, rstd, mask=row_mask)


def norm_fwd(x, weight, bias, residual, eps: float, rms: bool, zero_centered: bool):
    """Launch the forward kernel on 2-D x [M, N] (last dim contiguous). Returns y, z, mean, rstd;
    z is None without a residual, mean None for RMSNorm."""
    device = x.device
    if device.type == "cuda" and device.index != torch.cuda.current_device():  # another GPU is current: launch.py
        with torch.cuda.device(device):
            return norm_fwd(x, weight, bias, residual, eps, rms, zero_centered)
    n = x.shape[1]
    param = weight if weight is not None else bias
    kernels = config.specialized(device) if n > config.MAX_FUSED_N_FWD else ""
    plan = _plan(n, param.element_size() if param is not None else 2, weight is not None, bias is not None,
                 residual is not None, rms, zero_centered, device, kernels)
    return plan(x, weight, bias, residual, eps)


def norm_fwd_traced(x, weight, bias, residual, eps: float, rms: bool, zero_centered: bool):
    """`norm_fwd` as torch.compile traces it (x a fake or functional CUDA tensor): the same plan's outputs allocated
    with torch ops and its kernel recorded through `torch.library.wrap_triton`, so that Inductor launches it. None
    where the plan may take the staged forward (a Gluon kernel, chosen per call by the tensors' alignment, which
    a trace does not know): the caller then records an opaque call of the launchers instead."""
    n = int(x.shape[1])  # a symbolic N specialized: plans are per N
    param = weight if weight is not None else bias
    kernels = config.specialized(x.device) if n > config.MAX_FUSED_N_FWD else ""
    plan = _plan(n, param.element_size() if param is not None else 2, weight is not None, bias is not None,
                 residual is not None, rms, zero_centered, x.device, kernels)
    if plan.staged is not None and x.element_size() == 2:  # other rows never take it
        return None
    return plan.traced(x, weight, bias, residual, eps)


def _stageable_params(weight, bias) -> bool:
    """What the staged forward's parameter copies need: 16-byte aligned addresses (`config.staged_params`), and
    a bias as wide as the weight (the plan sizes shared memory by the weight's width)."""
    return config.staged_params(weight, bias) and \
        (weight is None or bias is None or weight.element_size() == bias.element_size())


# Y, Z, MEAN, RSTD: allocated by _FwdPlan, dtypes fixed by x, residual and the plan; N and eps: fixed by the plan
_UNKEYED = (4, 5, 6, 7, 11, 12)


@functools.lru_cache(maxsize=None)
def _plan(n: int, param_size: int, has_weight: bool, has_bias: bool, has_residual: bool, rms: bool,
          zero_centered: bool, device, kernels: str = "") -> "_FwdPlan":
    return _FwdPlan(n, param_size, has_weight, has_bias, has_residual, rms, zero_centered, device, kernels)


class _FwdPlan:
    """The forward's launch for one N, parameter size, variant and device, chosen once (as `_BwdPlan`). "staged"
    kernels add the staged forward above MAX_FUSED_N_FWD for the calls its copies can take."""

    def __init__(self, n, param_size, has_weight, has_bias, has_residual, rms, zero_centered, device, kernels=""):
        self.rms = rms
        self.cfg = cfg = config.fwd_config(n, param_size, has_bias)
        self.sms = config.sm_count(device)
        self.programs = {}  # M -> programs to launch, host time per call (bounded: MAX_CACHED_M)
        self.kernel = Launcher(norm_fwd_kernel, cfg.num_warps, derived=_UNKEYED, IS_RMS=rms,
                               HAS_WEIGHT=has_weight, HAS_BIAS=has_bias, HAS_RESIDUAL=has_residual,
                               ZERO_CENTERED=zero_centered, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, TAIL_N=cfg.tail_n,
                               SINGLE_PASS=cfg.single_pass, NUM_STAGES=cfg.num_stages,
                               PERSISTENT=cfg.programs_per_sm > 0)
        self.staged = None  # rows too long for registers, staged in shared memory (norm_fwd_staged.py)
        if kernels == "staged" and n > config.MAX_FUSED_N_FWD and n % 16 == 0 and not has_residual:
            from .norm_fwd_staged import fits, param_chunks, staged_fwd_kernel

            staged = config.STAGED_FWD
            if fits(n, staged.chunk, 2):
                held = 0 if rms else param_chunks(n, staged.chunk, 2, param_size, has_weight + has_bias)
                self.staged = Launcher(staged_fwd_kernel, staged.num_warps, derived=(3, 4, 5),
                                       IS_RMS=rms, HAS_WEIGHT=has_weight, HAS_BIAS=has_bias,
                                       ZERO_CENTERED=zero_centered, VEC=staged.vec,
                                       CHUNKS=config.cdiv(n, staged.chunk), PARAM_CHUNKS=held,
                                       HOLD_CHUNK0=not rms and not held and param_size == 2)

    def _programs(self, M):
        return self.cfg.programs(config.cdiv(M, self.cfg.block_m), self.sms)

    def __call__(self, x, weight, bias, residual, eps):
        M, N = x.shape
        # x.new_empty: no torch.device object per call (x.device), fewer arguments to parse than torch.empty
        y = torch.empty_like(x)
        z = x.new_empty((M, N), dtype=torch.result_type(x, residual)) if residual is not None else None
        mean = None if self.rms else x.new_empty(M, dtype=torch.float32)
        rstd = x.new_empty(M, dtype=torch.float32)
        if M and self.staged is not None and config.staged_rows(x) and _stageable_params(weight, bias):
            self.staged((min(M, self.sms),), x, weight, bias, y, mean, rstd, x.stride()[0], M, N, eps)
        elif M:
            programs = config.per_m(self.programs, M, self._programs)
            self.kernel((programs,), x, residual, weight, bias, y, z, mean, rstd, x.stride()[0],
                        residual.stride()[0] if residual is not None else 0, M, N, eps)
        return y, z, mean, rstd

    def traced(self, x, weight, bias, residual, eps):
        """`__call__`'s portable launch through `Launcher.traced` (M may be symbolic: no per-M cache)."""
        M, N = x.shape
        y = torch.empty_like(x)
        z = torch.empty((M, N), dtype=torch.result_type(x, residual), device=x.device) if residual is not None \
            else None
        mean = None if self.rms else torch.empty(M, dtype=torch.float32, device=x.device)
        rstd = torch.empty(M, dtype=torch.float32, device=x.device)
        if M:
            self.kernel.traced((self._programs(M),), x, residual, weight, bias, y, z, mean, rstd, x.stride()[0],
                               residual.stride()[0] if residual is not None else 0, M, N, eps)
        return y, z, mean, rstd
