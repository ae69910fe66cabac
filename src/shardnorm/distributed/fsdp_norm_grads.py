"""Sequence-parallel norm grads under FSDP2: FSDP reduces them over dp first, shardnorm over tp after.

Under FSDP2 × TP a sequence-parallel norm's weight/bias are Replicate over tp, and each rank's
dgamma/dbeta is a partial sum over its own tokens and its own samples: it must be summed over tp and
over dp, each exactly once. The order used here:

1. The norm's backward returns its partial sum as the unsharded parameter's grad, `Partial` over tp;
   a hook on that parameter relabels it `Replicate` (no communication), so FSDP does not all-reduce it
   but keeps it across no-sync micro-batches (in `reduce_dtype`) and reduce-scatters it over dp with
   the rest of the block's grads: no extra collective over dp.
2. After the backward in which FSDP reduce-scattered, the reducer all-reduces over tp only the dp
   shards FSDP produced: numel/dp elements per parameter instead of numel, in fp32, one collective
   per bucket per optimizer step.

The hook runs in eager autograd before the grad is accumulated, also when the block is compiled.

torch's own path reduces in the other order: FSDP redistributes each norm's `Partial` grad to
`Replicate` before its reduce-scatter, one all-reduce of the full parameter per norm parameter, in
the param dtype. Reducing over tp first could overlap with backward but moves dp times the bytes;
the tp all-reduce here runs after FSDP's last reduce-scatter (not overlapped) and is small.
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

_TRACKED = "_shardnorm_fsdp_reducer"


class FSDPNormGradReducer:
    """The model's norm-grad reducer under `shard_model` (what `shardnorm.accumulate`/`finalize_grads` drive).

    `params`: the FSDP-sharded norm parameters whose grads are partial over `group` (the tp group).
    Inside `shardnorm.accumulate(model)` the tp all-reduce waits for a later backward or
    `finalize_grads`; the dp reduction is FSDP's to skip (`shardnorm.fsdp.no_sync` does both).
    """

    def __init__(self, params: list[nn.Parameter], group, *, bucket_cap_mb: float = 1.0):
        if bucket_cap_mb <= 0:
            raise ValueError(f"shardnorm: bucket_cap_mb must be > 0, got {bucket_cap_mb}")
        self.params, self.group = params, group
        self.bucket_cap_numel = max(1, int(bucket_cap_mb * 2**20) // 4)
        self.accumulating = False
        self.collectives = 0  # tp all-reduces issued so far (one per bucket per optimizer step)
        self._before: dict[int, torch.Tensor] = {}  # id(param) -> fp32 local grad already reduced over tp
        self._dirty: set[int] = set()  # params whose sharded grad holds FSDP output not yet reduced over tp
        self._backward_task: int | None = None
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_sharded_grad)

    @property
    def has_pending(self) -> bool:
        return bool(self._dirty)

    def bind(self, params) -> None:
        """Nothing to bind: norm grads reach this reducer through FSDP, not from the norms."""

    def track(self, param: nn.Parameter) -> None:
        """Take over an unsharded param (FSDP makes it at its first all-gather) of a sequence-parallel norm."""
        if getattr(param, _TRACKED, None) is self:
            return
        if isinstance(param, DTensor) and dist.get_process_group_ranks(param.device_mesh.get_group()) \
                != dist.get_process_group_ranks(self.group):
            raise ValueError(f"shardnorm: a sequence-parallel norm parameter of shape {tuple(param.shape)} "
                             f"lives on {param.device_mesh}, not on the tp mesh shard_model was given")
        setattr(param, _TRACKED, self)
        param.sequence_parallel = True
        param.register_hook(self._relabel)

    # ---- called from autograd and FSDP ---------------------------------------------------------------

    def _relabel(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, labelled Replicate over tp so that FSDP reduces it over dp only."""
        task = torch._C._current_graph_task_id()
        if task != self._backward_task:
            self._begin_backward(task)
        if not isinstance(grad, DTensor) or not any(p.is_partial() for p in grad.placements):
            return grad  # a plain (process-group mode) grad is the local partial sum already
        placements = tuple(Replicate() if p.is_partial() else p for p in grad.placements)
        return DTensor.from_local(grad.to_local(), grad.device_mesh, placements, run_check=False,
                                  shape=grad.shape, stride=grad.stride())

    def _begin_backward(self, task: int) -> None:
        self._backward_task = task
        if not self._dirty:  # remember what is already reduced, so only FSDP's new output is all-reduced
            self._before = {id(p): _local(p).float().reshape(-1).clone()
                            for p in self.params if p.grad is not None}
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _on_sharded_grad(self, param: nn.Parameter) -> None:
        """FSDP added its reduce-scatter output (still partial over tp) to this sharded grad."""
        self._dirty.add(id(param))

    def _end_backward(self) -> None:
        self._backward_task = None
        if not self.accumulating:
            self.finalize()

    # ---- reduction -----------------------------------------------------------------------------------

    @torch.no_grad()
    def finalize(self) -> None:
        """All-reduce over tp, in fp32 buckets, what FSDP added to the sharded norm grads. Idempotent."""
        dirty = [p for p in self.params if id(p) in self._dirty]
        self._dirty.clear()
        if not dirty:
            return
        before = [self._before.get(id(p)) for p in dirty]
        flat = torch.cat([_local(p).float().reshape(-1) - (b if b is not None else 0)
                          for p, b in zip(dirty, before)])
        works = [dist.all_reduce(flat[start:start + self.bucket_cap_numel], group=self.group, async_op=True)
                 for start in range(0, flat.numel(), self.bucket_cap_numel)]
        self.collectives += len(works)
        for work in works:
            work.wait()
        offset = 0
        for p, b in zip(dirty, before):
            local = _local(p)
            reduced = flat[offset:offset + local.numel()]
            offset += local.numel()
            local.copy_((reduced if b is None else reduced + b).view_as(local))
        self._before.clear()


def _local(param: nn.Parameter) -> torch.Tensor:
    grad = param.grad
    return grad.to_local() if isinstance(grad, DTensor) else grad
