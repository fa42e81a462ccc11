"""One all_reduce as each route a PyTorch user could take makes it, timed in one
job, interleaved: plain torch.distributed, deepspeed.comm's CPU route and mcrdl
(docs/comparison.md).

    mcrdl run -n 2 benchmarks/percall/comparison.py --table docs/results/tuning-2ranks.json \\
        --record docs/results/comparison

DeepSpeed starts torch.distributed on the "mcrdl" backend (``--table``: its
tuning table), and a gloo group is made beside it, so every route runs in the
same processes: torch.distributed's ``all_reduce`` on the gloo group and on
"mcrdl", deepspeed.comm's ``all_reduce`` on both, deepspeed.comm's
``inference_all_reduce`` (on CPU its shared-memory kernel, the op DeepSpeed
offers for inference only), and mcrdl's own API, selected and with MPI forced
(the best single library here). Every route's sum is checked on exact values
before anything is timed. Per size, ``--rounds`` rounds run every route in
turn (the order reversed every other round), each a warm-up, a barrier and
timed blocking fp32 sums; a round's figure is the slowest rank's time per
call, the page the median over rounds. ``--record PREFIX`` writes PREFIX.json
and PREFIX.md.
"""
import argparse
import os
import statistics
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.distributed as dist
from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import environment, interleaved, write_json  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--table", help="the tuning table mcrdl selects from (MCRDL_TUNING_TABLE)")
p.add_argument("--sizes", default="4,1024,65536,1048576", help="bytes, comma-separated")
p.add_argument("--rounds", type=int, default=7)
p.add_argument("--record", help="write PREFIX.json and PREFIX.md")
args = p.parse_args()
if args.table:
    os.environ["MCRDL_TUNING_TABLE"] = args.table

import deepspeed  # noqa: E402
import deepspeed.comm as ds  # noqa: E402
from mpi4py import MPI  # noqa: E402

import mcrdl  # noqa: E402

comm = MPI.COMM_WORLD
# (DeepSpeed's shm kernel maps its files only where LOCAL_SIZE, which DeepSpeed's own
# launcher sets, equals the world size; unmapped, as under mpiexec or torchrun, its
# first call segfaults. The files are named after MASTER_ADDR and MASTER_PORT.)
os.environ.setdefault("LOCAL_SIZE", str(comm.size))
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
os.environ.setdefault("MASTER_PORT", str(comm.bcast(29500 + os.getpid() % 20000 if comm.rank == 0 else None)))
deepspeed.init_distributed(dist_backend="mcrdl")
rank, world = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")
console = Console(width=160)
shm_kernel = hasattr(torch.ops, "deepspeed") and hasattr(torch.ops.deepspeed, "inference_all_reduce_")
ROUTES = {
    "torch.distributed on gloo": lambda t: dist.all_reduce(t, group=gloo),
    "deepspeed.comm on gloo": lambda t: ds.all_reduce(t, group=gloo),
    "deepspeed.comm inference_all_reduce": lambda t: ds.inference_all_reduce(t),
    "torch.distributed on mcrdl": lambda t: dist.all_reduce(t),
    "deepspeed.comm on mcrdl": lambda t: ds.all_reduce(t),
    "mcrdl API, selected": lambda t: mcrdl.all_reduce(t),
    "mcrdl API, MPI only": lambda t: mcrdl.all_reduce(t, backend="mpi"),
}


def calls_for(nbytes: int) -> int:
    return 2000 if nbytes <= 1024 else 500 if nbytes <= 65536 else 100


results = []
for nbytes in (int(s) for s in args.sizes.split(",")):
    n = nbytes // 4
    for name, route in ROUTES.items():  # exact values first: every route's sum
        t = torch.arange(n, dtype=torch.float32) + rank
        route(t)
        ok = torch.equal(t, sum(torch.arange(n, dtype=torch.float32) + r for r in range(world)))
        if not all(comm.allgather(ok)):
            raise SystemExit(f"{name}: wrong sum at {nbytes} B")
    zeros = {name: torch.zeros(n) for name in ROUTES}  # (timed on zeros: sums stay exact)
    order = [(name, (lambda r, z: lambda: r(z))(route, zeros[name])) for name, route in ROUTES.items()]
    calls = calls_for(nbytes)
    times = interleaved(order, args.rounds, calls, max(calls // 10, 5), comm)
    results.append({"bytes": nbytes, "calls": calls,
                    "us": {name: statistics.median(ts) for name, ts in times.items()},
                    "rounds_us": times})
    if rank == 0:
        console.print(f"{nbytes} B done", highlight=False)

if rank == 0:
    table = Table(title=f"fp32 all_reduce, {world} ranks: us per call (slowest rank, median of {args.rounds} rounds)")
    table.add_column("route")
    for r in results:
        table.add_column(f"{r['bytes']} B", justify="right")
    for name in ROUTES:
        table.add_row(name, *[f"{r['us'][name]:.1f}" for r in results])
    console.print(table)
    if args.record:
        env = environment(deepspeed=deepspeed.__version__)
        doc = {"command": "mcrdl run -n 2 benchmarks/percall/comparison.py " + " ".join(sys.argv[1:]),
               "environment": env, "world": world, "table": args.table, "rounds": args.rounds,
               "deepspeed_shm_kernel": shm_kernel, "results": results}
        write_json(args.record + ".json", doc, console)
        head = "| route | " + " | ".join(f"{r['bytes']:,} B" for r in results) + " |"
        lines = [head, "|---|" + "---:|" * len(results)]
        for name in ROUTES:
            lines.append(f"| {name} | " + " | ".join(f"{r['us'][name]:.1f}" for r in results) + " |")
        page = [
            "# One all_reduce, each route a user could take", "",
            __doc__.split("\n\n", 1)[1].strip(), "",
            f"Ran {env['date']} on {env['hostname']} ({env['cpus']} CPUs, load average at the end "
            f"{', '.join(f'{x:.2f}' for x in env['loadavg_at_end'])}), torch {env['versions']['torch']}, "
            f"DeepSpeed {deepspeed.__version__} (its shm kernel {'loaded' if shm_kernel else 'not loaded'}).", "",
            "```", doc["command"], "```", "",
            f"fp32 all_reduce, {world} ranks, us per call (slowest rank, median of {args.rounds} rounds):", "",
            *lines, ""]
        with open(args.record + ".md", "w") as f:
            f.write("\n".join(page))
        console.print(f"wrote {args.record}.md", highlight=False)
comm.Barrier()  # (every rank mapped every file at its first call: DeepSpeed never unlinks them)
os.unlink(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ['MASTER_ADDR']}_"
          f"{os.environ['MASTER_PORT']}_{rank}")
dist.destroy_process_group()
