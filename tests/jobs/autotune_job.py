"""In-situ autotune (mcrdl.autotune). Usage: autotune_job.py CASE[,CASE...]
(several: in turn, each on a runtime of its own: init, the case, destroy)

Every result is checked against a local reference, during exploration and
after; at the end every member of every group must hold the same winners."""
import json
import os
import random
import sys
import time

import torch

import mcrdl
import verdicts
from common import check
from mcrdl import api
from mcrdl.autotune import bucket, bucket_bounds

cases = sys.argv[1].split(",")
os.environ.setdefault("MCRDL_AUTOTUNE_BLOCK_MS", "5")  # trials (a challenger won per call) end quickly
rank = world = tuner = None


#: cases about how two candidates are judged: mpi against gloo alone (every other case
#: explores every live library)
PAIRED = {"disagree", "step_cost_gloo", "step_cost_mpi"}


def start(case=None):
    """A runtime with autotune on, its tuner fresh."""
    global rank, world, tuner
    mcrdl.init_process_group(("mpi", "gloo") if case in PAIRED else None, timeout=30, autotune=True)
    rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
    tuner = api._runtime.autotune


# float32 elements either side of bucket edges (1 KiB, 4 KiB) for each op's lookup size
EDGES = (1, 255, 256, 257, 1023, 1024, 1025)


def run_ops(group, ranks, numel, salt, async_op=False):
    """One call of each collective on ``group`` (members ``ranks``), checked."""
    me, n = ranks.index(rank), len(ranks)
    works = []

    def later(work, fn):
        if work is None:
            fn()
        else:
            works.append((work, fn))

    def val(r):
        return torch.arange(numel, dtype=torch.float32) + 10 * r + salt

    t = val(rank)
    later(mcrdl.all_reduce(t, group=group, async_op=async_op),
          lambda t=t: check(torch.equal(t, sum(val(r) for r in ranks)), "all_reduce", numel, t[:4]))
    b = val(rank)
    later(mcrdl.broadcast(b, ranks[-1], group=group, async_op=async_op),
          lambda b=b: check(torch.equal(b, val(ranks[-1])), "broadcast", numel))
    out = torch.empty(n * numel)
    later(mcrdl.all_gather_into_tensor(out, val(rank), group=group, async_op=async_op),
          lambda out=out: check(torch.equal(out, torch.cat([val(r) for r in ranks])), "all_gather", numel))
    full = torch.cat([val(rank) + i for i in range(n)])
    part = torch.empty(numel)
    later(mcrdl.reduce_scatter_tensor(part, full, group=group, async_op=async_op),
          lambda part=part: check(torch.equal(part, sum(val(r) + me for r in ranks)), "reduce_scatter", numel))
    parts = [torch.empty(numel) for _ in ranks]
    later(mcrdl.all_gather(parts, val(rank), group=group, async_op=async_op),
          lambda parts=parts: check(all(torch.equal(p, val(r)) for p, r in zip(parts, ranks)), "all_gather list"))
    r = val(rank)
    later(mcrdl.reduce(r, ranks[0], group=group, async_op=async_op),
          lambda r=r: check(me != 0 or torch.equal(r, sum(val(x) for x in ranks)), "reduce", numel))
    gl = [torch.empty(numel) for _ in ranks] if me == 0 else None
    later(mcrdl.gather(val(rank), gl, ranks[0], group=group, async_op=async_op),
          lambda gl=gl: check(me != 0 or all(torch.equal(p, val(x)) for p, x in zip(gl, ranks)), "gather"))
    sc = torch.empty(numel)
    sl = [val(x) for x in ranks] if me == 0 else None
    later(mcrdl.scatter(sc, sl, ranks[0], group=group, async_op=async_op),
          lambda sc=sc: check(torch.equal(sc, val(rank)), "scatter", numel))
    a_in = torch.cat([val(rank) + 100 * i for i in range(n)])
    a_out = torch.empty(n * numel)
    later(mcrdl.all_to_all_single(a_out, a_in, group=group, async_op=async_op),
          lambda a_out=a_out: check(torch.equal(a_out, torch.cat([val(x) + 100 * me for x in ranks])), "a2a"))
    for work, fn in works:
        work.wait()
        fn()


def same_winners(group, ranks, done=True):
    """Every member holds the same outcome (or exploration state, unless
    ``done``) for every bucket of ``group``."""
    mine = [(cls, bucket_bounds(bkt)[0], b.winner, b.agreed, b.calls)
            for (cls, _, bkt), b in sorted(group.tuned.items())]
    if done and any(w is None for _, _, w, _, _ in mine):
        raise AssertionError(f"bucket still exploring: {mine}")
    rows = api._runtime.control_allgather(group, json.dumps(mine).encode())
    check(len(set(rows)) == 1, "ranks disagree on the winners:", *rows)
    return mine


def exploring(group=None):
    """Buckets of ``group`` (default: the world) not decided yet (the same on every member)."""
    g = group or api._runtime.world
    return sum(b.winner is None and b.candidates and key[0] != "barrier" for key, b in g.tuned.items())


def ops():
    """Every collective, sync and async, sizes straddling bucket edges, p2p in
    between (not explored), then the fast paths plan with the winners."""
    ranks = list(range(world))
    for numel in EDGES:
        i = 0
        while i < 2 or exploring():  # until every bucket seen is decided
            check(i < 400, "exploration does not end", tuner.report())
            run_ops(None, ranks, numel, i, async_op=i % 3 == 1)
            x = torch.full((numel,), float(i))
            if rank == 0:
                mcrdl.send(x + 1, 1)
            elif rank == 1:
                mcrdl.recv(x, 0)
                check(torch.equal(x, torch.full((numel,), i + 1.0)), "p2p")
            i += 1
    won = same_winners(api._runtime.world, ranks)
    check(len(won) >= 4 * 3, "too few buckets explored", won)
    # a frozen bucket runs on its fast path, with the winner's plan
    t = torch.ones(256)
    mcrdl.all_reduce(t)
    plan = api._runtime.world.plans[("all_reduce", (t.nbytes, t.dtype), None, False)]  # (the blocking all_reduce plan key)
    winner = next(w for op, lo, w, _, _ in won if op == "all_reduce" and lo <= t.nbytes < 2 * max(lo, 1))
    check(plan[0] == winner, "fast path plans", plan[0], "but the winner is", winner)
    check("autotune" in mcrdl.explain("all_reduce", t), mcrdl.explain("all_reduce", t))


def one_sided():
    """Rank 0 has an outstanding isend (general path), rank 1 does not (fast
    path): both must still follow the same exploration schedule."""
    i = 0
    while i < 2 or exploring():
        check(i < 400, "exploration does not end", tuner.report())
        i += 1
        t = torch.full((64,), float(rank))
        w = mcrdl.isend(torch.ones(8) * i, 1) if rank == 0 else None
        mcrdl.all_reduce(t)
        check(torch.equal(t, torch.full((64,), float(sum(range(world))))), "all_reduce", i, t[:2])
        b = torch.full((300,), float(rank))
        mcrdl.broadcast(b, 0)
        check(torch.equal(b, torch.zeros(300)), "broadcast", i)
        if rank == 1:
            x = torch.empty(8)
            mcrdl.recv(x, 0)
            check(torch.equal(x, torch.ones(8) * i), "recv", i)
        if w is not None:
            w.wait()
    same_winners(api._runtime.world, list(range(world)))


def disagree():
    """Ranks measure opposite orders (rank 0: mpi slow, others: gloo slow);
    the agreement still gives every rank one winner."""
    slow = "mpi" if rank == 0 else "gloo"
    real = tuner.record
    tuner.record = lambda b, name, s: real(b, name, s * (1000 if name == slow else 1))
    for i in range(3 * tuner.rounds):
        t = torch.full((16,), 1.0)
        mcrdl.all_reduce(t)
        check(torch.equal(t, torch.full((16,), float(world))), "all_reduce", i)
    same_winners(api._runtime.world, list(range(world)))


def step_cost(costly):
    """Per call gloo measures faster on every rank (mpi's times are recorded
    1e5x), but every call that runs on ``costly`` slows the job's work after
    it by 5 ms. The trial over blocks of calls sees what per-call times cannot:
    gloo wins unless it is the costly one (with MCRDL_AUTOTUNE_BLOCK_MS=0, no
    trial: gloo always). Rank 1 starts 50 ms late, so the ranks' paces (and
    the blocks they propose) differ: a schedule from unagreed blocks hangs.
    Every third step also broadcasts 1 KiB, learned (and frozen) first: the
    trial finds that period in the group's calls (period 1 if the broadcast's
    fast-path calls go uncounted)."""
    x = torch.zeros(256)
    mcrdl.broadcast(x, src=0)
    while exploring():  # (learned before the hack below: a trial of its own would come first)
        mcrdl.broadcast(x, src=0)
    real = tuner.record
    # (1e5: a gloo call on a loaded machine took longer than 1000 MPI calls in one round)
    tuner.record = lambda b, name, s: real(b, name, s * (1e5 if name == "mpi" else 1))
    ran = []
    be = api._runtime.backends[costly]
    real_all_reduce = be.all_reduce

    def all_reduce(h, t, op):
        if t.dtype == torch.float32:  # (not the agreement's int64 all-reduce)
            ran.append(1)
        return real_all_reduce(h, t, op)
    be.all_reduce = all_reduce
    if rank == 1:
        time.sleep(0.05)
    i = 0
    while i < 2 or exploring():
        check(i < 400, "exploration does not end", tuner.report())
        i += 1
        t = torch.full((16,), float(rank + i))
        mcrdl.all_reduce(t)
        check(torch.equal(t, torch.full((16,), float(sum(range(world)) + world * i))), "all_reduce", i)
        if ran:
            ran.clear()
            time.sleep(0.005)
        if i % 3 == 0:
            x.fill_(i)
            mcrdl.broadcast(x, src=0)
            check(torch.equal(x, torch.full((256,), float(i))), "broadcast", i)
    be.all_reduce = real_all_reduce
    b = api._runtime.world.tuned[("all_reduce", "cpu", bucket(64))]
    trial = tuner.block_ms > 0
    want = "mpi" if trial and costly == "gloo" else "gloo"
    check(b.winner == want, "winner", b.winner, "expected", want, b.how, b.blocks)
    check((b.blocks is not None) == trial, "trial", b.blocks)
    check(not trial or b.blocks["period"] == 3, "the period of the group's calls", b.blocks)
    same_winners(api._runtime.world, list(range(world)))
    rows = api._runtime.control_allgather(api._runtime.world, json.dumps([b.block, b.calls]).encode())
    check(len(set(rows)) == 1, "ranks disagree on the trial's blocks:", *rows)
    print(f"rank {rank}: {b.winner}: {b.how}; {b.blocks}", flush=True)


def slow_rank():
    """Rank 1 arrives late at every call, by a random delay."""
    rng = random.Random(rank)
    i = 0
    while i < 2 or exploring():
        check(i < 400, "exploration does not end", tuner.report())
        if rank == 1:
            time.sleep(rng.random() * 0.002)
        run_ops(None, list(range(world)), 100, i)
        i += 1
    same_winners(api._runtime.world, list(range(world)))


def subgroups():
    """Calls on overlapping subgroups interleave differently on each rank."""
    lo, hi, tail = mcrdl.new_group([0, 1]), mcrdl.new_group([2, 3]), mcrdl.new_group([1, 2, 3])
    mine = [(g, r) for g, r in ((lo, [0, 1]), (hi, [2, 3]), (tail, [1, 2, 3])) if rank in r]
    rt = api._runtime

    def any_rank_exploring():
        """Every rank goes on while any rank's groups explore: each sees only its own
        groups, and lo's and hi's trials (blocks agreed from each group's timings) may
        end at different rounds; a rank that stopped first would leave the others' tail
        and world calls unmatched (seen: its control_allgather met their all_reduce)."""
        return bool(rt.control_max(rt.world, int(any(exploring(g) for g, _ in mine) or exploring())))

    i = 0
    while i < 2 or any_rank_exploring():
        check(i < 600, "exploration does not end", tuner.report())
        for g, r in (mine if i % 3 else mine[::-1]):
            run_ops(g, r, 255 + (i % 2), i)
        run_ops(None, list(range(world)), 64, i)
        i += 1
    for g, r in mine:
        same_winners(g, r)
    same_winners(api._runtime.world, list(range(world)))


def reused():
    """A destroyed group's name given to another group (torch does: its group
    names restart at 0 after destroy_process_group) starts with no autotune state."""
    import torch.distributed as dist

    rt = api._runtime
    if rank == 0:  # a one-rank group "x" that explores and decides its 256 B all_reduce
        solo = rt.new_group([0], name="x", store=dist.PrefixStore("solo/", rt.store))
        for i in range(100):  # (each library that serves it, timed in turn, then decided)
            mcrdl.all_reduce(torch.ones(64), group=solo)
            if i and not exploring(solo):
                break
        check(exploring(solo) == 0, "solo group still exploring")
        rt.destroy_group(solo)
    pair = rt.new_group(list(range(world)), name="x", store=dist.PrefixStore("pair/", rt.store))
    i = 0
    while i < 2 or exploring(pair):
        check(i < 100, "exploration does not end", tuner.report())
        t = torch.full((64,), float(i))
        mcrdl.all_reduce(t, group=pair)
        check(torch.equal(t, torch.full((64,), float(i * world))), "all_reduce", i)
        i += 1
    same_winners(pair, list(range(world)))


def debug_divergence():
    """Debug mode (MCRDL_DEBUG=1) names a rank whose autotune schedule drifted
    from the others' instead of hanging."""
    from mcrdl import CommError

    t = torch.ones(64)
    mcrdl.all_reduce(t)
    if rank == 1:
        next(iter(api._runtime.world.tuned.values())).calls += 1
    try:
        mcrdl.all_reduce(t)
    except CommError as exc:
        check("collective mismatch" in str(exc) and "autotune" in str(exc), exc)
    else:
        raise AssertionError("the drifted schedule was not noticed")


def uneven():
    """all_to_all_single with per-rank sizes in different buckets (ranks agree
    on the size first)."""
    rng = random.Random(7)
    for i in range(4 * tuner.rounds):
        rows = [[rng.choice((1, 200, 300, 1100)) for _ in range(world)] for _ in range(world)]
        send = rows[rank]  # rows[s][d]: what s sends to d
        recv = [rows[s][rank] for s in range(world)]
        inp = torch.cat([torch.full((n,), float(100 * rank + d)) for d, n in enumerate(send)])
        out = torch.empty(sum(recv))
        mcrdl.all_to_all_single(out, inp, recv, send)
        ref = torch.cat([torch.full((n,), float(100 * s + rank)) for s, n in enumerate(recv)])
        check(torch.equal(out, ref), "uneven a2a", i, send, recv)
    same_winners(api._runtime.world, list(range(world)), done=False)


def drift():
    """Drift check (MCRDL_AUTOTUNE_DRIFT=W): once rank 1 arrives 20 ms late at
    every call, rank 0's latency is far above its baseline and the group opens
    the bucket again at one call on every rank, although rank 0 takes the
    general path (an isend outstanding) at calls where rank 1 takes the fast
    path, and some calls are async (counted, not timed)."""
    W = tuner.drift
    check(W >= 2, "run with MCRDL_AUTOTUNE_DRIFT >= 2")
    world_g = api._runtime.world
    calls = 0

    def step():
        nonlocal calls
        calls += 1
        t = torch.full((64,), float(rank + calls))
        w = mcrdl.isend(torch.ones(4) * calls, 1) if rank == 0 and calls % 3 == 0 else None
        work = mcrdl.all_reduce(t, async_op=calls % 5 == 1)
        if work is not None:
            work.wait()
        check(torch.equal(t, torch.full((64,), float(sum(range(world)) + world * calls))), "all_reduce", calls)
        if w is not None:
            w.wait()
        elif rank == 1 and calls % 3 == 0:
            x = torch.empty(4)
            mcrdl.recv(x, 0)
            check(torch.equal(x, torch.ones(4) * calls), "recv", calls)

    while calls < 2 or exploring():
        check(calls < 400, "exploration does not end", tuner.report())
        step()
    b = world_g.tuned[("all_reduce", "cpu", bucket(256))]
    stable = False  # a noisy window (a descheduled rank) may open the bucket before any lateness:
    while not stable:  # go on until 3 windows in a row leave it decided (the same on every rank)
        check(calls < 3000, "the bucket never settles", tuner.report())
        seen = len(b.reopened)
        for _ in range(3 * W):
            step()
        stable = b.winner is not None and len(b.reopened) == seen
    winner = b.winner
    seen = len(b.reopened)
    late = 0
    while len(b.reopened) == seen:
        check(late < 6 * W, "drift not seen", b.base, b.window, tuner.report())
        if rank == 1:
            time.sleep(0.02)
        step()
        late += 1
    last = b.reopened[-1]
    check(last["winner"] == winner and b.candidates[0] == winner, "the winner seeds the new exploration", last)
    check(rank != 0 or last["now_us"] >= 2 * last["base_us"], "opened again without drift", last)
    while exploring():
        check(calls < 2000, "exploration does not end", tuner.report())
        step()
    same_winners(world_g, list(range(world)))
    rows = api._runtime.control_allgather(world_g, json.dumps([len(b.reopened), b.since]).encode())
    check(len(set(rows)) == 1, "ranks disagree on the drift checks:", *rows)
    print(f"rank {rank}: drift checks that opened the bucket: {b.reopened}; now {b.how}", flush=True)
    check("opened again by drift" in mcrdl.explain("all_reduce", torch.ones(64)), mcrdl.explain("all_reduce",
                                                                                             torch.ones(64)))


CASES = {"ops": ops, "drift": drift, "one_sided": one_sided, "disagree": disagree, "slow_rank": slow_rank,
         "subgroups": subgroups, "uneven": uneven, "reused": reused, "debug_divergence": debug_divergence,
         "step_cost_gloo": lambda: step_cost("gloo"), "step_cost_mpi": lambda: step_cost("mpi")}
if len(cases) > 1:
    verdicts.run_parts(cases, CASES, before_each=start, after_each=mcrdl.destroy_process_group)
else:
    start(cases[0])
    CASES[cases[0]]()
    verdicts.finished(cases[0])
    mcrdl.destroy_process_group()
print(f"rank {rank}: {sys.argv[1]} OK", flush=True)
