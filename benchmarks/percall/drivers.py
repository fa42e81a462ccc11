"""What the compiled driver saves per call: every op on MPI through the
compiled driver (csrc/driver.cpp's ``drive``, calls from their plans) and
through the general path (``ops.general``, what the pure-Python build runs),
against raw mpi4py, in one job, interleaved.

    mcrdl run -n 2 benchmarks/percall/drivers.py [--sizes 4,1K,64K] [--ops all_reduce,...]
                                        [--rounds R] [--json out.json]

The calls and the raw mpi4py reference are hotpath.py's (same ops, sizes,
checks and styles); the two drivers serve the same API functions, swapped
between rounds (``api.run_op``), so both run in the same process. For every
op, size and style, ``R`` rounds time the three variants in turn (reversed
every other round); a round's figure is the slowest rank's; the report is the
median time of each and the median per-round ratio compiled / general.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import mcrdl
from mcrdl import api, ops

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # percall/: hotpath
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import environment, write_json  # noqa: E402
from hotpath import OPS, STYLES, build, iterations, label, parse_size, timed  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,1K,64K")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    names, sizes = args.ops.split(","), [parse_size(s) for s in args.sizes.split(",")]

    mcrdl.init_process_group(backends=["mpi"])
    from mpi4py import MPI
    drivers = {"compiled": api.run_op, "general": ops.general}
    if drivers["compiled"] is ops.general:
        raise SystemExit("the compiled driver is not loaded here (no C++ compiler, or MCRDL_NATIVE=0)")
    comm = MPI.COMM_WORLD.Dup()
    rank, world = comm.Get_rank(), comm.Get_size()
    console = Console(stderr=True, width=200)
    gen = torch.Generator().manual_seed(rank + 1)
    fill = lambda k: torch.randint(-8, 8, (k,), generator=gen).float()  # noqa: E731  sums stay exact

    def through(driver, call):
        def fn():
            api.run_op = driver
            call()
        return fn

    results = []
    with Progress(console=console, disable=rank != 0, transient=True) as progress:
        task = progress.add_task("drivers", total=len(names) * len(sizes))
        for op in names:
            for nbytes in sizes:
                call, raw, outs, raw_outs = build(op, max(1, nbytes // 4), comm, MPI, fill)
                for name, driver in drivers.items():  # (each driver's output checked against mpi4py's)
                    for t in outs + raw_outs:
                        t.zero_()
                    through(driver, call)()
                    raw()
                    if not all(torch.equal(x, y) for x, y in zip(outs, raw_outs)):
                        raise SystemExit(f"rank {rank}: {op} {label(nbytes)}: the {name} driver and mpi4py differ")
                iters = iterations(nbytes)
                variants = [(name, through(d, call)) for name, d in drivers.items()] + [("raw", raw)]
                row = {"op": op, "bytes": nbytes, "iters": iters}
                for style in STYLES:
                    times = {name: [] for name, _ in variants}
                    for r in range(args.rounds):
                        for name, fn in variants if r % 2 == 0 else variants[::-1]:
                            for _ in range(max(10, iters // 20)):
                                fn()
                            times[name].append(comm.allreduce(timed(fn, iters, style, comm), op=MPI.MAX) * 1e6)
                    ratios = [c / p for c, p in zip(times["compiled"], times["general"])]
                    row[style] = {**{f"{name}_us": statistics.median(t) for name, t in times.items()},
                                  "compiled_vs_general": statistics.median(ratios), "ratios": ratios}
                results.append(row)
                progress.advance(task)
    api.run_op = drivers["compiled"]
    if rank == 0:
        table = Table(title=f"compiled driver / general path per call, {world} ranks, MPI, median of {args.rounds} "
                            "rounds (µs: compiled, general, raw mpi4py)")
        table.add_column("op")
        for nbytes in sizes:
            table.add_column(label(nbytes), justify="right")
        for op in names:
            cells = []
            for nbytes in sizes:
                row = next(r for r in results if r["op"] == op and r["bytes"] == nbytes)
                b = row[STYLES[0]]
                cells.append(f"{b['compiled_vs_general']:.2f}x ({b['compiled_us']:.1f}, {b['general_us']:.1f}, "
                             f"{b['raw_us']:.1f}) / {row[STYLES[1]]['compiled_vs_general']:.2f}x")
            table.add_row(op, *cells)
        Console(width=220).print(table)
        Console(width=220).print(f"cells: {STYLES[0]} ratio (µs compiled, general, raw) / {STYLES[1]} ratio")
        if args.json:
            write_json(args.json, {"benchmark": "drivers", "world_size": world, "rounds": args.rounds,
                                   "environment": environment(mpi=MPI.Get_library_version().splitlines()[0]),
                                   "command": " ".join(sys.argv), "results": results}, Console())
    mcrdl.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
