"""The ccl backend (oneCCL's C API) through the selector, with a table that
prefers it for every op: what it serves runs on it and equals the local
reference; what it declines falls through to the next library, also equal to
the reference. Parts (argv[1:], default all):

lazy     before any ccl op the library is not loaded and no ccl thread runs
matrix   every declared op x dtype x size (4 B .. 4 MiB) x sync/async x group
fall     what it declines (complex dtypes, gather, send/recv) runs elsewhere, right
mixed    a 64 MB MPI message outstanding across a ccl op, and program order
stop     rank 1 freezes; rank 0's next ccl op must end its process with the
         sentinel's message (test_ccl.py)
"""
import os
import signal
import subprocess
import sys
import threading
import time

import torch

import mcrdl
import verdicts
from common import check, reduced, value
from mcrdl.backends import ccl_lib

PARTS = sys.argv[1:] or ["lazy", "matrix", "fall", "mixed"]
# (a table cannot name ccl for gather or p2p: it has neither, and the table is refused)
CLASSES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "scatter", "all_to_all",
           "barrier")
TABLE = {"format": "mcrdl-tuning/1", "rules": {c: {str(n): [{"max_bytes": None, "backend": "ccl"}]
                                                     for n in (1, 2, 3, 4)} for c in CLASSES}}
timeout = float(os.environ.get("CCL_JOB_TIMEOUT", "120"))
mcrdl.init_process_group(tuning_table=TABLE, timeout=timeout)
rt = mcrdl.api.current_runtime()
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
check(mcrdl.available_backends()["ccl"] == "live", "ccl live", mcrdl.available_backends())
ccl = rt.backends["ccl"]
OPS = {"sum": mcrdl.ReduceOp.SUM, "avg": mcrdl.ReduceOp.AVG, "max": mcrdl.ReduceOp.MAX,
       "min": mcrdl.ReduceOp.MIN, "product": mcrdl.ReduceOp.PRODUCT}
DTYPES = (torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.float16,
          torch.int8, torch.uint8)
FLOATS = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def on_ccl(call):
    """Run ``call``; did it enter the library exactly once?"""
    before = ccl._started
    work = call()
    if work is not None:
        work.wait()
    return ccl._started - before == 1


def lazy():
    t = torch.ones(8)
    mcrdl.all_reduce(t, backend="mpi" if "mpi" in rt.backends else "gloo")
    check(torch.all(t == world), "all_reduce elsewhere", t)
    check(not ccl_lib.loaded(), "oneCCL not loaded before its first op")
    names = [th.name for th in threading.enumerate()]
    check(not any("ccl" in n for n in names), "no ccl thread before its first op", names)
    t = torch.ones(8)
    check(on_ccl(lambda: mcrdl.all_reduce(t)), "first op on ccl")
    check(torch.all(t == world), "first ccl all_reduce", t)
    check(ccl_lib.loaded(), "oneCCL loaded at its first op")
    verdicts.finished("lazy")


def sizes(dtype):
    """4 B .. 4 MiB for float32, smaller for the rest (numel)."""
    if dtype == torch.float32:
        return (1, 7, 1000, 300_001, 1 << 20)
    if dtype in (torch.bfloat16, torch.int64):
        return (1, 7, 300_001)
    return (1, 1000)


def run(tag, want_ccl, call):
    for _ in range(2):  # the first call plans, the second runs from the plan
        got = call()
        if got is not None:
            check(got == want_ccl, "ran on ccl " + tag, got, "expected", want_ccl)


def matrix():
    groups = [(None, list(range(world))), (mcrdl.new_group(range(world)), list(range(world)))]
    if world >= 4:
        groups.append((mcrdl.new_group([1, 3]), [1, 3]))
    for group, ranks in groups:
        if rank not in ranks:
            continue
        n, g = len(ranks), ranks.index(rank)
        root = ranks[-1]
        served = group is None  # (the backend declines sub-groups: they fall through, still right)
        for dtype in DTYPES:
            for numel in sizes(dtype):
                for async_op in (False, True):
                    kw = dict(group=group, async_op=async_op)
                    tag = f"[group={ranks} {dtype} numel={numel} async={async_op}]"
                    big = numel > 1000
                    for opname, op in OPS.items():
                        if opname == "avg" and dtype not in FLOATS:
                            continue
                        if big and opname not in ("sum", "max"):
                            continue

                        def all_reduce():
                            t = value(g, numel, dtype, opname == "product")
                            on = on_ccl(lambda: mcrdl.all_reduce(t, op=op, **kw))
                            check(torch.equal(t, reduced(range(n), numel, dtype, opname)),
                                  f"all_reduce {opname} {tag}", t[:8])
                            return on
                        run(f"all_reduce {opname} {tag}", served, all_reduce)

                        def reduce_():
                            t = value(g, numel, dtype, opname == "product")
                            on = on_ccl(lambda: mcrdl.reduce(t, dst=root, op=op, **kw))
                            if rank == root:
                                check(torch.equal(t, reduced(range(n), numel, dtype, opname)),
                                      f"reduce {opname} {tag}", t[:8])
                            return on
                        if opname != "avg":
                            run(f"reduce {opname} {tag}", served, reduce_)

                        def reduce_scatter():
                            full = value(g, n * numel, dtype, opname == "product")
                            out = torch.empty(numel, dtype=dtype)
                            on = on_ccl(lambda: mcrdl.reduce_scatter_tensor(out, full, op=op, **kw))
                            want = reduced(range(n), n * numel, dtype, opname)[g * numel:(g + 1) * numel]
                            check(torch.equal(out, want), f"reduce_scatter_tensor {opname} {tag}", out[:8], want[:8])
                            return on
                        if not big or opname == "sum":
                            run(f"reduce_scatter {opname} {tag}", served, reduce_scatter)

                    def broadcast():
                        t = value(g, numel, dtype)
                        on = on_ccl(lambda: mcrdl.broadcast(t, src=root, **kw))
                        check(torch.equal(t, value(n - 1, numel, dtype)), "broadcast " + tag, t[:8])
                        return on
                    run("broadcast " + tag, served, broadcast)

                    def all_gather():
                        inp = value(g, numel, dtype)
                        out = torch.empty(n * numel, dtype=dtype)
                        on = on_ccl(lambda: mcrdl.all_gather_into_tensor(out, inp, **kw))
                        check(torch.equal(out, torch.cat([value(r, numel, dtype) for r in range(n)])),
                              "all_gather_into_tensor " + tag)
                        # in place: the input is this rank's block of the output
                        out = torch.cat([value(r, numel, dtype) if r == g else torch.zeros(numel, dtype=dtype)
                                         for r in range(n)])
                        on2 = on_ccl(lambda: mcrdl.all_gather_into_tensor(out, out[g * numel:(g + 1) * numel], **kw))
                        check(torch.equal(out, torch.cat([value(r, numel, dtype) for r in range(n)])),
                              "all_gather_into_tensor in place " + tag)
                        return on and on2
                    run("all_gather " + tag, served, all_gather)

                    def scatter():
                        parts = [value(100 + i, numel, dtype) for i in range(n)] if rank == root else None
                        out = torch.empty(numel, dtype=dtype)
                        on = on_ccl(lambda: mcrdl.scatter(out, parts, src=root, **kw))
                        check(torch.equal(out, value(100 + g, numel, dtype)), "scatter " + tag, out[:8])
                        return on
                    run("scatter " + tag, served, scatter)

                    def all_to_all():
                        inp = value(g, n * numel, dtype)
                        out = torch.empty(n * numel, dtype=dtype)
                        on = on_ccl(lambda: mcrdl.all_to_all_single(out, inp, **kw))
                        want = torch.cat([value(r, n * numel, dtype)[g * numel:(g + 1) * numel] for r in range(n)])
                        check(torch.equal(out, want), "all_to_all_single " + tag)
                        sends = lambda i: [(i + j) % 3 + (j == 0) * numel for j in range(n)]  # rows i -> j
                        ins, outs = sends(g), [sends(i)[g] for i in range(n)]
                        inp = value(g, 2 * sum(ins), dtype).view(-1, 2)
                        out = torch.empty(sum(outs), 2, dtype=dtype)
                        on2 = on_ccl(lambda: mcrdl.all_to_all_single(out, inp, outs, ins, **kw))
                        want = torch.cat([value(i, 2 * sum(sends(i)), dtype).view(-1, 2)[
                            sum(sends(i)[:g]):sum(sends(i)[:g + 1])] for i in range(n)])
                        check(torch.equal(out, want), "all_to_all_single uneven " + tag)
                        return on and on2
                    run("all_to_all " + tag, served, all_to_all)

            # bool moves as uint8 in the ops that only move data
            t = torch.arange(9) % (g + 2) == 0
            check(on_ccl(lambda: mcrdl.broadcast(t, src=root, group=group)) == served, "bool broadcast on ccl")
            check(torch.equal(t, torch.arange(9) % (n + 1) == 0), "bool broadcast", t)
        for async_op in (False, True):
            check(on_ccl(lambda: mcrdl.barrier(group=group, async_op=async_op)) == served, f"barrier on ccl {ranks}")
        t = torch.zeros(0)
        mcrdl.all_reduce(t, group=group)  # (no elements: nothing to do)
    verdicts.finished("matrix")


def fall():
    # a dtype the library has not: the next library, result right
    for opname in ("sum", "max", "product"):
        for async_op in (False, True):
            t = value(rank, 1000, torch.int16, opname == "product")
            check(not on_ccl(lambda: mcrdl.all_reduce(t, op=OPS[opname], async_op=async_op)), "int16 not on ccl")
            check(torch.equal(t, reduced(range(world), 1000, torch.int16, opname)), f"int16 all_reduce {opname}", t[:8])
    t = value(rank, 7, torch.int16)
    check(not on_ccl(lambda: mcrdl.broadcast(t, src=0)), "int16 broadcast not on ccl")
    check(torch.equal(t, value(0, 7, torch.int16)), "int16 broadcast", t)
    # ops the C API has not
    glist = [torch.empty(3) for _ in range(world)] if rank == 0 else None
    check(not on_ccl(lambda: mcrdl.gather(torch.full((3,), float(rank)), glist, dst=0)), "gather not on ccl")
    if rank == 0:
        check(all(torch.all(x == r) for r, x in enumerate(glist)), "gather", glist)
    if world > 1:
        t = torch.full((4,), float(rank))
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        works = [mcrdl.irecv(t2 := torch.empty(4), prv, tag=7), mcrdl.isend(t, nxt, tag=7)]
        check(all(w.backend != "ccl" for w in works), "p2p not on ccl", [w.backend for w in works])
        for w in works:
            w.wait()
        check(torch.all(t2 == prv), "p2p result", t2)
    # explicit backend= of what it declines: refused by name
    try:
        mcrdl.all_reduce(torch.zeros(2, dtype=torch.int16), backend="ccl")
        check(False, "int16 with backend='ccl' refused")
    except mcrdl.UnsupportedError as exc:
        check("the library has no torch.int16" in str(exc), "the reason", exc)
    try:
        mcrdl.gather(torch.zeros(2), [torch.zeros(2) for _ in range(world)] if rank == 0 else None, backend="ccl")
        check(False, "gather with backend='ccl' refused")
    except mcrdl.UnsupportedError as exc:
        check("has no gather" in str(exc), "the reason", exc)
    verdicts.finished("fall")


def mixed():
    if "mpi" in rt.backends and world >= 2:
        big = torch.full((16 << 20,), float(rank))
        t = torch.ones(1000)
        if rank == 0:
            work = mcrdl.irecv(big, 1, backend="mpi")
            check(on_ccl(lambda: mcrdl.all_reduce(t)), "all_reduce on ccl beside an MPI receive")
            work.wait()
            check(torch.all(big == 1.0), "the 64 MB message", big[:4])
        elif rank == 1:
            mcrdl.isend(big, 0, backend="mpi").wait()
            check(on_ccl(lambda: mcrdl.all_reduce(t)), "all_reduce on ccl after the send")
        else:
            mcrdl.all_reduce(t)
        check(torch.all(t == world), "all_reduce result beside MPI", t[:4])
    other = "mpi" if "mpi" in rt.backends else "gloo"
    for n in (1000, 1 << 20):
        t = torch.full((n,), float(rank + 1))
        work = mcrdl.all_reduce(t, async_op=True)
        check(work.backend == "ccl", "async all_reduce on ccl", work.backend)
        mcrdl.all_reduce(t, backend=other)
        total = world * (world + 1) / 2
        check(torch.all(t == total * world), f"{other} ordered after ccl ({n})", t[:4])
        work.wait()
    # many async ops queued, then one wait
    ts = [torch.full((100,), float(rank + i)) for i in range(20)]
    works = [mcrdl.all_reduce(t, async_op=True) for t in ts]
    works[-1].wait()
    for i, t in enumerate(ts):
        check(torch.all(t == sum(r + i for r in range(world))), f"queued all_reduce {i}", t[:4])
    verdicts.finished("mixed")


def stop():
    mcrdl.all_reduce(torch.ones(4))
    if rank == 1:
        # (resumed after 30 s at the latest, so the job ends even where the launcher's signals
        # cannot reach a stopped process: its next all_reduce meets a peer gone; as shm_job's)
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
