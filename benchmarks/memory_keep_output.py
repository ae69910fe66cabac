"""Memory and step time of `keep_output=False` (norm outputs recomputed in backward) on a Hugging Face Llama decoder.

One GPU, bf16, `LlamaForCausalLM` from a `LlamaConfig` (default: 4 layers, hidden 4096, intermediate 14336, 32
heads / 8 kv heads, vocab 32000, random init, no downloads), batch 2 x 4096 tokens, forward + backward with the
loss from `labels`. Variants, all holding the same weights: the model's own norms (`hf`), Liger's RMSNorm patch
(`liger`, if liger_kernel imports), shardnorm with the outputs kept (`shardnorm`) and not kept
(`shardnorm_discard`); eager and `torch.compile`d. The variants' timed steps are interleaved (step i of every
variant, then step i + 1), >= 30 per variant, medians reported:

- peak_mib: torch.cuda.max_memory_allocated in the step (reset before it) minus what was resident before it
  (every variant's weights), plus this variant's own weights and grads: the step's own peak.
- after_forward_mib: memory_allocated after the forward minus before it: what the forward keeps for backward.
- step_ms: CUDA events around forward + backward; step vs shardnorm: the median over steps of this variant's step
  time over shardnorm's in the same round (paired, so drift of the shared machine cancels).
- handles / recomputed: consumer saves that took `shardnorm.output_recompute`'s handle, and its recomputes, in the
  step (its counters).

Expected saving from keep_output=False: 2 norms a layer x tokens x hidden x 2 bytes (128 MiB a layer at the
defaults) in after_forward_mib; the peak drops by less where it falls in a layer's backward (that layer's norm
outputs are back then). The first step's loss and grads of `shardnorm_discard` are compared bitwise with
`shardnorm`'s (`bitwise_equal`), next to `shardnorm` against a repeat of itself (`deterministic`: if attention's
backward is not, neither comparison can be bitwise).

    python benchmarks/memory_keep_output.py --out benchmarks/results/keep_output   # one H100/H200, ~10 min
    python benchmarks/memory_keep_output.py --tiny --out /tmp/keep_output          # CPU smoke test

Writes keep_output.json, keep_output.md and keep_output.png (if matplotlib imports) to --out.
"""

import argparse
import inspect
import json
import statistics
import time
from pathlib import Path

import torch

import shardnorm
from shardnorm import output_recompute

MIB = 2 ** 20


def build_config(args):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                         num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                         max_position_embeddings=max(args.seq, 128), rms_norm_eps=1e-5, tie_word_embeddings=False,
                         use_cache=False)  # training: no KV cache
    config._attn_implementation = "sdpa"
    return config


def patch_liger(model):
    """Liger's apply_liger_kernel_to_llama on this model, norms only; the ImportError if liger_kernel does not
    import."""
    try:
        import liger_kernel.transformers as lt
    except ImportError as e:
        return e
    fn = lt.apply_liger_kernel_to_llama
    params = inspect.signature(fn).parameters
    kwargs = {k: False for k, v in params.items() if isinstance(v.default, bool)}
    kwargs["rms_norm"] = True
    fn(model=model, **kwargs)
    return model


def build_variants(args, device, dtype) -> tuple:
    """({name: model}, why Liger is left out or None)."""
    from transformers import LlamaForCausalLM

    config = build_config(args)
    torch.manual_seed(0)
    with torch.device(device):
        base = LlamaForCausalLM(config).to(dtype)
    state = base.state_dict()
    variants = {"hf": base}
    liger_error = None
    for name in ("shardnorm", "shardnorm_discard"):
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype)
        model.load_state_dict(state)
        result = shardnorm.convert(model, keep_output=name == "shardnorm")
        if result.skipped or result.count != 2 * args.layers + 1:
            raise RuntimeError(f"shardnorm.convert converted {result.count} norms, skipped {result.skipped}")
        variants[name] = result.model
    if not args.no_liger:
        import importlib

        modeling = importlib.import_module("transformers.models.llama.modeling_llama")
        saved = dict(vars(modeling))  # Liger rebinds LlamaRMSNorm & co. in the module: put them back after
        with torch.device(device):
            model = LlamaForCausalLM(config).to(dtype)
        model.load_state_dict(state)
        liger = patch_liger(model)
        vars(modeling).update(saved)
        if isinstance(liger, ImportError):
            liger_error = f"{type(liger).__name__}: {liger}"
        else:
            variants["liger"] = liger
    for model in variants.values():
        model.train()
    return variants, liger_error


def make_step(model, ids, compiled: bool):
    runner = torch.compile(model) if compiled else model
    params = [p for p in model.parameters() if p.requires_grad]

    def step(after_forward: list):
        for p in params:
            p.grad = None
        before = torch.cuda.memory_allocated() if ids.is_cuda else 0
        loss = runner(input_ids=ids, labels=ids).loss
        if ids.is_cuda:
            after_forward.append((torch.cuda.memory_allocated() - before) / MIB)
        loss.backward()
        return loss

    return step, params


def timed(step, params, device) -> dict:
    after_forward = []
    if device.type == "cuda":
        torch.cuda.synchronize()
        resident = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(after_forward)
        end.record()
        torch.cuda.synchronize()
        own = 2 * sum(p.numel() * p.element_size() for p in params)  # weights + grads
        peak = (torch.cuda.max_memory_allocated() - resident) / MIB + own / MIB
        out = dict(ms=start.elapsed_time(end), peak_mib=peak, after_forward_mib=after_forward[0])
    else:
        t0 = time.perf_counter()
        step(after_forward)
        out = dict(ms=1e3 * (time.perf_counter() - t0), peak_mib=float("nan"), after_forward_mib=float("nan"))
    for p in params:
        p.grad = None
    return out


def first_step_grads(model, ids):
    for p in model.parameters():
        p.grad = None
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    return loss.detach(), grads


def same(a, b) -> bool:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    return bool(torch.equal(loss_a, loss_b) and all(torch.equal(x, y) for x, y in zip(grads_a, grads_b)))


def run(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.float32 if args.tiny else torch.bfloat16
    variants, liger_error = build_variants(args, device, dtype)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    # the same step twice with the outputs kept (is the step deterministic at all: attention's backward may
    # not be), then with them discarded
    kept = first_step_grads(variants["shardnorm"], ids)
    deterministic = same(kept, first_step_grads(variants["shardnorm"], ids))
    bitwise = same(kept, first_step_grads(variants["shardnorm_discard"], ids))
    del kept
    rows = []
    for mode in args.modes:
        steps = {name: make_step(model, ids, mode == "compiled") for name, model in variants.items()}
        samples = {name: [] for name in steps}
        errors = {}
        for name, (step, params) in steps.items():  # warm-up (and compile) each variant
            try:
                for _ in range(args.warmup):
                    timed(step, params, device)
            except Exception as e:  # noqa: BLE001 - a variant that fails (e.g. under compile) is reported, not fatal
                errors[name] = f"{type(e).__name__}: {e}"[:300]
        for _ in range(args.steps):
            for name, (step, params) in steps.items():
                if name not in errors:
                    output_recompute.counters(reset=True)
                    sample = timed(step, params, device)
                    counts = output_recompute.counters()
                    sample["handles"] = counts["saved_as_handle"]
                    sample["recomputed"] = counts["recomputed"]
                    samples[name].append(sample)
        kept_ms = [s["ms"] for s in samples["shardnorm"]]
        for name in steps:
            row = dict(mode=mode, variant=name, steps=len(samples[name]), error=errors.get(name))
            # step i of this variant over step i of shardnorm's (run next to each other): drift cancels
            ratios = [s["ms"] / k for s, k in zip(samples[name], kept_ms)]
            row["ms_vs_shardnorm"] = statistics.median(ratios) if ratios and len(ratios) == len(kept_ms) else None
            for key in ("ms", "peak_mib", "after_forward_mib", "handles", "recomputed"):
                values = [s[key] for s in samples[name]]
                row[key] = statistics.median(values) if values else None
                row[f"{key}_all"] = values
            rows.append(row)
        del steps
        torch._dynamo.reset()
    expected = 2 * args.layers * args.batch * args.seq * args.hidden * (4 if args.tiny else 2) / MIB
    notes = [f"liger: left out, liger_kernel does not import ({liger_error})"] if liger_error else []
    return dict(device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu", torch=torch.__version__,
                notes=notes,
                config=vars(args), deterministic=deterministic, bitwise_equal=bitwise, expected_saving_mib=expected,
                rows=rows)


def markdown(result: dict) -> str:
    lines = [f"keep_output=False on LlamaForCausalLM ({result['config']['layers']} layers, hidden "
             f"{result['config']['hidden']}, {result['config']['batch']} x {result['config']['seq']} tokens), "
             f"{result['device']}, torch {result['torch']}; medians of {result['config']['steps']} interleaved steps. "
             f"Expected saving {result['expected_saving_mib']:.1f} MiB. First step's loss and grads, shardnorm_discard "
             f"vs shardnorm: bitwise equal {result['bitwise_equal']} (shardnorm vs itself: "
             f"{result['deterministic']}).", "",
             "| mode | variant | step ms | step vs shardnorm | peak MiB | kept after forward MiB | "
             "vs shardnorm: peak / after forward MiB | handles / recomputed per step |",
             "|---|---|---|---|---|---|---|---|"]
    by = {(r["mode"], r["variant"]): r for r in result["rows"]}
    for r in result["rows"]:
        if r["error"]:
            lines.append(f"| {r['mode']} | {r['variant']} | failed: {r['error']} | | | | | |")
            continue
        ref = by.get((r["mode"], "shardnorm"))
        delta = f"{r['peak_mib'] - ref['peak_mib']:+.0f} / {r['after_forward_mib'] - ref['after_forward_mib']:+.0f}" \
            if ref and not ref["error"] and r["peak_mib"] == r["peak_mib"] else ""
        ratio = f"{r['ms_vs_shardnorm'] - 1:+.2%}" if r.get("ms_vs_shardnorm") else ""
        lines.append(f"| {r['mode']} | {r['variant']} | {r['ms']:.1f} | {ratio} | {r['peak_mib']:.0f} | "
                     f"{r['after_forward_mib']:.0f} | {delta} | {r['handles']:.0f} / {r['recomputed']:.0f} |")
    return "\n".join(lines + [""] + result["notes"]) + "\n"


def plot(result: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [r for r in result["rows"] if not r["error"]]
    labels = [f"{r['mode']}\n{r['variant']}" for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for ax, key, title in zip(axes, ("peak_mib", "after_forward_mib", "ms"),
                              ("peak MiB", "kept after forward MiB", "step ms")):
        ax.bar(range(len(rows)), [r[key] if r[key] == r[key] else 0 for r in rows],
               color=["tab:red" if r["variant"] == "shardnorm_discard" else "tab:blue" for r in rows])
        ax.set_xticks(range(len(rows)), labels, fontsize=7, rotation=45, ha="right")
        ax.set_title(title)
    fig.suptitle(f"keep_output=False, {result['device']} (expected saving {result['expected_saving_mib']:.0f} MiB)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for keep_output.json / .md / .png")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 model on CPU (smoke test)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"])
    parser.add_argument("--no-liger", action="store_true")
    args = parser.parse_args()
    if args.tiny:
        args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads = 2, 64, 96, 4, 2
        args.vocab, args.batch, args.seq, args.steps, args.warmup = 100, 2, 16, 3, 1
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = run(args)
    (out / "keep_output.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (out / "keep_output.md").write_text(text)
    plotted = plot(result, out / "keep_output.png")
    print(text + (f"plot: {out / 'keep_output.png'}" if plotted else "(no matplotlib: no plot)"))


if __name__ == "__main__":
    main()
