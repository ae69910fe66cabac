"""Triton kernels: one norm family (LN/RMS, bias, residual, zero-centered gamma) and its launchers."""

from .norm_bwd import column_sum_kernel, dx_kernel, norm_bwd, norm_bwd_kernel, norm_bwd_traced, row_sums_kernel
from .norm_fwd import norm_fwd, norm_fwd_kernel, norm_fwd_traced

# what a traced norm_fwd / norm_bwd launches through wrap_triton (ops.py lists them for AOTAutograd's cache key)
TRACED_FWD_KERNELS = (norm_fwd_kernel,)
TRACED_BWD_KERNELS = (norm_bwd_kernel, row_sums_kernel, dx_kernel, column_sum_kernel)

__all__ = ["norm_fwd", "norm_bwd", "norm_fwd_traced", "norm_bwd_traced", "TRACED_FWD_KERNELS", "TRACED_BWD_KERNELS"]
