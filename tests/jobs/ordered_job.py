"""The MPI backend's stream-ordered starts (a CUDA-aware MPI's path for CUDA
tensors), on CPU: a subclass takes float64 tensors for device tensors whose
stream's work completes after a number of polls that differs per rank and per
op, as a CUDA event does. Their ops start late; ops on float32 tensors called
meanwhile, collectives and sends alike, must queue behind them, or ranks start
them in different orders and MPI matches the wrong calls. Then the whole op
matrix on it."""
import runpy
import sys
import threading
from pathlib import Path

import torch

import mcrdl
from common import Lands, check, reduced, value
from mcrdl.backends.mpi import DeferredPending, MPIBackend

NAME = "mpi_ordered_cpu"


@mcrdl.register_backend
class OrderedOnCPU(MPIBackend):
    """The MPI backend with every op in stream order; float64 stands for CUDA."""
    name = NAME
    count = 0

    def __init__(self, ctx):
        super().__init__(ctx)
        self.order_after_streams()

    @staticmethod
    def device_tensor(args):
        return next((a for a in args if isinstance(a, torch.Tensor) and a.dtype == torch.float64), None)

    def stream_event(self, t):
        self.count += 1
        return Lands((self.count * (3 if mcrdl.get_rank() % 2 else 5)) % 7)


mcrdl.init_process_group(timeout=60)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
engine = mcrdl.api._rt().engine
ordered = mcrdl.api._rt().backends[NAME]
peer, prev = (rank + 1) % world, (rank - 1) % world

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
mcrdl.barrier()
mcrdl.destroy_process_group()
print(f"rank {rank}: ordering checks OK")

sys.argv = [str(Path(__file__).parent / "ops_job.py"), NAME]
runpy.run_path(sys.argv[0], run_name="__main__")
