"""Randomized mixing stress test. Usage: stress_job.py SEED[,SEED...] NOPS

Every rank draws the same program from each SEED (one after the other): ops, dtypes, sizes spanning the
thresholds of a hand-written tuning table, sync/async, waits in random order,
explicit and selected backends, and chained ops on overlapping slices of
shared buffers across backends. Every result is checked against a reference
computed locally."""
import random
import sys
import time

import torch

import mcrdl
import verdicts
from common import check, reduced, value

seeds, nops = [int(s) for s in sys.argv[1].split(",")], int(sys.argv[2])
T = [1024, 16384]  # table thresholds in bytes: mpi below 1 KB, gloo to 16 KB, mpi above
rules = [{"max_bytes": T[0], "backend": "mpi"}, {"max_bytes": T[1], "backend": "gloo"},
         {"max_bytes": None, "backend": "mpi"}]
ops = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather", "scatter",
       "all_to_all", "p2p")
# Group size 4 is not listed: it uses the rules of 2 (the largest listed size below).
table = {"format": "mcrdl-tuning/1", "metadata": {"note": "stress test"},
         "rules": {op: {"2": rules} for op in ops}}
mcrdl.init_process_group(timeout=60, tuning_table=table)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
DT = (torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16, torch.uint8)
SIZES = (1, 3, 64, 255, 256, 257, 1000, 4095, 4096, 4097, 9000)  # elements; straddle T per dtype
pending = []  # (work, check)
used = {}  # async works per backend, of the current seed

# Shared buffers: identical on every rank, so an all_reduce SUM of a slice
# multiplies it by `world`; expected values are tracked per element.
SLOT = 1 << 14
slots = [torch.full((SLOT,), 1.0, dtype=torch.float64) for _ in range(3)]
expect = [torch.full((SLOT,), 1.0, dtype=torch.float64) for _ in range(3)]


def submit(work, fn):
    if work is None:
        fn()
    else:
        used[work.backend] = used.get(work.backend, 0) + 1
        pending.append((work, fn))


def drain(k=None):
    rng.shuffle(pending)
    take = len(pending) if k is None else min(k, len(pending))
    for _ in range(take):
        work, fn = pending.pop()
        work.wait()
        fn()


for seed in seeds:
    rng = random.Random(seed)
    used.clear()
    for buf in slots + expect:
        buf.fill_(1.0)
    start = time.perf_counter()
    for i in range(nops):
        kind = rng.choice(ops + ("slot", "slot", "barrier"))
        dtype = rng.choice(DT)
        numel = rng.choice(SIZES)
        backend = rng.choice((None, None, None, "mpi", "gloo"))
        async_op = rng.random() < 0.5
        kw = dict(async_op=async_op, backend=backend)
        root = rng.randrange(world)
        salt = i
        tag = f"seed {seed} op {i} {kind} {dtype} n={numel} backend={backend} async={async_op}"
        if kind == "slot":
            s = rng.randrange(3)
            a = rng.randrange(SLOT - 1)
            b = rng.randrange(a + 1, min(SLOT, a + 6000) + 1)
            if expect[s][a:b].abs().max() > 1e12:
                drain()
                slots[s].fill_(1.0)
                expect[s].fill_(1.0)
            w = mcrdl.all_reduce(slots[s][a:b], **kw)
            expect[s][a:b] *= world
            submit(w, lambda: None)
        elif kind == "all_reduce":
            op = rng.choice(("sum", "max", "min"))
            t = value(rank, numel, dtype, salt=salt)
            ref = reduced(range(world), numel, dtype, op, salt=salt)
            submit(mcrdl.all_reduce(t, op=getattr(mcrdl.ReduceOp, op.upper()), **kw),
                   lambda t=t, ref=ref, tag=tag: check(torch.equal(t, ref), tag))
        elif kind == "broadcast":
            t = value(rank, numel, dtype, salt=salt)
            ref = value(root, numel, dtype, salt=salt)
            submit(mcrdl.broadcast(t, root, **kw), lambda t=t, ref=ref, tag=tag: check(torch.equal(t, ref), tag))
        elif kind == "reduce":
            t = value(rank, numel, dtype, salt=salt)
            ref = reduced(range(world), numel, dtype, "sum", salt=salt)
            submit(mcrdl.reduce(t, root, **kw),
                   lambda t=t, ref=ref, tag=tag, root=root: check(rank != root or torch.equal(t, ref), tag))
        elif kind == "all_gather":
            inp = value(rank, numel, dtype, salt=salt)
            out = torch.empty(world * numel, dtype=dtype)
            ref = torch.cat([value(r, numel, dtype, salt=salt) for r in range(world)])
            submit(mcrdl.all_gather_into_tensor(out, inp, **kw),
                   lambda out=out, ref=ref, tag=tag: check(torch.equal(out, ref), tag))
        elif kind == "reduce_scatter":
            full = value(rank, world * numel, dtype, salt=salt)
            out = torch.empty(numel, dtype=dtype)
            ref = reduced(range(world), world * numel, dtype, "sum", salt=salt)[rank * numel:(rank + 1) * numel]
            submit(mcrdl.reduce_scatter_tensor(out, full, **kw),
                   lambda out=out, ref=ref, tag=tag: check(torch.equal(out, ref), tag))
        elif kind == "gather":
            gl = [torch.empty(numel, dtype=dtype) for _ in range(world)] if rank == root else None
            refs = [value(r, numel, dtype, salt=salt) for r in range(world)]
            submit(mcrdl.gather(value(rank, numel, dtype, salt=salt), gl, root, **kw),
                   lambda gl=gl, refs=refs, tag=tag: check(gl is None or all(
                       torch.equal(a, b) for a, b in zip(gl, refs)), tag))
        elif kind == "scatter":
            sl = [value(r, numel, dtype, salt=salt) for r in range(world)] if rank == root else None
            out = torch.empty(numel, dtype=dtype)
            ref = value(rank, numel, dtype, salt=salt)
            submit(mcrdl.scatter(out, sl, root, **kw), lambda out=out, ref=ref, tag=tag: check(torch.equal(out, ref), tag))
        elif kind == "all_to_all":
            # uneven: rank r sends rows(r, j) to j; per-rank totals straddle thresholds
            rows = lambda r, j: (numel * (r + 1) + j * 7 + salt) % (2 * numel + 1)
            send = [rows(rank, j) for j in range(world)]
            recv = [rows(r, rank) for r in range(world)]
            inp = value(rank, sum(send), dtype, salt=salt)
            out = torch.empty(sum(recv), dtype=dtype)
            ref = torch.cat([value(r, sum(rows(r, j) for j in range(world)), dtype, salt=salt)[
                sum(rows(r, j) for j in range(rank)):sum(rows(r, j) for j in range(rank + 1))]
                for r in range(world)])
            submit(mcrdl.all_to_all_single(out, inp, recv, send, **kw),
                   lambda out=out, ref=ref, tag=tag: check(torch.equal(out, ref), tag))
        elif kind == "p2p":
            nxt, prv = (rank + 1) % world, (rank - 1) % world
            src = value(rank, numel, dtype, salt=salt)
            dst = torch.empty(numel, dtype=dtype)
            ref = value(prv, numel, dtype, salt=salt)
            ws = mcrdl.batch_isend_irecv([mcrdl.P2POp(mcrdl.irecv, dst, prv, tag=i % 7, backend=backend),
                                          mcrdl.P2POp(mcrdl.isend, src, nxt, tag=i % 7, backend=backend)])
            submit(ws[1], lambda: None)
            submit(ws[0], lambda dst=dst, ref=ref, tag=tag: check(torch.equal(dst, ref), tag))
        else:
            submit(mcrdl.barrier(async_op=async_op, backend=backend), lambda: None)
        if rng.random() < 0.15:
            drain(rng.randrange(1, 4))
    drain()
    for s in range(3):
        check(torch.equal(slots[s], expect[s]), f"seed {seed}: slot {s} differs from the one-backend result")
    print(f"rank {rank}: STRESS OK seed={seed} ops={nops} world={world} in {time.perf_counter() - start:.1f} s, "
          f"async works per backend {used}")
mcrdl.destroy_process_group()
verdicts.finished("stress")
