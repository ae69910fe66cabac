"""shardnorm under FSDP: the main job's Llama-style model (tiny) trains like one process.

dp=2 (FSDP2 and FSDP1) and dp=2 × tp=2 (FSDP2 and FSDP1 × sequence-parallel shardnorm norms): 3 AdamW
steps of 2 micro-batches on fresh random tokens reach the single-process losses and parameters (fp32, 1e-5),
with activation checkpointing and per-block torch.compile too; which modules become FSDP units; DCP
save at step 2 / load into a fresh model / step 3 equals the uninterrupted run; a checkpoint in the
middle of accumulation is refused. One spawn per world size runs every case (start-up dominates).
"""

import dataclasses
import warnings

import pytest
import torch
from fsdp_harness import (TRAIN, TorchEngine, assert_grads_match, assert_matches, full_params,
                          make_model, rank_rows, reference, step_grads, token_batches, train)
from spawn_ranks import DEVICE, rank_device, spawn
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper, checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
from torch.distributed.tensor import Replicate, distribute_tensor

import shardnorm
from parallel.collectives import AllReduceCounter
from parallel.model import Block
from parallel.parallelize import apply_tensor_parallel, materialize_output, parallelize
from shardnorm.distributed import reducer_of
from shardnorm.distributed.fsdp_checkpoint import fsdp_params
from shardnorm.distributed.fsdp_norm_grads import FSDPShardedGrads
from shardnorm.fsdp import (auto_wrap_policy, find_block_classes, load, norm_mixed_precision, pending_grads, save,
                            shard_model)

pytestmark = pytest.mark.distributed
MID_STEP = "refusing to checkpoint in the middle of gradient accumulation"


def _quiet():
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    warnings.filterwarnings("ignore", message=".*sequential all_gather operations.*")


def _checkpointed_compiled(seed, mesh, device) -> nn.Module:
    """torchtitan's order: TP, activation checkpointing, per-block compile, FSDP (blocks detected)."""
    model = make_model(seed, device)
    if mesh.ndim == 2:
        apply_tensor_parallel(model, mesh["tp"], "shardnorm")
        model.tok_embeddings.register_forward_hook(materialize_output)
    for i, block in enumerate(model.layers):
        model.layers[i] = checkpoint_wrapper(block)
        model.layers[i].compile(backend="aot_eager")
    return shard_model(model, mesh)


def _units(model: nn.Module, kind) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, kind)]


def _check_fsdp2_units(model: nn.Module, blocks: list[str]) -> None:
    assert _units(model, FSDPModule) == [""] + blocks, _units(model, FSDPModule)
    assert not any(isinstance(m, FSDPModule) for m in model.modules() if isinstance(m, nn.RMSNorm))


def _check_checkpoint(seed, mesh, device, dp_rank, path, build, uninterrupted) -> None:
    """Save after step 2, load into a fresh model (other init), step 3: same loss and params."""
    batches = token_batches(seed, mesh["dp"].size() if mesh.ndim == 2 else mesh.size())
    model = build(seed, mesh, device)
    engine = TorchEngine(model, TRAIN, norm_reducer=True)
    train(engine, batches[:2], dp_rank, device)
    save(path, model, engine.optimizer, extra={"scheduler": engine.scheduler})
    fresh = build(seed + 7, mesh, device)
    engine = TorchEngine(fresh, TRAIN, norm_reducer=True)
    load(path, fresh, engine.optimizer, extra={"scheduler": engine.scheduler})
    losses = train(engine, batches[2:], dp_rank, device)
    ref_losses, ref_params = uninterrupted
    assert_matches("resumed from DCP", losses, full_params(fresh), ref_losses[2:], ref_params)

    # mid-accumulation: shardnorm's pending tp reduction, FSDP's no-sync grads would be lost
    (x, y), _ = rank_rows(batches[0], dp_rank, device)
    if isinstance(getattr(reducer_of(fresh), "source", None), FSDPShardedGrads):
        with shardnorm.accumulate(fresh, fsdp_sync=True):  # FSDP reduces over dp, the tp all-reduce waits
            nn.functional.cross_entropy(fresh(x).flatten(0, 1), y.flatten()).backward()
        assert "shardnorm's norm-grad buffer" in pending_grads(fresh)
        with pytest.raises(RuntimeError, match=MID_STEP):
            save(f"{path}-mid", fresh, engine.optimizer)
        shardnorm.finalize_grads(fresh)
        engine.optimizer.zero_grad(set_to_none=True)
        assert not pending_grads(fresh)
    with shardnorm.accumulate(fresh):  # neither FSDP nor shardnorm reduces
        nn.functional.cross_entropy(fresh(x).flatten(0, 1), y.flatten()).backward()
    assert pending_grads(fresh)
    with pytest.raises(RuntimeError, match=MID_STEP):
        save(f"{path}-mid", fresh, engine.optimizer)


def _shard_main_job(seed, mesh, device):
    return parallelize(make_model(seed, device), mesh, TRAIN)


# ---- 2 processes: dp=2 ----------------------------------------------------------------------------------

def _dp2(rank, world_size, seed, path):
    _quiet()
    device = rank_device(rank)
    batches = token_batches(seed, world_size)
    ref = reference(seed, batches)
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",))

    # FSDP2: blocks found automatically; plain, and with checkpointing + compile
    ref_grads = step_grads(make_model(seed, "cpu"), batches[0])
    assert_grads_match("FSDP2 dp=2", step_grads(shard_model(make_model(seed, device), mesh),
                                                rank_rows(batches[0], rank, device)), ref_grads)
    model = shard_model(make_model(seed, device), mesh)
    _check_fsdp2_units(model, ["layers.0", "layers.1"])
    losses = train(TorchEngine(model, TRAIN), batches, rank, device)
    assert_matches("FSDP2 dp=2", losses, full_params(model), *ref)
    model = _checkpointed_compiled(seed, mesh, device)
    _check_fsdp2_units(model, ["layers.0", "layers.1"])
    assert all(isinstance(m, CheckpointWrapper) for m in model.layers)
    losses = train(TorchEngine(model, TRAIN), batches, rank, device)
    assert_matches("FSDP2 dp=2, checkpointing + compile", losses, full_params(model), *ref)

    # a norm run outside the FSDP unit that all-gathers it sees a shard: refused by name
    with pytest.raises(RuntimeError, match=r"layers\.0\.\S*ffn_norm\.weight is still FSDP-sharded"):
        model.layers[0].ffn_norm(torch.randn(2, 32, device=device))

    # FSDP1: one unit per block plus the root; norms only with the fp32-norm mixed precision
    model = FullyShardedDataParallel(make_model(seed, device), auto_wrap_policy=auto_wrap_policy(),
                                     use_orig_params=True, device_id=device)
    assert [type(m.module).__name__ for m in model.modules() if isinstance(m, FullyShardedDataParallel)] \
        == ["Transformer", "Block", "Block"]
    engine = TorchEngine(model, TRAIN)
    losses = train(engine, batches, rank, device)
    assert_matches("FSDP1 dp=2", losses, full_params(model), *ref)
    (x, y), _ = rank_rows(batches[0], rank, device)
    with shardnorm.accumulate(model):
        nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    with pytest.raises(RuntimeError, match=MID_STEP):
        save(f"{path}-fsdp1", model, engine.optimizer)
    mixed = FullyShardedDataParallel(make_model(seed, device), auto_wrap_policy=auto_wrap_policy([Block]),
                                     mixed_precision=norm_mixed_precision(), use_orig_params=True,
                                     device_id=device)
    units = [type(m.module).__name__ for m in mixed.modules() if isinstance(m, FullyShardedDataParallel)]
    assert units == ["Transformer", "Block", "RMSNorm", "RMSNorm", "Block", "RMSNorm", "RMSNorm", "RMSNorm"], \
        units
    assert all(m.mixed_precision.param_dtype in (None, torch.float32) for m in mixed.modules()
               if isinstance(m, FullyShardedDataParallel) and isinstance(m.module, nn.RMSNorm))

    _check_checkpoint(seed, mesh, device, rank, path,
                      lambda s, mesh, device: shard_model(make_model(s, device), mesh), ref)


def test_fsdp_dp2(tmp_path):
    spawn(_dp2, 2, torch.seed() % 2**31, str(tmp_path / "ckpt"))


# ---- 4 processes: dp=2 × tp=2, sequence-parallel norms (dp=1 × tp=2 on 2 GPUs) ---------------------------

def _all_reduces(model, batch) -> int:
    engine = TorchEngine(model, TRAIN, norm_reducer=True)
    with AllReduceCounter() as counter:
        engine.step(batch)
    return counter.count


def _dp_tp2(rank, world_size, seed, path):
    _quiet()
    device = rank_device(rank)
    dp = world_size // 2
    batches = token_batches(seed, dp)
    ref = reference(seed, batches)
    mesh = init_device_mesh(device.type, (dp, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()

    # the main job's parallelize (TP plan + shard_model): FSDP's new params keep what shardnorm needs
    ref_grads = step_grads(make_model(seed, "cpu"), batches[0])
    grads = step_grads(_shard_main_job(seed, mesh, device), rank_rows(batches[0], dp_rank, device))
    assert_grads_match("FSDP2 × TP", grads, ref_grads)
    # built on the meta device, parallelized, then materialized (torchtitan's order): the reducer's
    # buckets must land on the real device (they stayed on meta and the norm grads came out zero)
    meta = parallelize(make_model(seed, "meta"), mesh, TRAIN)
    meta.to_empty(device=device)
    real = make_model(seed, "cpu")
    set_model_state_dict(meta, real.state_dict(), options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():  # the rope tables are not in the state dict
        for (_, buf), (_, value) in zip(meta.named_buffers(), real.named_buffers()):
            buf.copy_(value)
    assert_grads_match("FSDP2 × TP built on meta", step_grads(meta, rank_rows(batches[0], dp_rank, device)),
                       ref_grads)
    model = _shard_main_job(seed, mesh, device)
    _check_fsdp2_units(model, ["layers.0", "layers.1"])
    reducer = model._shardnorm_reducer
    assert isinstance(reducer.source, FSDPShardedGrads) and len(reducer.params) == 5
    assert all(p.sequence_parallel for n, p in model.named_parameters() if "norm" in n)
    losses = train(TorchEngine(model, TRAIN, norm_reducer=True), batches, dp_rank, device)
    assert_matches("FSDP2 × TP", losses, full_params(model), *ref)
    assert reducer.collectives == TRAIN.steps  # one bucket per optimizer step, none per micro-batch
    unsharded = [fsdp_param.unsharded_param for m in model.modules() if isinstance(m, FSDPModule)
                 for fsdp_param in fsdp_params(m) if "norm" in fsdp_param._param_fqn]
    assert len(unsharded) == 5 and all(p.sequence_parallel for p in unsharded)

    model = _checkpointed_compiled(seed, mesh, device)
    losses = train(TorchEngine(model, TRAIN, norm_reducer=True), batches, dp_rank, device)
    assert_matches("FSDP2 × TP, checkpointing + compile", losses, full_params(model), *ref)

    # bf16 mixed precision (fp32 params and reduction): close to the fp32 run, as bf16 allows
    bf16 = dataclasses.replace(TRAIN, dtype="bfloat16")
    losses = train(TorchEngine(parallelize(make_model(seed, device), mesh, bf16), bf16, norm_reducer=True),
                   batches, dp_rank, device)
    assert all(abs(a - b) <= 2e-2 * abs(b) for a, b in zip(losses, ref[0])), (losses, ref[0])

    # measured: all-reduces per step of norm grads, shardnorm's order vs torch's SequenceParallel + FSDP2
    step = rank_rows(batches[0], dp_rank, device)
    ours = _all_reduces(_shard_main_job(seed, mesh, device), step)
    torch_norms = parallelize(make_model(seed, device, "torch"), mesh, dataclasses.replace(TRAIN, norm="torch"))
    theirs = _all_reduces(torch_norms, step)
    assert (ours, theirs) == (1, 5), (ours, theirs)

    # FSDP1 × TP: trains like one process; DTensor reduces each norm grad over tp per micro-batch (not
    # bucketed: 5 norm params × 2 micro-batches), FSDP1 over dp
    fsdp1 = make_model(seed, device)
    apply_tensor_parallel(fsdp1, mesh["tp"], "shardnorm")
    fsdp1 = FullyShardedDataParallel(fsdp1, device_mesh=mesh["dp"], auto_wrap_policy=auto_wrap_policy(),
                                     device_id=device)
    losses = train(TorchEngine(fsdp1, TRAIN), batches, dp_rank, device)
    assert_matches("FSDP1 × TP", losses, full_params(fsdp1), *ref)
    if dp > 1:  # over a one-rank dp group FSDP1 falls back to NO_SHARD, whose grad sync is an all-reduce too
        assert _all_reduces(fsdp1, step) == 5 * TRAIN.grad_accum

    # norms parallelized over the whole 2-D mesh, or FSDP1 with use_orig_params over a TP model: refused
    bad = make_model(seed, device)
    bad.norm.weight = nn.Parameter(distribute_tensor(bad.norm.weight.detach(), mesh, [Replicate()] * 2))
    with pytest.raises(ValueError, match=r"norm parameter norm\.weight is already a DTensor"):
        shard_model(bad, mesh)
    bad = make_model(seed, device)
    apply_tensor_parallel(bad, mesh["tp"], "shardnorm")
    with pytest.raises(NotImplementedError, match="FSDP1 × tensor parallelism with use_orig_params=True"):
        FullyShardedDataParallel(bad, auto_wrap_policy=auto_wrap_policy(), use_orig_params=True,
                                 device_id=device)

    _check_checkpoint(seed, mesh, device, dp_rank, path, _shard_main_job, ref)


def test_fsdp_dp_tp2(tmp_path):
    """dp=2 × tp=2 on CPU; on CUDA as many GPUs as there are, up to 4 (2 GPUs: dp=1 × tp=2)."""
    world_size = 4 if DEVICE == "cpu" else min(4, torch.cuda.device_count())
    spawn(_dp_tp2, world_size, torch.seed() % 2**31, str(tmp_path / "ckpt"))


# ---- 2 processes: dp=1 × tp=2, a step given up or taken with partial sums pending --------------------------

PENDING_STEP = r"norm grads are not reduced yet"


def _abandon(model, micro_batches, fsdp_sync: bool) -> None:
    """The step's micro-batches but the last inside `accumulate`; the last backward never runs (a NaN loss)."""
    for x, y in micro_batches[:-1]:
        with shardnorm.accumulate(model, fsdp_sync=fsdp_sync):
            (1e3 * nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())).backward()


def _tp2_pending(rank, world_size, seed):
    """FSDP2 × TP: a zero_grad after a given-up step leaves nothing pending, and the next step's grads are its
    own; optimizer.step() after a last backward inside `accumulate` raises (fsdp_sync either way)."""
    _quiet()
    device = rank_device(rank)
    batches = token_batches(seed, 1)
    ref_grads = step_grads(make_model(seed, "cpu"), batches[0])
    mesh = init_device_mesh(device.type, (1, world_size), mesh_dim_names=("dp", "tp"))
    step = rank_rows(batches[0], 0, device)
    for set_to_none in (True, False):
        model = _shard_main_job(seed, mesh, device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        assert_grads_match("first step", step_grads(model, step), ref_grads)  # .grad None again
        if not set_to_none:
            optimizer.zero_grad(set_to_none=True)
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        _abandon(model, step + step[:1], fsdp_sync=True)
        assert "shardnorm's norm-grad buffer" in pending_grads(model)
        optimizer.zero_grad(set_to_none=set_to_none)
        assert not pending_grads(model), f"set_to_none={set_to_none}: {pending_grads(model)}"
        assert_grads_match(f"after a given-up step, set_to_none={set_to_none}", step_grads(model, step), ref_grads)

    for fsdp_sync in (True, False):
        model = _shard_main_job(seed, mesh, device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        _abandon(model, step + step[:1], fsdp_sync)  # every micro-batch of the step inside accumulate
        with pytest.raises(RuntimeError, match=PENDING_STEP):
            optimizer.step()
        if fsdp_sync:  # FSDP reduced over dp in every backward: finalize_grads completes the step
            shardnorm.finalize_grads(model)
            optimizer.step()


def test_fsdp_tp2_pending_partial_sums():
    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    spawn(_tp2_pending, 2, seed)


def _finalized_grads(model) -> dict[str, torch.Tensor]:
    """The step's grads after `finalize_grads`: name -> full grad, then .grad None again."""
    shardnorm.finalize_grads(model)
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = p.grad.full_tensor().cpu()
        p.grad = None
    return grads


def _in_place_grad_step(model, micro_batches) -> dict[str, torch.Tensor]:
    """One step of 3 micro-batches, the first two inside accumulate(fsdp_sync=True), the grads zeroed with
    `p.grad.zero_()` after the first and scaled with `p.grad.mul_(0.5)` after the second, outside no_grad, as
    a user's loop does: name -> full grad (0.5 x the second's + the third's), then .grad None again."""
    ops = [lambda g: g.zero_(), lambda g: g.mul_(0.5)]
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        with shardnorm.accumulate(model, fsdp_sync=True) if not last else torch.enable_grad():
            nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        if not last:
            for name, p in model.named_parameters():
                assert not p.grad.requires_grad, f"{name}: .grad requires grad between micro-batches"
                ops[i](p.grad)
            if i == 0:
                assert not pending_grads(model), pending_grads(model)  # zeroed: nothing left to reduce
    return _finalized_grads(model)


# what a loop does to a `.grad` kept from the last step, mid-step; the first two bump no version counter
# (`torch._foreach_zero_` on DTensor grads, `.data`), so only the values can tell that they changed
KEPT_GRAD_CHANGES = {
    "optimizer (foreach), zeros": lambda model, optimizer: optimizer.zero_grad(set_to_none=False),
    "in place, .data.zero_()": lambda model, optimizer: [p.grad.data.zero_() for p in model.parameters()],
    "in place, mul_(0.5)": lambda model, optimizer: [p.grad.mul_(0.5) for p in model.parameters()],
}


def _kept_grad_step(model, micro_batches, change: str) -> dict[str, torch.Tensor]:
    """A step of the first micro-batch, its grads kept (no zero_grad), then the next step: its first micro-batch
    inside accumulate(fsdp_sync=True), `change` on the grads, its last micro-batch: name -> full grad, then .grad
    None again. Checks that a zeroing leaves nothing pending (a checkpoint would be refused)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0, foreach=True)
    for i, (x, y) in enumerate(micro_batches):
        with shardnorm.accumulate(model, fsdp_sync=True) if i == 1 else torch.enable_grad():
            nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        if i == 1:
            KEPT_GRAD_CHANGES[change](model, optimizer)
            if "zero" in change:
                assert not pending_grads(model), f"{change}: {pending_grads(model)}"
    return _finalized_grads(model)


def _tp2_in_place(rank, world_size, seed):
    """FSDP2 × TP with accumulate(fsdp_sync=True): in-place grad code between micro-batches works and gives the
    grads it gives with torch's norms (.grad's requires_grad stays the user's), also on a `.grad` kept from the
    last step and where the change bumps no version counter."""
    _quiet()
    device = rank_device(rank)
    batches = token_batches(seed, 1, steps=2)
    mesh = init_device_mesh(device.type, (1, world_size), mesh_dim_names=("dp", "tp"))
    micro_batches = rank_rows(batches[0] + batches[1][:1], 0, device)
    ours = _shard_main_job(seed, mesh, device)
    torch_norms = parallelize(make_model(seed, device, "torch"), mesh, dataclasses.replace(TRAIN, norm="torch"))
    assert_grads_match("p.grad.zero_() / mul_(0.5) between micro-batches", _in_place_grad_step(ours, micro_batches),
                       _in_place_grad_step(torch_norms, micro_batches))
    for change in KEPT_GRAD_CHANGES:  # SGD at lr 0: the models stay as they were
        assert_grads_match(f"a kept .grad, then {change} mid-step", _kept_grad_step(ours, micro_batches, change),
                           _kept_grad_step(torch_norms, micro_batches, change))


def test_fsdp_tp2_in_place_grad_ops():
    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    spawn(_tp2_in_place, 2, seed)


# ---- no process group needed ----------------------------------------------------------------------------

def _frozen_norms_step(model, micro_batches, freeze) -> dict[str, torch.Tensor]:
    """`freeze` (name -> bool) applied, one step of the micro-batches (all but the last inside accumulate): name ->
    full grad, None for a frozen parameter; then .grad None again."""
    for name, p in model.named_parameters():
        p.requires_grad_(not freeze(name))
    for i, (x, y) in enumerate(micro_batches):
        with shardnorm.accumulate(model) if i < len(micro_batches) - 1 else torch.enable_grad():
            nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    grads = {}
    for name, p in model.named_parameters():
        grads[name] = None if p.grad is None else p.grad.full_tensor().cpu()
        p.grad = None
    return grads


def _tp2_frozen_norms(rank, world_size, seed):
    """FSDP2 x TP (`shard_model`) with some sequence-parallel norm weights frozen (LoRA-style) before the wrapping
    and others after it: the step trains as with torch's norms, the frozen weights get no grad (a hook on a frozen
    parameter raises)."""
    _quiet()
    device = rank_device(rank)
    batches = token_batches(seed, 1, steps=2)
    mesh = init_device_mesh(device.type, (1, world_size), mesh_dim_names=("dp", "tp"))
    micro_batches = rank_rows(batches[0] + batches[1][:1], 0, device)
    before = lambda name: name.startswith("layers.0.") and name.endswith("norm.weight")  # noqa: E731
    after = lambda name: before(name) or name == "norm.weight"  # noqa: E731
    ours, torch_norms = make_model(seed, device, "shardnorm"), make_model(seed, device, "torch")
    for model in (ours, torch_norms):
        for name, p in model.named_parameters():
            p.requires_grad_(not before(name))
    ours = parallelize(ours, mesh, TRAIN)
    torch_norms = parallelize(torch_norms, mesh, dataclasses.replace(TRAIN, norm="torch"))
    for freeze in (before, after):
        got, want = _frozen_norms_step(ours, micro_batches, freeze), _frozen_norms_step(torch_norms, micro_batches,
                                                                                        freeze)
        frozen = [name for name in want if freeze(name)]
        assert frozen and all(got[name] is None and want[name] is None for name in frozen), frozen
        assert_grads_match("frozen norm weights", {k: v for k, v in got.items() if v is not None},
                           {k: v for k, v in want.items() if v is not None})


def test_fsdp_tp2_frozen_norm_weights():
    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    spawn(_tp2_frozen_norms, 2, seed)


def test_block_detection():
    model = make_model(0, "cpu")
    assert find_block_classes(model) == (Block,)
    model.layers[0] = checkpoint_wrapper(model.layers[0])
    model.layers[1] = checkpoint_wrapper(model.layers[1])
    assert find_block_classes(model) == (CheckpointWrapper,)
    with pytest.raises(ValueError, match="no repeated module class containing a norm"):
        find_block_classes(nn.Sequential(nn.Linear(4, 4), shardnorm.RMSNorm(4)))
    policy = auto_wrap_policy([shardnorm.RMSNorm])
    with pytest.raises(ValueError, match="RMSNorm is a norm; a norm stays inside its block's FSDP unit"):
        policy._run_policy(make_model(0, "cpu"), set(), {})
