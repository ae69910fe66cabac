"""keep_output_checks.png from the hf_ablation_*.json beside it: each variant's step over the option-off step of the
same turn, median and range.   python keep_output_checks/plot.py"""
import json
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt

here = Path(__file__).parent
runs = ["hf_ablation_llama_fp32sum", "hf_ablation_qwen3_fp32sum", "hf_ablation_llama", "hf_ablation_qwen3"]
variants = ["on", "on_nochecks", "on_hooks_only"]
fig, ax = plt.subplots(figsize=(8, 4))
for i, run in enumerate(runs):
    summary = json.loads((here / f"{run}.json").read_text())["summary"]
    for j, v in enumerate(variants):
        s = summary[v]
        x = i * (len(variants) + 1) + j
        ax.errorbar([x], [s["ratio_median"]], yerr=[[s["ratio_median"] - s["ratio_min"]], [s["ratio_max"] - s["ratio_median"]]],
                    fmt="o", color=f"C{j}", label=v if i == 0 else None, capsize=3)
ax.axhline(1.0, color="gray", lw=0.8)
ax.axhline(1.015, color="red", lw=0.8, ls="--", label="goal +1.5 %")
ax.set_xticks([i * (len(variants) + 1) + 1 for i in range(len(runs))], [r.replace("hf_ablation_", "") for r in runs])
ax.set_ylabel("step / option-off step (same turn)")
ax.set_title("HF decoders on one H200, keep_output=False: where the step cost goes")
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(here / "keep_output_checks.png", dpi=110)
