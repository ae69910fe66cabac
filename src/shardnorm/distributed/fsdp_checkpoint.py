"""`torch.distributed.checkpoint` save/load for FSDP models with shardnorm norms. A checkpoint holds no grads,
so `save` between the micro-batches of a step, which would drop those accumulated so far, refuses on every rank.
"""

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FSDPModule

from shardnorm._torch_compat import fsdp_param_fqn, fsdp_param_holds_unreduced_grad, fsdp_params
from shardnorm.distributed.accumulation import reducer_of
from shardnorm.distributed.grad_sources import local_tensor


def _nonzero(grad) -> bool:
    if grad is None:
        return False
    return bool(local_tensor(grad).count_nonzero())


def pending_grads(model: nn.Module) -> list[str]:
    """What on this rank holds accumulated grads that a checkpoint would lose (parameter names)."""
    pending = [name for name, p in model.named_parameters() if _nonzero(p.grad)]
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        for fsdp_param in fsdp_params(module):
            if fsdp_param_holds_unreduced_grad(fsdp_param):
                pending.append(f"{fsdp_param_fqn(fsdp_param)} (FSDP no-sync grad)")
    reducer = reducer_of(model)
    if reducer is not None and reducer.has_pending:
        pending.append("shardnorm's norm-grad buffer")
    return pending


def _refuse_if_pending(model: nn.Module) -> None:
    pending = pending_grads(model)
    flag = torch.tensor([len(pending)], dtype=torch.int64)
    if dist.is_initialized():  # every rank raises, or none: no rank left waiting in dcp.save
        device = next(model.parameters()).device
        flag = flag.to(device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        shown = ", ".join(pending[:4]) + (" ..." if len(pending) > 4 else "") if pending else "on another rank"
        raise RuntimeError(f"shardnorm: refusing to checkpoint in the middle of gradient accumulation: "
                           f"accumulated grads would be lost ({shown}); save after optimizer.step() and "
                           f"optimizer.zero_grad()")


def _state(model: nn.Module, optimizer, extra: dict | None) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer or [])
    return {"model": model_state, **({"optim": optim_state} if optimizer else {}), **(extra or {})}


def save(checkpoint_id, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None) -> None:
    """Save the sharded model (and optimizer) state with DCP; `extra`: more state (e.g. a scheduler)."""
    _refuse_if_pending(model)
    dcp.save(_state(model, optimizer, extra), checkpoint_id=checkpoint_id)


def load(checkpoint_id, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
         extra: dict | None = None) -> None:
    """Load in place what `save` wrote into a model sharded the same way (and its optimizer, `extra`)."""
    state = _state(model, optimizer, extra)
    dcp.load(state, checkpoint_id=checkpoint_id)
    set_state_dict(model, optimizer or [], model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}))
