"""The MPI backend's stream-ordered starts (a CUDA-aware MPI's path for CUDA
tensors), on CPU: a subclass takes float64 tensors for device tensors whose
stream's work completes after a number of polls that differs per rank and per
op, as a CUDA event does. Their ops start late; ops on float32 tensors called
meanwhile, collectives and sends alike, must queue behind them, or ranks start
them in different orders and MPI matches the wrong calls. Then the whole op
matrix on it. Usage: ordered_job.py [late [VERDICT_DIR]]"""
import os
import runpy
import sys
import threading
import time
from pathlib import Path

import torch

import mcrdl
import verdicts
from common import Lands, LandsAt, check, reduced, value
from mcrdl.backends.mpi import DeferredPending, MPIBackend

NAME = "mpi_ordered_cpu"


@mcrdl.register_backend
class OrderedOnCPU(MPIBackend):
    """The MPI backend with every op in stream order; float64 stands for CUDA
    (and, like CUDA tensors, has no compiled fast path). ``late``: the next
    event completes only that many seconds after it was made (as its op's
    deadline starts, so the gap holds however slow the machine)."""
    name = NAME
    count, late = 0, None

    def __init__(self, ctx):
        super().__init__(ctx)
        self.order_after_streams()

    @staticmethod
    def device_tensor(args):
        return next((a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.float64), None)

    def stream_event(self, t):
        self.count += 1
        if self.late is not None:
            delay, self.late = self.late, None
            return LandsAt(time.monotonic() + delay)
        return Lands((self.count * (3 if mcrdl.get_rank() % 2 else 5)) % 7)

    def starter(self, op, h, timeout, tensors, *fixed):
        if self.device_tensor(tensors) is not None:
            return self.nonblocking(op, h, *fixed)
        return super().starter(op, h, timeout, tensors, *fixed)


@mcrdl.register_backend
class OrderedTwo(OrderedOnCPU):
    """A second queue: a wait on one backend's op must start the other's."""
    name = NAME + "_2"


mcrdl.init_process_group(timeout=60)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
engine = mcrdl.api.current_runtime().engine
ordered = mcrdl.api.current_runtime().backends[NAME]
peer, prev = (rank + 1) % world, (rank - 1) % world

if sys.argv[1:2] == ["late"]:
    # a collective still queued on rank 1 at its deadline is not withdrawn: the
    # others started it, and the next collective must not pair with it (the job
    # then aborts at exit, as after any failed collective)
    quick = mcrdl.new_group(list(range(world)), timeout=2)
    if rank == 1:
        ordered.late = 2.4  # rank 1 misses its own 2 s deadline; the others wait less
    try:
        mcrdl.all_reduce(value(rank, 4, torch.float64), group=quick, backend=NAME)
        check(False, "a collective whose device work came late on rank 1 completed in time")
    except mcrdl.CommTimeoutError:
        pass
    after = value(rank, 5, torch.float32, salt=7)
    mcrdl.all_reduce(after, group=quick, backend=NAME)  # rank 1: queued behind the late one
    check(torch.equal(after, reduced(range(world), 5, torch.float32, "sum", salt=7)),
          "paired with a timed-out collective:", after)
    check(not ordered.queue, "ops left unstarted:", len(ordered.queue))
    print(f"rank {rank}: late collective OK", flush=True)
    if sys.argv[2:]:  # the verdict, where the abort at exit cannot lose it (it can the launcher's output)
        with open(os.path.join(sys.argv[2], f"rank{rank}"), "w") as f:
            f.write("late collective OK\n")
    mcrdl.barrier()  # (the abort at exit must not cut another rank's output)
    sys.exit(0)

# a host op with nothing waiting starts at once; a device op waits for its stream
host = mcrdl.all_reduce(value(rank, 4, torch.float32), backend=NAME, async_op=True)
check(not isinstance(host._pending, DeferredPending), "a host op with nothing queued was deferred")
host.wait()
dev = mcrdl.all_reduce(value(rank, 4, torch.float64), backend=NAME, async_op=True)
check(isinstance(dev._pending, DeferredPending), "a device op was not deferred:", type(dev._pending))
dev.wait()

# device and host ops interleaved, of different sizes, with a thread polling the
# engine as a future's helper does: host ops queue behind device ops
stop = threading.Event()
poller = threading.Thread(target=lambda: [engine.poll() for _ in iter(stop.is_set, True)], daemon=True)
poller.start()
for rnd in range(20):
    dtypes = [torch.float64, torch.float32, torch.float64, torch.float32, torch.float32, torch.float64]
    ts = [value(rank, 3 + 5 * i + rnd, dt, salt=i) for i, dt in enumerate(dtypes)]
    works = [mcrdl.all_reduce(x, backend=NAME, async_op=True) for x in ts[:3]]
    works.append(mcrdl.broadcast(ts[3], src=0, backend=NAME, async_op=True))
    works += [mcrdl.all_reduce(x, backend=NAME, async_op=True) for x in ts[4:]]
    mcrdl.all_reduce(blocking := value(rank, 9 + rnd, torch.float32), backend=NAME)  # queues, and waits
    check(torch.equal(blocking, reduced(range(world), 9 + rnd, torch.float32, "sum")), "blocking op, round", rnd)
    for w in reversed(works):
        w.wait()
    for i, x in enumerate(ts):
        want = value(0, 3 + 5 * i + rnd, dtypes[i], salt=i) if i == 3 else \
            reduced(range(world), 3 + 5 * i + rnd, dtypes[i], "sum", salt=i)
        check(torch.equal(x, want), "start out of order: round", rnd, "op", i)
    # sends keep their order too (MPI's non-overtaking rule holds in start order)
    if world > 1:
        sends = [mcrdl.isend(value(rank, 6, dt, salt=k), peer, tag=3, backend=NAME)
                 for k, dt in enumerate((torch.float64, torch.float32, torch.float64))]
        got = [torch.empty(6, dtype=dt) for dt in (torch.float64, torch.float32, torch.float64)]
        for k, t in enumerate(got):
            mcrdl.recv(t, prev, tag=3, backend=NAME)
            check(torch.equal(t, value(prev, 6, t.dtype, salt=k)), "send overtaken: round", rnd, "message", k)
        for s in sends:
            s.wait()
stop.set()
poller.join()
check(Lands.not_yet > 100, "starts were not deferred:", Lands.not_yet)
check(not ordered.queue, "ops left unstarted:", len(ordered.queue))

# two backends' queues: each rank's send waits in one, its receive in the other,
# and it waits for the receive first (a wait spinning on one queue alone hangs)
if world > 1:
    for rnd in range(5):
        mine, theirs = (NAME, NAME + "_2") if rank % 2 else (NAME + "_2", NAME)
        got = torch.empty(8, dtype=torch.float64)
        send = mcrdl.isend(value(rank, 8, torch.float64, salt=rnd), peer, tag=2, backend=mine)
        receive = mcrdl.irecv(got, prev, tag=2, backend=NAME if prev % 2 else NAME + "_2")
        receive.wait()
        send.wait()
        check(torch.equal(got, value(prev, 8, torch.float64, salt=rnd)), "two queues, round", rnd)

# a receive still queued at its deadline is not dropped: the message sent for it
# must not go to the next receive; a receive from a named source knows it
if world > 1:
    quick = mcrdl.new_group(list(range(world)), timeout=1)
    if rank == 0:
        mcrdl.send(value(0, 4, torch.float64, salt=1), 1, group=quick, tag=5, backend=NAME)
    elif rank == 1:
        ordered.late = 1.5
        try:
            mcrdl.recv(torch.zeros(4, dtype=torch.float64), 0, group=quick, tag=5, backend=NAME)
            check(False, "a receive whose device work came late completed in time")
        except mcrdl.CommTimeoutError:
            pass
    mcrdl.barrier()
    if rank == 0:
        mcrdl.send(value(0, 4, torch.float64, salt=2), 1, group=quick, tag=5, backend=NAME)
    elif rank == 1:
        got = torch.zeros(4, dtype=torch.float64)
        work = mcrdl.irecv(got, 0, group=quick, tag=5, backend=NAME)
        work.wait()
        check(torch.equal(got, value(0, 4, torch.float64, salt=2)), "got the message of a timed-out receive:", got)
        check(work.source_rank() == 0, "source_rank of a receive from rank 0:", work.source_rank())

# an op queued outside any work the engine tracks (here: started on the backend
# directly): the blocking fast path, which runs when nothing is outstanding,
# must still queue behind it
for rnd in range(10):
    early = value(rank, 6, torch.float64, salt=rnd)
    ordered.late = 0.05 if rank % 2 else 0  # queued on odd ranks only
    pending = ordered.all_reduce(mcrdl.api.current_runtime().world.handles[NAME], early, mcrdl.ReduceOp.SUM)
    fast = value(rank, 6, torch.float32, salt=rnd)
    mcrdl.all_reduce(fast, backend=NAME)
    while not pending.test():
        pass
    check(torch.equal(early, reduced(range(world), 6, torch.float64, "sum", salt=rnd)), "queued op, round", rnd)
    check(torch.equal(fast, reduced(range(world), 6, torch.float32, "sum", salt=rnd)), "fast path overtook, round", rnd)
mcrdl.barrier()
mcrdl.destroy_process_group()
verdicts.finished("ordering checks")
print(f"rank {rank}: ordering checks OK")

sys.argv = [str(Path(__file__).parent / "ops_job.py"), NAME]
runpy.run_path(sys.argv[0], run_name="__main__")
