"""keep_output=False: the consumers of a norm's output save a recompute handle; the output is made again in backward.

Every check runs the same model twice from the same seed, option off and on, and compares the loss and every grad
bitwise; the saving itself is checked on the outputs' storage (freed after the forward: a weak reference dies).
"""

import copy
import gc
import weakref

import pytest
import torch

import shardnorm
from shardnorm import _torch_compat, output_checks, output_recompute
from shardnorm.output_recompute import KeepOutputError

import optional_packages

H = 32


def read_checks(forward) -> None:
    """After a backward: on a GPU its checks reach the host asynchronously (`output_checks.check_equal`); let the
    copy land, then run `forward` (a keep_output=False norm's), which reads what arrived."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        forward()


def scoped(model: torch.nn.Module) -> torch.nn.Module:
    """`model` handed to `convert(..., keep_output=False)`: its forward is the scope of its norms' option."""
    return shardnorm.convert(model, keep_output=False, warn=False).model


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
        if not keep:
            scoped(self)

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
    """Weak references to every shardnorm norm's output storage in the next forward (y only: the residual form's
    z is the stream). Weak: a hook that kept the outputs would keep them alive."""
    seen = []

    def hook(module, args, output):
        y = output[0] if isinstance(output, tuple) else output
        local = y.to_local() if type(y).__name__ == "DTensor" else y
        seen.append(weakref.ref(local.untyped_storage()))

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
    """How many of the watched outputs nothing holds any more (freed: their consumers saved handles)."""
    gc.collect()
    return sum(ref() is None for ref in outputs)


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
    # 3 blocks x 2 norms and the final norm (head's input, inside the Stack's forward); each recomputed once
    assert counts["tracked"] == 7 and counts["recomputed"] == 7, counts
    assert counts["saved_as_handle"] >= 7 * 2 - 1, counts  # two consumers a norm (the final norm: head alone)
    assert released == [7]


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
    """A norm whose output is the parent's output: the user holds it, so it stays, whole; backward is right."""
    norm = shardnorm.RMSNorm(H, keep_output=False)
    parent = scoped(torch.nn.Sequential(torch.nn.Linear(H, H), norm, torch.nn.Linear(H, H)))
    outputs = _outputs_of(parent)
    x = torch.randn(4, H, requires_grad=True)
    with pytest.warns(UserWarning, match="outside a model handed to shardnorm.convert"):
        h = parent[1](parent[0](x))  # outside the scope: the output is kept, and the norm says so once
    y = parent(x)
    assert _released_count(outputs) == 1  # the output of the inner call inside parent(...) was freed
    expected = torch.autograd.grad(parent[2](h).sum(), x)[0]
    y.sum().backward()
    assert torch.equal(x.grad, expected)


def test_not_released_without_grad_or_under_checkpoint():
    torch.manual_seed(0)
    model = Stack(False)
    x = torch.randn(2, 3, H, requires_grad=True)
    output_recompute.counters(reset=True)
    with torch.no_grad():
        model(x)
    out = torch.utils.checkpoint.checkpoint(model.blocks[0], x, use_reentrant=False)
    out.sum().backward()
    # no grad: nothing saved; under the checkpoint's saved-tensors hooks the checkpoint owns the saved tensors
    assert output_recompute.counters()["tracked"] == 0
    assert _torch_compat.saved_tensors_hooks_top() is None


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


class _HookedStack(Stack):
    """A Stack whose forward wraps every block in saved-tensors hooks of its own: `wrap(block, x)` runs the block
    (a non-reentrant checkpoint, a per-layer offload). Counts the blocks' forward calls."""

    def __init__(self, keep: bool, wrap):
        super().__init__(keep)
        self.wrap, self.block_calls = wrap, 0
        for block in self.blocks:
            block.register_forward_pre_hook(lambda *args: setattr(self, "block_calls", self.block_calls + 1))

    def forward(self, x):
        for block in self.blocks:
            x = self.wrap(block, x)
        return self.head(self.final(x))


class _OffloadOnce:
    """Saved-tensors hooks as offload libraries write them: pack stores the tensor away, unpack hands it back once."""

    def __init__(self):
        self.store, self.packed = {}, 0

    def pack(self, t):
        self.packed += 1
        self.store[self.packed] = t.clone()
        return self.packed

    def unpack(self, key):
        return self.store.pop(key)


@pytest.mark.parametrize("hooks", ["checkpoint", "offload"])
def test_hooks_pushed_inside_the_model_keep_the_option_inert(hooks):
    """Saved-tensors hooks pushed inside a scoped model (HF's gradient checkpointing, non-reentrant by default; a
    per-layer offload) take the consumers' saves themselves: the option must leave them alone. Reading the norm's own
    saves in the forward would run their unpack there: the checkpoint would recompute each block in the forward (4
    block forwards where 1 is due), and a single-use unpack would leave the backward without its tensor."""
    offload = _OffloadOnce()

    def wrap(block, x):
        if hooks == "checkpoint":
            return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
            return block(x)

    def run(keep):
        torch.manual_seed(3)
        model = _HookedStack(keep, wrap)
        _perturb(model, 3)
        x = torch.randn(2, 4, H, generator=torch.Generator().manual_seed(3), requires_grad=True)
        loss = model(x).square().mean()
        forward_calls = model.block_calls
        loss.backward()
        return forward_calls, [x.grad] + [p.grad for p in model.parameters()]

    (calls_kept, kept), (calls, discarded) = run(True), run(False)
    assert calls == calls_kept == 3
    for u, v in zip(kept, discarded):
        assert torch.equal(u, v)


class _Parent(torch.nn.Module):
    """norm -> lin, with a step between them or after them (`between(y)`, `after(y)`) and a way to return y."""

    def __init__(self, keep: bool, between=None, after=None, wrap=None):
        super().__init__()
        torch.manual_seed(5)
        self.norm, self.lin = shardnorm.RMSNorm(H, keep_output=keep), torch.nn.Linear(H, H)
        self.between, self.after, self.wrap = between, after, wrap
        if not keep:
            scoped(self)

    def forward(self, x):
        y = self.norm(x)
        if self.between is not None:
            self.between(y)
        out = self.lin(y)
        if self.after is not None:
            self.after(y)
        return out if self.wrap is None else self.wrap(out, y)


def _grads(parent, x):
    out = parent(x)
    out = out.out if hasattr(out, "out") else out
    out.square().sum().backward()
    return [x.grad] + [p.grad for p in parent.parameters()]


def _same_grads(make, reference_make=None):
    """Grads of make(keep=False) equal (bitwise) those of reference_make(keep=True) (default: make(keep=True))."""
    got = _grads(make(False), x := torch.randn(3, H, generator=torch.Generator().manual_seed(1), requires_grad=True))
    ref_x = x.detach().clone().requires_grad_()
    want = _grads((reference_make or make)(True), ref_x)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_in_place_change_of_output_before_its_consumers():
    """y changed in place before a consumer saves it: that save keeps the tensor itself (the recompute would lose
    the change), so the grads are the option off's."""
    _same_grads(lambda keep: _Parent(keep, between=lambda y: y.mul_(2.0)))


def test_outputs_held_by_user_code_stay_correct():
    """A forward hook that keeps the output (activation logging), an output captured in an object the parent returns,
    and an output modified in place after the parent returned: never a crash, the values the user sees are the
    forward's, and the grads are those of the unmodified forward."""
    logged = []

    def logging_parent(keep):
        parent = _Parent(keep)
        parent.norm.register_forward_hook(lambda m, a, y: logged.append(y))
        return parent

    _same_grads(logging_parent)
    assert torch.equal(logged[0], logged[1])  # the kept output reads as the forward wrote it

    class Holder:  # neither a tuple, dict nor dataclass
        def __init__(self, out, y):
            self.out, self.y = out, y

    _same_grads(lambda keep: _Parent(keep, wrap=Holder))

    captured = []
    parent = _Parent(False, after=captured.append)
    x = torch.randn(3, H, requires_grad=True)
    out = parent(x)
    expected = captured[0].detach().clone()
    captured[0].detach().add_(100.0)  # user code scribbles on the output after the forward
    out.square().sum().backward()  # the handle recomputes the forward's y, not the scribbled one
    ref = _Parent(True)
    ref_x = x.detach().clone().requires_grad_()
    ref(ref_x).square().sum().backward()
    assert torch.equal(x.grad, ref_x.grad) and torch.equal(parent.lin.weight.grad, ref.lin.weight.grad)
    assert not torch.equal(captured[0], expected)


def test_mixed_dtype_residual_and_retried_backward():
    """norm(x_bf16, residual=r_fp32): y is bf16, z = x + r is fp32; the recompute from z rounds to y's dtype once,
    bitwise the fused forward; a second backward on the retained graph gives the same grads."""

    class Parent(torch.nn.Module):
        def __init__(self, keep):
            super().__init__()
            torch.manual_seed(3)
            self.norm = shardnorm.RMSNorm(H, keep_output=keep)
            self.lin = torch.nn.Linear(H, H).to(torch.bfloat16)
            if not keep:
                scoped(self)

        def forward(self, x, r):
            y, z = self.norm(x, r)
            return self.lin(y).float() + z

    def run(keep):
        g = torch.Generator().manual_seed(4)
        x = torch.randn(3, H, generator=g).to(torch.bfloat16).requires_grad_()
        r = torch.randn(3, H, generator=g).requires_grad_()
        parent = Parent(keep)
        loss = parent(x, r).square().sum()
        loss.backward(retain_graph=True)
        first = [t.grad.clone() for t in (x, r, *parent.parameters())]
        loss.backward()
        return first, [t.grad for t in (x, r, *parent.parameters())]

    (first_off, second_off), (first_on, second_on) = run(True), run(False)
    assert all(torch.equal(a, b) for a, b in zip(first_off, first_on))
    assert all(torch.equal(a, b) for a, b in zip(second_off, second_on))
    assert all(torch.isfinite(g).all() for g in second_on)


@pytest.mark.parametrize("write", ["affine", "roll_within_rows"])
def test_input_changed_through_data_raises(device, write):
    """The norm's input written through `.data` (no version bump) between forward and backward: the recompute
    differs from what the consumers read, and the backward raises instead of using a wrong output (on a GPU at the
    end of the backward, where the flags are read once). Elements moved within a row keep the row's statistics
    and change its output."""
    parent = _Parent(False).to(device)
    x = torch.randn(3, H, device=device, requires_grad=True)
    h = x * 1.0
    out = parent(h)
    if write == "affine":
        h.data.mul_(3.0).add_(1.0)
    else:
        h.data.copy_(h.data.roll(1, dims=-1))
    with pytest.raises(KeepOutputError, match="without a version-counter bump"):
        out.sum().backward()
        read_checks(lambda: parent(x))


def test_keyboard_interrupt_in_parent_forward():
    """A KeyboardInterrupt skips the module forward hooks (torch runs them only for Exception): the hooks pushed at
    the scoped model's call stay pushed until that model's next call resets them. Nothing is held in the meantime,
    and the next call's grads are the option off's."""

    def interrupt(y):
        raise KeyboardInterrupt

    parent = _Parent(False, after=interrupt)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):  # a call that pushed no hooks
        parent(torch.randn(3, H, requires_grad=True))
    with pytest.raises(KeyboardInterrupt):
        parent(torch.randn(3, H, requires_grad=True))
    inputs = []
    for _ in range(200):
        x = torch.randn(64, H, requires_grad=True)
        inputs.append(weakref.ref(x))
        parent.norm(x).sum().backward()
        del x
    gc.collect()
    assert sum(ref() is not None for ref in inputs) == 0
    parent.after = None
    parent.zero_grad(set_to_none=True)
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    got = _grads(parent, x)
    assert _torch_compat.saved_tensors_hooks_top() is None
    ref_x = x.detach().clone().requires_grad_()
    assert all(torch.equal(a, b) for a, b in zip(got, _grads(_Parent(True), ref_x)))


def test_in_place_change_of_input_raises():
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = shardnorm.RMSNorm(H, keep_output=False), torch.nn.Linear(H, H)

        def forward(self, x):
            return self.lin(self.norm(x))

    x = torch.randn(3, H, requires_grad=True)
    h = x * 1.0
    out = scoped(Bad())(h)
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


def _no_global_module_hooks() -> bool:
    from torch.nn.modules import module

    return not (module._global_forward_pre_hooks or module._global_forward_hooks
                or module._global_backward_pre_hooks or module._global_backward_hooks)


def test_option_scope_and_repr():
    """The option installs nothing process-wide: a norm stores it; `convert(model, keep_output=False)` puts one
    forward pre-hook and one forward hook on the model it is handed, and on nothing else."""
    norm = shardnorm.RMSNorm(H)
    assert norm.keep_output and "keep_output" not in repr(norm)
    norm.keep_output = False
    assert "keep_output=False" in repr(norm) and _no_global_module_hooks()
    assert not norm._forward_pre_hooks and not norm._forward_hooks
    model = torch.nn.Sequential(torch.nn.Linear(H, H), norm, torch.nn.Linear(H, H))
    assert scoped(model) is model and len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    scoped(model)  # again: the same two hooks
    assert len(model._forward_pre_hooks) == 1 and len(model._forward_hooks) == 1
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model)
    assert _no_global_module_hooks()
    copied = copy.deepcopy(model)  # the copy's scope holds the copy's norms
    assert copied[1].keep_output is False
    copied[1].keep_output = True
    assert not copied.__dict__[output_recompute._SCOPE_ATTR].needs_hooks()
    assert model.__dict__[output_recompute._SCOPE_ATTR].needs_hooks()
    with pytest.raises(TypeError, match="keep_output"):
        shardnorm.LayerNorm(H, keep_output="no")
    state = shardnorm.RMSNorm(H, keep_output=False).state_dict()
    assert list(state) == ["weight"]  # the option is not state


def test_models_without_shardnorm_norms_see_nothing():
    """While discarding norms exist: a model without shardnorm's norms runs with no saved-tensors hook, under
    torch.func.grad too; a scoped model's norm under torch.func.grad raises shardnorm's own error."""
    discarding = scoped(torch.nn.Sequential(shardnorm.RMSNorm(H, keep_output=False)))
    torch.manual_seed(7)
    linear = torch.nn.Linear(H, H)
    x = torch.randn(3, H)
    seen = []
    linear.register_forward_hook(lambda m, a, y: seen.append(_torch_compat.saved_tensors_hooks_top()))
    linear(x.requires_grad_()).sum().backward()
    assert seen == [None]
    got = torch.func.grad(lambda t: torch.tanh(linear(t)).sum())(x)
    want = torch.autograd.functional.vjp(lambda t: torch.tanh(linear(t)).sum(), x)[1]
    assert torch.allclose(got, want, rtol=1e-6, atol=0)
    with pytest.raises(NotImplementedError, match="torch.func.grad"):
        torch.func.grad(lambda t: discarding(t).sum())(x)


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
    # 2 layers x 2 norms and the final norm (lm_head's input) each step. Under checkpointing the layers' norm
    # outputs are freed either way (the checkpoint keeps none of them) and only the final norm's differs
    assert on[2] == [5, 5]
    assert off[2] == ([4, 4] if gradient_checkpointing else [0, 0])


def test_nothing_released_when_no_consumer_saves_the_output():
    """A consumer that saves no copy of y (relu saves its result): y is gone at the parent's return."""

    from shardnorm._torch_compat import view_base

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = shardnorm.RMSNorm(H, keep_output=False)

        def forward(self, x):
            return x + torch.relu(self.norm(x))

    refs = []
    parent = scoped(Parent())
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
    assert _torch_compat.saved_tensors_hooks_enabled()
    with torch.autograd.graph.disable_saved_tensors_hooks("off"):
        assert not _torch_compat.saved_tensors_hooks_enabled()


def test_models_run_where_saved_tensors_hooks_are_disabled():
    """A scoped model run under `torch.autograd.graph.disable_saved_tensors_hooks` (as torch's own features do)
    trains as without the option: its discarding norm keeps its output."""
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    with_norm = scoped(torch.nn.Sequential(shardnorm.RMSNorm(8, keep_output=False), torch.nn.Linear(8, 2)))
    x = torch.randn(4, 8)
    with torch.autograd.graph.disable_saved_tensors_hooks("saved-tensors hooks are disabled here"):
        plain(x).sum().backward()
        with_norm(x).sum().backward()
    expected = torch.nn.Sequential(torch.nn.RMSNorm(8), torch.nn.Linear(8, 2))
    expected.load_state_dict(with_norm.state_dict())
    expected(x).sum().backward()
    for (name, p), q in zip(with_norm.named_parameters(), expected.parameters()):
        assert torch.allclose(p.grad, q.grad, rtol=1e-5, atol=1e-6), name


# ---- the main job's model: single process, DTensor sequence parallel and FSDP2 on 2 gloo ranks -----------------

def _main_job_model(keep: bool, seed: int, device=torch.device("cpu")):
    from parallel.config import ModelConfig
    from parallel.model import build_model

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=32, norm_keep_output=keep)
    return build_model(cfg, "shardnorm", device, seed)


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

    from spawn_ranks import rank_device
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from parallel.config import TrainConfig
    from parallel.engines import TorchEngine
    from parallel.parallelize import parallelize, uses_norm_reducer

    device = rank_device(rank)
    for dp, tp in ((2, 1), (1, 2)):  # FSDP2 over 2 ranks; tensor + sequence parallel (DTensor norms) over 2
        mesh = init_device_mesh(device.type, (dp, tp), mesh_dim_names=("dp", "tp"))
        runs = {}
        for keep in (True, False):
            train = TrainConfig(norm="shardnorm", grad_accum=2, max_grad_norm=1.0)
            model = _main_job_model(keep, seed, device)
            engine = TorchEngine(parallelize(model, mesh, train), train, norm_reducer=uses_norm_reducer("shardnorm", tp))
            refs, released = _outputs_of(model), []

            def count(module, args, output):  # after the root's forward
                released.append(_released_count(refs))
                refs.clear()

            model.register_forward_hook(count)
            g = torch.Generator().manual_seed(seed + (rank if dp > 1 else 0))
            losses = []
            for _ in range(2):
                micro = [(torch.randint(0, 256, (2, 16), generator=g).to(device),
                          torch.randint(0, 256, (2, 16), generator=g).to(device)) for _ in range(train.grad_accum)]
                losses.append(engine.step(micro))
            params = [(p.full_tensor() if isinstance(p, DTensor) else p).detach() for p in model.parameters()]
            runs[keep] = losses, params, released
        (losses_off, params_off, released_off), (losses_on, params_on, released_on) = runs[True], runs[False]
        assert losses_off == losses_on, (dp, tp, losses_off, losses_on)
        for a, b in zip(params_off, params_on):
            assert torch.equal(a, b), (dp, tp)
        assert released_off == [0] * 4
        # every norm output freed after the forward (2 blocks x 2 + final); under sequence parallelism the norms
        # gather their own outputs, and it is the gathered outputs whose consumers save a handle
        assert released_on == [5] * 4, (dp, tp, released_on)


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
    optional_packages.importorskip("torchtitan")
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
                m.register_forward_hook(lambda mod, a, y: refs.append(weakref.ref(y.untyped_storage())))
            losses = []
            for step in micro_batches(seed + 1, 2, config["gradient_accumulation_steps"], world_size, 4, (8,)):
                for micro in step:
                    x, target = (t.to(device) for t in micro[rank])
                    loss = loss_fn(engine(x), target)
                    released.append(_released_count(refs))
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
    """A parent whose forward raises: the hooks pushed at its call are popped (torch runs always_call forward hooks
    on an Exception) and what it stored stays whole; a norm called outside any module saves its output as usual."""

    class Raises(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.lin = shardnorm.RMSNorm(H, keep_output=False), torch.nn.Linear(H, H)

        def forward(self, x):
            self.y = self.norm(x)
            self.lin(self.y)
            raise ValueError("boom")

    parent = scoped(Raises())
    with pytest.raises(ValueError, match="boom"):
        parent(torch.randn(3, H, requires_grad=True))
    assert torch.isfinite(parent.y).all()
    assert _torch_compat.saved_tensors_hooks_top() is None and output_recompute._scope.depth == 0
    x = torch.randn(3, H, requires_grad=True)
    output_recompute.counters(reset=True)
    y = parent.norm(x)  # no parent: its consumer runs after the scope closed and saves y itself
    out = torch.nn.functional.linear(y, parent.lin.weight)
    out.sum().backward()
    assert output_recompute.counters()["saved_as_handle"] == 0


def _write_behind_autograd(module, args, y):
    """Double y through an alias of its memory that shares no version counter with it (what a `.data` write is
    where torch does not bump the version)."""
    with torch.no_grad():
        alias = torch.empty(0, dtype=y.dtype, device=y.device).set_(y.untyped_storage(), y.storage_offset(),
                                                                      y.shape, y.stride())
        alias.mul_(2.0)


def test_output_written_behind_autograd_raises(device):
    """A forward hook that writes the norm's output behind autograd's back (no version bump) before its consumers
    run: their forward saw the written values, a recompute would give them the norm's own. The backward raises
    instead of using the wrong ones."""
    parent = _Parent(False).to(device)
    parent.norm.register_forward_hook(_write_behind_autograd)
    x = torch.randn(3, H, device=device, requires_grad=True)
    with pytest.raises(KeepOutputError, match="written after the norm's forward"):
        parent(x).sum().backward()
        read_checks(lambda: parent(x))
    kept = _Parent(True).to(device)
    kept.norm.register_forward_hook(_write_behind_autograd)
    kept(x).sum().backward()  # the option off: the consumers saved the written output itself


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (torch.equal holds NaN unequal to itself)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return a.dtype == b.dtype and torch.equal(a.view(ints[a.element_size()]), b.view(ints[b.element_size()]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rows_recompute_as_they_were(device, bad):
    """A row with a NaN or an Inf (an fp16 overflow, which GradScaler answers by skipping the step): its statistics
    and output are NaN in the forward and again in the recompute, which is no change. The backward gives the option
    off's grads, NaNs in the same places, instead of a KeepOutputError (value comparisons hold NaN != NaN)."""
    x = torch.randn(3, H, generator=torch.Generator().manual_seed(4)).to(device)
    x[1, 5] = bad

    def grads(keep):
        parent = _Parent(keep).to(device)
        x_ = x.clone().requires_grad_()
        parent(x_).sum().backward()
        read_checks(lambda: parent(x))
        return [x_.grad] + [p.grad for p in parent.parameters()]

    got, want = grads(False), grads(True)
    assert not torch.isfinite(want[0]).all()
    assert all(_bitwise_equal(a, b) for a, b in zip(got, want))


def _nudge_one_element(module, args, y):
    """Behind autograd (no version bump), set y's smallest element (a 0) to the smallest normal number of its
    dtype: a change an fp32 sum of y's values rounds away, but the consumers' forward then reads other values than a
    recompute gives."""
    with torch.no_grad():
        alias = torch.empty(0, dtype=y.dtype, device=y.device).set_(y.untyped_storage(), y.storage_offset(),
                                                                      y.shape, y.stride())
        flat = alias.view(-1)
        flat[flat.abs().argmin()] = torch.finfo(y.dtype).tiny


def test_small_write_behind_autograd_raises(device):
    """The `.data`-write check compares the bits: one element of a 64 x 4096 bf16 output moved from 0 to 1e-38 (a
    float sum of the values does not see it: checked below) still raises."""
    torch.manual_seed(6)
    parent = torch.nn.Sequential(shardnorm.RMSNorm(4096, keep_output=False), torch.nn.Linear(4096, 8)).to(
        device=device, dtype=torch.bfloat16)
    scoped(parent)
    x = (torch.randn(64, 4096, device=device) * 10).to(torch.bfloat16)
    x[0, 0] = 0  # y's smallest element is 0
    y = parent[0](x)
    nudged = y.clone()
    _nudge_one_element(None, None, nudged)
    assert not torch.equal(nudged, y)
    assert torch.sum(nudged, dtype=torch.float32) == torch.sum(y, dtype=torch.float32)
    parent[0].register_forward_hook(_nudge_one_element)
    with pytest.raises(KeepOutputError, match="written after the norm's forward"):
        parent(x.requires_grad_()).float().sum().backward()
        read_checks(lambda: parent(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(4, 6, 8), (3, 5, 7)], ids=["even", "odd"])
def test_fingerprint_is_exact_and_follows_the_bits(device, dtype, shape):
    """`output_checks.fingerprint`, the `.data`-write check's checksum: the same bits give the same checksum in any
    layout whose rows are contiguous (the re-gather compares a gathered copy with what the consumer read), NaN
    included, and in a view whose rows are not (a transposed view, as a matmul saves it: read in place) the same
    checksum as the same view of a copy; flipping any one bit of any one element changes it, in both."""
    g = torch.Generator().manual_seed(8)
    t = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    t.view(-1)[3] = float("nan")
    want = output_checks.fingerprint(t)
    assert all(torch.equal(output_checks.fingerprint(u), want)
               for u in [t.clone(), t.transpose(0, 1).contiguous().transpose(0, 1)])
    columns = t.transpose(1, 2).contiguous().transpose(1, 2)  # rows not contiguous

    def relaid(view):  # a copy in the view's own layout
        return view.transpose(1, 2).contiguous().transpose(1, 2) if view is columns else view.clone()

    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    for view in (t, columns):
        want = output_checks.fingerprint(view)
        assert torch.equal(output_checks.fingerprint(relaid(view)), want)
        for i in torch.randint(0, t.numel(), (6,), generator=g).tolist():
            for bit in (0, 8 * t.element_size() - 1, int(torch.randint(1, 8 * t.element_size() - 1, (), generator=g))):
                flipped = relaid(view)
                memory = torch.empty(0, dtype=bits, device=device).set_(flipped.untyped_storage())
                memory[i] ^= torch.tensor(1, dtype=torch.int64).bitwise_left_shift(bit).to(bits)
                assert not torch.equal(output_checks.fingerprint(flipped), want), (i, bit)


CHANGES_A_SUM_KEEPS = {
    "reverse rows": lambda v: v.flip(-2),
    "flip the hidden dim": lambda v: v.flip(-1),
    "swap two elements": lambda v: v.index_select(-1, torch.tensor([1, 0, *range(2, v.shape[-1])], device=v.device)),
    # one more in every exponent: 2**23 (fp32) or 2**7 + 2**23 (a word of two bf16) in every word, which a sum
    # modulo 2**32 of 2**9 fp32 words, or 2**25 bf16 words, keeps
    "double every element": lambda v: v * 2,
    "halve every element": lambda v: v / 2,
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("change", list(CHANGES_A_SUM_KEEPS))
def test_fingerprint_sees_changes_a_sum_keeps(device, change, dtype):
    """Writes a plain (or position-weighted) integer sum keeps: elements that only moved (a permutation through
    `.data`), and the same power of two added to every word (every element scaled by 2). The hashed words' sums see
    them, in a contiguous tensor and in a view whose rows are not contiguous."""
    g = torch.Generator().manual_seed(9)
    t = torch.randn(4, 64, 128, generator=g).to(device=device, dtype=dtype)
    for view in (t, t.transpose(1, 2)):
        changed = CHANGES_A_SUM_KEEPS[change](view)
        changed = view.clone().copy_(changed) if view.is_contiguous() else \
            changed.transpose(1, 2).contiguous().transpose(1, 2)
        assert not torch.equal(changed, view)
        assert not torch.equal(output_checks.fingerprint(changed), output_checks.fingerprint(view)), change


@pytest.mark.parametrize("shape,dims", [((5, 7, 33), (0, 1)), ((2, 3, 5, 8), (2, 3)), ((2, 3, 4, 5, 6), (1, 3)),
                                        ((3000, 16), (0, 1)), ((9,), None), ((4, 0), (0, 1)), ((5, 1), (0, 1))])
def test_fingerprint_kernel_is_the_torch_sums(triton_backend, shape, dims):
    """The kernel (interpreted on a CPU) and the torch ops of `reference.fingerprint` give the same block sums,
    bitwise: for contiguous tensors and views whose rows are not (read in place), 16- and 32-bit words, rows over
    several dims, more rows than one block holds, and no rows at all."""
    from shardnorm import reference
    from shardnorm.kernels import fingerprint as kernels

    g = torch.Generator().manual_seed(10)
    for dtype in (torch.bfloat16, torch.float32):
        t = torch.randn(shape, generator=g).to(device=triton_backend, dtype=dtype)
        for view in (t, t.transpose(*dims) if dims else t):
            words = output_checks._words_4d(output_checks._words(view))
            rows, block_n = output_checks._blocks(words.shape[-1])
            want = reference.fingerprint(words, rows)
            assert torch.equal(kernels.fingerprint(words, rows, block_n), want), (dtype, view.stride())
            assert torch.equal(output_checks.fingerprint(view), want)
            # the same shape and strides one element further into the storage: other words, its own layout
            shifted = torch.empty(t.numel() + 1, dtype=dtype, device=t.device)
            shifted = shifted.as_strided(view.shape, view.stride(), 1).copy_(view)
            words = output_checks._words_4d(output_checks._words(shifted))
            want = reference.fingerprint(words, output_checks._blocks(words.shape[-1])[0])
            assert torch.equal(output_checks.fingerprint(shifted), want)


def test_reference_fingerprint_multiplies_modulo_2_32_exactly():
    """The torch ops' uint32 products (`reference._mul32`, int64 tensors) against Python's exact integers."""
    from shardnorm import reference

    h = torch.randint(0, 2**32, (4096,), dtype=torch.int64, generator=torch.Generator().manual_seed(11))
    h[:2] = torch.tensor([0, 2**32 - 1])
    for constant in (0x9E3779B9, 0x85EBCA6B, 0xC2B2AE35):
        assert reference._mul32(h, constant).tolist() == [v * constant % 2**32 for v in h.tolist()]


def test_output_permuted_behind_autograd_raises(device):
    """A forward hook that flips the norm's output through `.data`: the consumers read the flipped output, a
    recompute gives the unflipped one, and the same values in other places keep a plain sum's checksum."""
    torch.manual_seed(0)
    parent = _Parent(False)
    parent.to(device)

    def flip(module, args, y):
        y.data.copy_(y.data.flip(-1))

    parent.norm.register_forward_hook(flip)
    x = torch.randn(4, H, device=device)
    with pytest.raises(KeepOutputError, match="written after the norm's forward"):
        parent(x.requires_grad_()).float().sum().backward()
        read_checks(lambda: parent(x))


def test_device_checks_raise_once_their_copy_lands(monkeypatch, capsys):
    """The order in which a GPU backward's checks are read (`output_checks.check_equal`), with events standing in
    for CUDA's: what has landed is read (the first set flag raises), what is still on its way stays for later, the
    end of a backward waits for every earlier backward's copy, and what is unread at exit is reported then."""

    class Event:
        def __init__(self, landed):
            self.landed = landed

        def query(self):
            return self.landed

        def synchronize(self):
            self.landed = True

    def record(landed, *flags):
        return Event(landed), torch.tensor(flags), [lambda i=i: KeepOutputError(f"flag {i}") for i in range(len(flags))]

    unread = []
    monkeypatch.setattr(output_checks, "_unread", unread)
    clean, dirty, travelling = record(True, False, False), record(True, False, True), record(False, True)
    unread.extend([clean, dirty, travelling])
    with pytest.raises(KeepOutputError, match="flag 1") as raised:
        output_checks.check_arrived()
    assert "any optimizer step taken since has used them" in str(raised.value)  # read late: says so
    assert unread == [travelling]
    output_checks.check_arrived()  # not landed: not read, kept
    assert unread == [travelling]
    with pytest.raises(KeepOutputError, match="flag 0"):
        output_checks._check_pending([])  # a backward's end with no flags of its own waits for the earlier ones
    assert unread == []
    unread.extend([record(False, False), record(False, False, True)])  # the last backward's, unread at exit
    output_checks._report_unread()
    assert unread == []
    assert "read at exit: KeepOutputError: flag 1" in capsys.readouterr().err
    unread.append(record(False, False))
    output_checks._report_unread()
    assert capsys.readouterr().err == ""


def test_comparisons_of_a_backward_that_raised_go_with_it():
    """A device backward's comparisons wait for its end (`output_checks.check_equal`); a backward that raises midway
    never gets there, and its comparisons, tensors included, must not stay behind in the process."""
    kept = []

    class Compare(torch.autograd.Function):  # a recompute's check, as the backward of a consumer makes it
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            a, b = torch.zeros(4, device="meta"), torch.zeros(4, device="meta")  # no host: the check waits
            kept.extend([weakref.ref(a), weakref.ref(b)])
            output_checks.check_equal(a, b, lambda: KeepOutputError("unreachable"))
            assert len(output_checks._pending_checks) == 1
            return grad

    class Fail(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise ValueError("a later node of the backward fails")

    x = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError, match="later node"):
        Compare.apply(Fail.apply(x)).sum().backward()
    gc.collect()
    assert len(output_checks._pending_checks) == 0
    assert kept and all(ref() is None for ref in kept)


def test_backward_comparisons_made_together_keep_their_errors():
    """A GPU backward's checks are compared at its end, those of one shape and dtype in one kernel
    (`output_checks._compare`): each flag still answers for its own comparison and error, whatever the order."""
    g = torch.Generator().manual_seed(3)
    pending, expected = [], []
    for i, shape in enumerate([(), (5,), (), (7,), (5,), ()]):
        a = torch.randn(shape, generator=g)
        differs = i in (1, 2)
        b = a.clone()
        if differs:
            b.view(-1)[-1] += 1e-6 * (1 + b.view(-1)[-1].abs())
        pending.append((a, b, lambda i=i: KeepOutputError(f"check {i}")))
        expected.append(differs)
    flags, errors = output_checks._compare(pending)
    assert flags.dtype == torch.bool and flags.shape == (len(pending),)
    assert sorted(str(e()) for f, e in zip(flags.tolist(), errors) if f) == ["check 1", "check 2"]
    assert sorted(str(e()) for f, e in zip(flags.tolist(), errors) if not f) == \
        sorted(f"check {i}" for i, d in enumerate(expected) if not d)
