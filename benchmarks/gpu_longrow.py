"""Long-row backward on one GPU: the split backward vs the staged candidates, checked and timed.

Per shape a child process builds bf16 x/dy, the forward's statistics and a float64 reference (dx of
rows spread over M, dgamma/dbeta over all rows), then per candidate: checks dx/dgamma/dbeta against
it and that a second run is bitwise equal, and times the bare launcher (`kernels.norm_bwd`) with
do_bench_cudagraph (median, as kernel_gpu_time.py) and do_bench (best of 3 medians, as bench_kernels.py).
Bytes: read x and dy, write dx (3 x M x N x 2). The child measures the device-to-device copy too.
A candidate that hangs (a grid that cannot be resident) must not eat the run: the parent kills a
child that reports nothing for --timeout seconds, records that candidate as hung and starts a new
child for the rest. Candidates compile first in parallel processes (Triton's disk cache is shared).

    python benchmarks/gpu_longrow.py --out OUT_DIR [--quick] [--candidates table,split]

The fp32-weight shapes say whether the staged backward should take fp32 weights too (STAGED_BWD has bf16
entries only, so the table's choice there is the split backward).

Writes OUT_DIR/longrow.json and OUT_DIR/longrow.md and prints the table.
"""

import argparse
import json
import multiprocessing
import os
import queue
import subprocess
import sys
import threading
import time

SHAPES = [("layer", 16384, 14336, "bfloat16"), ("layer", 32768, 16384, "bfloat16"), ("layer", 32768, 32768, "bfloat16"),
          ("layer", 32768, 65536, "bfloat16"), ("rms", 32768, 32768, "bfloat16"), ("rms", 32768, 65536, "bfloat16"),
          ("layer", 32768, 32768, "float32"), ("rms", 32768, 65536, "float32")]
REF_ROWS = 256  # rows of dx compared in float64 at each of the start, middle and end of M


def candidates() -> dict:
    """name -> backward config, None for the table's choice (`config.STAGED_BWD` on Hopper): the split backward
    (portable), then staged ones: S(warps, slice columns, row slots). At N <= 16384 one slice is the whole row in
    two (three) slots, no exchange; three slots publish the next row's sums before this row's are awaited.
    Register use from a local sm_90 compile: 32 warps spill LayerNorm's dgamma/dbeta sums, 16 do not."""
    from shardnorm.kernels import config
    staged = config.StagedConfig
    return {
        "table": None,
        "split": config.BWD_SPLIT,
        "staged_slices_16384": staged(32, slice_n=16384),
        "staged_slices_8192": staged(32, slice_n=8192),
        "staged_slices_16384_lead": staged(32, slice_n=16384, slots=3),
        "staged_slices_16384_w16": staged(16, slice_n=16384),  # STAGED_BWD up to 16384 columns
        "staged_slices_16384_w16_lead": staged(16, slice_n=16384, slots=3),  # STAGED_BWD above
    }


_TABLE = []  # config.bwd_config as shardnorm defines it, kept by the first `using`


def using(cfg):
    """Every backward takes cfg (as sweep_tiles.using); None: the table's choice again."""
    from shardnorm.kernels import config
    if not _TABLE:
        _TABLE.append(config.bwd_config)
    sys.modules["shardnorm.kernels.norm_bwd"]._plan.cache_clear()
    config.bwd_config = _TABLE[0] if cfg is None else (lambda *_: cfg)


def inputs(norm, m, n, weight_dtype):
    import torch
    from shardnorm.kernels import norm_fwd
    rms = norm == "rms"
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, device="cuda", dtype=getattr(torch, weight_dtype))
    b = None if rms else torch.randn(n, device="cuda", dtype=w.dtype)
    _, _, mean, rstd = norm_fwd(x, w, b, None, 1e-5, rms, False)
    return x, w, b, torch.randn_like(x), mean, rstd


def reference(x, w, b, dy, rms):
    """float64: dx of the sampled rows, dgamma (and dbeta) over all rows, in row chunks on the GPU."""
    import torch
    m, n = x.shape
    rows = sorted({*range(min(REF_ROWS, m)), *range(m // 2, min(m, m // 2 + REF_ROWS)),
                   *range(max(0, m - REF_ROWS), m)})
    dw = torch.zeros(n, dtype=torch.float64, device=x.device)
    db = torch.zeros_like(dw)
    dx = []
    for start in range(0, m, 1024):
        xs = x[start:start + 1024].double()
        dys = dy[start:start + 1024].double()
        xc = xs if rms else xs - xs.mean(-1, keepdim=True)
        rstd = torch.rsqrt(xc.square().mean(-1, keepdim=True) + 1e-5)
        xhat = xc * rstd
        wdy = dys * w.double()
        c1 = (xhat * wdy).mean(-1, keepdim=True)
        gx = (wdy - xhat * c1 - (0 if rms else wdy.mean(-1, keepdim=True))) * rstd
        dw += (dys * xhat).sum(0)
        db += dys.sum(0)
        keep = [r - start for r in rows if start <= r < start + 1024]
        if keep:
            dx.append(gx[keep])
    return rows, torch.cat(dx), dw, (None if rms else db)


def rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def child(shape_json: str, names: list, copy_gbs: float):
    """Run the candidates `names` on one shape; one JSON line per event on stdout."""
    import torch
    from triton.testing import do_bench, do_bench_cudagraph

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_kernels import copy_bandwidth
    from shardnorm.kernels import norm_bwd

    def emit(**kw):
        print(json.dumps(kw), flush=True)

    norm, m, n, wd = json.loads(shape_json)
    rms = norm == "rms"
    if not copy_gbs:
        copy_gbs = copy_bandwidth()
        emit(event="copy", copy_gbs=copy_gbs, gpu=torch.cuda.get_device_name())
    torch.manual_seed(m + n)
    x, w, b, dy, mean, rstd = inputs(norm, m, n, wd)
    rows, ref_dx, ref_dw, ref_db = reference(x, w, b, dy, rms)
    cands = candidates()
    call = lambda: norm_bwd(dy, None, x, w, mean, rstd, b is not None, rms, False)  # noqa: E731
    nbytes = 3 * m * n * x.element_size()
    for name in names:
        emit(event="start", name=name)
        row = dict(event="done", name=name, norm=norm, M=m, N=n, weight_dtype=wd, cfg=repr(cands[name]))
        try:
            using(cands[name])
            dx, dw, db = call()
            torch.cuda.synchronize()
            row["err"] = dict(dx=rel(dx[rows], ref_dx), dw=rel(dw, ref_dw))
            if ref_db is not None:
                row["err"]["db"] = rel(db, ref_db)
            again = call()
            row["bitwise_repeatable"] = all(a is None or torch.equal(a, c) for a, c in zip((dx, dw, db), again))
            row["correct"] = all(e < 2e-2 for e in row["err"].values()) and row["bitwise_repeatable"]
            del dx, dw, db, again
            ms = do_bench_cudagraph(call, return_mode="median")
            rounds = [do_bench(call, return_mode="median") for _ in range(3)]
            row.update(graph_us=ms * 1e3, bench_us=min(rounds) * 1e3, bench_rounds_us=[r * 1e3 for r in rounds],
                       graph_of_copy=nbytes / ms / 1e6 / copy_gbs, bench_of_copy=nbytes / min(rounds) / 1e6 / copy_gbs)
        except Exception as e:  # recorded, the next candidate runs
            row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            torch.cuda.synchronize()
        emit(**row)


def compile_one(job):
    """Worker: run one candidate on 64 rows (compiles it into the shared disk cache)."""
    norm, n, wd, name = job
    try:
        import torch
        using(candidates()[name])
        from shardnorm.kernels import norm_bwd
        x, w, b, dy, mean, rstd = inputs(norm, 64, n, wd)
        norm_bwd(dy, None, x, w, mean, rstd, b is not None, norm == "rms", False)
        torch.cuda.synchronize()
    except Exception as e:
        return f"{name} {norm} {wd}: {type(e).__name__}: {str(e)[:200]}"


def run_shape(shape, names, timeout, copy_gbs, log, meta):
    """Children until every candidate of the shape is done, failed or hung; `meta` gets the copy
    bandwidth and GPU name from the first child."""
    rows, left = [], list(names)
    while left:
        cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(shape), "--names", ",".join(left),
               "--copy-gbs", str(copy_gbs or 0)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        lines = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout] + [lines.put(None)],
                         daemon=True).start()
        current = None
        while True:
            try:
                line = lines.get(timeout=timeout)
            except queue.Empty:  # no report for `timeout` seconds: hung
                proc.kill()
                break
            if line is None:  # the child is done (or died)
                break
            if not line.startswith("{"):
                continue
            ev = json.loads(line)
            if ev["event"] == "copy":
                meta.update(ev)
                copy_gbs = ev["copy_gbs"]
            elif ev["event"] == "start":
                current = ev["name"]
            else:
                rows.append(ev)
                left.remove(ev["name"])
                current = None
                print(f"  {fmt(ev, copy_gbs)}", flush=True)
        proc.wait()
        if left and (current or left[0]) in left:  # the child died or hung on `current` (or before the first)
            bad = current or left[0]
            why = "hung" if proc.returncode in (-9, None) else f"child exited {proc.returncode}"
            rows.append(dict(event="done", name=bad, norm=shape[0], M=shape[1], N=shape[2], weight_dtype=shape[3],
                             failed=f"{why} (no report for {timeout} s)" if why == "hung" else why))
            print(f"  {bad}: {rows[-1]['failed']}", flush=True)
            left.remove(bad)
    return rows, copy_gbs


def fmt(r, copy_gbs) -> str:
    if "failed" in r:
        return f"{r['name']:30s} FAILED {r['failed']}"
    err = " ".join(f"{k} {v:.1e}" for k, v in r["err"].items())
    return (f"{r['name']:30s} graph {r['graph_us']:8.1f} us ({r['graph_of_copy']:4.0%})  bench {r['bench_us']:8.1f} us "
            f"({r['bench_of_copy']:4.0%})  err {err}  repeatable {r['bitwise_repeatable']}")


def markdown(rows, copy_gbs, gpu) -> str:
    out = [f"# Long-row backward, split vs staged ({gpu}, copy {copy_gbs:.0f} GB/s)", "",
           "% of copy: GPU time (CUDA graph median) / do_bench best of 3; errors vs float64; R: bitwise repeatable.", "",
           "| norm | weights | M x N | candidate | graph | bench | dx err | dw err | R |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['norm']} | {r['weight_dtype']} | {r['M']} x {r['N']} | {r['name']} |"
        if "failed" in r:
            out.append(f"{head} failed: {r['failed'][:80]} | | | | |")
        else:
            out.append(f"{head} {r['graph_of_copy']:.0%} ({r['graph_us']:.0f} us) | {r['bench_of_copy']:.0%} | "
                       f"{r['err']['dx']:.1e} | {r['err']['dw']:.1e} | {'y' if r['bitwise_repeatable'] else 'NO'} |")
    return "\n".join(out) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out")
    parser.add_argument("--quick", action="store_true", help="bf16 weights; the table's choice and the split backward")
    parser.add_argument("--timeout", type=float, default=60)
    parser.add_argument("--child")
    parser.add_argument("--names")
    parser.add_argument("--copy-gbs", type=float, default=0)
    parser.add_argument("--candidates", help="comma-separated candidate names (default: all)")
    parser.add_argument("--max-n", type=int, help="only shapes with N up to this")
    parser.add_argument("--only", help="comma-separated norm:N:weights shapes, e.g. layer:16384:bfloat16")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.names.split(","), args.copy_gbs)
    os.makedirs(args.out, exist_ok=True)
    names = list(candidates())
    shapes = SHAPES
    if args.quick:
        names, shapes = ["table", "split"], [s for s in SHAPES if s[3] == "bfloat16"]
    if args.candidates:
        names = args.candidates.split(",")
    if args.max_n:
        shapes = [s for s in shapes if s[2] <= args.max_n]
    if args.only:
        keep = {tuple(k.split(":")) for k in args.only.split(",")}
        shapes = [s for s in shapes if (s[0], str(s[2]), s[3]) in keep]
    start = time.monotonic()
    jobs = sorted({(norm, n, wd, name) for norm, _, n, wd in shapes for name in names})
    with multiprocessing.get_context("spawn").Pool(min(12, len(jobs))) as pool:
        try:
            for msg in pool.map_async(compile_one, jobs, chunksize=1).get(timeout=120):
                if msg:
                    print(f"  compile: {msg}", flush=True)
        except multiprocessing.TimeoutError:
            print("  compile: timed out (a candidate hung?); the rest compile when measured", flush=True)
            pool.terminate()
    print(f"compiled {len(jobs)} jobs in {time.monotonic() - start:.0f} s", flush=True)
    rows, copy_gbs, meta = [], 0.0, dict(gpu="?")
    with open(os.path.join(args.out, "longrow_children.log"), "w") as log:
        for shape in shapes:
            print(f"{shape[0]} {shape[1]} x {shape[2]} weights {shape[3]}", flush=True)
            got, copy_gbs = run_shape(shape, names, args.timeout, copy_gbs, log, meta)
            rows += got
            with open(os.path.join(args.out, "longrow.json"), "w") as f:  # after every shape: a kill keeps them
                json.dump(dict(gpu=meta["gpu"], copy_gbs=copy_gbs, rows=rows), f, indent=1)
            with open(os.path.join(args.out, "longrow.md"), "w") as f:
                f.write(markdown(rows, copy_gbs, meta["gpu"]))
    print(markdown(rows, copy_gbs, meta["gpu"]), flush=True)
    print(f"total {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
