"""Sequence parallelism with the norm gathering its own output (`SequenceParallelNorm(output_layouts=Replicate())`)
and `keep_output=False`: each rank keeps only its shard of the norm's input; the gathered output is recomputed and
all-gathered again in backward. Loss and every grad bitwise equal to the option off, and equal (to fp32 rounding)
to one process running the same model unsharded; the gathered outputs are freed after the forward."""

import gc
import weakref

import pytest
import torch

import shardnorm

H, FFN, SEQ, BATCH = 32, 64, 8, 2


class Block(torch.nn.Module):
    """Pre-norm attention-like and MLP-like sublayers, each norm output read by two matmuls (q/k, up/gate)."""

    def __init__(self, keep: bool, residual_form: bool):
        super().__init__()
        self.attention_norm = shardnorm.RMSNorm(H, keep_output=keep)
        self.ffn_norm = shardnorm.LayerNorm(H, keep_output=keep)
        self.wq, self.wk, self.wo = (torch.nn.Linear(H, H, bias=False) for _ in range(3))
        self.w1, self.w3 = torch.nn.Linear(H, FFN, bias=False), torch.nn.Linear(H, FFN, bias=False)
        self.w2 = torch.nn.Linear(FFN, H, bias=False)
        self.residual_form = residual_form

    def forward(self, x, residual=None):
        if self.residual_form:
            h, residual = self.attention_norm(x, residual) if residual is not None else (self.attention_norm(x), x)
            a = self.wo(self.wq(h) * torch.sigmoid(self.wk(h)))
            h, residual = self.ffn_norm(a, residual)
            return self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h)), residual
        h = self.attention_norm(x)
        x = x + self.wo(self.wq(h) * torch.sigmoid(self.wk(h)))
        h = self.ffn_norm(x)
        return x + self.w2(torch.nn.functional.silu(self.w1(h)) * self.w3(h)), None


class Model(torch.nn.Module):
    def __init__(self, keep: bool, residual_form: bool, layers: int = 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(keep, residual_form) for _ in range(layers))

    def forward(self, x):
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual)
        return x if residual is None else x + residual


def _build(keep, residual_form, device, seed=0):
    torch.manual_seed(seed)
    model = Model(keep, residual_form).to(device)
    with torch.no_grad():  # norms away from their init (weight 1, bias 0): grads must depend on them
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn_like(p))
    return model


def sp_plan(norm_style):
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    from shardnorm.distributed import RegatherColwiseParallel as Colwise

    return {"attention_norm": norm_style, "ffn_norm": norm_style,
            "wq": Colwise(), "wk": Colwise(), "wo": RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            "w1": Colwise(), "w3": Colwise(), "w2": RowwiseParallel(output_layouts=Shard(1), use_local_output=False)}


def _sharded_steps(rank, world_size, residual_form, seed):
    from spawn_ranks import rank_device
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from shardnorm.distributed import SequenceParallelNorm

    device = rank_device(rank)
    mesh = init_device_mesh(device.type, (world_size,))
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(BATCH, SEQ, H, generator=g).to(device)
    dy_full = torch.randn(BATCH, SEQ, H, generator=g).to(device)

    # single process, unsharded, same initial weights
    ref = _build(True, residual_form, device)
    x_ref = x_full.clone().requires_grad_()
    (ref(x_ref) * dy_full).sum().backward()

    results = {}
    for keep in (True, False):
        model = _build(keep, residual_form, device)
        for layer in model.layers:
            parallelize_module(layer, mesh, sp_plan(SequenceParallelNorm(output_layouts=Replicate())))
        gathered = []

        def watch(module, args, output):
            y = output[0] if isinstance(output, tuple) else output
            assert isinstance(y, DTensor) and y.placements == (Replicate(),) and tuple(y.shape) == (BATCH, SEQ, H)
            gathered.append(weakref.ref(y.to_local().untyped_storage()))

        for layer in model.layers:
            for norm in (layer.attention_norm, layer.ffn_norm):
                norm.register_forward_hook(watch)
        x = DTensor.from_local(x_full.chunk(world_size, dim=1)[rank].clone(), mesh, (Shard(1),))
        x.requires_grad_()
        shardnorm.output_recompute.counters(reset=True)
        out = model(x)
        gc.collect()
        alive = sum(r() is not None for r in gathered)
        loss = (out.to_local() * dy_full.chunk(world_size, dim=1)[rank]).sum()
        loss.backward()
        counts = shardnorm.output_recompute.counters()
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        results[keep] = loss.detach(), grads, x.grad.to_local().clone(), alive, counts

    (loss_on, grads_on, dx_on, alive_on, _), (loss_off, grads_off, dx_off, alive_off, counts) = \
        results[True], results[False]
    assert torch.equal(loss_on, loss_off)
    assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))
    assert torch.equal(dx_on, dx_off)
    assert alive_on == 4, alive_on  # kept: every gathered output lives until the backward
    assert alive_off == 0, alive_off  # released: nothing holds a gathered output after the forward
    # 4 gathered outputs, each saved by its two consumers' matmuls and recomputed once in the backward
    assert counts["recomputed"] == 4 and counts["saved_as_handle"] == 8, counts
    # against one process without sharding (different summation order of the matmuls: fp32 tolerance)
    ref_grads = [p.grad for p in ref.parameters()]
    for a, b in zip(grads_off, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dx_off, x_ref.grad.chunk(world_size, dim=1)[rank], rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.parametrize("residual_form", [False, True], ids=["plain", "residual"])
def test_gathered_output_recomputed_bitwise(residual_form):
    from spawn_ranks import spawn

    spawn(_sharded_steps, 2, residual_form, 1234)


def _compiled_steps(rank, world_size, seed, use_local_output):
    """Layers compiled (fullgraph): with keep_output=False the norm and its all-gather are traced in selective
    checkpoints that recompute them, so the compiled graphs save neither the gathered outputs nor the local
    ones; the grads are the option off's."""
    from spawn_ranks import rank_device
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import parallelize_module

    from shardnorm.distributed import SequenceParallelNorm

    device = rank_device(rank)
    mesh = init_device_mesh(device.type, (world_size,))
    g = torch.Generator().manual_seed(seed)
    x_full = torch.randn(BATCH, SEQ, H, generator=g).to(device)
    results = {}
    for keep in (True, False):
        torch._dynamo.reset()
        model = _build(keep, False, device)
        for layer in model.layers:
            style = SequenceParallelNorm(output_layouts=Replicate(), use_local_output=use_local_output)
            parallelize_module(layer, mesh, sp_plan(style))
            layer.compile(backend="aot_eager_decomp_partition", fullgraph=True)
        x = DTensor.from_local(x_full.chunk(world_size, dim=1)[rank].clone(), mesh, (Shard(1),))
        x.requires_grad_()
        saved = {}

        def pack(t):
            local = t.to_local() if isinstance(t, DTensor) else t
            saved[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(x)
        out.to_local().square().sum().backward()
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        results[keep] = grads, x.grad.to_local().clone(), sum(saved.values())
    (grads_on, dx_on, bytes_on), (grads_off, dx_off, bytes_off) = results[True], results[False]
    for a, b in zip(grads_on + [dx_on], grads_off + [dx_off]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    gathered, stats = BATCH * SEQ * H * 4, BATCH * SEQ * 4  # fp32 [B, S, H]; at most one fp32 per token more
    assert bytes_on - bytes_off >= 4 * (gathered - stats), (bytes_on, bytes_off, gathered)


@pytest.mark.distributed
@pytest.mark.parametrize("use_local_output", [False, True], ids=["dtensor_output", "local_output"])
def test_compiled_layers_recompute_the_gather(use_local_output):
    from spawn_ranks import spawn

    spawn(_compiled_steps, 2, 99, use_local_output)


def _input_changed_in_place(rank, world_size):
    """An ordinary in-place op on the norm's DTensor input between forward and backward: the recompute would read
    the changed input, so the backward raises, naming the in-place change (a DTensor's in-place ops bump its own
    version counter, not its local tensor's: reading the local's alone reported a `.data` write)."""
    from spawn_ranks import DEVICE, rank_device
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import parallelize_module

    from shardnorm.distributed import RegatherColwiseParallel, SequenceParallelNorm
    from shardnorm.output_recompute import KeepOutputError

    mesh = init_device_mesh(DEVICE, (world_size,))
    model = torch.nn.Sequential(shardnorm.RMSNorm(H, keep_output=False), torch.nn.Linear(H, H)).to(rank_device(rank))
    parallelize_module(model, mesh, {"0": SequenceParallelNorm(output_layouts=Replicate()),
                                    "1": RegatherColwiseParallel()})
    x = distribute_tensor(torch.randn(BATCH, SEQ, H), mesh, [Shard(1)]).requires_grad_()
    h = x * 1.0
    out = model(h)
    with torch.no_grad():
        h.mul_(2.0)
    with pytest.raises(KeepOutputError, match="modified in place"):
        out.sum().backward()


def test_dtensor_input_changed_in_place_raises_naming_it():
    from spawn_ranks import spawn

    spawn(_input_changed_in_place, 2)


def _regather_edges(rank, world_size):
    """The consumers' re-gather at its edges: uneven sequence shards (DTensor's padded gather, bitwise the option
    off), no saved-tensors hook during the forward, a retained graph's second backward and a checkpointed model (the
    option off's grads), the gathered output written behind autograd before its consumer
    read it (an error, not wrong grads), and torch's own ColwiseParallel as the consumer (a warning that nothing is
    saved, and the option off's grads)."""
    from spawn_ranks import DEVICE, rank_device
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from shardnorm import _torch_compat
    from shardnorm.distributed import RegatherColwiseParallel, SequenceParallelNorm
    from shardnorm.output_recompute import KeepOutputError

    mesh = init_device_mesh(DEVICE, (world_size,))
    device = rank_device(rank)

    def build(keep, consumer=RegatherColwiseParallel, seq=SEQ + 1, nan=False):
        torch.manual_seed(2)
        model = torch.nn.Sequential(shardnorm.RMSNorm(H, keep_output=keep), torch.nn.Linear(H, H)).to(device)
        with torch.no_grad():
            model[0].weight.add_(0.3 * torch.randn_like(model[0].weight))
        parallelize_module(model, mesh, {"0": SequenceParallelNorm(output_layouts=Replicate()), "1": consumer()})
        x = distribute_tensor(torch.randn(BATCH, seq, H, generator=torch.Generator().manual_seed(3)), mesh,
                              [Shard(1)])
        if nan:  # one token of rank 0's shard (an fp16 overflow): NaN statistics, NaN output rows
            x.to_local()[0, 0, 3] = float("nan") if rank == 0 else x.to_local()[0, 0, 3]
        return model, x.requires_grad_()

    def grads(keep, **kw):
        model, x = build(keep, **kw)
        hooks = []
        model[1].register_forward_pre_hook(lambda m, a: hooks.append(_torch_compat.saved_tensors_hooks_top()))
        model(x).square().sum().backward()
        assert hooks == [None]
        return [x.grad.to_local()] + [p.grad.to_local() for p in model.parameters()]

    # 9 tokens on 2 ranks: uneven shards, where torch's own linear reads DTensor's gathered output (torch 2.11 on
    # NCCL gathers them into a non-contiguous tensor that F.linear refuses to view)
    probe = distribute_tensor(torch.randn(BATCH, SEQ + 1, H), mesh, [Shard(1)]).redistribute(placements=[Replicate()])
    seq = SEQ + 1 if probe.to_local().is_contiguous() else SEQ
    for a, b in zip(grads(True, seq=seq), grads(False, seq=seq)):
        assert torch.equal(a, b)
    # the option off: the consumers' linear on local tensors against torch's ColwiseParallel (DTensor's), bitwise
    for a, b in zip(grads(True, seq=seq), grads(True, consumer=ColwiseParallel, seq=seq)):
        assert torch.equal(a, b)

    def twice(keep):  # a second backward over the retained graph re-gathers again: twice the one backward's grads
        model, x = build(keep, seq=SEQ)
        loss = model(x).square().sum()
        loss.backward(retain_graph=True)
        loss.backward()
        return [x.grad.to_local()] + [p.grad.to_local() for p in model.parameters()]

    def checkpointed(keep):  # under a non-reentrant checkpoint the consumers' nodes keep their forward's handle
        model, x = build(keep, seq=SEQ)
        torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False).square().sum().backward()
        return [x.grad.to_local()] + [p.grad.to_local() for p in model.parameters()]

    def with_nan(keep):  # recomputed and re-gathered as they were: the option off's NaNs, no KeepOutputError
        model, x = build(keep, seq=SEQ, nan=True)
        model(x).square().sum().backward()
        return [x.grad.to_local()] + [p.grad.to_local() for p in model.parameters()]

    for run in (twice, checkpointed, with_nan):
        for a, b in zip(run(True), run(False)):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), run.__name__  # bits: NaN equals NaN
    assert all(g.isnan().any() for g in with_nan(False)[2:])  # the consumer's weight grad sums the NaN row

    model, x = build(False)
    def write_behind_autograd(module, args, out):
        out.to_local().data.mul_(2.0)

    model[0].register_forward_hook(write_behind_autograd)
    with pytest.raises(KeepOutputError, match="written after the norm's forward"):
        model(x).sum().backward()
        if x.is_cuda:  # the backward's checks reach the host asynchronously: read at the next norm forward
            torch.cuda.synchronize()
            model(x)

    model, x = build(False)  # the norm's input written behind autograd: the re-gathered copy differs too
    loss = model(x).sum()
    x.to_local().data.copy_(x.to_local().data.roll(1, dims=-1))
    with pytest.raises(KeepOutputError, match="the input it is recomputed from"):
        loss.backward()
        if x.is_cuda:
            torch.cuda.synchronize()
            model(x)

    with pytest.warns(UserWarning, match="RegatherColwiseParallel"):
        torch_consumer = dict(consumer=ColwiseParallel, seq=seq)
        for a, b in zip(grads(True, **torch_consumer), grads(False, **torch_consumer)):
            assert torch.equal(a, b)


def test_regather_edges():
    from spawn_ranks import spawn

    spawn(_regather_edges, 2)


def _sharded_output(rank, world_size):
    """A SequenceParallelNorm whose output stays sharded (its consumers gather it themselves, torchtitan's plan):
    keep_output=False can save nothing there, so the model's scope pushes no saved-tensors hooks for it and the norm
    says so once; the grads are the option off's."""
    from spawn_ranks import DEVICE, rank_device
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, parallelize_module

    from shardnorm import _torch_compat
    from shardnorm.distributed import SequenceParallelNorm

    mesh = init_device_mesh(DEVICE, (world_size,))

    def grads(keep):
        torch.manual_seed(4)
        consumer = torch.nn.Sequential(torch.nn.Linear(H, H))
        model = torch.nn.Sequential(shardnorm.RMSNorm(H, keep_output=keep), consumer).to(rank_device(rank))
        parallelize_module(model, mesh, {"0": SequenceParallelNorm(), "1.0": ColwiseParallel(),
                                         "1": PrepareModuleInput(input_layouts=(Shard(1),),
                                                                 desired_input_layouts=(Replicate(),))})
        if not keep:
            shardnorm.convert(model, keep_output=False, warn=False)
        hooks = []
        consumer[0].register_forward_pre_hook(lambda m, a: hooks.append(_torch_compat.saved_tensors_hooks_top()))
        x = distribute_tensor(torch.randn(BATCH, SEQ, H, generator=torch.Generator().manual_seed(5)), mesh,
                              [Shard(1)]).requires_grad_()
        model(x).square().sum().backward()
        assert hooks == [None]
        return [x.grad.to_local()] + [p.grad.to_local() for p in model.parameters()]

    kept = grads(True)
    with pytest.warns(UserWarning, match="stays sequence-sharded"):
        discarded = grads(False)
    assert all(torch.equal(a, b) for a, b in zip(kept, discarded))


def test_sharded_output_pushes_no_hooks_and_warns():
    from spawn_ranks import spawn

    spawn(_sharded_output, 2)
