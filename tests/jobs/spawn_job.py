"""Ranks started by ``torch.multiprocessing.spawn`` (no launcher at all), running
torch_backend_ops_job.py torch-first: the usual mp.spawn recipe sets MASTER_ADDR and
MASTER_PORT and calls ``init_process_group("mcrdl", rank=..., world_size=...)``.

Usage: spawn_job.py NPROCS PORT DEFAULT_BACKEND"""
import os
import runpy
import sys
from pathlib import Path

import torch.multiprocessing as mp

JOB = Path(__file__).with_name("torch_backend_ops_job.py")


def rank_main(rank: int, nprocs: int, port: int, backend: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(nprocs))
    sys.path.insert(0, str(JOB.parent))
    sys.argv = [str(JOB), backend, "torch-first"]
    runpy.run_path(str(JOB), run_name="__main__")


if __name__ == "__main__":
    n, port, backend = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    mp.spawn(rank_main, args=(n, port, backend), nprocs=n)
    print(f"spawn_job: {n} ranks done", flush=True)
