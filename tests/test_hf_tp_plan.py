"""A tiny Qwen3 loaded with `from_pretrained(path, tp_plan="auto")` on 2 ranks: norm grads over 2 micro-batches.

transformers' `replicated_with_grad_allreduce` style (Qwen3's q_norm/k_norm) all-reduces `.grad` after every
micro-batch, so its grad is 2*G1 + G2; after `shardnorm.integrations.transformers.convert_model` every norm
grad is the single-process G1 + G2 (<= 1e-5 rel) on every rank, with one reducer all-reduce per step where
stock issues one per q/k norm per micro-batch. One spawn runs two model shapes (head_dim 12 with transformers'
style names, head_dim 20 with shardnorm's registered style named in the plan), a plan style on a norm that
shardnorm cannot honour (a clear error), then
an Accelerate loop (`accelerator.accumulate`, gradient_accumulation_steps=2, clipping, AdamW, 5 steps) with
`bind_accumulation`: the norm grads are final when the last micro-batch's backward returns (before clipping
reads them) and the losses follow the single-process run; stock's drift.
Last, transformers' `sequence_parallel` style on the decoder norms (a user plan): shardnorm's takeover equals
transformers' own DTensor grads (the sum over ranks) with one all-reduce per step.
A second spawn: `keep_output=False` under a tp_plan. transformers' colwise styles save a DTensor made around the norm
output they read (`DTensor.from_local`); the recompute follows it to the norm's output, so every norm output is
saved as a handle and made again once in the backward, loss and grads bitwise those of keep_output=True.
(transformers.Trainer itself refuses a tp_plan model on CPU: Accelerate allows a ParallelismConfig only on
GPU devices, DeepSpeed or FSDP2; the Trainer with `enable` on 2 GPUs ran in `benchmarks/gpu_hf_tp_plan.py`, removed
in d7c3b12: `git show d7c3b12^:benchmarks/gpu_hf_tp_plan.py`.)
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from spawn_ranks import DEVICE, rank_device, spawn
from torch.distributed.tensor import DTensor

transformers = pytest.importorskip("transformers")

TOL = 1e-5
LOSS_TOL = 1e-5
MICRO = 2
# (hidden, heads, kv heads, head_dim): hidden sizes and head dims that are not powers of two
SHAPES = [(48, 4, 2, 12), (40, 2, 2, 20)]


def _save_tiny_qwen3(path, hidden, heads, kv_heads, head_dim, seed):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(vocab_size=64, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    with torch.no_grad():  # fresh norm weights: a grad scaled by a weight of 1 would hide a scale bug
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)


def _batches(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 64, (2, 9), generator=g) for _ in range(MICRO)]


def _loss(model, ids):
    ids = ids.to(model.device)
    return model(input_ids=ids, labels=ids).loss


def _norm_grads(model):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters() if "norm" in n}


class _AllReduceCounter:
    """Counts `torch.distributed.all_reduce` calls (what the stock hook and shardnorm's reducer issue)."""

    def __init__(self):
        self.calls = 0

    @contextlib.contextmanager
    def counting(self):
        original = dist.all_reduce

        def counted(*args, **kwargs):
            self.calls += 1
            return original(*args, **kwargs)

        dist.all_reduce = counted
        try:
            yield self
        finally:
            dist.all_reduce = original


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _clip(model, max_norm):
    """Clip by the global grad norm; grads are DTensors (sharded linears) and plain tensors (norms)."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    total = torch.stack([(g.full_tensor() if hasattr(g, "full_tensor") else g).norm() for g in grads]).norm()
    for g in grads:
        g.mul_(torch.clamp(max_norm / (total + 1e-6), max=1.0))


STEPS = 5


def _train(model, batches, accelerator=None, on_boundary=None):
    """AdamW, 2 micro-batches per step, clipping at 1.0; with `accelerator`, micro-batches run under
    `accelerator.accumulate` (which sets sync_gradients) and `accelerator.backward`. Returns the losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in batches:
        for ids in step:
            if accelerator is None:
                loss = _loss(model, ids)
                (loss / len(step)).backward()
            else:
                with accelerator.accumulate(model):
                    loss = _loss(model, ids)
                    accelerator.backward(loss)
            losses.append(loss.item())
        if on_boundary is not None:
            on_boundary(model)
        _clip(model, 1.0)
        opt.step()
        opt.zero_grad()
    return losses


def _accelerate_loop(rank, path):
    from accelerate import Accelerator
    from transformers import AutoModelForCausalLM

    from shardnorm.integrations.transformers import bind_accumulation, convert_model

    g = torch.Generator().manual_seed(5)
    batches = [[torch.randint(0, 64, (2, 9), generator=g) for _ in range(MICRO)] for _ in range(STEPS)]
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference = _train(single, batches)

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    ours = convert_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto"),
                         accelerator=accelerator)
    bind_accumulation(ours, accelerator)
    first_step = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for ids in batches[0]:
        (_loss(first_step, ids) / MICRO).backward()
    first_grads = _norm_grads(first_step)

    at_first_boundary = {}

    def record(model):  # right after the step's last backward: what clipping is about to read
        at_first_boundary.setdefault(id(model), _norm_grads(model))

    losses = _train(ours, batches, accelerator, record)
    stock_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
    stock = _train(stock_model, batches, accelerator, record)
    for n, expected in first_grads.items():
        err = _rel(at_first_boundary[id(ours)][n], expected)
        assert err <= TOL, f"rank {rank} {n}: grad not final when the last backward returned (rel err {err:.1e})"
    assert max(_rel(at_first_boundary[id(stock_model)][n], first_grads[n]) for n in first_grads) > 1e-2
    for i, (x, y) in enumerate(zip(losses, reference)):
        assert abs(x - y) <= LOSS_TOL * y, f"rank {rank} micro-batch {i}: loss {x} vs single-process {y}"
    if rank == 0:
        drift = max(abs(x - y) / y for x, y in zip(stock, reference))
        print(f"accelerate loop (stock's largest loss drift {drift:.1e}) losses per micro-batch: single {[round(v, 6) for v in reference]}\n"
              f" shardnorm {[round(v, 6) for v in losses]}\n stock {[round(v, 6) for v in stock]}")


def _users_hook(module, grad_input, grad_output):
    pass


def _body(rank, world, root):
    from transformers import AutoModelForCausalLM

    from transformers import DistributedConfig

    import shardnorm
    from shardnorm.conversion import NormWrapperError
    from shardnorm.integrations.transformers import REPLICATED_NORM_STYLE, convert_model

    for i, shape in enumerate(SHAPES):
        path = f"{root}/qwen3_{i}"
        if rank == 0:
            _save_tiny_qwen3(path, *shape, seed=10 + i)
        dist.barrier()
        batches = _batches(100 + i)

        single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        _loss(single, batches[0]).backward()
        g1 = _norm_grads(single)
        _loss(single, batches[1]).backward()
        expected = _norm_grads(single)  # G1 + G2

        stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
        stock_count = _AllReduceCounter()
        with stock_count.counting():
            for ids in batches:
                _loss(stock, ids).backward()
        stock_grads = _norm_grads(stock)

        if i == 0:  # transformers' own style names, taken over by convert_model
            ours = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto")
        else:  # shardnorm's registered style, named in the plan
            norms = {f"model.layers.*.self_attn.{n}": REPLICATED_NORM_STYLE for n in ("q_norm", "k_norm")}
            # the norms' entries alone: transformers 5.23 adds them to the model's own plan, 5.17 replaces the plan
            # with them, leaving the projections whole, so that summing the norms' grads over tp would double them
            alone = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                         distributed_config=DistributedConfig(tp_plan=norms))
            if isinstance(alone.model.layers[0].self_attn.q_proj.weight, DTensor):
                ours = alone
            else:  # convert_model refuses, and the model's plan with the norms' entries is what works
                with pytest.raises(ValueError, match=r"self_attn\.q_norm.*shards no projection beside it"):
                    convert_model(alone)
                base = {f"model.{k}": v for k, v in alone.config.base_model_tp_plan.items()}
                ours = AutoModelForCausalLM.from_pretrained(
                    path, dtype=torch.float32, distributed_config=DistributedConfig(tp_plan={**base, **norms}))
            with pytest.raises(RuntimeError, match=f"{REPLICATED_NORM_STYLE}.*convert_model"):
                _loss(ours, batches[0])
            # a user's backward hook on a norm is not transformers' to drop: conversion refuses, naming it
            q_norm = ours.model.layers[0].self_attn.q_norm
            handle = q_norm.register_full_backward_hook(_users_hook)
            with pytest.raises(NormWrapperError, match=r"self_attn\.q_norm .*a backward hook \(_users_hook\)"):
                convert_model(ours)
            handle.remove()
        ours = convert_model(ours)
        # a user's backward hook on a converted norm fires, also after a second convert_model (as
        # enable(trainer) after convert_model runs it), which takes nothing over twice
        fired = []
        ours.model.layers[1].self_attn.k_norm.register_full_backward_hook(lambda m, gi, go: fired.append(m))
        ours = convert_model(ours)
        counter = _AllReduceCounter()
        with counter.counting():
            with shardnorm.accumulate(ours):
                _loss(ours, batches[0]).backward()
            assert counter.calls == 0, "the reducer reduced inside accumulate()"
            _loss(ours, batches[1]).backward()
            shardnorm.finalize_grads(ours)  # a no-op: the last backward reduced already
        ours_grads = _norm_grads(ours)
        assert len(fired) == MICRO and fired[0] is ours.model.layers[1].self_attn.k_norm, fired

        qk = [n for n in expected if "q_norm" in n or "k_norm" in n]
        assert len(qk) == 4 and len(expected) == 9, sorted(expected)
        converted = [n for n, m in ours.named_modules() if isinstance(m, shardnorm.RMSNorm)]
        assert len(converted) == 9, converted
        for n in expected:
            err = _rel(ours_grads[n], expected[n])
            assert err <= TOL, f"shape {shape} rank {rank} {n}: shardnorm grad rel err {err:.2e}"
        for n in qk:  # stock is wrong exactly as the issue says: 2*G1 + G2
            assert _rel(stock_grads[n], expected[n]) > 1e-2, f"{n}: stock HF unexpectedly right"
            err = _rel(stock_grads[n], expected[n] + g1[n])
            assert err <= TOL, f"shape {shape} rank {rank} {n}: stock is not 2*G1 + G2 (rel err {err:.2e})"
        # collectives for the norm grads: stock one per q/k norm per micro-batch, shardnorm one per step
        assert stock_count.calls == len(qk) * MICRO, stock_count.calls
        assert counter.calls == 1 and shardnorm.distributed.reducer_of(ours).num_buckets == 1, counter.calls
        if rank == 0 and i == 0:
            print(f"\nnorm-grad all-reduces per step: stock {stock_count.calls}, shardnorm {counter.calls}; "
                  f"q_norm rel err vs G1+G2: stock {_rel(stock_grads[qk[0]], expected[qk[0]]):.3f}, "
                  f"shardnorm {_rel(ours_grads[qk[0]], expected[qk[0]]):.1e}")
    # a style shardnorm cannot honour on a norm: an error naming the module and the style
    odd = AutoModelForCausalLM.from_pretrained(f"{root}/qwen3_0", dtype=torch.float32,
                                               distributed_config=DistributedConfig(tp_plan={"model.norm": "all_reduce"}))
    with pytest.raises(ValueError, match="'all_reduce' on norm 'model.norm'"):
        convert_model(odd)
    _accelerate_loop(rank, f"{root}/qwen3_0")
    _sequence_parallel_norms(rank, f"{root}/qwen3_0")


def _sequence_parallel_norms(rank, path):
    """transformers' own `sequence_parallel` style on the decoder norms (no shipped model's plan uses it; a
    user's plan can): each rank's hidden states are its sequence shard, so a norm's weight grad is the sum
    over ranks. shardnorm's takeover gives the grads transformers' DTensor path gives, over 2 micro-batches
    (each rank with its own tokens), with one reducer all-reduce per step."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    import shardnorm
    from shardnorm.integrations.transformers import convert_model

    plan = {"model.layers.*.input_layernorm": "sequence_parallel",
            "model.layers.*.post_attention_layernorm": "sequence_parallel", "model.norm": "sequence_parallel"}
    g = torch.Generator().manual_seed(300 + rank)
    batches = [torch.randint(0, 64, (2, 9), generator=g) for _ in range(MICRO)]

    def grads(convert):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                     distributed_config=DistributedConfig(tp_plan=plan))
        if convert:
            model = convert_model(model)
        for i, ids in enumerate(batches):
            with shardnorm.accumulate(model) if convert and i < MICRO - 1 else contextlib.nullcontext():
                _loss(model, ids).backward()
        return model, _norm_grads(model)

    stock, stock_grads = grads(False)
    ours, ours_grads = grads(True)
    alone = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # this rank's tokens only
    for ids in batches:
        _loss(alone, ids).backward()
    local = _norm_grads(alone)
    sp = [n for n in stock_grads if "layernorm" in n or n == "model.norm.weight"]
    assert len(sp) == 5 and all(isinstance(m, shardnorm.RMSNorm) for n, m in ours.named_modules()
                                if n.endswith(("layernorm", "model.norm"))), sp
    for n in sp:
        assert _rel(local[n], stock_grads[n]) > 1e-2, f"{n}: the ranks' tokens do not differ enough to test the sum"
        err = _rel(ours_grads[n], stock_grads[n])
        assert err <= TOL, f"rank {rank} {n}: shardnorm vs transformers' sequence_parallel rel err {err:.2e}"
    reducer = shardnorm.distributed.reducer_of(ours)
    assert reducer is not None and reducer.collectives == 1, getattr(reducer, "collectives", None)

    # a step given up after its first micro-batch, then zero_grad: the next step's grads are its own; a step
    # whose every backward ran inside accumulate is refused at optimizer.step()
    opt = torch.optim.SGD(ours.parameters(), lr=0.0)
    opt.zero_grad()
    with shardnorm.accumulate(ours):
        (1e3 * _loss(ours, batches[0])).backward()
    assert reducer.has_pending
    ours.zero_grad()
    assert not reducer.has_pending, "zero_grad left the given-up step's partial sums pending"
    for i, ids in enumerate(batches):
        with shardnorm.accumulate(ours) if i < MICRO - 1 else contextlib.nullcontext():
            _loss(ours, ids).backward()
    again = _norm_grads(ours)
    for n in sp:
        assert _rel(again[n], ours_grads[n]) <= TOL, f"rank {rank} {n}: step after a given-up one"
    opt.zero_grad()
    with shardnorm.accumulate(ours):
        _loss(ours, batches[0]).backward()
    with pytest.raises(RuntimeError, match="norm grads are not reduced yet"):
        opt.step()
    shardnorm.discard_pending(ours)


@pytest.mark.distributed
@pytest.mark.skipif(DEVICE == "cuda", reason="CPU runs by design (Accelerate/Trainer with use_cpu on gloo); "
                    "its GPU counterpart, benchmarks/gpu_hf_tp_plan.py, was removed in d7c3b12")
def test_tp_plan_qwen3_norm_grads_two_micro_batches(tmp_path):
    spawn(_body, 2, str(tmp_path))


SP_PLAN = {"model.layers.*.input_layernorm": "sequence_parallel",
           "model.layers.*.post_attention_layernorm": "sequence_parallel", "model.norm": "sequence_parallel"}
# no style that re-wraps its input after the post-attention and final norms: their outputs reach plain Linears (the
# attention keeps the model's own colwise / rowwise entries, under which the q/k norms' rows are this rank's heads)
REPLICATE_PLAN = {f"model.layers.*.mlp.{m}": "replicate" for m in ("gate_proj", "up_proj", "down_proj")} | \
    {"lm_head": "replicate"}


def _all_grads(model):
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def _keep_output_body(rank, world, root):
    from transformers import AutoModelForCausalLM, DistributedConfig

    import shardnorm
    from shardnorm.integrations.transformers import convert_model

    path = f"{root}/qwen3"
    if rank == 0:
        _save_tiny_qwen3(path, *SHAPES[0], seed=21)
    dist.barrier()
    ids = _batches(400)[0]  # the same batch on both ranks, as tensor parallelism runs
    # one process on this rank's device; transformers puts a tp_plan model there itself (NCCL: cuda:LOCAL_RANK)
    single = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(rank_device(rank))
    single_loss = _loss(single, ids)
    single_loss.backward()
    single_grads = _all_grads(single)

    def run(keep, **load):
        model = convert_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load),
                              keep_output=keep)
        shardnorm.output_recompute.counters(reset=True)
        loss = _loss(model, ids)
        loss.backward()
        return model, loss.detach(), _all_grads(model), shardnorm.output_recompute.counters()

    from transformers.integrations.tensor_parallel import ALL_PARALLEL_STYLES

    plans = [("auto", dict(tp_plan="auto")),
             ("sequence_parallel", dict(distributed_config=DistributedConfig(tp_plan=SP_PLAN)))]
    if "replicate" in ALL_PARALLEL_STYLES:  # transformers 5.23 has it, 5.17 not
        plans.append(("replicate", dict(distributed_config=DistributedConfig(tp_plan=REPLICATE_PLAN))))
        # q/k projections replicated too: every rank holds every head, and summing the q/k norms' grads over the
        # ranks (their style) would double them: refused, the model as it was
        whole = {f"model.layers.*.self_attn.{m}": "replicate" for m in ("q_proj", "k_proj", "v_proj", "o_proj")}
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, distributed_config=DistributedConfig(tp_plan=REPLICATE_PLAN | whole))
        with pytest.raises(ValueError, match=r"self_attn\.q_norm.*shards no projection beside it"):
            convert_model(model)
        assert not any(isinstance(m, shardnorm.RMSNorm) for m in model.modules())
    for name, load in plans:
        _, loss_on, grads_on, _ = run(True, **load)
        model, loss_off, grads_off, counts = run(False, **load)
        # every output of the decoder norms went to consumers that saved a handle (transformers' colwise styles save a
        # DTensor made around it) and was made again once in the backward: 2 norms per layer and the final one (the
        # q/k norms' outputs are tracked too, but rotary's products save only cos/sin)
        norms = 2 * model.config.num_hidden_layers + 1
        assert counts["recomputed"] == norms and counts["saved_as_handle"] >= norms, (name, counts)
        assert torch.equal(loss_on, loss_off), (name, loss_on, loss_off)
        assert grads_on.keys() == grads_off.keys() and len(grads_on) == len(single_grads), sorted(grads_on)
        for n in grads_on:
            assert torch.equal(grads_on[n], grads_off[n]), f"{name} rank {rank} {n}: keep_output=False changed the grad"
        assert abs(loss_off.item() - single_loss.item()) <= LOSS_TOL * single_loss.item()
        for n, g in grads_off.items():
            if name == "sequence_parallel" and n.endswith(("layernorm.weight", "model.norm.weight")):
                # transformers' sequence_parallel style takes the whole (replicated) sequence for this rank's
                # shard, so the weight grad is the sum over the tp ranks: tp times one process's (shardnorm's
                # takeover computes what transformers' own style computes; see docs/integrations/transformers.md)
                assert _rel(g, world * single_grads[n]) <= TOL, f"rank {rank} {n}: {_rel(g, world * single_grads[n])}"
            else:
                err = _rel(g, single_grads[n])
                assert err <= TOL, f"{name} rank {rank} {n}: rel err {err:.1e}"


@pytest.mark.distributed
def test_tp_plan_keep_output_false_recomputes_the_norm_outputs(tmp_path):
    spawn(_keep_output_body, 2, str(tmp_path))


def test_unknown_transformers_version_is_named():
    from shardnorm.integrations import transformers as adapter

    with pytest.raises(ImportError, match=r"transformers==4\.57\.1"):
        adapter._check_version("4.57.1")
    adapter._check_version(transformers.__version__)
