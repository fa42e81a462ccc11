"""torch's own gloo aborts at exit when an all_reduce is still running:
`python benchmarks/faults/gloo_exit_abort.py --runs 20`.

Each run is a 2-rank job (ranks started with torchrun's variables): 5 blocking
all_reduces of 64 K floats, rank 1 sleeps 0.5 s, then each rank starts one
more all_reduce with ``async_op=True``, drops its Work and ends, without
destroy_process_group. The job is counted as aborted when a rank dies of
SIGABRT or prints ``terminate called without an active exception``.

Why (a core dump's backtrace, torch 2.13.0, Python 3.11): the Work's last
reference is gloo's worker thread; when the op completes, ``runLoop`` destroys
it, its tensors give back their Python objects, which needs the GIL; the
interpreter is finalizing, so ``take_gil`` calls ``pthread_exit`` on the
worker, whose forced unwind crosses the Work's (noexcept) destructor:
``std::terminate``. Backends: ``gloo`` (torch's own), ``gloo+exit``
(an atexit handler that runs a barrier and destroy_process_group before
finalization) and ``mcrdl`` (the same job on "mcrdl" with every all_reduce on
gloo, ``MCRDL_OP_BACKENDS=all_reduce:gloo``; mcrdl's exit handler waits for
outstanding work first).
"""
import argparse
import atexit
import os
import socket
import subprocess
import sys
import time

N, STEPS = 65536, 5


def rank_main(backend: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("mcrdl" if backend == "mcrdl" else "gloo")
    if backend == "gloo+exit":
        @atexit.register
        def _leave():
            dist.barrier()  # gloo runs it after every earlier op, dropped ones too
            dist.destroy_process_group()
    for _ in range(STEPS):
        dist.all_reduce(torch.ones(N))
    if dist.get_rank() == 1:
        time.sleep(0.5)
    dist.all_reduce(torch.ones(N), async_op=True)  # its Work dropped at once


def job(backend: str) -> bool:
    """One 2-rank job; True when a rank aborted."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1", "MCRDL_OP_BACKENDS": "all_reduce:gloo"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank-of", backend],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    aborted = False
    for p in procs:
        _, err = p.communicate(timeout=120)
        aborted |= p.returncode in (-6, 134) or "terminate called" in err
    return aborted


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--backends", default="gloo,gloo+exit,mcrdl")
    p.add_argument("--rank-of", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_of:
        return rank_main(args.rank_of)
    from rich.progress import Progress
    backends = args.backends.split(",")
    aborted = dict.fromkeys(backends, 0)
    with Progress() as progress:
        task = progress.add_task("jobs", total=args.runs * len(backends))
        for _ in range(args.runs):  # interleaved: the machine's load falls on all alike
            for backend in backends:
                aborted[backend] += job(backend)
                progress.advance(task)
    for backend in backends:
        print(f"{backend:10s} {aborted[backend]}/{args.runs} jobs aborted at exit")


if __name__ == "__main__":
    main()
