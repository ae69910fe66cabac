"""Long-row forward with the row staged in shared memory (Gluon), so x is read from HBM once.

Above 32768 columns a row does not fit one program's registers and the `tl` forward reads it twice
(statistics, then y: 67 % of copy at best, 76-78 % with L2 hits). Here one persistent program per SM
copies a row of x into shared memory chunk by chunk with `cp.async` (a 65536-column bf16 row is 128 KB),
takes the statistics as the chunks land (LayerNorm's in one pass too, `_shifted_moments`) and writes y; as
each chunk is consumed in that last pass the same thread copies the next row's chunk into its place. The
weight and bias come from L2, each chunk's loaded one chunk ahead.
Same staging as the backward (`norm_bwd_staged.py`); Gluon does not run under TRITON_INTERPRET, so CI
checks the chunked `tl` forward (the same result to fp32 rounding) and the GPU tests this one
(tests/test_long_rows_staged.py).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from .norm_bwd_staged import SMEM_BYTES, add_pairs


def fits(n: int, chunk: int, x_size: int) -> bool:
    """Whether a row of n columns of x_size-byte x fits shared memory in chunks of `chunk`."""
    return -(-n // chunk) * chunk * x_size <= SMEM_BYTES


@gluon.jit
def _issue_x(xs, X, row, M, N, stride_x, offs, c: gl.constexpr, CHUNK: gl.constexpr):
    """cp.async of chunk c of `row` of x (nothing past M: the copy zero-fills) into its slot; one group."""
    cols = c * CHUNK + offs
    async_copy.async_copy_global_to_shared(xs.index(c), X + row.to(gl.int64) * stride_x + cols,
                                           mask=(cols < N) & (row < M))
    async_copy.commit_group()


@gluon.jit
def _params(W, B, cols, col_mask, HAS_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr, ZERO_CENTERED: gl.constexpr):
    """Weight (+ 1 when zero-centered) and bias of `cols` in fp32; 1 and 0 where absent."""
    w = 1.0
    b = 0.0
    if HAS_WEIGHT:
        w = gl.load(W + cols, mask=col_mask, other=0.0).to(gl.float32)
        if ZERO_CENTERED:
            w = w + 1.0
    if HAS_BIAS:
        b = gl.load(B + cols, mask=col_mask, other=0.0).to(gl.float32)
    return w, b


@gluon.jit
def _shifted_moments(xs, offs, N, zero, layout: gl.constexpr, CHUNKS: gl.constexpr, CHUNK: gl.constexpr):
    """A LayerNorm row's mean and variance in one pass over its chunks in shared memory: sums of x - K and
    (x - K)^2 with K the mean of chunk 0 (reduced while the later chunks are still landing). The variance
    E[d^2] - E[d]^2 loses at most log2(N / CHUNK) bits to cancellation: chunk 0's squared deviations from the
    row mean are at least CHUNK (K - mean)^2 and at most N var, so (K - mean)^2 <= (N / CHUNK) var."""
    async_copy.wait_group(CHUNKS - 1)
    first = xs.index(0).load(layout).to(gl.float32)  # zero-filled past N
    shift = gl.sum(first, axis=0) / gl.minimum(N, CHUNK)
    d = gl.where(offs < N, first - shift, 0.0)
    s1 = d
    s2 = d * d
    for c in gl.static_range(1, CHUNKS):
        async_copy.wait_group(CHUNKS - 1 - c)
        d = gl.where(c * CHUNK + offs < N, xs.index(c).load(layout).to(gl.float32) - shift, 0.0)
        s1 += d
        s2 += d * d
    t1, t2 = gl.reduce((s1, s2), 0, add_pairs)
    d_mean = t1 / N
    return shift + d_mean, gl.maximum(t2 / N - d_mean * d_mean, 0.0)


@gluon.jit
def staged_fwd_kernel(X, W, B, Y, MEAN, RSTD, stride_x, M, N, eps,
                      IS_RMS: gl.constexpr, HAS_WEIGHT: gl.constexpr, HAS_BIAS: gl.constexpr,
                      ZERO_CENTERED: gl.constexpr, VEC: gl.constexpr, CHUNKS: gl.constexpr):
    NUM_WARPS: gl.constexpr = gl.num_warps()
    CHUNK: gl.constexpr = VEC * 32 * NUM_WARPS
    layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NUM_WARPS], [0])
    staged: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # per chunk; index() takes the chunk
    xs = gl.allocate_shared_memory(X.dtype.element_ty, [CHUNKS, CHUNK], staged)
    offs = gl.arange(0, CHUNK, layout=layout)
    zero = gl.zeros([CHUNK], gl.float32, layout)
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    for c in gl.static_range(CHUNKS):
        _issue_x(xs, X, pid, M, N, stride_x, offs, c, CHUNK)
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
            mean, var = _shifted_moments(xs, offs, N, zero, layout, CHUNKS, CHUNK)
        rstd = 1.0 / gl.sqrt(var + eps)
        # y; the parameters of chunk c + 1 are in flight while chunk c is written.
        row64 = row.to(gl.int64)
        w_next, b_next = _params(W, B, offs, offs < N, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED)
        for c in gl.static_range(CHUNKS):
            cols = c * CHUNK + offs
            col_mask = cols < N
            w, b = w_next, b_next
            if c + 1 < CHUNKS:
                w_next, b_next = _params(W, B, cols + CHUNK, cols + CHUNK < N, HAS_WEIGHT, HAS_BIAS, ZERO_CENTERED)
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
