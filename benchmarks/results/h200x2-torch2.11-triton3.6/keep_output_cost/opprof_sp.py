"""torch.profiler op tables (every host thread, the autograd engine's included) of sp_step's eager step, option off/on."""
import argparse, os, time, statistics
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import profile, ProfilerActivity
from benchmarks import sp_step

def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank)
    mesh = init_device_mesh("cuda", (world,))
    args = argparse.Namespace(dim=4096, ffn=11008, seq=4096, layers=4, compile=False, device="cuda",
                              dtype=torch.bfloat16, inductor={})
    g = torch.Generator().manual_seed(0)
    ls = args.seq // world
    xs = [torch.randn(1, args.seq, args.dim, generator=g)[:, rank*ls:(rank+1)*ls].contiguous().cuda().bfloat16() for _ in range(2)]
    out = os.environ["OUT"]
    for variant in ("shardnorm", "shardnorm_discard"):
        model = sp_step.build(variant, args, mesh, 1)
        opt = torch.optim.SGD(model.parameters(), lr=1e-6)
        for _ in range(3): sp_step.step(model, variant, xs, opt)
        torch.cuda.synchronize(); dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3): sp_step.step(model, variant, xs, opt)
            torch.cuda.synchronize()
        if rank == 0:
            ka = prof.key_averages()
            open(f"{out}/ops_{variant}.txt", "w").write(ka.table(sort_by="self_cpu_time_total", row_limit=70, max_name_column_width=70))
            prof.export_chrome_trace(f"{out}/trace_{variant}.json")
        del model, opt; torch.cuda.empty_cache()
    dist.destroy_process_group()
main()
