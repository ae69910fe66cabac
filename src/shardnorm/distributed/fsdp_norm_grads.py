"""Sequence-parallel norm grads under FSDP2: FSDP reduces them over dp first, shardnorm over tp after.

A hook on FSDP's unsharded norm parameter relabels its tp-`Partial` grad `Replicate`, so FSDP reduce-scatters
it over dp with the block's grads and adds no tp all-reduce; then the model's reducer all-reduces only those
dp shards over tp, in fp32, once per step. Why this order: docs/distributed.md ("Reduction order").
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from shardnorm.distributed.grad_sources import REDUCER_ATTR, GradAttributeSource, follow_grad_change, local_tensor
from shardnorm.rows import dtensor_like


class FSDPShardedGrads(GradAttributeSource):
    """FSDP2's reduce-scatter output in the sharded norm params' `.grad`, still partial over `group` (tp).

    `shard_model`'s forward pre-hooks hand it FSDP's unsharded params (`track`). Unreduced: what FSDP added
    since the step's first backward (a post-accumulate hook says FSDP wrote), remembered by the grad tensor's
    identity and a copy of its values as FSDP left them, so a zeroing or scaling of `.grad` takes it too (`.grad`
    set to None or replaced: all of it; changed in place: elementwise, as the reducer's own stash, `_Slot._kept`),
    also where no version counter sees the change (an optimizer built with `foreach=True` or `fused=True` zeroes
    DTensor grads with `torch._foreach_zero_`; `p.grad.data.zero_()`); the grad's autograd state stays the
    user's, so in-place grad code (`p.grad.zero_()`, `p.grad.mul_()`) works as with torch's norms. A backward
    inside `accumulate` whose grads FSDP kept (no-sync) is pending as well; those follow FSDP's own rules.
    """

    def __init__(self, params: list[nn.Parameter], group):
        super().__init__(params, group)
        self._before: dict[int, torch.Tensor] = {}  # id(param) -> fp32 local grad already reduced over tp
        self._dirty: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(param) -> (its sharded grad holding
        # FSDP output not yet reduced over tp, a flat fp32 copy of that grad's local values as last seen)
        self._kept_by_fsdp = False  # FSDP kept (no-sync) the grads of a backward inside accumulate
        self._hooked: set[int] = set()  # id(param) of the sharded params whose grads the hook reports

    def attach(self, reducer) -> None:
        super().attach(reducer)
        self._hook_trainable()

    def _hook_trainable(self) -> None:
        """The post-accumulate hook on each sharded param that takes grads (torch refuses a hook on a frozen one:
        LoRA-style runs freeze norms), including one unfrozen since."""
        for p in self.params:
            if p.requires_grad and id(p) not in self._hooked:
                p.register_post_accumulate_grad_hook(self._on_sharded_grad)
                self._hooked.add(id(p))

    def track(self, param: nn.Parameter) -> None:
        """Take over an unsharded param (FSDP makes it at its first all-gather) of a sequence-parallel norm; a
        frozen one has no grads to take."""
        if getattr(param, REDUCER_ATTR, None) is self.reducer or not param.requires_grad:
            return
        if isinstance(param, DTensor) and dist.get_process_group_ranks(param.device_mesh.get_group()) \
                != dist.get_process_group_ranks(self.group):
            raise ValueError(f"shardnorm: a sequence-parallel norm parameter of shape {tuple(param.shape)} "
                             f"lives on {param.device_mesh}, not on the tp mesh shard_model was given")
        setattr(param, REDUCER_ATTR, self.reducer)
        param.sequence_parallel = True
        param.register_hook(self._relabel)

    def _relabel(self, grad: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum, labelled Replicate over tp so that FSDP reduces it over dp only."""
        self.reducer.note_backward()
        if self.reducer.accumulating:
            self._kept_by_fsdp = True
        if not isinstance(grad, DTensor) or not any(p.is_partial() for p in grad.placements):
            return grad  # a plain (process-group mode) grad is the local partial sum already
        placements = tuple(Replicate() if p.is_partial() else p for p in grad.placements)
        return dtensor_like(grad.to_local(), grad, placements)

    def begin_backward(self) -> None:
        self._hook_trainable()
        self._follow_user_changes()
        for p in self.params:  # remember what is already reduced, so only FSDP's new output is all-reduced
            if id(p) not in self._dirty:
                if p.grad is None:
                    self._before.pop(id(p), None)
                else:
                    self._before[id(p)] = local_tensor(p.grad).float().reshape(-1).clone()

    def _on_sharded_grad(self, param: nn.Parameter) -> None:
        """FSDP added its reduce-scatter output (still partial over tp) to this sharded grad: hold it (no user code
        runs before the backward ends: `end_backward` reads what FSDP left where a later change needs it)."""
        self._dirty[id(param)] = (param.grad, None)
        self._kept_by_fsdp = False

    def end_backward(self) -> None:
        """A copy of what FSDP left in each held grad that also holds a reduced part (`_before`), which the user's
        changes from here on are measured against (`_follow_user_changes`). A grad without a reduced part needs
        none: whatever the user makes of it is all unreduced. The step's last backward is harvested at once, with
        no copy."""
        for p in self.params:
            held, seen = self._dirty.get(id(p), (None, None))
            if held is not None and seen is None and id(p) in self._before:
                self._dirty[id(p)] = (held, local_tensor(held).reshape(-1).to(torch.float32, copy=True))

    def _follow_user_changes(self) -> None:
        """Apply to the record what the user did to the held sharded grads since FSDP wrote them, without reading
        the device: a grad set to None or replaced takes all of it; changed in place, its reduced part follows the
        change as the reducer's stash does (`follow_grad_change`; a value set where FSDP left 0, NaN or Inf counts
        as reduced)."""
        for p in self.params:
            held, seen = self._dirty.get(id(p), (None, None))
            if held is None:
                continue
            if p.grad is not held:
                del self._dirty[id(p)]
                self._before.pop(id(p), None)
                continue
            base = self._before.get(id(p))
            if base is None or seen is None:  # all of it unreduced, or nothing changed since FSDP wrote
                continue
            now = local_tensor(held).reshape(-1).to(torch.float32, copy=True)
            self._before[id(p)], = follow_grad_change(seen, now, (base, now))
            self._dirty[id(p)] = (held, now)

    @property
    def pending(self) -> bool:
        """Whether FSDP kept a backward's grads, or some held sharded grad still has a part not reduced over tp
        after the user's handling of it (a read of the device)."""
        if self._kept_by_fsdp:
            return True
        for p in self._unreduced():
            now, base = local_tensor(p.grad).reshape(-1), self._before.get(id(p))
            if bool((now if base is None else now.float() - base).any()):
                return True
        return False

    def _unreduced(self) -> list[nn.Parameter]:
        self._follow_user_changes()
        return [p for p in self.params if id(p) in self._dirty]

    def _base(self, param) -> torch.Tensor | None:
        return self._before.get(id(param))

    def _forget(self) -> None:
        self._dirty.clear()
        self._before.clear()
        self._kept_by_fsdp = False
