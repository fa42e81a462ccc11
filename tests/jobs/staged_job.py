"""Host-staged MPI's staging, on CPU tensors (no GPU here): a subclass that
declares CPU tensors runs every op through separate host buffers, copies in
and back, and the start queue. Then the whole op matrix on it."""
import runpy
import sys
from pathlib import Path

import torch

import mcrdl
from common import check, reduced, value
from mcrdl.backends.mpi import MPIBackend
from mcrdl.backends.mpi_staged import StagedMPIBackend, StagedPending

NAME = "mpi_staged_cpu"


@mcrdl.register_backend
class StagedOnCPU(StagedMPIBackend):
    """The staged backend with CPU tensors on the device side (CUDA's copies
    become plain copies, its events are done at once)."""
    name = NAME
    devices = frozenset({"cpu"})

    @classmethod
    def unavailable_reason(cls, ctx):
        return MPIBackend.unavailable_reason(ctx)


mcrdl.init_process_group(timeout=60)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
staged = mcrdl.api._rt().backends[NAME]
peer = (rank + 1) % world

# MPI sees host buffers, never the caller's memory: the pending op holds copies
t = value(rank, 1000, torch.float32)
work = mcrdl.all_reduce(t, backend=NAME, async_op=True)
pending = work._pending
check(isinstance(pending, StagedPending), "not staged:", type(pending))
(dev, host, copy_in, copy_back), = pending.entries
check(dev.data_ptr() == t.data_ptr() and host.data_ptr() != t.data_ptr() and copy_in and copy_back,
      "all_reduce stages the tensor in and back")
work.wait()
check(torch.equal(t, reduced(range(world), 1000, torch.float32, "sum")), "staged all_reduce result")
check(not staged.queue, "nothing left unstarted", len(staged.queue))

# a root's broadcast input is copied in, the others' outputs back, not the reverse
t = value(rank, 10, torch.float32)
work = mcrdl.broadcast(t, src=0, backend=NAME, async_op=True)
(_, _, copy_in, copy_back), = work._pending.entries
check((copy_in, copy_back) == ((True, False) if rank == 0 else (False, True)), "broadcast directions", copy_in,
      copy_back)
work.wait()
check(torch.equal(t, value(0, 10, torch.float32)), "staged broadcast result")

# program order against other backends on the same tensor: staged, then mpi, then gloo
t = value(rank, 64, torch.float32)
first = mcrdl.all_reduce(t, backend=NAME, async_op=True)
mcrdl.all_reduce(t, backend="mpi")  # waits for the staged op (same tensor), then doubles again
mcrdl.all_reduce(t, backend="gloo")
check(first.is_completed(), "the staged op finished before the next op on its tensor")
check(torch.equal(t, reduced(range(world), 64, torch.float32, "sum") * world * world), "staged -> mpi -> gloo order")

# several staged ops outstanding at once (one FIFO), waited for in reverse
ts = [value(rank, 16, torch.float32, salt=i) for i in range(5)]
works = [mcrdl.all_reduce(x, backend=NAME, async_op=True) for x in ts]
for w in reversed(works):
    w.wait()
for i, x in enumerate(ts):
    check(torch.equal(x, reduced(range(world), 16, torch.float32, "sum", salt=i)), "outstanding staged op", i)

# point to point: a receive from any source names its sender
if world > 1:
    buf = torch.empty(8)
    if rank == 0:
        for _ in range(world - 1):
            work = mcrdl.irecv(buf, src=None, tag=9, backend=NAME)
            work.wait()
            src = work.source_rank()
            check(0 < src < world and torch.equal(buf, value(src, 8, torch.float32)), "any-source", src, buf)
    else:
        mcrdl.send(value(rank, 8, torch.float32), 0, tag=9, backend=NAME)

# a receive nobody sends to fails at the group's deadline and is withdrawn
small = mcrdl.new_group(list(range(world)), timeout=2)
if world > 1 and rank == 1:
    try:
        mcrdl.recv(torch.empty(4), 0, group=small, tag=77, backend=NAME)
        check(False, "a receive with no sender completed")
    except mcrdl.CommTimeoutError as exc:
        check(NAME in str(exc), "timeout names the backend:", exc)
mcrdl.barrier()
mcrdl.destroy_process_group()
print(f"rank {rank}: staging checks OK")

sys.argv = [str(Path(__file__).parent / "ops_job.py"), NAME]
runpy.run_path(sys.argv[0], run_name="__main__")
