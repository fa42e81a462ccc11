"""The one-word switch: plain ``torch.distributed.init_process_group("mcrdl", init_method=ARG)``
with no mcrdl import (torch's autoload registers the backend), under `mcrdl run` or spawned by
hand (MPI and gloo live either way: by hand, mcrdl starts MPI over torch's store). Checks what frameworks call beyond the plain collectives:
any-source receives, monitored_barrier, sparse all_reduce, all_gather_coalesced, object
collectives, batch_isend_irecv, the coalescing manager, functional collectives."""
import os
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import verdicts
from common import check

warnings.simplefilter("ignore", FutureWarning)
warnings.simplefilter("ignore", UserWarning)
init = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
check("mcrdl" not in sys.modules, "no mcrdl import before init")
dist.init_process_group("mcrdl", init_method=init, rank=rank, world_size=world)
import mcrdl  # noqa: E402 - only to see what runs underneath
from mcrdl.backends import OPS  # noqa: E402  (the libraries that have every op)

check(dist.get_backend() == "mcrdl" and (mcrdl.get_rank(), mcrdl.get_world_size()) == (rank, world),
      "identity")
check(mcrdl.live_backends(ops=OPS) == ["mpi", "gloo"], "MPI and gloo live, whoever started us",
      mcrdl.available_backends())
others = [r for r in range(world) if r != rank]
pg = dist.group.WORLD

# receives from any source, through torch and on every live mcrdl backend
if rank == 0:
    got = sorted(dist.recv(torch.zeros(3)) for _ in others)
    check(got == list(range(1, world)), "recv(src=None) senders", got)
else:
    dist.send(torch.full((3,), float(rank)), 0)
dist.barrier()
if rank == 0:
    t = torch.zeros(3)
    work = dist.irecv(t)
    work.wait()
    check(t[0].item() == work._source_rank() == world - 1, "irecv(src=None)", t, work._source_rank())
    for b in mcrdl.live_backends(ops=OPS):
        t = torch.zeros(2)
        src = mcrdl.recv(t, None, backend=b)
        check(t.tolist() == [float(src)] * 2 and src == world - 1, "mcrdl any-source recv on", b, t, src)
elif rank == world - 1:
    dist.send(torch.full((3,), float(rank)), 0)
    for b in mcrdl.live_backends(ops=OPS):
        mcrdl.send(torch.full((2,), float(rank)), 0, backend=b)

# sparse all_reduce (gloo's semantics: SUM, in place)
idx = torch.tensor([[0, rank % 3], [rank, 0]])
sparse = torch.sparse_coo_tensor(idx, torch.tensor([1.0, 2.0]), (3, world))
dist.all_reduce(sparse)
want = torch.zeros(3, world)
for r in range(world):
    want[0, r] += 1
    want[r % 3, 0] += 2
check(torch.equal(sparse.to_dense(), want), "sparse all_reduce", sparse.to_dense(), want)

# all_gather_coalesced: outputs[r][i] is rank r's input i
outs = [[torch.zeros(2), torch.zeros(3)] for _ in range(world)]
dist.all_gather_coalesced(outs, [torch.full((2,), float(rank)), torch.full((3,), 10.0 + rank)])
check(all(outs[r][0].tolist() == [float(r)] * 2 and outs[r][1].tolist() == [10.0 + r] * 3
          for r in range(world)), "all_gather_coalesced", outs)

# object collectives, batch_isend_irecv, coalescing manager, functional collectives
objs = [None] * world
dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
check(objs == [{"rank": r, "s": "x" * r} for r in range(world)], "all_gather_object", objs)
box = [{"from": 0}] if rank == 0 else [None]
dist.broadcast_object_list(box, src=0)
check(box == [{"from": 0}], "broadcast_object_list", box)
right, left = (rank + 1) % world, (rank - 1) % world
inbox = torch.zeros(4)
ops = [dist.P2POp(dist.isend, torch.full((4,), float(rank)), right),
       dist.P2POp(dist.irecv, inbox, left)]
for w in dist.batch_isend_irecv(ops):
    w.wait()
check(inbox.tolist() == [float(left)] * 4, "batch_isend_irecv", inbox)
a, b = torch.ones(3) * rank, torch.ones(2) * (rank + 1)
with dist._coalescing_manager(async_ops=True) as cm:
    dist.all_reduce(a)
    dist.all_reduce(b)
cm.wait()
check(a.tolist() == [float(sum(range(world)))] * 3 and b.tolist() == [float(sum(range(1, world + 1)))] * 2,
      "coalescing manager", a, b)
import torch.distributed._functional_collectives as fc  # noqa: E402

total = fc.all_reduce(torch.full((2,), float(rank + 1)), "sum", pg)
check(total.tolist() == [float(sum(range(1, world + 1)))] * 2, "functional all_reduce", total)
gathered = fc.all_gather_tensor(torch.full((2,), float(rank)), 0, pg)
check(gathered.tolist() == [float(r) for r in range(world) for _ in range(2)], "functional all_gather", gathered)
fut = dist.all_reduce(torch.ones(2), async_op=True).get_future()
check(fut.wait()[0].tolist() == [float(world)] * 2, "Work.get_future", fut.value())
# monitored_barrier: passes when all arrive; names the rank that did not (last: as with gloo,
# a gloo receive that timed out closes its connection, so the ranks then sync on the store)
pg.monitored_barrier(timedelta(seconds=30), wait_all_ranks=True)
late = world - 1
dist.barrier()
if rank != late:
    start = time.monotonic()
    try:
        pg.monitored_barrier(timedelta(seconds=3))
        raise AssertionError("monitored_barrier passed without rank " + str(late))
    except RuntimeError as exc:
        want = (f"Rank {late} failed to pass monitoredBarrier" if rank == 0 else
                f"Rank {rank} successfully reached monitoredBarrier, but received errors")
        check(want in str(exc) and time.monotonic() - start < 20, "monitored_barrier error", exc)

store = dist.distributed_c10d._get_default_store()
store.add("done", 1)
store.wait(["all-done"] if rank else [], timedelta(seconds=60))
while rank == 0 and store.add("done", 0) < world:
    time.sleep(0.01)
if rank == 0:
    store.set("all-done", "1")
verdicts.finished("drop-in")
print(f"rank {rank}: DROP-IN OK ({init.split(':')[0]}, live {mcrdl.live_backends(ops=OPS)})")
