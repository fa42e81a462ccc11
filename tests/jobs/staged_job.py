"""Host-staged MPI's staging, on CPU tensors (no GPU here): a subclass that
declares CPU tensors runs every op through separate host buffers, copies in
and back, and the start queue. A second subclass's copies in land only after
a number of polls that differs per rank and per op, as CUDA events do: starts
are deferred and must still keep their order on every rank. Then the whole op
matrix on the first."""
import runpy
import sys
import threading
import time
from pathlib import Path

import torch

import mcrdl
import verdicts
from common import Lands, LandsAt, check, reduced, value
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


@mcrdl.register_backend
class LateCopies(StagedOnCPU):
    """Copies in land after 0-6 polls, in a different pattern on each rank;
    ``late``: the next one lands that many seconds after it was made (as its
    op's deadline starts, so the gap holds however slow the machine); ``fail``:
    the next one fails."""
    name = "mpi_staged_late"
    count, late, fail = 0, None, False

    def copy_in(self, pending):
        super().copy_in(pending)  # (copies at once: CPU)
        self.count += 1
        if self.late is not None:
            lands, self.late = LandsAt(time.monotonic() + self.late), None
            return lands
        lands = Lands((self.count * (3 if mcrdl.get_rank() % 2 else 5)) % 7, self.fail)
        self.fail = False
        return lands


mcrdl.init_process_group(timeout=60)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
staged = mcrdl.api.current_runtime().backends[NAME]
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

# a receive nobody sends to fails at the group's deadline; its tensor is left alone
small = mcrdl.new_group(list(range(world)), timeout=2)
engine = mcrdl.api.current_runtime().engine
if world > 1 and rank == 1:
    t = torch.full((4,), 12345.5)
    try:
        mcrdl.recv(t, 0, group=small, tag=77, backend=NAME)
        check(False, "a receive with no sender completed")
    except mcrdl.CommTimeoutError as exc:
        check(NAME in str(exc), "timeout names the backend:", exc)
    for _ in range(100):
        engine.poll()
    check(torch.equal(t, torch.full((4,), 12345.5)), "a cancelled receive wrote its tensor:", t)
    check(not engine._abandoned, "a cancelled receive is still polled:", engine._abandoned)
    # the same from any source (MPI reports no sender for a cancelled receive)
    try:
        mcrdl.recv(t, None, group=small, tag=78, backend=NAME)
        check(False, "a receive from any source with no sender completed")
    except mcrdl.CommTimeoutError:
        pass
    for _ in range(100):
        engine.poll()
    check(not engine._abandoned, "a cancelled any-source receive is still polled:", engine._abandoned)
mcrdl.barrier()

# deferred starts: copies in land late, differently per rank and op; collectives of
# different sizes must still start in submission order everywhere (else they cross),
# while another thread polls the engine as the futures thread does
LATE = "mpi_staged_late"
late = mcrdl.new_group(list(range(world)), timeout=20)
stop = threading.Event()
poller = threading.Thread(target=lambda: [engine.poll() for _ in iter(stop.is_set, True)], daemon=True)
poller.start()
for rnd in range(20):
    ts = [value(rank, 3 + 5 * i + rnd, torch.float32, salt=i) for i in range(6)]
    works = [mcrdl.all_reduce(x, group=late, backend=LATE, async_op=True) for x in ts[:3]]
    works.append(mcrdl.broadcast(ts[3], src=0, group=late, backend=LATE, async_op=True))
    works += [mcrdl.all_reduce(x, group=late, backend=LATE, async_op=True) for x in ts[4:]]
    for w in reversed(works):
        w.wait()
    for i, x in enumerate(ts):
        want = value(0, 3 + 5 * i + rnd, torch.float32, salt=i) if i == 3 else \
            reduced(range(world), 3 + 5 * i + rnd, torch.float32, "sum", salt=i)
        check(torch.equal(x, want), "deferred start out of order: round", rnd, "op", i)
stop.set()
poller.join()
check(Lands.not_yet > 100, "starts were not deferred:", Lands.not_yet)
# a wait on a receive that started must start the send queued behind it (the
# peer's receive waits for that send): no other thread polls now
if world > 1:
    for rnd in range(10):
        got = torch.empty(5)
        receive = mcrdl.irecv(got, (rank - 1) % world, group=late, tag=4, backend=LATE)
        send = mcrdl.isend(value(rank, 5, torch.float32, salt=rnd), peer, group=late, tag=4, backend=LATE)
        receive.wait()
        send.wait()
        check(torch.equal(got, value((rank - 1) % world, 5, torch.float32, salt=rnd)), "receive then send", rnd)
# a copy in that fails is its own op's failure; the op queued behind it still runs
be = mcrdl.api.current_runtime().backends[LATE]
be.fail = True
failing = be.send(late.handles[LATE], torch.ones(3), peer if world > 1 else 0, 9)
behind = be.barrier(late.handles[LATE])
try:
    failing.test()
    check(False, "a failed copy in went unreported")
except RuntimeError as exc:
    check("the copy to the host failed" in str(exc), exc)
while not behind.test():
    pass
# a send whose copy in lands after its deadline (no receive is posted) is not
# dropped from the queue (later messages would pair with the wrong receives):
# it starts then, is cancelled in MPI, and is let go once MPI is done with it
quick = mcrdl.new_group(list(range(world)), timeout=1)
mcrdl.api.current_runtime().backends[LATE].late = 1.5
try:
    mcrdl.send(torch.ones(2), peer, group=quick, tag=5, backend=LATE)
    check(False, "a send whose input reached the host late completed in time")
except mcrdl.CommTimeoutError:
    pass
until = time.monotonic() + 10
while engine._abandoned and time.monotonic() < until:
    engine.poll()
check(not engine._abandoned, "a cancelled op is still polled:", engine._abandoned)
mcrdl.barrier()
mcrdl.destroy_process_group()
verdicts.finished("staging checks")
print(f"rank {rank}: staging checks OK")

sys.argv = [str(Path(__file__).parent / "ops_job.py"), NAME]
runpy.run_path(sys.argv[0], run_name="__main__")
