"""DeepSpeed adapter: `initialize` and `apply`, the two ways into DeepSpeed with a "shardnorm" config section.

Importing this works without DeepSpeed installed; `initialize` says so when it is called. Keys are validated
in `deepspeed_config.py`, AutoTP's q/k-norm all-reduces taken over in `deepspeed_autotp.py`.
"""

from typing import Any

import torch

from .deepspeed_autotp import (attach_marked_norm_grads, autotp_size, check_step_config, claim_marked_norm_grads,
                               marked_norm_params)
from .deepspeed_config import ShardnormConfigError, ShardnormSection, load_config, parse_section, read_section
from .deepspeed_conversion import convert_norms, planned_norms

__all__ = ["ShardnormConfigError", "ShardnormSection", "apply", "initialize", "parse_section", "read_section"]


def apply(model: torch.nn.Module, config: Any) -> torch.nn.Module:
    """Convert `model`'s norms as the config's "shardnorm" section asks; returns the model.

    For code that calls `deepspeed.initialize` itself (Hugging Face Trainer, Accelerate). Owning AutoTP's
    q/k-norm all-reduces needs the engine, so there it refuses before changing the model.
    """
    ds_config = load_config(config)
    section = read_section(ds_config)
    if section is None:
        return model
    if section.grad_reduce == "step" and marked_norm_params(model, ds_config,
                                                            [m for _, m in planned_norms(model, section)]):
        raise ShardnormConfigError(
            "shardnorm.grad_reduce", '"step" under AutoTP needs shardnorm.integrations.deepspeed.initialize (it '
            'hooks the engine); with apply() set "grad_reduce": "deepspeed" to keep DeepSpeed\'s per-parameter '
            'all-reduce. Nothing was converted')
    model, _ = convert_norms(model, section)
    return model


def initialize(model: torch.nn.Module = None, config: Any = None, **kwargs):
    """`deepspeed.initialize` with the "shardnorm" section applied first; returns what it returns. Every other
    argument goes to it unchanged (an optimizer built before still holds the same Parameters)."""
    try:
        import deepspeed
    except ImportError as e:
        raise ImportError("shardnorm.integrations.deepspeed.initialize needs DeepSpeed: "
                          "pip install 'shardnorm[deepspeed]'") from e
    if model is None or config is None:
        raise TypeError("shardnorm.integrations.deepspeed.initialize needs model= and config=")
    ds_config = load_config(config)
    section = read_section(ds_config)
    claimed = []
    if section is not None and section.grad_reduce == "step" and autotp_size(ds_config) > 1:
        check_step_config(ds_config)
    if section is not None:
        model, _ = convert_norms(model, section)
        claimed = claim_marked_norm_grads(model, ds_config, section)
    result = deepspeed.initialize(model=model, config=config, **kwargs)
    if claimed:
        attach_marked_norm_grads(result[0], claimed, section.bucket_cap_mb)
    return result
