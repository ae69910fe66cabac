#!/usr/bin/env bash
# torchtitan 0.3's own trainer on its llama3 debug model, stock vs shardnorm (shardnorm.integrations.torchtitan),
# on 2 GPUs with NCCL, bf16 (FSDP2 mixed precision), 20 steps of 2 micro-batches:
#   tp2   : dp_shard=1 x tp=2 with sequence parallelism (the norms shardnorm's reducer takes over)
#   fsdp2 : dp_shard=2 x tp=1 (FSDP only: shardnorm's kernels, no sequence-parallel norm grads)
# FSDP x TP with a data-parallel degree > 1 needs 4 GPUs (dp_shard=2 x tp=2); on 2 GPUs dp_shard=1 with tp=2
# is the tp2 case. Per case and norm: the loss per step and the all-reduces of forward + backward per step,
# and shardnorm's reducer collectives. Writes $OUT/torchtitan_gpu.{json,md}; each run is recorded even
# when it fails. Usage: bash benchmarks/gpu_torchtitan.sh OUT   (torchtitan and its imports on PYTHONPATH,
# e.g. pip install --no-index --no-deps --target /tmp/site .whl/*.whl; export PYTHONPATH=/tmp/site)
set -u
OUT=${1:?usage: bash benchmarks/gpu_torchtitan.sh OUT}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export TORCHTITAN_RUNNER_DEVICE=${TORCHTITAN_RUNNER_DEVICE:-cuda}  # cpu: a smoke run of this script
STEPS=${STEPS:-20}
SEQ=${SEQ:-2048}
EXTRA=${EXTRA:-}  # more torchtitan CLI args (a CPU smoke run: --override.imports tests.torchtitan_runner.sdpa_on_cpu)
WORK=$(mktemp -d)

python3 - "$OUT" "$WORK" <<'PY'
import json, sys, traceback
out, work = sys.argv[1], sys.argv[2]
info = {}
try:
    import torch
    info["torch"] = torch.__version__
    info["cuda_devices"] = torch.cuda.device_count()
    info["torch_has_distributed_set_timeout"] = hasattr(torch.distributed, "set_timeout")
    import torchtitan
    info["torchtitan"] = torchtitan.__version__
    import torchtitan.trainer  # noqa: F401  (the trainer's imports: datasets, tyro, spmd_types, ...)
    from tests.torchtitan_runner import make_assets
    make_assets(work)
    info["import_ok"] = True
except Exception as e:
    info["import_ok"] = False
    info["import_error"] = f"{type(e).__name__}: {e}"
    info["traceback"] = traceback.format_exc()[-3000:]
json.dump(info, open(f"{out}/torchtitan_env.json", "w"), indent=1)
print("environment:", json.dumps({k: v for k, v in info.items() if k != "traceback"}))
PY

run() {  # case norm extra-args...
    local case=$1 norm=$2; shift 2
    local log="$OUT/torchtitan_${case}_${norm}.log"
    timeout "${RUN_TIMEOUT:-240}" python3 -m torch.distributed.run --nproc_per_node=2 --master_port=$((29500 + RANDOM % 1000)) \
        -m tests.torchtitan_runner "$OUT/torchtitan_${case}_${norm}.json" --module tests.torchtitan_runner \
        --config "${norm}_debugmodel" --hf_assets_path "$WORK/tokenizer" --dataloader.dataset_path "$WORK/c4_test" \
        --training.seq_len "$SEQ" --training.local_batch_size 4 --training.global_batch_size "$GLOBAL" \
        --training.steps "$STEPS" --debug.seed 7 --dump_folder "$WORK/out_${case}_${norm}" "$@" $EXTRA > "$log" 2>&1
    echo "$case $norm rc=$?" | tee -a "$OUT/torchtitan_rc.txt"
}

if python3 -c "import json,sys; sys.exit(0 if json.load(open('$OUT/torchtitan_env.json'))['import_ok'] else 1)"; then
    for norm in stock shardnorm; do
        GLOBAL=8 run tp2 "$norm" --parallelism.tensor_parallel_degree 2
        GLOBAL=16 run fsdp2 "$norm" --parallelism.data_parallel_shard_degree 2
    done
fi

python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
env = json.load(open(f"{out}/torchtitan_env.json"))
rcs = dict(l.rsplit(" rc=", 1) for l in open(f"{out}/torchtitan_rc.txt").read().split("\n") if l) \
    if os.path.exists(f"{out}/torchtitan_rc.txt") else {}
result = {"env": env, "cases": {}}
md = [f"# torchtitan {env.get('torchtitan')} llama3 debugmodel, stock vs shardnorm (torch {env.get('torch')}, "
      f"{env.get('cuda_devices')} GPUs, bf16, 2 micro-batches/step)", ""]
if not env.get("import_ok"):
    md.append(f"torchtitan could not be imported: `{env.get('import_error')}`")
for case in ("tp2", "fsdp2"):
    runs = {}
    for norm in ("stock", "shardnorm"):
        path = f"{out}/torchtitan_{case}_{norm}.json"
        if os.path.exists(path):
            runs[norm] = json.load(open(path))
        else:
            log = f"{out}/torchtitan_{case}_{norm}.log"
            tail = open(log).read()[-2500:] if os.path.exists(log) else "not run"
            runs[norm] = {"error": f"rc={rcs.get(f'{case} {norm}')}", "log_tail": tail}
    result["cases"][case] = runs
    md += [f"## {case}", ""]
    if all("loss" in r for r in runs.values()):
        s, n = runs["stock"], runs["shardnorm"]
        rel = [abs(a - b) / abs(a) for a, b in zip(s["loss"], n["loss"])]
        runs["max_rel_loss_diff"] = max(rel) if rel else None
        md += ["| step | stock loss | shardnorm loss | rel diff | all-reduces fwd+bwd stock | shardnorm | "
               "shardnorm reducer collectives (cumulative) |", "|---|---|---|---|---|---|---|"]
        for i, (a, b) in enumerate(zip(s["loss"], n["loss"])):
            md.append(f"| {i + 1} | {a:.5f} | {b:.5f} | {rel[i]:.2e} | {s['fwd_bwd_all_reduces'][i]} | "
                      f"{n['fwd_bwd_all_reduces'][i]} | {n['reducer_collectives'][i]} |")
        md += ["", f"max relative loss difference: {runs['max_rel_loss_diff']:.2e}", ""]
    else:
        for norm, r in runs.items():
            if "error" in r:
                md += [f"{norm}: {r['error']}", "", "```", r["log_tail"][-1500:], "```", ""]
json.dump(result, open(f"{out}/torchtitan_gpu.json", "w"), indent=1)
open(f"{out}/torchtitan_gpu.md", "w").write("\n".join(md) + "\n")
print("\n".join(md))
PY
rm -rf "$WORK"
