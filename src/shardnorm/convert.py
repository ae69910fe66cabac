"""`convert(model)`: swap a model's norms for shardnorm's in place, keeping the very same Parameters.

Converted: `torch.nn.LayerNorm`, `torch.nn.RMSNorm`, and Hugging Face style RMSNorms (a class whose
name ends in "RMSNorm" with a `weight` Parameter and a `variance_epsilon` or `eps` float, as Llama,
Mistral and Qwen define them). Parameters are moved over as objects, so devices, dtypes, optimizer
references and `requires_grad` are kept; nothing is copied or allocated.
"""

from typing import Iterable, Optional

import torch

from .modules import LayerNorm, RMSNorm

DEFAULT_CLASSES = ("LayerNorm", "RMSNorm", "*RMSNorm")


def _hf_rms_eps(module: torch.nn.Module) -> Optional[float]:
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    if isinstance(weight, torch.nn.Parameter) and weight.dim() == 1 and isinstance(eps, float):
        return eps
    return None


def _matches(name: str, patterns: tuple) -> bool:
    return any(name == p or (p.startswith("*") and name.endswith(p[1:])) for p in patterns)


def _replacement(module: torch.nn.Module, patterns: tuple) -> Optional[torch.nn.Module]:
    if isinstance(module, (LayerNorm, RMSNorm)) or not _matches(type(module).__name__, patterns):
        return None
    if type(module) is torch.nn.LayerNorm:
        new = LayerNorm(module.normalized_shape, module.eps, module.elementwise_affine,
                        bias=module.bias is not None, device="meta")
        new.bias = module.bias
    elif type(module) is torch.nn.RMSNorm:
        new = RMSNorm(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
    elif (eps := _hf_rms_eps(module)) is not None:
        new = RMSNorm(tuple(getattr(module.weight, "ds_shape", module.weight.shape)), eps, device="meta")
    else:
        return None
    new.weight = module.weight
    new.train(module.training)
    return new


def convert(model: torch.nn.Module, classes: Iterable[str] = DEFAULT_CLASSES) -> tuple[torch.nn.Module, int]:
    """Replace the norms of `model` (and `model` itself if it is one). Returns (model, count).

    `classes`: class names to convert; a leading "*" matches a suffix ("*RMSNorm" covers LlamaRMSNorm).
    """
    patterns = tuple(classes)
    root = _replacement(model, patterns)
    if root is not None:
        return root, 1
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _replacement(child, patterns)
            if new is not None:
                setattr(parent, name, new)
                count += 1
    return model, count
