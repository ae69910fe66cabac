"""Kernel benchmark on one GPU: shardnorm vs torch eager, torch.compile, Liger-Kernel and quack.

Every provider runs the same shapes in the same process; each one's y, dx and dgamma are checked
against a float64 reference first, so a fast wrong kernel cannot win. Times are
`triton.testing.do_bench` medians after warm-up (it also flushes L2 between repetitions), the best
of `--repeats` rounds that time every provider in turn (the GPU machine's shared CPU makes host-bound
medians drift by 2x between runs, so compare small shapes within one run only); inputs that fit in L2
are additionally rotated. Bytes are the minimum traffic: forward reads x and writes
y, backward reads x and dy and writes dx (weights, stats and dgamma are not counted), fwd+bwd the
sum. Backward is timed as `y.backward(dy, retain_graph=True)`, so it includes the dgamma/dbeta
reduction. A device-to-device copy measured in the same run is the ceiling.

    python -m benchmarks.bench_kernels --out results.json [--quick] [--max-autotune] [--repeats 3]
        [--shapes genai,llama,qk,longrow] [--providers shardnorm,quack,...]

Liger-Kernel and quack (CuTe-DSL kernels, benchmark-only: shardnorm never imports it) are optional: a peer
that does not import is skipped with one line. `python -m benchmarks.report results.json` turns the JSON into
the markdown table and the plot.

shardnorm runs with its default kernels: on Hopper the staged kernels for long rows (`kernels/config.py`,
SPECIALIZED). `SHARDNORM_PORTABLE_KERNELS=1` runs the portable Triton kernels everywhere, for an A/B of a
specialized path in the same harness; the JSON's meta says which ran (`shardnorm_long_rows`).
"""

import argparse
import json
import math

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import shardnorm
from benchmarks.common import command, copy_gbs, environment, gbs, rel_err, require_cuda, turns, version

GENAI = [(32768, n) for n in (1024, 2048, 4096, 8192, 16384, 32768, 65536)]
LLAMA = [(16384, n) for n in (4096, 5120, 8192, 14336)]
QK_NORM = [(262144, n) for n in (64, 128, 256)]
# The long rows (above one program's registers). M = 32768 at N = 65536 (4 GiB per bf16 tensor), as in GENAI:
# one input set, and every provider fits in 80 GB but torch eager RMSNorm with fp32 weights (its
# fp32 upcast path runs out of memory; reported as failed, as before).
LONGROW_LN = [(16384, 14336)] + [(32768, n) for n in (16384, 32768, 65536)]
LONGROW_RMS = [(32768, n) for n in (32768, 65536)]
SHAPE_GROUPS = {  # --shapes group -> norm -> [(M, N)]
    "genai": dict(rms=GENAI, layer=GENAI),
    "llama": dict(rms=LLAMA, layer=LLAMA),
    "qk": dict(rms=QK_NORM, layer=QK_NORM),
    "longrow": dict(rms=LONGROW_RMS, layer=LONGROW_LN),
}
PROVIDERS = ("shardnorm", "torch", "torch.compile", "torch.compile-max-autotune", "liger", "quack")
EPS = 1e-6
REF_ROWS = 512  # rows of y/dx compared in float64 (dgamma uses all rows)


def make_providers(rms: bool, n: int, max_autotune: bool, weight_dtype=torch.bfloat16, only=PROVIDERS) -> dict:
    """name -> fn(x, w, b) for one norm and hidden size, limited to `only`. A fn's `note`, if it has
    one, goes into its rows (what differs from the other providers' call)."""
    if rms:
        eager = lambda x, w, b: F.rms_norm(x, (n,), w, EPS)  # noqa: E731
        ours = lambda x, w, b: shardnorm.rms_norm(x, (n,), w, EPS)  # noqa: E731
    else:
        eager = lambda x, w, b: F.layer_norm(x, (n,), w, b, EPS)  # noqa: E731
        ours = lambda x, w, b: shardnorm.layer_norm(x, (n,), w, b, EPS)  # noqa: E731
    providers = {"shardnorm": ours, "torch": eager, "torch.compile": torch.compile(eager, dynamic=False)}
    if max_autotune:
        providers["torch.compile-max-autotune"] = torch.compile(eager, dynamic=False,
                                                                mode="max-autotune-no-cudagraphs")
    if "liger" in only:
        providers.update(liger_provider(rms))
    if "quack" in only:
        providers.update(quack_provider(rms, weight_dtype))
    return {name: fn for name, fn in providers.items() if name in only}


def skipped(peer: str, e: Exception) -> dict:
    print(f"  {peer}: not importable ({type(e).__name__}: {e}); the table has no {peer} column", flush=True)
    return {}


def liger_provider(rms: bool) -> dict:
    try:
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    except ImportError as e:
        return skipped("liger", e)
    if rms:
        return {"liger": lambda x, w, b: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False)}
    return {"liger": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)}


def quack_provider(rms: bool, weight_dtype) -> dict:
    """quack-kernels (CuTe-DSL, Tri Dao). RMSNorm: `quack.rmsnorm.rmsnorm`, its autograd entry, which
    takes bf16 or fp32 weights as they are. LayerNorm has no autograd entry: `layernorm_fwd` and
    `layernorm_bwd` in one Function. `layernorm_fwd` asserts fp32 weight and bias, so bf16 ones are
    cast per forward and their grads cast back (the row's note says so: 2 + 2 small kernels that the
    other providers do not launch)."""
    try:
        from quack.rmsnorm import layernorm_bwd, layernorm_fwd, rmsnorm
    except Exception as e:  # ImportError, or CUTLASS's DSL failing to load its CUDA libraries
        return skipped("quack", e)
    if rms:
        return {"quack": lambda x, w, b: rmsnorm(x, w, eps=EPS)}

    class QuackLayerNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            w32, b32 = w.float(), b.float()  # no copy when already fp32
            y, rstd, mean = layernorm_fwd(x, w32, b32, EPS, return_rstd=True, return_mean=True)
            ctx.save_for_backward(x, w32, rstd, mean)
            ctx.dtypes = w.dtype, b.dtype
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w32, rstd, mean = ctx.saved_tensors
            dx, dw, db = layernorm_bwd(x, w32, dy.contiguous(), rstd, mean, has_bias=True)
            return dx, dw.to(ctx.dtypes[0]), db.to(ctx.dtypes[1])

    fn = lambda x, w, b: QuackLayerNorm.apply(x, w, b)  # noqa: E731
    if weight_dtype != torch.float32:
        fn.note = (f"{str(weight_dtype).removeprefix('torch.')} weight and bias cast to fp32 per call, grads cast "
                   "back (quack LayerNorm takes fp32 only)")
    return {"quack": fn}


def peer_versions() -> dict:
    """Installed versions of the optional peers."""
    versions = {dist: version(dist) for dist in ("liger-kernel", "quack-kernels", "nvidia-cutlass-dsl")}
    return {dist: v for dist, v in versions.items() if v}


def reference(x, w, b, dy, rms: bool):
    """float64 y and dx of the first REF_ROWS rows, and dgamma over all rows (in row chunks)."""
    dw = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
    out = {}
    for start in range(0, x.shape[0], 2048):
        xs = x[start:start + 2048].double().requires_grad_()
        ws = w.double().requires_grad_()
        if rms:
            y = xs * torch.rsqrt(xs.square().mean(-1, keepdim=True) + EPS) * ws
        else:
            y = F.layer_norm(xs, (x.shape[1],), ws, b.double(), EPS)
        gx, gw = torch.autograd.grad(y, (xs, ws), dy[start:start + 2048].double())
        dw += gw
        if start == 0:
            out["y"], out["dx"] = y[:REF_ROWS].detach(), gx[:REF_ROWS]
    out["dw"] = dw
    return out


def time_provider(fn, xs, dys, w, b, params):
    """do_bench medians (ms) of forward, backward (`y.backward(dy)` on a retained graph) and both."""
    sets = len(xs)
    it = iter(range(10**9))
    ms_fwd = do_bench(lambda: fn(xs[next(it) % sets], w, b), return_mode="median")
    graphs = [(fn(x, w, b), dy) for x, dy in zip(xs, dys)]
    ms_bwd = do_bench(lambda: (lambda g: g[0].backward(g[1], retain_graph=True))(graphs[next(it) % sets]),
                      grad_to_none=xs + params, return_mode="median")
    graphs.clear()

    def step():
        i = next(it) % sets
        fn(xs[i], w, b).backward(dys[i])

    return ms_fwd, ms_bwd, do_bench(step, grad_to_none=xs + params, return_mode="median")


def bench_shape(m, n, rms, weight_dtype, max_autotune, copy, repeats, only=PROVIDERS):
    dtype = torch.bfloat16
    es = torch.tensor([], dtype=dtype).element_size()
    x_bytes = m * n * es
    sets = max(1, min(8, math.ceil(4 * torch.cuda.get_device_properties(0).L2_cache_size / x_bytes)))
    xs = [torch.randn(m, n, device="cuda", dtype=dtype).requires_grad_() for _ in range(sets)]
    w = torch.randn(n, device="cuda", dtype=weight_dtype).requires_grad_()
    b = None if rms else torch.randn(n, device="cuda", dtype=weight_dtype).requires_grad_()
    dys = [torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(sets)]
    ref = reference(xs[0].detach(), w.detach(), b.detach() if b is not None else None, dys[0], rms)
    params = [w] + ([b] if b is not None else [])
    rows, timed = [], []
    for name, fn in make_providers(rms, n, max_autotune, weight_dtype, only).items():
        row = dict(provider=name, norm="rms" if rms else "layer", M=m, N=n, x_dtype="bf16",
                   weight_dtype=str(weight_dtype).replace("torch.", ""), input_sets=sets)
        if getattr(fn, "note", None):
            row["note"] = fn.note
        rows.append(row)
        try:
            y = fn(xs[0], w, b)
            gx, gw = torch.autograd.grad(y, (xs[0], w), dys[0])
            row["err"] = dict(y=rel_err(y[:REF_ROWS], ref["y"]), dx=rel_err(gx[:REF_ROWS], ref["dx"]),
                              dw=rel_err(gw, ref["dw"]))
            row["correct"] = all(e < 2e-2 for e in row["err"].values())
            del y, gx, gw
            timed.append((row, fn))
        except Exception as e:  # a provider that fails a shape is reported, not fatal
            row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    # Rounds over all providers in turn; each keeps its best median, so a stretch of host noise on
    # the (shared) CPU hits every provider alike instead of whichever happened to run then.
    for r in range(repeats):
        for row, fn in turns(timed, r):
            try:
                for key, ms in zip(("fwd", "bwd", "fwd_bwd"), time_provider(fn, xs, dys, w, b, params)):
                    row.setdefault(f"{key}_ms_rounds", []).append(ms)
            except Exception as e:
                row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                timed.remove((row, fn))
    for row in rows:
        if "failed" in row:
            print(f"  {row['provider']:28s} FAILED {row['failed']}", flush=True)
            continue
        for key, nbytes in (("fwd", 2 * x_bytes), ("bwd", 3 * x_bytes), ("fwd_bwd", 5 * x_bytes)):
            row[f"{key}_ms"] = ms = min(row[f"{key}_ms_rounds"])
            row[f"{key}_gbs"] = gbs(nbytes, ms)
            row[f"{key}_of_copy"] = row[f"{key}_gbs"] / copy
        print(f"  {row['provider']:28s} fwd {row['fwd_gbs']:7.0f} GB/s ({row['fwd_of_copy']:4.0%})  "
              f"bwd {row['bwd_gbs']:7.0f} GB/s ({row['bwd_of_copy']:4.0%})  "
              f"err y {row['err']['y']:.1e} dx {row['err']['dx']:.1e} dw {row['err']['dw']:.1e}"
              + (f"  [{row['note']}]" if "note" in row else ""), flush=True)
    return rows


def comma_list(choices):
    """argparse type: a comma list whose items are all in choices."""
    def parse(text):
        items = text.split(",")
        unknown = [i for i in items if i not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {', '.join(choices)}")
        return items
    return parse


def long_row_kernels() -> str:
    """Which long-row kernels shardnorm takes on this GPU: "staged" (Hopper's) or "portable"."""
    from shardnorm.kernels import config

    return config.specialized(torch.device("cuda", torch.cuda.current_device())) or "portable"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--quick", action="store_true", help="genai shapes (unless --shapes), bf16 weights only")
    parser.add_argument("--max-autotune", action="store_true", help="add torch.compile max-autotune-no-cudagraphs")
    parser.add_argument("--norms", default="rms,layer")
    parser.add_argument("--weights", default="bfloat16,float32")
    parser.add_argument("--shapes", type=comma_list(tuple(SHAPE_GROUPS)),
                        help="shape groups, comma list of " + ", ".join(SHAPE_GROUPS)
                        + " (default genai,llama,qk; --quick: genai); longrow: the long rows, "
                        "LayerNorm N = 14336 (M = 16384), 16384, 32768, 65536 and RMSNorm N = 32768, 65536 "
                        "(M = 32768)")
    parser.add_argument("--providers", type=comma_list(PROVIDERS), default=list(PROVIDERS),
                        help="only these, comma list of " + ", ".join(PROVIDERS) + " (default all)")
    parser.add_argument("--min-n", type=int, default=0, help="only shapes with N at least this")
    parser.add_argument("--max-n", type=int, default=1 << 30, help="only shapes with N at most this")
    parser.add_argument("--repeats", type=int, default=3, help="timing rounds over all providers; best median kept")
    args = parser.parse_args(argv)
    require_cuda(parser, "bench_kernels")
    groups = args.shapes or (["genai"] if args.quick else ["genai", "llama", "qk"])
    torch._dynamo.config.cache_size_limit = 1024
    torch._functorch.config.donated_buffer = False  # compiled backward is re-run with retain_graph
    copy = copy_gbs()
    props = torch.cuda.get_device_properties(0)
    env = environment("cuda")
    meta = dict(gpu=props.name, sm_count=props.multi_processor_count, date=env["date"], stack=env["stack"],
                torch=env["torch"], triton=env["triton"], peers=peer_versions(), copy_gbs=copy,
                shardnorm_long_rows=long_row_kernels(), repeats=args.repeats, command=command(__spec__.name, argv))
    print(f"{props.name}: device-to-device copy {copy:.0f} GB/s", flush=True)
    weights = ["bfloat16"] if args.quick else args.weights.split(",")
    rows = []
    for norm in args.norms.split(","):
        # groups overlap (longrow's shapes are in genai and llama): each shape once, in group order
        shapes = dict.fromkeys(shape for g in groups for shape in SHAPE_GROUPS[g][norm]
                               if args.min_n <= shape[1] <= args.max_n)
        for wd in weights:
            for m, n in shapes:
                print(f"{norm} M={m} N={n} weight={wd}", flush=True)
                rows += bench_shape(m, n, norm == "rms", getattr(torch, wd), args.max_autotune, copy,
                                    args.repeats, args.providers)
                torch.cuda.empty_cache()
                with open(args.out, "w") as f:
                    json.dump(dict(meta=meta, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
