"""shardnorm: fused Triton LayerNorm / RMSNorm for distributed training."""

from .convert import convert
from .functional import add_layer_norm, add_rms_norm, layer_norm, rms_norm
from .modules import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm", "add_layer_norm", "add_rms_norm", "convert", "layer_norm", "rms_norm"]
__version__ = "0.1.0"
