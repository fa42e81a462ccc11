"""Tensor fusion: coalesced ops equal per-tensor ops for every live backend and for
selection, sync and async; buffer reuse; program order; futures; subgroups; bad
input. Usage: fusion_job.py"""
import torch

import mcrdl
from mcrdl.backends import OPS  # the libraries that have every op
import verdicts
from common import check, reduced, value
from mcrdl.features.fusion import (all_gather_coalesced, all_reduce_coalesced, broadcast_coalesced,
                                   fusion_buffer_pool, plan_buckets)

mcrdl.init_process_group(timeout=120)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
live = mcrdl.live_backends("cpu", ops=OPS)
BUCKET = 4096  # small: some tensors are bigger than a bucket, several buckets per dtype
count = 0

# (dtype, shape, transposed): mixed dtypes, 1-element, fused and bigger-than-bucket,
# non-contiguous both fused and alone, and an empty tensor.
SPECS = [
    (torch.float32, (1,), False), (torch.float16, (7,), False), (torch.bfloat16, (100,), False),
    (torch.int64, (3,), False), (torch.float32, (5000,), False), (torch.float16, (1000,), False),
    (torch.bfloat16, (3000,), False), (torch.int64, (600,), False), (torch.float32, (0,), False),
    (torch.float32, (10, 20), True), (torch.int64, (1,), False), (torch.float16, (1,), False),
    (torch.float32, (40, 50), True), (torch.bfloat16, (2, 3, 4), False), (torch.float32, (300,), False),
    (torch.float16, (513,), False), (torch.int64, (2, 50), True), (torch.float32, (1,), False),
    (torch.bool, (9,), False), (torch.float64, (33,), False), (torch.bool, (3000,), False),
]


def make(r, for_product=False, floats_only=False):
    out = []
    for i, (dtype, shape, transposed) in enumerate(SPECS):
        if floats_only and not dtype.is_floating_point:
            continue
        numel = 1
        for s in shape:
            numel *= s
        t = value(r, numel, dtype, for_product, salt=i).view(shape)
        out.append(t.t() if transposed else t)
    return out


def finish(work, async_op, tensors=None):
    if async_op:
        check(isinstance(work, mcrdl.Work), "expected a Work, got", work)
        work.wait()
        check(work.is_completed(), "work not completed after wait")
        if tensors is not None:
            check(len(work.result()) == len(tensors) and
                  all(a is b for a, b in zip(work.result(), tensors)), "result() is not the tensors")
    else:
        check(work is None, "sync op returned", work)


def same(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)


# the plan really splits: several buckets, some direct, several per dtype
plan = plan_buckets(make(rank), BUCKET)
check(any(b.direct for b in plan) and any(not b.direct for b in plan), "plan", plan)
check(sum(not b.direct and b.dtype == torch.float32 for b in plan) >= 1, "plan", plan)
check(all(b.nbytes <= BUCKET or b.direct for b in plan), "bucket over cap", plan)

for backend in live + [None]:
    for async_op in (False, True):
        kw = dict(backend=backend, async_op=async_op)
        tag = f"[backend={backend} async={async_op}]"
        for bucket in (BUCKET, None):  # None: module default (25 MiB): one bucket per dtype
            for op in ("sum", "max", "min", "product", "avg"):
                rop = getattr(mcrdl.ReduceOp, op.upper())
                floats = op == "avg"
                ts = make(rank, op == "product", floats)
                per = [t.clone() for t in ts]
                for p in per:
                    mcrdl.all_reduce(p, op=rop, backend=backend)
                finish(all_reduce_coalesced(ts, op=rop, bucket_bytes=bucket, **kw), async_op, ts)
                for i, (t, p) in enumerate(zip(ts, per)):
                    check(same(t, p), tag, "all_reduce_coalesced", op, "tensor", i, t, p)
                    count += 1
                if op == "sum":
                    for i, t in enumerate(ts):
                        ref = reduced(range(world), t.numel(), t.dtype, "sum", salt=i)
                        check(torch.equal(t.reshape(-1), ref.view(SPECS[i][1]).reshape(-1)
                                          if not SPECS[i][2] else ref.view(SPECS[i][1]).t().reshape(-1)),
                              tag, "all_reduce_coalesced vs local reference", i)
            # broadcast from the last rank
            src = world - 1
            ts = make(rank)
            finish(broadcast_coalesced(ts, src, bucket_bytes=bucket, **kw), async_op, ts)
            for i, (t, ref) in enumerate(zip(ts, make(src))):
                check(same(t, ref), tag, "broadcast_coalesced tensor", i)
                count += 1
            # all_gather: output_lists[i][r] = rank r's input i (non-contiguous outputs too)
            inputs = make(rank)
            outs = [[torch.empty_like(t) if not SPECS[i][2] else torch.empty(t.shape[::-1], dtype=t.dtype).t()
                     for _ in range(world)] for i, t in enumerate(inputs)]
            flat_outs = [o for lst in outs for o in lst]
            finish(all_gather_coalesced(outs, inputs, bucket_bytes=bucket, **kw), async_op, flat_outs)
            per_rank = [make(r) for r in range(world)]
            for i in range(len(inputs)):
                for r in range(world):
                    check(same(outs[i][r], per_rank[r][i]), tag, "all_gather_coalesced", i, r)
                    count += 1

# -- buffer reuse -------------------------------------------------------------------------
pool = fusion_buffer_pool()
pool.clear()
nfused = sum(not b.direct for b in plan_buckets(make(rank), BUCKET))
ts = make(rank)
all_reduce_coalesced(ts, bucket_bytes=BUCKET)
check(pool.lent() == [], "buffers still lent after a sync call", pool.stats())
first = pool.cached()
check(len(first) == nfused, "cached buffers", len(first), "expected", nfused)
s1 = pool.stats()
all_reduce_coalesced(ts, bucket_bytes=BUCKET)
s2 = pool.stats()
check(s2["hits"] - s1["hits"] == nfused and s2["misses"] == s1["misses"], "no reuse", s1, s2)
second = pool.cached()
check({id(b) for b in first} == {id(b) for b in second}, "second call used other buffers")
count += 3
# async: an outstanding call's buffers are never lent to another call
ta, tb = make(rank), make(rank)
wa = all_reduce_coalesced(ta, bucket_bytes=BUCKET, async_op=True)
lent_a = pool.lent()
check(len(lent_a) == nfused and all(any(b is f for f in first) for b in lent_a),
      "async call did not reuse the free buffers")
wb = all_reduce_coalesced(tb, bucket_bytes=BUCKET, async_op=True)
lent_b = [b for b in pool.lent() if not any(b is a for a in lent_a)]
check(len(lent_b) == nfused, "second outstanding call shares buffers with the first")
ptr_a = {b.data_ptr() for b in lent_a}
check(all(b.data_ptr() not in ptr_a for b in lent_b), "buffer memory shared across outstanding calls")
wa.wait()
wb.wait()
check(pool.lent() == [], "buffers still lent after wait")
for t, u, p in zip(ta, tb, make(rank)):
    ref = p.clone()
    mcrdl.all_reduce(ref)
    check(same(t, ref) and same(u, ref), "concurrent async coalesced results")
wc = all_reduce_coalesced(make(rank), bucket_bytes=BUCKET, async_op=True)
check(all(any(b is x for x in lent_a + lent_b) for b in pool.lent()), "freed buffers not reused")
wc.wait()
count += 6

# -- futures ------------------------------------------------------------------------------
ts = make(rank)
fut = all_reduce_coalesced(ts, bucket_bytes=BUCKET, async_op=True).get_future()
res = fut.wait()
check(len(res) == len(ts) and all(a is b for a, b in zip(res, ts)), "future result is not the tensors")
check(torch.equal(ts[4], reduced(range(world), 5000, torch.float32, "sum", salt=4)), "future values")
count += 1

# -- program order: an op on an original tensor waits for the outstanding fused call ----
if "mpi" in live and "gloo" in live:
    for first_b, second_b in (("mpi", "gloo"), ("gloo", "mpi")):
        ts = make(rank)
        w = all_reduce_coalesced(ts, bucket_bytes=BUCKET, async_op=True, backend=first_b)
        mcrdl.all_reduce(ts[14], backend=second_b)  # fused in a bucket: written by unpacking
        w.wait()
        ref = reduced(range(world), 300, torch.float32, "sum", salt=14) * world
        check(torch.equal(ts[14], ref), "program order", first_b, second_b, ts[14][:4], ref[:4])
        # and a fused call reading a tensor an outstanding op writes
        t = value(rank, 300, torch.float32, salt=14)
        w = mcrdl.all_reduce(t, async_op=True, backend=first_b)
        all_reduce_coalesced([t, value(rank, 5, torch.float32)], backend=second_b)
        w.wait()
        check(torch.equal(t, ref), "program order (fused reads)", first_b, second_b)
        count += 2

# -- empty inputs ----------------------------------------------------------------------------
check(all_reduce_coalesced([]) is None, "empty sync")
w = all_reduce_coalesced([], async_op=True)
check(isinstance(w, mcrdl.Work) and w.is_completed(), "empty async", w)
w = broadcast_coalesced([torch.empty(0)], 0, async_op=True)
check(isinstance(w, mcrdl.Work) and w.wait(), "zero-element async")

# -- subgroup (4+ ranks) ------------------------------------------------------------------------
if world >= 4:
    sub = [1, 3]
    g = mcrdl.new_group(sub)
    for backend in live + [None]:
        ts = make(rank)
        before = [t.clone() for t in ts]
        w = all_reduce_coalesced(ts, group=g, bucket_bytes=BUCKET, async_op=True, backend=backend)
        if rank in sub:
            w.wait()
            for i, t in enumerate(ts):
                ref = before[i].clone()
                ref.copy_(sum(make(r)[i].to(torch.float64) for r in sub).to(t.dtype))
                check(same(t, ref), "subgroup all_reduce_coalesced", backend, i)
            ts = make(rank)
            broadcast_coalesced(ts, src=3, group=g, bucket_bytes=BUCKET, backend=backend)
            check(all(same(a, b) for a, b in zip(ts, make(3))), "subgroup broadcast_coalesced")
            inputs = make(rank)
            outs = [[torch.empty_like(t) for _ in sub] for t in inputs]
            all_gather_coalesced(outs, inputs, group=g, bucket_bytes=BUCKET, backend=backend)
            check(all(same(outs[i][j], make(r)[i]) for i in range(len(inputs))
                      for j, r in enumerate(sub)), "subgroup all_gather_coalesced")
            count += 3
        else:
            check(w is None, "non-member got a Work")
            check(all(same(a, b) for a, b in zip(ts, before)), "non-member tensors changed")

# -- bad input: refused on the calling rank, naming the function and item ---------------------
def refuses(exc_type, words, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        for w in words:
            check(w in str(exc), f"error {exc!r} does not mention {w!r}")
        return
    raise AssertionError(f"{fn.__name__}{args} did not raise {exc_type.__name__}")


t = torch.ones(4)
refuses(TypeError, ["all_reduce_coalesced", "tensors[1]", "int"], all_reduce_coalesced, [t, 3])
refuses(TypeError, ["all_reduce_coalesced", "list"], all_reduce_coalesced, t)
refuses(mcrdl.UnsupportedError, ["all_reduce_coalesced", "tensors[1]", "torch.int64", "AVG"],
        all_reduce_coalesced, [t, torch.ones(3, dtype=torch.int64)], op=mcrdl.ReduceOp.AVG)
refuses(mcrdl.UnsupportedError, ["broadcast_coalesced", "tensors[0]", "complex"],
        broadcast_coalesced, [torch.ones(2, dtype=torch.complex64)], 0)
refuses(ValueError, ["broadcast_coalesced", "src"], broadcast_coalesced, [t], world)
refuses(ValueError, ["all_gather_coalesced", "output_lists[0]"], all_gather_coalesced, [[t]], [t])
refuses(ValueError, ["all_gather_coalesced", "output_lists[0][0]"], all_gather_coalesced,
        [[torch.ones(3)] * world], [t])
refuses(ValueError, ["all_reduce_coalesced", "bucket_bytes"], all_reduce_coalesced, [t], bucket_bytes=0)
if "gloo" in live:  # a later bucket the forced backend cannot run: refused before the first is sent
    refuses(mcrdl.UnsupportedError, ["all_reduce_coalesced", "tensors[1]", "int16", "gloo"],
            all_reduce_coalesced, [t, torch.ones(3, dtype=torch.int16)], backend="gloo")
check(fusion_buffer_pool().lent() == [], "refused calls leaked buffers")
# nothing was sent: the next collective still matches across ranks
t = torch.full((3,), float(rank))
all_reduce_coalesced([t, torch.ones(2)])
check(torch.equal(t, torch.full((3,), float(sum(range(world))))), "after refusals", t)
count += 10

mcrdl.destroy_process_group()
verdicts.finished("fusion")
print(f"rank {rank}: OK {count} checks on {live + ['selected']}")
