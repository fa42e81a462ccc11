"""Every op through each of mcrdl's drivers, called again and again with fresh
inputs, checked against local references: the API's own driver (csrc/driver.cpp's
compiled ``drive`` where it built: its calls run from the plan, with the compiled
starters called from C) and the general path (``ops.general``, no plan: what the
pure-Python build runs), x dtypes x sizes from 0 B to 4 MiB x blocking/async, on
every live CPU backend.

    paths_job.py [--sizes 0,1,7,16384,1048576] [backend ...]
"""
import argparse
import functools
import time

import torch

import mcrdl
from mcrdl.backends import OPS  # the libraries that have every op
import common
import verdicts
from mcrdl import api, facts, ops
from mcrdl.integrations.torch_backend import ProcessGroupMCRDL

mcrdl.init_process_group(timeout=120)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
engine = api.current_runtime().engine
verdicts.set_rank(rank)
ALL, ROOT = tuple(range(world)), world - 1
#: the driver the API's functions call, swapped per pass (``api.run_op``)
DRIVERS = {"api": api.run_op, "general": ops.general}
CALLS = 3  # per driver: the first makes the plan
DTYPES = (torch.float32, torch.int32, torch.float16)  # MPI reduces float16 widened: the general path
LARGE = 16 << 10  # from here float32 only


@functools.cache
def ref(r, n, dtype, salt):
    """common.value, made once (references are only read)."""
    return common.value(r, n, dtype, salt=salt)


def value(r, n, dtype, salt):
    """A fresh copy of rank r's input (ops write into theirs)."""
    return ref(r, n, dtype, salt).clone()


@functools.cache
def reduced(ranks, n, dtype, op, salt):
    return common.reduced(ranks, n, dtype, op, salt)


def blocks(dtype, n, salt):
    """This rank's n elements for each rank, in one buffer."""
    return value(rank, world * n, dtype, salt)


def all_reduce(kw, dtype, n, s):
    t = value(rank, n, dtype, s)
    return mcrdl.all_reduce(t, **kw), [(t, reduced(ALL, n, dtype, "sum", s))]


def broadcast(kw, dtype, n, s):
    t = value(rank, n, dtype, s)
    return mcrdl.broadcast(t, ROOT, **kw), [(t, ref(ROOT, n, dtype, s))]


def reduce(kw, dtype, n, s):
    t = value(rank, n, dtype, s)
    return mcrdl.reduce(t, ROOT, **kw), [(t, reduced(ALL, n, dtype, "sum", s))] if rank == ROOT else []


def all_gather_into_tensor(kw, dtype, n, s):
    out = torch.empty(world * n, dtype=dtype)
    work = mcrdl.all_gather_into_tensor(out, value(rank, n, dtype, s), **kw)
    return work, [(out, torch.cat([ref(r, n, dtype, s) for r in ALL]))]


def results_are(work, parts, what):
    """An async Work's result() lists the blocks a caller's list passed (on every path)."""
    if work is not None:
        verdicts.check(f"[{work.backend} {what}] result() is the list's blocks",
                       len(work.result()) == len(parts) and all(a is b for a, b in zip(work.result(), parts)),
                       "its blocks", work.result())


def all_gather(kw, dtype, n, s):  # the list as views of one buffer: run as the flat op
    out = torch.empty(world * n, dtype=dtype)
    parts = list(out.chunk(world)) if n else [torch.empty(0, dtype=dtype)] * world
    work = mcrdl.all_gather(parts, value(rank, n, dtype, s), **kw)
    results_are(work, parts, "all_gather")
    return work, [(out, torch.cat([ref(r, n, dtype, s) for r in ALL]))]


def reduce_scatter_tensor(kw, dtype, n, s):
    out = torch.empty(n, dtype=dtype)
    work = mcrdl.reduce_scatter_tensor(out, blocks(dtype, n, s), **kw)
    return work, [(out, reduced(ALL, world * n, dtype, "sum", s)[rank * n:(rank + 1) * n])]


def reduce_scatter(kw, dtype, n, s):
    out = torch.empty(n, dtype=dtype)
    full = blocks(dtype, n, s)
    work = mcrdl.reduce_scatter(out, list(full.chunk(world)) if n else [full] * world, **kw)
    return work, [(out, reduced(ALL, world * n, dtype, "sum", s)[rank * n:(rank + 1) * n])]


def gather(kw, dtype, n, s):
    whole = torch.empty(world, n, dtype=dtype)
    parts = list(whole.unbind(0)) if rank == ROOT else None
    work = mcrdl.gather(value(rank, n, dtype, s), parts, ROOT, **kw)
    results_are(work, parts or [], "gather")
    return work, [(whole.view(-1), torch.cat([ref(r, n, dtype, s) for r in ALL]))] if rank == ROOT else []


def scatter(kw, dtype, n, s):
    out = torch.empty(n, dtype=dtype)
    whole = torch.stack([ref(100 + r, n, dtype, s) for r in ALL])
    work = mcrdl.scatter(out, list(whole.unbind(0)) if rank == ROOT else None, ROOT, **kw)
    return work, [(out, ref(100 + rank, n, dtype, s))]


def all_to_all_single(kw, dtype, n, s):
    out = torch.empty(world * n, dtype=dtype)
    work = mcrdl.all_to_all_single(out, blocks(dtype, n, s), **kw)
    want = torch.cat([ref(r, world * n, dtype, s)[rank * n:(rank + 1) * n] for r in ALL])
    return work, [(out, want)]


def all_to_all_single_uneven(kw, dtype, n, s):
    """Rank r sends (r + j) % 3 + n // 2 rows of 2 to rank j."""
    rows = lambda src, dst: (src + dst) % 3 + n // 2  # noqa: E731
    inp = value(rank, 2 * sum(rows(rank, j) for j in ALL), dtype, s).view(-1, 2)
    out = torch.empty(sum(rows(r, rank) for r in ALL), 2, dtype=dtype)
    work = mcrdl.all_to_all_single(out, inp, [rows(r, rank) for r in ALL], [rows(rank, j) for j in ALL], **kw)
    pieces = []
    for r in ALL:
        sent = ref(r, 2 * sum(rows(r, j) for j in ALL), dtype, s).view(-1, 2)
        at = sum(rows(r, j) for j in range(rank))
        pieces.append(sent[at:at + rows(r, rank)])
    return work, [(out, torch.cat(pieces))]


def send_recv(kw, dtype, n, s):
    """A ring: each rank sends to the next and receives from the previous (blocking:
    even ranks send first, odd ranks receive first; the job runs on an even number of ranks)."""
    nxt, prv, backend = (rank + 1) % world, (rank - 1) % world, kw["backend"]
    got, src = torch.empty(n, dtype=dtype), value(rank, n, dtype, s)
    if kw["async_op"]:  # (odd calls receive from any source: only prv sends this tag here)
        any_source = s % 2 == 1
        receive = mcrdl.irecv(got, None if any_source else prv, tag=s, backend=backend)
        for work in [receive, mcrdl.isend(src, nxt, tag=s, backend=backend)]:
            work.wait()
        verdicts.check(f"[{backend} irecv numel={n} src={'any' if any_source else 'prv'}] source_rank",
                       receive.source_rank() == prv, prv, receive.source_rank())
    elif rank % 2 == 0:
        mcrdl.send(src, nxt, tag=s, backend=backend)
        mcrdl.recv(got, prv, tag=s, backend=backend)
    else:
        mcrdl.recv(got, prv, tag=s, backend=backend)
        mcrdl.send(src, nxt, tag=s, backend=backend)
    return None, [(got, ref(prv, n, dtype, s))]


CASES = [all_reduce, broadcast, reduce, all_gather_into_tensor, all_gather, reduce_scatter_tensor, reduce_scatter,
         gather, scatter, all_to_all_single, all_to_all_single_uneven, send_recv]

parser = argparse.ArgumentParser()
parser.add_argument("--sizes", default="0,1,7,16384,1048576", help="elements per rank (float32: up to 4 MiB)")
parser.add_argument("backends", nargs="*")
args = parser.parse_args()
calls = 0
for backend in args.backends or mcrdl.live_backends("cpu", ops=OPS):
    for dtype in DTYPES:
        for numel in map(int, args.sizes.split(",")):
            if numel >= LARGE and dtype is not torch.float32:
                continue
            for async_op in (False, True):
                kw = dict(async_op=async_op, backend=backend)
                for case in CASES:
                    for driver, run in DRIVERS.items():
                        api.run_op = run
                        for call in range(CALLS):
                            tag = (f"[{backend} {case.__name__} {dtype} numel={numel} async={async_op} "
                                   f"{driver} call {call}]")
                            work, checks = case(kw, dtype, numel, call)
                            if async_op and case is not send_recv:
                                verdicts.check(tag + " returns a Work", isinstance(work, mcrdl.Work), "a Work", work)
                                # (csrc/engine.cpp's track makes the API's from a plan: every slot Work.__init__ sets)
                                unset = [a for a in mcrdl.Work.__slots__ if not hasattr(work, a)]
                                verdicts.check(tag + " has every slot set", not unset, [], unset)
                                left = work._deadline - time.monotonic()  # (no group: 0 B, done at once)
                                due = 120 if work.group is not None else mcrdl.work.DEFAULT_TIMEOUT
                                verdicts.check(tag + " is due the group's timeout from now", due - 10 < left <= due,
                                               f"{due - 10}-{due} s", left)
                                work.wait()
                            elif case is not send_recv:
                                verdicts.check(tag + " returns None", work is None, None, work)
                            verdicts.check_equal(tag, [g for g, _ in checks], [w for _, w in checks])
                            if async_op:  # a waited work leaves the engine, on every wait path
                                verdicts.check(tag + " leaves nothing outstanding", not engine.outstanding, [],
                                               list(engine.outstanding))
                            calls += 1
                api.run_op = DRIVERS["api"]

def born_done(tries: int = 20) -> int:
    """Small isends (eager) and irecvs of a message already here complete in their
    start: the compiled driver makes their Works done, never outstanding
    (csrc/driver.cpp's start_async). Each must behave as a waited Work; how many
    sends and receives were born done."""
    nxt, prv, born = (rank + 1) % world, (rank - 1) % world, 0
    for i in range(tries):
        src, got = value(rank, 4, torch.float32, i), torch.empty(4)
        send = mcrdl.isend(src, nxt, tag=1000, backend="mpi")  # (one tag: the calls after the first run from the plan)
        born += send not in engine.outstanding
        mcrdl.barrier(backend="mpi")  # (prv's message is here)
        receive = mcrdl.irecv(got, prv, tag=1000, backend="mpi")
        born += receive not in engine.outstanding
        tag = f"[mpi born done try {i}]"
        for work in (send, receive):
            verdicts.check(tag + f" {work.op} completes", work.is_completed() and work.wait() and work.is_success()
                           and work.exception() is None, True, work)
        verdicts.check_equal(tag + " received", [got, receive.result()[0], receive.get_future().wait()[0]],
                             [ref(prv, 4, torch.float32, i)] * 3)
        verdicts.check(tag + " source_rank", receive.source_rank() == prv, prv, receive.source_rank())
        verdicts.check(tag + " send's result", send.result()[0] is src, "its tensor", send.result())
        verdicts.check(tag + " leaves nothing outstanding", not engine.outstanding, [], list(engine.outstanding))
        # torch's send and recv (ProcessGroupMCRDL): a Work born done stands for a completed op
        got = torch.empty(4)
        send = torch_group.send([src], nxt, 1001)
        born += send._work is None
        mcrdl.barrier(backend="mpi")
        receive = torch_group.recv([got], prv, 1001)
        born += receive._work is None
        for work in (send, receive):
            verdicts.check(tag + f" torch {work._op} completes", work.is_completed() and work.wait()
                           and work.is_success() and work.exception() is None, True, work)
        verdicts.check_equal(tag + " torch received", [got, receive.result()[0], receive.get_future().wait()[0]],
                             [ref(prv, 4, torch.float32, i)] * 3)
    return born


def lock_guards_async_works(hold_s: float = 0.3) -> bool:
    """While another thread holds the engine's lock, an async all-reduce from its
    plan (the compiled driver's track) cannot become outstanding, nor its wait
    (finished) complete it: each returns only once the lock is free, right."""
    import threading
    x = torch.ones(4)
    mcrdl.all_reduce(x, async_op=True, backend="mpi").wait()  # (the plan, built)
    ok = True
    for step in ("start", "wait"):
        x.fill_(rank + 1)
        work = mcrdl.all_reduce(x, async_op=True, backend="mpi") if step == "wait" else None
        held = threading.Event()

        def hold():
            with engine._lock:
                held.set()
                time.sleep(hold_s)
        holder = threading.Thread(target=hold)
        holder.start()
        held.wait()
        start = time.monotonic()
        if work is None:
            work = mcrdl.all_reduce(x, async_op=True, backend="mpi")
        else:
            work.wait()
        waited = time.monotonic() - start
        holder.join()
        work.wait()
        ok &= waited >= hold_s * 0.8 and torch.equal(x, torch.full((4,), float(sum(range(1, world + 1)))))
    return ok


def async_avg_waits_compiled(tries: int = 5, patience_s: float = 10.0) -> bool:
    """An async AVG from its plan stays on the compiled path: its divide is the
    compiled completion step (csrc/engine.cpp's Divide), which the compiled wait
    (``finished``) runs, so that wait completes the work, divided."""
    finished = facts.load().finished
    mcrdl.all_reduce(torch.ones(4), op=mcrdl.ReduceOp.AVG, async_op=True, backend="mpi").wait()  # (the plan)
    ok = True
    for i in range(tries):
        x = value(rank, 4, torch.float32, i)
        work = mcrdl.all_reduce(x, op=mcrdl.ReduceOp.AVG, async_op=True, backend="mpi")
        deadline, done = time.monotonic() + patience_s, False
        while not done and time.monotonic() < deadline:
            done = finished(work, 64, 1)
        work.wait()  # (where the compiled wait never completed it)
        ok &= done and work not in engine.outstanding and torch.allclose(x, reduced(ALL, 4, torch.float32, "avg", i))
    return ok


if "mpi" in (args.backends or mcrdl.live_backends("cpu", ops=OPS)):
    torch_group = ProcessGroupMCRDL(api.current_runtime().world, rank, world)
    born = born_done()
    compiled = facts.load() is not facts  # (pure Python: every Work is outstanding until waited)
    verdicts.check("some sends and receives are born done on the compiled path only", (born > 0) == compiled,
                   "some" if compiled else 0, born)
    # (track() and finished() take only csrc/engine.cpp's lock: with another, every async MPI work goes through Python)
    verdicts.check("the engine's lock is csrc/engine.cpp's RLock where compiled",
                   type(engine._lock).__module__ == ("mcrdl_facts" if compiled else "_thread"),
                   "mcrdl_facts" if compiled else "_thread", type(engine._lock))
    verdicts.check("the lock guards async works on every path", lock_guards_async_works(), True, False)
    if compiled:
        verdicts.check("an async AVG completes on the compiled wait, divided", async_avg_waits_compiled(), True, False)
verdicts.check("paths done", True)
print(f"rank {rank}: {calls} calls through {len(DRIVERS)} drivers")
mcrdl.destroy_process_group()
