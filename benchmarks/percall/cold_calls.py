"""Calls as a training step makes them: mcrdl against raw mpi4py, each call
right after a compute step, measured in one job, interleaved.

    mcrdl run -n 2 benchmarks/percall/cold_calls.py [--rounds R] [--calls K] [--json out.json]

Back-to-back loops (OSU, allreduce_latency.py) keep the library's, the
interpreter's and mcrdl's own code and data hot in cache; in a step each call
follows compute that evicts them, and then every line a call runs costs cache
misses. Per (compute step, op and size, variant) and round: ``K`` calls, each
after the compute step and an MPI barrier (both untimed), timed with
``time.perf_counter``; a round's value is the slowest rank's median call; the
report is the median over rounds. Rounds interleave every step, case and
variant (the order of the variants rotates). Compute steps, on one torch
thread as the workloads run: none (back to back), one matmul (as
``mcrdl bench --cold``), a transformer-like layer forward (no grad), and its
forward + backward. Every variant's result is checked on exact values first.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import mcrdl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import environment, write_json  # noqa: E402

SIZES = (32, 128 << 10, 1 << 20)


def compute_steps() -> dict:
    """Name -> a compute step run before each timed call."""
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    lin1, lin2, norm = torch.nn.Linear(512, 512), torch.nn.Linear(512, 512), torch.nn.LayerNorm(512)
    x = torch.randn(256, 512)

    def layer():
        h = norm(F.gelu(lin1(x)))
        return lin2(torch.softmax(h @ h.t() / 22.6, dim=-1) @ h).sum()

    def forward():
        with torch.no_grad():
            layer()
    return {"none": lambda: None, "matmul": lambda: a @ b, "layer forward": forward,
            "layer fwd+bwd": lambda: layer().backward()}


def cases(comm, MPI, rank: int, world: int) -> dict:
    """(op, bytes) -> {variant: (call, check)}; check() verifies one call's result."""
    out = {}
    for nbytes in SIZES:
        n = nbytes // 8  # float64 elements, a multiple of the world size
        t, r = torch.full((n,), float(rank + 1), dtype=torch.float64), torch.empty(n, dtype=torch.float64)
        arr, rarr = t.numpy(), r.numpy()
        total = world * (world + 1) / 2

        def reduced(call, t=t):
            t.fill_(rank + 1)
            call()
            return bool((t == total).all())
        m = lambda t=t: mcrdl.all_reduce(t)
        raw = lambda a=arr: comm.Allreduce(MPI.IN_PLACE, a)
        out[("all_reduce", nbytes)] = {"mcrdl": (m, lambda m=m, f=reduced: f(m)),
                                       "raw mpi4py": (raw, lambda raw=raw, f=reduced: f(raw))}
        src = torch.arange(n, dtype=torch.float64) + 1000 * rank
        block = n // world
        ref = torch.cat([torch.arange(n, dtype=torch.float64)[rank * block:(rank + 1) * block] + 1000 * p
                         for p in range(world)])
        s_arr = src.numpy()
        for split in (False, True):
            rows = [block] * world if split else None
            counts = ([block] * world, [block * i for i in range(world)])
            if split:
                m = lambda s=src, o=r, rows=rows: mcrdl.all_to_all_single(o, s, rows, rows)
                raw = lambda s=s_arr, o=rarr, c=counts: comm.Alltoallv([s, c, MPI.DOUBLE], [o, c, MPI.DOUBLE])
            else:
                m = lambda s=src, o=r: mcrdl.all_to_all_single(o, s)
                raw = lambda s=s_arr, o=rarr: comm.Alltoall(s, o)
            op = "all_to_all_single" + (" (split sizes)" if split else "")
            out[(op, nbytes)] = {v: (f, lambda f=f, r=r, ref=ref: (r.zero_(), f(), torch.equal(r, ref))[2])
                                 for v, f in (("mcrdl", m), ("raw mpi4py", raw))}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    ap.add_argument("--calls", type=int, default=30, help="timed calls per variant and round (default 30)")
    ap.add_argument("--json", help="write the results to this JSON file (rank 0)")
    args = ap.parse_args()
    if args.rounds < 1 or args.calls < 1:
        ap.error("--rounds and --calls must be at least 1")
    torch.set_num_threads(1)
    mcrdl.init_process_group(backends=["mpi"])
    from mpi4py import MPI
    comm = MPI.COMM_WORLD.Dup()
    rank, world = comm.Get_rank(), comm.Get_size()
    from rich.console import Console
    from rich.table import Table
    console = Console() if sys.stdout.isatty() else Console(width=200, force_terminal=False)

    steps, table = compute_steps(), cases(comm, MPI, rank, world)
    for key, variants in table.items():
        for v, (_, check) in variants.items():
            if not comm.allreduce(int(check()), op=MPI.MIN):
                raise AssertionError(f"{v} {key[0]} of {key[1]} B gave a wrong result")
    variants = ["mcrdl", "raw mpi4py"]
    rounds: dict = {}
    t0 = time.perf_counter()
    for rnd in range(args.rounds):
        order = variants[rnd % 2:] + variants[:rnd % 2]
        for sname, step in steps.items():
            for key, calls in table.items():
                for v in order:
                    call = calls[v][0]
                    times = []
                    for _ in range(args.calls + 2):
                        step()
                        comm.Barrier()
                        start = time.perf_counter()
                        call()
                        times.append(time.perf_counter() - start)
                    med = comm.allreduce(statistics.median(times[2:]), op=MPI.MAX)
                    rounds.setdefault((sname, *key, v), []).append(med * 1e6)
        if rank == 0:
            console.print(f"round {rnd + 1}/{args.rounds} done, {time.perf_counter() - t0:.0f} s",
                          highlight=False)
    if rank == 0:
        tab = Table(title=f"us per call right after a compute step, {world} ranks, median over "
                          f"{args.rounds} rounds of the slowest rank's median of {args.calls} calls")
        for col in ("compute before the call", "op", "bytes", "mcrdl", "raw mpi4py", "mcrdl / raw"):
            tab.add_column(col, justify="left" if col in ("compute before the call", "op") else "right")
        results = []
        for sname in steps:
            for op, nbytes in table:
                med = {v: statistics.median(rounds[(sname, op, nbytes, v)]) for v in variants}
                ratio = med["mcrdl"] / med["raw mpi4py"]
                tab.add_row(sname, op, str(nbytes), f"{med['mcrdl']:.1f}", f"{med['raw mpi4py']:.1f}",
                            f"{ratio:.2f}")
                results.append({"compute": sname, "op": op, "bytes": nbytes, "median_us": med,
                                "ratio": ratio, "rounds_us": {v: rounds[(sname, op, nbytes, v)]
                                                              for v in variants}})
        console.print(tab)
        if args.json:
            doc = {"benchmark": "cold_calls", "world_size": world,
                   "command": "mcrdl run -n 2 benchmarks/percall/cold_calls.py " + " ".join(sys.argv[1:]),
                   "rounds": args.rounds, "calls": args.calls,
                   "environment": environment(mpi=MPI.Get_library_version().splitlines()[0]),
                   "results": results}
            write_json(args.json, doc, console)
    comm.Free()
    mcrdl.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
