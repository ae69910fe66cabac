"""Host (CPU) time per norm call at small shapes, where the GPU's work is negligible.

    python -m benchmarks.host_time --out DIR [--shapes 8x4096 8x1024] [--profile]    # CUDA, else CPU tensors
    python -m benchmarks.host_time --layers --out DIR [--shapes 8x4096]             # where a call's time goes
    python -m benchmarks.host_time --dtensor --out DIR                               # CPU, a 1-rank gloo mesh
    torchrun --nproc-per-node 2 -m benchmarks.host_time --dtensor --device cuda --out DIR   # 2 GPUs, NCCL

Plain tensors (default): shardnorm's module against torch's `nn.RMSNorm` / `nn.LayerNorm`, shardnorm's functional
call against `F.rms_norm` / `F.layer_norm`, Liger's module where it imports, shardnorm's autograd node taking the ops
(`shardnorm_ops`: the way compiled graphs, dispatch modes and tensor subclasses reach the kernels, here in eager),
which eager calls on plain tensors avoid by calling the launchers directly (ops.py says why), and both modules
under `torch.compile(fullgraph=True)` (`*_module_compiled`: what a compiled graph pays per norm, guards and the
compiled-function wrappers included).

`--dtensor`: sequence-parallel norms on DTensor `Shard(1)` inputs, each parallelized over the tp mesh as the main
job does it: `torch_sp`, torch's `nn.RMSNorm` under `SequenceParallel` (with a residual, `norm(x + residual)`, the
DTensor add included); `shardnorm_sp`, shardnorm's `RMSNorm` under `SequenceParallelNorm` without a reducer (the
weight grad comes back `Partial`, as under the main job's FSDP2; the residual add fused); `shardnorm_sp_reducer`,
the same with `attach_reducer`, inside `shardnorm.accumulate`: the reducer's per-call cost without its
once-per-step all-reduce. `rms_gather` rows: the output all-gathered for column-parallel consumers (torch's norm
then DTensor's redistribute, as `PrepareModuleInput` does it; shardnorm's `SequenceParallelNorm(output_layouts=
Replicate())`, its gather on the local tensors), and in backward the consumers' `Partial` grad reduce-scattered;
every rank runs the same calls in the same order; `(all_gather)` / `(reduce_scatter)` rows (more than one rank): the
collective alone, launched and waited for as the functional op and as the process group's own (`collective_rows`).
Other rows run no collective in the timed calls.

Host time of one call: time.perf_counter around CALLS calls queued back to back (a sync before and after, none
inside), the median of ROUNDS rounds, the best of 3 such medians; forward, and forward+backward (`y.backward(dy)`).
The providers of a case take turns round by round, so a slow stretch of the shared CPU falls on all of them.
Writes DIR/host_time.{json,md} (`--dtensor`: DIR/host_time_dtensor.{json,md}, rank 0); `--profile` adds a cProfile
of each provider's forward+backward, DIR/profile/<case>-<provider>.txt.

`--layers`: the eager call layer by layer, each layer timed from its own entry point (the layers below it
included), against torch's module and functional call: forward, the launcher alone (`Launcher.__call__`, outputs
allocated once), the plan (`_FwdPlan.__call__`: allocations and the launch), `kernels.norm_fwd` (the plan lookup),
`ops.norm` (the autograd node), the functional call, the module; backward, the plan (`_BwdPlan.__call__`), the
backward alone through the autograd engine (`torch.autograd.grad` of a retained graph, ours and torch's), then
forward+backward for `ops.norm`, the functional call and the module. Also timed: the pieces a launch and a plan call are made of
(Triton's current device and stream, torch's, the allocations). Writes DIR/host_time_layers.{json,md} after every
case. Needs the Triton backend: CUDA tensors, or on a CPU `TRITON_INTERPRET=1 SHARDNORM_BACKEND=triton` (the
interpreter runs the kernels: a check that it runs, not a timing).
"""

import argparse
import contextlib
import cProfile
import importlib
import io
import os
import pstats
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import shardnorm
from benchmarks.common import command, environment, table, turns, write_json
from shardnorm import ops, settings

SHAPES = ((8, 4096), (8, 1024), (4096, 128))
DTENSOR_SHAPES = {"cuda": ((1, 16, 4096),), "cpu": ((1, 16, 64), (1, 16, 4096))}  # [batch, sequence, hidden]
ROUNDS, CALLS = 7, 50


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_us_interleaved(fns: dict, calls=CALLS, rounds=ROUNDS, best_of=3) -> dict:
    """Host microseconds per call of each `name: fn`, the fns taking turns within every round: best of `best_of`
    medians over `rounds` rounds of `calls` calls."""
    for fn in fns.values():  # warm-up: compile kernels, fill caches
        for _ in range(3):
            fn()
    best = {}
    for _ in range(best_of):
        samples = {name: [] for name in fns}
        for r in range(rounds):
            for name in turns(list(fns), r):
                sync()
                start = time.perf_counter()
                for _ in range(calls):
                    fns[name]()
                samples[name].append((time.perf_counter() - start) / calls * 1e6)
                sync()
        for name, times in samples.items():
            best[name] = min(best.get(name, float("inf")), statistics.median(times))
    return best


def profile_text(fn, calls: int = 200, top: int = 30) -> str:
    """cProfile of `calls` calls of fn after a warm-up: the `top` functions by own time, then by cumulative time."""
    for _ in range(3):
        fn()
    sync()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(calls):
        fn()
    sync()
    profile.disable()
    text = io.StringIO()
    stats = pstats.Stats(profile, stream=text)
    text.write(f"{calls} calls\n")
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return text.getvalue()


def plain_providers(rms: bool, n: int, device, dtype) -> dict:
    ours = (shardnorm.RMSNorm if rms else shardnorm.LayerNorm)(n, device=device, dtype=dtype)
    theirs = (torch.nn.RMSNorm if rms else torch.nn.LayerNorm)(n, device=device, dtype=dtype)
    with torch.no_grad():
        for p in list(ours.parameters()) + list(theirs.parameters()):
            p.normal_()
    w, b = ours.weight, getattr(ours, "bias", None)
    result = {
        "shardnorm_module": ours,
        "torch_module": theirs,
        "shardnorm_module_compiled": torch.compile(ours, fullgraph=True),
        "torch_module_compiled": torch.compile(theirs, fullgraph=True),
        "shardnorm_functional": (lambda x: shardnorm.rms_norm(x, (n,), w)) if rms else
        (lambda x: shardnorm.layer_norm(x, (n,), w, b)),
        "torch_functional": (lambda x: F.rms_norm(x, (n,), w)) if rms else (lambda x: F.layer_norm(x, (n,), w, b)),
        # the private node with direct=False: the op route, timed in eager; a signature change fails this row only
        "shardnorm_ops": lambda x: ops._NormFunction.apply(x, w, b, None, None, None, (1e-6, rms, False, False, None)),
    }
    try:
        from liger_kernel.transformers import LigerLayerNorm, LigerRMSNorm

        result["liger_module"] = (LigerRMSNorm if rms else LigerLayerNorm)(n).to(device=device, dtype=dtype)
    except Exception:  # not installed, or no GPU
        pass
    return result


def plain_cases(shapes, device, dtype):
    """(row fields, {provider: fn(x)}, inputs, dy, context) per norm and shape."""
    for rms in (True, False):
        for m, n in shapes:
            x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
            dy = torch.randn(m, n, device=device, dtype=dtype)
            fields = {"norm": "rms" if rms else "ln", "m": m, "n": n, "shape": f"{m} x {n}"}
            yield fields, plain_providers(rms, n, device, dtype), (x,), dy, contextlib.nullcontext()


class _AddNorm(torch.nn.Module):
    """torch's norm on x + residual: the main job's pre-norm step for torch's norms (parallel/model.py)."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x, residual):
        return self.norm(x + residual)


def dtensor_providers(n: int, mesh, device, dtype, residual: bool, gather: bool = False) -> tuple:
    """({provider: fn(x, residual)}, the module whose grads go to the reducer). `gather`: the output all-gathered for
    column-parallel consumers (torch's `PrepareModuleInput` redistribute after its norm; shardnorm's
    `SequenceParallelNorm(output_layouts=Replicate())`)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import SequenceParallel, parallelize_module

    from shardnorm.distributed import SequenceParallelNorm, attach_reducer

    def make(cls, style, reducer=False):
        norm = cls(n, eps=1e-6, device=device, dtype=dtype)
        with torch.no_grad():
            norm.weight.normal_(generator=torch.Generator(device).manual_seed(0))
        norm = parallelize_module(norm, mesh, style)
        if reducer:
            attach_reducer(norm)
        return norm

    layouts = {"output_layouts": Replicate()} if gather else {}
    theirs = make(torch.nn.RMSNorm, SequenceParallel())
    ours = make(shardnorm.RMSNorm, SequenceParallelNorm(**layouts))
    routed = make(shardnorm.RMSNorm, SequenceParallelNorm(**layouts), reducer=True)
    if gather:
        replicate = (Replicate(),)
        return {"torch_sp": lambda x, r: theirs(x).redistribute(placements=replicate),
                "shardnorm_sp": lambda x, r: ours(x), "shardnorm_sp_reducer": lambda x, r: routed(x)}, routed
    if residual:
        add = _AddNorm(theirs)
        return {"torch_sp": lambda x, r: add(x, r), "shardnorm_sp": lambda x, r: ours(x, r)[0],
                "shardnorm_sp_reducer": lambda x, r: routed(x, r)[0]}, routed
    return {"torch_sp": lambda x, r: theirs(x), "shardnorm_sp": lambda x, r: ours(x),
            "shardnorm_sp_reducer": lambda x, r: routed(x)}, routed


def dtensor_cases(shapes, mesh, device, dtype):
    """(row fields, {provider: fn(x, residual)}, inputs, dy, context) per shape: without and with a residual, and the
    output all-gathered (its grad a `Partial` sum, as column-parallel consumers give it)."""
    from torch.distributed.tensor import DTensor, Partial, Shard

    world, rank = mesh.size(), mesh.get_local_rank()
    gen = torch.Generator(device).manual_seed(1234 + rank)
    for b, s, n in shapes:
        if s % world:
            raise SystemExit(f"--shapes: sequence length {s} is not divisible by the {world} ranks")

        def shard(requires_grad=False):
            local = torch.randn(b, s // world, n, device=device, dtype=dtype, generator=gen)
            return DTensor.from_local(local.requires_grad_(requires_grad), mesh, [Shard(1)], run_check=False)

        for residual, gather in ((False, False), (True, False), (False, True)):
            x, r, dy = shard(True), shard(True) if residual else None, shard()
            if gather:
                dy = DTensor.from_local(torch.randn(b, s, n, device=device, dtype=dtype, generator=gen), mesh,
                                        [Partial()], run_check=False)
            fns, routed = dtensor_providers(n, mesh, device, dtype, residual, gather)
            fields = {"norm": "add_rms" if residual else "rms_gather" if gather else "rms", "b": b, "s": s, "n": n,
                      "local_rows": b * s // world, "shape": f"{b} x {s} x {n} ({b * s // world})"}
            yield fields, fns, (x, r), dy, shardnorm.accumulate(routed)


def init_dtensor(device_type: str):
    """The default process group (torchrun's, else a world of one), this rank's device and the tp mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from parallel.runtime import free_port

    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    if device_type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    return device, init_device_mesh(device_type, (dist.get_world_size(),))


def runnable(fns: dict, inputs: tuple, dy) -> dict:
    """Why each provider whose forward+backward raises was left out (it is removed from `fns`)."""
    failed = {}
    for name, fn in list(fns.items()):
        try:
            fn(*inputs).backward(dy)
        except Exception as e:  # a provider that fails is reported, not fatal
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            del fns[name]
    return failed


def measure(cases, out: Path, profile: bool, main: bool) -> list[dict]:
    rows = []
    for fields, fns, inputs, dy, context in cases:
        with context:
            failed = runnable(fns, inputs, dy)
            forward = host_us_interleaved({name: (lambda f=f: f(*inputs)) for name, f in fns.items()})
            steps = {name: (lambda f=f: f(*inputs).backward(dy)) for name, f in fns.items()}
            backward = host_us_interleaved(steps)
            if profile and main:
                (out / "profile").mkdir(parents=True, exist_ok=True)
                label = f"{fields['norm']}-{'x'.join(str(fields[k]) for k in ('b', 's', 'm', 'n') if k in fields)}"
                for name, step in steps.items():
                    (out / "profile" / f"{label}-{name}.txt").write_text(profile_text(step))
        rows += [{**fields, "provider": name, "failed": why} for name, why in failed.items()]
        rows += [{**fields, "provider": name, "forward_us": forward[name], "forward_backward_us": backward[name]}
                 for name in fns]
        if main:
            print("\n".join(map(str, rows[-len(failed) - len(fns):])), flush=True)
    return rows


def collective_rows(shapes, mesh, device, dtype) -> list[dict]:
    """Host us per collective as the eager sequence-parallel gather launches it, waited for (no host sync): the
    functional op (`torch.ops._c10d_functional`, what DTensor's redistribute calls) against the process group's own
    (`_torch_compat.all_gather_start` / `reduce_scatter_start`); the sharded dim's rows as the norm gathers them."""
    from shardnorm import _torch_compat

    group, world = mesh.get_group(0), mesh.size()
    ops_ = torch.ops._c10d_functional
    rows = []
    for b, s, n in shapes:
        local = torch.randn(b * s // world, n, device=device, dtype=dtype)
        full = torch.randn(b * s, n, device=device, dtype=dtype)
        fns = {("all_gather", "functional"): lambda: ops_.wait_tensor(
                   ops_.all_gather_into_tensor(local, world, group.group_name)),
               ("all_gather", "process_group"): lambda: _torch_compat.collective_result(
                   _torch_compat.all_gather_start(local, group)),
               ("reduce_scatter", "functional"): lambda: ops_.wait_tensor(
                   ops_.reduce_scatter_tensor(full, "sum", world, group.group_name)),
               ("reduce_scatter", "process_group"): lambda: _torch_compat.collective_result(
                   _torch_compat.reduce_scatter_start(full, group))}
        us = host_us_interleaved(fns)
        rows += [{"norm": f"({kind})", "shape": f"{b} x {s} x {n} ({b * s // world})", "provider": provider,
                  "forward_us": us[kind, provider], "forward_backward_us": float("nan")}
                 for kind, provider in fns]
    return rows


def write(out: Path, name: str, rows: list[dict], env: dict, title: str, shape_header: str) -> None:
    write_json(out / f"{name}.json", {"env": env, "rows": rows})
    lines = [f"{title}, {env['device']}, {env['dtype']}, torch {env['torch']}", "", f"Command: `{env['command']}`", ""]
    times = lambda r: ([f"{r['forward_us']:.1f}", f"{r['forward_backward_us']:.1f}"] if "failed" not in r  # noqa: E731
                       else [f"failed: {r['failed']}", ""])
    lines += table(["norm", shape_header, "provider", "forward", "forward+backward"],
                   [[r["norm"], r["shape"], r["provider"], *times(r)] for r in rows])
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def layer_fns(rms: bool, m: int, n: int, device, dtype) -> tuple[dict, dict]:
    """({layer: fn()} timed per forward call, {layer: fn()} timed per forward+backward or backward call) for one
    norm and shape: shardnorm's eager path from the launcher up, torch's module and functional call beside it."""
    from triton.runtime.driver import driver

    config = importlib.import_module("shardnorm.kernels.config")
    kf = importlib.import_module("shardnorm.kernels.norm_fwd")
    kb = importlib.import_module("shardnorm.kernels.norm_bwd")
    ours = (shardnorm.RMSNorm if rms else shardnorm.LayerNorm)(n, eps=1e-6, device=device, dtype=dtype)
    theirs = (torch.nn.RMSNorm if rms else torch.nn.LayerNorm)(n, eps=1e-6, device=device, dtype=dtype)
    with torch.no_grad():
        for p in list(ours.parameters()) + list(theirs.parameters()):
            p.normal_()
    w, b = ours.weight, getattr(ours, "bias", None)
    wd, bd = w.detach(), (b.detach() if b is not None else None)
    x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=True)
    xd, dy = x.detach(), torch.randn(m, n, device=device, dtype=dtype)
    eps = 1e-6
    # the plans kernels.norm_fwd / norm_bwd look up for these arguments
    fwd_kernels = config.specialized(device) if n > config.MAX_FUSED_N_FWD else ""
    fwd_plan = kf._plan(n, wd.element_size(), True, bd is not None, False, rms, False, device, fwd_kernels)
    bwd_kernels = config.specialized(device) if n >= config.MIN_LONG_N_BWD else ""
    bwd_plan = kb._plan(n, wd.dtype, bd is not None, False, rms, False, device, bwd_kernels)
    y0, _, mean0, rstd0 = fwd_plan(xd, wd, bd, None, eps)
    programs = fwd_plan._programs(m)
    stride = xd.stride()[0]
    # backward alone, through the autograd engine, the graph retained so that it runs again: ours against torch's
    ours_y, torch_y = ops.norm(x, w, b, None, eps, rms, False)[0], (
        F.rms_norm(x, (n,), w, eps) if rms else F.layer_norm(x, (n,), w, b, eps))

    functional = (lambda: shardnorm.rms_norm(x, (n,), w, eps)) if rms else \
        (lambda: shardnorm.layer_norm(x, (n,), w, b, eps))
    torch_functional = (lambda: F.rms_norm(x, (n,), w, eps)) if rms else (lambda: F.layer_norm(x, (n,), w, b, eps))
    forward = {}
    if device.type == "cuda":  # what a launch asks Triton's driver for, and torch's current device beside it
        active = driver.active
        forward["triton_device_stream"] = lambda: active.get_current_stream(active.get_current_device())
        forward["torch_current_device"] = torch.cuda.current_device
    forward |= {
        "empty_like_x": lambda: torch.empty_like(xd),
        "new_empty_rows_fp32": lambda: xd.new_empty(m, dtype=torch.float32),
        "launcher": lambda: fwd_plan.kernel((programs,), xd, None, wd, bd, y0, None, mean0, rstd0, stride, 0, m, n,
                                            eps),
        "plan": lambda: fwd_plan(xd, wd, bd, None, eps),
        "kernels.norm_fwd": lambda: ops._kernels().norm_fwd(xd, wd, bd, None, eps, rms, False),
        "ops.norm": lambda: ops.norm(x, w, b, None, eps, rms, False),
        "functional": functional,
        "module": lambda: ours(x),
        "torch_functional": torch_functional,
        "torch_module": lambda: theirs(x),
    }
    backward = {
        "bwd_plan": lambda: bwd_plan(dy, None, xd, wd, mean0, rstd0),
        "bwd_ops.norm": lambda: torch.autograd.grad(ours_y, (x,), dy, retain_graph=True),
        "bwd_torch_functional": lambda: torch.autograd.grad(torch_y, (x,), dy, retain_graph=True),
        "fb_ops.norm": lambda: ops.norm(x, w, b, None, eps, rms, False)[0].backward(dy),
        "fb_functional": lambda: functional().backward(dy),
        "fb_module": lambda: ours(x).backward(dy),
        "fb_torch_functional": lambda: torch_functional().backward(dy),
        "fb_torch_module": lambda: theirs(x).backward(dy),
    }
    return forward, backward


def measure_layers(shapes, device, dtype, out: Path, env: dict) -> list[dict]:
    """Per-layer host us per call of every norm and shape, both directions; the files rewritten after each case."""
    if device.type != "cuda" and settings.get().backend != "triton":
        raise SystemExit("--layers times the Triton path: run it on a GPU, or on a CPU with TRITON_INTERPRET=1 "
                         "SHARDNORM_BACKEND=triton (a check that it runs, not a timing)")
    rows = []
    for rms in (True, False):
        for m, n in shapes:
            forward, backward = layer_fns(rms, m, n, device, dtype)
            fields = {"norm": "rms" if rms else "ln", "m": m, "n": n, "shape": f"{m} x {n}"}
            for kind, fns in (("forward", forward), ("backward", backward)):
                for name, us in host_us_interleaved(fns).items():
                    rows.append({**fields, "kind": kind, "layer": name, "us": us})
                    print(rows[-1], flush=True)
            write_layers(out, rows, env)
    return rows


def write_layers(out: Path, rows: list[dict], env: dict) -> None:
    write_json(out / "host_time_layers.json", {"env": env, "rows": rows})
    cases = list(dict.fromkeys((r["norm"], r["shape"]) for r in rows))
    layers = list(dict.fromkeys(r["layer"] for r in rows))
    us = {(r["norm"], r["shape"], r["layer"]): r["us"] for r in rows}
    lines = [f"Host us per call, layer by layer, {env['device']}, {env['dtype']}, torch {env['torch']}, "
             f"Triton {env['triton']}", "", f"Command: `{env['command']}`", "",
             "Each layer timed from its own entry point (the layers below it included); `fb_*`: forward+backward.",
             ""]
    lines += table(["layer", *[f"{norm} {shape}" for norm, shape in cases]],
                   [[layer, *[f"{us[(*case, layer)]:.1f}" if (*case, layer) in us else "" for case in cases]]
                    for layer in layers])
    (out / "host_time_layers.md").write_text("\n".join(lines) + "\n")


def parse_shape(text: str) -> tuple:
    return tuple(map(int, text.split("x")))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--dtensor", action="store_true", help="sequence-parallel norms on DTensor Shard(1) inputs")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="*", type=parse_shape,
                        help="MxN (default 8x4096 8x1024 4096x128); --dtensor: BxSxN global, sharded on S "
                             "(default 1x16x4096 on GPUs, also 1x16x64 on CPU)")
    parser.add_argument("--profile", action="store_true", help="also write a cProfile of each provider to OUT/profile/")
    parser.add_argument("--layers", action="store_true", help="the eager call layer by layer (launcher, plan, "
                        "kernels, ops.norm, functional, module; backward) instead of the providers")
    args = parser.parse_args(argv)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)
    if args.layers:
        env = {**environment(args.device), "dtype": str(dtype), "command": command(__spec__.name, argv)}
        measure_layers(args.shapes or SHAPES, torch.device(args.device), dtype, args.out, env)
        print((args.out / "host_time_layers.md").read_text())
        return
    if not args.dtensor:
        cases = plain_cases(args.shapes or SHAPES, torch.device(args.device), dtype)
        rows = measure(cases, args.out, args.profile, True)
        env = {**environment(args.device), "dtype": str(dtype), "command": command(__spec__.name, argv)}
        write(args.out, "host_time", rows, env, "Host us per call", "M x N")
        return
    import torch.distributed as dist

    device, mesh = init_dtensor(args.device)
    main_rank = dist.get_rank() == 0
    rows = measure(dtensor_cases(args.shapes or DTENSOR_SHAPES[args.device], mesh, device, dtype), args.out,
                   args.profile, main_rank)
    if mesh.size() > 1:
        rows += collective_rows(args.shapes or DTENSOR_SHAPES[args.device], mesh, device, dtype)
    dist.barrier()
    if main_rank:
        env = {**environment(args.device, mesh.size()), "dtype": str(dtype), "world_size": mesh.size(),
               "command": command(__spec__.name, argv)}
        write(args.out, "host_time_dtensor", rows, env,
              f"Host us per call, DTensor Shard(1) inputs on a {mesh.size()}-rank mesh", "B x S x N (local rows)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
