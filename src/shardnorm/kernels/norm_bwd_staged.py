"""Long-row backward with the row staged in shared memory (Gluon), so x and dy are read from HBM once.

Persistent programs copy their slice of a row's x and dy into shared memory with `cp.async`, take the two
row sums from there and read it again for dx, the next row's copies a row ahead; a row's slices meet as
tagged 64-bit words. dgamma/dbeta sums go to the partial buffer `column_sum_kernel` reduces. Every thread
reads back only what it copied itself, so a chunk is ready for it once its own copy group has landed. Gluon
does not run under TRITON_INTERPRET: CI checks the split backward (the same math in `tl`), the GPU tests
this one (tests/test_long_rows_staged.py). Which rows: `config.STAGED_BWD`.
"""

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

SMEM_BYTES = 227 * 1024  # Hopper's opt-in shared memory per block (config.SPECIALIZED: sm_90 only)
MAX_CHUNKS = 4  # register sums for up to 4 chunks (below)
MAX_SUMS = 32768  # fp32 dgamma/dbeta sums per program: half the register file (256 KB)
EXCHANGE_RING = 4  # rows of tagged words per group in the sliced kernel's exchange (RING >= 2 + 2 * LEAD)


def stage_weight(n: int, chunk: int, weight_size: int, slots: int) -> bool:
    """Whether the weight of n columns fits in shared memory beside `slots` rows of bf16/fp16 x and dy (STAGE_W)."""
    return bool(weight_size) and -(-n // chunk) * chunk * (4 * slots + weight_size) <= SMEM_BYTES


def fits(n: int, chunk: int, src_size: int, dy_size: int, num_grads: int) -> bool:
    """Whether rows of n columns fit: at most MAX_CHUNKS chunks, x and dy within shared memory, the
    parameter-grad sums within half the registers."""
    padded = -(-n // chunk) * chunk
    return padded <= MAX_CHUNKS * chunk and padded * (src_size + dy_size) <= SMEM_BYTES and \
        padded * num_grads <= MAX_SUMS


@gluon.jit
def _row_terms(xs, dys, ws, W, MEAN, RSTD, row, first, offs, N, zero, layout: gl.constexpr, CHUNKS: gl.constexpr,
               CHUNK: gl.constexpr, IS_RMS: gl.constexpr, HAS_WEIGHT: gl.constexpr, ZERO_CENTERED: gl.constexpr,
               STAGE_W: gl.constexpr):
    """The row's mean (0 for RMSNorm) and rstd, and per lane the terms of its two row sums (xhat * w * dy,
    w * dy) over its chunks in shared memory (chunks first, first + 1, ...), each read once its copy group
    has landed (the next row's CHUNKS groups, issued after this row's, may stay in flight)."""
    rstd = gl.load(RSTD + row)
    mean = 0.0
    if not IS_RMS:
        mean = gl.load(MEAN + row)
    sum_xwdy = zero
    sum_wdy = zero
    for c in gl.static_range(CHUNKS):
        async_copy.wait_group(2 * CHUNKS - 1 - c)
        cols = c * CHUNK + offs
        xhat, dy, wdy = _chunk_values(xs, dys, ws, W, first + c, c, cols, cols < N, mean, rstd, layout, IS_RMS,
                                      HAS_WEIGHT, ZERO_CENTERED, STAGE_W)
        sum_xwdy += xhat * wdy
        sum_wdy += wdy
    return mean, rstd, sum_xwdy, sum_wdy


@gluon.jit
def add_pairs(a, b, c, d):
    """Combine of a reduction over pairs of sums (one exchange through shared memory for two sums)."""
    return a + c, b + d


@gluon.jit
def _row_sums(sum_xwdy, sum_wdy, IS_RMS: gl.constexpr):
    """The row's two sums (xhat * w * dy, w * dy) from the lanes' terms; LayerNorm's in one reduction (one
    exchange through shared memory, not two), RMSNorm's one sum twice."""
    if IS_RMS:
        part1 = gl.sum(sum_xwdy, axis=0)
        part2 = part1
    else:
        part1, part2 = gl.reduce((sum_xwdy, sum_wdy), 0, add_pairs)
    return part1, part2


@gluon.jit
def _dx_row(xs, dys, ws, DZ, W, DX, row, N, stride_dz, offs, first, mean, rstd, c1, c2, dw0, dw1, dw2, dw3, db0, db1,
            db2, db3, layout: gl.constexpr, CHUNKS: gl.constexpr, CHUNK: gl.constexpr, IS_RMS: gl.constexpr,
            HAS_WEIGHT: gl.constexpr, HAS_DZ: gl.constexpr, ZERO_CENTERED: gl.constexpr, STAGE_W: gl.constexpr):
    """The row's dx from its chunks in shared memory at `first`, each chunk's dgamma / dbeta terms added to its
    own sums (Gluon has no register arrays: one variable per chunk, up to MAX_CHUNKS; absent chunks' stay unused
    and compile away)."""
    dw0, db0 = _store_dx(xs, dys, ws, W, DZ, DX, row, N, stride_dz, first, 0, offs, mean, rstd, c1, c2, dw0, db0,
                         layout, IS_RMS, HAS_WEIGHT, HAS_DZ, ZERO_CENTERED, STAGE_W)
    if CHUNKS > 1:
        dw1, db1 = _store_dx(xs, dys, ws, W, DZ, DX, row, N, stride_dz, first + 1, 1, 1 * CHUNK + offs, mean, rstd,
                             c1, c2, dw1, db1, layout, IS_RMS, HAS_WEIGHT, HAS_DZ, ZERO_CENTERED, STAGE_W)
    if CHUNKS > 2:
        dw2, db2 = _store_dx(xs, dys, ws, W, DZ, DX, row, N, stride_dz, first + 2, 2, 2 * CHUNK + offs, mean, rstd,
                             c1, c2, dw2, db2, layout, IS_RMS, HAS_WEIGHT, HAS_DZ, ZERO_CENTERED, STAGE_W)
    if CHUNKS > 3:
        dw3, db3 = _store_dx(xs, dys, ws, W, DZ, DX, row, N, stride_dz, first + 3, 3, 3 * CHUNK + offs, mean, rstd,
                             c1, c2, dw3, db3, layout, IS_RMS, HAS_WEIGHT, HAS_DZ, ZERO_CENTERED, STAGE_W)
    return dw0, dw1, dw2, dw3, db0, db1, db2, db3


@gluon.jit
def _store_dx(xs, dys, ws, W, DZ, DX, row, N, stride_dz, at, c: gl.constexpr, cols, mean, rstd, c1, c2, dw, db,
              layout: gl.constexpr, IS_RMS: gl.constexpr, HAS_WEIGHT: gl.constexpr, HAS_DZ: gl.constexpr,
              ZERO_CENTERED: gl.constexpr, STAGE_W: gl.constexpr):
    """dx of the row's chunk (x, dy from shared-memory chunk `at`); returns (dw, db) with its terms added."""
    col_mask = cols < N
    xhat, dy, wdy = _chunk_values(xs, dys, ws, W, at, c, cols, col_mask, mean, rstd, layout, IS_RMS, HAS_WEIGHT,
                                  ZERO_CENTERED, STAGE_W)
    if IS_RMS:
        dx = (wdy - xhat * c1) * rstd
    else:
        dx = (wdy - (xhat * c1 + c2)) * rstd
    row64 = row.to(gl.int64)
    if HAS_DZ:
        dx += gl.load(DZ + row64 * stride_dz + cols, mask=col_mask, other=0.0).to(gl.float32)
    gl.store(DX + row64 * N + cols, dx.to(DX.dtype.element_ty), mask=col_mask)
    return dw + dy * xhat, db + dy


@gluon.jit
def _staged_weight(W, xs, offs, N, staged: gl.constexpr, CHUNKS: gl.constexpr, CHUNK: gl.constexpr,
                   STAGE_W: gl.constexpr):
    """STAGE_W: the weight's chunks (columns offs + c * CHUNK) copied into shared memory with the first row's
    copies (read twice per row, from L2 it would put a load's latency into every chunk of both passes);
    else `xs`, unused."""
    if STAGE_W:
        ws = gl.allocate_shared_memory(W.dtype.element_ty, [CHUNKS, CHUNK], staged)
        for c in gl.static_range(CHUNKS):
            async_copy.async_copy_global_to_shared(ws.index(c), W + c * CHUNK + offs, mask=c * CHUNK + offs < N)
    else:
        ws = xs
    return ws


@gluon.jit
def _store_sums(partial, N, offs, dw0, dw1, dw2, dw3, db0, db1, db2, db3, CHUNKS: gl.constexpr, CHUNK: gl.constexpr,
                HAS_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr):
    """The program's dgamma / dbeta sums of chunks 0..CHUNKS-1 into its partial row: dgamma, then dbeta."""
    _store_chunk_sums(partial, N, offs, dw0, db0, 0, CHUNK, HAS_WEIGHT, HAS_BIAS)
    if CHUNKS > 1:
        _store_chunk_sums(partial, N, offs, dw1, db1, 1, CHUNK, HAS_WEIGHT, HAS_BIAS)
    if CHUNKS > 2:
        _store_chunk_sums(partial, N, offs, dw2, db2, 2, CHUNK, HAS_WEIGHT, HAS_BIAS)
    if CHUNKS > 3:
        _store_chunk_sums(partial, N, offs, dw3, db3, 3, CHUNK, HAS_WEIGHT, HAS_BIAS)


@gluon.jit
def _store_chunk_sums(partial, N, offs, dw, db, c: gl.constexpr, CHUNK: gl.constexpr, HAS_WEIGHT: gl.constexpr,
                      HAS_BIAS: gl.constexpr):
    cols = c * CHUNK + offs
    col_mask = cols < N
    if HAS_WEIGHT:
        gl.store(partial + cols, dw, mask=col_mask)
    if HAS_BIAS:
        gl.store(partial + HAS_WEIGHT * N + cols, db, mask=col_mask)


@gluon.jit
def _chunk_values(xs, dys, ws, W, at, c: gl.constexpr, cols, col_mask, mean, rstd, layout: gl.constexpr,
                  IS_RMS: gl.constexpr, HAS_WEIGHT: gl.constexpr, ZERO_CENTERED: gl.constexpr, STAGE_W: gl.constexpr):
    """(xhat, dy, w * dy) of chunk c in fp32, zero past N (the copies zero-filled x and dy there); x and dy
    from shared-memory chunk `at` (c, or c in the row's slot)."""
    x = xs.index(at).load(layout).to(gl.float32)
    dy = dys.index(at).load(layout).to(gl.float32)
    if IS_RMS:
        xhat = x * rstd
    else:
        xhat = gl.where(col_mask, (x - mean) * rstd, 0.0)
    wdy = dy
    if HAS_WEIGHT:
        if STAGE_W:
            w = ws.index(c).load(layout).to(gl.float32)
        else:
            w = gl.load(W + cols, mask=col_mask, other=0.0).to(gl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
        wdy = dy * w
    return xhat, dy, wdy


@gluon.jit
def _issue_slot(xs, dys, SRC, DY, row, M, N, stride_src, stride_dy, offs, slot, CHUNKS: gl.constexpr,
                CHUNK: gl.constexpr):
    """cp.async of `row`'s slice (offs: its first chunk's columns) into row slot `slot`, one group per chunk."""
    row64 = row.to(gl.int64)
    for c in gl.static_range(CHUNKS):
        cols = c * CHUNK + offs
        mask = (cols < N) & (row < M)
        async_copy.async_copy_global_to_shared(xs.index(slot * CHUNKS + c), SRC + row64 * stride_src + cols, mask=mask)
        async_copy.async_copy_global_to_shared(dys.index(slot * CHUNKS + c), DY + row64 * stride_dy + cols, mask=mask)
        async_copy.commit_group()


@gluon.jit
def staged_slices_bwd_kernel(SRC, DY, DZ, W, MEAN, RSTD, DX, PARTIAL, EXCHANGE, stride_src, stride_dy, stride_dz, M, N,
                             IS_RMS: gl.constexpr, HAS_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr,
                             HAS_DZ: gl.constexpr, ZERO_CENTERED: gl.constexpr, VEC: gl.constexpr, CHUNKS: gl.constexpr,
                             STAGE_W: gl.constexpr, SLICES: gl.constexpr, RING: gl.constexpr, SLOTS: gl.constexpr):
    """Rows longer than one SM holds: program (slice c, group g) stages columns [c * CHUNKS * CHUNK, +CHUNKS *
    CHUNK) of rows g, g + G, ... in SLOTS row slots, and the slices of a row meet through tagged words
    (`_publish_row`, `_await_row`; partials added in slice order; launched cooperatively, so every slice is
    resident). SLOTS = 2: a row's sums are published and awaited in turn, the next row's copies in flight
    meanwhile. SLOTS = 3: row i + 1's sums are taken and published before row i's are awaited, so the
    exchange's round trip is covered by a pass over a row (the row after that in flight). SLICES: next_pow2 of
    the slice count; 1: whole rows, no exchange. EXCHANGE: `exchange_words`."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    CHUNK: gl.constexpr = VEC * 32 * NUM_WARPS
    gl.static_assert(CHUNKS <= 4)  # MAX_CHUNKS
    gl.static_assert((SLOTS == 2) or (SLOTS == 3))
    LEAD: gl.constexpr = SLOTS - 2  # rows whose sums are published ahead of the one being written
    gl.static_assert(RING >= 2 + 2 * LEAD)  # _await_row: a ring slot is read by every slice before reuse
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NUM_WARPS], [0])
    staged: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    xs = gl.allocate_shared_memory(SRC.dtype.element_ty, [SLOTS * CHUNKS, CHUNK], staged)
    dys = gl.allocate_shared_memory(DY.dtype.element_ty, [SLOTS * CHUNKS, CHUNK], staged)
    slice_id = gl.program_id(0)
    num_slices = gl.num_programs(0)
    group = gl.program_id(1)
    groups = gl.num_programs(1)
    words = EXCHANGE + groups + group * RING * 2 * num_slices  # the group's ring: [RING, 2, slices]
    offs = slice_id * (CHUNKS * CHUNK) + gl.arange(0, CHUNK, layout=layout)
    ws = _staged_weight(W, xs, offs, N, staged, CHUNKS, CHUNK, STAGE_W)
    zero = gl.zeros([CHUNK], gl.float32, layout)
    dw0, dw1, dw2, dw3 = zero, zero, zero, zero
    db0, db1, db2, db3 = zero, zero, zero, zero
    steps = (M - group + groups - 1) // groups
    for s in gl.static_range(SLOTS - 1):
        _issue_slot(xs, dys, SRC, DY, group + s * groups, M, N, stride_src, stride_dy, offs, s, CHUNKS, CHUNK)
    mean, rstd, part1, part2 = 0.0, 0.0, 0.0, 0.0
    if LEAD:  # row 0's sums taken (and published) before the loop, which then runs one row ahead
        mean, rstd, part1, part2 = _publish_row(xs, dys, ws, W, MEAN, RSTD, words, group, 0, slice_id, num_slices,
                                                offs, N, zero, layout, 0, CHUNKS, CHUNK, IS_RMS, HAS_WEIGHT,
                                                ZERO_CENTERED, STAGE_W, SLICES, RING)
    for step in range(0, steps):
        row = group + step * groups
        slot = step % SLOTS
        _issue_slot(xs, dys, SRC, DY, row + (SLOTS - 1) * groups, M, N, stride_src, stride_dy, offs,
                    (step + SLOTS - 1) % SLOTS, CHUNKS, CHUNK)
        if LEAD:
            mean_next, rstd_next, part1_next, part2_next = mean, rstd, part1, part2
            if step + 1 < steps:
                mean_next, rstd_next, part1_next, part2_next = _publish_row(
                    xs, dys, ws, W, MEAN, RSTD, words, group, step + 1, slice_id, num_slices, offs, N, zero, layout,
                    ((step + 1) % SLOTS) * CHUNKS, CHUNKS, CHUNK, IS_RMS, HAS_WEIGHT, ZERO_CENTERED, STAGE_W,
                    SLICES, RING)
        else:
            mean, rstd, part1, part2 = _publish_row(xs, dys, ws, W, MEAN, RSTD, words, group, step, slice_id,
                                                    num_slices, offs, N, zero, layout, slot * CHUNKS, CHUNKS, CHUNK,
                                                    IS_RMS, HAS_WEIGHT, ZERO_CENTERED, STAGE_W, SLICES, RING)
        if SLICES > 1:
            c1, c2 = _await_row(words, step, num_slices, N, SLICES, IS_RMS, RING)
        else:  # the whole row in this program: its own sums
            c1 = part1 / N
            c2 = part2 / N
        dw0, dw1, dw2, dw3, db0, db1, db2, db3 = _dx_row(
            xs, dys, ws, DZ, W, DX, row, N, stride_dz, offs, slot * CHUNKS, mean, rstd, c1, c2, dw0, dw1, dw2, dw3,
            db0, db1, db2, db3, layout, CHUNKS, CHUNK, IS_RMS, HAS_WEIGHT, HAS_DZ, ZERO_CENTERED, STAGE_W)
        if LEAD:
            mean, rstd, part1, part2 = mean_next, rstd_next, part1_next, part2_next
    async_copy.wait_group(0)
    _store_sums(PARTIAL + group.to(gl.int64) * (N * (HAS_WEIGHT + HAS_BIAS)), N, offs, dw0, dw1, dw2, dw3, db0, db1,
                db2, db3, CHUNKS, CHUNK, HAS_WEIGHT, HAS_BIAS)
    # The group's last slice out (every slice is past its last read then) zeroes the group's words, so the next
    # launch (a CUDA graph replay too) starts from tags that match no row.
    if SLICES > 1:
        if gl.atomic_add(EXCHANGE + group, 1, sem="acq_rel", scope="gpu") == num_slices - 1:
            for i in gl.static_range(RING * 2 * SLICES):
                gl.store(words + i, 0, mask=i < RING * 2 * num_slices)
            gl.store(EXCHANGE + group, 0)


@gluon.jit
def _publish_row(xs, dys, ws, W, MEAN, RSTD, words, group, step, slice_id, num_slices, offs, N, zero,
                 layout: gl.constexpr, first, CHUNKS: gl.constexpr, CHUNK: gl.constexpr, IS_RMS: gl.constexpr,
                 HAS_WEIGHT: gl.constexpr, ZERO_CENTERED: gl.constexpr, STAGE_W: gl.constexpr, SLICES: gl.constexpr,
                 RING: gl.constexpr):
    """The group's `step`-th row: its mean and rstd, and this slice's partial row sums (its chunks at `first`
    as they land; the next rows' copies may be in flight). With several slices each partial goes out in one
    64-bit word beside its row's tag (step + 1), a relaxed store: no counter to publish, so no release fence
    (which would wait for this program's copies and stores in flight) and no barrier."""
    row = group + step * gl.num_programs(1)
    mean, rstd, sum_xwdy, sum_wdy = _row_terms(xs, dys, ws, W, MEAN, RSTD, row, first, offs, N, zero, layout, CHUNKS,
                                               CHUNK, IS_RMS, HAS_WEIGHT, ZERO_CENTERED, STAGE_W)
    part1, part2 = _row_sums(sum_xwdy, sum_wdy, IS_RMS)
    if SLICES > 1:
        at = words + (step % RING) * 2 * num_slices
        tag = gl.to_tensor(step + 1).to(gl.int64) << 32
        gl.atomic_xchg(at + slice_id, tag | _bits(part1), sem="relaxed", scope="gpu")
        if not IS_RMS:
            gl.atomic_xchg(at + num_slices + slice_id, tag | _bits(part2), sem="relaxed", scope="gpu")
    return mean, rstd, part1, part2


@gluon.jit
def _await_row(words, step, num_slices, N, SLICES: gl.constexpr, IS_RMS: gl.constexpr, RING: gl.constexpr):
    """Poll the `step`-th row's words (every thread for itself, all slices' words per round trip) until each
    carries the row's tag; return mean(xhat * w * dy) and mean(w * dy), the partials added in slice order.
    A ring slot is published again only after every slice has read it: a slice publishes row i + RING after
    its wait for row i + RING - 1 - LEAD, so after every slice published that row, which each did after
    reading row i + RING - 2 - 2 * LEAD >= i."""
    layout: gl.constexpr = gl.BlockedLayout([SLICES], [32], [gl.num_warps()], [0])
    at = words + (step % RING) * 2 * num_slices
    sl = gl.arange(0, SLICES, layout=layout)
    valid = sl < num_slices
    tag = gl.to_tensor(step + 1).to(gl.int64) << 32
    pending = True
    part1 = gl.zeros([SLICES], gl.int64, layout)
    part2 = part1
    while pending:
        part1 = gl.load(at + sl, mask=valid, other=tag, volatile=True)
        ready = (part1 >> 32) == (step + 1)
        if not IS_RMS:
            part2 = gl.load(at + num_slices + sl, mask=valid, other=tag, volatile=True)
            ready = ready & ((part2 >> 32) == (step + 1))
        pending = gl.min(ready.to(gl.int32), axis=0) == 0
    c1 = gl.sum(_value(part1), axis=0) / N
    c2 = c1
    if not IS_RMS:
        c2 = gl.sum(_value(part2), axis=0) / N
    return c1, c2


@gluon.jit
def _bits(value):
    """The fp32 scalar's bits in the low half of an int64."""
    return value.to(gl.int32, bitcast=True).to(gl.int64) & 0xFFFFFFFF


@gluon.jit
def _value(word):
    """The fp32 value in the low half of an int64 word."""
    return (word & 0xFFFFFFFF).to(gl.int32).to(gl.float32, bitcast=True)


@functools.lru_cache(maxsize=None)
def exchange_words(device, stream: int, programs: int):
    """`staged_slices_bwd_kernel`'s exchange for grids of up to `programs` (G * C): int64, per group one
    last-slice-out counter, then its ring of tagged words ([G] + [G, RING, 2, C] <= programs * (2 * RING + 1)),
    zeroed once (tag 0 matches no row); the kernel leaves it zero. One per stream: two launches running at once
    must not share it."""
    return torch.zeros(programs * (2 * EXCHANGE_RING + 1), dtype=torch.int64, device=device)
