"""bench_hf_models' harness against the ablation's: the option's cost with the model's own norms interleaved or not,
and with or without the memory statistics read around each timed step."""
import argparse, json, statistics, sys
from pathlib import Path
import torch
import benchmarks.bench_hf_models as B

OUT = Path(sys.argv[1])
args = argparse.Namespace(layers=4, no_fp32_reference=True, out=OUT, profile=False)
prepared = {}
for v in ("native", "shardnorm", "shardnorm_discard"):
    row, first, step, params = B.prepare_case("llama", "eager", v, args, {})
    prepared[v] = (row, step, params)
orig_timed_step = B.timed_step
def plain_timed_step(step, params):
    for p in params: p.grad = None
    torch.cuda.synchronize()
    ms = B._timed(step)
    for p in params: p.grad = None
    return ms, float("nan"), float("nan")
results = []
for name, variants, timed in [("A bench", ("native", "shardnorm", "shardnorm_discard"), orig_timed_step),
                              ("B no memory stats", ("native", "shardnorm", "shardnorm_discard"), plain_timed_step),
                              ("C without native", ("shardnorm", "shardnorm_discard"), orig_timed_step),
                              ("D no stats, no native", ("shardnorm", "shardnorm_discard"), plain_timed_step),
                              ("A again", ("native", "shardnorm", "shardnorm_discard"), orig_timed_step)]:
    B.timed_step = timed
    sub = {}
    for v in variants:
        row, step, params = prepared[v]
        sub[v] = (dict(variant=v), step, params)
    B.time_interleaved(sub)
    on, off = sub["shardnorm_discard"][0], sub["shardnorm"][0]
    diffs = [a - b for a, b in zip(on["step_ms"], off["step_ms"])]
    ratios = [a / b for a, b in zip(on["step_ms"], off["step_ms"])]
    r = dict(config=name, off_ms=off["ms"], on_ms=on["ms"], best_round_ratio=on["ms"] / off["ms"],
             paired_diff_ms=statistics.median(diffs), paired_ratio=statistics.median(ratios),
             host_off=off["host_median_ms"], host_on=on["host_median_ms"])
    results.append(r)
    print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
json.dump(results, open(OUT / "harness_gap.json", "w"), indent=1)
