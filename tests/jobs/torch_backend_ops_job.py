"""torch.distributed collectives through the "mcrdl" backend vs local references.

Usage: torch_backend_ops_job.py DEFAULT_BACKEND [torch-first]  (mpi | gloo: what mcrdl's
selector falls back to; no table, no static map, so every op should run there).
torch-first: the drop-in's start, ``torch.distributed.init_process_group("mcrdl")`` on
torch's own env:// rendezvous (mcrdl's options from MCRDL_* variables), as under
torchrun or mp.spawn; else mcrdl starts first and torch joins it."""
import os
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import mcrdl
import mcrdl.integrations.torch_backend as tb
import verdicts
from common import check, reduced, value

warnings.simplefilter("ignore", FutureWarning)  # torch 2.13 renames all_gather_into_tensor etc.
backend = sys.argv[1]
if sys.argv[2:] == ["torch-first"]:
    os.environ.update(MCRDL_DEFAULT_BACKEND=backend, MCRDL_COMMS_LOG="1")
    dist.init_process_group("mcrdl", timeout=timedelta(seconds=120))
else:
    tb.init_process_group(mcrdl_options={"default_backend": backend, "timeout": 120, "comms_log": True})
rank, world = dist.get_rank(), dist.get_world_size()
check(dist.get_backend() == "mcrdl", "torch backend", dist.get_backend())
check((rank, world) == (mcrdl.get_rank(), mcrdl.get_world_size()), "ranks agree")
layer = {type(vars(tb.ProcessGroupMCRDL)["allreduce"]).__name__,  # TorchMethod: csrc/torch_method.cpp serves the common calls
         type(vars(tb.MCRDLTorchWork)["wait"]).__name__}
check(len(layer) == 1, "the methods and the Work's wait in one form", layer)
for method in (tb.ProcessGroupMCRDL.allreduce, tb.ProcessGroupMCRDL.send, tb.MCRDLTorchWork.wait,
               tb.MCRDLTorchWork(None, [], "x").wait):  # (function-like, compiled or not: wrappers read these)
    python = getattr(method, "__wrapped__", None) or getattr(method, "__func__", method)
    python = getattr(python, "__wrapped__", python)
    for name in ("__name__", "__qualname__", "__module__", "__doc__"):
        check(getattr(method, name) == getattr(python, name), "a method's", name, getattr(method, name))
print(f"rank {rank}: torch layer {'compiled' if layer == {'TorchMethod'} else 'python'}")
ranks = list(range(world))
R = dist.ReduceOp
TORCH_OPS = {"sum": R.SUM, "max": R.MAX, "min": R.MIN, "product": R.PRODUCT, "avg": R.AVG}
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
count = 0


def finish(work, async_op):
    if async_op:
        check(work is not None, "async op returned None")
        work.wait()
        check(work.is_completed(), "torch work not completed after wait")
    return work


def same(got, want, *what):
    global count
    count += 1
    want = want.to(got.dtype)
    ok = torch.equal(got, want) if not got.dtype.is_floating_point else torch.allclose(
        got.double(), want.double(), rtol=1e-2 if got.dtype == torch.bfloat16 else 1e-6)
    check(ok, *what, "got", got.tolist()[:12], "want", want.tolist()[:12])


# -- the selector decides: a known float32 sequence is recorded on the default backend ---------
before = len(mcrdl.comms_records())
t = torch.ones(64)
dist.all_reduce(t)
dist.broadcast(t, 0)
all_gather_single(torch.empty(64 * world), t)
dist.all_to_all_single(torch.empty(64), t)
recs = mcrdl.comms_records()[before:]
check([r.op for r in recs] == ["all_reduce", "broadcast", "all_gather_into_tensor", "all_to_all_single"],
      "recorded ops", [r.op for r in recs])
check({r.backend for r in recs} == {backend}, "selected backends", [(r.op, r.backend) for r in recs])

# -- every op x dtype x size x sync/async -----------------------------------------------------
for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32):
    floating = dtype.is_floating_point
    for numel in (1, 7, 1000):
        for async_op in (False, True):
            what = (dtype, numel, "async" if async_op else "sync")
            for name in ("sum", "max", "min", "product") + (("avg",) if floating else ()):
                t = value(rank, numel, dtype, name == "product")
                w = dist.all_reduce(t, op=TORCH_OPS[name], async_op=async_op)
                finish(w, async_op)
                same(t, reduced(ranks, numel, dtype, name), "all_reduce", name, *what)
                if async_op:
                    fut = w.get_future().wait()
                    check(isinstance(fut, list) and fut[0] is t, "all_reduce future value", fut)
            for src in ranks:
                t = value(rank, numel, dtype, salt=3)
                finish(dist.broadcast(t, src, async_op=async_op), async_op)
                same(t, value(src, numel, dtype, salt=3), "broadcast from", src, *what)
            dst = world - 1
            t = value(rank, numel, dtype)
            finish(dist.reduce(t, dst, op=R.MAX, async_op=async_op), async_op)
            if rank == dst:
                same(t, reduced(ranks, numel, dtype, "max"), "reduce max", *what)
            outs = [torch.empty(numel, dtype=dtype) for _ in ranks]
            finish(dist.all_gather(outs, value(rank, numel, dtype), async_op=async_op), async_op)
            for r in ranks:
                same(outs[r], value(r, numel, dtype), "all_gather", r, *what)
            out = torch.empty(world * numel, dtype=dtype)
            finish(all_gather_single(out, value(rank, numel, dtype), async_op=async_op), async_op)
            same(out, torch.cat([value(r, numel, dtype) for r in ranks]), "all_gather_into_tensor", *what)
            for name in ("sum", "max") + (("avg",) if floating else ()):
                inp = value(rank, world * numel, dtype)
                out = torch.empty(numel, dtype=dtype)
                finish(reduce_scatter_single(out, inp, op=TORCH_OPS[name], async_op=async_op), async_op)
                full = reduced(ranks, world * numel, dtype, name)
                same(out, full[rank * numel:(rank + 1) * numel], "reduce_scatter_tensor", name, *what)
            out = torch.empty(numel, dtype=dtype)
            inputs = [value(rank, numel, dtype, salt=j) for j in ranks]
            finish(dist.reduce_scatter(out, inputs, async_op=async_op), async_op)
            same(out, reduced(ranks, numel, dtype, "sum", salt=rank), "reduce_scatter list", *what)
            # all_to_all_single, even: block j of rank i is value(10*i + j)
            inp = torch.cat([value(10 * rank + j, numel, dtype) for j in ranks])
            out = torch.empty(world * numel, dtype=dtype)
            finish(dist.all_to_all_single(out, inp, async_op=async_op), async_op)
            same(out, torch.cat([value(10 * i + rank, numel, dtype) for i in ranks]), "all_to_all_single", *what)
            # uneven: rank i sends 1 + i + j rows of width numel to j
            in_splits = [1 + rank + j for j in ranks]
            out_splits = [1 + i + rank for i in ranks]
            inp = torch.cat([value(10 * rank + j, in_splits[j] * numel, dtype).view(-1, numel) for j in ranks])
            out = torch.empty(sum(out_splits), numel, dtype=dtype)
            finish(dist.all_to_all_single(out, inp, out_splits, in_splits, async_op=async_op), async_op)
            want = torch.cat([value(10 * i + rank, out_splits[i] * numel, dtype).view(-1, numel) for i in ranks])
            same(out, want, "all_to_all_single uneven", *what)
            outs = [torch.empty(numel + r, dtype=dtype) for r in ranks]
            ins = [value(10 * rank + j, numel + rank, dtype) for j in ranks]
            finish(dist.all_to_all(outs, ins, async_op=async_op), async_op)
            for i in ranks:
                same(outs[i], value(10 * i + rank, numel + i, dtype), "all_to_all list from", i, *what)
            root = world - 1
            glist = [torch.empty(numel, dtype=dtype) for _ in ranks] if rank == root else None
            finish(dist.gather(value(rank, numel, dtype), glist, dst=root, async_op=async_op), async_op)
            if rank == root:
                for r in ranks:
                    same(glist[r], value(r, numel, dtype), "gather from", r, *what)
            slist = [value(100 + j, numel, dtype) for j in ranks] if rank == root else None
            out = torch.empty(numel, dtype=dtype)
            finish(dist.scatter(out, slist, src=root, async_op=async_op), async_op)
            same(out, value(100 + rank, numel, dtype), "scatter", *what)

# -- bool reductions (BAND/BOR map to logical and/or) and complex (torch views it as real) --
for name, op, ref in (("bor", R.BOR, "max"), ("band", R.BAND, "min"), ("max", R.MAX, "max"),
                      ("sum", R.SUM, "sum")):
    t = value(rank, 9, torch.bool)
    dist.all_reduce(t, op=op)
    same(t, reduced(ranks, 9, torch.bool, ref), "bool all_reduce", name)
c = torch.complex(value(rank, 5, torch.float32), value(rank + 1, 5, torch.float32))
dist.all_reduce(c)
same(torch.view_as_real(c), torch.view_as_real(torch.complex(
    reduced(ranks, 5, torch.float32, "sum"), sum(value(r + 1, 5, torch.float32) for r in ranks))),
    "complex all_reduce")

# -- zero-size, barrier --------------------------------------------------------------------
t = torch.empty(0)
dist.all_reduce(t)
dist.broadcast(t, 0)
dist.barrier()
w = dist.barrier(async_op=True)
w.wait()
check(w.is_completed() and w.is_success(), "barrier work")

# -- point to point ---------------------------------------------------------------------------
nxt, prv = (rank + 1) % world, (rank - 1) % world
for numel in (1, 1000):
    if rank % 2 == 0:
        dist.send(value(rank, numel, torch.float32), nxt, tag=3)
        got = torch.empty(numel)
        check(dist.recv(got, prv, tag=4) == prv, "recv returns src")
    else:
        got = torch.empty(numel)
        dist.recv(got, prv, tag=3)
        dist.send(value(rank, numel, torch.float32), nxt, tag=4)
    same(got, value(prv, numel, torch.float32), "send/recv", numel)
    got = torch.empty(numel)
    reqs = [dist.irecv(got, prv), dist.isend(value(rank, numel, torch.float32, salt=1), nxt)]
    for q in reqs:
        q.wait()
    same(got, value(prv, numel, torch.float32, salt=1), "isend/irecv", numel)
    got = torch.empty(numel, dtype=torch.int64)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.irecv, got, prv, tag=7),
                                   dist.P2POp(dist.isend, value(rank, numel, torch.int64, salt=2), nxt, tag=7)])
    for q in reqs:
        q.wait()
    same(got, value(prv, numel, torch.int64, salt=2), "batch_isend_irecv", numel)

# -- object collectives, coalesced and functional collectives -----------------------------------
objs = [None] * world
dist.all_gather_object(objs, {"rank": rank, "s": "x" * rank})
check(objs == [{"rank": r, "s": "x" * r} for r in ranks], "all_gather_object", objs)
lst = [{"from": 0}, [1, 2]] if rank == 0 else [None, None]
dist.broadcast_object_list(lst, src=0)
check(lst == [{"from": 0}, [1, 2]], "broadcast_object_list", lst)
a, b = value(rank, 3, torch.float32), value(rank, 5, torch.float32, salt=1)
with dist._coalescing_manager(async_ops=True) as cm:
    dist.all_reduce(a)
    dist.all_reduce(b)
cm.wait()
same(a, reduced(ranks, 3, torch.float32, "sum"), "coalesced all_reduce a")
same(b, reduced(ranks, 5, torch.float32, "sum", salt=1), "coalesced all_reduce b")
outs = [torch.empty(world * 4), torch.empty(world * 2)]
with dist._coalescing_manager(async_ops=True) as cm:
    all_gather_single(outs[0], value(rank, 4, torch.float32))
    all_gather_single(outs[1], value(rank, 2, torch.float32, salt=1))
cm.wait()
same(outs[0], torch.cat([value(r, 4, torch.float32) for r in ranks]), "coalesced all_gather 0")
same(outs[1], torch.cat([value(r, 2, torch.float32, salt=1) for r in ranks]), "coalesced all_gather 1")
outs = [torch.empty(3), torch.empty(2)]
with dist._coalescing_manager(async_ops=True) as cm:
    reduce_scatter_single(outs[0], value(rank, 3 * world, torch.float32))
    reduce_scatter_single(outs[1], value(rank, 2 * world, torch.float32, salt=1))
cm.wait()
same(outs[0], reduced(ranks, 3 * world, torch.float32, "sum")[3 * rank:3 * rank + 3], "coalesced rs 0")
same(outs[1], reduced(ranks, 2 * world, torch.float32, "sum", salt=1)[2 * rank:2 * rank + 2], "coalesced rs 1")

# old style (a device given): ops inside run as issued, _end_coalescing waits for all of them
a, b = value(rank, 4, torch.float32), value(rank, 6, torch.float32, salt=2)
with dist._coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
    dist.all_reduce(a)
    dist.broadcast(b, world - 1, async_op=True)
cm.wait()
same(a, reduced(ranks, 4, torch.float32, "sum"), "device coalescing all_reduce")
same(b, value(world - 1, 6, torch.float32, salt=2), "device coalescing broadcast")

import torch.distributed._functional_collectives as fc  # noqa: E402

g = dist.group.WORLD
same(fc.all_reduce(value(rank, 6, torch.float32), "sum", g), reduced(ranks, 6, torch.float32, "sum"),
     "functional all_reduce")
same(fc.all_gather_tensor(value(rank, 4, torch.float32), 0, g),
     torch.cat([value(r, 4, torch.float32) for r in ranks]), "functional all_gather_tensor")
same(fc.reduce_scatter_tensor(value(rank, 2 * world, torch.float32), "sum", 0, g),
     reduced(ranks, 2 * world, torch.float32, "sum")[2 * rank:2 * rank + 2], "functional reduce_scatter")

# -- receive from any source: torch's recv(src=None) returns the sender's rank -----------------
if rank == 0:
    got = {}
    for _ in range(world - 1):
        buf = torch.empty(1)
        src = dist.recv(buf)
        got[src] = buf.item()
    check(got == {r: float(r) for r in range(1, world)}, "recv from any source", got)
else:
    dist.send(torch.full((1,), float(rank)), 0)

# -- a Work's wait: done in its start, finished by its first polls or in the engine's wait (the
#    sender sleeps first), with a timeout, and failed at its group's deadline -------------------
if rank < 2:
    peer, buf = 1 - rank, torch.empty(3)
    if rank == 0:
        late = dist.irecv(buf, peer, tag=21)
        check(late.wait() is True and late.is_completed(), "a late receive waited for", late)
        same(buf, value(peer, 3, torch.float32), "a late receive")
        timed = dist.irecv(buf, peer, tag=22)
        check(timed.wait(timeout=timedelta(seconds=60)) is True, "a wait with a timeout")
        same(buf, value(peer, 3, torch.float32, salt=1), "a receive waited for with a timeout")
    else:
        time.sleep(0.2)
        check(dist.isend(value(rank, 3, torch.float32), peer, tag=21).wait() is True, "a send's wait")
        dist.send(value(rank, 3, torch.float32, salt=1), peer, tag=22)
short = dist.new_group(backend="mcrdl", timeout=timedelta(seconds=1))
if rank == 0:
    lost = dist.irecv(torch.empty(1), 1, group=short, tag=23)  # nobody sends it
    try:
        lost.wait()
    except mcrdl.CommTimeoutError as exc:
        check("irecv" in str(exc), "the missed deadline names the op", exc)
    else:
        raise AssertionError("a receive nobody sends to completed")
    check(lost.is_completed() and not lost.is_success(), "a work failed at its deadline stays failed", lost)
dist.barrier()

# -- refused with a clear error, on every rank before any traffic ------------------------------


def refused(fn, *needles):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        check(all(n in msg for n in needles), "error message", repr(msg), "lacks", needles)
        return
    raise AssertionError(f"expected an error mentioning {needles}")


refused(lambda: dist.all_reduce(torch.ones(2), op=R.BXOR), "BXOR", "allreduce")
refused(lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=R.BAND), "BAND")
refused(lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=R.AVG), "AVG")
dist.barrier()
verdicts.finished("torch backend ops")
print(f"rank {rank}: TORCH BACKEND OPS OK ({count} checks, backend {backend})")
dist.destroy_process_group()
