"""The same collective timed back to back (as ``mcrdl bench``) and right after
compute (as in a training step), on every rank, one call at a time after a
barrier; per call the minimum over ranks (no arrival skew), median over calls,
then the median over rounds (conditions interleaved):

    mcrdl run -n 2 examples/model/interference.py [--iters 100] [--rounds 3]

"compute" runs K matmuls of 256x512 @ 512x512 fp32 (1.5 MiB of operands, a few
ms) before each call; "sleep" idles 10 ms instead (the CPU is handed back to
whatever else runs on the host). docs/results/model_validation.md uses it to
show why a workload's calls cost more than the bench's.
"""
import argparse
import statistics
import time

import torch

import mcrdl


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    mcrdl.init_process_group()
    a, b = torch.randn(256, 512), torch.randn(512, 512)
    before = {"back to back": lambda: None,
              "after 1 matmul": lambda: a @ b,
              "after 3 matmuls": lambda: [a @ b for _ in range(3)],
              "after 10 ms sleep": lambda: time.sleep(0.01)}
    calls = {}
    for n in (32, 128 << 10):
        x, y = torch.zeros(n // 4), torch.zeros(n // 4)
        calls[f"all_reduce {n} B"] = lambda x=x: mcrdl.all_reduce(x, backend="mpi")
        calls[f"all_to_all {n} B"] = lambda x=x, y=y: mcrdl.all_to_all_single(y, x, backend="mpi")
    rows: dict = {}
    for _ in range(args.rounds):
        for name, call in calls.items():
            for cond, prep in before.items():
                ts = []
                for _ in range(args.iters):
                    prep()
                    mcrdl.barrier(backend="mpi")
                    t0 = time.perf_counter()
                    call()
                    ts.append(time.perf_counter() - t0)
                all_ts = torch.empty(mcrdl.get_world_size() * args.iters, dtype=torch.float64)
                mcrdl.all_gather_into_tensor(all_ts, torch.tensor(ts, dtype=torch.float64))
                rows.setdefault(name, {}).setdefault(cond, []).append(statistics.median(
                    all_ts.view(-1, args.iters).min(0).values.tolist()) * 1e6)
    if mcrdl.get_rank() == 0:
        print(f"{'us per call (median of min over ranks)':40s}" + "".join(f"{c:>19s}" for c in before))
        for name, r in rows.items():
            print(f"{name:40s}" + "".join(f"{statistics.median(r[c]):19.1f}" for c in before))
    mcrdl.destroy_process_group()


if __name__ == "__main__":
    main()
