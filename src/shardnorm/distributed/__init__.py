"""shardnorm under tensor/sequence parallelism: DTensor norms, the norm-grad reducer, parallel styles."""

from shardnorm.distributed.accumulation import attach_reducer, reducer_of
from shardnorm.distributed.parallel_style import SequenceParallelNorm, process_group_sequence_parallel
from shardnorm.distributed.reducer import DEFAULT_BUCKET_CAP_MB, NormGradReducer
from shardnorm.distributed.regather import RegatherColwiseParallel

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "NormGradReducer",
    "RegatherColwiseParallel",
    "SequenceParallelNorm",
    "attach_reducer",
    "process_group_sequence_parallel",
    "reducer_of",
]
