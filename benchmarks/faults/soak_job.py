"""One short mixed-backend job ending one way (benchmarks/faults/soak.py).

Usage: soak_job.py ROUTE ENDING OUTSTANDING MARKDIR
ROUTE: api (mcrdl.init_process_group) | torch (torch.distributed's
init_process_group("mcrdl") and a DDP step: torch's wrapper holds mcrdl's
world group past the end, as in any framework). ENDING: destroy
(destroy_process_group, exit 0) | atexit (return; the exit handler cleans up)
| exception (every rank raises: exit code 1) | sigterm (wait for soak.py to
SIGTERM `mcrdl run`). OUTSTANDING: 1 leaves async work on gloo and MPI
unwaited at the end, 0 waits for everything. Each rank creates
MARKDIR/ready<rank> once its work is done."""
import os
import sys
import time

import torch
import torch.distributed as dist

import mcrdl

route, ending, outstanding, markdir = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
if route == "torch":
    dist.init_process_group("mcrdl", timeout=__import__("datetime").timedelta(seconds=60))
else:
    mcrdl.init_process_group(timeout=60)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
works = []
for step in range(20):
    for backend in ("mpi", "gloo"):
        x = torch.full((256 << (step % 6),), float(rank))
        works.append(mcrdl.all_reduce(x, backend=backend, async_op=True))
        out = torch.empty(world * 64)
        works.append(mcrdl.all_gather_into_tensor(out, torch.ones(64), backend=backend,
                                                  async_op=True))
    mcrdl.broadcast(torch.ones(1000), src=step % world, backend="gloo" if step % 2 else "mpi")
for w in works:
    w.wait()
if route == "torch":
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4))
    model(torch.ones(2, 8)).sum().backward()
    dist.all_reduce(torch.ones(16))
if outstanding:  # left for the ending to deal with
    works = [mcrdl.all_reduce(torch.ones(1 << 16), backend=b, async_op=True) for b in ("gloo", "mpi")]
open(os.path.join(markdir, f"ready{rank}"), "w").close()
if ending == "destroy":
    (dist.destroy_process_group if route == "torch" else mcrdl.destroy_process_group)()
elif ending == "exception":
    raise RuntimeError(f"rank {rank}: the user's code failed (on purpose)")
elif ending == "sigterm":
    time.sleep(120)
