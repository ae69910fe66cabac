"""Where a reducer's partial sums come from: the one input of `NormGradReducer` that differs per setup.

Pushed: handed to `reducer.add` as computed (`NormBackward`: the norms' own backward, through grad sinks).
Harvested (`GradAttributeSource`): left in `param.grad`, and at the step boundary the part not reduced yet is
taken out into the reducer's buffer (`PartialGrads`: DeepSpeed AutoTP's; `FSDPShardedGrads`: FSDP2's).

`REDUCER_ATTR` is set on the model (its reducer) and on the norm parameters a reducer owns, nothing else;
`SINK_ATTR` on those of them whose grads it is pushed. A norm all of whose parameters are pushed carries the
reducer too (`BOUND_REDUCER_ATTR`, `mark_bound`), and its parameters' sequence-parallel marks (`MARKS_ATTR`): its
forward raises where its parameters were replaced without theirs, and binding again puts the marks back.
"""

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from shardnorm.modules import BOUND_REDUCER_ATTR, REDUCER_ATTR

SINK_ATTR = "_shardnorm_grad_sink"  # the reducer's GradSink for a norm parameter it owns
GROUP_ATTR = "_shardnorm_group"  # a plain sequence-parallel parameter's group (process_group_sequence_parallel)
MARKS_ATTR = "_shardnorm_param_marks"  # a bound norm's {param name: {mark: value}} (`mark_bound`)
_MARKS = ("sequence_parallel", GROUP_ATTR)  # what parallelizing a norm puts on its parameters


class GradSource:
    """Base: a pushed source (it calls `reducer.add`) with nothing to harvest. The reducer calls `attach`
    once, from its constructor."""

    ends_step = False  # True: every backward the source reports ends the step, whatever `accumulate` says

    def attach(self, reducer) -> None:
        self.reducer = reducer

    def bind(self, params) -> None:
        """`attach_reducer` offers the model's norm parameters (call it again after re-parallelizing)."""

    def begin_backward(self) -> None:
        """The first grad of a backward reached the reducer."""

    def end_backward(self) -> None:
        """A backward that leaves its sums for a later harvest ended (inside `accumulate`, or one that raised):
        the user's code may change them before the next backward."""

    def discard(self) -> None:
        """Drop what the next harvest would take (`reducer.discard_pending`)."""

    def harvest(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """At the step boundary: (param, flat fp32 partial sum) not reduced yet, taken out of where it was."""
        return []

    @property
    def pending(self) -> bool:
        """Whether this source holds partial sums the next harvest would take."""
        return False


class NormBackward(GradSource):
    """shardnorm's norms push their fp32 dgamma/dbeta from their backward: each sequence-parallel norm parameter
    gets a grad sink (`NormGradReducer.sink`), which the norm's node gives the grad to instead of autograd giving it
    to the parameter (`distributed/dtensor.py`)."""

    def bind(self, params) -> None:
        for p in params:
            setattr(p, REDUCER_ATTR, self.reducer)
            group = token_group(p)
            if group is not None:
                setattr(p, SINK_ATTR, self.reducer.sink(p, group))
            elif hasattr(p, SINK_ATTR):
                delattr(p, SINK_ATTR)


def mark_bound(norm: nn.Module, reducer) -> None:
    """After `reducer`'s source bound the model's norm parameters: record the reducer on `norm` where every
    parameter its forward reads was given one of the reducer's sinks (the forward compares it with the
    parameters' own, `shardnorm.modules`), with their sequence-parallel marks; otherwise drop what an earlier
    binding recorded."""
    registered = dict(norm.named_parameters(recurse=False))
    bias_read = "bias" in registered or norm._rms or getattr(norm, "bias", None) is None  # else not a parameter
    if registered.get("weight") is not None and bias_read and all(
            getattr(p, REDUCER_ATTR, None) is reducer and grad_sink(p) is not None for p in registered.values()):
        norm.__dict__[BOUND_REDUCER_ATTR] = reducer
        norm.__dict__[MARKS_ATTR] = {name: {k: vars(p)[k] for k in _MARKS if k in vars(p)}
                                     for name, p in registered.items()}
    else:
        norm.__dict__.pop(BOUND_REDUCER_ATTR, None)
        norm.__dict__.pop(MARKS_ATTR, None)


def restore_marks(norm: nn.Module) -> None:
    """Put back on a bound norm's parameters the sequence-parallel marks that replacing them dropped (`model.to`,
    `load_state_dict(assign=True)`): a plain parameter without its group would be neither reduced nor accepted
    next to its DTensor input."""
    params = dict(norm.named_parameters(recurse=False))
    for name, marks in norm.__dict__.get(MARKS_ATTR, {}).items():
        p = params.get(name)
        if p is not None:
            for key, value in marks.items():
                if key not in vars(p) and (key != GROUP_ATTR or not isinstance(p, DTensor)):
                    setattr(p, key, value)


def token_group(param):
    """The process group over which `param`'s grads are partial sums: a `Replicate` DTensor's 1-D mesh (a
    `SequenceParallelNorm`'s tensor-parallel mesh), or the group `process_group_sequence_parallel` recorded on a
    plain parameter; None otherwise."""
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        return mesh.get_group() if mesh.ndim == 1 and all(p.is_replicate() for p in param.placements) else None
    return getattr(param, GROUP_ATTR, None)


def grad_sink(param):
    """The reducer's grad sink bound to a norm parameter (`NormBackward.bind`), or None."""
    return getattr(param, SINK_ATTR, None)


def local_tensor(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's part of `t`: a DTensor's local tensor; a plain tensor or None as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def follow_grad_change(written: torch.Tensor, now: torch.Tensor, *parts: tuple) -> list[torch.Tensor]:
    """Each of `parts`, (a share of the values `written` into a `.grad`, its value where `written` gives no
    ratio), as the user's change of that `.grad` from `written` to `now` leaves it, elementwise (flat fp32): as it
    was where the grad is unchanged, scaled alike where the user scaled it (zeroed: by 0), and the given value
    where the written value is 0, NaN or Inf (an overflowed micro-batch's), which no ratio carries over. No version
    counter tells the change: `torch._foreach_zero_` (a foreach or fused optimizer's zero_grad) and `.data` bump
    none."""
    same = now == written
    scaled = (written != 0) & written.isfinite()
    ratio = torch.where(scaled, now / written, 0.0)
    return [torch.where(same, part, torch.where(scaled, ratio * part, unscalable)) for part, unscalable in parts]


class GradAttributeSource(GradSource):
    """Partial sums that accumulate in `param.grad` over `group` (so a `zero_grad` drops them), harvested at the
    step boundary. A subclass says which params hold unreduced grads (`_unreduced`) and what part of their
    `.grad` was reduced already (`_base`)."""

    def __init__(self, params: list[nn.Parameter], group):
        self.params, self.group = list(params), group

    def attach(self, reducer) -> None:
        super().attach(reducer)
        reducer.register(self.params, self.group)

    def _unreduced(self) -> list[nn.Parameter]:
        raise NotImplementedError

    def _base(self, param) -> torch.Tensor | None:
        """The flat fp32 part of `param.grad` that is reduced already (None: nothing)."""
        return None

    def _forget(self) -> None:
        """The harvest took everything."""

    def discard(self) -> None:
        """`.grad` back to its reduced part (None where nothing was reduced)."""
        for p in self._unreduced():
            base = self._base(p)
            if base is None:
                p.grad = None
            else:
                local = local_tensor(p.grad)
                local.copy_(base.view_as(local))
        self._forget()

    def harvest(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        taken = []
        for p in self._unreduced():
            local = local_tensor(p.grad)
            if local is None:  # reduced as zeros: another rank may hold a grad for it
                taken.append((p, torch.zeros(local_tensor(p).numel(), dtype=torch.float32, device=p.device)))
                continue
            base = self._base(p)
            partial = local.reshape(-1).to(torch.float32, copy=True)
            if base is None:
                local.zero_()
            else:
                partial -= base
                local.copy_(base.view_as(local))
            taken.append((p, partial))
        self._forget()
        return taken


class PartialGrads(GradAttributeSource):
    """A hook leaves each rank's local partial sums in `.grad` (all of it unreduced). A backward for which
    `boundary()` is true (DeepSpeed's `engine.is_gradient_accumulation_boundary`) ends the step, `accumulate`
    or not: its end harvests every param, zeros where `.grad` is None, so each rank reduces the same buckets."""

    ends_step = True

    def __init__(self, params: list[nn.Parameter], group, *, boundary=lambda: True):
        super().__init__(params, group)
        self.boundary = boundary
        self._pending = False

    def attach(self, reducer) -> None:
        super().attach(reducer)
        for p in self.params:
            p.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        self._pending = True
        if self.boundary():
            self.reducer.note_backward()
        else:
            self.reducer.note_pending()

    @property
    def pending(self) -> bool:
        return self._pending and any(p.grad is not None for p in self.params)  # zero_grad(set_to_none) drops

    def _unreduced(self) -> list[nn.Parameter]:
        return self.params if self._pending else []

    def _forget(self) -> None:
        self._pending = False

