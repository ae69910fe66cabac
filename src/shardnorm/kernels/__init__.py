"""Triton kernels: one norm family (LN/RMS, bias, residual, zero-centered gamma) and its launchers."""

from .norm_bwd import norm_bwd
from .norm_fwd import norm_fwd

__all__ = ["norm_fwd", "norm_bwd"]
