"""Every op x live CPU backend x dtypes x sizes x groups x sync/async, checked
against references computed locally. Usage: ops_job.py [backend ...]

``OPS_JOB_BREAK=<op>@<rank>``: that rank's ``mcrdl.<op>`` adds 1 to its result (a
deliberately broken op: the test of the test harness)."""
import os
import sys

import torch

import mcrdl
from mcrdl.backends import OPS  # the libraries that have every op
import verdicts
from common import DTYPES, FLOATS, check, reduced, value

mcrdl.init_process_group(timeout=120)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
backends = sys.argv[1:] or mcrdl.live_backends("cpu", ops=OPS)
groups = [(None, list(range(world)))]
if world >= 4:
    sub_ranks = [1, 3]
    groups.append((mcrdl.new_group(sub_ranks), sub_ranks))
#: The compiled driver keeps plans; the pure-Python build (MCRDL_NATIVE=0) runs every call on the general path.
PLANNED = mcrdl.facts.load() is not mcrdl.facts
SIZES = (0, 1, 7, 1000)  # 7 and 1000 are not multiples of 2 or 4 ranks... 1000 is of 2/4 but 7 not
count = 0
if os.environ.get("OPS_JOB_BREAK", "@").split("@")[1] == str(rank):
    broken_op = os.environ["OPS_JOB_BREAK"].split("@")[0]
    correct = getattr(mcrdl, broken_op)

    def broken(tensor, *args, **kwargs):
        work = correct(tensor, *args, **kwargs)
        if work is not None:
            work.wait()
        if tensor.dtype != torch.bool:
            tensor.add_(1)
        return work

    setattr(mcrdl, broken_op, broken)


def finish(work, async_op):
    if async_op:
        check(isinstance(work, mcrdl.Work), "expected a Work, got", work)
        work.wait()
        check(work.is_completed(), "work not completed after wait")
    else:
        check(work is None, "sync op returned", work)


for backend in backends:
    for group, ranks in groups:
        member = rank in ranks
        n = len(ranks)
        grank = ranks.index(rank) if member else -1
        root = ranks[-1]
        for dtype in DTYPES:
            ops = ("sum", "max", "min", "product") + (("avg",) if dtype in FLOATS and dtype != torch.bool else ())
            for numel in SIZES:
                for async_op in (False, True):
                    kw = dict(group=group, async_op=async_op, backend=backend)
                    tag = f"[{backend} group={ranks} {dtype} numel={numel} async={async_op}]"
                    if not member:
                        t = value(rank, numel, dtype)
                        check(mcrdl.all_reduce(t, **kw) is None, tag, "non-member got work")
                        check(torch.equal(t, value(rank, numel, dtype)), tag, "non-member tensor changed")
                        continue
                    # all_reduce with every op
                    for op in ops:
                        t = value(rank, numel, dtype, op == "product")
                        finish(mcrdl.all_reduce(t, op=getattr(mcrdl.ReduceOp, op.upper()), **kw), async_op)
                        check(torch.equal(t, reduced(ranks, numel, dtype, op)), tag, "all_reduce", op, t)
                        count += 1
                    # reduce (only the root's result is defined)
                    t = value(rank, numel, dtype)
                    finish(mcrdl.reduce(t, dst=root, **kw), async_op)
                    if rank == root:
                        check(torch.equal(t, reduced(ranks, numel, dtype, "sum")), tag, "reduce", t)
                    for op in ops[1:]:  # (AVG: the root divides, the others' tensors are not results)
                        t = value(rank, numel, dtype, op == "product")
                        finish(mcrdl.reduce(t, dst=root, op=getattr(mcrdl.ReduceOp, op.upper()), **kw), async_op)
                        if rank == root:
                            check(torch.equal(t, reduced(ranks, numel, dtype, op)), tag, "reduce", op, t)
                    # broadcast
                    t = value(rank, numel, dtype)
                    finish(mcrdl.broadcast(t, src=root, **kw), async_op)
                    check(torch.equal(t, value(root, numel, dtype)), tag, "broadcast", t)
                    # all_gather_into_tensor and all_gather
                    inp = value(rank, numel, dtype)
                    out = torch.empty(n * numel, dtype=dtype)
                    finish(mcrdl.all_gather_into_tensor(out, inp, **kw), async_op)
                    ref = torch.cat([value(r, numel, dtype) for r in ranks])
                    check(torch.equal(out, ref), tag, "all_gather_into_tensor", out)
                    outs = [torch.empty(numel, dtype=dtype) for _ in ranks]
                    finish(mcrdl.all_gather(outs, inp, **kw), async_op)
                    check(all(torch.equal(o, value(r, numel, dtype)) for o, r in zip(outs, ranks)), tag, "all_gather")
                    # reduce_scatter_tensor and reduce_scatter
                    full = value(rank, n * numel, dtype)
                    out = torch.empty(numel, dtype=dtype)
                    finish(mcrdl.reduce_scatter_tensor(out, full, **kw), async_op)
                    ref = reduced(ranks, n * numel, dtype, "sum")[grank * numel:(grank + 1) * numel]
                    check(torch.equal(out, ref), tag, "reduce_scatter_tensor", out, ref)
                    out = torch.empty(numel, dtype=dtype)
                    finish(mcrdl.reduce_scatter(out, list(full.chunk(n)) if numel else
                                                [torch.empty(0, dtype=dtype)] * n, **kw), async_op)
                    check(torch.equal(out, ref), tag, "reduce_scatter", out, ref)
                    for op in ops[1:]:  # (an op other than SUM runs the general path)
                        full = value(rank, n * numel, dtype, op == "product")
                        finish(mcrdl.reduce_scatter_tensor(out, full, op=getattr(mcrdl.ReduceOp, op.upper()),
                                                           **kw), async_op)
                        ref = reduced(ranks, n * numel, dtype, op)[grank * numel:(grank + 1) * numel]
                        check(torch.equal(out, ref), tag, "reduce_scatter_tensor", op, out, ref)
                    # gather / scatter
                    glist = [torch.empty(numel, dtype=dtype) for _ in ranks] if rank == root else None
                    finish(mcrdl.gather(value(rank, numel, dtype), glist, dst=root, **kw), async_op)
                    if rank == root:
                        check(all(torch.equal(o, value(r, numel, dtype)) for o, r in zip(glist, ranks)), tag, "gather")
                    slist = [value(100 + i, numel, dtype) for i in range(n)] if rank == root else None
                    out = torch.empty(numel, dtype=dtype)
                    finish(mcrdl.scatter(out, slist, src=root, **kw), async_op)
                    check(torch.equal(out, value(100 + grank, numel, dtype)), tag, "scatter", out)
                    # the same with the root's list as views of one buffer (the fast path when
                    # blocking: no packing copy), and with the root's own block aliased (general path)
                    whole = torch.empty(n, numel, dtype=dtype)
                    views = list(whole.unbind(0)) if rank == root else None
                    finish(mcrdl.gather(value(rank, numel, dtype), views, dst=root, **kw), async_op)
                    if rank == root:
                        check(torch.equal(whole.view(-1), torch.cat([value(r, numel, dtype) for r in ranks])),
                              tag, "gather into views")
                        views[grank].copy_(value(rank, numel, dtype))
                    finish(mcrdl.gather(views[grank] if rank == root else value(rank, numel, dtype), views,
                                        dst=root, **kw), async_op)
                    if rank == root:
                        check(torch.equal(whole.view(-1), torch.cat([value(r, numel, dtype) for r in ranks])),
                              tag, "gather of an aliased block")
                    whole = torch.stack([value(100 + i, numel, dtype) for i in range(n)]) if rank == root else None
                    out = torch.empty(numel, dtype=dtype)
                    finish(mcrdl.scatter(out, list(whole.unbind(0)) if rank == root else None, src=root, **kw),
                           async_op)
                    check(torch.equal(out, value(100 + grank, numel, dtype)), tag, "scatter from views", out)
                    if numel:
                        g = group or mcrdl.api._runtime.world
                        if PLANNED and dtype is not torch.bool:  # every reduction runs from a plan
                            keyed = {(k[0], k[1][1]) for k in g.plans if k[-1] is async_op
                                     and isinstance(k[1][1], mcrdl.ReduceOp)}
                            wanted = {(o, getattr(mcrdl.ReduceOp, r.upper())) for r in ops[1:]
                                      for o in ("all_reduce", "reduce", "reduce_scatter_tensor")}
                            check(wanted <= keyed, tag, "reductions without a plan", wanted - keyed)
                        if not PLANNED:
                            check(not g.plans, tag, "plans in the pure-Python build", list(g.plans))
                        elif not async_op:
                            check({"gather", "scatter"} <= {k[0] for k in g.plans}, tag, "no fast-path plan")
                        else:  # async plans: keys end with True
                            planned = {k[0] for k in g.plans if k[-1] is True}
                            expected = {"broadcast", "all_gather_into_tensor"} | (
                                set() if dtype is torch.bool else {"all_reduce", "reduce_scatter_tensor"})
                            check(expected <= planned, tag, "no async fast-path plan", planned)
                    # all_to_all_single, even and uneven (rank r sends j+r+1 rows to peer j... bounded)
                    inp = value(rank, n * numel, dtype)
                    out = torch.empty(n * numel, dtype=dtype)
                    finish(mcrdl.all_to_all_single(out, inp, **kw), async_op)
                    ref = torch.cat([value(r, n * numel, dtype)[grank * numel:(grank + 1) * numel] for r in ranks])
                    check(torch.equal(out, ref), tag, "all_to_all_single", out, ref)
                    sends = lambda src_g: [(src_g + j) % 3 + (numel > 0) for j in range(n)]  # rows src->j
                    in_splits = sends(grank)
                    out_splits = [sends(i)[grank] for i in range(n)]
                    inp = value(rank, 2 * sum(in_splits), dtype).view(-1, 2)
                    out = torch.empty(sum(out_splits), 2, dtype=dtype)
                    finish(mcrdl.all_to_all_single(out, inp, out_splits, in_splits, **kw), async_op)
                    pieces = []
                    for i, r in enumerate(ranks):
                        s = sends(i)
                        src = value(r, 2 * sum(s), dtype).view(-1, 2)
                        pieces.append(src[sum(s[:grank]):sum(s[:grank + 1])])
                    check(torch.equal(out, torch.cat(pieces)), tag, "all_to_all_single uneven")
                    # all_to_all (lists of different sizes)
                    ins = [value(rank * 10 + j, j + numel, dtype) for j in range(n)]
                    outs = [torch.empty(grank + numel, dtype=dtype) for _ in range(n)]
                    finish(mcrdl.all_to_all(outs, ins, **kw), async_op)
                    check(all(torch.equal(outs[i], value(r * 10 + grank, grank + numel, dtype))
                              for i, r in enumerate(ranks)), tag, "all_to_all")
                    count += 10
            # point to point in a ring over the group, tags, and batch_isend_irecv
            if member and n > 1:
                nxt, prv = ranks[(grank + 1) % n], ranks[(grank - 1) % n]
                for numel in (0, 5, 4096):
                    src = value(rank, numel, dtype)
                    dst = torch.empty(numel, dtype=dtype)
                    if grank % 2 == 0:
                        mcrdl.send(src, nxt, group=group, tag=3, backend=backend)
                        mcrdl.recv(dst, prv, group=group, tag=3, backend=backend)
                    else:
                        mcrdl.recv(dst, prv, group=group, tag=3, backend=backend)
                        mcrdl.send(src, nxt, group=group, tag=3, backend=backend)
                    check(torch.equal(dst, value(prv, numel, dtype)), "send/recv", backend, dtype, numel)
                    g = group or mcrdl.api._runtime.world
                    check({"send", "recv"} <= {k[0] for k in g.plans} if PLANNED else not g.plans,
                          "p2p fast-path plans (none in the pure-Python build)", backend)
                    dst = torch.empty(numel, dtype=dtype)
                    works = mcrdl.batch_isend_irecv([
                        mcrdl.P2POp(mcrdl.irecv, dst, prv, group, 5, backend),
                        mcrdl.P2POp(mcrdl.isend, src, nxt, group, 5, backend)])
                    for w in works:
                        w.wait()
                    check(torch.equal(dst, value(prv, numel, dtype)), "batch_isend_irecv", backend, dtype)
                    dst = torch.empty(numel, dtype=dtype)
                    received = mcrdl.irecv(dst, prv, group=group, tag=6, backend=backend)
                    mcrdl.isend(src, nxt, group=group, tag=6, backend=backend).wait()
                    received.wait()
                    check(torch.equal(dst, value(prv, numel, dtype)), "isend/irecv", backend, dtype, numel)
                    check({"isend", "irecv"} <= {k[0] for k in g.plans} if PLANNED else not g.plans,
                          "async p2p plans (none in the pure-Python build)", backend)
                    count += 3
        # barrier, sync and async
        if rank in ranks:
            mcrdl.barrier(group=group, backend=backend)
            mcrdl.barrier(group=group, backend=backend, async_op=True).wait()

    # non-contiguous tensors: results land in the original views
    base = value(rank, 24, torch.float32).view(4, 6)
    t = base.t()
    mcrdl.all_reduce(t, backend=backend)
    check(torch.equal(base, reduced(range(world), 24, torch.float32, "sum").view(4, 6)), "non-contiguous all_reduce")
    inp = value(rank, 12, torch.float32).view(3, 4)[:, ::2]
    out = torch.empty(world * 6, dtype=torch.float32).view(world * 3, 2)
    mcrdl.all_gather_into_tensor(out, inp, backend=backend)
    ref = torch.cat([value(r, 12, torch.float32).view(3, 4)[:, ::2] for r in range(world)])
    check(torch.equal(out, ref), "non-contiguous all_gather_into_tensor", out, ref)
    # torch 2.13's names for all_gather_into_tensor and reduce_scatter_tensor
    out = torch.empty(world * 4)
    mcrdl.all_gather_single(out, value(rank, 4, torch.float32), backend=backend)
    check(torch.equal(out, torch.cat([value(r, 4, torch.float32) for r in range(world)])), "all_gather_single")
    out = torch.empty(4)
    mcrdl.reduce_scatter_single(out, value(rank, 4 * world, torch.float32), backend=backend)
    ref = reduced(range(world), 4 * world, torch.float32, "sum")[4 * rank:4 * rank + 4]
    check(torch.equal(out, ref), "reduce_scatter_single", out, ref)
    # futures
    t = value(rank, 8, torch.float32)
    fut = mcrdl.all_reduce(t, backend=backend, async_op=True).get_future()
    res = fut.wait()
    check(torch.equal(res[0], reduced(range(world), 8, torch.float32, "sum")), "future result")

if "mpi" in backends:
    from mcrdl.backends import native
    print(f"rank {rank}: MPI hot path {native.status()}")
    lo, hi, ranks = mcrdl.api._runtime.backends["mpi"].rows_rule
    print(f"rank {rank}: reduce_scatter_tensor by rows " + (f"for outputs of {lo}-{hi} bytes, groups of <= {ranks}"
                                                            if ranks else "never"))
mcrdl.destroy_process_group()
verdicts.finished("ops")
print(f"rank {rank}: OK {count} checks on {backends}")
