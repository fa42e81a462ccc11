"""Plain torch.distributed.init_process_group("mcrdl") with torch's env:// rendezvous
(torchrun, or RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set by hand): mcrdl starts
inside torch's backend creator, joins torch's TCPStore and starts MPI over it."""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import mcrdl
from mcrdl.backends import OPS  # the libraries that have every op
import mcrdl.integrations.torch_backend as tb
from common import check

check(not mcrdl.is_initialized(), "mcrdl not started yet")
tb.register()
dist.init_process_group("mcrdl")
rank, world = dist.get_rank(), dist.get_world_size()
check(mcrdl.is_initialized(), "the creator started mcrdl")
check((mcrdl.get_rank(), mcrdl.get_world_size()) == (rank, world), "identity agrees")
live = mcrdl.live_backends("cpu", ops=OPS)
check(live == ["mpi", "gloo"], "live backends", mcrdl.available_backends())
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)
check(t.tolist() == [float(sum(range(1, world + 1)))] * 5, "all_reduce", t)
outs = [torch.empty(2) for _ in range(world)]
dist.all_gather(outs, torch.full((2,), float(rank)))
check([o.tolist() for o in outs] == [[float(r)] * 2 for r in range(world)], "all_gather", outs)
torch.manual_seed(rank)
model = torch.nn.Linear(4, 3)
ddp = DDP(model)  # rank 0's weights are broadcast
ddp(torch.full((2, 4), float(rank))).sum().backward()
w = [torch.empty_like(model.weight) for _ in range(world)]
dist.all_gather(w, model.weight.detach())
check(all(torch.equal(x, w[0]) for x in w), "DDP synced the initial weights")
check(torch.allclose(model.bias.grad, torch.full((3,), 2.0)), "DDP averaged bias grad", model.bias.grad)
check(torch.allclose(model.weight.grad, torch.full((3, 4), 2.0 * sum(range(world)) / world)),
      "DDP averaged weight grad", model.weight.grad)
print(f"rank {rank}: TORCH BACKEND ENV OK")
dist.destroy_process_group()
