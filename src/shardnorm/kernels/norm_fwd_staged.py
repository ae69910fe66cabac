"""Long-row forward with the row staged in shared memory (Gluon), so x is read from HBM once.

One persistent program per SM copies a row of x into shared memory chunk by chunk with `cp.async`, takes the
statistics as the chunks land (LayerNorm's in one pass too, `_warp_moments`) and writes y, copying the next
row's chunk into each chunk's place as it is consumed. LayerNorm holds the first chunks' weight and bias in
the shared memory the row leaves free (`param_chunks`). Gluon does not run under TRITON_INTERPRET: CI checks
the chunked `tl` forward, the GPU tests this one (tests/test_long_rows_staged.py).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .norm_bwd_staged import SMEM_BYTES, add_pairs


SCRATCH_BYTES = 1024  # left free for the reductions' scratch


def fits(n: int, chunk: int, x_size: int) -> bool:
    """Whether a row of n columns of x_size-byte x fits shared memory in chunks of `chunk`."""
    return -(-n // chunk) * chunk * x_size <= SMEM_BYTES


def param_chunks(n: int, chunk: int, x_size: int, param_size: int, params: int) -> int:
    """How many leading chunks' parameters (`params` tensors of param_size-byte elements) fit in the shared
    memory a row of x leaves free (65536 bf16 columns: 3 of 8 chunks' weight and bias, 1 with fp32 ones)."""
    if not params:
        return 0
    chunks = -(-n // chunk)
    free = SMEM_BYTES - SCRATCH_BYTES - chunks * chunk * x_size
    return max(0, min(chunks, free // (chunk * param_size * params)))


@gluon.jit
def _issue_x(xs, X, row, M, N, stride_x, offs, c: gl.constexpr, CHUNK: gl.constexpr):
    """cp.async of chunk c of `row` of x (nothing past M: the copy zero-fills) into its slot; one group."""
    cols = c * CHUNK + offs
    async_copy.async_copy_global_to_shared(xs.index(c), X + row.to(gl.int64) * stride_x + cols,
                                           mask=(cols < N) & (row < M))
    async_copy.commit_group()


@gluon.jit
def _chunk_params(ws, bs, W, B, offs, N, c: gl.constexpr, CHUNK: gl.constexpr, PARAM_CHUNKS: gl.constexpr,
                  layout: gl.constexpr, HAS_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr, ZERO_CENTERED: gl.constexpr):
    """Chunk c's weight (+ 1 when zero-centered) and bias in fp32, 1 and 0 where absent: from shared memory for
    the first PARAM_CHUNKS chunks (copied once per program), else from global memory (L2)."""
    cols = c * CHUNK + offs
    w = 1.0
    b = 0.0
    if HAS_WEIGHT:
        if c < PARAM_CHUNKS:
            w = ws.index(c).load(layout).to(gl.float32)
        else:
            w = gl.load(W + cols, mask=cols < N, other=0.0).to(gl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
    if HAS_BIAS:
        if c < PARAM_CHUNKS:
            b = bs.index(c).load(layout).to(gl.float32)
        else:
            b = gl.load(B + cols, mask=cols < N, other=0.0).to(gl.float32)
    return w, b


@gluon.jit
def _chan(n_a, mean_a, m2_a, n_b, mean_b, m2_b):
    """Combine of (count, mean, sum of squared deviations) of two parts of a row (Chan et al.)."""
    n = n_a + n_b
    delta = mean_b - mean_a
    frac = n_b / n
    return n, mean_a + delta * frac, m2_a + m2_b + delta * delta * n_a * frac


@gluon.jit
def _warp_moments(xs, N, CHUNKS: gl.constexpr, VEC: gl.constexpr, NUM_WARPS: gl.constexpr):
    """A LayerNorm row's mean and variance in one pass with no block-wide step before the last: each warp sums
    x - K_w and (x - K_w)^2 over its columns of every chunk, K_w the mean of its columns of chunk 0 (a reduction
    within the warp), and the warps' (count, mean, M2) meet in one Chan reduction. A warp's variance loses at most
    log2(CHUNKS) bits to cancellation (its chunk-0 columns are 1 / CHUNKS of its columns). Needs N >= CHUNK (every
    warp has columns in chunk 0): the staged forward's rows are longer than 32768."""
    W: gl.constexpr = 32 * VEC  # a warp's columns of a chunk
    CHUNK: gl.constexpr = W * NUM_WARPS
    layout2: gl.constexpr = gl.BlockedLayout([1, VEC], [1, 32], [NUM_WARPS, 1], [1, 0])
    warp = gl.arange(0, NUM_WARPS, layout=gl.SliceLayout(1, layout2))
    cols = warp[:, None] * W + gl.arange(0, W, layout=gl.SliceLayout(0, layout2))[None, :]
    count = gl.minimum(gl.maximum(N - warp * W, 1), W).to(gl.float32)  # chunk 0's columns of each warp
    async_copy.wait_group(CHUNKS - 1)
    first = xs.index(0).reshape([NUM_WARPS, W]).load(layout2).to(gl.float32)  # zero-filled past N
    shift = gl.sum(first, axis=1) / count
    d = gl.where(cols < N, first - shift[:, None], 0.0)
    s1 = d
    s2 = d * d
    for c in gl.static_range(1, CHUNKS):
        async_copy.wait_group(CHUNKS - 1 - c)
        d = gl.where(c * CHUNK + cols < N,
                     xs.index(c).reshape([NUM_WARPS, W]).load(layout2).to(gl.float32) - shift[:, None], 0.0)
        s1 += d
        s2 += d * d
        count += gl.minimum(gl.maximum(N - c * CHUNK - warp * W, 0), W).to(gl.float32)
    t1, t2 = gl.reduce((s1, s2), 1, add_pairs)  # within each warp
    n, mean, m2 = gl.reduce((count, shift + t1 / count, gl.maximum(t2 - t1 * t1 / count, 0.0)), 0, _chan)
    return mean, m2 / n


@gluon.jit
def staged_fwd_kernel(X, W, B, Y, MEAN, RSTD, stride_x, M, N, eps,
                      IS_RMS: gl.constexpr, HAS_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr,
                      ZERO_CENTERED: gl.constexpr, VEC: gl.constexpr, CHUNKS: gl.constexpr,
                      PARAM_CHUNKS: gl.constexpr, HOLD_CHUNK0: gl.constexpr):
    """PARAM_CHUNKS: leading chunks whose parameters are copied into shared memory once (`param_chunks`);
    HOLD_CHUNK0: chunk 0's 2-byte parameters held in registers across rows where none fit in shared memory
    (loaded at the y pass's start, LayerNorm measured 87 % of copy instead of 94 %: an L2 round trip a row)."""
    NUM_WARPS: gl.constexpr = gl.num_warps()
    CHUNK: gl.constexpr = VEC * 32 * NUM_WARPS
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NUM_WARPS], [0])
    staged: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # per chunk; index() takes the chunk
    xs = gl.allocate_shared_memory(X.dtype.element_ty, [CHUNKS, CHUNK], staged)
    offs = gl.arange(0, CHUNK, layout=layout)
    zero = gl.zeros([CHUNK], gl.float32, layout)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    ws = xs  # unused unless PARAM_CHUNKS
    bs = xs
    if PARAM_CHUNKS > 0:  # one copy group, older than the row's: waiting for x's chunk 0 waits for it too
        if HAS_WEIGHT:
            ws = gl.allocate_shared_memory(W.dtype.element_ty, [PARAM_CHUNKS, CHUNK], staged)
            for c in gl.static_range(PARAM_CHUNKS):
                async_copy.async_copy_global_to_shared(ws.index(c), W + c * CHUNK + offs, mask=c * CHUNK + offs < N)
        if HAS_BIAS:
            bs = gl.allocate_shared_memory(B.dtype.element_ty, [PARAM_CHUNKS, CHUNK], staged)
            for c in gl.static_range(PARAM_CHUNKS):
                async_copy.async_copy_global_to_shared(bs.index(c), B + c * CHUNK + offs, mask=c * CHUNK + offs < N)
        async_copy.commit_group()
    for c in gl.static_range(CHUNKS):
        _issue_x(xs, X, pid, M, N, stride_x, offs, c, CHUNK)
    if HOLD_CHUNK0:
        w_first, b_first = _chunk_params(ws, bs, W, B, offs, N, 0, CHUNK, 0, layout, HAS_WEIGHT, HAS_BIAS,
                                         ZERO_CENTERED)
    for row in range(pid, M, programs):
        # Statistics, each chunk as soon as its copy has landed (zero-filled past N).
        mean = 0.0
        if IS_RMS:
            total = zero
            for c in gl.static_range(CHUNKS):
                async_copy.wait_group(CHUNKS - 1 - c)
                x = xs.index(c).load(layout).to(gl.float32)
                total += x * x
            var = gl.sum(total, axis=0) / N
        else:
            mean, var = _warp_moments(xs, N, CHUNKS, VEC, NUM_WARPS)
        rstd = 1.0 / gl.sqrt(var + eps)
        # y; the parameters of chunk c + 1 are in flight while chunk c is written.
        row64 = row.to(gl.int64)
        if HOLD_CHUNK0:
            w_next, b_next = w_first, b_first
        else:
            w_next, b_next = _chunk_params(ws, bs, W, B, offs, N, 0, CHUNK, PARAM_CHUNKS, layout, HAS_WEIGHT, HAS_BIAS,
                                           ZERO_CENTERED)
        for c in gl.static_range(CHUNKS):
            cols = c * CHUNK + offs
            col_mask = cols < N
            w, b = w_next, b_next
            if c + 1 < CHUNKS:
                w_next, b_next = _chunk_params(ws, bs, W, B, offs, N, c + 1, CHUNK, PARAM_CHUNKS, layout, HAS_WEIGHT,
                                               HAS_BIAS, ZERO_CENTERED)
            x = xs.index(c).load(layout).to(gl.float32)
            if IS_RMS:
                y = x * rstd
                if HAS_WEIGHT:
                    y = y * w
            else:  # one multiply-add an element: (x - mean) * rstd * w + b = x * scale + (b - mean * scale)
                scale = rstd * w
                y = x * scale + (b - mean * scale)
            gl.store(Y + row64 * N + cols, y.to(Y.dtype.element_ty), mask=col_mask)
            _issue_x(xs, X, row + programs, M, N, stride_x, offs, c, CHUNK)
        if not IS_RMS:
            gl.store(MEAN + row, mean)
        gl.store(RSTD + row, rstd)
    async_copy.wait_group(0)  # the last (empty) copies, before the program's shared memory goes
