"""keep_output=False: norm outputs released between forward and backward and recomputed into their own storage.

Every check runs the same model twice from the same seed, option off and on, and compares the loss and every grad
bitwise; the release itself is checked on the outputs' storage (0 bytes between the forward and the backward).
"""

import copy

import pytest
import torch

import shardnorm
from shardnorm import output_recompute
from shardnorm.output_recompute import KeepOutputError

H = 32


class Block(torch.nn.Module):
    """A pre-norm block: attention-like (two consumers of the first norm's output) and MLP-like sublayers."""

    def __init__(self, keep: bool, rms: bool = True, residual_form: bool = False, zero_centered: bool = False):
        super().__init__()
        norm = shardnorm.RMSNorm if rms else shardnorm.LayerNorm
        self.norm1 = norm(H, keep_output=keep, zero_centered_gamma=zero_centered)
        self.norm2 = norm(H, keep_output=keep, zero_centered_gamma=zero_centered)
        self.q, self.k = torch.nn.Linear(H, H), torch.nn.Linear(H, H)
        self.up, self.gate, self.down = torch.nn.Linear(H, 2 * H), torch.nn.Linear(H, 2 * H), torch.nn.Linear(2 * H, H)
        self.residual_form = residual_form

    def forward(self, x, residual=None):
        if self.residual_form:  # (y, z) = norm(x, residual): the residual stream z is the block's output
            h, z = self.norm1(x, residual) if residual is not None else (self.norm1(x), x)
            a = self.q(h) * torch.sigmoid(self.k(h))
            h, z = self.norm2(a, z)
            return self.down(self.up(h) * torch.nn.functional.silu(self.gate(h))), z
        h = self.norm1(x)
        x = x + self.q(h) * torch.sigmoid(self.k(h))
        h = self.norm2(x)
        return x + self.down(self.up(h) * torch.nn.functional.silu(self.gate(h)))


class Stack(torch.nn.Module):
    def __init__(self, keep: bool, layers: int = 3, final_norm: bool = True, **kw):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(keep=keep, **kw) for _ in range(layers))
        self.final = shardnorm.RMSNorm(H, keep_output=keep) if final_norm else None
        self.head = torch.nn.Linear(H, 7)

    def forward(self, x):
        residual = None
        for block in self.blocks:
            if block.residual_form:
                x, residual = block(x, residual)
            else:
                x = block(x)
        if residual is not None:
            x = x + residual
        return self.head(self.final(x) if self.final is not None else x)


def _perturb(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))


def _outputs_of(model) -> list:
    """Every shardnorm norm's output in the next forward (y only: the residual form's z is the stream)."""
    seen = []

    def hook(module, args, output):
        seen.append(output[0] if isinstance(output, tuple) else output)

    for m in model.modules():
        if isinstance(m, (shardnorm.RMSNorm, shardnorm.LayerNorm)):
            m.register_forward_hook(hook)
    return seen


def _as_torch_norms(model, eps: float) -> None:
    """shardnorm's norms swapped for torch's over the same Parameters (a float64 reference)."""
    for parent in list(model.modules()):
        for name, m in list(parent.named_children()):
            if isinstance(m, shardnorm.RMSNorm):
                ref = torch.nn.RMSNorm(m.normalized_shape, eps=eps)
            elif isinstance(m, shardnorm.LayerNorm):
                ref = torch.nn.LayerNorm(m.normalized_shape, eps=m.eps)
                ref.bias = m.bias
            else:
                continue
            ref.weight = m.weight
            setattr(parent, name, ref)


def _run(keep: bool, seed: int, steps: int = 1, dtype=torch.float32, watch=None, device="cpu", **kw):
    torch.manual_seed(seed)
    model = Stack(keep, **kw)
    _perturb(model, seed)
    if dtype == torch.float64:
        _as_torch_norms(model, eps=torch.finfo(torch.float32).eps)
    model = model.to(device=device, dtype=dtype)
    outputs = _outputs_of(model)
    losses = []
    for step in range(steps):  # gradient accumulation: grads summed over the steps
        x = torch.randn(3, 5, H, generator=torch.Generator().manual_seed(seed + step)).to(device=device, dtype=dtype)
        x.requires_grad_(True)
        outputs.clear()
        loss = model(x).float().square().mean()
        if watch is not None:
            watch(outputs)
        loss.backward()
        losses.append(loss.detach())
    return losses, [x.grad] + [p.grad for p in model.parameters()], outputs


def _assert_bitwise(a, b):
    losses_a, grads_a, _ = a
    losses_b, grads_b, _ = b
    assert all(torch.equal(u, v) for u, v in zip(losses_a, losses_b))
    assert len(grads_a) == len(grads_b)
    for i, (u, v) in enumerate(zip(grads_a, grads_b)):
        assert u is not None and v is not None, i
        assert torch.equal(u, v), f"grad {i} differs: max {(u - v).abs().max().item()}"


def _released_count(outputs) -> int:
    return sum(y.untyped_storage().nbytes() == 0 for y in outputs)


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("residual_form", [False, True])
def test_grads_bitwise_and_storage_released(device, rms, residual_form):
    released = []
    dtype = torch.bfloat16 if residual_form else torch.float32
    kw = dict(rms=rms, residual_form=residual_form, zero_centered=not rms, dtype=dtype, device=device)
    off = _run(True, 11, **kw)
    output_recompute.counters(reset=True)
    on = _run(False, 11, watch=lambda outs: released.append(_released_count(outs)), **kw)
    counts = output_recompute.counters()
    _assert_bitwise(off, on)
    y_bytes = 3 * 5 * H * (2 if dtype == torch.bfloat16 else 4)
    assert counts == {"released": 7, "released_bytes": 7 * y_bytes, "recomputed": 7}
    # 3 blocks x 2 norms released; the final norm's output is the Stack's input to head, not a block's: the
    # Stack is its parent and returns head(y), so it is released too
    assert released == [7]
    assert all(y.untyped_storage().nbytes() > 0 for y in on[2])  # refilled by the backward


def test_gradient_accumulation_and_fp64_reference(device):
    """Accumulated over 3 micro-batches: bitwise equal to the option off; and both near the float64 model."""
    off = _run(True, 5, steps=3, rms=True, device=device)
    on = _run(False, 5, steps=3, rms=True, device=device)
    _assert_bitwise(off, on)
    ref = _run(True, 5, steps=3, rms=True, dtype=torch.float64, device=device)
    for u, v in zip(on[1], ref[1]):
        assert ((u.double() - v).norm() / v.norm()).item() < 1e-4
    assert ((on[1][0].double() - ref[1][0]).norm() / ref[1][0].norm()).item() > 0  # fp32 is not float64


def test_output_of_parent_is_kept():
    """A norm whose output is the parent's output (or a view of it) is not released."""
    norm = shardnorm.RMSNorm(H, keep_output=False)
    parent = torch.nn.Sequential(torch.nn.Linear(H, H), norm)
    outputs = _outputs_of(parent)
    y = parent(torch.randn(4, H))
    assert outputs[0] is y and y.untyped_storage().nbytes() > 0
    y.sum().backward()


def test_not_released_without_grad_or_under_checkpoint():
    torch.manual_seed(0)
    model = Stack(False)
    outputs = _outputs_of(model)
    x = torch.randn(2, 3, H, requires_grad=True)
    with torch.no_grad():
        model(x)
    assert _released_count(outputs) == 0
    outputs.clear()
    out = torch.utils.checkpoint.checkpoint(model.blocks[0], x, use_reentrant=False)
    assert len(outputs) == 2 and _released_count(outputs) == 0  # saved-tensors hooks active: the checkpoint's
    out.sum().backward()


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_blocks_bitwise(use_reentrant):
    """Blocks under torch.utils.checkpoint (the option then does nothing, the checkpoint frees everything)."""

    def run(keep):
        torch.manual_seed(3)
        model = Stack(keep)
        _perturb(model, 3)
        x = torch.randn(2, 4, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
        h = x
        for block in model.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=use_reentrant)
        model.head(model.final(h)).square().mean().backward()
        return [x.grad] + [p.grad for p in model.parameters()]

    for u, v in zip(run(True), run(False)):
        assert torch.equal(u, v)


def test_in_place_change_of_output_raises():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = shardnorm.RMSNorm(H, keep_output=False), torch.nn.Linear(H, H)

        def forward(self, x):
            y = self.norm(x)
            y.mul_(2.0)  # the recompute would not repeat this
            return self.lin(y)

    with pytest.raises(KeepOutputError, match="modified in place"):
        Bad()(torch.randn(3, H, requires_grad=True))


def test_in_place_change_of_input_raises():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = shardnorm.RMSNorm(H, keep_output=False), torch.nn.Linear(H, H)

        def forward(self, x):
            return self.lin(self.norm(x))

    x = torch.randn(3, H, requires_grad=True)
    h = x * 1.0
    out = Bad()(h)
    with torch.no_grad():
        h.add_(1.0)
    with pytest.raises(KeepOutputError, match="input"):
        out.sum().backward()


def test_double_backward_bitwise():
    def run(keep):
        torch.manual_seed(2)
        model = Stack(keep, layers=2)
        _perturb(model, 2)
        x = torch.randn(2, 3, H, generator=torch.Generator().manual_seed(2), requires_grad=True)
        (gx,) = torch.autograd.grad(model(x).square().sum(), x, create_graph=True)
        gx.square().sum().backward()
        return [x.grad] + [p.grad for p in model.parameters()]

    for u, v in zip(run(True), run(False)):
        assert torch.equal(u, v)


def test_retain_graph_second_backward():
    torch.manual_seed(4)
    model = Stack(False, layers=2)
    x = torch.randn(2, 3, H, requires_grad=True)
    loss = model(x).square().mean()
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    loss.backward()
    for g, p in zip(first, model.parameters()):
        assert torch.equal(2 * g, p.grad)


def test_option_toggles_hooks_and_repr():
    norm = shardnorm.RMSNorm(H)
    assert norm.keep_output and "keep_output" not in repr(norm)
    norm.keep_output = False
    assert output_recompute.hooks_installed() and "keep_output=False" in repr(norm)
    copied = copy.deepcopy(norm)
    assert copied.keep_output is False
    norm.keep_output = True
    copied.keep_output = True
    others = [m for m in output_recompute._discarding]
    assert output_recompute.hooks_installed() == bool(others)
    with pytest.raises(TypeError, match="keep_output"):
        shardnorm.LayerNorm(H, keep_output="no")
    state = shardnorm.RMSNorm(H, keep_output=False).state_dict()
    assert list(state) == ["weight"]  # the option is not state


def _compiled_step(keep: bool, residual_form: bool, backend: str):
    """One compiled forward + backward of a 1-layer Stack: (grads, bytes the compiled graph saved for backward)."""
    torch.manual_seed(6)
    model = Stack(keep, layers=1, residual_form=residual_form)
    _perturb(model, 6)
    fn = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(6), requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        loss = fn(x).square().mean()
    loss.backward()
    return [x.grad] + [p.grad for p in model.parameters()], sum(saved)


@pytest.mark.parametrize("residual_form", [False, True])
def test_compiled_graph_recomputes_the_norm_outputs(residual_form):
    """Under torch.compile the eager hooks are off; a norm with keep_output=False is traced inside a selective
    checkpoint that recomputes its forward op, so the partitioner saves one [tokens, hidden] tensor fewer per norm
    and the grads are the option off's. The residual form keeps its outputs (recomputing them would need x and the
    residual): there only the norms called without one are recomputed (the first block's norm1, the final norm)."""
    torch._dynamo.reset()
    for backend in ("aot_eager_decomp_partition", "inductor"):
        kept_grads, kept_bytes = _compiled_step(True, residual_form, backend)
        grads, saved_bytes = _compiled_step(False, residual_form, backend)
        for u, v in zip(kept_grads, grads):
            torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
        recomputed = 2 if residual_form else 3  # norm1 and the final norm; or norm1, norm2 and the final norm
        norm_output = 2 * 5 * H * 4  # fp32 [10, H]
        assert recomputed * norm_output <= kept_bytes - saved_bytes < (recomputed + 1) * norm_output, \
            (backend, kept_bytes, saved_bytes)
        torch._dynamo.reset()


# ---- Hugging Face Llama ---------------------------------------------------------------------------------------

def _llama(keep: bool, gradient_checkpointing: bool, seed: int):
    transformers = pytest.importorskip("transformers")
    from hf_tiny import randomize_norms, tiny_config

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(tiny_config("llama")).float()
    randomize_norms(model, seed)
    shardnorm.convert(model, keep_output=keep)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return model


def test_hf_llama_compiled_under_gradient_checkpointing():
    """torch.compile of a Llama with transformers' (non-reentrant) gradient checkpointing: the norms' own selective
    checkpoint nests inside the layers' checkpoints; loss and grads equal the option off's."""
    def run(keep):
        model = _llama(keep, False, seed=9)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(9))
        loss = torch.compile(model)(input_ids=ids, labels=ids).loss
        loss.backward()
        torch._dynamo.reset()
        return [loss.detach()] + [p.grad for p in model.parameters()]

    torch._dynamo.reset()
    for u, v in zip(run(True), run(False)):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_hf_llama_bitwise(gradient_checkpointing):
    def run(keep):
        model = _llama(keep, gradient_checkpointing, seed=8)
        outputs = _outputs_of(model)
        released, losses = [], []
        for step in range(2):  # gradient accumulation
            ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(step))
            outputs.clear()
            loss = model(input_ids=ids, labels=ids).loss
            released.append(_released_count(outputs))
            loss.backward()
            losses.append(loss.detach())
        return losses, [p.grad for p in model.parameters()], released

    off, on = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(off[0], on[0]))
    for name_grad in zip(off[1], on[1]):
        assert torch.equal(*name_grad)
    # 2 layers x 2 norms each step; the final norm's output is LlamaModel's output: kept. With checkpointing
    # the layers run under the checkpoint: nothing to release (the checkpoint keeps none of them)
    assert on[2] == ([0, 0] if gradient_checkpointing else [4, 4])
    assert off[2] == [0, 0]


def test_nothing_released_when_no_consumer_saves_the_output():
    """A consumer that saves no copy of y (relu saves its result): y is gone at the parent's return."""
    import weakref

    from shardnorm._torch_compat import view_base

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = shardnorm.RMSNorm(H, keep_output=False)

        def forward(self, x):
            return x + torch.relu(self.norm(x))

    refs = []
    parent = Parent()
    parent.norm.register_forward_hook(lambda m, a, y: refs.append(weakref.ref(view_base(y))))
    x = torch.randn(4, H, requires_grad=True)
    out = parent(x)
    assert refs[0]() is None
    out.sum().backward()
    expected = torch.autograd.grad(torch.relu(torch.nn.functional.rms_norm(x, (H,), parent.norm.weight,
                                                                           torch.finfo(torch.float32).eps)).sum(), x)[0]
    assert ((x.grad - 1 - expected).norm() / expected.norm()).item() < 1e-5


def test_compat_entries():
    from shardnorm import _torch_compat

    t = torch.zeros(4)
    v = t.view(2, 2)
    assert _torch_compat.view_base(v) is t and _torch_compat.view_base(t) is t
    before = _torch_compat.tensor_version(t)
    v.add_(1)
    assert _torch_compat.tensor_version(t) == before + 1
    assert not _torch_compat.saved_tensors_hooks_active()
    with torch.autograd.graph.save_on_cpu():
        assert _torch_compat.saved_tensors_hooks_active()
    assert not _torch_compat.functorch_transforms_active()
    assert torch.func.vmap(lambda a: a * 0 + _torch_compat.functorch_transforms_active())(t).all()


# ---- the main job's model: single process, DTensor sequence parallel and FSDP2 on 2 gloo ranks -----------------

def _main_job_model(keep: bool, seed: int):
    from parallel.config import ModelConfig
    from parallel.model import build_model

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=32, norm_keep_output=keep)
    return build_model(cfg, "shardnorm", torch.device("cpu"), seed)


def test_main_job_model_bitwise():
    def run(keep):
        model = _main_job_model(keep, seed=1)
        _perturb(model, 1)
        outputs = _outputs_of(model)
        tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
        loss = model(tokens).float().square().mean()
        released = _released_count(outputs)
        loss.backward()
        return loss, [p.grad for p in model.parameters()], released

    (loss_off, grads_off, released_off), (loss_on, grads_on, released_on) = run(True), run(False)
    assert torch.equal(loss_off, loss_on) and all(torch.equal(a, b) for a, b in zip(grads_off, grads_on))
    assert (released_off, released_on) == (0, 5)  # 2 blocks x 2 norms and the final norm (lm head in the parent)


def test_main_job_config_key():
    from parallel.config import ConfigError, load

    with pytest.raises(ConfigError, match="model.norm_keep_output"):
        load("configs/tiny_cpu.toml", ["model.norm_keep_output=false", "train.norm=\"torch\""])
    assert load("configs/tiny_cpu.toml", ["model.norm_keep_output=false"]).model.norm_keep_output is False


def _distributed_steps(rank, world_size, seed):
    import weakref

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from parallel.config import TrainConfig
    from parallel.engines import TorchEngine
    from parallel.parallelize import parallelize, uses_norm_reducer
    from shardnorm._torch_compat import view_base

    for dp, tp in ((2, 1), (1, 2)):  # FSDP2 over 2 ranks; tensor + sequence parallel (DTensor norms) over 2
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        runs = {}
        for keep in (True, False):
            train = TrainConfig(norm="shardnorm", grad_accum=2, max_grad_norm=1.0)
            model = _main_job_model(keep, seed)
            engine = TorchEngine(parallelize(model, mesh, train), train, norm_reducer=uses_norm_reducer("shardnorm", tp))
            refs, released = [], []

            def capture(module, args, y):
                local = y.to_local() if isinstance(y, DTensor) else y
                refs.append(weakref.ref(view_base(local[0] if isinstance(local, tuple) else local)))

            def count(module, args, output):  # after the root's forward: every parent has returned
                released.append(sum(r() is not None and r().untyped_storage().nbytes() == 0 for r in refs))
                refs.clear()

            for m in model.modules():
                if isinstance(m, shardnorm.RMSNorm):
                    m.register_forward_hook(capture)
            model.register_forward_hook(count)
            g = torch.Generator().manual_seed(seed + (rank if dp > 1 else 0))
            losses = []
            for _ in range(2):
                micro = [(torch.randint(0, 256, (2, 16), generator=g), torch.randint(0, 256, (2, 16), generator=g))
                         for _ in range(train.grad_accum)]
                losses.append(engine.step(micro))
            params = [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in model.parameters()]
            runs[keep] = losses, params, released
        (losses_off, params_off, released_off), (losses_on, params_on, released_on) = runs[True], runs[False]
        assert losses_off == losses_on, (dp, tp, losses_off, losses_on)
        for a, b in zip(params_off, params_on):
            assert torch.equal(a, b), (dp, tp)
        assert released_off == [0] * 4
        # FSDP2: every norm output released (2 blocks x 2 + final); sequence parallel: the matmuls save the
        # all-gathered input, not the norm's shard, so there is nothing to release (and nothing recomputed)
        assert released_on == ([5] * 4 if tp == 1 else [0] * 4), (dp, tp, released_on)


@pytest.mark.distributed
def test_fsdp2_and_sequence_parallel_bitwise():
    from spawn_ranks import spawn

    spawn(_distributed_steps, 2, 3)


# ---- integrations: Hugging Face adapter and Trainer, DeepSpeed section and ZeRO-3, torchtitan converter -------

def test_hf_convert_model_and_trainer_bitwise(tmp_path):
    transformers = pytest.importorskip("transformers")
    from shardnorm.integrations.transformers import convert_model, enable

    model = convert_model(_llama(True, False, seed=1), keep_output=False)
    norms = [m for m in model.modules() if isinstance(m, shardnorm.RMSNorm)]
    assert len(norms) == 5 and not any(m.keep_output for m in norms)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            ids = torch.randint(0, 100, (12,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "labels": ids}

    def train(keep):
        torch.manual_seed(4)
        model = transformers.LlamaForCausalLM(__import__("hf_tiny").tiny_config("llama")).float()
        args = transformers.TrainingArguments(str(tmp_path / f"out{keep}"), per_device_train_batch_size=2,
                                              gradient_accumulation_steps=2, max_steps=2, use_cpu=True,
                                              report_to=[], save_strategy="no", logging_steps=1, seed=4,
                                              dataloader_num_workers=0)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
        enable(trainer, keep_output=keep)
        assert all(m.keep_output == keep for m in trainer.model.modules() if isinstance(m, shardnorm.RMSNorm))
        trainer.train()
        return [p.detach().clone() for p in trainer.model.parameters()]

    for a, b in zip(train(True), train(False)):
        assert torch.equal(a, b)


def test_deepspeed_section_key():
    from shardnorm.integrations.deepspeed_config import ShardnormConfigError, parse_section

    assert parse_section({"keep_output": False}).keep_output is False
    assert parse_section({}).keep_output is True
    with pytest.raises(ShardnormConfigError, match="shardnorm.keep_output"):
        parse_section({"keep_output": "no"})


def test_torchtitan_converter_passes_the_option():
    pytest.importorskip("torchtitan")
    from torchtitan.models.common import RMSNorm as TitanRMSNorm
    from torchtitan.models.llama3 import model_registry

    from shardnorm.integrations.torchtitan import ShardnormConverter, ShardnormRMSNorm

    for keep in (True, False):
        spec = model_registry("debugmodel", converters=[ShardnormConverter.Config(keep_output=keep)])
        configs = [cfg for _, cfg, _, _ in spec.model.traverse(TitanRMSNorm.Config, recurse=True)]
        assert configs and all(type(c) is ShardnormRMSNorm.Config and c.keep_output is keep for c in configs)
        assert configs[0].build().keep_output is keep


def _zero_steps(rank, world_size, seed):
    from deepspeed_harness import full_params, load_config, loss_fn, micro_batches, norm_model, use_test_device

    import shardnorm.integrations.deepspeed as sd

    device = use_test_device(rank)
    for config_name in ("zero1.json", "zero2.json", "zero3.json"):
        runs = {}
        for keep in (True, False):
            config = load_config(config_name)
            if config["zero_optimization"]["stage"] == 3:
                config["zero_optimization"]["stage3_param_persistence_threshold"] = 1  # norm weights partitioned
            config["shardnorm"]["keep_output"] = keep
            model = norm_model(seed).to(device)
            engine, *_ = sd.initialize(model=model, config=config, model_parameters=model.parameters())
            norms = [m for m in engine.module.modules() if isinstance(m, (shardnorm.RMSNorm, shardnorm.LayerNorm))]
            assert len(norms) == 4 and all(m.keep_output is keep for m in norms)
            refs, released = [], []
            prenorm = [m.norm for m in engine.module.modules() if hasattr(m, "fc")]  # parents: PrenormBlock
            for m in prenorm:
                m.register_forward_hook(lambda mod, a, y: refs.append(y))
            losses = []
            for step in micro_batches(seed + 1, 2, config["gradient_accumulation_steps"], world_size, 4, (8,)):
                for micro in step:
                    x, target = (t.to(device) for t in micro[rank])
                    loss = loss_fn(engine(x), target)
                    released.append(sum(y.untyped_storage().nbytes() == 0 for y in refs))
                    refs.clear()
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.detach())
            runs[keep] = losses, full_params(engine.module), released
            engine.destroy()
        (losses_off, params_off, released_off), (losses_on, params_on, released_on) = runs[True], runs[False]
        assert all(torch.equal(a, b) for a, b in zip(losses_off, losses_on)), config_name
        for name in params_off:
            assert torch.equal(params_off[name], params_on[name]), (config_name, name)
        assert set(released_off) == {0} and set(released_on) == {2}, config_name  # the PrenormBlocks' norm outputs


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_deepspeed_zero_stages_bitwise():
    """ZeRO-1, -2 and -3 (norm weights partitioned) through the "shardnorm" section's keep_output: losses and
    parameters after the optimizer steps bitwise equal with the option on and off, the outputs released."""
    pytest.importorskip("deepspeed")
    from spawn_ranks import spawn

    spawn(_zero_steps, 2, 5)


def test_exception_in_parent_and_no_parent():
    """A parent whose forward raises releases nothing and leaves the module-call stack as it was; a norm called
    outside any module keeps its output (nothing says when its consumers are done)."""

    class Raises(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = shardnorm.RMSNorm(H, keep_output=False), torch.nn.Linear(H, H)

        def forward(self, x):
            self.y = self.norm(x)
            self.lin(self.y)
            raise ValueError("boom")

    parent = Raises()
    with pytest.raises(ValueError, match="boom"):
        parent(torch.randn(3, H, requires_grad=True))
    assert parent.y.untyped_storage().nbytes() > 0
    assert output_recompute._stack() == []
    x = torch.randn(3, H, requires_grad=True)
    y = parent.norm(x)  # no parent
    out = torch.nn.functional.linear(y, parent.lin.weight)
    assert y.untyped_storage().nbytes() > 0
    out.sum().backward()
