"""Host us per call of the SP memory option's pieces on one GPU: 200 calls queued back to back (a sync before and
after), median of 5 rounds, best of 3. `python host_micro.py OUT` (PYTHONPATH=src:.; torchrun for the mesh rows)."""
import json, statistics, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

from shardnorm import _torch_compat, ops, output_checks
from shardnorm.kernels import fingerprint as fp_kernels
from shardnorm.distributed import sequence_gather

OUT = Path(sys.argv[1])
OUT.mkdir(parents=True, exist_ok=True)


def host_us(fn, calls=200):
    best = float("inf")
    for _ in range(3):
        meds = []
        for _ in range(5):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            meds.append((time.perf_counter() - t0) / calls * 1e6)
            torch.cuda.synchronize()
        best = min(best, statistics.median(meds))
    return best


def main():
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    mesh = init_device_mesh("cuda", (1,))
    group = mesh.get_group(0)
    x = torch.randn(1, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    xd = DTensor.from_local(x, mesh, (Replicate(),))
    x2 = x.view(-1, 4096)
    w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
    words = output_checks._words_4d(output_checks._words(x))
    rpb, bn = output_checks._blocks(words.shape[-1])
    out = torch.empty(words.shape[0] * words.shape[1] * words.shape[2] // rpb, device="cuda", dtype=torch.int32)
    launcher = fp_kernels._launchers.get((rpb, bn, 4))
    output_checks.fingerprint(x)
    launcher = fp_kernels._launchers[(rpb, bn, 4)]
    a = torch.zeros(8, device="cuda", dtype=torch.int32)
    small = [torch.zeros(1024, device="cuda", dtype=torch.int32) for _ in range(16)]
    rows = {
        "torch x.new_empty": lambda: x.new_empty(1024, dtype=torch.int32),
        "torch x.view(int32)": lambda: x.view(torch.int32),
        "torch x.detach()": lambda: x.detach(),
        "torch a.add_(1)": lambda: a.add_(1),
        "Launcher fingerprint (args ready)": lambda: launcher((out.numel(),), words, out, 2048, 2048, 1, 2048,
                                                              *words.stride()),
        "kernels.fingerprint(words)": lambda: fp_kernels.fingerprint(words, rpb, bn),
        "output_checks.fingerprint(x)": lambda: output_checks.fingerprint(x),
        "output_checks.fingerprint(DTensor)": lambda: output_checks.fingerprint(xd),
        "ops.recompute_output (rms, bf16)": lambda: ops.recompute_output(x2, w, None, 1e-6, True, False,
                                                                           torch.bfloat16),
        "kernels norm_fwd (rms)": lambda: ops._forward(x2, w, None, None, 1e-6, True, False),
        "current_graph_task_id": _torch_compat.current_graph_task_id,
        "all_gather_start+result (1 rank)": lambda: _torch_compat.collective_result(
            sequence_gather.start_gather(x, group)),
        "stack 16 + ne + any": lambda: torch.ne(torch.stack(small), torch.stack(small)).flatten(1).any(1),
    }
    res = {}
    for name, fn in rows.items():
        fn()
        res[name] = host_us(fn)
        print(f"{name:45s} {res[name]:8.1f} us", flush=True)
    (OUT / "host_micro.json").write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
