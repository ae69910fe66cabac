"""Cooperative backward for rows too long for one program: each row read once.

The split backward reads x and dy twice (row sums, then dx): 5 units of traffic for 3 counted. Here
a grid of C column slices x G row groups is resident at once (launched cooperatively, at most
`programs_per_sm` programs per SM, nothing else in the launch): program (c, g) holds its slice of a
[BLOCK_M, SLICE_N] row block in registers, writes its partial row sums to a small fp32 exchange
buffer, counts them in on its group's counter (release), waits until all C slices have (acquire),
adds the C partials in slice order (the same order, so the same sums, in every slice and every run)
and writes dx from the registers; dgamma/dbeta stay in fp32 registers across its row blocks and go
to row g of the [G, K] partial buffer that `column_sum_kernel` reduces as for the other kernels.

Why it cannot deadlock: a program only waits for the other slices of its own row group at the same
row block, all of which are resident (cooperative launch: the driver refuses a grid that cannot be)
and reach that block without waiting on anyone later. The interpreter runs programs one after
another, so there only single-slice grids (C = 1, a program waits on itself) may run this kernel.

Exchange slots and counters form a ring of RING per row group. LOOKAHEAD (0: load, publish, wait
per block) 1: publish row block i + 1 before waiting for block i, so the exchange's round trip has a
block of slack; a program can then be up to two blocks ahead of a slower one's read, and the fourth
slot is the first that is free again. 2: issue block i + 1's loads, wait for block i, write its dx,
then publish block i + 1's sums: the loads are in flight during the wait and the exchange reads (1
waits on them before publishing, so nothing is in flight then). Counter `slot` counts the
publications of its blocks (i // RING + 1 generations of C),
so a fast slice's later blocks can never stand in for a slow one's. The last slice of a group to
finish zeroes the group's counters, so every launch (a CUDA graph replay too) starts from zeros and
no host-side epoch is needed; the workspace is one zeroed buffer per device and stream.
"""

import functools

import torch
import triton
import triton.language as tl

from .bwd_tiles import (_accumulate, _column_program, _load_tile, _row_tile, _store_dx, _store_partials,
                        _tile_values)

RING = 4


@triton.jit
def _slice_tile(SRC, DY, W, w, MEAN, RSTD, block, cols, col_mask, M, stride_src, stride_dy, BLOCK_M: tl.constexpr,
                IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, ZERO_CENTERED: tl.constexpr):
    """xhat, dy, w * dy and rstd of one row block's slice (`_row_tile`, the weights held)."""
    rows64, row_mask, mask, xhat, dy, wdy, rstd = _row_tile(SRC, DY, W, w, MEAN, RSTD, block, cols, col_mask, M,
                                                            stride_src, stride_dy, BLOCK_M, IS_RMS, HAS_WEIGHT,
                                                            ZERO_CENTERED, True)
    return xhat, dy, wdy, rstd


@triton.jit
def _publish(xhat, wdy, EXCHANGE, COUNTERS, group, step, slice_id, num_slices,
             BLOCK_M: tl.constexpr, IS_RMS: tl.constexpr, RING: tl.constexpr):
    """This slice's partial row sums of the group's `step`-th row block into its exchange slot
    ([group, slot, kind, slice, row]), then one release increment of the slot's counter."""
    slot = step % RING
    at = EXCHANGE + ((group * RING + slot) * 2 * num_slices + slice_id) * BLOCK_M + tl.arange(0, BLOCK_M)
    tl.store(at, tl.sum(xhat * wdy, axis=1))
    if not IS_RMS:
        tl.store(at + num_slices * BLOCK_M, tl.sum(wdy, axis=1))
    tl.debug_barrier()  # every thread's stores before the (one-thread) release below
    tl.atomic_add(COUNTERS + group * (RING + 1) + slot, 1, sem="release", scope="gpu")


@triton.jit
def _row_sums(EXCHANGE, COUNTERS, group, step, num_slices, N, BLOCK_M: tl.constexpr, SLICES: tl.constexpr,
              IS_RMS: tl.constexpr, RING: tl.constexpr):
    """Wait (acquire) until all slices published the `step`-th row block, then return its
    mean(xhat*w*dy) and mean(w*dy), the partials added in slice order (SLICES = next_pow2(C))."""
    slot = step % RING
    counter = COUNTERS + group * (RING + 1) + slot
    target = num_slices * (step // RING + 1)
    seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()
    slices = tl.arange(0, SLICES)
    at = (EXCHANGE + (group * RING + slot) * 2 * num_slices * BLOCK_M
          + slices[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :])
    mask = (slices < num_slices)[:, None]
    c1 = tl.sum(tl.load(at, mask=mask, other=0.0, cache_modifier=".cg"), axis=0) / N  # past L1: slots are reused
    c2 = c1
    if not IS_RMS:
        c2 = tl.sum(tl.load(at + num_slices * BLOCK_M, mask=mask, other=0.0, cache_modifier=".cg"), axis=0) / N
    return c1, c2


@triton.jit
def _leave(COUNTERS, group, num_slices, RING: tl.constexpr):
    """The group's last slice out zeroes its counters: every slice is past its last wait then."""
    done = COUNTERS + group * (RING + 1) + RING
    if tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == num_slices - 1:
        slots = tl.arange(0, 2 * RING)
        tl.store(COUNTERS + group * (RING + 1) + slots, tl.zeros([2 * RING], dtype=tl.int32), mask=slots <= RING)


@triton.jit(do_not_specialize=["M"])
def coop_bwd_kernel(SRC, DY, DZ, W, MEAN, RSTD, DX, PARTIAL, EXCHANGE, COUNTERS,
                    stride_src, stride_dy, stride_dz, M, N,
                    IS_RMS: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
                    HAS_DZ: tl.constexpr, ZERO_CENTERED: tl.constexpr, BLOCK_M: tl.constexpr,
                    SLICE_N: tl.constexpr, SLICES: tl.constexpr, LOOKAHEAD: tl.constexpr, RING: tl.constexpr):
    """Program (slice c, group g) walks row blocks g, g + G, ... of columns [c * SLICE_N, +SLICE_N)."""
    slice_id, group, cols, col_mask, w, dw_acc, db_acc = _column_program(W, N, HAS_WEIGHT, ZERO_CENTERED, True,
                                                                         BLOCK_M, SLICE_N)
    num_slices = tl.num_programs(0)
    groups = tl.num_programs(1)
    steps = tl.cdiv(tl.cdiv(M, BLOCK_M) - group, groups)
    if LOOKAHEAD:  # block 0's sums go out before the loop
        xhat, dy, wdy, rstd = _slice_tile(SRC, DY, W, w, MEAN, RSTD, group, cols, col_mask, M, stride_src, stride_dy,
                                          BLOCK_M, IS_RMS, HAS_WEIGHT, ZERO_CENTERED)
        _publish(xhat, wdy, EXCHANGE, COUNTERS, group, 0, slice_id, num_slices, BLOCK_M, IS_RMS, RING)
    for step in range(0, steps):
        block = group + step * groups
        if LOOKAHEAD == 1:  # the next block's loads and sums go out before this block's wait
            next_xhat, next_dy, next_wdy, next_rstd = _slice_tile(
                SRC, DY, W, w, MEAN, RSTD, block + groups, cols, col_mask, M, stride_src, stride_dy, BLOCK_M,
                IS_RMS, HAS_WEIGHT, ZERO_CENTERED)
            _publish(next_xhat, next_wdy, EXCHANGE, COUNTERS, group, step + 1, slice_id, num_slices, BLOCK_M,
                     IS_RMS, RING)
        elif LOOKAHEAD == 2:  # only the next block's loads go out first: in flight during the wait
            next_rows, next_row_mask, next_mask, next_x, next_dy, next_mean, next_rstd = _load_tile(
                SRC, DY, MEAN, RSTD, block + groups, cols, col_mask, M, stride_src, stride_dy, BLOCK_M, IS_RMS)
        else:
            xhat, dy, wdy, rstd = _slice_tile(SRC, DY, W, w, MEAN, RSTD, block, cols, col_mask, M, stride_src,
                                              stride_dy, BLOCK_M, IS_RMS, HAS_WEIGHT, ZERO_CENTERED)
            _publish(xhat, wdy, EXCHANGE, COUNTERS, group, step, slice_id, num_slices, BLOCK_M, IS_RMS, RING)
        c1, c2 = _row_sums(EXCHANGE, COUNTERS, group, step, num_slices, N, BLOCK_M, SLICES, IS_RMS, RING)
        rows64 = (block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        mask = (rows64 < M)[:, None] & col_mask[None, :]
        if HAS_WEIGHT:  # recomputed rather than carried across the wait: fewer live registers
            wdy = dy * w[None, :]
        else:
            wdy = dy
        _store_dx(xhat, wdy, rstd, c1, c2, DX, DZ, rows64, cols, mask, N, stride_dz, IS_RMS, HAS_DZ)
        dw_acc, db_acc = _accumulate(dw_acc, db_acc, dy, xhat, HAS_WEIGHT, HAS_BIAS)
        if LOOKAHEAD == 1:
            xhat, dy, rstd = next_xhat, next_dy, next_rstd
        elif LOOKAHEAD == 2:
            xhat, dy, wdy = _tile_values(next_x, next_dy, next_mean, next_rstd, next_mask, W, w, cols, col_mask,
                                         IS_RMS, HAS_WEIGHT, ZERO_CENTERED, True)
            rstd = next_rstd
            _publish(xhat, wdy, EXCHANGE, COUNTERS, group, step + 1, slice_id, num_slices, BLOCK_M, IS_RMS, RING)
    _store_partials(dw_acc, db_acc, PARTIAL, group, cols, col_mask, N, HAS_WEIGHT, HAS_BIAS)
    _leave(COUNTERS, group, num_slices, RING)


@functools.lru_cache(maxsize=None)
def workspace(device: torch.device, stream: int, programs: int, block_m: int) -> tuple:
    """(exchange, counters) for up to `programs` resident programs: fp32 [programs, RING, 2, block_m]
    (G * C <= programs, so any grid's [G, RING, 2, C, block_m] fits) and int32 [programs, RING + 1],
    zeroed once; the kernel leaves the counters zero. One per stream: two launches running at once
    must not share counters."""
    exchange = torch.empty(programs * RING * 2 * block_m, dtype=torch.float32, device=device)
    return exchange, torch.zeros(programs * (RING + 1), dtype=torch.int32, device=device)
