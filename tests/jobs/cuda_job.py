"""CUDA paths (one GPU per rank): NCCL ops, and program order between
NCCL work and a CPU backend on data produced by CUDA kernels."""
import torch

import mcrdl
from common import check, reduced, value

mcrdl.init_process_group(timeout=120)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
dev = torch.device("cuda", mcrdl.get_local_rank() % torch.cuda.device_count())
torch.cuda.set_device(dev)
check(mcrdl.available_backends()["nccl"] == "live", mcrdl.available_backends())
for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int64):
    t = value(rank, 1 << 20, dtype).to(dev)
    mcrdl.all_reduce(t)  # CUDA tensor: selected backend must be able to take it
    check(torch.equal(t.cpu(), reduced(range(world), 1 << 20, dtype, "sum")), "nccl all_reduce", dtype)
    out = torch.empty(world * 1000, dtype=dtype, device=dev)
    mcrdl.all_gather_into_tensor(out, value(rank, 1000, dtype).to(dev), backend="nccl")
    check(torch.equal(out.cpu(), torch.cat([value(r, 1000, dtype) for r in range(world)])), "all_gather", dtype)
# A kernel writes x, NCCL reduces it asynchronously, the result is copied to the
# CPU and reduced again on MPI/gloo: every step must see the previous one.
for cpu_backend in [b for b in ("mpi", "gloo") if mcrdl.available_backends()[b] == "live"]:
    x = torch.ones(1 << 22, device=dev)
    x.mul_(rank + 1)  # producer kernel on the current stream
    w = mcrdl.all_reduce(x, backend="nccl", async_op=True)
    w.wait()
    host = x.cpu()
    mcrdl.all_reduce(host, backend=cpu_backend)
    expected = world * sum(r + 1 for r in range(world))
    check(bool((host == expected).all()), "nccl then", cpu_backend, host[:4])
# Stream order, not host waits: NCCL ops queued behind a long kernel return (a
# blocking one, and an async one's wait()) before the kernel ends, as torch's
# do; their results are right once the stream gets there.
y = torch.full((1024,), float(rank + 1), device=dev)
torch.cuda._sleep(1_000_000_000)  # about 0.5 s of GPU time ahead of the ops
mcrdl.all_reduce(y, backend="nccl")
mcrdl.all_reduce(y, backend="nccl", async_op=True).wait()
queued = torch.cuda.Event()
queued.record()
check(not queued.query(), "an NCCL op made the host wait for the GPU")
check(bool((y == world * sum(r + 1 for r in range(world))).all()), "nccl behind a kernel", y[:4])
mcrdl.destroy_process_group()
print(f"rank {rank}: CUDA OK")
