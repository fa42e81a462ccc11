"""How the cost of a call depends on the time since the previous communication.

    mcrdl run -n 2 examples/model/gap.py [--rounds 3] [--calls 60]

Each call: an MPI barrier, one matmul 256x512 @ 512x512 (as ``mcrdl bench
--cold``), then a busy wait until 2 ms + GAP after the barrier (no memory
traffic, no communication), then one timed blocking 128 KiB all_reduce through
mcrdl. Per GAP and round: the slowest rank's median call (µs); rounds repeat
the GAPs in order. Last output recorded: `git show 3dfebc3:docs/results/model_validation/model_gap.txt`.
"""
import argparse
import statistics
import time

import torch
from mpi4py import MPI

import mcrdl

GAPS_MS = (0.0, 0.5, 1.5, 3.0, 6.0)

p = argparse.ArgumentParser()
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--calls", type=int, default=60)
args = p.parse_args()
torch.set_num_threads(1)
mcrdl.init_process_group(backends=["mpi"])
comm = MPI.COMM_WORLD.Dup()
a, b = torch.randn(256, 512), torch.randn(512, 512)
t = torch.zeros(32768)
clock = time.perf_counter
res: dict = {}
for _ in range(args.rounds):
    for gap in GAPS_MS:
        times = []
        for _ in range(args.calls + 5):
            comm.Barrier()
            t0 = clock()
            a @ b
            while clock() - t0 < (2.0 + gap) * 1e-3:
                pass
            start = clock()
            mcrdl.all_reduce(t)
            times.append(clock() - start)
        res.setdefault(gap, []).append(comm.allreduce(statistics.median(times[5:]), op=MPI.MAX) * 1e6)
if comm.Get_rank() == 0:
    print("128 KiB all_reduce, us per call (slowest rank's median), one column per round")
    for gap, v in res.items():
        print(f"matmul, then {2 + gap:4.1f} ms after the barrier: " + "  ".join(f"{x:6.1f}" for x in v))
comm.Free()
mcrdl.destroy_process_group()
