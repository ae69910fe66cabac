"""Launch heuristics for the norm kernels, all in one place.

Everything here is keyed on the hidden size N (and, for the backward, on how many partial sums it
keeps), never on the number of rows M, so a new batch or sequence length never triggers a Triton
recompilation (M is a runtime argument marked `do_not_specialize`).

- Forward: while a row fits in registers (N <= MAX_FUSED_N_FWD) one pass, BLOCK_M rows of
  next_pow2(N) per program (or 4096 / 8192 columns and a narrower tail tile, `tail_pays`), one
  program per row block; with fp32 parameters, persistent programs that keep them in registers. Above, each row
  is walked twice in BLOCK_N chunks (statistics, then normalize, backwards), one program per row
  block.
- Backward, fused (N <= MAX_FUSED_N_BWD): persistent programs walk the rows grid-stride, each
  keeping its dgamma/dbeta partial sum in registers, then write one fp32 row of the [P, N] partial
  buffer. Its limit depends on how many partial sums (dgamma, dbeta) stay live in registers.
- Backward, split (longer rows): a row-sums pass over [BLOCK_M, BLOCK_N] tiles (per-tile partial
  row sums, and dgamma/dbeta partials per row group in registers), then an elementwise dx pass.
  Two reads of x and dy instead of one, but both passes are register-light and run at copy speed.
- Thread-block clusters (Hopper, Triton >= 3.9, `clusters(device)`): a row too long for one
  program's registers can stay one pass, the program spread over `num_ctas` CTAs of a cluster that
  split the row between their register files (row reductions through distributed shared memory).
  Measured faster than the two reads only for RMSNorm at some sizes (CLUSTER_FWD / CLUSTER_BWD).
- num_warps grows with the tile so each thread holds a bounded number of elements.

`benchmarks/sweep_tiles.py` measures alternatives by replacing `fwd_config` / `bwd_config` here;
`benchmarks/NOTES.md` records what was measured and why these values.
"""

import functools
import os
from dataclasses import dataclass
from typing import Optional, Union

import torch
import triton

# Largest row kept in registers in one pass (elements). Above it the chunked/split paths run.
MAX_FUSED_N_FWD = 32768
MAX_FUSED_N_BWD = {0: 16384, 1: 16384, 2: 8192}  # by the number of partial sums (dgamma, dbeta)
# Grid sizes per row count M a launch plan remembers (a dict lookup instead of a few Python calls per
# call); past it the plan forgets them all (variable-length batches).
MAX_CACHED_M = 4096
# Shortest row that can leave the one-pass backward (the cooperative/split/cluster choice only exists above).
MIN_LONG_N_BWD = min(MAX_FUSED_N_BWD.values()) + 1
# SM count used where there is no CUDA device (TRITON_INTERPRET on CPU tensors).
INTERPRETER_SM_COUNT = 8
# The tables were measured with Triton 3.6 (torch 2.11 on the GPU machine); 3.9 compiles some tiles
# differently, and only it compiles our kernels for thread-block clusters (NOTES.md v8).
TRITON_3_9 = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 9)


def cdiv(a: int, b: int) -> int:
    """Plain-int ceil division (triton.cdiv is a constexpr function: microseconds per host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def row_tiles(n: int) -> tuple[int, int]:
    """(block_n, tail_n) holding a one-pass row: next_pow2(N), or a power of two and a narrower one
    after it where that leaves fewer idle lanes (5120: 4096 + 1024, not 8192; 14336 stays 16384)."""
    whole = next_pow2(n)
    if n <= 2048 or n == whole:
        return whole, 0
    main = whole // 2
    tail = next_pow2(n - main)
    return (main, tail) if main + tail < whole else (whole, 0)


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    single_pass: bool = True
    programs_per_sm: int = 0  # persistent programs per SM; 0: one program per tile
    num_stages: int = 1  # software-pipelining depth of the row-block and chunk loops
    hoist_params: bool = False  # backward: weight in registers across row blocks (a persistent forward always)
    tail_n: int = 0  # one pass: a second, narrower tile after block_n (5120 = 4096 + 1024)
    num_ctas: int = 1  # CTAs per program (a thread-block cluster), the row split between them

    def programs(self, blocks: int, sm_count: int) -> int:
        """Programs to launch for `blocks` row blocks: one per block, or when persistent
        `programs_per_sm` CTAs on every SM (clusters of num_ctas of them), at most one per block."""
        if not self.programs_per_sm:
            return blocks
        return max(1, min(blocks, sm_count * self.programs_per_sm // self.num_ctas))


@dataclass(frozen=True)
class SplitBwdConfig:
    """The two passes of the split backward; `row_sums.programs_per_sm` sizes its grid of column
    tiles x row groups, so it sets how many dgamma/dbeta partial rows there are."""
    row_sums: TileConfig
    dx: TileConfig


@dataclass(frozen=True)
class CoopBwdConfig:
    """The cooperative backward (`norm_bwd_coop.py`): column slices of slice_n columns, block_m rows
    per exchange, `programs_per_sm` resident programs per SM in all (slices x row groups);
    lookahead: 0 each block waits for its own sums, 1 the next block's sums are published before
    this one's wait, 2 the next block's loads are in flight during the wait (norm_bwd_coop.py); cooperative: launch
    through the driver's cooperative launch, which refuses a grid that cannot be resident at once
    (instead of a hang)."""
    slice_n: int
    block_m: int
    num_warps: int
    programs_per_sm: int = 1
    lookahead: int = 2
    cooperative: bool = True


@dataclass(frozen=True)
class StagedConfig:
    """The staged kernels (`norm_bwd_staged.py`, `norm_fwd_staged.py`, Gluon): one persistent program per SM
    holds whole rows in shared memory, copied in chunks of vec x 32 x num_warps elements (vec: elements per
    16-byte copy). Backward (`staged_slices_bwd_kernel`): rows split into slices of slice_n columns, one
    program each, in `slots` row slots (3: the next row's sums published before this row's are awaited),
    exchanging their row sums; one slice (N <= slice_n): whole rows, the next row's copies a row ahead. The
    forward (slice_n 0) stages whole rows."""
    num_warps: int
    vec: int = 8
    slice_n: int = 0
    slots: int = 2

    @property
    def chunk(self) -> int:
        """Columns per chunk: one vec-element copy per thread."""
        return self.vec * 32 * self.num_warps


def staged_rows(*rows: torch.Tensor) -> bool:
    """Whether the staged kernels' 16-byte copies can take these [M, N] tensors: 2-byte elements (they size
    shared memory for them), row strides and addresses multiples of 16 (Triton must know it to compile
    16-byte copies)."""
    return all(t.element_size() == 2 and not (t.stride()[0] & 15 or t.data_ptr() & 15) for t in rows)


def staged_params(*params: Optional[torch.Tensor]) -> bool:
    """Whether the staged kernels can copy these parameters (absent ones aside): 16-byte aligned addresses."""
    return all(p is None or not p.data_ptr() & 15 for p in params)


BwdConfig = Union[TileConfig, SplitBwdConfig, CoopBwdConfig, StagedConfig]

# Large-N paths, from the H100 sweeps (benchmarks/NOTES.md, v5, v7). fp32 weight and bias are read
# again for every chunk; two rows per tile halve that (LayerNorm fp32 32768: 61% -> 75% of copy).
FWD_CHUNKED = TileConfig(block_m=1, block_n=16384, num_warps=32, single_pass=False)
FWD_CHUNKED_FP32_PARAMS = TileConfig(block_m=2, block_n=8192, num_warps=16, single_pass=False, num_stages=2)
BWD_SPLIT = SplitBwdConfig(row_sums=TileConfig(block_m=1, block_n=8192, num_warps=16, programs_per_sm=2, num_stages=3),
                           dx=TileConfig(block_m=1, block_n=4096, num_warps=8))


# Forward with fp32 parameters, one pass, persistent programs holding weight and bias in registers,
# by next_pow2(N): (warps, programs per SM); for LayerNorm with bias, and for any norm at 16384.
# Re-reading fp32 parameters for every row (from L2) was the bottleneck there: H100 A/B of GPU
# time (NOTES.md v7), LayerNorm 8192 +11%, 14336 +20% and 16384 +21% (both were chunked); RMSNorm
# 16384 +2% over the chunked path. RMSNorm 8192 and both norms at 4096 stay one block per program
# (RMSNorm 8192 -7%, LayerNorm 4096 -3% when persistent; RMSNorm 4096 92% vs 99% in the sweep).
PERSISTENT_FWD = {8192: (8, 8), 16384: (16, 4)}


def tail_pays(tail_n: int, param_size: int, has_bias: bool) -> bool:
    """Whether the forward takes a tail tile (H100 GPU-time sweeps and A/B at N = 4608-9216, NOTES.md
    v7): faster for LayerNorm with fp32 weight and bias (+6% to +32%) and for RMSNorm with tails up to
    1024 columns (fp32 +5% to +32%, bf16 0 to +6%); slower for LayerNorm with bf16 parameters (-5% to
    -25%) and RMSNorm with 2048-column tails (-4% to -6%). Longer tails were not measured."""
    if has_bias:
        return param_size >= 4 and tail_n <= 2048
    return tail_n <= 1024


# One pass over a row split across a thread-block cluster of num_ctas CTAs, by next_pow2(N) (and
# parameter bytes), where it beats reading the row twice (H100 sweep of GPU time, NOTES.md v8):
# RMSNorm forward 65536 89% vs 77% of copy (fp32 weight 76% vs 69%), backward 32768 with bf16 weight
# 68% vs 61% (fp32 weight: 42%, 63% at best). Only RMSNorm (`use_clusters`): each cross-CTA reduction
# costs cluster barriers, LayerNorm needs two per row and lost everywhere (backward 16384: 52% vs
# 60%, 32768: 38% vs 61%); so did RMSNorm's backward at 65536 (49% vs 61%).
CLUSTER_FWD = {(65536, 2): TileConfig(block_m=1, block_n=65536, num_warps=8, num_ctas=8),
               (65536, 4): TileConfig(block_m=1, block_n=65536, num_warps=32, programs_per_sm=1, num_ctas=2)}
CLUSTER_BWD = {(32768, 2): TileConfig(block_m=1, block_n=32768, num_warps=8, programs_per_sm=2, num_ctas=8,
                                      hoist_params=True)}


@functools.lru_cache(maxsize=None)
def fwd_config(n: int, param_size: int = 2, has_bias: bool = False, clusters: bool = False) -> TileConfig:
    """param_size: bytes per weight (bias) element; clusters: whether programs may span thread-block
    clusters (`use_clusters`). fp32 weight and bias beside a one-pass row above 16384 columns spill
    in one program: chunked there (H100 sweep, v5)."""
    block_n = next_pow2(n)
    main_n, tail_n = row_tiles(n)
    if TRITON_3_9 and has_bias and param_size == 2:
        # bf16 LayerNorm: the 3.6 choices below run 13-32% slower under 3.9 (H100 sweep of GPU time
        # under 3.9 at 5120, 14336 and 16384, NOTES.md v8): 82% -> 98% of copy, 68% -> 83%, 74% -> 87%.
        if (main_n, tail_n) == (4096, 1024):
            return TileConfig(block_m=1, block_n=4096, num_warps=4, tail_n=1024)
        if block_n == 16384:
            return TileConfig(block_m=1, block_n=16384, num_warps=16, programs_per_sm=2)
    if tail_n and main_n in (4096, 8192) and tail_pays(tail_n, param_size, has_bias):
        return TileConfig(block_m=1, block_n=main_n, num_warps=8, tail_n=tail_n)
    if param_size >= 4 and block_n in PERSISTENT_FWD and (has_bias or block_n == 16384):
        warps, per_sm = PERSISTENT_FWD[block_n]
        return TileConfig(block_m=1, block_n=block_n, num_warps=warps, programs_per_sm=per_sm)
    if n > MAX_FUSED_N_FWD or (n > 16384 and param_size >= 4 and has_bias):
        if clusters and (block_n, param_size) in CLUSTER_FWD:
            return CLUSTER_FWD[block_n, param_size]
        return FWD_CHUNKED_FP32_PARAMS if param_size >= 4 and has_bias else FWD_CHUNKED
    if block_n == 1024 and has_bias:  # one row a program (H100 sweep of GPU time, session 14: 95% vs 93% of copy)
        return TileConfig(block_m=1, block_n=1024, num_warps=4)
    if block_n <= 2048:  # small rows, QK-norm's 64-256 too: 2K-element tiles, 4 warps (H100 sweep)
        return TileConfig(block_m=2048 // block_n, block_n=block_n, num_warps=4)
    return TileConfig(block_m=max(1, 8192 // block_n), block_n=block_n, num_warps=8 if block_n <= 8192 else 16)


# Fused backward tiles by next_pow2(N): (rows per tile, warps, persistent programs per SM, pipeline
# stages). From the H100 sweep of GPU time (benchmarks/NOTES.md, v5): small rows take 2-4K-element
# tiles; from 1K columns up, one or two rows, more warps as the row grows, fewer programs per SM
# as the dgamma/dbeta accumulators fill the registers.
# The fused backward keeps the weight in registers up to this tile (H100 A/B of GPU time, NOTES.md
# v7: fp32 weights at N = 5120 +12% (LayerNorm) / +10% (RMSNorm); at 16384 the registers spill, -34%).
HOIST_PARAMS_MAX_N_BWD = 8192
# RMSNorm with a bf16 weight at 4097-5120 columns: a 4096 tile and a 512- or 1024-column tail instead
# of one 8192 tile (H100 sweeps of GPU time, Triton 3.6 and 3.9, NOTES.md v8: 5120 90-91% vs 76% of
# copy, 4608 87-88% vs 72%); slower for LayerNorm and fp32 weights (v7).
BWD_TAIL_RMS = dict(block_m=1, block_n=4096, num_warps=8, programs_per_sm=2, num_stages=2, hoist_params=True)
FUSED_BWD = {64: (64, 8, 2, 1), 128: (32, 8, 2, 1), 256: (16, 8, 2, 1), 512: (8, 8, 2, 1), 1024: (2, 4, 4, 2),
             2048: (1, 4, 4, 1), 4096: (1, 8, 2, 1), 8192: (1, 16, 1, 1), 16384: (1, 16, 2, 1)}


# Cooperative backward for long rows (NOTES.md v11), by (next_pow2(N), weight bytes, RMSNorm): where
# the H100 sweep (benchmarks/gpu_longrow.py, results/h100-2026-11-23-s9/longrow_run2.md, GPU time, % of
# copy) measured it ahead of the split backward (59-61% at every one of these shapes). 8192-column slices:
# fewer exchanges per byte than 4096 (42-48%); 16384 spills; two rows per exchange spill.
# `SHARDNORM_LONG_BWD=coop` runs COOP_BWD_DEFAULT for every long row (tests, sweeps).
_COOP_LN = CoopBwdConfig(slice_n=8192, block_m=1, num_warps=16)  # LN bf16 14336 62%, 16384 68%, 32768 70%,
#                                                                  65536 67%; fp32 weights 32768 71%
_COOP_RMS = CoopBwdConfig(slice_n=8192, block_m=1, num_warps=32)  # RMS bf16 32768 77%, 65536 73%; fp32 65536 73%
COOP_BWD = {(16384, 2, False): _COOP_LN, (32768, 2, False): _COOP_LN, (65536, 2, False): _COOP_LN,
            (32768, 4, False): _COOP_LN, (32768, 2, True): _COOP_RMS, (65536, 2, True): _COOP_RMS,
            (65536, 4, True): _COOP_RMS}
COOP_BWD_DEFAULT = _COOP_LN
# The staged backward (Gluon), where the row fits (norm_bwd_staged.fits) and a call's rows are 16-byte
# aligned; the plan falls back to COOP_BWD / the split backward otherwise. H100, bf16, % of copy (GPU time,
# results/h100-2026-11-25-s13/staged_sweep and -s14/staged_sweep; the split backward 61% in the same runs, the
# cooperative 62-78% in session 12's):
# - whole rows in two slots, the next row's copies a row ahead (one 16384-column slice, 16 warps: 128
#   registers a thread, where 32 warps spill LayerNorm's dgamma/dbeta sums): LayerNorm 14336 87-88%, 16384 96%.
# - 16384-column slices in three slots, the next row's sums published before this row's are awaited, tagged
#   words for the exchange: LayerNorm 32768 87-88%, 65536 85%, RMSNorm 32768 92-93%, 65536 92-93%. (A kernel
#   with whole rows in one slot, 32 warps, measured RMSNorm 32768 92% in the same runs: removed, session 14.)
# `SHARDNORM_LONG_BWD=staged` runs STAGED_BWD_DEFAULT for every long row it can take.
_STAGED_TWO_SLOTS = StagedConfig(num_warps=16, slice_n=16384)
_STAGED_SLICES = StagedConfig(num_warps=16, slice_n=16384, slots=3)
STAGED_BWD_DEFAULT = _STAGED_SLICES
STAGED_BWD = {(16384, 2, False): _STAGED_TWO_SLOTS, (32768, 2, False): _STAGED_SLICES,
              (65536, 2, False): _STAGED_SLICES, (32768, 2, True): _STAGED_SLICES,
              (65536, 2, True): _STAGED_SLICES}


# The staged forward for rows longer than MAX_FUSED_N_FWD (bf16/fp16 x, N % 16 == 0, no residual): x read
# once instead of twice. SHARDNORM_LONG_FWD=chunked keeps the chunked `tl` forward (benchmarks' A/B).
STAGED_FWD = StagedConfig(num_warps=32)


def staged_fwd(device: torch.device) -> bool:
    """Whether rows longer than MAX_FUSED_N_FWD may take the staged forward on `device`."""
    return staged(device) and os.environ.get("SHARDNORM_LONG_FWD") != "chunked"


def without_staged(coop: str) -> str:
    """The long-row mode to fall back to when the plan cannot run a staged config."""
    return "coop-table" if coop in ("table", "staged") else coop


@functools.lru_cache(maxsize=None)
def bwd_config(n: int, num_partials: int, param_size: int = 2, rms: bool = False,
               clusters: bool = False, coop: str = "") -> BwdConfig:
    """num_partials: dgamma and/or dbeta; param_size: bytes per weight element; rms: RMSNorm (one row
    sum per row, no dbeta); clusters: as in fwd_config; coop: `coop_mode`'s answer ("": never the
    cooperative backward, "table": the staged backward where STAGED_BWD has it, else the cooperative one
    where COOP_BWD has it, "coop-table": COOP_BWD only, "force": the cooperative backward for every long
    row, "staged": the staged one). A staged config the plan cannot run goes back here with
    `without_staged(coop)`."""
    block_n = next_pow2(n)
    main_n, tail_n = row_tiles(n)
    if rms and param_size == 2 and main_n == 4096 and tail_n in (512, 1024):
        return TileConfig(**BWD_TAIL_RMS, tail_n=tail_n)
    if n > MAX_FUSED_N_BWD[num_partials]:
        if coop == "force":
            return COOP_BWD_DEFAULT
        if coop == "staged":
            return STAGED_BWD_DEFAULT
        if coop == "table" and (block_n, param_size, rms) in STAGED_BWD:
            return STAGED_BWD[block_n, param_size, rms]
        if coop and (block_n, param_size, rms) in COOP_BWD:
            return COOP_BWD[block_n, param_size, rms]
        return CLUSTER_BWD.get((block_n, param_size), BWD_SPLIT) if clusters else BWD_SPLIT
    if block_n < 64:  # rows of a few elements: the 64-column tile size
        return TileConfig(block_m=4096 // block_n, block_n=block_n, num_warps=8, programs_per_sm=2)
    block_m, warps, per_sm, stages = FUSED_BWD[block_n]
    return TileConfig(block_m=block_m, block_n=block_n, num_warps=warps, programs_per_sm=per_sm, num_stages=stages,
                      hoist_params=block_n <= HOIST_PARAMS_MAX_N_BWD)


def row_groups(cfg: SplitBwdConfig, m: int, n: int, sm_count: int) -> int:
    """Row groups of the split backward's row-sums pass: enough column tiles x groups to fill
    `programs_per_sm` programs on every SM; each group is one partial row."""
    col_tiles = cdiv(n, cfg.row_sums.block_n)
    wanted = cdiv(sm_count * cfg.row_sums.programs_per_sm, col_tiles)
    return max(1, min(wanted, cdiv(m, cfg.row_sums.block_m)))


def per_m(cache: dict, m: int, make):
    """cache[m], made by make(m) the first time; the cache forgets everything past MAX_CACHED_M entries."""
    value = cache.get(m)
    if value is None:
        if len(cache) >= MAX_CACHED_M:
            cache.clear()
        value = cache[m] = make(m)
    return value


def coop_groups(cfg: CoopBwdConfig, m: int, n: int, sm_count: int) -> int:
    """Row groups G of the cooperative backward: as many as keep all G x C programs resident
    (`programs_per_sm` per SM), at most one per row block, at least one."""
    return max(1, min(sm_count * cfg.programs_per_sm // cdiv(n, cfg.slice_n), cdiv(m, cfg.block_m)))


def coop_fits(cfg: CoopBwdConfig, n: int, sm_count: int, interpreted: bool) -> bool:
    """Whether the cooperative grid can run: all C slices of a row group resident (C <= programs), and
    under the interpreter (which runs programs one at a time) a single slice, which waits on itself."""
    slices = cdiv(n, cfg.slice_n)
    return slices <= sm_count * cfg.programs_per_sm and (not interpreted or slices == 1)


def partial_rows(cfg: BwdConfig, m: int, n: int, sm_count: int) -> int:
    """Rows of the backward's fp32 [P, G*N] dgamma/dbeta partial buffer for M x N: one per row group
    of the split and cooperative backwards, one per persistent program of the fused one (at least
    one: a zero partial row when M == 0; at most one per row block)."""
    if isinstance(cfg, SplitBwdConfig):
        return row_groups(cfg, m, n, sm_count)
    if isinstance(cfg, CoopBwdConfig):
        return coop_groups(cfg, m, n, sm_count)
    if isinstance(cfg, StagedConfig):  # one program per SM (per slice), at most one per row
        return max(1, min(m, sm_count // cdiv(n, cfg.slice_n) if cfg.slice_n else sm_count))
    return cfg.programs(cdiv(m, cfg.block_m), sm_count)


# One-pass backwards of at most this many elements (M * N) take every row in one program, which
# stores dgamma/dbeta itself: no fp32 partial buffer and no column-sum launch, i.e. an allocation and
# a launch less of host time, the whole cost at such sizes (issue 22; NOTES.md v15). One program
# walking 8 x 4096 bf16 (128 KB of x and dy) is a few us of GPU time.
DIRECT_GRADS_MAX_ELEMENTS = 32768


def direct_grads(cfg: BwdConfig, m: int, n: int) -> bool:
    """Whether the backward of M x N under `cfg` runs as one program that writes dgamma/dbeta
    directly: one-pass tiles (not a thread-block cluster) and at most DIRECT_GRADS_MAX_ELEMENTS."""
    return isinstance(cfg, TileConfig) and cfg.num_ctas == 1 and m * n <= DIRECT_GRADS_MAX_ELEMENTS


@functools.lru_cache(maxsize=None)
def column_sum_block(k: int, sms: int) -> int:
    """Column tile of the dgamma/dbeta reduction over a [P, k] buffer: narrow for narrow buffers,
    so the reduction spreads over enough programs."""
    return min(256, max(32, next_pow2(cdiv(k, 2 * sms))))


def coop_mode(device: torch.device) -> str:
    """How long rows choose the cooperative backward on `device`: "" where it cannot run, else
    "force" when SHARDNORM_LONG_BWD=coop (benchmarks, and the test suite on a GPU), "staged" when
    SHARDNORM_LONG_BWD=staged and the staged backward can run, else "table"."""
    if not cooperative(device):
        return ""
    forced = os.environ.get("SHARDNORM_LONG_BWD")
    if forced == "staged":
        return "staged" if staged(device) else "table"
    return "force" if forced == "coop" else "table"


@functools.lru_cache(maxsize=None)
def staged(device: torch.device) -> bool:
    """Whether long rows may take the staged kernels: NVIDIA Hopper (sm_90, where they were measured and
    where the 227 KB of shared memory per block they size rows by exists; sm_80's 164 KB and sm_89's 99 KB
    would not hold them) with Gluon importable. Never on CPU tensors: Gluon does not run under the
    interpreter."""
    if device.type != "cuda" or torch.version.hip is not None or torch.cuda.get_device_capability(device) != (9, 0):
        return False
    try:
        from . import norm_bwd_staged  # noqa: F401
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def cooperative(device: torch.device) -> bool:
    """Whether long rows may take the cooperative backward on `device`: a CUDA GPU whose driver
    launches cooperative grids (Triton's `launch_cooperative_grid`). Never under the interpreter
    (CPU tensors), where a program waiting on another that has not run yet would hang."""
    return device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 7


def use_clusters(device: torch.device, rms: bool) -> bool:
    """Whether a norm's long rows take the cluster configs: RMSNorm only (CLUSTER_FWD above)."""
    return rms and clusters(device)


@functools.lru_cache(maxsize=None)
def clusters(device: torch.device) -> bool:
    """Whether programs may span thread-block clusters on `device`: NVIDIA Hopper or newer with Triton
    >= 3.9 (3.6-3.8 fail to compile our kernels with num_ctas > 1; ROCm has no clusters). The
    interpreter runs a cluster program as one program, so on CPU tensors the cluster configs run (and
    are tested) as they are."""
    if device.type != "cuda":
        return True
    return TRITON_3_9 and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] >= 9


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count
