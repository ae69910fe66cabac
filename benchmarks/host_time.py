"""Host (CPU) time per norm call at small shapes, where the GPU work is negligible.

    python benchmarks/host_time.py --out OUT_DIR            # CUDA: the full table
    python benchmarks/host_time.py --cpu-stub               # no GPU: shardnorm's Python only
    python benchmarks/host_time.py --dry-run                # a few calls of everything (smoke test;
                                                            # without CUDA: --cpu-stub's)
    python benchmarks/host_time.py --pointers-ab            # + a row with launch.INT_POINTERS = False

Host time of one call: time.perf_counter around N calls queued back to back (no sync inside the
timed loop, one before and after), the median of several rounds, the best of 3 such medians. The providers
of a shape take turns round by round, so a slow stretch of the shared CPU falls on all of them. Rows:
shardnorm's module forward and forward+backward (`y.backward(dy)`) with the C++ host path (`shardnorm.host`)
and without it (`shardnorm_python`), shardnorm's functional call (`shardnorm_functional`), torch's native
`F.rms_norm` / `F.layer_norm` (`torch`) and its `nn.RMSNorm` / `nn.LayerNorm` module (`torch_module`): module
against module, function against function. Then Liger's module if importable, the layers of a shardnorm call
(functional, `ops.norm`, bare launchers, `torch.empty`), and the same forward+backward replayed from a CUDA
graph (manual capture) and under `torch.compile(mode="reduce-overhead")`, i.e. the host time those leave.

--cpu-stub times shardnorm's layers on CPU tensors with the Triton launches replaced by a no-op
(SHARDNORM_BACKEND=triton, no interpreter): the Python and allocation part of a call, on any machine.
Writes OUT_DIR/host_time.json and OUT_DIR/host_time.md.
"""

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

SHAPES = ((8, 4096), (8, 1024), (4096, 128))  # tiny, tiny, QK-norm-like
ROUNDS, CALLS = 7, 50


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us(fn, before=None, calls=CALLS, rounds=ROUNDS, best_of=3) -> float:
    """Host microseconds per call: best of `best_of` medians over `rounds` rounds of `calls` calls."""
    return host_us_interleaved({"fn": (fn, before, None)}, calls, rounds, best_of)["fn"]


def host_us_interleaved(fns: dict, calls=CALLS, rounds=ROUNDS, best_of=3) -> dict:
    """host_us of each `name: (fn, before, setup)`, the fns taking turns within every round (in an order
    rotated round by round); `setup` (or None) runs untimed before each turn (e.g. the host path on or off)."""
    names = list(fns)
    best = {}
    for _ in range(best_of):
        samples = {name: [] for name in names}
        for r in range(rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn, before, setup = fns[name]
                if setup is not None:
                    setup()
                sync()
                start = time.perf_counter()
                for _ in range(calls):
                    if before is not None:
                        before()
                    fn()
                samples[name].append((time.perf_counter() - start) / calls * 1e6)
                sync()
        for name in names:
            best[name] = min(best.get(name, float("inf")), statistics.median(samples[name]))
    return best


class Case:
    """One norm at one shape: x, dy, a module per provider and the leaves whose grads a backward sets."""

    def __init__(self, m, n, rms, device, dtype=torch.bfloat16):
        import shardnorm

        torch.manual_seed(m + n)
        self.m, self.n, self.rms, self.device = m, n, rms, device
        self.x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
        self.dy = torch.randn(m, n, device=device, dtype=dtype)
        self.mod = (shardnorm.RMSNorm(n, eps=1e-6) if rms else shardnorm.LayerNorm(n)).to(device, dtype)
        with torch.no_grad():
            for p in self.mod.parameters():
                p.normal_()
        self.w, self.b = self.mod.weight, getattr(self.mod, "bias", None)
        self.leaves = [t for t in (self.x, self.w, self.b) if t is not None]

    def clear(self):
        for t in self.leaves:
            t.grad = None

    def timed(self, name, fwd, setup):
        """`name/fwd`, `name/fwd_bwd`, `name/bwd` (a backward alone, over a retained graph) for
        host_us_interleaved; the graph is built with `setup` done (it fixes which autograd node it has)."""
        x, dy = self.x, self.dy
        setup()
        y = fwd(x)
        return {f"{name}/fwd": (lambda: fwd(x), None, setup),
                f"{name}/fwd_bwd": (lambda: fwd(x).backward(dy), self.clear, setup),
                f"{name}/bwd": (lambda: y.backward(dy, retain_graph=True), self.clear, setup)}


def providers(case, pointers_ab=False):
    """(name, forward) of every provider that runs here; `pointers_ab`: shardnorm again with tensors
    passed to Triton's launcher instead of their addresses (`measure` flips `launch.INT_POINTERS`)."""
    import shardnorm.functional as SF

    n, w, b = case.n, case.w, case.b
    out = [("shardnorm", case.mod)] + [(TENSOR_POINTERS, case.mod)] * pointers_ab
    if case.device.type != "cuda":
        return out
    out.append((PYTHON_PATH, case.mod))
    if case.rms:
        ours, native = (lambda x: SF.rms_norm(x, (n,), w, 1e-6)), (lambda x: F.rms_norm(x, (n,), w, 1e-6))
        module = torch.nn.RMSNorm(n, eps=1e-6)
    else:
        ours, native = (lambda x: SF.layer_norm(x, (n,), w, b)), (lambda x: F.layer_norm(x, (n,), w, b))
        module = torch.nn.LayerNorm(n)
    module = module.to(case.device, w.dtype)
    module.load_state_dict(case.mod.state_dict())
    out += [(FUNCTIONAL, ours), ("torch", native), ("torch_module", module)]
    try:
        if case.rms:
            from liger_kernel.transformers import LigerRMSNorm

            liger = LigerRMSNorm(n, eps=1e-6).to(case.device, w.dtype)
        else:
            from liger_kernel.transformers import LigerLayerNorm

            liger = LigerLayerNorm(n, eps=1e-5).to(case.device, w.dtype)
        with torch.no_grad():
            for p, q in zip(liger.parameters(), case.mod.parameters()):
                p.copy_(q)
        out.append(("liger", liger))
    except Exception as e:  # not installed, or an API change: the row says so
        print(f"  liger unavailable: {type(e).__name__}: {e}", flush=True)
    return out


def pieces(case):
    """Host time of the layers of one shardnorm call, from allocations up to the module."""
    from shardnorm import functional as Fn, ops
    from shardnorm.kernels import norm_bwd, norm_fwd

    x, w, b, m, n, rms, dev = case.x, case.w, case.b, case.m, case.n, case.rms, case.device
    xd, dy = x.detach(), case.dy
    _, _, mean, rstd = norm_fwd(xd, w.detach(), None if b is None else b.detach(), None, 1e-6, rms, False)
    out = dict(
        empty_like=host_us(lambda: torch.empty_like(xd)),
        empty_stats=host_us(lambda: torch.empty(m, dtype=torch.float32, device=dev)),
        launcher_fwd=host_us(lambda: norm_fwd(xd, w, b, None, 1e-6, rms, False)),
        launcher_bwd=host_us(lambda: norm_bwd(dy, None, xd, w, mean, rstd, b is not None, rms, False)),
        ops_norm=host_us(lambda: ops.norm(x, w, b, None, 1e-6, rms, False)),
        functional=host_us(lambda: Fn._norm(x, None, (n,), w, b, 1e-6, rms, False)),
    )
    with torch.no_grad():
        out["module_fwd_no_grad"] = host_us(lambda: case.mod(x))
    if dev.type == "cuda":  # the C++ entry point alone, called as ops.norm calls it
        from shardnorm import host

        module = host.load()
        out["host_norm"] = host_us(lambda: module.norm(x, w, b, None, 1e-6, rms, False))
    return out


def captured(case, compile_too=True):
    """Host time per forward+backward replayed from a manually captured CUDA graph, and under
    torch.compile(mode="reduce-overhead") (cudagraph trees; `compile_too`: compiling takes seconds)."""
    mod, dy = case.mod, case.dy
    static_x = case.x.detach().clone().requires_grad_()
    out = {}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (compiles the kernels) off the capture
        for _ in range(3):
            case.clear()
            static_x.grad = None
            mod(static_x).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    case.clear()
    static_x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mod(static_x).backward(dy)
    out["graph_replay_fwd_bwd"] = host_us(graph.replay)
    if not compile_too:
        return out
    compiled = torch.compile(mod, mode="reduce-overhead")

    def step():
        compiled(case.x).backward(dy)

    for _ in range(5):  # record, then replay
        case.clear()
        step()
    out["compile_reduce_overhead_fwd_bwd"] = host_us(step, case.clear)
    return out


TENSOR_POINTERS = "shardnorm_tensor_pointers"
PYTHON_PATH = "shardnorm_python"  # shardnorm with the C++ host path off (`shardnorm.host`)
FUNCTIONAL = "shardnorm_functional"  # shardnorm.functional's rms_norm / layer_norm, the host path on


def host_path(on: bool) -> None:
    """The C++ host path on (built if need be) or off, where there is CUDA."""
    if torch.cuda.is_available():
        from shardnorm import host

        host.enable(on)


def time_providers(case, row, pointers_ab=False):
    """Every provider's forward, forward+backward and backward, interleaved, into row[provider]. The retained
    graphs go when this returns: one kept alive holds the parameters' AccumulateGrad nodes, which would make a
    later CUDA graph capture's backward touch the legacy stream."""
    from shardnorm.kernels import launch

    timed = {}
    for name, fwd in providers(case, pointers_ab):
        def setup(name=name):  # the host path and launch arguments this provider runs with
            launch.INT_POINTERS = name != TENSOR_POINTERS
            host_path(name in ("shardnorm", FUNCTIONAL))

        try:
            timed.update(case.timed(name, fwd, setup))
        except Exception:
            row[name] = dict(error=traceback.format_exc(limit=3))
    for key, us in host_us_interleaved(timed).items():
        name, what = key.split("/")
        row.setdefault(name, {})[what] = us
    launch.INT_POINTERS = True
    case.clear()


def measure(shapes, device, pointers_ab=False):
    rows = []
    for i, (m, n) in enumerate(shapes):
        for rms in (True, False):
            case = Case(m, n, rms, device)
            row = dict(M=m, N=n, norm="rms" if rms else "layer")
            time_providers(case, row, pointers_ab)
            host_path(False)  # the pieces are the Python path's layers (and the C++ entry point alone)
            parts = [("pieces", pieces)]
            if device.type == "cuda":  # compile reduce-overhead at the first shape only (seconds each)
                parts.append(("captured", lambda c: captured(c, compile_too=i == 0)))
            for name, part in parts:
                try:
                    host_path(name == "captured")  # captured: what a user's graph gets, the host path on
                    row[name] = part(case)
                except Exception:
                    row[name] = dict(error=traceback.format_exc(limit=3))
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def markdown(rows) -> str:
    lines = ["| norm | M x N | provider | fwd us | fwd+bwd us | bwd us |", "|---|---|---|---|---|---|"]
    fmt = lambda d, k: f"{d[k]:.1f}" if k in d else "error" if "error" in d else "-"  # noqa: E731
    for r in rows:
        for name in ("shardnorm", PYTHON_PATH, TENSOR_POINTERS, "torch_module", FUNCTIONAL, "torch", "liger"):
            if name in r:
                d = r[name]
                lines.append(f"| {r['norm']} | {r['M']}x{r['N']} | {name} | {fmt(d, 'fwd')} | {fmt(d, 'fwd_bwd')} | "
                             f"{fmt(d, 'bwd')} |")
    lines += ["", "| norm | M x N | piece | host us |", "|---|---|---|---|"]
    for r in rows:
        for group in ("pieces", "captured"):
            for k, v in r.get(group, {}).items():
                lines.append(f"| {r['norm']} | {r['M']}x{r['N']} | {group}: {k} | "
                             + (f"{v:.1f} |" if isinstance(v, float) else "error (see the json) |"))
    return "\n".join(lines) + "\n"


def stub_launches():
    """CPU: take the Triton path on CPU tensors with every kernel launch a no-op: the Launcher runs as
    on a GPU (device and stream lookup, cache key, argument list) up to the compiled kernel's `run`."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("--cpu-stub times the compiled-kernel path: unset TRITON_INTERPRET")
    os.environ["SHARDNORM_BACKEND"] = "triton"
    from shardnorm.kernels import launch

    class Compiled:
        function = packed_metadata = None

        @staticmethod
        def run(*args):
            pass

    class AlwaysCompiled(dict):
        def get(self, key, default=None):
            return Compiled

    class Driver:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 0)

    class Config:
        active = Driver()

    init = launch.Launcher.__init__

    def stub_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.compiled = AlwaysCompiled()

    launch.Launcher.__init__ = stub_init
    launch.driver = Config()


def main():
    global ROUNDS, CALLS
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"))
    parser.add_argument("--cpu-stub", action="store_true", help="no GPU: shardnorm's layers with no-op launches")
    parser.add_argument("--dry-run", action="store_true", help="a few calls of everything")
    parser.add_argument("--shapes", nargs="*", help="MxN (default 8x4096 8x1024 4096x128)")
    parser.add_argument("--pointers-ab", action="store_true",
                        help="also shardnorm with tensors, not addresses, passed to Triton's launcher (a row of its own)")
    args = parser.parse_args()
    shapes = [tuple(map(int, s.split("x"))) for s in args.shapes] if args.shapes else SHAPES
    if args.dry_run:
        ROUNDS, CALLS = 2, 2
    if torch.cuda.is_available() and not args.cpu_stub:
        device = torch.device("cuda")
    elif args.cpu_stub or args.dry_run:
        stub_launches()
        device = torch.device("cpu")
    else:
        print("host_time.py: no CUDA device; use --cpu-stub (shardnorm's Python) or --dry-run")
        return
    result = dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (launches stubbed)"
                  if args.cpu_stub else "cpu", torch=torch.__version__, rounds=ROUNDS, calls=CALLS,
                  rows=measure(shapes, device, args.pointers_ab))
    if device.type == "cuda":  # evidence that the host path's rows replayed (calls since the extension loaded)
        from shardnorm import host

        result["host_stats"] = host.stats()
        result["host_refused"] = {str(k): v for k, v in host.refused.items()}
    table = markdown(result["rows"])
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "host_time.json"), "w") as f:
            json.dump(result, f, indent=1)
        with open(os.path.join(args.out, "host_time.md"), "w") as f:
            f.write(f"# Host time per call ({result['device']}, torch {result['torch']})\n\n" + table)


if __name__ == "__main__":
    main()
