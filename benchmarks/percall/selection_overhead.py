"""Per-call cost of backend selection: `mcrdl run -n 2 benchmarks/percall/selection_overhead.py`.

Times a 4-byte all_reduce (the size where overhead shows) with the backend
forced (`backend="mpi"`) against the same call selected by the default, a
static map, a tuning table and in-situ autotune once its bucket froze (all
choosing mpi), interleaved over rounds; and times `Selector.choose` alone.
Medians over rounds of the max across ranks. Every variant starts with the
group's fast-path plans dropped, so each builds its own.
"""
import argparse
import json
import statistics
import time

import torch

import mcrdl
from mcrdl import api
from mcrdl.autotune import Autotuner

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=5000)
p.add_argument("--rounds", type=int, default=15)
p.add_argument("--json")
args = p.parse_args()

TABLE = {"format": "mcrdl-tuning/1", "rules": {"all_reduce": {"2": [
    {"max_bytes": 64, "backend": "mpi"}, {"max_bytes": 65536, "backend": "gloo"},
    {"max_bytes": None, "backend": "mpi"}]}}}
mcrdl.init_process_group(tuning_table=TABLE)
rank = mcrdl.get_rank()
t = torch.ones(1)
sel = api._runtime.selector
static_sel = type(sel)(sel.live, "gloo", {"all_reduce": "mpi"}, None)
default_sel = type(sel)(sel.live, "mpi", None, None)


def allreduce_loop(selector, backend, tuner=None):
    api._runtime.selector, api._runtime.autotune = selector, tuner
    api._runtime.world.plans.clear()
    for _ in range(args.iters):
        mcrdl.all_reduce(t, backend=backend)
    api._runtime.autotune = None


tuner = Autotuner(sel, block_ms=0)  # its 4-byte all_reduce bucket, explored and frozen here first
api._runtime.autotune = tuner
while not api._runtime.world.tuned or any(b.winner is None for b in api._runtime.world.tuned.values()):
    mcrdl.all_reduce(t)
api._runtime.autotune = None
won = next(iter(api._runtime.world.tuned.values())).winner


variants = {
    "forced (backend='mpi')": lambda: allreduce_loop(sel, "mpi"),
    "default backend": lambda: allreduce_loop(default_sel, None),
    "static map": lambda: allreduce_loop(static_sel, None),
    "tuning table": lambda: allreduce_loop(sel, None),
    f"autotuned (frozen: {won})": lambda: allreduce_loop(sel, None, tuner),
}
times = {k: [] for k in variants}
for _ in range(args.rounds):
    for name, fn in variants.items():
        mcrdl.barrier(backend="mpi")
        start = time.perf_counter()
        fn()
        per_call = torch.tensor([(time.perf_counter() - start) / args.iters * 1e6], dtype=torch.float64)
        mcrdl.all_reduce(per_call, op=mcrdl.ReduceOp.MAX, backend="mpi")
        times[name].append(float(per_call))
api._runtime.selector = sel
choose = {}
for name, (s, be) in {"choose(): forced": (sel, "mpi"), "choose(): table": (sel, None),
                      "choose(): static": (static_sel, None)}.items():
    start = time.perf_counter()
    for _ in range(100000):
        s.choose("all_reduce", 4, 2, "cpu", torch.float32, mcrdl.ReduceOp.SUM, be)
    choose[name] = (time.perf_counter() - start) / 100000 * 1e6
if rank == 0:
    base = statistics.median(times["forced (backend='mpi')"])
    print(f"4 B all_reduce, {mcrdl.get_world_size()} ranks, median of {args.rounds} rounds x {args.iters} calls")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:24s} {med:7.2f} us  ({med - base:+.2f} us vs forced)")
    for name, us in choose.items():
        print(f"  {name:24s} {us:7.3f} us per call (selector alone)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_us": {k: statistics.median(v) for k, v in times.items()},
                       "choose_us": choose, "iters": args.iters, "rounds": args.rounds}, f, indent=2)
mcrdl.destroy_process_group()
