"""Launch heuristics for the norm kernels, all in one place (each path: docs/performance.md, "Kernel paths").

Keyed on the hidden size N (and, backward, on how many partial sums it keeps), never on the row count M, so
a new batch or sequence length never recompiles. Numbers below are % of copy bandwidth on one H100 (torch
2.11, Triton 3.6, bf16 x and dy, M = 32768 unless stated): "GPU time" is the bare launcher replayed from a
CUDA graph (measured with `benchmarks/sweep_tiles.py`, which swapped `fwd_config` / `bwd_config` here; removed in
d7c3b12, its last version: `git show d7c3b12^:benchmarks/sweep_tiles.py`), "benchmark" do_bench of the autograd
call (`python -m benchmarks.bench_kernels`).
"""

import functools
from dataclasses import dataclass
from typing import Union

import torch
import triton

from .. import settings

# Largest row kept in registers in one pass (elements). Above it the chunked/split paths run.
MAX_FUSED_N_FWD = 32768
MAX_FUSED_N_BWD = {0: 16384, 1: 16384, 2: 8192}  # by the number of partial sums (dgamma, dbeta)
# Grid sizes per row count M a launch plan remembers (a dict lookup instead of a few Python calls per
# call); past it the plan forgets them all (variable-length batches).
MAX_CACHED_M = 4096
# Shortest row that can leave the one-pass backward (the specialized long-row kernel only exists above).
MIN_LONG_N_BWD = min(MAX_FUSED_N_BWD.values()) + 1
# SM count used where there is no CUDA device (TRITON_INTERPRET on CPU tensors).
INTERPRETER_SM_COUNT = 8
# The tables were measured with Triton 3.6 (torch 2.11 on the GPU machine); 3.9 compiles some tiles
# differently.
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

    def programs(self, blocks: int, sm_count: int) -> int:
        """Programs to launch for `blocks` row blocks: one per block, or when persistent
        `programs_per_sm` on every SM, at most one per block. GUARD_FREE (here and where marked): the traced bodies
        compute grids from a symbolic row count, so min / max are torch.sym_min / sym_max, which Python's would
        turn into guards on M (a recompile per regime; an error where the user marked M dynamic); on ints they are
        min / max, cached per M in eager calls."""
        if not self.programs_per_sm:
            return blocks
        return torch.sym_max(1, torch.sym_min(blocks, sm_count * self.programs_per_sm))  # GUARD_FREE


@dataclass(frozen=True)
class SplitBwdConfig:
    """The two passes of the split backward; `row_sums.programs_per_sm` sizes its grid of column
    tiles x row groups, so it sets how many dgamma/dbeta partial rows there are."""
    row_sums: TileConfig
    dx: TileConfig


@dataclass(frozen=True)
class StagedConfig:
    """The staged kernels (`norm_bwd_staged.py`, `norm_fwd_staged.py`): rows in shared memory, copied in chunks
    of vec x 32 x num_warps elements (vec: elements per 16-byte copy). Backward: slices of slice_n columns, one
    program each, in `slots` row slots (3: the next row's sums published before this row's are awaited); the
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


def staged_params(*params) -> bool:
    """Whether the staged kernels can copy these parameters (absent ones aside): 16-byte aligned addresses."""
    return all(p is None or not p.data_ptr() & 15 for p in params)


BwdConfig = Union[TileConfig, SplitBwdConfig, StagedConfig]

# Portable long-row paths, from the H100 sweeps of GPU time. fp32 weight and bias are
# read again for every chunk; two rows per tile halve that (LayerNorm fp32 32768: 61% -> 75% of copy).
# The split backward sits at 59-61% at every long row, its design's ceiling (x and dy read twice).
FWD_CHUNKED = TileConfig(block_m=1, block_n=16384, num_warps=32, single_pass=False)
FWD_CHUNKED_FP32_PARAMS = TileConfig(block_m=2, block_n=8192, num_warps=16, single_pass=False, num_stages=2)
BWD_SPLIT = SplitBwdConfig(row_sums=TileConfig(block_m=1, block_n=8192, num_warps=16, programs_per_sm=2, num_stages=3),
                           dx=TileConfig(block_m=1, block_n=4096, num_warps=8))


# Forward with fp32 parameters, one pass, persistent programs holding weight and bias in registers, by
# next_pow2(N): (warps, programs per SM); for LayerNorm with bias, and for any norm at 16384. Re-reading fp32
# parameters for every row was the bottleneck there (H100 A/B of GPU time: LayerNorm 8192 +11%, 14336 +20%,
# 16384 +21%; RMSNorm 16384 +2%); RMSNorm 8192 and both norms at 4096 were slower persistent (-3% to -7%).
PERSISTENT_FWD = {8192: (8, 8), 16384: (16, 4)}


def tail_pays(tail_n: int, param_size: int, has_bias: bool) -> bool:
    """Whether the forward takes a tail tile (H100 GPU-time sweeps and A/B at N = 4608-9216): faster for
    LayerNorm with fp32 weight and bias (+6% to +32%) and for RMSNorm with tails up to 1024 columns (fp32 +5%
    to +32%, bf16 0 to +6%); slower for LayerNorm with bf16 parameters (-5% to -25%) and RMSNorm with
    2048-column tails (-4% to -6%). Longer tails were not measured."""
    if has_bias:
        return param_size >= 4 and tail_n <= 2048
    return tail_n <= 1024


@functools.lru_cache(maxsize=None)
def fwd_config(n: int, param_size: int = 2, has_bias: bool = False) -> TileConfig:
    """The portable forward's tiles. param_size: bytes per weight (bias) element. fp32 weight and bias
    beside a one-pass row above 16384 columns spill in one program: chunked there (H100 sweep)."""
    block_n = next_pow2(n)
    main_n, tail_n = row_tiles(n)
    if TRITON_3_9 and has_bias and param_size == 2:
        # bf16 LayerNorm: the 3.6 choices below run 13-32% slower under 3.9 (H100 sweep of GPU time
        # under 3.9 at 5120, 14336 and 16384): 82% -> 98% of copy, 68% -> 83%, 74% -> 87%.
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
        return FWD_CHUNKED_FP32_PARAMS if param_size >= 4 and has_bias else FWD_CHUNKED
    if block_n == 1024 and has_bias:  # one row a program (H100 sweep of GPU time: 95% vs 93% of copy)
        return TileConfig(block_m=1, block_n=1024, num_warps=4)
    if block_n <= 2048:  # small rows, QK-norm's 64-256 too: 2K-element tiles, 4 warps (H100 sweep)
        return TileConfig(block_m=2048 // block_n, block_n=block_n, num_warps=4)
    return TileConfig(block_m=max(1, 8192 // block_n), block_n=block_n, num_warps=8 if block_n <= 8192 else 16)


# Fused backward tiles by next_pow2(N): (rows per tile, warps, persistent programs per SM, pipeline
# stages). From the H100 sweep of GPU time: small rows take 2-4K-element tiles; from 1K columns up, one or
# two rows, more warps as the row grows, fewer programs per SM as the dgamma/dbeta accumulators fill the
# registers.
# The fused backward keeps the weight in registers up to this tile (H100 A/B of GPU time:
# fp32 weights at N = 5120 +12% (LayerNorm) / +10% (RMSNorm); at 16384 the registers spill, -34%).
HOIST_PARAMS_MAX_N_BWD = 8192
# RMSNorm with a bf16 weight at 4097-5120 columns: a 4096 tile and a 512- or 1024-column tail instead
# of one 8192 tile (H100 sweeps of GPU time, Triton 3.6 and 3.9: 5120 90-91% vs 76% of
# copy, 4608 87-88% vs 72%); slower for LayerNorm and fp32 weights.
BWD_TAIL_RMS = dict(block_m=1, block_n=4096, num_warps=8, programs_per_sm=2, num_stages=2, hoist_params=True)
FUSED_BWD = {64: (64, 8, 2, 1), 128: (32, 8, 2, 1), 256: (16, 8, 2, 1), 512: (8, 8, 2, 1), 1024: (2, 4, 4, 2),
             2048: (1, 4, 4, 1), 4096: (1, 8, 2, 1), 8192: (1, 16, 1, 1), 16384: (1, 16, 2, 1)}


# ---- the specialized long-row kernels: which GPU family takes them, and for which shapes ----------------

# GPU family (CUDA compute capability) -> the long-row kernels it takes instead of the portable ones, in
# both directions. Hopper only: the staged kernels size rows by its 227 KB of shared memory per block (sm_80
# has 164 KB, sm_89 99 KB), and it is where they were measured. Every other device, and CPU tensors (Gluon
# does not run under the interpreter), takes the portable kernels.
SPECIALIZED = {(9, 0): "staged"}

# The staged forward for rows longer than MAX_FUSED_N_FWD (bf16/fp16 x, N % 16 == 0, no residual, 16-byte
# aligned rows and parameters): x read once instead of twice. H100, % of copy, benchmark:
# RMSNorm 65536 97% vs 77% chunked, LayerNorm 65536 95% vs 76% (`bench_kernels.py --shapes longrow`, then
# again with SHARDNORM_PORTABLE_KERNELS=1).
STAGED_FWD = StagedConfig(num_warps=32)

# The staged backward, by (next_pow2(N), weight bytes, RMSNorm), where the row fits (norm_bwd_staged.fits) and
# a call's rows are 16-byte aligned bf16/fp16 (`staged_rows`); other calls take the split backward. H100, bf16,
# % of copy in GPU time, the split backward 59-61% in the same runs:
# - whole rows in two slots, the next row's copies a row ahead (one 16384-column slice, 16 warps: 128
#   registers a thread, where 32 warps spill LayerNorm's dgamma/dbeta sums): LayerNorm 14336 87-88%, 16384 96%.
# - 16384-column slices in three slots, the next row's sums published before this row's are awaited, tagged
#   words for the exchange: LayerNorm 32768 87-88%, 65536 85%, RMSNorm 32768 92-93%, 65536 92-93%
#   (measured with `benchmarks/gpu_longrow.py`, removed in d7c3b12: `git show d7c3b12^:benchmarks/gpu_longrow.py`).
# fp32 weights take the same configs: H200, benchmark, 1.12-1.48x the split backward (docs/performance.md).
_STAGED_TWO_SLOTS = StagedConfig(num_warps=16, slice_n=16384)
_STAGED_SLICES = StagedConfig(num_warps=16, slice_n=16384, slots=3)
STAGED_BWD = {(16384, weight_bytes, False): _STAGED_TWO_SLOTS for weight_bytes in (2, 4)} | {
    (block_n, weight_bytes, rms): _STAGED_SLICES
    for block_n in (32768, 65536) for weight_bytes in (2, 4) for rms in (False, True)}


def specialized(device: torch.device) -> str:
    """The long-row kernels `device` takes: `SPECIALIZED`'s entry for its GPU family, or "" (the portable
    ones) where it has none or `settings.portable_kernels` (SHARDNORM_PORTABLE_KERNELS=1) asks for them."""
    return "" if settings.get().portable_kernels else _family_kernels(device)


@functools.lru_cache(maxsize=None)
def _family_kernels(device: torch.device) -> str:
    if device.type != "cuda" or torch.version.hip is not None:
        return ""
    return SPECIALIZED.get(torch.cuda.get_device_capability(device), "")


@functools.lru_cache(maxsize=None)
def bwd_config(n: int, num_partials: int, param_size: int = 2, rms: bool = False, kernels: str = "") -> BwdConfig:
    """num_partials: dgamma and/or dbeta; param_size: bytes per weight element; rms: RMSNorm (one row
    sum per row, no dbeta); kernels: `specialized(device)`. Long rows: STAGED_BWD's entry where the
    staged kernels may run and hold the row, else the split backward."""
    block_n = next_pow2(n)
    main_n, tail_n = row_tiles(n)
    if rms and param_size == 2 and main_n == 4096 and tail_n in (512, 1024):
        return TileConfig(**BWD_TAIL_RMS, tail_n=tail_n)
    if n > MAX_FUSED_N_BWD[num_partials]:
        staged = STAGED_BWD.get((block_n, param_size, rms)) if kernels == "staged" else None
        return staged if staged is not None and staged_fits(staged, n, num_partials) else BWD_SPLIT
    if block_n < 64:  # rows of a few elements: the 64-column tile size
        return TileConfig(block_m=4096 // block_n, block_n=block_n, num_warps=8, programs_per_sm=2)
    block_m, warps, per_sm, stages = FUSED_BWD[block_n]
    return TileConfig(block_m=block_m, block_n=block_n, num_warps=warps, programs_per_sm=per_sm, num_stages=stages,
                      hoist_params=block_n <= HOIST_PARAMS_MAX_N_BWD)


def staged_fits(cfg: StagedConfig, n: int, num_grads: int) -> bool:
    """The staged backward's slices in shared memory for bf16/fp16 rows (2 bytes each of x and dy: its vec of
    8 makes 16-byte copies), whole chunks per slice in each row slot, for a norm with parameter grads (it writes
    partials); N a multiple of 16, as Triton must know to compile 16-byte copies of whole rows. Every slice's
    program must be resident (one per SM): STAGED_BWD's rows have at most 4 slices."""
    from .norm_bwd_staged import fits

    return (num_grads > 0 and n % 16 == 0 and cfg.slice_n > 0 and cfg.slice_n % cfg.chunk == 0 and
            fits(cfg.slice_n, cfg.chunk, 2 * cfg.slots, 2 * cfg.slots, num_grads))  # slots: wider rows


def row_groups(cfg: SplitBwdConfig, m: int, n: int, sm_count: int) -> int:
    """Row groups of the split backward's row-sums pass: enough column tiles x groups to fill
    `programs_per_sm` programs on every SM; each group is one partial row."""
    col_tiles = cdiv(n, cfg.row_sums.block_n)
    wanted = cdiv(sm_count * cfg.row_sums.programs_per_sm, col_tiles)
    return torch.sym_max(1, torch.sym_min(wanted, cdiv(m, cfg.row_sums.block_m)))  # GUARD_FREE


def per_m(cache: dict, m: int, make):
    """cache[m], made by make(m) the first time; the cache forgets everything past MAX_CACHED_M entries."""
    value = cache.get(m)
    if value is None:
        if len(cache) >= MAX_CACHED_M:
            cache.clear()
        value = cache[m] = make(m)
    return value


def partial_rows(cfg: BwdConfig, m: int, n: int, sm_count: int) -> int:
    """Rows of the backward's fp32 [P, G*N] dgamma/dbeta partial buffer for M x N: one per row group
    of the split backward, one per persistent program of the fused and staged ones (at least
    one: a zero partial row when M == 0; at most one per row block)."""
    if isinstance(cfg, SplitBwdConfig):
        return row_groups(cfg, m, n, sm_count)
    if isinstance(cfg, StagedConfig):  # one program per SM (per slice), at most one per row
        return max(1, min(m, sm_count // cdiv(n, cfg.slice_n) if cfg.slice_n else sm_count))
    return cfg.programs(cdiv(m, cfg.block_m), sm_count)


# One-pass backwards of at most this many elements (M * N) take every row in one program, which stores
# dgamma/dbeta itself: an allocation and a launch less of host time, the whole cost at such sizes (35.7 ->
# 32.2 us for RMSNorm 8 x 4096 bf16, `benchmarks/host_time.py`), for a few us of GPU time.
DIRECT_GRADS_MAX_ELEMENTS = 32768


def direct_grads(cfg: BwdConfig, m: int, n: int) -> bool:
    """Whether the backward of M x N under `cfg` runs as one program that writes dgamma/dbeta
    directly: one-pass tiles and at most DIRECT_GRADS_MAX_ELEMENTS. Never for a traced call's symbolic M (GUARD_FREE):
    the choice would be a guard on M, which recompiles a dynamic-shape graph at the threshold and fails one whose row
    count the user marked dynamic (`torch._dynamo.mark_dynamic`); such a call takes the partial sums, equal to the
    direct ones up to their fp32 summation order."""
    return isinstance(cfg, TileConfig) and type(m) is int and m * n <= DIRECT_GRADS_MAX_ELEMENTS


@functools.lru_cache(maxsize=None)
def column_sum_block(k: int, sms: int) -> int:
    """Column tile of the dgamma/dbeta reduction over a [P, k] buffer: narrow for narrow buffers,
    so the reduction spreads over enough programs."""
    return min(256, max(32, next_pow2(cdiv(k, 2 * sms))))


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return INTERPRETER_SM_COUNT
    return torch.cuda.get_device_properties(device).multi_processor_count
