"""DDP on CUDA tensors through mcrdl, against the same training over a plain
torch gloo group on the CPU: (1) the "mcrdl" torch backend as DDP's group,
(2) DDP on a gloo group with mcrdl's communication hooks. Ranks may share a
GPU: NCCL is then left out (it refuses two ranks on one GPU) and the CUDA
gradients go through host-staged MPI; with a GPU per rank they go to NCCL."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mcrdl
import mcrdl.integrations.torch_backend as tb
from common import check
from mcrdl.integrations import ddp_hook
from mcrdl.rank_env import torchrun_env

STEPS = 5
shared_gpu = torch.cuda.device_count() < int(torchrun_env(os.environ)["LOCAL_WORLD_SIZE"])
backends = ["mpi", "mpi_staged", "gloo"] if shared_gpu else None
tb.init_process_group(mcrdl_options={"backends": backends, "comms_log": True, "timeout": 120})
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", mcrdl.get_local_rank() % torch.cuda.device_count())
torch.cuda.set_device(dev)
gloo = dist.new_group(backend="gloo")
target = torch.randn(32, 4, generator=torch.Generator().manual_seed(7))


def train(device, group, hook=None):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4)).to(device)
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.01)  # several buckets
    if hook:
        ddp_hook.register(ddp, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        x = x.to(device)
        loss = nn.functional.mse_loss(ddp(x), torch.tanh(x @ target.to(device)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).cpu()


reference = train("cpu", gloo)
for label, group, hook in (("mcrdl torch backend", dist.group.WORLD, None),
                           ("mcrdl allreduce hook", gloo, "allreduce"),
                           ("mcrdl polled hook", gloo, "polled")):
    mark = len(mcrdl.comms_records())
    params = train(dev, group, hook)
    ran = sorted({(r.op, r.backend) for r in mcrdl.comms_records()[mark:]})
    check(any(op == "all_reduce" for op, _ in ran), label, "sent no all_reduce through mcrdl:", ran)
    check(all(b != "gloo" for op, b in ran if op == "all_reduce"), label, "all-reduced CUDA tensors on gloo", ran)
    diff = (params - reference).abs().max().item()
    check(torch.allclose(params, reference, rtol=1e-4, atol=1e-5), label, "differs from gloo on the CPU by", diff)
    if rank == 0:
        print(f"{label}: {', '.join(f'{op} on {b}' for op, b in ran)}; max |param - cpu gloo| {diff:.2e}")
dist.destroy_process_group()
print(f"rank {rank}: CUDA DDP OK")
