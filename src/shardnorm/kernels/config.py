"""Launch heuristics for the norm kernels, all in one place.

Everything here is keyed on the hidden size N and the activation element size only, never on the
number of rows M, so a new batch or sequence length never triggers a Triton recompilation (M is a
runtime argument marked `do_not_specialize`).

- BLOCK_N: the column tile. While a whole row fits (N <= MAX_FUSED_N) it is next_pow2(N) and the
  kernels run one pass over x/dy (SINGLE_PASS); above that the row is walked in BLOCK_N chunks and
  re-read from L2 in a second loop instead of spilling registers.
- BLOCK_M: rows per tile, so that small-N tiles still move ~16-32 KB per iteration.
- num_warps: grows with the tile so each thread holds a bounded number of elements.
- Backward is persistent: `bwd_programs` programs walk the row blocks grid-stride, each keeping its
  dgamma/dbeta partial sum in registers, then write one fp32 row of the [P, N] partial buffer. Its
  one-pass limit depends on how many partial sums (dgamma, dbeta) stay live in registers.

`benchmarks/sweep_tiles.py` measures alternatives by replacing `fwd_config` / `bwd_config` here;
`benchmarks/NOTES.md` records what was measured and why these values.
"""

from dataclasses import dataclass

import triton

# Largest row kept in registers in one pass (elements). Above it the chunked path runs.
MAX_FUSED_N_FWD = 32768
MAX_FUSED_N_BWD = {0: 16384, 1: 16384, 2: 8192}  # by the number of partial sums (dgamma, dbeta)
# Chunk width of the chunked (large-N) path.
CHUNK_N = 4096
# Elements per tile that the tile-size heuristics aim for.
TILE_ELEMENTS_FWD = 8192
TILE_ELEMENTS_BWD = 4096
# SM count used where there is no CUDA device (TRITON_INTERPRET on CPU tensors).
INTERPRETER_SM_COUNT = 4


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    single_pass: bool
    programs_per_sm: int = 2  # persistent backward programs per SM


def _tile(n: int, max_fused: int, tile_elements: int) -> TileConfig:
    single_pass = n <= max_fused
    block_n = triton.next_power_of_2(n) if single_pass else CHUNK_N
    block_m = max(1, min(16, tile_elements // block_n))
    elements = block_m * block_n
    num_warps = 4 if elements <= 4096 else 8 if elements <= 8192 else 16
    return TileConfig(block_m, block_n, num_warps, single_pass)


def fwd_config(n: int) -> TileConfig:
    return _tile(n, MAX_FUSED_N_FWD, TILE_ELEMENTS_FWD)


def bwd_config(n: int, num_partials: int) -> TileConfig:
    return _tile(n, MAX_FUSED_N_BWD[num_partials], TILE_ELEMENTS_BWD)


def bwd_programs(cfg: TileConfig, num_row_blocks: int, sm_count: int) -> int:
    """At least one program (it writes a zero partial when M == 0), at most one per row block."""
    return max(1, min(sm_count * cfg.programs_per_sm, num_row_blocks))
