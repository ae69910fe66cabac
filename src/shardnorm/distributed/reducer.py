"""The one norm-grad reducer: per-rank fp32 partial sums, reduced across their group once per step.

Every partial sum goes into one fp32 buffer per process group, cut into `bucket_cap_mb` buckets, and
accumulates over micro-batches; in the step's last backward each bucket is all-reduced as soon as its last
contribution arrives, and at the end of that backward (or at `finalize()`) the sums are added to `.grad`.
Where they come from is the `source` (`grad_sources.py`); this class owns the rest. Buckets are laid out in
the order grads first arrive (the backward order); a grad that arrives after its bucket was launched is
reduced on its own, so correctness never depends on that guess.

The norms hand their grads over through grad sinks (`GradSink`): an fp32 leaf per parameter that the norm's node
takes as an input and gives the parameter's grad to (`ops._NormFunction`), so compiled graphs carry the hand-off as
an ordinary grad; the sink's post-accumulate hook passes it on to `add`.

Between the backward passes of an accumulating step the partial sums wait in the parameters' own `.grad` (as
Megatron-Core keeps them in its grad buffer): however the user zeroes grads (`zero_grad`, `set_to_none`,
`p.grad.zero_()`, `p.grad.data.zero_()`), the zeroing reaches them. The step's last backward takes them back out
before its buckets are reduced: the exact fp32 sums where `.grad` still holds what was written there, so a bf16
`.grad` rounds the step's sum once. Where a bucket's `.grad`s are all None (after `zero_grad(set_to_none=True)`),
the reducer writes them all in one multi-tensor copy: a few kernels per bucket instead of a few per parameter.
A backward that raises leaves its sums in `.grad` as an accumulating backward does, so the user's zeroing of a
step given up reaches them.
"""

import functools
import weakref
from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from shardnorm._torch_compat import (current_graph_task_id, dtensor_local, dtensor_spec_of, dtensor_with_spec,
                                     foreach_copy, queue_backward_callback)
from shardnorm.distributed.grad_sources import GradSource, NormBackward, follow_grad_change, local_tensor

ReduceMode = Literal["bucketed", "per_layer"]

# Norm grads are small (a Llama-3-8B's 65 norms: 1.0 MiB of fp32): 1 MiB buckets give the norms' backward a
# few buckets that start while backward goes on; a larger cap would only take away that overlap.
DEFAULT_BUCKET_CAP_MB = 1.0


class _Slot:
    """One parameter's fp32 accumulator: a view into its bucket once laid out, a lone tensor before."""

    __slots__ = ("param", "group", "data", "bucket", "expected", "count", "touched", "stashed", "base", "total",
                 "written", "grad")

    def __init__(self, param, group, numel: int, device):
        self.param, self.group, self.bucket = param, group, None
        self.data = torch.zeros(numel, dtype=torch.float32, device=device)
        self.expected, self.count, self.touched = 1, 0, False
        # the pending sum waits in the param's .grad: what .grad held before (fp32), the exact fp32 sum, what was
        # written into .grad (its dtype), and the .grad object it was written into
        self.stashed, self.base, self.total, self.written, self.grad = False, None, None, None, None

    def stash(self) -> None:
        """Move the pending sum into the param's `.grad` (in its dtype), where any zeroing of the grads reaches it,
        keeping its exact fp32 value too: a bf16 `.grad` would otherwise round the step's sum once per
        micro-batch instead of once."""
        param = self.param
        self._unbatch()
        kept, base = self._kept() if self.stashed else (None, None)
        if kept is None:  # the step's first stash, or .grad set to None since the last one
            self.base = None if param.grad is None else \
                local_tensor(param.grad).reshape(-1).to(torch.float32, copy=True)
            self.total = self.data.clone()
        else:
            self.base, self.total = base, kept.add_(self.data)
        values = (self.total if self.base is None else self.base + self.total).to(param.dtype)
        if param.grad is None:
            param.grad = _as_grad(param, values.clone())
        else:
            local = local_tensor(param.grad)
            local.copy_(values.view_as(local))
        self.written, self.grad = values, param.grad
        self.data.zero_()
        self.touched, self.stashed = False, True

    def _unbatch(self) -> None:
        """This slot's stash is about to change on its own: its bucket's stash is no longer one piece."""
        if self.bucket is not None:
            self.bucket.stashed = None

    def _kept(self) -> tuple:
        """(the stashed fp32 sum, what `.grad` goes back to when the sum is taken out) as the user's handling of
        `.grad` left them; (None, None) where `.grad` was set to None. Elementwise: where `.grad` still holds what
        `stash` wrote, the exact sum and what `.grad` held before the step; elsewhere the user changed `.grad`
        (zeroed or scaled it through `zero_grad`, `.data` or anything else), and the change applies to both parts
        alike: the sum is reduced over the ranks, the part held before (the last step's reduced grad, the same on
        every rank) is not, so it must not be counted once per rank. A changed element whose written value gives no
        ratio (0, or a NaN or Inf of an overflowed micro-batch) holds what the user put there, as the part held
        before: a zeroing after a NaN micro-batch leaves zeros, not 0 x NaN."""
        if self.param.grad is None:
            return None, None
        now, written = local_tensor(self.param.grad).reshape(-1).float(), self.written.float()
        if self.base is None:
            return torch.where(now == written, self.total, now), None
        return tuple(follow_grad_change(written, now, (self.total, 0.0), (self.base, now)))

    def holds_sum(self) -> bool:
        """Whether a stashed sum is left after the user's handling of `.grad` (a read of the device)."""
        kept, _ = self._kept()
        return kept is not None and bool(kept.any())

    def unstash(self) -> None:
        """Take back out of `.grad` what is left of the stashed sum, leaving `.grad` as it was before the step."""
        if not self.stashed:
            return
        self._unbatch()
        kept, base = self._kept()
        if kept is not None:
            self.data.add_(kept)
            self.touched = True
            if self.bucket is not None:
                self.bucket.dirty = True
        self._restore_grad(base)

    def drop(self) -> None:
        """Forget the pending sum, `.grad` back to what it was before the step."""
        self._unbatch()
        if self.stashed:
            self._restore_grad(self.base)
        self.data.zero_()
        self.touched = False

    def _restore_grad(self, base) -> None:
        """`.grad` back to `base` (None: to None); nothing stashed any more."""
        if self.param.grad is not None:
            if base is None:
                self.param.grad = None
            else:
                local = local_tensor(self.param.grad)
                local.copy_(base.view_as(local))
        self.stashed, self.base, self.total, self.written, self.grad = False, None, None, None, None


class GradSink:
    """Where a norm's node gives one parameter's fp32 partial-sum grad (`ops._NormFunction`): `tensor`, an fp32
    leaf of the parameter's local size whose value is never read; its post-accumulate hook hands the grad to the
    reducer, over `group`."""

    __slots__ = ("tensor", "group", "param", "__weakref__")

    def __init__(self, tensor: torch.Tensor, group, param):
        self.tensor, self.group, self.param = tensor, group, param

    def __deepcopy__(self, memo):
        return None  # a copied parameter has no sink: NormGradReducer.__deepcopy__


class _Bucket:
    """A contiguous range of a flat buffer, reduced with one collective.

    Its slots' pending sums are stashed, taken back and written to `.grad` (`stash`, `unstash`, `write_grads`)
    together where they can be: a few kernels per bucket instead of a few per parameter, host time of every
    accumulating step (10 against 80 ops a step for 8 norms, 20 against 650 for 65:
    `benchmarks/results/cpu-torch2.13-triton3.9/reducer_host.md`). Where the slots' `.grad`s are not in one state
    (a user's own `.grad`, some set to None, a norm unused in a micro-batch), each slot does it on its own
    (`_Slot`)."""

    __slots__ = ("group", "flat", "slots", "pending", "work", "dirty", "pieces", "stashed")

    def __init__(self, group, flat: torch.Tensor, slots: list[_Slot]):
        self.group, self.flat, self.slots = group, flat, slots
        self.pending, self.work, self.dirty = 0, None, False
        offsets = [0]
        for s in slots:
            offsets.append(offsets[-1] + s.data.numel())
        self.pieces = list(zip(offsets[:-1], offsets[1:]))
        # (total, written, grads): the slots' stashed state, the first two as flat tensors, grads the `.grad`s'
        # tensors, or None
        self.stashed = None

    def _dtype(self):
        """The slots' params' one dtype, or None where they differ (then slot by slot)."""
        dtype = self.slots[0].param.dtype
        return dtype if all(s.param.dtype == dtype for s in self.slots) else None

    def _views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[a:b] for a, b in self.pieces]

    def _copies(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """The slots' pieces of `flat` as tensors of their own, copied by one multi-tensor kernel: `.grad`s that are
        views of one tensor would take no copy, but torch cannot deepcopy a DTensor over a view at an offset (a
        model copied for EMA or `AveragedModel` after a backward)."""
        pieces = [flat.new_empty(b - a) for a, b in self.pieces]
        foreach_copy(pieces, self._views(flat))
        return pieces

    def _stashed_sum(self) -> torch.Tensor:
        """`_Slot._kept`'s sum for every slot at once (each slot's `.grad` is the one stashed, nothing held before)."""
        total, written, grads = self.stashed
        now = torch.cat(grads)
        return torch.where(now == written, total, now.float())

    def _in_one_piece(self) -> bool:
        """Whether the last stash was the whole bucket's and every `.grad` is still the object it wrote."""
        return self.stashed is not None and all(s.stashed and s.param.grad is s.grad for s in self.slots)

    def stash(self) -> None:
        """`_Slot.stash` of every touched slot: at once where the slots are in one state."""
        if not self._stash_at_once():
            for s in self.slots:
                if s.touched:
                    s.stash()

    def _stash_at_once(self) -> bool:
        slots, dtype = self.slots, self._dtype()
        if dtype is None or not all(s.touched for s in slots):
            return False
        if not any(s.stashed for s in slots) and all(s.param.grad is None for s in slots):
            total = self.flat.clone()
            written = total.to(dtype)
            grads = self._copies(written)
            for s, grad in zip(slots, grads):
                s.param.grad = _as_grad(s.param, grad)
        elif self._in_one_piece():
            grads = self.stashed[2]
            total = self._stashed_sum().add_(self.flat)
            written = total.to(dtype)
            foreach_copy(grads, self._views(written))
        else:
            return False
        for s, t, w in zip(slots, self._views(total), self._views(written)):
            s.base, s.total, s.written, s.grad = None, t, w, s.param.grad
            s.touched, s.stashed = False, True
        self.flat.zero_()
        self.stashed = (total, written, grads)
        return True

    def unstash(self) -> None:
        """`_Slot.unstash` of every slot: at once where the last stash was the whole bucket's and left as it was."""
        if not self._in_one_piece():
            for s in self.slots:
                s.unstash()
            return
        self.flat.add_(self._stashed_sum())
        for s in self.slots:
            s._restore_grad(None)  # nothing held before the stash: .grad back to None
            s.touched = True
        self.stashed, self.dirty = None, True

    def write_grads(self) -> None:
        """The reduced sums of the touched slots into `.grad` (`_accumulate_grad`): where every one of those
        `.grad`s is None, as views of one tensor in the params' dtype."""
        if not self._write_grads_at_once():
            for s in self.slots:
                if s.touched:
                    _accumulate_grad(s.param, s.data)
                    s.data.zero_()
                    s.touched = False

    def _write_grads_at_once(self) -> bool:
        touched, dtype = [s.touched for s in self.slots], self._dtype()
        if dtype is None or not any(touched) \
                or any(t and s.param.grad is not None for s, t in zip(self.slots, touched)):
            return False
        for s, t, grad in zip(self.slots, touched, self._copies(self.flat.to(dtype))):
            if t:
                s.param.grad = _as_grad(s.param, grad)
                s.touched = False
        self.flat.zero_()
        return True


class NormGradReducer:
    """Owns the cross-rank reduction of norm weight/bias grads: each partial sum is reduced exactly once.

    reduce="bucketed": one all-reduce per bucket per optimizer step, overlapped with the last backward.
    reduce="per_layer": one all-reduce per pushed norm parameter grad per micro-batch, issued as it arrives
    (for debugging and comparison); grads still land in `.grad` only when the step's grads are final.
    source: where the partial sums come from (default `NormBackward()`: the norms push them).
    """

    def __init__(self, *, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, reduce: ReduceMode = "bucketed",
                 source: GradSource | None = None):
        if reduce not in ("bucketed", "per_layer"):
            raise ValueError(f"shardnorm: reduce must be 'bucketed' or 'per_layer', got {reduce!r}")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, (int, float)) \
                or not 0 < bucket_cap_mb < float("inf"):
            raise ValueError(f"shardnorm: bucket_cap_mb must be a finite number > 0, got {bucket_cap_mb!r}")
        self.reduce = reduce
        self.bucket_cap_bytes = int(bucket_cap_mb * 2**20)
        self.accumulating = False  # set by shardnorm.accumulate(model): backward passes do not reduce
        self.collectives = 0  # all-reduces issued so far, every kind (bucket, per-layer, late)
        self.buckets: list[_Bucket] = []
        self._slots: dict[int, _Slot] = {}  # id(param) -> slot; the slot keeps the param alive
        self._staged: list[_Slot] = []  # seen but not yet laid out in a bucket
        self._unmaterialized: list[tuple[list, object]] = []  # registered while on the meta device
        self._late: list[tuple[_Slot, torch.Tensor]] = []  # arrived after their bucket was launched
        self._per_layer: list[tuple[object, torch.Tensor, list[_Slot]]] = []
        self._backward_task: int | None = None  # autograd graph task whose end we wait for
        self._run: weakref.ref | None = None  # that backward's `_BackwardRun`, held by its end callback
        self._syncing = False
        self._left_pending = False  # an accumulating backward left sums for the step; finalize or discard takes them
        self.source = source if source is not None else NormBackward()
        if reduce == "per_layer" and not isinstance(self.source, NormBackward):
            raise ValueError(f"shardnorm: reduce='per_layer' reduces grads pushed by the norms' backward; the "
                             f"source {type(self.source).__name__} is harvested once per step, use reduce='bucketed'")
        self.source.attach(self)
        _REDUCERS.add(self)

    @property
    def num_buckets(self) -> int:
        """Collectives per optimizer step in bucketed mode (once the layout is known)."""
        return len(self.buckets)

    @property
    def params(self) -> list:
        """The parameters whose grads this reducer owns so far, in layout order."""
        return [s.param for s in self._slots.values()]

    @property
    def has_pending(self) -> bool:
        """Whether accumulated grads are waiting for the step's reduction: not the sums a zero_grad since dropped
        or zeroed (for stashed sums, a read of the device)."""
        return any(s.touched or s.stashed and s.holds_sum() for s in self._slots.values()) or self.source.pending

    def __deepcopy__(self, memo):
        """A deep copy of the model (an EMA copy; torch.optim.swa_utils.AveragedModel) gets no reducer: a reducer
        holds process groups, which do not copy, and its buffers and pending sums belong to the original's
        parameters. The copy's norm grads are `Partial`, as before `attach_reducer`; `attach_reducer(copy)` gives
        it its own reducer (tests/test_distributed_reducer.py)."""
        return None

    def sink(self, param, group) -> GradSink:
        """A grad sink for `param`, whose partial sums are reduced over `group` (`NormBackward.bind`)."""
        local = local_tensor(param)
        tensor = torch.zeros(local.numel(), dtype=torch.float32, device=local.device, requires_grad=True)
        sink = GradSink(tensor, group, param)
        tensor.register_post_accumulate_grad_hook(functools.partial(self._on_sink_grad, weakref.ref(sink)))
        return sink

    def _on_sink_grad(self, sink_ref, tensor: torch.Tensor) -> None:
        grad, tensor.grad = tensor.grad, None
        sink = sink_ref()
        if sink is not None:
            self.add([sink.param], [grad.detach()], sink.group)

    def discard_pending(self) -> None:
        """Drop every partial sum waiting for the step's reduction, as a `zero_grad` does (each rank calls it).

        `.grad` is left as it was before the step's first backward; the next backward starts a new step."""
        if self._backward_task is not None:
            raise RuntimeError("shardnorm: discard_pending was called inside a backward pass; call it between steps")
        self._finish_per_layer()
        for s in self._slots.values():
            if s.touched or s.stashed:
                s.drop()
        for b in self.buckets:
            b.dirty = False
        self.source.discard()
        self._left_pending = False
        release_step_check()

    # ---- called by sources, from backward ----------------------------------------------------------------

    def note_backward(self) -> None:
        """A grad for this reducer is being computed: the first call of a backward starts its bookkeeping
        (the end-of-backward callback, which finalizes unless accumulating)."""
        task = current_graph_task_id()
        if task != self._backward_task:  # the first grad of this backward pass
            self._begin_backward(task)

    def register(self, params: list, group) -> None:
        """Lay these parameters out now, in this order (harvested sources, whose params are known up front);
        parameters still on the meta device (torchtitan, HF's low-memory loading) at the first backward."""
        if any(local_tensor(p).is_meta for p in params):
            self._unmaterialized.append((list(params), group))
            return
        for p in params:
            self._slot(p, local_tensor(p), group)
        self._lay_out_staged()

    def add(self, params: list, grads: list[torch.Tensor], group) -> None:
        """Add one call's local fp32 weight/bias grads (partial sums over this rank's share of `group`), from
        inside a backward. The grads are kept (or reduced) here: whoever calls must not leave them in `.grad`."""
        self.note_backward()
        slots = [self._slot(p, g, group) for p, g in zip(params, grads)]
        for s in slots:
            s.count += 1
        if self.reduce == "per_layer":
            flat = torch.cat([g.reshape(-1) for g in grads])
            self._per_layer.append((self._all_reduce(flat, group, async_op=True), flat, slots))
            return
        for s, g in zip(slots, grads):
            if self._accumulate(s, g) and s.bucket is not None:
                s.bucket.pending -= 1
                if self._syncing and s.bucket.pending <= 0:
                    s.bucket.work = self._all_reduce(s.bucket.flat, s.bucket.group, async_op=True)

    def _accumulate(self, slot: _Slot, grad: torch.Tensor) -> bool:
        """Add `grad` to the slot's fp32 sum; False when its bucket was launched already (then it is kept
        aside and reduced on its own in finalize)."""
        slot.touched = True
        bucket = slot.bucket
        if bucket is not None and bucket.work is not None:
            self._late.append((slot, grad.reshape(-1).clone()))
            return False
        slot.data.add_(grad.reshape(-1))
        if bucket is not None:
            bucket.dirty = True
        return True

    def _slot(self, param, grad: torch.Tensor, group) -> _Slot:
        slot = self._slots.get(id(param))
        if slot is None:
            slot = self._slots[id(param)] = _Slot(param, group, grad.numel(), grad.device)
            self._staged.append(slot)
        elif slot.group is not group:
            raise ValueError(f"shardnorm: a norm parameter of shape {tuple(param.shape)} is reduced over "
                             f"two different process groups; use one reducer per shard group")
        return slot

    def _materialize(self) -> None:
        """Lay out what `register` got on the meta device, now that the model holds real storage."""
        pending, self._unmaterialized = self._unmaterialized, []
        for params, group in pending:
            if any(local_tensor(p).is_meta for p in params):
                raise RuntimeError("shardnorm: norm parameters are still on the meta device at the first backward; "
                                   "materialize the model (e.g. `model.to_empty(device=...)` and its weight init) "
                                   "before training")
            self.register(params, group)

    def _begin_backward(self, task: int) -> None:
        if self._unmaterialized:
            self._materialize()
        self._backward_task = task
        self._syncing = self.source.ends_step or not self.accumulating
        if self._syncing:  # the step's sums so far, as the user's zeroing left them, join this backward's
            self._unstash_all()
        for b in self.buckets:
            b.pending = sum(s.expected for s in b.slots)
        self.source.begin_backward()
        run = _BackwardRun()
        self._run = weakref.ref(run, functools.partial(_run_gone, weakref.ref(self)))
        queue_backward_callback(functools.partial(self._end_backward, run))

    def _end_backward(self, run: "_BackwardRun") -> None:
        self._backward_task, self._run = None, None
        for s in self._slots.values():
            if s.count:
                s.expected, s.count = s.count, 0
        if self._syncing:
            self.finalize()
        else:
            self._finish_per_layer()
            self._leave_for_the_step()

    def _abandon_backward(self) -> None:
        """The backward raised, and its end callback will never run. What it reduced (buckets launched with all
        their grads, per-layer reductions) goes to `.grad` as a step's end writes it; every other sum, this
        backward's and the step's earlier ones, waits in `.grad` as after an accumulating backward, so a step given up
        with `zero_grad` (as with torch's norms) leaves nothing behind, and a step that goes on includes them."""
        self._backward_task, self._run, self._syncing = None, None, False
        for s in self._slots.values():
            s.count = 0
        self._finish_per_layer()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
                b.work, b.dirty = None, False
                b.write_grads()
        late, self._late = self._late, []
        for s, g in late:
            self._accumulate(s, g)
        self._leave_for_the_step()

    def _leave_for_the_step(self) -> None:
        """A backward ended without ending the step: its sums wait in `.grad` (stashed) for the step's last backward
        or `finalize_grads`, and until then an optimizer step over them is refused."""
        self._lay_out_staged()
        for b in self.buckets:
            b.stash()
        self.source.end_backward()
        self.note_pending()

    def note_pending(self) -> None:
        """Sums wait for the step's last backward or `finalize_grads` (an accumulating backward's, or a source's
        between its framework's boundaries): until they are reduced or discarded, an optimizer step over them is
        refused (`release_step_check` reads this reducer's note)."""
        self._left_pending = True
        arm_step_check()

    def _unstash_all(self) -> None:
        """Every stashed sum back into the buckets (only laid-out slots are ever stashed: `_end_backward`)."""
        for b in self.buckets:
            b.unstash()

    # ---- reduction -----------------------------------------------------------------------------------

    def _all_reduce(self, flat: torch.Tensor, group, async_op: bool = False):
        """Every collective of the reducer goes through here, and is counted."""
        self.collectives += 1
        return dist.all_reduce(flat, group=group, async_op=async_op)

    def _finish_per_layer(self) -> None:
        for work, flat, slots in self._per_layer:
            work.wait()
            _add_into(slots, flat)
        self._per_layer.clear()

    def _lay_out_staged(self) -> None:
        """Give staged slots their place: one flat buffer per group, cut into buckets in arrival order."""
        by_group: dict[object, list[_Slot]] = {}
        for s in self._staged:
            by_group.setdefault(s.group, []).append(s)
        self._staged.clear()
        for group, slots in by_group.items():
            flat = torch.cat([s.data for s in slots])
            start = offset = 0
            members: list[_Slot] = []
            for s in slots:
                n = s.data.numel()
                if members and (offset + n - start) * 4 > self.bucket_cap_bytes:
                    self._add_bucket(group, flat[start:offset], members)
                    start, members = offset, []
                s.data = flat[offset:offset + n]
                members.append(s)
                offset += n
            self._add_bucket(group, flat[start:offset], members)

    def _add_bucket(self, group, flat: torch.Tensor, slots: list[_Slot]) -> None:
        bucket = _Bucket(group, flat, slots)
        bucket.dirty = any(s.touched for s in slots)
        for s in slots:
            s.bucket = bucket
        self.buckets.append(bucket)

    def _reduce_late(self) -> list[tuple[list[_Slot], torch.Tensor]]:
        """All-reduce the grads that arrived after their bucket was launched: one collective per group."""
        by_group: dict[object, list[tuple[_Slot, torch.Tensor]]] = {}
        for s, g in self._late:
            by_group.setdefault(s.group, []).append((s, g))
        self._late.clear()
        reduced = []
        for group, items in by_group.items():
            flat = torch.cat([g for _, g in items])
            self._all_reduce(flat, group)
            reduced.append(([s for s, _ in items], flat))
        return reduced

    @torch.no_grad()
    def finalize(self) -> None:
        """Take in what the source holds, reduce whatever has not been reduced yet, wait for all of it, and
        add it to `.grad`. Idempotent."""
        if self._unmaterialized:
            self._materialize()
        self._unstash_all()
        for param, partial in self.source.harvest():
            self._accumulate(self._slots[id(param)], partial)
        self._finish_per_layer()
        self._lay_out_staged()
        if self.reduce == "bucketed":
            for b in self.buckets:
                if b.dirty and b.work is None:
                    b.work = self._all_reduce(b.flat, b.group, async_op=True)
        late = self._reduce_late()
        for b in self.buckets:
            if b.work is not None:
                b.work.wait()
            b.work, b.dirty = None, False
        for slots, flat in late:
            _add_into(slots, flat)
        for b in self.buckets:
            b.write_grads()
        self._left_pending = False
        release_step_check()


class _BackwardRun:
    """A backward a reducer takes part in, held by the end callback queued on its graph task: it goes with that
    task, so gone while still the reducer's run means the backward raised before its end."""

    __slots__ = ("__weakref__",)


def _run_gone(reducer_ref, run_ref) -> None:
    reducer = reducer_ref()
    if reducer is not None and reducer._run is run_ref:
        reducer._abandon_backward()


_REDUCERS: "weakref.WeakSet[NormGradReducer]" = weakref.WeakSet()
_step_check = None  # the handle of torch.optim's global step pre-hook while some reducer holds pending grads


def arm_step_check() -> None:
    """A reducer now holds grads accumulated for a step (`accumulate`): until none does, torch.optim's global step
    pre-hook refuses a step over them. Only then: a process whose reducers hold nothing pending, and every process
    without one, keeps its optimizers as torch leaves them."""
    global _step_check
    if _step_check is None:
        _step_check = register_optimizer_step_pre_hook(_refuse_pending_step)


def release_step_check() -> None:
    """The hook goes as soon as no reducer is left with sums by an accumulating backward (finalized or discarded;
    read on the host), not at the next optimizer step: while it is there a compiled optimizer step breaks its graph
    on it, and every optimizer of the process runs it."""
    global _step_check
    if _step_check is not None and not any(r._left_pending for r in list(_REDUCERS)):
        _step_check.remove()
        _step_check = None


def _refuse_pending_step(optimizer, args, kwargs) -> None:
    """No step over norm parameters whose partial sums are still pending; the hook goes once nothing is pending
    (finalized, discarded or zeroed)."""
    global _step_check
    pending = [reducer for reducer in list(_REDUCERS) if reducer.has_pending]
    if not pending and _step_check is not None:
        _step_check.remove()
        _step_check = None
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]} if pending else set()
    for reducer in pending:
        if not stepped.isdisjoint(reducer._slots):
            raise RuntimeError(
                "shardnorm: optimizer.step() over norm parameters whose grads are still accumulating: the norm "
                "grads are not reduced yet (the step's last backward ran inside shardnorm.accumulate(model)). "
                "Run the last micro-batch's backward outside accumulate, or call "
                "shardnorm.finalize_grads(model) before clipping and stepping; shardnorm.discard_pending(model) "
                "drops them")


def _as_grad(param, values: torch.Tensor) -> torch.Tensor:
    """`values` (this rank's part of `param` in its dtype, any shape of its numel) shaped and placed as `param`'s
    grad: a DTensor with the param's own spec (`DTensor.from_local` builds and checks a new one: ~6x the host time)."""
    if isinstance(param, DTensor):
        return dtensor_with_spec(values.view(dtensor_local(param).shape), dtensor_spec_of(param))
    return values.view(param.shape)



def _add_into(slots: list[_Slot], flat: torch.Tensor) -> None:
    """Add consecutive pieces of `flat` into `slots`."""
    offset = 0
    for s in slots:
        s.data.add_(flat[offset:offset + s.data.numel()])
        s.touched = True
        offset += s.data.numel()


def _accumulate_grad(param, data: torch.Tensor) -> None:
    """Add the reduced fp32 sum to param.grad in the param's dtype and placement."""
    if param.grad is None:
        param.grad = _as_grad(param, data.to(param.dtype, copy=True))
    elif not isinstance(param.grad, DTensor) or param.grad.placements == param.placements:  # this rank's part
        local = local_tensor(param.grad)
        # fp32 `data` into a bf16 .grad: added in fp32, rounded once (DTensor's add_: ~40x the host time of this)
        local.add_(data.view(local.shape))
    else:
        param.grad.add_(_as_grad(param, data.to(param.dtype, copy=True)))
