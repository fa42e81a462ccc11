"""The floor under mcrdl's MPI hot path: each collective as MPICH's blocking
call (what raw mpi4py and OSU's C benchmarks time) against its nonblocking form
completed by an ``MPI_Test`` spin (what mcrdl's compiled path runs, so that
every wait has a deadline and other libraries keep progressing: DESIGN hazards
1 and 6) and completed by ``MPI_Wait`` (waiting inside the library), all in C
with nothing else in the loop (benchmarks/percall/c/blocking_loop.c, built with the
job's mpicc).

    mcrdl run -n 2 benchmarks/percall/blocking_floor.py [--sizes 4,1K,16K,256K] [--rounds 5] [--json out.json]

Per size, ``R`` rounds; each round runs every (op, form) once, rotating the
order of the forms; a value is the slowest rank's seconds per call; the report
is, per nonblocking form, the median over rounds of its ratio to the blocking
call, with the medians in µs.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
import tempfile

import numpy as np
from mpi4py import MPI
from rich.console import Console
from rich.table import Table

from allreduce_latency import build_c, parse_size

OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "all_to_all", "reduce_scatter"]
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "c", "blocking_loop.c")
#: blocking_loop's forms, in its numbering: the blocking call, nonblocking + MPI_Test spin, + MPI_Wait
FORMS = ["blocking", "test", "wait"]


def build(workdir: str):
    fn = build_c(SRC, workdir).blocking_loop
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="4,1K,16K,256K", help="bytes per rank, comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--json")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    with tempfile.TemporaryDirectory() as work:
        loop = build(work)
        results = []
        for nbytes in sizes:
            count = nbytes // 4
            # (all_to_all sends count to each of n peers from buf_a; the other ops use count of it)
            buf_a, buf_b = np.zeros(count * n, np.float32), np.zeros(count * n, np.float32)
            iters = max(200, min(5000, (1 << 24) // max(nbytes, 1) // 8))
            for op_id, op in enumerate(OPS):
                times = {form: [] for form in FORMS}
                for r in range(a.rounds):
                    for form in FORMS[r % 3:] + FORMS[:r % 3]:
                        t = loop(comm.py2f(), op_id, FORMS.index(form), buf_a.ctypes.data, buf_b.ctypes.data,
                                 count, iters, max(iters // 10, 20))
                        times[form].append(comm.allreduce(t, op=MPI.MAX) * 1e6)
                row = {"op": op, "bytes": nbytes, "iters": iters, "blocking_us": statistics.median(times["blocking"])}
                for form in FORMS[1:]:
                    ratios = [x / y for x, y in zip(times[form], times["blocking"])]
                    row.update({f"{form}_us": statistics.median(times[form]),
                                f"{form}_ratio": statistics.median(ratios), f"{form}_ratios": ratios})
                results.append(row)
    if rank == 0:
        for form, label in (("test", "MPI_Test spin"), ("wait", "MPI_Wait")):
            table = Table(title=f"MPI nonblocking + {label} / blocking, {n} ranks, median of {a.rounds} rounds "
                                f"({MPI.Get_library_version().splitlines()[0].strip()})")
            table.add_column("op")
            for nbytes in sizes:
                table.add_column(f"{nbytes} B", justify="right")
            for op in OPS:
                cells = [next(r for r in results if r["op"] == op and r["bytes"] == s) for s in sizes]
                table.add_row(op, *(f"{c[form + '_us']:.2f} / {c['blocking_us']:.2f} us = {c[form + '_ratio']:.2f}x"
                                    for c in cells))
            Console(width=200).print(table)
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"benchmark": "blocking_floor", "world_size": n, "rounds": a.rounds,
                           "command": "mcrdl run -n %d benchmarks/percall/blocking_floor.py %s" % (n, " ".join(sys.argv[1:])),
                           "results": results}, f, indent=1)
                f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
