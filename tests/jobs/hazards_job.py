"""Design hazards 1-4 and 6 through the public API. Usage: hazards_job.py CASE[,CASE...]
(several: in turn, each on a runtime of its own)"""
import sys
import time

import torch

import mcrdl
import verdicts
from common import check, value

cases = sys.argv[1].split(",")
TABLE = {"format": "mcrdl-tuning/1", "metadata": {"note": "hand-written for tests"},
         "rules": {"all_to_all": {"2": [{"max_bytes": 1000, "backend": "mpi"},
                                        {"max_bytes": None, "backend": "gloo"}]}}}
rank = world = None


def start(case):
    """The runtime ``case`` runs on: straddle's with a hand-written table, debug's in debug mode."""
    global rank, world
    mcrdl.init_process_group(timeout=30, tuning_table=TABLE if case == "straddle" else None,
                             debug=case == "debug")
    rank, world = mcrdl.get_rank(), mcrdl.get_world_size()


def end():
    mcrdl.barrier()
    mcrdl.destroy_process_group()


def progress():
    """Hazard 1: MPI irecv of 64 MB outstanding while this rank blocks in gloo;
    the peer reaches the gloo op only after its MPI send completed."""
    for gloo_op in ("barrier", "all_reduce", "reduce_scatter_tensor"):
        big = torch.zeros(16 << 20, dtype=torch.float32)  # 64 MB
        mcrdl.barrier(backend="mpi")
        start = time.perf_counter()
        if rank == 0:
            work = mcrdl.irecv(big, 1, backend="mpi")
        else:
            mcrdl.isend(torch.full_like(big, 7.0), 0, backend="mpi").wait()
        if gloo_op == "barrier":
            mcrdl.barrier(backend="gloo")
        elif gloo_op == "all_reduce":
            t = torch.ones(4)
            mcrdl.all_reduce(t, backend="gloo")
            check(torch.equal(t, torch.full((4,), 2.0)), "gloo all_reduce", t)
        else:  # gloo's is_completed() stays False for this op until wait()
            out = torch.empty(4)
            mcrdl.reduce_scatter_tensor(out, torch.ones(8), backend="gloo")
            check(torch.equal(out, torch.full((4,), 2.0)), "gloo reduce_scatter", out)
        if rank == 0:
            work.wait()
            check(bool((big == 7.0).all()), "irecv data")
        elapsed = time.perf_counter() - start
        print(f"rank {rank}: hazard-1 with gloo {gloo_op}: {elapsed * 1e3:.1f} ms")
        check(elapsed < 5.0, f"hazard-1 scenario took {elapsed:.1f} s")


def order():
    """Hazard 3: an op on one backend touching a tensor that an outstanding op
    of another backend writes runs after it (MPI only progresses when polled,
    so without ordering gloo would read the unreduced tensor)."""
    n = 4 << 20
    for first, second in (("mpi", "gloo"), ("gloo", "mpi")):
        t = value(rank, n, torch.float64)
        w = mcrdl.all_reduce(t, backend=first, async_op=True)
        mcrdl.all_reduce(t, backend=second)
        w.wait()
        ref = sum(value(r, n, torch.float64) for r in range(world)) * world
        check(torch.equal(t, ref), f"{first} then {second}: result differs from one-backend order")
        # a reader of a slice of a tensor being written (overlap, not identity)
        t = torch.zeros(n, dtype=torch.float64)
        if rank == 0:
            t.fill_(3.0)
        w = mcrdl.broadcast(t, 0, backend=first, async_op=True)
        out = torch.empty(world * 8, dtype=torch.float64)
        mcrdl.all_gather_into_tensor(out, t[100:108], backend=second)
        w.wait()
        check(bool((out == 3.0).all()), f"{first} broadcast then {second} all_gather of a slice", out)
    print(f"rank {rank}: program order OK")


def straddle():
    """Hazard 2: uneven all_to_all whose per-rank bytes straddle a table threshold."""
    check(world == 2, "straddle runs on 2 ranks (the table is for group size 2)")
    rows_to = [[10, 10], [200, 200]][rank]  # rank 0 sends 80 B total, rank 1 1600 B
    rows_from = [[10, 200], [10, 200]][rank]
    inp = value(rank, sum(rows_to), torch.float32)
    out = torch.empty(sum(rows_from))
    work = mcrdl.all_to_all_single(out, inp, rows_from, rows_to, async_op=True)
    work.wait()
    check(work.backend == "gloo", "expected the agreed size (1600 B) to pick gloo, got", work.backend)
    ref = torch.cat([value(r, sum([[10, 10], [200, 200]][r]), torch.float32)[
        sum([[10, 10], [200, 200]][r][:rank]):sum([[10, 10], [200, 200]][r][:rank + 1])]
        for r in range(world)])
    check(torch.equal(out, ref), "uneven all_to_all_single result")
    ins = [torch.full((5 + 195 * rank,), float(rank)) for _ in range(world)]
    outs = [torch.empty(5 + 195 * r) for r in range(world)]
    work = mcrdl.all_to_all(outs, ins, async_op=True)
    work.wait()
    check(work.backend == "gloo", "list all_to_all chose", work.backend)
    check(all(bool((o == r).all()) for r, o in enumerate(outs)), "list all_to_all result")
    print(f"rank {rank}: straddle OK ({mcrdl.explain('all_to_all', 80)})")


def debug():
    """Hazard 4: mismatched collectives raise on every rank, naming ranks and fields."""
    t = torch.ones(4)
    mcrdl.all_reduce(t)  # matched: passes
    try:
        if rank == 0:
            mcrdl.all_reduce(t)
        else:
            mcrdl.broadcast(t, 0)
    except mcrdl.CommError as exc:
        msg = str(exc)
        check("op" in msg and "rank 0" in msg and "rank 1" in msg, "message lacks ranks/fields:", msg)
        print(f"rank {rank}: caught: {msg}")
    else:
        raise AssertionError("mismatched op order was not detected")
    try:
        mcrdl.all_reduce(t, backend="mpi" if rank == 0 else "gloo")
    except mcrdl.CommError as exc:
        check("backend" in str(exc), "backend mismatch not named", exc)
    else:
        raise AssertionError("mismatched backends were not detected")
    # split sizes passed on one rank only: MPI would run Alltoall there and
    # Alltoallv on the other (ranks must agree, as with torch's MPI backend)
    inp, out = torch.ones(2 * world), torch.empty(2 * world)
    try:
        mcrdl.all_to_all_single(out, inp, *([[2] * world] * 2 if rank == 0 else []), backend="mpi")
    except mcrdl.CommError as exc:
        check("split sizes" in str(exc), "split sizes mismatch not named", exc)
    else:
        raise AssertionError("split sizes on one rank only were not detected")
    t = torch.ones(4)
    mcrdl.all_reduce(t)  # still usable after a detected mismatch
    check(torch.equal(t, torch.full((4,), float(world))), "all_reduce after mismatch", t)
    print(f"rank {rank}: debug OK")


def timeout():
    """Hazard 6: a wait with a timeout raises at its deadline, naming op and
    backend, and leaves the work usable; a work that misses its group's
    deadline fails for good (and MPI withdraws the receive)."""
    for backend in ("mpi", "gloo"):
        buf = torch.empty(4)
        if rank == 0:
            work = mcrdl.irecv(buf, 1, tag=9, backend=backend)
            start = time.perf_counter()
            try:
                work.wait(timeout=0.5)
            except mcrdl.CommTimeoutError as exc:
                elapsed = time.perf_counter() - start
                check("irecv" in str(exc) and backend in str(exc), "message:", exc)
                check(0.4 < elapsed < 5, "timed out after", elapsed)
                print(f"rank 0: {backend} timeout after {elapsed:.2f} s: {exc}")
            else:
                raise AssertionError("wait did not time out")
            work.wait()  # the peer sends after 1 s: the same work completes
            check(torch.equal(buf, torch.full((4,), 7.0)), "data after waiting again", buf)
        else:
            time.sleep(1.0)
            mcrdl.send(torch.full((4,), 7.0), 0, tag=9, backend=backend)
    short = mcrdl.new_group(range(world), timeout=1.0)
    fresh = mcrdl.new_group(range(world), timeout=1.0)  # (made while every rank is here)
    for backend in ("mpi", "gloo"):
        if rank == 0:
            work = mcrdl.irecv(torch.empty(4), 1, group=short, tag=11, backend=backend)
            start = time.perf_counter()
            for attempt in range(2):
                try:
                    work.wait()
                except mcrdl.CommTimeoutError as exc:
                    check(backend in str(exc), exc)
                else:
                    raise AssertionError("group deadline did not fail the work")
            elapsed = time.perf_counter() - start
            check(0.9 < elapsed < 10, "group deadline after", elapsed)
            print(f"rank 0: {backend} group deadline after {elapsed:.2f} s")
    # a blocking receive nobody sends to fails at the group's deadline too (gloo
    # waits inside the library, on its process group's own timeout); on its own
    # group, as gloo closes the connection of a receive that timed out
    for backend in ("mpi", "gloo"):
        if rank == 0:
            start = time.perf_counter()
            try:
                mcrdl.recv(torch.empty(4), 1, group=fresh, tag=12, backend=backend)
            except mcrdl.CommTimeoutError as exc:
                check("recv" in str(exc) and backend in str(exc), exc)
                # the peer is alive; a receive has no collective order to blame
                check("ranks 1 are alive, so a peer is stuck or has not posted the matching send or receive" in str(exc)
                      and "collectives" not in str(exc), "the peers' verdict fits a receive:", exc)
            else:
                raise AssertionError("a blocking recv with no sender returned")
            elapsed = time.perf_counter() - start
            check(0.9 < elapsed < 10, "blocking recv deadline after", elapsed)
            print(f"rank 0: {backend} blocking recv deadline after {elapsed:.2f} s")


CASES = {"progress": progress, "order": order, "straddle": straddle, "debug": debug, "timeout": timeout}
if len(cases) > 1:
    verdicts.run_parts(cases, CASES, before_each=start, after_each=end)
else:
    start(cases[0])
    CASES[cases[0]]()
    end()
    verdicts.finished(cases[0])
print(f"rank {rank}: {sys.argv[1]} done")
