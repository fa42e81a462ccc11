"""Async ops in flight, as DDP's gradient buckets are: B all-reduces started
on B tensors, then waited for, through mcrdl (``async_op=True``, MPI forced)
against mpi4py (``Iallreduce`` on numpy views of the same-sized tensors, then
``Waitall``), in one job, interleaved.

    mcrdl run -n 2 benchmarks/percall/async_inflight.py [--sizes 4,16K,256K] [--batches 1,4,16]
                                                [--futures] [--rounds R] [--json out.json]

A figure is µs per op (elapsed for many batches / ops), the slowest rank's;
the report is the median over ``R`` rounds of each variant and of the
per-round ratio mcrdl / raw. Both variants' results are compared once before
timing. Each op mcrdl starts is checked against every op in flight for
shared memory (program order, DESIGN hazard 3): what that costs grows with B.
``--futures``: mcrdl's ops are waited for through ``Work.get_future()``, as DDP
waits for its buckets (completed by mcrdl's futures thread).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
from mpi4py import MPI
from rich.console import Console
from rich.table import Table

import mcrdl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import environment, interleaved, write_json  # noqa: E402
from hotpath import label, parse_size  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="4,16K,256K")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--futures", action="store_true", help="wait through get_future() (DDP's way)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    mcrdl.init_process_group(timeout=120)
    comm = MPI.COMM_WORLD.Dup()
    rank, world = comm.Get_rank(), comm.Get_size()
    console = Console(width=200)
    results = []
    for nbytes in sizes:
        for batch in batches:
            ours = [torch.full((max(1, nbytes // 4),), float(rank + i)) for i in range(batch)]
            theirs = [t.clone() for t in ours]
            views = [t.numpy() for t in theirs]

            def mcrdl_batch():
                works = [mcrdl.all_reduce(t, async_op=True, backend="mpi") for t in ours]
                for waiting in [w.get_future() for w in works] if args.futures else works:
                    waiting.wait()

            def raw_batch():
                MPI.Request.Waitall([comm.Iallreduce(MPI.IN_PLACE, v, MPI.SUM) for v in views])

            mcrdl_batch()
            raw_batch()
            if not all(torch.equal(a, b) for a, b in zip(ours, theirs)):
                raise SystemExit(f"rank {rank}: {label(nbytes)} x {batch}: mcrdl and mpi4py differ")
            repeats = max(2, (4000 if nbytes <= 4096 else 400) // batch)
            times = interleaved([("mcrdl", mcrdl_batch), ("raw", raw_batch)], args.rounds, repeats,
                                max(2, repeats // 20), comm, per_call=batch)
            ratios = [m / r for m, r in zip(times["mcrdl"], times["raw"])]
            row = {"bytes": nbytes, "batch": batch, "mcrdl_us": statistics.median(times["mcrdl"]),
                   "raw_us": statistics.median(times["raw"]), "ratio": statistics.median(ratios),
                   "ratios": ratios}
            results.append(row)
            if rank == 0:
                console.print(f"[{label(nbytes)} x {batch} in flight] {row['mcrdl_us']:.2f} vs "
                              f"{row['raw_us']:.2f} us per op = {row['ratio']:.2f}x", highlight=False,
                              markup=False)
    if rank == 0:
        how = " (get_future)" if args.futures else ""
        table = Table(title=f"async all_reduce in flight, mcrdl{how} / raw mpi4py, {world} ranks, "
                            f"median of {args.rounds} rounds")
        table.add_column("in flight")
        for nbytes in sizes:
            table.add_column(label(nbytes), justify="right")
        for batch in batches:
            table.add_row(str(batch), *[f"{r['ratio']:.2f}x ({r['mcrdl_us']:.1f} / {r['raw_us']:.1f})"
                                        for nbytes in sizes for r in results
                                        if r["bytes"] == nbytes and r["batch"] == batch])
        console.print(table)
        if args.json:
            write_json(args.json, {"benchmark": "async_inflight", "world_size": world, "rounds": args.rounds,
                                   "futures": args.futures,
                                   "environment": environment(mpi=MPI.Get_library_version().splitlines()[0]),
                                   "command": " ".join(sys.argv), "results": results}, console)
    mcrdl.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
