"""Regressions from the core review (each case failed before its fix).
Usage: regressions_job.py CASE[,CASE...] (several: run in turn, a barrier after each)"""
import sys
import time

import torch

import mcrdl
from mcrdl.backends import OPS  # the libraries that have every op
import verdicts
from common import check

cases = sys.argv[1].split(",")
case = cases[0]
if case == "start_error":
    from mcrdl.backends.torch_pg import GlooBackend

    @mcrdl.register_backend
    class RefusingGloo(GlooBackend):
        """gloo whose all_reduce refuses to start a tensor whose first element is negative."""
        name = "refusing"

        def all_reduce(self, h, tensor, op):
            if tensor[0] < 0:
                raise RuntimeError("refused by the test backend")
            return super().all_reduce(h, tensor, op)
# gloo_plans_order: gloo alone, so MPI never hands its types to the compiled driver
mcrdl.init_process_group(backends="gloo" if case == "gloo_plans_order" else None, timeout=20)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()


def late_send(t, backend, delay=0.3):
    time.sleep(delay)
    mcrdl.send(t, 1, backend=backend)


def staging():
    """Staging copies (non-contiguous, list variants) are made after earlier
    work on another backend finished writing the tensor."""
    x = torch.zeros(2, 2)
    w = mcrdl.irecv(x, 0, backend="mpi") if rank == 1 else late_send(torch.ones(2, 2), "mpi")
    parts = [torch.empty(2, 2) for _ in range(world)]
    mcrdl.all_gather(parts, x.t(), backend="gloo")
    if w:
        w.wait()
    check(torch.equal(parts[1], torch.ones(2, 2)), "all_gather of an irecv target", parts[1])
    y = torch.zeros(4)
    w = mcrdl.irecv(y, 0, backend="mpi") if rank == 1 else late_send(torch.ones(4), "mpi")
    outs = [torch.empty(2) for _ in range(world)]
    mcrdl.all_to_all(outs, [y[:2], y[2:]], backend="gloo")
    if w:
        w.wait()
    check(torch.equal(outs[1], torch.ones(2)), "all_to_all of an irecv target", outs[1])
    z = torch.full((2, 2), 5.0) if rank == 0 else torch.zeros(2, 2)
    w = mcrdl.broadcast(z, 0, backend="gloo", async_op=True)
    mcrdl.all_reduce(z.t(), backend="mpi")
    w.wait()
    check(bool((z == 5.0 * world).all()), "all_reduce of a broadcast target", z)


def aliased():
    """In-place variants with aliased input/output, on every backend."""
    for backend in ("mpi", "gloo"):
        out = torch.zeros(2 * world)
        out[2 * rank:2 * rank + 2] = rank + 1
        mcrdl.all_gather_into_tensor(out, out[2 * rank:2 * rank + 2], backend=backend)
        check(torch.equal(out, torch.arange(1.0, world + 1).repeat_interleave(2)), backend, "ag", out)
        inp = torch.arange(2.0 * world) + 1
        mcrdl.reduce_scatter_tensor(inp[2 * rank:2 * rank + 2], inp, backend=backend)
        ref = (torch.arange(2.0 * world) + 1) * world
        check(torch.equal(inp[2 * rank:2 * rank + 2], ref[2 * rank:2 * rank + 2]), backend, "rs", inp)
        x = torch.arange(2.0 * world) + 10 * rank
        mcrdl.all_to_all_single(x, x, backend=backend)
        ref = torch.cat([(torch.arange(2.0 * world) + 10 * r)[2 * rank:2 * rank + 2] for r in range(world)])
        check(torch.equal(x, ref), backend, "a2a in place", x)


def future():
    """The futures thread never blocks in gloo while MPI work waits on it."""
    g = torch.ones(4)
    big = torch.zeros(16 << 20)
    start = time.perf_counter()
    if rank == 0:
        fut = mcrdl.all_reduce(g, backend="gloo", async_op=True).get_future()
        time.sleep(0.3)
        req = mcrdl.irecv(big, 1, backend="mpi")
        fut.wait()
        req.wait()
    else:
        mcrdl.send(torch.ones(16 << 20), 0, backend="mpi")
        mcrdl.all_reduce(g, backend="gloo")
    check(time.perf_counter() - start < 10, "future + MPI took", time.perf_counter() - start)
    check(torch.equal(g, torch.full((4,), float(world))), g)


def callbacks():
    """Future callbacks may issue ops; works they start stay tracked."""
    buf = torch.zeros(4)
    pending = mcrdl.irecv(buf, 1, backend="mpi") if rank == 0 else None
    a, b, c = torch.ones(4), torch.ones(4), torch.ones(4)
    box = {}

    def cb(f):
        mcrdl.all_reduce(b, backend="gloo")
        box["e"] = mcrdl.all_reduce(c, backend="mpi", async_op=True)
        return f.value()
    mcrdl.all_reduce(a, backend="gloo", async_op=True).get_future().then(cb).wait()
    engine = mcrdl.api.current_runtime().engine
    check(box["e"]._done or box["e"] in engine.outstanding, "work from a callback is tracked")
    box["e"].wait()
    check(torch.equal(c, torch.full((4,), float(world))), c)
    if rank == 1:
        mcrdl.send(torch.ones(4), 0, backend="mpi")
    else:
        pending.wait()


def polling():
    """is_completed() and combine() finish gloo ops whose is_completed() lies."""
    for op in ("p2p", "reduce_scatter_tensor"):
        x = torch.zeros(4)
        if op == "p2p":
            w = mcrdl.irecv(x, 1, backend="gloo") if rank == 0 else mcrdl.isend(torch.ones(4), 0, backend="gloo")
        else:
            w = mcrdl.reduce_scatter_tensor(x[:2], torch.ones(2 * world), backend="gloo", async_op=True)
        start = time.perf_counter()
        while not w.is_completed():
            check(time.perf_counter() - start < 5, op, "is_completed() never became True")
            time.sleep(0.001)
        w.wait()
    out = torch.empty(2)
    w = mcrdl.reduce_scatter_tensor(out, torch.ones(2 * world), backend="gloo", async_op=True)
    mcrdl.api.combine("combined", [w]).wait(timeout=5)
    check(torch.equal(out, torch.full((2,), float(world))), out)


def parameters():
    """Completion steps work on leaf tensors that require grad (parameters)."""
    for backend in ("mpi", "gloo"):
        for _ in range(2):  # (the second from its plan: the compiled divide)
            p = torch.nn.Parameter(torch.full((4,), float(rank + 1)))
            version = p._version
            mcrdl.all_reduce(p, op=mcrdl.ReduceOp.AVG, backend=backend)
            check(torch.allclose(p.detach(), torch.full((4,), (world + 1) / 2)), backend, "AVG", p)
            check(p._version > version, backend, "AVG changed the tensor's version (autograd sees it)")
        q = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        mcrdl.all_reduce(q, backend=backend)
        check(bool((q.detach() == world).all()), backend, "bf16", q)
        outs = [torch.nn.Parameter(torch.zeros(4)) for _ in range(world)]
        mcrdl.all_gather(outs, torch.full((4,), float(rank)), backend=backend)
        check(all(bool((o.detach() == r).all()) for r, o in enumerate(outs)), backend, "all_gather")


def barrier_orders():
    """A barrier runs after outstanding async work (as gloo's does)."""
    t = torch.ones(1 << 20)
    w = mcrdl.all_reduce(t, backend="mpi", async_op=True)
    mcrdl.barrier(backend="gloo")
    check(w._done, "barrier returned before outstanding work completed")


def destroy_pending():
    """destroy_process_group with a pending future neither hangs nor waits the timeout."""
    if rank == 0:
        w = mcrdl.irecv(torch.zeros(4), 1, backend="mpi")  # never sent
        fut = w.get_future()
    start = time.perf_counter()
    mcrdl.destroy_process_group()
    check(time.perf_counter() - start < 5, "destroy took", time.perf_counter() - start)
    if rank == 0:
        check(fut.done(), "future not settled by destroy")
        try:
            fut.wait()
        except Exception as exc:
            check("destroyed" in str(exc), exc)
        else:
            raise AssertionError("future of a destroyed work succeeded")


def callback_at_exit():
    """A future callback still running when the script ends: destroy waits for
    it. Without that, its thread finds the interpreter finalizing when it takes
    the GIL back inside ``Future.set_result`` and the process aborts ("terminate
    called without an active exception"), seen in CI after ops_job's future."""
    started = []

    def busy(fut):
        started.append(1)
        end = time.monotonic() + 2
        while time.monotonic() < end:  # holds the GIL now and then, like real work
            pass
        return fut.value()
    for backend in ("mpi", "gloo"):
        mcrdl.all_reduce(torch.ones(4), backend=backend, async_op=True).get_future().then(busy)
    while len(started) < 2:
        time.sleep(0.01)


def futures_thread():
    """Futures of many works in flight are completed by one thread (a thread per
    future cost ~170 µs to start here, more than most ops), which ends once idle."""
    import threading

    from mcrdl import work

    for backend in ("mpi", "gloo"):
        ts = [torch.full((4,), float(rank + i)) for i in range(16)]
        before = threading.active_count()
        if rank == 1:
            time.sleep(0.3)  # rank 0's futures are all pending meanwhile
        futs = [mcrdl.all_reduce(t, backend=backend, async_op=True).get_future() for t in ts]
        check(threading.active_count() - before <= 1, backend, "threads for 16 futures:",
              threading.active_count() - before)
        for i, f in enumerate(futs):
            want = torch.full((4,), float(sum(r + i for r in range(world))))
            check(torch.equal(f.wait()[0], want), backend, "future", i, f.value())
    deadline = time.monotonic() + work.FUTURES_LINGER_S + 5
    while any(t.name == "mcrdl-futures" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    check(not any(t.name == "mcrdl-futures" for t in threading.enumerate()), "the futures thread outlived its linger")


def multidim_blocks():
    """scatter/gather of multi-dim tensors from/into back-to-back views of one buffer
    (DTensor's distribute_tensor): gloo got flat blocks and refused them."""
    for backend in mcrdl.live_backends(ops=OPS):
        big = torch.arange(2 * world, dtype=torch.float32).repeat_interleave(3).view(2 * world, 3)
        out = torch.zeros(2, 3)
        mcrdl.scatter(out, list(big.chunk(world)) if rank == 0 else None, 0, backend=backend)
        check(torch.equal(out, big[2 * rank:2 * rank + 2]), "scatter of 2-D blocks on", backend, out)
        into = torch.zeros(3 * world, 2)
        mcrdl.gather(torch.full((3, 2), float(rank)), list(into.chunk(world)) if rank == 0 else None,
                     0, backend=backend)
        if rank == 0:
            check(torch.equal(into, torch.arange(world, dtype=torch.float32).repeat_interleave(6)
                              .view(3 * world, 2)), "gather into 2-D blocks on", backend, into)


def span_memo():
    """A list of views of one buffer is remembered between calls (the fast
    paths of all_gather, reduce_scatter, gather, scatter); the same list
    holding other tensors, or its tensors moved to other memory, must not
    reuse the remembered buffer."""
    for backend in mcrdl.live_backends(ops=OPS):
        for op in ("all_gather", "gather", "scatter", "reduce_scatter"):
            buf = torch.zeros(world * 2)
            parts = list(buf.chunk(world))

            def call():
                mine = torch.full((2,), float(rank + 1))
                if op == "all_gather":
                    mcrdl.all_gather(parts, mine, backend=backend)
                elif op == "gather":
                    mcrdl.gather(mine, parts if rank == 0 else None, 0, backend=backend)
                elif op == "scatter":
                    for i, p in enumerate(parts):
                        p.fill_(float(i + 1))
                    mcrdl.scatter(mine, parts if rank == 0 else None, 0, backend=backend)
                    return mine
                else:
                    for i, p in enumerate(parts):
                        p.fill_(float(i + 1))
                    mcrdl.reduce_scatter(mine, parts, backend=backend)
                    return mine

            def expect_gathered(where):
                if op in ("all_gather", "gather") and (op == "all_gather" or rank == 0):
                    want = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(2)
                    check(torch.equal(torch.cat(where), want), op, backend, "gathered", where)

            def expect_result(out):
                if out is not None:
                    want = float(rank + 1) * (world if op == "reduce_scatter" else 1)
                    check(torch.equal(out, torch.full((2,), want)), op, backend, out)

            expect_result(call())
            expect_gathered(parts)
            if op in ("gather", "scatter") and rank == 0:  # (only the root checks its list)
                bigger = torch.ones(3)
                try:  # the remembered view holds 2 per rank: reused, MPI would overrun it
                    (mcrdl.gather if op == "gather" else mcrdl.scatter)(bigger, parts, 0, backend=backend)
                except ValueError:
                    pass
                else:
                    raise AssertionError(f"{op} of a bigger tensor with the remembered list ran")
            other = torch.zeros(world * 2)
            old = buf.clone()
            parts[:] = list(other.chunk(world))  # the same list object, other tensors
            expect_result(call())
            expect_gathered(parts)
            check(torch.equal(buf, old), op, backend, "wrote into the list's former buffer")
            moved = [torch.zeros(2) for _ in range(world)]
            old = other.clone()
            for p, m in zip(parts, moved):  # the same tensors, moved to separate memory
                p.set_(m)
            expect_result(call())
            expect_gathered(moved)
            check(torch.equal(other, old), op, backend, "wrote into the tensors' former memory")
    # A list at the remembered address after the view's storage was freed in place (as
    # FSDP frees parameters) gets a view of its own memory: every rank makes the same calls.
    reused = 0
    for _ in range(20):
        old = torch.zeros(1 << 22)
        at = old.data_ptr()
        mcrdl.all_gather(list(old[:2 * world].chunk(world)), torch.full((2,), float(rank + 1)), backend="mpi")
        old.untyped_storage().resize_(0)
        del old
        new = torch.zeros(1 << 22)
        reused += new.data_ptr() == at
        mcrdl.all_gather(list(new[:2 * world].chunk(world)), torch.full((2,), float(rank + 1)), backend="mpi")
        want = torch.arange(1, world + 1, dtype=torch.float32).repeat_interleave(2)
        check(torch.equal(new[:2 * world], want), "all_gather into memory freed and handed out again", new[:8])
    print(f"rank {rank}: the freed address came back {reused} of 20 times")


def plan_fit():
    """A plan kept for one call never serves a call it does not fit: the same
    bytes in another dtype or shape, another root, a tensor elsewhere in
    memory, an aliased or non-contiguous one, bools, another reduction. Each
    call follows one that made a plan and must give the local reference."""
    def same(got, want, what):
        check(torch.equal(got, want), "plan_fit:", what, "got", got, "expected", want)

    for backend in mcrdl.live_backends(ops=OPS):
        for dtype, n in ((torch.float32, 4), (torch.int32, 4), (torch.float64, 2), (torch.int8, 16)):
            t = torch.full((n,), rank + 1, dtype=dtype)
            mcrdl.all_reduce(t, backend=backend)
            same(t, torch.full((n,), world * (world + 1) // 2, dtype=dtype), f"all_reduce {dtype} on {backend}")
        flags = torch.tensor([rank == 0, False, True])
        mcrdl.all_reduce(flags, backend=backend)  # (bool SUM: a logical or, mapped by the general path)
        same(flags, torch.tensor([True, False, True]), f"all_reduce of bools on {backend}")
        t = torch.full((4,), rank + 1.0)
        mcrdl.all_reduce(t, mcrdl.ReduceOp.MAX, backend=backend)
        same(t, torch.full((4,), float(world)), f"all_reduce MAX after SUM on {backend}")
        buf = torch.arange(8, dtype=torch.float32) + 10 * rank
        for offset in (0, 4):  # the same shape elsewhere in one storage
            view = buf[offset:offset + 4]
            mcrdl.all_reduce(view, backend=backend)
        want = torch.arange(8, dtype=torch.float32) * world + 10 * world * (world - 1) // 2
        same(buf, want, f"all_reduce of two views of one buffer on {backend}")
        strided = (torch.arange(8, dtype=torch.float32) + rank)[::2]
        mcrdl.all_reduce(strided, backend=backend)
        same(strided, torch.arange(0, 8, 2, dtype=torch.float32) * world + world * (world - 1) // 2,
             f"all_reduce of a strided view after a plan on {backend}")
        for root in range(world):  # one plan per root
            t = torch.full((3,), float(rank))
            mcrdl.broadcast(t, root, backend=backend)
            same(t, torch.full((3,), float(root)), f"broadcast from {root} on {backend}")
        for rows, cols in ((2 * world, 2), (world, 4)):  # the same bytes in other rows
            inp = torch.arange(rows * cols, dtype=torch.float32).view(rows, cols) + 100 * rank
            out = torch.empty(rows, cols)
            mcrdl.all_to_all_single(out, inp, backend=backend)
            per = rows // world
            want = torch.cat([torch.arange(rows * cols, dtype=torch.float32).view(rows, cols)[rank * per:(rank + 1) * per]
                              + 100 * r for r in range(world)])
            same(out, want, f"all_to_all_single of {rows}x{cols} on {backend}")
        whole = torch.zeros(2 * world)
        mcrdl.all_gather_into_tensor(whole, torch.full((2,), float(rank)), backend=backend)
        same(whole, torch.arange(world, dtype=torch.float32).repeat_interleave(2), f"all_gather_into_tensor on {backend}")
        whole = torch.arange(2 * world, dtype=torch.float32)  # input aliasing the output: copied, not planned
        mcrdl.all_gather_into_tensor(whole, whole[2 * rank:2 * rank + 2], backend=backend)
        same(whole, torch.arange(2 * world, dtype=torch.float32), f"aliased all_gather_into_tensor on {backend}")


def released():
    """destroy_process_group releases every library handle at once, though the
    user still holds the group (torch's ProcessGroup wrapper does): a gloo group
    kept alive by a cached fast-path plan was destroyed only at interpreter
    teardown, and its worker thread, still dropping the last work's tensors,
    aborted the process ("terminate called without an active exception")."""
    import gc
    import weakref
    world_group = mcrdl.new_group(list(range(world)))
    for g in (None, world_group):
        for backend in mcrdl.live_backends(ops=OPS):
            mcrdl.all_reduce(torch.ones(4), group=g, backend=backend)
            mcrdl.broadcast(torch.ones(4), 0, group=g, backend=backend)
    held = [mcrdl.api.current_runtime().world, world_group]  # as ProcessGroupMCRDL holds its group
    refs = {f"{g.name}/{name}": weakref.ref(g.handles[name])
            for g in held for name in g.handles
            if name != "mpi" and g.handles[name] is not None}  # (mpi4py Comms take no weakref; shm has none)
    check(any("gloo" in k for k in refs), "no gloo handle to watch", refs)
    mcrdl.destroy_process_group()
    gc.collect()
    alive = [k for k, r in refs.items() if r() is not None]
    check(not alive, "handles alive after destroy_process_group", alive)


def p2p_order():
    """isend/irecv (their fast path too) start after outstanding work that
    touches their buffer: an isend of an irecv target sends what arrived, and an
    irecv into a buffer an MPI isend still reads (4 MiB: rendezvous) waits."""
    n = 1 << 20
    if rank == 1:
        x = torch.zeros(4)
        w = mcrdl.irecv(x, 0, backend="mpi")
        mcrdl.isend(x, 0, backend="gloo").wait()
        w.wait()
        big = torch.ones(n)
        sent = mcrdl.isend(big, 0, backend="mpi")
        mcrdl.irecv(big, 0, backend="gloo").wait()
        sent.wait()
        check(bool((big == 2).all()), "irecv target after the isend", big[:4])
    elif rank == 0:
        late_send(torch.ones(4), "mpi")
        y = torch.zeros(4)
        mcrdl.recv(y, 1, backend="gloo")
        check(torch.equal(y, torch.ones(4)), "isend of an irecv target sent before it arrived", y)
        twos = mcrdl.isend(torch.full((n,), 2.0), 1, backend="gloo")
        time.sleep(0.3)
        got = torch.zeros(n)
        src = mcrdl.recv(got, 1, backend="mpi")  # blocking, with work outstanding: the general path
        check(src == 1, "recv returned", src)  # (raised NotImplementedError for an MPI recv)
        twos.wait()
        check(bool((got == 1).all()), "an MPI isend's buffer overwritten by a later irecv", got[:4])


def collective_order():
    """Async collectives (their fast path too) start after outstanding work on
    another backend that touches their tensors: an all_reduce of an irecv
    target uses what arrived, an all_gather of it the reduced values, and a broadcast into a buffer an MPI
    isend still reads (4 MiB: rendezvous) waits for it."""
    n = 1 << 20
    x = torch.zeros(4)
    w = mcrdl.irecv(x, 0, backend="mpi") if rank == 1 else late_send(torch.ones(4), "mpi")
    reduced = mcrdl.all_reduce(x, backend="gloo", async_op=True)
    gathered = torch.zeros(4 * world)
    gather = mcrdl.all_gather_into_tensor(gathered, x, backend="gloo", async_op=True)
    reduced.wait()
    gather.wait()
    if w:
        w.wait()
    check(torch.equal(x, torch.ones(4)), "all_reduce of an irecv target", x)
    check(torch.equal(gathered, torch.ones(4 * world)), "all_gather of an all_reduce target", gathered)
    if rank == 1:
        big = torch.ones(n)
        sent = mcrdl.isend(big, 0, backend="mpi")
        mcrdl.broadcast(big, 0, backend="gloo", async_op=True).wait()
        sent.wait()
        check(bool((big == 2).all()), "broadcast target after the isend", big[:4])
    elif rank == 0:
        twos = mcrdl.broadcast(torch.full((n,), 2.0), 0, backend="gloo", async_op=True)
        time.sleep(0.3)
        got = torch.zeros(n)
        mcrdl.recv(got, 1, backend="mpi")
        twos.wait()
        check(bool((got == 1).all()), "an MPI isend's buffer overwritten by a later broadcast", got[:4])
    else:
        mcrdl.broadcast(torch.zeros(n), 0, backend="gloo", async_op=True).wait()
    plans_order("mpi")


def plans_order(backend):
    """Async calls from their plans (the compiled driver orders them in C): a call
    writing or reading what an outstanding one writes waits for it first (16 MiB:
    the first is still running when the second starts, unless the second waited)."""
    a, out = torch.empty(4 << 20), torch.empty(world * (4 << 20))
    for call in range(3):  # (the first call builds the plans)
        a.fill_(1.0)
        first = mcrdl.all_reduce(a, backend=backend, async_op=True)
        second = mcrdl.all_reduce(a, backend=backend, async_op=True)
        check(first._done, f"{backend} call {call}: an all_reduce waits for the one writing its tensor")
        gather = mcrdl.all_gather_into_tensor(out, a, backend=backend, async_op=True)
        check(second._done, f"{backend} call {call}: an all_gather waits for the all_reduce writing its input")
        third = mcrdl.all_reduce(a, backend=backend, async_op=True)
        check(gather._done, f"{backend} call {call}: an all_reduce waits for the all_gather reading its tensor")
        third.wait()
        check(bool((out == world * world).all()) and bool((a == world ** 3).all()),
              f"{backend} call {call}: results in program order", (out[:2], a[:2]))
        every_op_from_its_plan_orders(backend, a, out, call)


def every_op_from_its_plan_orders(backend, a, out, call):
    """Every other op's async call from its plan (rooted, list forms, even and
    uneven all-to-all) after an all_reduce writing what it reads or writes:
    started, the all_reduce is done (16 MiB: it was still running)."""
    n, root = a.numel(), world - 1
    block, other = n // world, torch.empty(n)
    counts = [block] * world
    calls = {  # each reads a (scatter: writes a block of it), the only tensor its rank shares with the all_reduce
        "reduce": lambda: mcrdl.reduce(a, root, backend=backend, async_op=True),
        "all_gather": lambda: mcrdl.all_gather(list(out.chunk(world)), a, backend=backend, async_op=True),
        "reduce_scatter": lambda: mcrdl.reduce_scatter(other[:block], list(a.chunk(world)), backend=backend,
                                                       async_op=True),
        "gather": lambda: mcrdl.gather(a, list(out.chunk(world)) if rank == root else None, root,
                                       backend=backend, async_op=True),
        "scatter": lambda: mcrdl.scatter(a[:block], list(other.chunk(world)) if rank == root else None, root,
                                         backend=backend, async_op=True),
        "all_to_all_single": lambda: mcrdl.all_to_all_single(other, a, backend=backend, async_op=True),
        "uneven all_to_all_single": lambda: mcrdl.all_to_all_single(other, a, counts, counts, backend=backend,
                                                                     async_op=True),
    }
    for name, start in calls.items():
        a.fill_(1.0)
        other.fill_(float(rank + 1))
        first = mcrdl.all_reduce(a, backend=backend, async_op=True)
        work = start()
        check(first._done, f"{backend} call {call}: {name} waits for the all_reduce writing its tensor")
        work.wait()
        if name == "reduce" and rank != root:
            continue  # (scratch there)
        if name == "reduce":
            want = torch.full((n,), float(world * world))
        elif name == "scatter":
            want = torch.full((n,), float(world))
            want[:block] = float(root + 1)
        else:
            want = torch.full((n,), float(world))
        check(torch.equal(a, want), f"{backend} call {call}: {name} in program order", a[:2], a[block:block + 2])


def start_error():
    """An async or blocking call whose start raises, from its plan (the compiled
    driver starts it in C): a CommError naming the op, the backend and the cause
    (as the general path raises), nothing left outstanding, and the next call runs."""
    t = torch.ones(4)
    mcrdl.all_reduce(t, backend="refusing", async_op=True).wait()  # (builds the plan)
    for _ in range(2):
        try:
            mcrdl.all_reduce(torch.full((4,), -1.0), backend="refusing", async_op=True)
        except mcrdl.CommError as exc:
            verdicts.check("the error names op, backend and cause", "all_reduce on backend 'refusing' could not "
                           "start: refused by the test backend" in str(exc) and isinstance(exc.__cause__, RuntimeError),
                           "CommError from RuntimeError", f"{exc!r} from {exc.__cause__!r}")
        else:
            verdicts.check("the error names op, backend and cause", False, "CommError", "no error")
        outstanding = mcrdl.api.current_runtime().engine.outstanding
        verdicts.check("nothing outstanding after a refused start", not outstanding, [], outstanding)
    mcrdl.all_reduce(torch.ones(4), backend="refusing")  # (the blocking plan): refused from it, the same error
    for _ in range(2):
        try:
            mcrdl.all_reduce(torch.full((4,), -1.0), backend="refusing")
        except mcrdl.CommError as exc:
            verdicts.check("a blocking start's error names op, backend and cause", "all_reduce on backend "
                           "'refusing' could not start: refused by the test backend" in str(exc)
                           and isinstance(exc.__cause__, RuntimeError), "CommError from RuntimeError",
                           f"{exc!r} from {exc.__cause__!r}")
        except Exception as exc:  # noqa: BLE001  (the library's own error, unwrapped)
            verdicts.check("a blocking start's error names op, backend and cause", False, "CommError", repr(exc))
        else:
            verdicts.check("a blocking start's error names op, backend and cause", False, "CommError", "no error")
    mcrdl.all_reduce(t, backend="refusing", async_op=True).wait()
    verdicts.check("the next call runs", torch.equal(t, torch.full((4,), 2.0 * world)), 2.0 * world, t)


def wait_error():
    """An async receive that MPI fails at completion (the message is longer than
    its buffer), waited for on the compiled wait or the Python one: a CommError
    naming the op, the backend and MPI's words, caused by the library's error; the
    work is done, failed and no longer outstanding; the next call runs."""
    engine = mcrdl.api.current_runtime().engine
    for tag in (7, 8):  # (the second from the receive's plan)
        if rank == 0:
            mcrdl.send(torch.ones(8), 1, tag=tag, backend="mpi")
        elif rank == 1:
            work = mcrdl.irecv(torch.zeros(4), 0, tag=tag, backend="mpi")
            try:
                work.wait()
            except mcrdl.CommError as exc:
                verdicts.check("the wait names op, backend and cause", "irecv on backend 'mpi' failed" in str(exc)
                               and "truncated" in str(exc) and exc.__cause__ is not None,
                               "irecv ... truncated, with a cause", f"{exc!r} from {exc.__cause__!r}")
                # the sender is alive and a receive has no collective order to blame
                verdicts.check("the peers' verdict fits a receive", "ranks 0 are alive, so a peer is stuck or the "
                               "library refused the message" in str(exc) and "collectives" not in str(exc),
                               "the library refused the message", str(exc))
            else:
                verdicts.check("the wait names op, backend and cause", False, "CommError", "no error")
            verdicts.check("the failed receive is done, failed, not outstanding",
                           work.is_completed() and not work.is_success() and not engine.outstanding,
                           "done, failed, nothing outstanding", (work, engine.outstanding))
    t = torch.ones(4)
    mcrdl.all_reduce(t, backend="mpi")
    verdicts.check("the next call runs", torch.equal(t, torch.full((4,), float(world))), float(world), t)


CASES = {"collective_order": collective_order, "p2p_order": p2p_order, "staging": staging, "aliased": aliased,
         "future": future, "futures_thread": futures_thread, "callbacks": callbacks, "polling": polling,
         "parameters": parameters, "barrier": barrier_orders, "destroy": destroy_pending,
         "callback_at_exit": callback_at_exit, "multidim_blocks": multidim_blocks, "span_memo": span_memo,
         "released": released, "plan_fit": plan_fit, "start_error": start_error, "wait_error": wait_error,
         "gloo_plans_order": lambda: plans_order("gloo"), "mpi_plans_order": lambda: plans_order("mpi")}
if len(cases) > 1:
    verdicts.run_parts(cases, CASES, after_each=mcrdl.barrier)
else:
    CASES[case]()
if mcrdl.is_initialized():
    mcrdl.barrier()
    mcrdl.destroy_process_group()
if len(cases) == 1:
    verdicts.finished(case)
print(f"rank {rank}: {sys.argv[1]} OK")
