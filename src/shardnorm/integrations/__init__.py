"""Adapters from training frameworks to shardnorm's core API, one small module per framework.

Each adapter only translates: it imports its framework (optional; a missing one raises with the extra
to install), converts norms with `shardnorm.convert`, and hands norm grads to the one
`shardnorm.distributed.NormGradReducer` (`attach_reducer(model, source=...)`, then `shardnorm.accumulate` /
`finalize_grads`). No copies of conversion or reducer logic live here. DeepSpeed's adapter is
`deepspeed.py` (`initialize`, `apply`) with its `deepspeed_*.py` parts. See docs/architecture.md.
"""
