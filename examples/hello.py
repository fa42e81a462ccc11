"""All-reduce on every live backend: `mcrdl run -n 2 examples/hello.py`."""
import torch

import mcrdl

mcrdl.init_process_group()
rank, size = mcrdl.get_rank(), mcrdl.get_world_size()
expected = size * (size + 1) / 2
on_cpu = mcrdl.live_backends("cpu")
for name, status in mcrdl.available_backends().items():
    if status != "live":
        if rank == 0:
            print(f"{name:5s} not live: {status}")
        continue
    if name in on_cpu:
        device = torch.device("cpu")
    elif torch.cuda.device_count() >= mcrdl.get_local_size():  # NCCL: one GPU per rank
        device = torch.device("cuda", mcrdl.get_local_rank())
    else:
        if rank == 0:
            print(f"{name:5s} live, but needs a GPU per rank ({torch.cuda.device_count()} here)")
        continue
    t = torch.full((4,), float(rank + 1), device=device)
    mcrdl.all_reduce(t, backend=name)
    assert torch.all(t == expected), (name, t)
    print(f"rank {rank}/{size} {name:5s} all_reduce on {device.type} -> {t.tolist()}")
mcrdl.destroy_process_group()
