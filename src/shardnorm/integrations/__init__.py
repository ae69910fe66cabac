"""Adapters from training frameworks to shardnorm's core API, one small module per framework.

Each adapter only translates: it imports its framework (optional; a missing one raises with the extra
to install), converts norms with `shardnorm.convert`, and hands norm grads to the one
`shardnorm.distributed.NormGradReducer` (`add`, or a `grad_sources` source, then `accumulate` /
`finalize_grads`). No copies of conversion or reducer logic live here. DeepSpeed's adapter predates this
folder and stays at `shardnorm.deepspeed` (its public path). See ARCHITECTURE.md.
"""
