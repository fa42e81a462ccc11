"""Per-call cost of the communication logger: `mcrdl run -n 2 benchmarks/logger_overhead.py`.

A 4-byte all_reduce on mpi with the logger off and on, interleaved over rounds
(medians of the slowest rank); the logger is switched by swapping the
runtime's logger object, so both run in one job."""
import argparse
import json
import statistics
import time

import torch

import mcrdl
from mcrdl import api
from mcrdl.features.logger import CommsLogger

p = argparse.ArgumentParser()
p.add_argument("--iters", type=int, default=5000)
p.add_argument("--rounds", type=int, default=15)
p.add_argument("--json")
args = p.parse_args()
mcrdl.init_process_group()
rt = api._rt()
rank = mcrdl.get_rank()
t = torch.ones(1)
times = {"off": [], "on": []}
for _ in range(args.rounds):
    for mode in times:
        rt.logger = (CommsLogger(rank, mcrdl.get_world_size(), lambda data: rt.control_allgather(rt.world, data))
                     if mode == "on" else None)
        mcrdl.barrier(backend="mpi")
        start = time.perf_counter()
        for _ in range(args.iters):
            mcrdl.all_reduce(t, backend="mpi")
        per = torch.tensor([(time.perf_counter() - start) / args.iters * 1e6], dtype=torch.float64)
        rt.logger = None
        mcrdl.all_reduce(per, op=mcrdl.ReduceOp.MAX, backend="mpi")
        times[mode].append(float(per))
if rank == 0:
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"4 B all_reduce on mpi, {mcrdl.get_world_size()} ranks, median of {args.rounds} rounds x {args.iters}")
    print(f"  logger off: {off:.2f} us/call")
    print(f"  logger on:  {on:.2f} us/call  ({on - off:+.2f} us per call)")
    if args.json:
        json.dump({"off_us": off, "on_us": on, "iters": args.iters, "rounds": args.rounds},
                  open(args.json, "w"), indent=2)
mcrdl.destroy_process_group()
