"""ZeRO stages 1, 2, 3 under shardnorm.deepspeed.initialize train exactly like plain torch.

One spawned 2-rank group runs every case (DeepSpeed start-up dominates the run time): 3 optimizer
steps of gradient accumulation 2, fresh random data, loss and parameters within 1e-5 of the same
model (torch.nn norms) trained with torch AdamW.
"""

import os

import pytest

from deepspeed_harness import (config_adamw, full_params, load_config, loss_fn, mean_over_ranks, micro_batches,
                               norm_model, rel_err, train_reference, use_test_device)
from multiprocess import spawn

deepspeed = pytest.importorskip("deepspeed")

STEPS, GAS, ROWS, TOL = 3, 2, 4, 1e-5

# (name, config file, changes to zero_optimization, changes to the shardnorm section, changes to the optimizer)
CASES = [
    ("zero1", "zero1.json", {}, {}, {}),
    ("zero2", "zero2.json", {}, {}, {}),
    ("zero3 partitioned norms", "zero3.json", {"stage3_param_persistence_threshold": 1}, {}, {}),
    ("zero3 default threshold", "zero3.json", {"stage3_param_persistence_threshold": None}, {}, {}),
    ("zero3 zero-centered gamma", "zero3.json", {"stage3_param_persistence_threshold": 1},
     {"zero_centered_gamma": True}, {"weight_decay": 0.0}),
]


def _config(file, zero, section, optimizer):
    config = load_config(file)
    config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"] = ROWS, GAS
    for key, value in zero.items():
        config["zero_optimization"].pop(key, None)
        if value is not None:
            config["zero_optimization"][key] = value
    config["shardnorm"].update(section)
    config["optimizer"]["params"].update(optimizer)
    return config


def _assert_gathered_in_forward(norms):
    """ZeRO-3 must hand every norm module its whole weight while it runs."""

    def check(module, args):
        assert module.weight.numel() == module.weight.ds_numel, "norm weight not gathered for forward"

    return [m.register_forward_pre_hook(check) for m in norms]


def _check_partitioning(name, zero, norms):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    for m in norms:
        w = m.weight
        if zero.get("stage3_param_persistence_threshold") == 1:
            assert not w.ds_persist and w.ds_status == ZeroParamStatus.NOT_AVAILABLE, name
            assert w.ds_tensor.numel() < w.ds_numel and w.numel() == 0, f"{name}: norm weight not partitioned"
        else:
            assert w.ds_persist, f"{name}: small norm weights persist under the default threshold"


def _run_case(rank, world_size, device, seed, name, file, zero, section, optimizer):
    import shardnorm.deepspeed as sd
    from shardnorm.deepspeed.conversion import shardnorm_modules

    config = _config(file, zero, section, optimizer)
    model = norm_model(seed).to(device)
    batches = micro_batches(seed + 1, STEPS, GAS, world_size, ROWS, (8,))
    reference, ref_losses = train_reference(model, config, batches, device, config_adamw(config))

    engine, *_ = sd.initialize(model=model, config=config, model_parameters=model.parameters())
    norms = shardnorm_modules(engine.module)
    assert len(norms) == 4, f"{name}: expected 4 converted norms, got {len(norms)}"
    hooks = _assert_gathered_in_forward(norms) if config["zero_optimization"]["stage"] == 3 else []
    losses = []
    for step in batches:
        for micro in step:
            x, target = (t.to(device) for t in micro[rank])
            loss = loss_fn(engine(x), target)
            engine.backward(loss)
            engine.step()
            losses.append(mean_over_ranks(loss.item(), device))
    for h in hooks:
        h.remove()

    for i, (got, want) in enumerate(zip(losses, ref_losses)):
        assert abs(got - want) <= TOL * abs(want), f"{name}: micro-batch {i} loss {got} vs torch {want}"
    got, want = full_params(engine.module), dict(reference.named_parameters())
    for key in want:
        assert rel_err(got[key], want[key]) <= TOL, f"{name}: {key} rel err {rel_err(got[key], want[key]):.2e}"
    if config["zero_optimization"]["stage"] == 3:
        _check_partitioning(name, zero, norms)
    engine.destroy()


def _body(rank, world_size, seed):
    device = use_test_device(rank)
    for i, case in enumerate(CASES):
        _run_case(rank, world_size, device, seed + 10 * i, *case)


@pytest.mark.distributed
@pytest.mark.deepspeed
def test_zero_stages_match_plain_torch():
    spawn(_body, 2, int.from_bytes(os.urandom(3), "little"))
