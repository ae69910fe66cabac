"""Triton kernels: one norm family (LN/RMS, bias, residual, zero-centered gamma) and its launchers."""

from .norm_bwd import norm_bwd, norm_bwd_traced
from .norm_fwd import norm_fwd, norm_fwd_traced

__all__ = ["norm_fwd", "norm_bwd", "norm_fwd_traced", "norm_bwd_traced"]
