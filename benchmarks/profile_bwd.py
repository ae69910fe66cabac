"""Where a shardnorm backward's time goes: GPU kernel time vs host time, per shape (torch.profiler).

    python benchmarks/profile_bwd.py

For each shape, prints the median wall time of `y.backward(dy)` and the GPU time of each kernel it
launched; the difference is host overhead (Python, autograd, Triton launch) not hidden by the GPU.
"""

import time

import torch
from torch.profiler import ProfilerActivity, profile

import shardnorm

SHAPES = [(32768, 1024, False), (32768, 2048, False), (16384, 4096, False), (32768, 4096, False),
          (262144, 64, True), (32768, 32768, True)]


def main():
    for m, n, rms in SHAPES:
        x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = None if rms else torch.randn(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn_like(x)
        y = shardnorm.rms_norm(x, n, w) if rms else shardnorm.layer_norm(x, n, w, b)
        for _ in range(10):
            y.backward(dy, retain_graph=True)
        torch.cuda.synchronize()
        walls = []
        for _ in range(20):
            start = time.perf_counter()
            y.backward(dy, retain_graph=True)
            torch.cuda.synchronize()
            walls.append((time.perf_counter() - start) * 1e6)
        host = []
        for _ in range(20):
            start = time.perf_counter()
            y.backward(dy, retain_graph=True)
            host.append((time.perf_counter() - start) * 1e6)
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                y.backward(dy, retain_graph=True)
            torch.cuda.synchronize()
        kernels = {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.device_time_total > 0}
        print(f"{'rms' if rms else 'layer'} {m}x{n}: wall {sorted(walls)[10]:.0f} us, host (no sync) "
              f"{sorted(host)[10]:.0f} us, ideal {3 * m * n * 2 / 3.0e6:.0f} us at 3 TB/s; kernels (us/call): "
              + ", ".join(f"{k[:40]} {v:.0f}" for k, v in kernels.items()), flush=True)


if __name__ == "__main__":
    main()
