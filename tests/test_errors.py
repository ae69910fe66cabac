"""Bad input gets a clear error naming the argument, never a silent wrong result."""

import pytest
import torch

import shardnorm


def test_normalized_shape_mismatch():
    with pytest.raises(ValueError, match="normalized_shape"):
        shardnorm.layer_norm(torch.randn(2, 8), (7,))
    with pytest.raises(ValueError, match="normalized_shape"):
        shardnorm.rms_norm(torch.randn(8), (2, 8))


def test_weight_and_bias_shape():
    with pytest.raises(ValueError, match="weight must have shape"):
        shardnorm.layer_norm(torch.randn(2, 8), 8, torch.ones(7))
    with pytest.raises(ValueError, match="bias must have shape"):
        shardnorm.layer_norm(torch.randn(2, 8), 8, torch.ones(8), torch.ones(9))


def test_residual_shape():
    with pytest.raises(ValueError, match="residual must have"):
        shardnorm.add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), 8)


def test_device_mismatch():
    with pytest.raises(ValueError, match="weight is on meta"):
        shardnorm.rms_norm(torch.randn(2, 8), 8, torch.ones(8, device="meta"))


def test_ops_check_devices(monkeypatch):
    """The ops check every tensor's device against x's (src's): the kernels get raw addresses."""
    from shardnorm import ops

    with pytest.raises(ValueError, match="shardnorm::norm_bwd: rstd is on meta but src is on cpu"):
        ops._check_devices("norm_bwd", "src", torch.ones(2), dy=torch.ones(2), rstd=torch.ones(2, device="meta"))
    seen = []
    monkeypatch.setattr(ops, "_check_devices", lambda op, anchor, like, **tensors: seen.append((op, set(tensors))))
    x, w = torch.randn(2, 8), torch.randn(8)
    _, _, mean, rstd = torch.ops.shardnorm.norm_fwd(x, w, None, None, 1e-5, True, False)
    torch.ops.shardnorm.norm_bwd(x, None, x, w, mean, rstd, False, True, False)
    assert seen == [("norm_fwd", {"weight", "bias", "residual"}),
                    ("norm_bwd", {"dy", "dz", "weight", "mean", "rstd"})]


def test_norm_bwd_refuses_calls_autograd_would_record(backend, device):
    """`norm_bwd` has no autograd of its own: called directly on an input that requires grad it raises, naming the
    op, rather than return outputs whose grads would be missing; under no_grad it runs."""
    x, w = torch.randn(2, 8, device=device), torch.randn(8, device=device)
    with torch.no_grad():
        _, _, mean, rstd = torch.ops.shardnorm.norm_fwd(x, w, None, None, 1e-5, True, False)
    call = lambda x, w: torch.ops.shardnorm.norm_bwd(x, None, x, w, mean, rstd, False, True, False)  # noqa: E731
    with pytest.raises(RuntimeError, match="shardnorm::norm_bwd has no autograd of its own"):
        call(x, w.requires_grad_())
    with torch.no_grad():
        assert call(x, w)[0].shape == x.shape


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool])
def test_integer_dtype(dtype):
    with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
        shardnorm.layer_norm(torch.ones(2, 8, dtype=dtype), 8)
    with pytest.raises(TypeError, match="weight must be"):
        shardnorm.layer_norm(torch.ones(2, 8), 8, torch.ones(8, dtype=dtype))


@pytest.mark.parametrize("eps", [-1e-5, float("nan")])
def test_bad_eps(eps):
    with pytest.raises(ValueError, match="eps must be >= 0"):
        shardnorm.rms_norm(torch.randn(2, 8), 8, eps=eps)


@pytest.mark.parametrize("name, value", [("SHARDNORM_BACKEND", "cuda"), ("SHARDNORM_PORTABLE_KERNELS", "maybe")])
def test_bad_setting_names_the_variable(monkeypatch, name, value):
    from shardnorm import settings

    monkeypatch.setenv(name, value)
    try:
        with pytest.raises(ValueError, match=f"{name} must be one of .*got '{value}'"):
            settings.reload()
    finally:
        monkeypatch.undo()
        settings.reload()


@pytest.mark.parametrize("shape, what", [(torch.ones(8), "got Tensor"), ("8", "got str"), (True, "got bool"),
                                         ((8.0,), "got an element of type float"), (8.0, "got float")])
def test_normalized_shape_type(shape, what):
    """A tensor (the weight passed where the shape goes), a string or a float size: a TypeError naming
    normalized_shape, not a comparison's or an unreadable shape mismatch (a float size passes the comparison)."""
    with pytest.raises(TypeError, match=f"normalized_shape must be an int or a sequence of ints, {what}"):
        shardnorm.rms_norm(torch.randn(2, 8), shape)
    if not isinstance(shape, torch.Tensor):
        with pytest.raises(TypeError, match="normalized_shape"):
            shardnorm.LayerNorm(shape)


@pytest.mark.parametrize("eps", ["1e-5", torch.tensor(1e-5), True])
def test_eps_type(eps):
    """A string or tensor eps: a TypeError naming eps, at the call and at construction (a tensor would reach the
    kernels as another kind of argument; torch's constructors take a string)."""
    with pytest.raises(TypeError, match="eps must be a float"):
        shardnorm.rms_norm(torch.randn(2, 8), 8, eps=eps)
    with pytest.raises(TypeError, match="eps must be a float"):
        shardnorm.RMSNorm(8, eps=eps)
    norm = shardnorm.RMSNorm(8, keep_output=False)
    norm.eps = eps  # set after construction: the call checks it
    with pytest.raises(TypeError, match="eps must be a float"):
        norm(torch.randn(2, 8))


def test_int_eps_is_a_float(backend, device):
    """An int eps is the float it names. The kernels' launch plans leave eps out of their cache key (always a
    float): an int 1 first would compile a kernel specialized to it (Triton makes an int 1 a constant) that a later
    float eps would reuse. An N no other test uses, so this test's first call makes the plan."""
    x = torch.randn(4, 40, device=device)
    expected = torch.nn.functional.layer_norm(x.double(), (40,), eps=1.0)
    torch.testing.assert_close(shardnorm.layer_norm(x, 40, eps=1).double(), expected, rtol=1e-5, atol=1e-5)
    expected = torch.nn.functional.layer_norm(x.double(), (40,), eps=1e-5)
    torch.testing.assert_close(shardnorm.layer_norm(x, 40, eps=1e-5).double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["x", "weight", "bias", "residual"])
def test_non_tensor_argument(name):
    args = {"x": torch.randn(2, 8), "residual": torch.randn(2, 8), "weight": torch.ones(8), "bias": torch.zeros(8)}
    args[name] = [0.0] * 8
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor"):
        shardnorm.add_layer_norm(args["x"], args["residual"], 8, args["weight"], args["bias"])


def test_flag_types():
    """A string flag would be read by its truth value: "no" would select the 1 + weight kernels, or keep the outputs
    a `convert(..., keep_output="no")` meant to discard. A TypeError naming the flag instead."""
    with pytest.raises(TypeError, match="zero_centered_gamma must be a bool"):
        shardnorm.rms_norm(torch.randn(2, 8), 8, torch.ones(8), zero_centered_gamma="no")
    with pytest.raises(TypeError, match="zero_centered_gamma must be a bool"):
        shardnorm.LayerNorm(8, zero_centered_gamma="no")
    model = torch.nn.Sequential(torch.nn.LayerNorm(8))
    with pytest.raises(TypeError, match="keep_output must be a bool"):
        shardnorm.convert(model, keep_output="no")
    assert type(model[0]) is torch.nn.LayerNorm  # refused before anything was converted


def test_nested_tensor_is_named():
    """A jagged nested tensor (packed variable-length sequences), which torch's norms take: an error naming it
    (not a reshape's error, which names no argument)."""
    nested = torch.nested.nested_tensor([torch.randn(2, 8), torch.randn(3, 8)], layout=torch.jagged)
    for norm in (shardnorm.LayerNorm(8), shardnorm.RMSNorm(8)):
        with pytest.raises(TypeError, match="x is a nested tensor"):
            norm(nested)
