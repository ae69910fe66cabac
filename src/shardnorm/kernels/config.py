"""Launch heuristics for the norm kernels, all in one place.

Everything here is keyed on the hidden size N (and, for the backward, on how many partial sums it
keeps), never on the number of rows M, so a new batch or sequence length never triggers a Triton
recompilation (M is a runtime argument marked `do_not_specialize`).

- BLOCK_N: the column tile. While a whole row fits (N <= MAX_FUSED_N) it is next_pow2(N) and the
  kernels run one pass over x/dy (SINGLE_PASS); above that the row is walked in BLOCK_N chunks,
  once for the row statistics and again to write, instead of spilling registers.
- BLOCK_M: rows per tile; num_warps grows with the tile so each thread holds a bounded number of
  elements.
- Backward is persistent: `bwd_programs` programs walk the row blocks grid-stride, each keeping its
  dgamma/dbeta partial sum in registers, then write one fp32 row of the [P, N] partial buffer. Its
  one-pass limit depends on how many partial sums (dgamma, dbeta) stay live in registers.

`benchmarks/sweep_tiles.py` measures alternatives by replacing `fwd_config` / `bwd_config` here;
`benchmarks/NOTES.md` records what was measured and why these values.
"""

import functools
from dataclasses import dataclass

import triton

# Largest row kept in registers in one pass (elements). Above it the chunked path runs.
MAX_FUSED_N_FWD = 32768
MAX_FUSED_N_BWD = {0: 16384, 1: 16384, 2: 8192}  # by the number of partial sums (dgamma, dbeta)
# SM count used where there is no CUDA device (TRITON_INTERPRET on CPU tensors).
INTERPRETER_SM_COUNT = 4


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    single_pass: bool
    programs_per_sm: int = 2  # persistent backward programs per SM
    num_stages: int = 1  # software-pipelining depth of the row-block and chunk loops


# Chunked (large-N) paths. Backward: 8 rows x 1024 columns per tile amortizes the read-modify-write
# of the program's own partial row over 8 rows; pipelined 2 deep (sweep on H100, NOTES.md).
FWD_CHUNKED = TileConfig(block_m=1, block_n=4096, num_warps=8, single_pass=False, num_stages=2)
BWD_CHUNKED = TileConfig(block_m=8, block_n=1024, num_warps=4, single_pass=False, programs_per_sm=2, num_stages=2)


@functools.lru_cache(maxsize=None)
def fwd_config(n: int) -> TileConfig:
    if n > MAX_FUSED_N_FWD:
        return FWD_CHUNKED
    block_n = triton.next_power_of_2(n)
    # Small rows: several per program so each tile holds 8K elements (QK-norm rows of 64-256 too).
    return TileConfig(block_m=max(1, 8192 // block_n), block_n=block_n,
                      num_warps=8 if block_n <= 8192 else 16, single_pass=True)


@functools.lru_cache(maxsize=None)
def bwd_config(n: int, num_partials: int) -> TileConfig:
    if n > MAX_FUSED_N_BWD[num_partials]:
        return BWD_CHUNKED
    block_n = triton.next_power_of_2(n)
    # From N = 1024 up one row per iteration (the dgamma/dbeta accumulators already fill the
    # registers); below, rows up to 1K elements a tile. More persistent programs per SM for small
    # rows keep enough loads in flight.
    return TileConfig(block_m=max(1, 1024 // block_n), block_n=block_n,
                      num_warps=4 if block_n <= 1024 else 8 if block_n <= 8192 else 16, single_pass=True,
                      programs_per_sm=4 if block_n <= 4096 else 2, num_stages=2 if block_n <= 1024 else 1)


def bwd_programs(cfg: TileConfig, num_row_blocks: int, sm_count: int) -> int:
    """At least one program (it writes a zero partial when M == 0), at most one per row block."""
    return max(1, min(sm_count * cfg.programs_per_sm, num_row_blocks))
