"""The shm backend (DeepSpeed's shared-memory all-reduce) through the selector,
with a table that prefers it for every all_reduce: what it serves runs on it
and equals the local reference; everything it cannot do falls through to the
next library, also equal to the reference. Parts (argv[1:], default all):

matrix   every dtype x reduction x size x sync/async x group
views    non-contiguous views (the API's contiguous stand-in, copied back)
narrow   bfloat16/float16 on a host without AVX-512 (the level is lowered)
mixed    hazard 1 (a 64 MB MPI message outstanding across it) and program order
files    no segment of this job left in /dev/shm after its first op
threads  more torch threads than the rank's share of the cores: the kernels use the share
repeat   many all_reduces of job-specific values (two jobs at once: test_shm.py)
stop     rank 1 freezes inside the job; rank 0's next shm all_reduce must end
         its process with the sentinel's message (test_shm.py)
"""
import os
import signal
import subprocess
import sys
import time

import torch

import mcrdl
import verdicts
from common import DTYPES, FLOATS, check, reduced, value

PARTS = sys.argv[1:] or ["matrix", "views", "narrow", "mixed", "files", "threads"]
TABLE = {"format": "mcrdl-tuning/1", "rules": {"all_reduce": {str(n): [{"max_bytes": None, "backend": "shm"}]
                                                              for n in (2, 3, 4)}}}
timeout = float(os.environ.get("SHM_JOB_TIMEOUT", "120"))
mcrdl.init_process_group(tuning_table=TABLE, timeout=timeout)
rt = mcrdl.api.current_runtime()
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
check(mcrdl.available_backends()["shm"] == "live", "shm live", mcrdl.available_backends())
shm = rt.backends["shm"]
if rank == 0:  # (the test looks for this job's segments only: other tests' jobs make theirs meanwhile)
    print("shm segments: {}_{}_".format(*shm._names), flush=True)
OPS = {"sum": mcrdl.ReduceOp.SUM, "avg": mcrdl.ReduceOp.AVG, "max": mcrdl.ReduceOp.MAX,
       "min": mcrdl.ReduceOp.MIN, "product": mcrdl.ReduceOp.PRODUCT}
SERVED = {torch.float32} | ({torch.bfloat16, torch.float16} if shm.level >= 2 else set())  # (AVX-512: level 2)


def ran_on_shm(call):
    """Run ``call``; did it enter the shm library (exactly once)?"""
    before = shm.lib.counts()[0]
    work = call()
    if work is not None:
        work.wait()
    return shm.lib.counts()[0] - before == 1


def matrix():
    groups = [(None, list(range(world))), (mcrdl.new_group(range(world)), list(range(world)))]
    if world >= 4:
        groups.append((mcrdl.new_group([1, 3]), [1, 3]))
    for group, ranks in groups:
        world_group = group is None
        for dtype in DTYPES:
            for opname, op in OPS.items():
                if dtype == torch.bool and opname in ("avg", "product"):
                    continue
                if opname == "avg" and dtype not in FLOATS:
                    continue
                sizes = (1, 7, 1000) if dtype != torch.float32 or opname != "sum" else (1, 7, 1000, 300_001, 9_000_001)
                for numel in sizes:
                    for async_op in (False, True):
                        if rank not in ranks:
                            continue
                        tag = f"[group={ranks}{'' if world_group else ' (new_group)'} {dtype} {opname} numel={numel} async={async_op}]"
                        served = world_group and dtype in SERVED and opname in ("sum", "avg")
                        # selected async calls go to the next library (async_calls = False);
                        # backend="shm" still runs them there, on the worker thread
                        for backend in (None, "shm") if async_op and served else (None,):
                            for _ in range(2):  # the first call plans, the second runs from the plan
                                t = value(ranks.index(rank), numel, dtype, opname == "product")
                                on = ran_on_shm(lambda: mcrdl.all_reduce(t, op=op, group=group, async_op=async_op,
                                                                         backend=backend))
                                want = reduced(range(len(ranks)), numel, dtype, opname)
                                check(torch.equal(t, want), f"result {tag} backend={backend}", t[:8], want[:8])
                                expected = served and (backend == "shm" or not async_op)
                                check(on == expected, f"ran on shm {tag} backend={backend}", on, "expected", expected)
    verdicts.finished("matrix")


def views():
    square = value(rank, 1000, torch.float32).view(10, 100)  # 2-D, contiguous
    check(ran_on_shm(lambda: mcrdl.all_reduce(square)), "2-D tensor on shm")
    check(torch.equal(square.view(-1), reduced(range(world), 1000, torch.float32, "sum")), "2-D result", square[0, :4])
    base = torch.stack([value(rank, 1000, torch.float32), torch.full((1000,), -7.0)], dim=1)  # (1000, 2)
    view = base[:, 0]  # stride 2
    check(not view.is_contiguous(), "a strided view")
    for async_op in (False, True):
        for _ in range(2):
            view.copy_(value(rank, 1000, torch.float32))
            on = ran_on_shm(lambda: mcrdl.all_reduce(view, async_op=async_op, backend="shm" if async_op else None))
            check(on, f"view on shm async={async_op}")
            check(torch.equal(view, reduced(range(world), 1000, torch.float32, "sum")), "view result", view[:4])
            check(torch.all(base[:, 1] == -7.0), "the other column untouched", base[:4, 1])
    verdicts.finished("views")


def narrow():
    level, shm.level = shm.level, 1  # as on an AVX2-only host
    rt.selector._capable.clear()
    rt.selector._cache.clear()
    rt.world.plans.clear()
    try:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for async_op in (False, True):
                t = value(rank, 1000, dtype)
                on = ran_on_shm(lambda: mcrdl.all_reduce(t, async_op=async_op))
                check(torch.equal(t, reduced(range(world), 1000, dtype, "sum")), f"{dtype} result on level 1", t[:4])
                check(on == (dtype == torch.float32 and not async_op), f"{dtype} on shm at level 1", on)
    finally:
        shm.level = level
        rt.selector._capable.clear()
        rt.selector._cache.clear()
        rt.world.plans.clear()
    verdicts.finished("narrow")


def mixed():
    # hazard 1: rank 0's 64 MB MPI receive needs its progress while it is in shm's all-reduce,
    # which rank 1 reaches only once its send completed
    big = torch.full((16 << 20,), float(rank))
    t = torch.ones(1000)
    if rank == 0:
        work = mcrdl.irecv(big, 1, backend="mpi")
        check(ran_on_shm(lambda: mcrdl.all_reduce(t)), "all_reduce on shm beside an MPI receive")
        work.wait()
        check(torch.all(big == 1.0), "the 64 MB message", big[:4])
    elif rank == 1:
        mcrdl.isend(big, 0, backend="mpi").wait()
        check(ran_on_shm(lambda: mcrdl.all_reduce(t)), "all_reduce on shm after the send")
    else:
        mcrdl.all_reduce(t)
    check(torch.all(t == world), "all_reduce result beside MPI", t[:4])
    # program order: an MPI all_reduce of a tensor an async shm all_reduce writes waits for it
    for n in (1000, 1 << 20):
        t = torch.full((n,), float(rank + 1))
        work = mcrdl.all_reduce(t, async_op=True, backend="shm")
        check(work.backend == "shm", "async all_reduce on shm", work.backend)
        mcrdl.all_reduce(t, backend="mpi")
        total = world * (world + 1) / 2
        check(torch.all(t == total * world), f"ordered after shm ({n})", t[:4])
        work.wait()
    verdicts.finished("mixed")


def files():
    mcrdl.all_reduce(torch.ones(4))  # (the segments are made at the first op)
    job, tag = shm._names
    left = [f for f in os.listdir("/dev/shm") if f"_{job}_{tag}_" in f]
    check(not left, "no segment of this job in /dev/shm", left)
    verdicts.finished("files")


def threads():
    """Past this rank's share of the cores the kernels' OpenMP threads wait for cores that
    spinning peers hold (2 ranks x 2 threads on 2 cores: 15 ms a call): the share caps them,
    for the op only, and torch's own setting is left as it was."""
    from mcrdl.backends.shm import thread_share

    cpus = os.cpu_count()
    mine = torch.zeros(cpus)
    mine[sorted(os.sched_getaffinity(0))] = 1
    every = torch.zeros(world * cpus)
    mcrdl.all_gather_into_tensor(every, mine, backend="mpi")
    share = thread_share(frozenset(os.sched_getaffinity(0)),
                         [frozenset(torch.nonzero(m).flatten().tolist()) for m in every.view(world, cpus)])
    before = torch.get_num_threads()
    torch.set_num_threads(share + 1)
    try:
        for async_op in (False, True):
            t = value(rank, 100_000, torch.float32)
            on = ran_on_shm(lambda: mcrdl.all_reduce(t, async_op=async_op, backend="shm" if async_op else None))
            check(on and torch.equal(t, reduced(range(world), 100_000, torch.float32, "sum")),
                  f"result on shm with {share + 1} torch threads, async={async_op}", on, t[:4])
            check(shm.lib.last_threads() == share, f"the kernels' threads (async={async_op})",
                  shm.lib.last_threads(), "expected", share)
            check(torch.get_num_threads() == share + 1, "torch's own setting kept", torch.get_num_threads())
    finally:
        torch.set_num_threads(before)
    verdicts.finished("threads")


def repeat():
    salt = int(os.environ.get("SHM_JOB_SALT", "0"))
    for i in range(300):
        t = torch.full((1 << (i % 17),), float(rank + 1 + salt * 1000 + i))
        mcrdl.all_reduce(t)
        want = sum(r + 1 + salt * 1000 + i for r in range(world))
        check(torch.all(t == want), f"repeat {i} of job {salt}", t[:4], want)
    verdicts.finished("repeat")


def stop():
    mcrdl.all_reduce(torch.ones(4))
    if rank == 1:
        # (resumed after 30 s at the latest, so the job ends even where the launcher's
        # signals cannot reach a stopped process: its next all_reduce meets a peer gone)
        subprocess.Popen(["sh", "-c", f"sleep 30; kill -CONT {os.getpid()}"], start_new_session=True,
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print("rank 1 freezes", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(0.5)
    mcrdl.all_reduce(torch.ones(4))  # never completes: the sentinel ends this process
    check(False, "rank 0 still running after the sentinel's deadline")


for part in PARTS:
    globals()[part]()
mcrdl.destroy_process_group()
