"""Batch invariance: a row's y and dx are bitwise the same whatever other rows share its call.

Launch configs depend on N only, and every kernel reduces a row in the same order wherever the row sits in
the batch, so computing rows alone, in a few, or among many must give the same bits. Checked on the Triton
kernels (interpreted on CPU, on the GPU where there is one) for each path a row can take: one pass, the tail
tile, and the long-row paths (chunked forward, split backward), reached at small N by lowering the one-pass
limits and chunk widths. dgamma/dbeta are sums over the batch's rows and are not part of the guarantee.
"""

import random

import pytest
import torch

import shardnorm
from conftest import backend_device
from shardnorm.kernels import config

norm_bwd_module = __import__("sys").modules["shardnorm.kernels.norm_bwd"]
norm_fwd_module = __import__("sys").modules["shardnorm.kernels.norm_fwd"]
MANY = 67  # rows: several row blocks and persistent programs per program under the interpreter's 8 SMs


def _forget_plans():
    for cached in (config.fwd_config, config.bwd_config, norm_fwd_module._plan, norm_bwd_module._plan):
        cached.cache_clear()


@pytest.fixture
def long_rows(monkeypatch):
    """Rows above 128 columns take the long-row paths, walked in 64-column chunks / tiles."""
    tile = config.TileConfig
    monkeypatch.setattr(config, "MAX_FUSED_N_FWD", 128)
    monkeypatch.setattr(config, "MAX_FUSED_N_BWD", {0: 128, 1: 128, 2: 128})
    monkeypatch.setattr(config, "FWD_CHUNKED", tile(block_m=1, block_n=64, num_warps=4, single_pass=False))
    monkeypatch.setattr(config, "FWD_CHUNKED_FP32_PARAMS",
                        tile(block_m=2, block_n=64, num_warps=4, single_pass=False, num_stages=2))
    monkeypatch.setattr(config, "BWD_SPLIT", config.SplitBwdConfig(
        row_sums=tile(block_m=1, block_n=64, num_warps=4, programs_per_sm=2, num_stages=2),
        dx=tile(block_m=1, block_n=64, num_warps=4)))
    _forget_plans()
    yield
    _forget_plans()


def _rows_of_every_batch(n, rms, dtype, weight_dtype, strided_dy, seed):
    """y and dx of rows [0, MANY) computed in batches of MANY, of 3 (rows 4-6), of 1 (row 5), of 2 (rows 5-6)."""
    device = backend_device("triton")
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(MANY, n, generator=gen) * 2 + 0.5).to(dtype).to(device)
    wide = torch.randn(MANY, n + 24, generator=gen).to(dtype).to(device)
    dy = wide[:, 8:8 + n] if strided_dy else wide[:, :n].contiguous()  # strided: rows n + 24 apart
    w = torch.randn(n, generator=gen).to(weight_dtype).to(device)
    b = None if rms else torch.randn(n, generator=gen).to(weight_dtype).to(device)

    def run(start: int, stop: int):
        xs = x[start:stop].clone().requires_grad_()
        y = shardnorm.rms_norm(xs, n, w) if rms else shardnorm.layer_norm(xs, n, w, b)
        (dx,) = torch.autograd.grad(y, xs, dy[start:stop])
        return y.detach(), dx

    return {rows: run(*rows) for rows in ((0, MANY), (4, 7), (5, 6), (5, 7))}


CASES = [(rms, dtype, weight_dtype, strided)
         for rms in (False, True) for dtype, weight_dtype in ((torch.bfloat16, torch.bfloat16),
                                                               (torch.bfloat16, torch.float32),
                                                               (torch.float32, torch.float32))
         for strided in (False, True)]
IDS = [f"{'rms' if rms else 'ln'}-{str(d)[6:]}-w{str(w)[6:]}-{'strided_dy' if s else 'dense_dy'}"
       for rms, d, w, s in CASES]


def _check(n, rms, dtype, weight_dtype, strided):
    seed = random.getrandbits(31)
    results = _rows_of_every_batch(n, rms, dtype, weight_dtype, strided, seed)
    y_all, dx_all = results[0, MANY]
    for (start, stop), (y, dx) in results.items():
        ctx = f"rows {start}-{stop - 1} alone vs among {MANY} (n={n}, seed={seed})"
        assert torch.equal(y, y_all[start:stop]), f"y: {ctx}"
        assert torch.equal(dx, dx_all[start:stop]), f"dx: {ctx}"


@pytest.fixture(autouse=True)
def kernels(triton_backend):
    """Every test here runs the Triton kernels (tests/conftest.py)."""


@pytest.mark.parametrize("rms,dtype,weight_dtype,strided", CASES, ids=IDS)
@pytest.mark.parametrize("n", [7, 300], ids=["tiny_rows", "one_pass"])
def test_short_rows(n, rms, dtype, weight_dtype, strided):
    _check(n, rms, dtype, weight_dtype, strided)


@pytest.mark.parametrize("rms,dtype,weight_dtype,strided", [c for c in CASES if c[1] == c[2] == torch.bfloat16],
                         ids=[i for c, i in zip(CASES, IDS) if c[1] == c[2] == torch.bfloat16])
def test_tail_tile(rms, dtype, weight_dtype, strided):
    """5120 columns: the forward's (LayerNorm: one 8192 tile) and RMSNorm's backward 4096 + 1024 tail tiles."""
    _check(5120, rms, dtype, weight_dtype, strided)


LONG_CASES = [(c, i) for c, i in zip(CASES, IDS) if c[3] == (c[1] == c[2] == torch.bfloat16)]


@pytest.mark.parametrize("rms,dtype,weight_dtype,strided", [c for c, _ in LONG_CASES], ids=[i for _, i in LONG_CASES])
def test_long_rows(long_rows, rms, dtype, weight_dtype, strided):
    """300 columns as the long rows take them: 5 chunks of the forward, 5 column tiles of the split backward."""
    fwd = config.fwd_config(300, weight_dtype.itemsize, not rms)
    assert not fwd.single_pass
    assert isinstance(config.bwd_config(300, 1 if rms else 2, weight_dtype.itemsize, rms), config.SplitBwdConfig)
    _check(300, rms, dtype, weight_dtype, strided)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="rows this long take minutes under the interpreter")
@pytest.mark.parametrize("rms", [False, True], ids=["ln", "rms"])
@pytest.mark.parametrize("n", [20000, 40000, 65536])
@pytest.mark.parametrize("strided", [False, True], ids=["dense_dy", "strided_dy"])
def test_long_rows_with_default_kernels(rms, n, strided):
    """Long rows with the default limits: on Hopper the staged kernels (backward from 20000, forward from 40000)
    for bf16 rows, which hold whole rows per program; elsewhere the chunked forward and split backward."""
    _check(n, rms, torch.bfloat16, torch.bfloat16, strided)
