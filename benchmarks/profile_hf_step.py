"""Where a compiled HF decoder step's GPU time goes: the model's own norms vs shardnorm, kernel by kernel.

    python benchmarks/profile_hf_step.py --out $OUT [--arch llama] [--variants native,shardnorm]

Builds the same model as bench_hf_models.py (4 layers of 4096, 2 x 4096 tokens, bf16), compiles each
variant, warms it up, and records PROFILED_STEPS steps with torch.profiler. Each kernel's GPU time per
step is grouped by kind (GEMM, attention, norm, other elementwise/reduction), and the table lists the
kernels whose time differs most between the variants. Writes profile_<arch>.json and .md.
"""

import argparse
import collections
import json
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hf_models as bench  # noqa: E402

PROFILED_STEPS = 3


def kind(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("flash", "attention", "fmha", "sdpa")):  # first: cuDNN's SDPA kernels say sm90 too
        return "attention"
    if any(k in n for k in ("gemm", "sm90", "cutlass", "cublas", "matmul", "xmma", "nvjet")):
        return "gemm"
    if any(k in n for k in ("norm_fwd", "norm_bwd", "row_sums", "column_sum", "coop_bwd", "rsqrt", "rms", "layer_norm")):
        return "norm"
    return "other"


def profile_variant(arch: str, variant: str, layers: int) -> dict:
    with bench.restore_module_globals(arch):
        model = bench.build(arch, layers)
        model, notes = bench.PATCHES[variant](model, arch)
        runner = torch.compile(model)
        ids = bench._tokens()
        params = list(model.parameters())

        def step():
            for p in params:
                p.grad = None
            runner(input_ids=ids, labels=ids).loss.backward()

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(PROFILED_STEPS):
                step()
            torch.cuda.synchronize()
    per_kernel = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[e.name] += e.device_time_total / 1e3 / PROFILED_STEPS  # ms per step
    by_kind = collections.defaultdict(float)
    for name, ms in per_kernel.items():
        by_kind[kind(name)] += ms
    del model, runner
    bench.free()
    return dict(variant=variant, notes=notes, total_ms=sum(per_kernel.values()), by_kind=dict(by_kind),
                kernels=dict(sorted(per_kernel.items(), key=lambda kv: -kv[1])))


def markdown(arch: str, results: list) -> str:
    kinds = ("gemm", "attention", "norm", "other")
    lines = [f"# Compiled {arch} step, GPU time per step by kernel kind (ms; {torch.cuda.get_device_name()}, "
             f"torch {torch.__version__})", "", "| variant | total | " + " | ".join(kinds) + " |",
             "|---|---|" + "---|" * len(kinds)]
    for r in results:
        lines.append(f"| {r['variant']} | {r['total_ms']:.2f} | " +
                     " | ".join(f"{r['by_kind'].get(k, 0.0):.2f}" for k in kinds) + " |")
    names = set().union(*(r["kernels"] for r in results))
    spread = sorted(names, key=lambda n: -(max(r["kernels"].get(n, 0.0) for r in results)
                                           - min(r["kernels"].get(n, 0.0) for r in results)))
    lines += ["", "Kernels whose time differs most between the variants (ms per step):", "",
              "| kernel | kind | " + " | ".join(r["variant"] for r in results) + " |",
              "|---|---|" + "---|" * len(results)]
    for n in spread[:40]:
        lines.append(f"| `{n[:90]}` | {kind(n)} | " + " | ".join(f"{r['kernels'].get(n, 0.0):.3f}" for r in results) + " |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--arch", default="llama")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--variants", default="native,shardnorm")
    args = parser.parse_args()
    from torch._inductor import config as inductor_config

    inductor_config.force_disable_caches = True
    torch._dynamo.config.recompile_limit = 32
    results = [profile_variant(args.arch, v, args.layers) for v in args.variants.split(",")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"profile_{args.arch}.json").write_text(json.dumps(results, indent=1))
    table = markdown(args.arch, results)
    (out / f"profile_{args.arch}.md").write_text(table)
    print(table)


if __name__ == "__main__":
    main()
