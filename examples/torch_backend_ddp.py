"""DDP through mcrdl as a torch.distributed backend: `mcrdl run -n 2 examples/torch_backend_ddp.py`
(or `mcrdl run --launcher torchrun -n 2 ...`; MCRDL_OP_BACKENDS / MCRDL_TUNING_TABLE apply).

torch.distributed calls and DistributedDataParallel run on the "mcrdl" group, so
mcrdl's selector picks the library for each gradient all-reduce. The same model
is trained again through a plain gloo group for comparison.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import mcrdl
import mcrdl.integrations.torch_backend as tb

STEPS = 5

# Starts mcrdl (rank/size from MPI here, from the env under torchrun) and makes
# the "mcrdl" group torch's default group, on a store under mcrdl's own.
# Equivalent: tb.register(); mcrdl.init_process_group(...);
#             dist.init_process_group("mcrdl", **tb.init_kwargs())
# Under torchrun a plain dist.init_process_group("mcrdl") after tb.register() also works.
tb.init_process_group(mcrdl_options={"comms_log": True})
rank, world = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")  # plain torch gloo, for comparison
target = torch.randn(32, 4, generator=torch.Generator().manual_seed(7))


def train(group):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.005)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    losses = []
    for step in range(STEPS):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        loss = nn.functional.mse_loss(ddp(x), torch.tanh(x @ target))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(round(loss.item(), 6))
    return losses, torch.cat([p.detach().flatten() for p in model.parameters()])


mark = len(mcrdl.comms_records())
losses, params = train(dist.group.WORLD)   # the default group: "mcrdl"
ran = sorted({(r.op, r.backend) for r in mcrdl.comms_records()[mark:]})
gloo_losses, gloo_params = train(gloo)
same = losses == gloo_losses and torch.allclose(params, gloo_params, rtol=0, atol=1e-6)
print(f"rank {rank}/{world}: losses {losses}; same as gloo: {same}")
if rank == 0:
    print("DDP's communication, as mcrdl ran it:", ", ".join(f"{op} on {b}" for op, b in ran))
    print(mcrdl.explain("all_reduce", 8 << 10))
dist.destroy_process_group()
