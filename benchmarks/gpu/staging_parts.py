"""Where a small host-staged all-reduce spends its time, part by part.

Run with 1 and 2 ranks on one GPU (``mcrdl run -n 2 python3 benchmarks/gpu/staging_parts.py
SIZES...``):
each line is the median over 200 calls (µs, rank 0, a barrier before each
call) of
  mpi      MPI_Allreduce on a pinned host buffer (mpi4py, blocking);
  d2h      copy device -> pinned host on a side stream, event, wait for it;
  h2d      the same, host -> device;
  by hand  d2h + mpi + h2d, as mpi_staged does them, without mcrdl;
  mcrdl returns   mcrdl.all_reduce(backend="mpi_staged") alone: until the
           host may go on (the copy back is stream-ordered);
  mcrdl    the same and a stream synchronize;
  gloo     mcrdl.all_reduce(backend="gloo") and a stream synchronize.
When ranks share the GPU, the device parts show what a context switch
between their processes costs."""
import os
import statistics
import sys
import time

import torch

import mcrdl
from mpi4py import MPI

NBYTES = [int(a) for a in sys.argv[1:]] or [4, 65536]
ITERS = 200
mcrdl.init_process_group(timeout=120)
comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
dev = torch.device("cuda", mcrdl.get_local_rank() % torch.cuda.device_count())
torch.cuda.set_device(dev)
side = torch.cuda.Stream(dev)
print(f"rank {rank}: waits {mcrdl.wait_policy()}, CPUs {sorted(os.sched_getaffinity(0))}, {dev}", flush=True)


def timed(call) -> float:
    for _ in range(5):
        call()
    samples = []
    for _ in range(ITERS):
        comm.Barrier()
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


def copied(dst, src):
    def call():
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        while not event.query():
            pass
    return call


for nbytes in NBYTES:
    n = max(nbytes // 4, 1)
    x = torch.ones(n, device=dev)
    host = torch.ones(n).pin_memory()
    parts = {
        "mpi": lambda: comm.Allreduce(MPI.IN_PLACE, host.numpy()),
        "d2h": copied(host, x),
        "h2d": copied(x, host),
    }
    d2h, h2d = parts["d2h"], parts["h2d"]
    parts["by hand"] = lambda: (d2h(), comm.Allreduce(MPI.IN_PLACE, host.numpy()), h2d())
    stream = torch.cuda.current_stream(dev)
    if "mpi_staged" in mcrdl.live_backends("cuda"):
        parts["mcrdl returns"] = lambda: mcrdl.all_reduce(x, backend="mpi_staged")
        parts["mcrdl"] = lambda: (mcrdl.all_reduce(x, backend="mpi_staged"), stream.synchronize())
    if "gloo" in mcrdl.live_backends("cuda"):
        parts["gloo"] = lambda: (mcrdl.all_reduce(x, backend="gloo"), stream.synchronize())
    line = "  ".join(f"{k} {timed(call):7.1f}" for k, call in parts.items())
    if rank == 0:
        print(f"{world} ranks, {nbytes:>8} B: {line}", flush=True)
mcrdl.destroy_process_group()
