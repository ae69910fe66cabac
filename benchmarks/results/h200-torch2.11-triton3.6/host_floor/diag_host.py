"""One-off: where the eager host time of one norm call goes on a GPU host (launch variants, autograd Function cost on
CUDA vs CPU tensors, allocations). Writes $OUT/diag_host.json as it goes."""
import json, os, statistics, sys, tempfile, time
import torch
from triton.runtime.driver import driver

out = os.environ.get("OUT", "/tmp")
results = {}

def save():
    json.dump(results, open(f"{out}/diag_host.json", "w"), indent=1)

def bench(fns, calls=200, rounds=9):
    for f in fns.values():
        for _ in range(20): f()
    torch.cuda.synchronize()
    best = {}
    for _ in range(3):
        s = {k: [] for k in fns}
        for r in range(rounds):
            for k, f in fns.items():
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(calls): f()
                s[k].append((time.perf_counter() - t) / calls * 1e6)
                torch.cuda.synchronize()
        for k, v in s.items():
            best[k] = round(min(best.get(k, 1e9), statistics.median(v)), 2)
    return best

import shardnorm
from shardnorm import ops
import importlib; kf = importlib.import_module("shardnorm.kernels.norm_fwd"); from shardnorm.kernels import launch
dev = torch.device("cuda")
M, N = 8, 4096
x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
w = torch.randn(N, device=dev, dtype=torch.bfloat16)
plan = kf._plan(N, 2, True, False, False, True, False, dev, "")
y, _, _, rstd = plan(x, w, None, None, 1e-6)
y2, _, _, _ = plan(x, w, None, None, 1e-6)
programs = plan._programs(M)
L = plan.kernel
args = (x, None, w, None, y, None, None, rstd, x.stride()[0], 0, M, N, 1e-6)
key = launch._key(driver.active.get_current_device(), L.keyed(args) if L.keyed else args)
compiled = L.compiled[key]
active = driver.active
grid3 = (programs, 1, 1)

def run_tensors():
    device = active.get_current_device(); stream = active.get_current_stream(device)
    launch._key(device, L.keyed(args))
    compiled.run(*grid3, stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *L.trailing)

def run_ints():
    L(grid3[:1], *args)

stream0 = active.get_current_stream(active.get_current_device())
def run_ints_raw():
    compiled.run(*grid3, stream0, compiled.function, compiled.packed_metadata, None, None, None,
                 *[a.data_ptr() if type(a) is torch.Tensor else a for a in args], *L.trailing)

fns = {"launcher_tensors(old)": run_tensors, "launcher_ints(new)": run_ints, "compiled.run_ints_nokey": run_ints_raw}
# torch's static launcher
try:
    try:
        from torch._inductor.runtime.static_cuda_launcher import StaticallyLaunchedCudaKernel
    except ImportError:
        from torch._inductor.runtime.static_triton_launcher import StaticallyLaunchedCudaKernel
    if not hasattr(compiled, "_cubin_path"):
        compiled._cubin_path = None
    k = StaticallyLaunchedCudaKernel(compiled)
    k.reload_cubin_from_raw(tempfile.mktemp(suffix=".cubin"))
    k.load_kernel(torch.cuda.current_device())
    const = set(k.full_constexprs)
    keep = [i for i in range(len(args)) if i not in const]
    extra = (None,) * (len(k.arg_tys) - len(keep))
    C = k.C_impl
    results["static"] = {"arg_tys": k.arg_tys, "keep": keep, "constexprs": sorted(const)}
    save()
    def run_static():
        a = tuple(args[i].data_ptr() if type(args[i]) is torch.Tensor else args[i] for i in keep) + extra
        C._launch_kernel(k.function, programs, 1, 1, k.num_warps, k.shared, k.arg_tys, a, stream0)
    y.zero_(); run_static(); torch.cuda.synchronize()
    results["static"]["bitwise"] = bool(torch.equal(y, y2))
    fns["static_launcher_ints"] = run_static
except Exception as e:
    results["static_error"] = repr(e)[:500]
save()
fns["cur_device_stream_triton"] = lambda: active.get_current_stream(active.get_current_device())
fns["raw_stream_torch"] = lambda: torch._C._cuda_getCurrentRawStream(0)
fns["key"] = lambda: launch._key(0, L.keyed(args))
fns["empty_like"] = lambda: torch.empty_like(x)
fns["new_empty_fp32"] = lambda: x.new_empty(M, dtype=torch.float32)
fns["new_empty_2M_unbind"] = lambda: x.new_empty((2, M), dtype=torch.float32).unbind(0)
fns["data_ptr"] = lambda: x.data_ptr()
results["launch_us"] = bench(fns)
save()
print(results, flush=True)

# autograd.Function cost: CUDA vs CPU tensors
class Triv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, r, s1, s2, opts):
        y = torch.empty_like(x)
        ctx.save_for_backward(x, w, None, y)
        ctx.flags = opts
        ctx.set_materialize_grads(False)
        return y
    @staticmethod
    def backward(ctx, dy):
        f = ctx.flags; s = ctx.saved_tensors
        return torch.empty_like(dy), torch.empty_like(s[1]), None, None, None, None, None
opts = (1e-6, True, False, True, None)
fb = {}
for d in ("cuda", "cpu"):
    xg = torch.randn(M, N, device=d, requires_grad=True); wg = torch.randn(N, device=d, requires_grad=True)
    dy = torch.randn(M, N, device=d)
    fb[f"triv_fwd_{d}"] = lambda xg=xg, wg=wg: Triv.apply(xg, wg, None, None, None, None, opts)
    fb[f"triv_fb_{d}"] = lambda xg=xg, wg=wg, dy=dy: Triv.apply(xg, wg, None, None, None, None, opts).backward(dy)
    fb[f"torch_mul_fb_{d}"] = lambda xg=xg, dy=dy: (xg * 1).backward(dy)
    fb[f"torch_rms_fb_{d}"] = lambda xg=xg, wg=wg, dy=dy: torch.nn.functional.rms_norm(xg, (N,), wg, 1e-6).backward(dy)
results["function_us"] = bench(fb, calls=100)
save()
print(results, flush=True)
