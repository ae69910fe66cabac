"""The C++ host path (`shardnorm.host`): replayed calls give the Python path's results bitwise, forward and
backward, for every variant, several dtypes and shapes; what it cannot replay runs the Python path.

Without a GPU: the extension is built (it needs no CUDA) and its plumbing runs on CPU tensors with a test
launcher in place of cuLaunchKernel: the launcher gets the replayed launch's argument bytes and computes the
norm from them (addresses to tensors, scalars decoded), so keys, allocations, argument packing, outputs and
the autograd node are checked against float64; and `record.py` refuses the interpreter's launches (no
compiled kernel to replay). With a GPU: real recordings and replays of the Triton kernels.
"""

import ctypes
import shutil
import struct

import pytest
import torch

import shardnorm
from conftest import reference_norm, rel_err
from shardnorm import host

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="building the host path needs a C++ compiler")


@pytest.fixture(scope="module")
def module():
    if host.unsupported() is not None and torch.cuda.is_available():
        pytest.skip(host.unsupported())
    try:
        return host.load()
    except RuntimeError as error:
        if "Triton" not in str(error):
            raise
        return host.build()  # CPU: the replay's argument packing is Triton 3.6's, the plumbing any version's


# ---- CPU: the plumbing, with a test launcher ------------------------------------------------------------

ALLOC = 8  # replay.cpp's kAllocBase


class FakeKernel:
    """Stands in for one compiled norm kernel: `spec()` says how a call allocates and launches (as record.py
    would), `launch()` is the test launcher: it finds the tensors behind the addresses it is given and
    writes the norm's outputs (computed in float64 from the addressed inputs) into the replay's buffers."""

    def __init__(self, module):
        self.module, self.tensors, self.launches, self.recorded = module, {}, 0, []

    def remember(self, *tensors):
        for t in tensors:
            if t is not None:
                self.tensors[t.data_ptr()] = t

    def record_forward(self, key, x, weight, bias, residual, eps, rms, zero_centered):
        outputs = shardnorm.reference.norm_fwd(x, weight, bias, residual, eps, rms, zero_centered)
        outputs = tuple(None if t.numel() == 0 else t for t in outputs)  # absent as the kernels' (None)
        if key is not None:
            self.recorded.append(("fwd", tuple(key)))
            M, N = x.shape
            stats = [([M], [1], torch.float32)]
            allocs = [([M, N], [N, 1], x.dtype), *stats, *([] if rms else stats)]
            rstd, mean = ALLOC + 1, -1 if rms else ALLOC + 2
            params = [(True, 0)] + [(True, i) for i, t in ((1, weight), (2, bias)) if t is not None]
            params += [(True, ALLOC), (True, rstd)] + ([] if rms else [(True, mean)])
            params += [(False, M), (False, N), (False, int.from_bytes(struct.pack("<f", eps), "little")),
                       (False, int(rms) | int(zero_centered) << 1 | (weight is not None) << 2 | (bias is not None) << 3)]
            launch = (1, (M, 1, 1), 128, 0, 2, params)
            self.module.add_spec(key, residual is None, allocs, [launch], [ALLOC, -1, mean, rstd])
        return outputs

    def record_backward(self, key, dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered):
        self.recorded.append(("bwd", None if key is None else tuple(key)))
        outputs = shardnorm.reference.norm_bwd(dy, dz, src, weight, mean, rstd, has_bias, rms, zero_centered)
        if key is not None and dz is None and weight is not None and not zero_centered:  # dy, src, weight, rstd[, mean]
            M, N = src.shape
            grads = [([N], [1], weight.dtype)] * (1 + has_bias)
            params = [(True, 0), (True, 2), (True, 3), (True, 5)] + ([] if rms else [(True, 4)])
            params += [(True, ALLOC), (True, ALLOC + 1)] + ([(True, ALLOC + 2)] if has_bias else [])
            params += [(False, M), (False, N), (False, int(rms) | int(has_bias) << 1)]
            self.module.add_spec(key, True, [([M, N], [N, 1], src.dtype), *grads], [(2, (1, 1, 1), 128, 0, 2, params)],
                                 [ALLOC, ALLOC + 1, ALLOC + 2 if has_bias else -1])
        return outputs

    def launch(self, function, grid, block, shared, values, stream):
        if function == 2:
            return self.launch_backward(values)
        assert function == 1 and block == 128 and shared == 0 and stream == 0 and values[-2:] == [0, 0]
        flags = values[-3]
        rms, zero_centered, has_weight, has_bias = (bool(flags >> i & 1) for i in range(4))
        M, N = values[-6] & 0xFFFFFFFF, values[-5] & 0xFFFFFFFF
        assert grid == (M, 1, 1)
        eps = struct.unpack("<f", (values[-4] & 0xFFFFFFFF).to_bytes(4, "little"))[0]
        ptrs = iter(values[:-6])
        x = self.tensors[next(ptrs)].reshape(M, N)  # the memory of M rows, whatever the caller's shape
        weight = self.tensors[next(ptrs)] if has_weight else None
        bias = self.tensors[next(ptrs)] if has_bias else None
        y_at, rstd_at = next(ptrs), next(ptrs)
        y = reference_norm(x, weight, bias, None, eps, rms, zero_centered).to(x.dtype)
        xd = x.double()
        var = xd.square().mean(-1) if rms else xd.var(-1, unbiased=False)
        rstd = torch.rsqrt(var + eps).float()
        ctypes.memmove(y_at, y.data_ptr(), y.numel() * y.element_size())
        ctypes.memmove(rstd_at, rstd.data_ptr(), rstd.numel() * 4)
        if not rms:
            mean = xd.mean(-1).float()
            ctypes.memmove(next(ptrs), mean.data_ptr(), M * 4)
        self.launches += 1

    def launch_backward(self, values):
        flags, M, N = values[-3], values[-5] & 0xFFFFFFFF, values[-4] & 0xFFFFFFFF
        rms, has_bias = bool(flags & 1), bool(flags & 2)
        ptrs = iter(values[:-5])
        dy, src, weight = (self.tensors[next(ptrs)] for _ in range(3))
        rstd = _from_address(next(ptrs), M)  # the forward replay's buffers: known by address only
        mean = None if rms else _from_address(next(ptrs), M)
        dy, src = dy.reshape(M, N), src.reshape(M, N)
        out = shardnorm.reference.norm_bwd(dy, None, src, weight, mean, rstd, has_bias, rms, False)
        for t in out[:2 + has_bias]:
            ctypes.memmove(next(ptrs), t.contiguous().data_ptr(), t.numel() * t.element_size())
        self.launches += 1


def _from_address(address: int, count: int) -> torch.Tensor:
    """A copy of `count` float32 values at a raw CPU address."""
    return torch.frombuffer(bytearray((ctypes.c_char * (4 * count)).from_address(address)), dtype=torch.float32)


@pytest.fixture
def fake(module, monkeypatch):
    kernel = FakeKernel(module)
    module.clear()
    module.set_callbacks(kernel.record_forward, kernel.record_backward, shardnorm.ops._ready)
    module.set_test_launcher(kernel.launch)
    yield kernel
    module.set_test_launcher(None)
    module.set_callbacks(host._record_forward, host._record_backward, shardnorm.ops._ready)
    module.clear()


@pytest.mark.parametrize("rms", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M, N", [(8, 64), (5, 100)])
def test_replay_on_cpu(fake, module, rms, dtype, M, N):
    torch.manual_seed(M * N)
    x = torch.randn(M, N, dtype=dtype, requires_grad=True)
    weight = torch.randn(N, dtype=dtype, requires_grad=True)
    bias = None if rms else torch.randn(N, dtype=dtype, requires_grad=True)
    fake.remember(x, weight, bias)
    eps = 1e-5
    y0, z0 = module.norm(x, weight, bias, None, eps, rms, False)  # records
    assert z0 is None and fake.launches == 0 and [r[0] for r in fake.recorded] == ["fwd"]
    y1, _ = module.norm(x, weight, bias, None, eps, rms, False)  # replays
    assert fake.launches == 1 and len(fake.recorded) == 1
    expected = reference_norm(x.detach(), weight.detach(), bias, None, eps, rms)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert rel_err(y1, expected) < tol and rel_err(y0, expected) < tol
    assert y1.requires_grad and y1.grad_fn is not None and y1.shape == x.shape and y1.dtype == dtype
    dy = torch.randn_like(y1)
    y1.backward(dy)  # the C++ node's backward: no backward spec, so the Python callback runs it
    assert fake.recorded[-1][0] == "bwd" and fake.recorded[-1][1] is not None
    grads = [t.grad for t in (x, weight, bias) if t is not None]
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    reference_norm(x64, w64, b64, None, eps, rms).backward(dy.double())
    for got, want in zip(grads, [t.grad for t in (x64, w64, b64) if t is not None]):
        assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 2e-2)
    # with no grad: no node, same replay
    with torch.no_grad():
        y2, _ = module.norm(x, weight, bias, None, eps, rms, False)
    assert y2.grad_fn is None and torch.equal(y2, y1) and fake.launches == 2


class _Pending(torch.autograd.Function):
    """A tensor handed out as a collective's pending result (AsyncCollectiveTensor) with an autograd edge back
    to it, as DTensor's to_local hands out a sequence-parallel shard: the wrapper has no storage of its own."""

    @staticmethod
    def forward(ctx, t):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        return AsyncCollectiveTensor(t.detach().clone())

    @staticmethod
    def backward(ctx, grad):
        return grad


@pytest.mark.parametrize("rms", [True, False])
def test_pending_collective_results_replay(fake, module, rms):
    """x (or the residual) as a collective's pending result: the autograd edge is the wrapper, the kernels read
    the waited tensor behind it (x_data); y and the grads reaching the tensor before the wrapper are the norm's."""
    torch.manual_seed(11)
    M, N, eps = 6, 64, 1e-5
    source = torch.randn(M, N, requires_grad=True)
    weight = torch.randn(N, requires_grad=True)
    bias = None if rms else torch.randn(N, requires_grad=True)
    x = _Pending.apply(source)
    assert type(x).__name__ == "AsyncCollectiveTensor" and x.grad_fn is not None
    data = x.wait()
    fake.remember(data, weight, bias)
    assert module.norm(x, weight, bias, None, eps, rms, False) is None  # no storage: only with x_data
    assert module.norm(x, weight, bias, None, eps, rms, False, data[:, :32], None) is None  # not x's shape
    for _ in range(2):  # records, then replays
        y, z = module.norm(x, weight, bias, None, eps, rms, False, data, None)
    assert fake.launches == 1 and z is None and type(y) is torch.Tensor and y.grad_fn is not None
    assert rel_err(y, reference_norm(source.detach(), weight.detach(), bias, None, eps, rms)) < 1e-6
    dy = torch.randn_like(y)
    y.backward(dy)
    s64, w64 = source.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    reference_norm(s64, w64, b64, None, eps, rms).backward(dy.double())
    for got, want in zip((source.grad, weight.grad), (s64.grad, w64.grad)):
        assert got is not None and rel_err(got, want) < 1e-5
    # a pending residual beside a plain x: z = x + residual, its grad reaches the residual's source
    source.grad = None
    r_source = torch.randn(M, N, requires_grad=True)
    residual = _Pending.apply(r_source)
    plain_x = torch.randn(M, N, requires_grad=True)
    r_data = residual.wait()
    fake.remember(plain_x, r_data)
    y, z = module.norm(plain_x, weight, bias, residual, eps, rms, False, None, r_data)
    assert torch.equal(z, plain_x + r_source) and z.grad_fn is not None
    assert rel_err(y, reference_norm(plain_x + r_source, weight, bias, None, eps, rms)) < 1e-6
    (y * dy).sum().backward()
    assert r_source.grad is not None and torch.equal(r_source.grad, plain_x.grad)


class _PendingGrad(torch.autograd.Function):
    """Identity whose backward hands out the grad as a collective's pending result (what reaches a norm's output
    under sequence parallel, from the next layer's all-gather backward)."""

    @staticmethod
    def forward(ctx, t):
        return t.view_as(t)

    elem = None  # the tensor behind the pending grad, if set (a test launcher finds tensors by address)

    @staticmethod
    def backward(ctx, grad):
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        return AsyncCollectiveTensor(grad.clone() if _PendingGrad.elem is None else _PendingGrad.elem.copy_(grad))


@pytest.mark.parametrize("rms", [True, False])
def test_pending_grads_are_waited_on(fake, module, rms, monkeypatch):
    """A grad that is a collective's pending result has no memory the kernels may read: the C++ backward waits
    on it (ops._ready, the `ready` callback) and uses the tensor behind it, recorded and then replayed, as for a
    plain grad; without that callback such a grad is the Python path's, unkeyed."""
    torch.manual_seed(12)
    M, N, eps = 6, 64, 1e-5
    weight = torch.randn(N, requires_grad=True)
    bias = None if rms else torch.randn(N, requires_grad=True)
    fake.remember(weight, bias)
    dy = torch.randn(M, N)
    monkeypatch.setattr(_PendingGrad, "elem", torch.empty(M, N))
    fake.remember(dy, _PendingGrad.elem)
    for step in range(3):  # forward: records, replays; backward: records (with a plain dy), replays
        x = torch.randn(M, N, requires_grad=True)
        fake.remember(x)
        y, _ = module.norm(x, weight, bias, None, eps, rms, False)
        weight.grad = None
        (_PendingGrad.apply(y) if step else y).backward(dy)
        x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
        b64 = None if bias is None else bias.detach().double().requires_grad_()
        reference_norm(x64, w64, b64, None, eps, rms).backward(dy.double())
        assert rel_err(x.grad, x64.grad) < 1e-5 and rel_err(weight.grad, w64.grad) < 1e-5
    assert [r[0] for r in fake.recorded] == ["fwd", "bwd"] and fake.launches == 2 + 2
    module.set_callbacks(fake.record_forward, fake.record_backward)  # no `ready`
    weight.grad = None
    x = torch.randn(M, N, requires_grad=True)
    fake.remember(x)
    y, _ = module.norm(x, weight, bias, None, eps, rms, False)
    _PendingGrad.apply(y).backward(dy)
    assert fake.recorded[-1] == ("bwd", None) and fake.launches == 5  # the forward replayed, the backward Python's
    x64, w64 = x.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    b64 = None if bias is None else bias.detach().double().requires_grad_()
    reference_norm(x64, w64, b64, None, eps, rms).backward(dy.double())
    assert rel_err(x.grad, x64.grad) < 1e-5 and rel_err(weight.grad, w64.grad) < 1e-5


def test_key_tells_signatures_apart(fake, module):
    x = torch.randn(4, 32)
    w = torch.randn(32)
    fake.remember(x, w)
    module.norm(x, w, None, None, 1e-5, True, False)
    module.norm(x, w, None, None, 1e-6, True, False)  # another eps
    module.norm(x, w, None, None, 1e-5, False, False)  # LayerNorm
    x16 = x.to(torch.bfloat16)
    fake.remember(x16)
    module.norm(x16, w, None, None, 1e-5, True, False)  # another dtype
    rows = torch.randn(4, 40)[:, :32]  # another row stride
    fake.remember(rows)
    module.norm(rows, w, None, None, 1e-5, True, False)
    assert len(fake.recorded) == 5 and len(set(fake.recorded)) == 5 and module.size() == 5
    module.norm(x, w, None, None, 1e-5, True, False)
    assert len(fake.recorded) == 5 and fake.launches == 1


def test_unreplayable_and_unkeyed_calls_run_python(fake, module):
    x, w, res = torch.randn(4, 32), torch.randn(32), torch.randn(4, 32)
    fake.remember(x, w, res)
    for _ in range(2):  # FakeKernel registers residual calls as not replayable
        y, z = module.norm(x, w, None, res, 1e-5, True, False)
    assert fake.launches == 0 and len(fake.recorded) == 1
    assert rel_err(y, reference_norm(x, w, None, res, 1e-5, True)) < 1e-6 and torch.equal(z, x + res)
    cols = torch.randn(32, 4).t()  # unit row stride: no key, the Python path unrecorded
    module.norm(cols, w, None, None, 1e-5, True, False)
    assert len(fake.recorded) == 1 and module.size() == 1


def test_capacity_bounds_recordings(fake, module):
    w = torch.randn(16)
    fake.remember(w)
    module.set_capacity(2)
    try:
        for m in (1, 2, 3, 4):
            x = torch.randn(m, 16)
            fake.remember(x)
            module.norm(x, w, None, None, 1e-5, True, False)
        assert module.size() == 2 and len(fake.recorded) == 2  # past capacity: Python, unrecorded
    finally:
        module.set_capacity(1024)


def test_module_entry_takes_plain_calls_and_leaves_the_rest(fake, module, monkeypatch):
    """module_norm (the modules' and functional API's entry) replays [..., N] inputs in their own shape and
    returns None for whatever the Python path must check, name or unwrap."""
    torch.manual_seed(3)
    x, w = torch.randn(2, 3, 64, requires_grad=True), torch.randn(64, requires_grad=True)
    fake.remember(x, w)
    for _ in range(2):  # records, then replays
        y, z = module.module_norm(x, None, (64,), w, None, 1e-6, True, False)
    assert fake.launches == 1 and z is None and y.shape == x.shape and not y._is_view()
    assert rel_err(y, reference_norm(x.detach(), w.detach(), None, None, 1e-6, True)) < 1e-6
    y.backward(torch.ones_like(y))  # a 3-D dy: the Python backward gets rows, dx comes back in x's shape
    assert x.grad.shape == x.shape and w.grad.shape == w.shape
    y2, _ = module.module_norm(x, None, 64, w, None, None, True, False)  # int shape, default eps (a new key)
    y2.add_(1.0)  # an ordinary output: in-place ops allowed
    assert len(fake.recorded) == 3

    class Sub(torch.Tensor):
        pass

    leave = [
        (x.detach().as_subclass(Sub), None, (64,), w, None, 1e-6),  # a subclass (DTensor-like): unwrapped there
        (x.double(), None, (64,), w, None, 1e-6),  # a dtype the Python path names
        (x, None, (3, 64), w, None, 1e-6),  # normalized_shape over two dims
        (x, None, (32,), w, None, 1e-6),  # a shape mismatch the Python path names
        (x, None, (64,), w[:32], None, 1e-6),
        (x, torch.randn(3, 64), (64,), w, None, 1e-6),  # residual of another shape
        (x, None, (64,), w, None, -1.0),  # bad eps
        (x, None, (64,), w, None, float("nan")),
        (x.transpose(0, 1), None, (64,), w, None, 1e-6),  # 3-D and not contiguous
        (x[:, :, :0], None, (0,), None, None, 1e-6),
        (x, None, (64,), torch.randn(128)[::2], None, 1e-6),  # a strided weight: the Python path copies it
        (x, None, (64,), w, None, 10**400),  # an eps no double holds
    ]
    for args in leave:
        assert module.module_norm(*args, True, False) is None, args
    module.set_test_launcher(None)  # CPU tensors without a test launcher: the torch backend's (Python path)
    assert module.module_norm(x, None, (64,), w, None, 1e-6, True, False) is None
    module.set_test_launcher(fake.launch)
    monkeypatch.setenv("SHARDNORM_BACKEND", "torch")
    assert module.module_norm(x, None, (64,), w, None, 1e-6, True, False) is None
    monkeypatch.delenv("SHARDNORM_BACKEND")
    assert torch.func.vmap(lambda t: module.module_norm(t, None, (64,), w.detach(), None, 1e-6, True, False)
                           is None and t.sum())(x.detach()) is not None
    import torch.autograd.forward_ad as fwad

    with fwad.dual_level():  # forward-mode AD: the Python path raises for it, a replay would drop the tangent
        dual = fwad.make_dual(x.detach(), torch.randn_like(x))
        assert module.module_norm(dual, None, (64,), w, None, 1e-6, True, False) is None
        assert module.norm(dual.reshape(6, 64), w, None, None, 1e-6, True, False) is None


@pytest.mark.parametrize("rms", [True, False])
def test_backward_replays_in_the_callers_shape(fake, module, rms):
    """A 3-D call's backward: recorded through the Python callback once, then replayed with dx allocated in x's
    shape; grads against float64 (the same grad tensor for two steps: the key's alias record does not change)."""
    torch.manual_seed(4)
    x = torch.randn(2, 5, 48, requires_grad=True)
    w = torch.randn(48, requires_grad=True)
    b = None if rms else torch.randn(48, requires_grad=True)
    dy = torch.randn(2, 5, 48)
    fake.remember(x, w, b, dy)
    for step in range(3):
        for t in (x, w, b):
            if t is not None:
                t.grad = None
        y, _ = module.module_norm(x, None, (48,), w, b, 1e-5, rms, False)
        y.backward(dy)
        x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        b64 = None if b is None else b.detach().double().requires_grad_()
        reference_norm(x64, w64, b64, None, 1e-5, rms).backward(dy.double())
        assert x.grad.shape == x.shape and rel_err(x.grad, x64.grad) < 1e-5 and rel_err(w.grad, w64.grad) < 1e-5
        if b is not None:
            assert rel_err(b.grad, b64.grad) < 1e-5
    assert [kind for kind, _ in fake.recorded] == ["fwd", "bwd"] and fake.launches == 4  # 2 replays each way


def test_interpreter_launches_are_not_recorded():
    """Under TRITON_INTERPRET there is no compiled kernel: the recording must refuse, not replay nothing."""
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs without a GPU")
    from shardnorm.host import record
    from shardnorm.kernels import norm_fwd

    x, w = torch.randn(4, 64), torch.randn(64)
    outputs, spec = record.record((x, w, None, None), lambda: norm_fwd(x, w, None, None, 1e-5, True, False))
    assert isinstance(spec, str) and rel_err(outputs[0], reference_norm(x, w, None, None, 1e-5, True)) < 1e-6


def test_mode_variable_is_checked(monkeypatch):
    monkeypatch.setattr(host, "_state", "idle")
    monkeypatch.setenv("SHARDNORM_HOST_PATH", "yes")
    with pytest.raises(ValueError, match="SHARDNORM_HOST_PATH"):
        host.start()
    monkeypatch.setenv("SHARDNORM_HOST_PATH", "off")
    host.start()
    assert host._state == "off" and host.norm is None and host.module_norm is None


def test_scalar_packing():
    from shardnorm.kernels.launch import scalar_bytes as _scalar

    assert _scalar("i32", -1) == 0xFFFFFFFF and _scalar("i64", -1) == -1 and _scalar("i1", True) == 1
    assert _scalar("fp32", 1.0) == 0x3F800000 and _scalar("u64", 2**64 - 1) == -1
    assert _scalar("fp64", -2.0) == struct.unpack("<q", struct.pack("<d", -2.0))[0]
    assert _scalar("bf16", 1.0) is None and _scalar("*fp32", 0) is None


# ---- GPU: real recordings against the Python path --------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="replays Triton kernels on a GPU")


@pytest.fixture
def host_on(module):
    module.clear()
    host.enable(True)
    yield module
    host.enable(False)
    host.clear()


def _call(fn, x, weight, bias, residual, dy, dz):
    """Outputs and grads of one forward+backward of fn, on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias, residual)]
    y, z = fn(*leaves)
    torch.autograd.backward([y] + ([z] if z is not None else []), [dy] + ([dz] if z is not None else []))
    return [y.detach(), z.detach() if z is not None else None] + [t.grad if t is not None else None for t in leaves]


CASES = [  # (rms, bias, residual, zero_centered, x dtype, weight dtype, M, N)
    (True, False, False, False, torch.bfloat16, torch.bfloat16, 8, 4096),
    (True, False, False, False, torch.bfloat16, torch.float32, 8, 1024),
    (False, True, False, False, torch.bfloat16, torch.bfloat16, 8, 4096),
    (False, True, True, False, torch.float16, torch.float16, 37, 1000),
    (True, False, True, True, torch.float32, torch.float32, 3, 128),
    (False, False, False, False, torch.float32, None, 64, 768),
    (True, False, False, False, torch.bfloat16, torch.bfloat16, 4096, 128),  # the backward's partial rows
    (False, True, False, False, torch.bfloat16, torch.bfloat16, 2048, 2048),
    (True, False, False, False, torch.bfloat16, torch.bfloat16, 64, 32768),  # long rows: staged, not replayed
]


# every case with plain tensors; two with x / residual as a collective's pending results, and the grads that come
# back pending too (sequence parallel: a DTensor's local shard is an AsyncCollectiveTensor)
REPLAY_CASES = [(case, False) for case in CASES] + [(CASES[0], True), (CASES[3], True)]


@cuda
@pytest.mark.parametrize("case, pending", REPLAY_CASES,
                         ids=lambda c: "pending" if c is True else "plain" if c is False else
                         "-".join(map(str, c)).replace("torch.", ""))
def test_replay_matches_python_path(host_on, case, pending):
    """Recorded, then replayed (forward and backward): bitwise the Python path's outputs and grads on plain
    tensors, and against float64. Pending inputs: grads go through the wrappers' autograd edges."""
    rms, has_bias, has_residual, zero_centered, dtype, wdtype, M, N = case
    torch.manual_seed(M + N)
    dev = "cuda"
    x = torch.randn(M, N, device=dev, dtype=dtype)
    weight = torch.randn(N, device=dev, dtype=wdtype) if wdtype is not None else None
    bias = torch.randn(N, device=dev, dtype=wdtype) if has_bias else None
    residual = torch.randn(M, N, device=dev, dtype=dtype) if has_residual else None
    dy = torch.randn(M, N, device=dev, dtype=dtype)
    dz = torch.randn(M, N, device=dev, dtype=dtype) if has_residual else None
    eps = 1e-6
    ops = shardnorm.ops

    def fn(x, w, b, r):
        return ops.norm(x, w, b, r, eps, rms, zero_centered)

    def fn_pending(x, w, b, r):
        y, z = fn(_Pending.apply(x), w, b, _Pending.apply(r) if r is not None else None)
        return _PendingGrad.apply(y), (_PendingGrad.apply(z) if z is not None else None)

    host.enable(False)
    python = _call(fn, x, weight, bias, residual, dy, dz)
    host.enable(True)
    before = host.stats()
    runs = [_call(fn_pending if pending else fn, x, weight, bias, residual, dy, dz) for _ in range(3)]  # records,
    after = host.stats()  # then replays
    replayed = [after[k] - before[k] for k in ("replayed_forward", "replayed_backward")]
    assert replayed == ([2, 0] if N == 32768 else [2, 2]), (replayed, host.refused)  # long rows: staged backward
    for run in runs:
        for got, want in zip(run, python):
            assert (got is None) == (want is None)
            if got is not None:
                assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
    expected = reference_norm(x, weight, bias, residual, eps, rms, zero_centered)
    assert rel_err(runs[-1][0], expected) < (1e-5 if dtype == torch.float32 else 1e-2)


@cuda
@pytest.mark.parametrize("rms", [True, False])
def test_modules_and_functional_match_python_path(host_on, rms):
    """The modules' entry (module_norm) on [batch, seq, hidden] inputs, with and without the fused residual:
    bitwise the Python path's outputs and grads, replayed after the first call."""
    torch.manual_seed(2)
    dev, dtype = "cuda", torch.bfloat16
    norm = (shardnorm.RMSNorm(1024, eps=1e-6) if rms else shardnorm.LayerNorm(1024)).to(dev, dtype)
    with torch.no_grad():
        for p in norm.parameters():
            p.normal_()
    x, res = torch.randn(2, 16, 1024, device=dev, dtype=dtype), torch.randn(2, 16, 1024, device=dev, dtype=dtype)
    dy = torch.randn_like(x)

    def step(residual):
        xi = x.detach().clone().requires_grad_()
        ri = residual.detach().clone().requires_grad_() if residual is not None else None
        for p in norm.parameters():
            p.grad = None
        out = norm(xi) if ri is None else norm(xi, residual=ri)
        y = out if ri is None else out[0]
        (y.float() * dy.float()).sum().backward() if ri is None else \
            torch.autograd.backward([y, out[1]], [dy, dy])
        return [y.detach(), xi.grad] + [p.grad.clone() for p in norm.parameters()] + ([ri.grad] if ri is not None else [])

    for residual in (None, res):
        host.enable(False)
        python = step(residual)
        host.enable(True)
        before = host.stats()
        runs = [step(residual) for _ in range(3)]
        after = host.stats()
        assert after["replayed_forward"] - before["replayed_forward"] == 2, host.refused
        assert after["replayed_backward"] - before["replayed_backward"] == 2, host.refused
        for run in runs:
            assert all(torch.equal(a, b) for a, b in zip(run, python))
    y = shardnorm.rms_norm(x, (1024,), norm.weight, 1e-6) if rms else \
        shardnorm.layer_norm(x, (1024,), norm.weight, norm.bias)
    expected = reference_norm(x, norm.weight, getattr(norm, "bias", None), None, 1e-6 if rms else 1e-5, rms)
    assert y.shape == x.shape and rel_err(y, expected) < 1e-2


@cuda
def test_strided_grad_and_new_shapes(host_on):
    """dy with a column stride (the Python path copies it: no key) and an M never seen (a new recording)."""
    torch.manual_seed(0)
    norm = shardnorm.RMSNorm(256, eps=1e-6).cuda()
    with torch.no_grad():
        norm.weight.normal_()
    for M in (16, 16, 24, 16):
        x = torch.randn(M, 256, device="cuda", requires_grad=True)
        y = norm(x)
        dy = torch.randn(256, M, device="cuda").t()  # column stride M
        y.backward(dy)
        x64 = x.detach().double().requires_grad_()
        w64 = norm.weight.detach().double().requires_grad_()
        reference_norm(x64, w64, None, None, 1e-6, True).backward(dy.double())
        assert rel_err(x.grad, x64.grad) < 1e-5 and rel_err(norm.weight.grad, w64.grad) < 1e-5
        norm.weight.grad = None


@cuda
def test_cuda_graph_capture_replays(host_on):
    """The host path's launches go to the capturing stream: a captured forward+backward replays eager's."""
    torch.manual_seed(1)
    norm = shardnorm.LayerNorm(512).cuda()
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = torch.randn(32, 512, device="cuda", requires_grad=True)
    dy = torch.randn(32, 512, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            norm(x).backward(dy)
    torch.cuda.current_stream().wait_stream(side)
    x.grad = norm.weight.grad = norm.bias.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = norm(x)
        y.backward(dy)
    with torch.no_grad():
        x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    host.enable(False)
    x2 = x.detach().clone().requires_grad_()
    eager = shardnorm.LayerNorm(512).cuda()
    eager.load_state_dict(norm.state_dict())
    y2 = eager(x2)
    y2.backward(dy)
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad) and torch.equal(norm.weight.grad, eager.weight.grad)
