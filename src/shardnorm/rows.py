"""The shapes the norm ops take: [M, N] rows whose last dim is contiguous, and parameters as 1-D unit-stride
vectors of N. The kernels read raw addresses with those strides, so every caller of the ops shapes its tensors
here (functional calls, the output recompute). And the way back for DTensors: a local result with its global shape
(`as_dtensor`, `dtensor_like`), one helper for every place that rebuilds one; `cached_spec` where a hot path
wraps local tensors with specs built once."""

from typing import Optional

from torch import Tensor


def as_rows(t: Tensor, n: int, flat: bool = False) -> Tensor:
    """[..., N] as the [M, N] rows the ops take, last dim contiguous (a view where strides allow); `flat`: t is
    already [M, N]."""
    if flat and t.stride()[1] == 1:  # stride() then an index: ~60 ns less than stride(1)'s argument parsing
        return t
    t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 or t.shape[0] == 0 else t.contiguous()


def as_param(p: Optional[Tensor], n: int) -> Optional[Tensor]:
    """A parameter as the kernels read it: 1-D with unit stride (a strided view, e.g. w[::2], is copied)."""
    if p is None or p.dim() == 1 and (p.stride()[0] == 1 or n == 1):
        return p
    return p.reshape(n).contiguous()


def as_dtensor(local: Tensor, mesh, placements, shape, stride) -> Tensor:
    """`local` (this rank's part) as a DTensor of global `shape` and `stride`, differentiably: `DTensor.from_local`
    without its cross-rank check, and without inferring the global shape (a collective for uneven shards)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)


def dtensor_like(local: Tensor, like, placements=None) -> Tensor:
    """`local` as a DTensor laid out like the DTensor `like`: its mesh, global shape and stride, and its placements
    unless `placements` are given."""
    return as_dtensor(local, like.device_mesh, like.placements if placements is None else placements, like.shape,
                      like.stride())


SPECS_KEPT = 64  # specs one cache keeps: the sequence lengths and dtypes one call site sees


def cached_spec(cache: dict, kind, mesh, placements: tuple, shape, stride, dtype):
    """The DTensorSpec of a local tensor laid out by (mesh, placements, shape, stride, dtype), built once and kept in
    `cache` by `kind` (the caller's key for the placements, cheaper to hash than them) with shape, stride and dtype:
    wrapping with a cached spec (`_torch_compat.dtensor_with_spec`) skips the spec `DTensor.from_local` builds and
    checks on every call (~15 us on a CPU). `stride` None: the global tensor is contiguous, its stride derived from
    `shape` when the spec is built."""
    key = (kind, shape, stride, dtype)
    spec = cache.get(key)
    if spec is None:
        from ._torch_compat import dtensor_spec

        if len(cache) >= SPECS_KEPT:
            cache.clear()
        if stride is None:
            stride = contiguous_strides(shape)
        spec = cache[key] = dtensor_spec(mesh, placements, shape, stride, dtype)
    return spec


def contiguous_strides(shape) -> tuple:
    """The strides of a contiguous tensor of `shape`."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
