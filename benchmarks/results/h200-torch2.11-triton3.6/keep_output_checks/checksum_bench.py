"""The checksum of a keep_output=False output (`output_checks.fingerprint`) against the fp32 sum it replaced, and
other integer sums, on one GPU: do_bench medians, best of 3.  python keep_output_checks/checksum_bench.py"""
import torch, triton.testing as tt
from shardnorm.output_checks import fingerprint
cases = {"bf16 8192x4096": torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16),
         "bf16 q 2x4096x32x128 view": torch.randn(2, 4096, 32 * 128, device="cuda", dtype=torch.bfloat16).view(2, 4096, 32, 128).transpose(1, 2),
         "fp32 8192x4096": torch.randn(8192, 4096, device="cuda"),
         "bf16 8192x1024": torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)}
def f_fp32(t): return torch.sum(t, dtype=torch.float32)
def f_i16_64(t): return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).sum(dtype=torch.int64)
def f_i32_64(t): return t.view(torch.int32).sum(dtype=torch.int64)
def f_i32_32(t): return t.view(torch.int32).sum(dtype=torch.int32)
for name, t in cases.items():
    nbytes = t.numel() * t.element_size()
    row = [name]
    for fn in (f_fp32, f_i16_64, f_i32_64, f_i32_32, fingerprint):
        try:
            ms = min(tt.do_bench(lambda: fn(t), warmup=50, rep=200) for _ in range(3))
            row.append(f"{fn.__name__} {ms*1e3:.1f}us {nbytes/ms/1e6:.0f}GB/s")
        except Exception as e:
            row.append(f"{fn.__name__} ERR {type(e).__name__}")
    print(" | ".join(row), flush=True)
