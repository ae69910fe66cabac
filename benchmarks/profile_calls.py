"""Where one call's time goes, per benchmark shape: host time vs GPU time (no device needed to read).

    python benchmarks/profile_calls.py [--out calls.json] [--shapes 32768x1024 262144x64]

For shardnorm's forward and backward (and torch eager's, for scale) it prints the `do_bench` median
the kernel benchmark reports, the GPU time of the kernels the call launched (torch.profiler), and the
host time of one call (Python, autograd, allocations, launches; timed back to back without a sync).
Where do_bench is near the GPU time the kernel is the bottleneck; where it is near the host time,
no kernel change shows in the benchmark. It also times the bare pieces of a call.
"""

import argparse
import importlib
import json
import statistics
import time
import unittest.mock

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

import shardnorm
from bench_kernels import GENAI, LLAMA, QK_NORM
from shardnorm.kernels import norm_bwd as launch_bwd, norm_fwd as launch_fwd

SHAPES = GENAI + LLAMA + QK_NORM


def host_us(fn, before=None, calls=50) -> float:
    """Median host time of one call, calls queued back to back (the GPU never blocks the host)."""
    samples = []
    for _ in range(5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            if before:
                before()
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def gpu_us(fn, before=None, calls=10) -> float:
    """GPU time per call of every kernel fn launches (profiler device time)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if before:
                before()
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls


def measure(m, n, rms, provider):
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = None if rms else torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    if provider == "shardnorm":
        fwd = (lambda: shardnorm.rms_norm(x, n, w, 1e-6)) if rms else (lambda: shardnorm.layer_norm(x, n, w, b))
    else:
        fwd = (lambda: F.rms_norm(x, (n,), w, 1e-6)) if rms else (lambda: F.layer_norm(x, (n,), w, b))
    leaves = [t for t in (x, w, b) if t is not None]

    def clear():
        for t in leaves:
            t.grad = None

    y = fwd()
    bwd = lambda: y.backward(dy, retain_graph=True)  # noqa: E731
    out = {}
    for name, fn, before, nbytes in (("fwd", fwd, None, 2 * x.numel() * 2), ("bwd", bwd, clear, 3 * x.numel() * 2)):
        bench_ms = do_bench(fn, grad_to_none=leaves if before else None, return_mode="median")
        out[name] = dict(bench_us=bench_ms * 1e3, gpu_us=gpu_us(fn, before), host_us=host_us(fn, before),
                         ideal_us_at_3tbs=nbytes / 3e6)
    return out


def pieces(m=32768, n=1024):
    """Host cost of the layers of one shardnorm call, from the bare Triton launch up."""
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn_like(x)
    y, z, mean, rstd = launch_fwd(x, w, b, None, 1e-5, False, False)
    out = dict(
        launcher_fwd=host_us(lambda: launch_fwd(x, w, b, None, 1e-5, False, False)),
        launcher_bwd=host_us(lambda: launch_bwd(dy, None, x, w, mean, rstd, True, False, False)),
        empty_x4=host_us(lambda: [torch.empty(m, n, device="cuda") for _ in range(4)]),
        torch_add=host_us(lambda: torch.add(x, x)),
    )
    xg = x.detach().requires_grad_()
    out["functional_fwd"] = host_us(lambda: shardnorm.layer_norm(xg, n, w, b))
    with torch.no_grad():
        out["functional_fwd_no_grad"] = host_us(lambda: shardnorm.layer_norm(xg, n, w, b))

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return g

    class Fresh3(torch.autograd.Function):
        """Our backward's autograd shape: three leaves, three freshly allocated grads."""

        @staticmethod
        def forward(ctx, a, wa, ba):
            return a.view_as(a)

        @staticmethod
        def backward(ctx, g):
            return torch.empty_like(g), torch.empty(n, device="cuda"), torch.empty(n, device="cuda")

    wg, bg = w.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    yi, y3 = Identity.apply(xg), Fresh3.apply(xg, wg, bg)

    def clear():
        xg.grad = wg.grad = bg.grad = None

    out["autograd_python_function_bwd"] = host_us(lambda: yi.backward(dy, retain_graph=True), clear)
    out["autograd_3_leaves_bwd"] = host_us(lambda: y3.backward(dy, retain_graph=True), clear)
    out.update(backward_body(xg, wg, bg, dy, clear))
    out.update(triton_launch_pieces(x, w, b))
    return out


def backward_body(x, w, b, dy, clear, calls=200):
    """Host time of shardnorm's whole backward call and of its Python backward alone (which runs on
    the autograd engine's device thread): the difference is the engine's."""
    from shardnorm import ops

    inner = ops._EagerNorm.backward
    spent = []

    def timed(ctx, *grads):
        start = time.perf_counter()
        result = inner(ctx, *grads)
        spent.append(time.perf_counter() - start)
        return result

    y = shardnorm.layer_norm(x, x.shape[1], w, b)
    total = host_us(lambda: y.backward(dy, retain_graph=True), clear)
    ops._EagerNorm.backward = staticmethod(timed)
    try:
        for _ in range(calls):
            clear()
            y.backward(dy, retain_graph=True)
    finally:
        ops._EagerNorm.backward = staticmethod(inner)
    return dict(shardnorm_bwd_fp32_params=total, shardnorm_bwd_python_body=statistics.median(spent) * 1e6)


def triton_launch_pieces(x, w, b):
    """Host cost of one Triton launch of the forward kernel, and of the parts of JITFunction.run."""
    from triton.runtime.driver import driver

    from shardnorm.kernels.launch import Launcher
    fwd_module = importlib.import_module("shardnorm.kernels.norm_fwd")  # the module, not its function
    from shardnorm.kernels.norm_fwd import norm_fwd_kernel

    # The launcher's own grid, arguments and constexprs, captured from one call.
    calls = []
    record = lambda launcher, grid, *args: calls.append((launcher, grid, args))  # noqa: E731
    with unittest.mock.patch.object(Launcher, "__call__", record):
        fwd_module.norm_fwd(x, w, b, None, 1e-5, False, False)
    launcher, grid, args = calls[0]
    kw = dict(launcher.options, **launcher.constexprs)
    compiled = norm_fwd_kernel[grid](*args, **kw)
    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    binder = norm_fwd_kernel.device_caches[device][4]
    bound = list(binder(*args, **kw)[0].values())
    return dict(
        triton_launch=host_us(lambda: norm_fwd_kernel[grid](*args, **kw)),
        cached_launch=host_us(lambda: launcher(grid, *args)),
        triton_binder=host_us(lambda: binder(*args, **kw)),
        triton_device_stream=host_us(lambda: driver.active.get_current_stream(driver.active.get_current_device())),
        compiled_run=host_us(lambda: compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata,
                                                  None, None, None, *bound)),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--shapes", nargs="*", help="MxN shapes (default: the kernel benchmark's)")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes is not None else SHAPES
    result = dict(pieces_us=pieces(), shapes=[])
    print("host us of call layers (LayerNorm 32768 x 1024):",
          ", ".join(f"{k} {v:.1f}" for k, v in result["pieces_us"].items()), flush=True)
    for m, n in shapes:
        for rms in (False, True):
            for provider in ("shardnorm", "torch"):
                row = dict(M=m, N=n, norm="rms" if rms else "layer", provider=provider, **measure(m, n, rms, provider))
                result["shapes"].append(row)
                print(f"{row['norm']:5s} {m}x{n} {provider:9s} " + "  ".join(
                    f"{d}: bench {row[d]['bench_us']:6.0f} gpu {row[d]['gpu_us']:6.0f} host {row[d]['host_us']:5.0f} "
                    f"ideal {row[d]['ideal_us_at_3tbs']:5.0f}" for d in ("fwd", "bwd")), flush=True)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
