"""Every documented recipe compiles with `fullgraph=True` and Dynamo counts no graph break (2 gloo ranks).

Each recipe runs a step as its docs say (micro-batches inside `shardnorm.accumulate`, the last outside it, norm grads
through the model's reducer), compiled with `torch.compile(fullgraph=True)` (an `Unsupported` error where Dynamo
would break the graph), and `torch._dynamo.utils.counters["graph_break"]` must stay empty. Grads are compared with
the same recipe run eagerly, so a graph that compiled but dropped the reducer's grads fails too. The AOT backend
traces forward and backward as Inductor gets them, without compiling C++ (minutes on CPU); one recipe runs Inductor.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from docs_prelude import HIDDEN, Model
from spawn_ranks import DEVICE, rank_device, spawn
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module

import shardnorm
from shardnorm.distributed import (RegatherColwiseParallel, SequenceParallelNorm, attach_reducer,
                                   process_group_sequence_parallel)

pytestmark = pytest.mark.distributed

SEQ, BATCH, MICRO_BATCHES = 6, 2, 2
TOL = 1e-5


README_PLAN = {"layers.*.attn_norm": SequenceParallelNorm(output_layouts=Replicate()),
               "layers.*.attn.wq": RegatherColwiseParallel(),
               "layers.*.attn.wo": RowwiseParallel(output_layouts=Shard(1)),
               "norm": SequenceParallelNorm(output_layouts=Replicate()),
               "out": RegatherColwiseParallel(output_layouts=Replicate())}


def _randomized(module, seed):
    """`module` with random params (ones and zeros would hide mistakes), on this rank's device."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if p.dim() == 1 else 0.0))
    return module.to(rank_device(dist.get_rank()))


def _steps(model, forward, seed, compiled_modules=()):
    """MICRO_BATCHES micro-batches through `forward`, all but the last inside `accumulate`; the norm grads'
    graph breaks counted. Returns ({name: grad as a full tensor}, graph breaks)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    g = torch.Generator().manual_seed(seed + 1)
    for mb in range(MICRO_BATCHES):
        x = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
        with shardnorm.accumulate(model) if mb < MICRO_BATCHES - 1 else contextlib.nullcontext():
            forward(x).float().square().mean().backward()
    return _grads(model), sum(torch._dynamo.utils.counters["graph_break"].values())


def _grads(model) -> dict:
    """{name: (grad as a full tensor, its placements or None)} of the params that have a grad."""
    return {n: ((p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().cpu(),
                getattr(p.grad, "placements", None))
            for n, p in model.named_parameters() if p.grad is not None}


def _compare(what, eager, compiled, breaks):
    """No graph break, and the compiled step's grads as eager's: values, and placements (a `Partial` norm grad
    where eager's is `Replicate` would mean something but the reducer reached `.grad`)."""
    assert breaks == 0, f"{what}: {breaks} graph breaks: {dict(torch._dynamo.utils.counters['graph_break'])}"
    assert eager.keys() == compiled.keys(), f"{what}: grads of {set(eager) ^ set(compiled)} differ in presence"
    for name, (want, placements) in eager.items():
        got, got_placements = compiled[name]
        err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
        assert err <= TOL, f"{what}: {name}.grad rel err {err:.2e} against eager"
        assert got_placements == placements, f"{what}: {name}.grad placed {got_placements}, eager {placements}"


def _readme_recipe(mesh, keep_output, seed):
    """The README's recipe on the model its examples run on (`docs_prelude.Model`, torch's norms converted)."""
    model = _randomized(Model(), seed)
    shardnorm.convert(model, keep_output=keep_output)
    parallelize_module(model, mesh, README_PLAN)
    attach_reducer(model)
    return model


def _sequence_parallel_recipes(rank, world_size, seed):
    mesh = init_device_mesh(DEVICE, (world_size,))

    def shard(x):
        return x.chunk(world_size, dim=1)[rank].contiguous().to(rank_device(rank))

    for keep_output in (True, False):
        for backend in ("aot_eager",) if keep_output is False else ("aot_eager", "inductor"):
            what = f"README SP recipe, keep_output={keep_output}, {backend}"
            eager_model = _readme_recipe(mesh, keep_output, seed)
            eager, _ = _steps(eager_model, lambda x: eager_model(shard(x)), seed)
            model = _readme_recipe(mesh, keep_output, seed)
            compiled_model = torch.compile(model, backend=backend, fullgraph=True)
            compiled, breaks = _steps(model, lambda x: compiled_model(shard(x)), seed)
            _compare(what, eager, compiled, breaks)

    # process_group_sequence_parallel: plain tensors and params, a ProcessGroup (Megatron-style)
    def pg_model():
        model = _randomized(nn.Sequential(shardnorm.LayerNorm(HIDDEN), nn.Linear(HIDDEN, HIDDEN)), seed)
        process_group_sequence_parallel(model[0], dist.group.WORLD, sequence_dim=1)
        attach_reducer(model)
        return model

    eager_model = pg_model()
    eager, _ = _steps(eager_model, lambda x: eager_model(shard(x)), seed)
    model = pg_model()
    compiled_model = torch.compile(model, backend="aot_eager", fullgraph=True)
    compiled, breaks = _steps(model, lambda x: compiled_model(shard(x)), seed)
    _compare("process_group_sequence_parallel", eager, compiled, breaks)


def _hidden_sharded_recipe(rank, world_size, seed):
    """Hidden-sharded norms (x Shard(-1), weight/bias Shard(0)), e.g. a QK-norm over tensor-parallel heads, in fp32,
    where torch 2.11's Dynamo traces a backward with a zero grad for an autograd.Function output that `.to(x.dtype)`
    returns unchanged (`hidden_sharded.py`); one rank shows it too, on a one-GPU machine."""
    mesh = init_device_mesh(DEVICE, (world_size,))
    for cls in (shardnorm.LayerNorm, shardnorm.RMSNorm):
        def hidden_model():
            norm = _randomized(cls(HIDDEN), seed)
            for name, p in list(norm.named_parameters()):
                norm.register_parameter(name, nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)])))
            return norm

        def hidden_forward(norm):
            return lambda x: norm(distribute_tensor(x.to(rank_device(rank)), mesh, [Shard(-1)])).full_tensor()

        eager_model = hidden_model()
        eager, _ = _steps(eager_model, hidden_forward(eager_model), seed)
        model = hidden_model()
        compiled, breaks = _steps(model, hidden_forward(torch.compile(model, backend="aot_eager", fullgraph=True)),
                                  seed)
        _compare(f"hidden-sharded {cls.__name__} on {world_size} ranks", eager, compiled, breaks)


def test_sequence_parallel_recipes_compile_without_graph_breaks():
    spawn(_sequence_parallel_recipes, 2, torch.seed() % 2**31)


def _fsdp_recipe(rank, world_size, seed):
    """FSDP2 `shard_model` over dp x tp (dp=1 here: the hooks and the reducer's FSDP source are the same), each
    block compiled as the main job and torchtitan do, between TP and FSDP."""
    from shardnorm.fsdp import shard_model

    mesh = init_device_mesh(DEVICE, (1, world_size), mesh_dim_names=("dp", "tp"))

    def build(compiled):
        model = _randomized(Model(), seed)
        shardnorm.convert(model)
        parallelize_module(model, mesh["tp"], README_PLAN)
        if compiled:  # torchtitan's order: TP, compile, FSDP
            for block in model.layers:
                block.compile(backend="aot_eager", fullgraph=True)
        shard_model(model, mesh)
        return model

    def shard(x):
        # contiguous: a strided shard under FSDP2 and compiled blocks fails in torch's own fake-tensor DTensor
        # linear, with torch's norms as with shardnorm's ("unhashable type: non-nested SymInt", torch 2.13)
        return x.chunk(world_size, dim=1)[rank].contiguous().to(rank_device(rank))

    eager_model = build(False)
    eager, _ = _steps(eager_model, lambda x: eager_model(shard(x)), seed)
    model = build(True)
    compiled, breaks = _steps(model, lambda x: model(shard(x)), seed)
    _compare("FSDP2 shard_model x TP, blocks compiled", eager, compiled, breaks)


@pytest.mark.parametrize("world_size", [1, 2])
def test_hidden_sharded_norms_compile_without_graph_breaks(world_size):
    spawn(_hidden_sharded_recipe, world_size, torch.seed() % 2**31)


def test_fsdp2_and_tensor_parallel_blocks_compile_without_graph_breaks():
    spawn(_fsdp_recipe, 2, torch.seed() % 2**31)


def _hf_tp_plan_recipe(rank, world_size, root, seed):
    """A tiny Qwen3 loaded with `from_pretrained(path, tp_plan="auto")` (per-head q/k norms sharded with the heads,
    decoder norms replicated), `convert_model`, then `torch.compile(model, fullgraph=True)`."""
    from transformers import AutoModelForCausalLM

    from shardnorm.integrations.transformers import convert_model

    path = f"{root}/tiny-qwen3"

    def load():
        return convert_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, tp_plan="auto"))

    g = torch.Generator().manual_seed(seed)
    ids = [torch.randint(0, 64, (2, 9), generator=g) for _ in range(MICRO_BATCHES)]

    def run(model, forward):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        for mb, batch in enumerate(ids):
            with shardnorm.accumulate(model) if mb < MICRO_BATCHES - 1 else contextlib.nullcontext():
                batch = batch.to(model.device)
                forward(input_ids=batch, labels=batch).loss.backward()
        return _grads(model), sum(torch._dynamo.utils.counters["graph_break"].values())

    eager_model = load()
    eager, _ = run(eager_model, eager_model)
    model = load()
    compiled, breaks = run(model, torch.compile(model, backend="aot_eager", fullgraph=True))
    _compare("HF tp_plan + convert_model", eager, compiled, breaks)


def test_hf_tp_plan_compiles_without_graph_breaks(tmp_path):
    pytest.importorskip("transformers")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
                         tie_word_embeddings=False)
    Qwen3ForCausalLM(config).save_pretrained(tmp_path / "tiny-qwen3")
    spawn(_hf_tp_plan_recipe, 2, str(tmp_path), torch.seed() % 2**31)
