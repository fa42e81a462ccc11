"""CPU libraries on CUDA tensors (ranks may share one GPU): MPI host-staged
(``mpi_staged``, the default) or direct on a CUDA-aware MPI (``mpi``), or
torch's gloo (``gloo``: collectives only). Every op against local references,
and stream order: an op reads what the kernels queued before it wrote, without
blocking the calling thread until they ran, and its results are there for the
stream it was submitted on. With ``unordered``, mcrdl's stream waits are
removed (mpi_staged: the staging's; gloo: the submitting stream's wait at
completion) and the stream-order checks must fail (they would not catch their
loss otherwise).
Usage: cuda_staged_job.py [backend] [unordered]"""
import sys
import time

import torch

import mcrdl
from common import check, reduced, value

NAME = sys.argv[1] if len(sys.argv) > 1 else "mpi_staged"
ORDERED = "unordered" not in sys.argv[2:]
if not ORDERED and NAME == "gloo":  # the ablation: the stream current at completion waits, not the submitter's
    from mcrdl.backends.torch_pg import TorchPending
    TorchPending._finish = lambda self, wait, *args: wait(*args)
elif not ORDERED:  # the ablation: side streams no longer wait for the caller's stream, nor it for them
    torch.cuda.Stream.wait_event = lambda stream, event: None
P2P = NAME != "gloo"  # torch's gloo cannot send CUDA tensors (mcrdl refuses it: checked below)
mcrdl.init_process_group(timeout=120)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
dev = torch.device("cuda", mcrdl.get_local_rank() % torch.cuda.device_count())
torch.cuda.set_device(dev)
main = torch.cuda.current_stream(dev)
check(mcrdl.available_backends()[NAME] == "live", mcrdl.available_backends())
if torch.cuda.device_count() < mcrdl.get_world_size():  # ranks share a GPU: NCCL would refuse it
    check(mcrdl.available_backends()["nccl"] != "live", mcrdl.available_backends())
if NAME not in mcrdl.live_backends("cuda"):
    print(f"rank {rank}: SKIP {NAME} takes no CUDA tensors here (MPI is not CUDA-aware)")
    mcrdl.destroy_process_group()
    sys.exit(0)
root = world - 1
on = lambda r, n, dtype, **kw: value(r, n, dtype, **kw).to(dev)
for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.int64) if ORDERED else ():
    for n in (1, 1000, 1 << 18):
        for async_op in (False, True):
            tag = f"[{dtype} n={n} async={async_op}]"
            finish = (lambda w: w.wait()) if async_op else (lambda w: None)
            kw = dict(backend=NAME, async_op=async_op)
            t = on(rank, n, dtype)
            finish(mcrdl.all_reduce(t, **kw))
            check(torch.equal(t.cpu(), reduced(range(world), n, dtype, "sum")), tag, "all_reduce")
            t = on(rank, n, dtype)
            finish(mcrdl.broadcast(t, src=root, **kw))
            check(torch.equal(t.cpu(), value(root, n, dtype)), tag, "broadcast")
            t = on(rank, n, dtype)
            finish(mcrdl.reduce(t, dst=root, **kw))
            check(rank != root or torch.equal(t.cpu(), reduced(range(world), n, dtype, "sum")), tag, "reduce")
            out = torch.empty(world * n, dtype=dtype, device=dev)
            finish(mcrdl.all_gather_into_tensor(out, on(rank, n, dtype), **kw))
            check(torch.equal(out.cpu(), torch.cat([value(r, n, dtype) for r in range(world)])), tag, "all_gather")
            out = torch.empty(n, dtype=dtype, device=dev)
            finish(mcrdl.reduce_scatter_tensor(out, on(rank, world * n, dtype), **kw))
            ref = reduced(range(world), world * n, dtype, "sum")[rank * n:(rank + 1) * n]
            check(torch.equal(out.cpu(), ref), tag, "reduce_scatter")
            out = torch.empty(world * n, dtype=dtype, device=dev)
            inp = torch.cat([value(rank * 10 + r, n, dtype) for r in range(world)]).to(dev)
            finish(mcrdl.all_to_all_single(out, inp, **kw))
            ref = torch.cat([value(r * 10 + rank, n, dtype) for r in range(world)])
            check(torch.equal(out.cpu(), ref), tag, "all_to_all_single")
            gl = [torch.empty(n, dtype=dtype, device=dev) for _ in range(world)] if rank == root else None
            finish(mcrdl.gather(on(rank, n, dtype), gl, dst=root, **kw))
            check(rank != root or all(torch.equal(g.cpu(), value(r, n, dtype)) for r, g in enumerate(gl)), tag, "gather")
            out = torch.empty(n, dtype=dtype, device=dev)
            sl = [on(r, n, dtype) for r in range(world)] if rank == root else None
            finish(mcrdl.scatter(out, sl, src=root, **kw))
            check(torch.equal(out.cpu(), value(rank, n, dtype)), tag, "scatter")
            if world > 1 and P2P:
                dst = torch.empty(n, dtype=dtype, device=dev)
                recv = mcrdl.irecv(dst, (rank - 1) % world, tag=4, backend=NAME)
                mcrdl.isend(on(rank, n, dtype), (rank + 1) % world, tag=4, backend=NAME).wait()
                recv.wait()
                check(torch.equal(dst.cpu(), value((rank - 1) % world, n, dtype)), tag, "isend/irecv")
            # the staging's side streams were made current and back (work.on_stream)
            check(torch.cuda.current_stream(dev) == main, tag, "left", torch.cuda.current_stream(dev), "current")
if not P2P and world > 1:
    try:
        mcrdl.send(torch.ones(1, device=dev), (rank + 1) % world, backend=NAME)
        check(False, f"{NAME} took a CUDA send")
    except mcrdl.UnsupportedError as exc:
        check("cannot send" in str(exc), exc)
mcrdl.barrier(backend=NAME)

violations = []
# Stream order: a kernel queued behind a 0.2 s GPU sleep writes x; the
# all-reduce submitted right after must reduce what it wrote (it starts, or its
# copy runs, after an event on the stream), and the submitting thread must not
# wait for the sleep (no host-blocking synchronize).
SLEEP_S = 0.2
cycles_per_s = torch.cuda.get_device_properties(dev).clock_rate * 1e3  # kHz -> cycles/s
# bfloat16 widens to float32 on a private stream (the direct path); a future's
# helper thread starts the op on its own thread (whose current device is 0).
for i, (dtype, future) in enumerate([(torch.float32, False)] * 3 + [(torch.bfloat16, False), (torch.float32, True)]):
    x = torch.zeros(1 << 20, device=dev, dtype=dtype)
    torch.cuda._sleep(int(SLEEP_S * cycles_per_s))
    x.fill_(rank + 1)  # the producer, queued behind the sleep
    start = time.perf_counter()
    work = mcrdl.all_reduce(x, backend=NAME, async_op=True)
    submit_s = time.perf_counter() - start
    work.get_future().wait() if future else work.wait()
    if not bool((x.cpu() == sum(r + 1 for r in range(world))).all()):
        violations.append(f"the op ran before its producer: {dtype} future={future} {x[:4].tolist()}")
    check(i == 0 or submit_s < SLEEP_S / 2, f"submitting blocked the caller for {submit_s:.3f} s")  # (warm)
# Where the results are ordered: an op submitted on a side stream is waited for
# with another stream current, and read at once (a 64 MiB copy back would still
# be landing if the reader's stream were not made to wait for it) on the side
# stream (the submitting one: mcrdl orders it at completion), or on the stream
# current at wait() (torch's contract), also after an AVG's divide (a completion
# step) and gloo's reduce_scatter (which copies its output inside wait()).
side = torch.cuda.Stream(dev)
total, n = sum(r + 1 for r in range(world)), 1 << 24
for what, reader in [("sum", "side"), ("sum", "current"), ("avg", "current"), ("reduce_scatter", "side"),
                     ("reduce_scatter", "current")]:
    for _ in range(3):
        with torch.cuda.stream(side):
            if what == "reduce_scatter":
                x = torch.empty(n, device=dev)
                inp = torch.full((world * n,), float(rank + 1), device=dev)
                work = mcrdl.reduce_scatter_tensor(x, inp, backend=NAME, async_op=True)
            else:
                x = torch.full((n,), float(rank + 1), device=dev)
                op = mcrdl.ReduceOp.AVG if what == "avg" else mcrdl.ReduceOp.SUM
                work = mcrdl.all_reduce(x, op=op, backend=NAME, async_op=True)
        work.wait()
        check(torch.cuda.current_stream(dev) == main, what, "left", torch.cuda.current_stream(dev), "current")
        if reader == "side":
            with torch.cuda.stream(side):
                got = x.clone()
        else:
            got = x.clone()
        torch.cuda.synchronize(dev)
        want = total / world if what == "avg" else total
        if not bool((got.cpu() == want).all()):
            violations.append(f"{what} read on the {reader} stream before its results landed: {got[:2].tolist()}")
            break
# Write after read: a clone of dst queued behind a GPU sleep must see dst's old
# values, though the peer's send completes on the host meanwhile (the receive,
# or its copy back, waits for the work queued before it)
if world > 1 and P2P:
    n = 1 << 16
    dst = torch.full((n,), -1.0, device=dev)
    torch.cuda._sleep(int(SLEEP_S * cycles_per_s))
    before = dst.clone()
    recv = mcrdl.irecv(dst, (rank - 1) % world, tag=8, backend=NAME)
    mcrdl.isend(torch.full((n,), float(rank), device=dev), (rank + 1) % world, tag=8, backend=NAME).wait()
    recv.wait()
    if not bool((before.cpu() == -1).all()):
        violations.append("the copy back overwrote dst before earlier work read it")
    if not bool((dst.cpu() == float((rank - 1) % world)).all()):  # (the fill queued before it ran last)
        violations.append("the received values were overwritten by work queued before the receive")
mcrdl.destroy_process_group()
if ORDERED:
    check(not violations, *violations)
    print(f"rank {rank}: CUDA {NAME} OK")
else:
    check(violations, "the stream-order checks passed with the stream waits removed: they cannot catch their loss")
    print(f"rank {rank}: CUDA {NAME} unordered: caught {len(violations)} violations: {violations[0]}")
