"""The `.data`-write checks' checksum (`output_checks.fingerprint`) as one kernel: a hashed sum of a tensor's words,
read once in place, whatever its strides.

Per block of rows (rows: every index of the words but the last, in order), the uint32 sum, wrapping, of
fmix32(word + i * 0x9E3779B9) over the block's words, i the word's index in the tensor (r * n + column), fmix32
MurmurHash3's finalizer, a bijection of uint32: any one changed word changes its block's sum, and a change spread
over many words (every element doubled: one more in each exponent; elements moved) changes it but with a chance of
about 2**-32, where a plain or position-weighted sum misses a change of 2**k in every word of a block whose size
2**(32 - k) divides. Integer arithmetic gives one result in any order: the kernel and `reference.fingerprint`
compute the same sums, bitwise.
"""

import torch
import triton
import triton.language as tl

from .launch import Launcher


@triton.jit
def fingerprint_kernel(W, OUT, R, N, D1, D2, stride0, stride1, stride2, stride3,
                       BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, WORD_BITS: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    m = rows % D2
    b = (rows // D2) % D1
    a = rows // (D2 * D1)
    base = a.to(tl.int64) * stride0 + b.to(tl.int64) * stride1 + m.to(tl.int64) * stride2
    first = rows.to(tl.uint32) * N  # the row's first word index, wrapping (N: an int32, or constexpr 1)
    acc = tl.zeros([BLOCK_R], dtype=tl.uint32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = (rows[:, None] < R) & (cols[None, :] < N)
        word = tl.load(W + base[:, None] + cols[None, :].to(tl.int64) * stride3, mask=mask, other=0)
        if WORD_BITS == 32:
            word = word.to(tl.uint32, bitcast=True)
        else:
            word = word.to(tl.uint16, bitcast=True).to(tl.uint32)
        h = word + (first[:, None] + cols[None, :].to(tl.uint32)) * 0x9E3779B9
        h ^= h >> 16
        h *= 0x85EBCA6B
        h ^= h >> 13
        h *= 0xC2B2AE35
        h ^= h >> 16
        acc += tl.sum(tl.where(mask, h, 0), axis=1)
    tl.store(OUT + pid, tl.sum(acc, axis=0).to(tl.int32, bitcast=True))


_launchers: dict = {}  # (rows per block, block_n, word size) -> Launcher; OUT (fresh, int32) is not keyed


def fingerprint(words: torch.Tensor, rows_per_block: int, block_n: int) -> torch.Tensor:
    """The blocks' sums (int32, their uint32 bits) of 4-D `words` (int32 or int16) on a GPU, read in place, each
    program summing one block `block_n` words of a row at a time."""
    d0, d1, d2, n = words.shape
    r = d0 * d1 * d2
    out = words.new_empty(-(-r // rows_per_block), dtype=torch.int32)
    if r and n:
        key = (rows_per_block, block_n, words.element_size())
        launch = _launchers.get(key)
        if launch is None:
            launch = _launchers[key] = Launcher(fingerprint_kernel, 4, derived=(1,), BLOCK_R=rows_per_block,
                                                BLOCK_N=block_n, WORD_BITS=8 * words.element_size())
        launch((out.numel(),), words, out, r, n, d1, d2, *words.stride())
    elif r:
        out.zero_()
    return out
