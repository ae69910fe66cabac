"""shardnorm under tensor/sequence parallelism: DTensor norms, the norm-grad reducer, parallel styles."""

from shardnorm.distributed.accumulation import accumulate, attach_reducer, finalize_grads, reducer_of
from shardnorm.distributed.parallel_style import SequenceParallelNorm, sequence_parallel_norm
from shardnorm.distributed.reducer import NormGradReducer

__all__ = [
    "NormGradReducer",
    "SequenceParallelNorm",
    "accumulate",
    "attach_reducer",
    "finalize_grads",
    "reducer_of",
    "sequence_parallel_norm",
]
