"""MPI's nonblocking collectives (what mcrdl's MPI backend calls, polled with
``MPI_Test``) against the blocking ones, in mpi4py, at large sizes: is a slow
mcrdl call the library's nonblocking form or mcrdl?

    mcrdl run -n 2 benchmarks/percall/nbc_vs_blocking.py            # the MPI mpi4py loaded
    OMPI_MCA_coll_libnbc_ireduce_algorithm=2 mpiexec -n 2 python benchmarks/percall/nbc_vs_blocking.py

Prints the median of 5 calls (a barrier before each) per op and size, in ms,
on rank 0. Results: docs/results/gpu.md (Open MPI 4.1).
"""
import statistics
import time

import numpy as np
from mpi4py import MPI

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
CALLS = 5


def spin(request):
    while not request.Test():
        pass


def forms(a, out):
    """(op, blocking call, nonblocking call polled to completion)."""
    root_out = out if rank == 0 else None
    yield ("reduce", lambda: comm.Reduce(a, root_out, MPI.SUM, 0),
           lambda: spin(comm.Ireduce(a, root_out, MPI.SUM, 0)))
    yield ("all_reduce", lambda: comm.Allreduce(a, out, MPI.SUM),
           lambda: spin(comm.Iallreduce(a, out, MPI.SUM)))
    yield ("broadcast", lambda: comm.Bcast(a, 0), lambda: spin(comm.Ibcast(a, 0)))


def median_ms(call):
    call()
    times = []
    for _ in range(CALLS):
        comm.Barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


if rank == 0:
    print(f"{MPI.Get_library_version().replace(chr(0), '').splitlines()[0].strip()}, {comm.Get_size()} ranks; "
          f"median of {CALLS} calls, ms")
    print(f"{'op':12s}{'size':>8s}{'blocking':>12s}{'nonblocking':>14s}{'ratio':>8s}")
for mib in (1, 16, 64):
    a = np.ones(mib << 18, np.float32)
    out = np.empty_like(a)
    for op, blocking, nonblocking in forms(a, out):
        b, nb = median_ms(blocking), median_ms(nonblocking)
        if rank == 0:
            print(f"{op:12s}{mib:>5d} MiB{b:12.2f}{nb:14.2f}{nb / b:7.1f}x")
