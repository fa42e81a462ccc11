"""In-situ autotuning: a job learns its backend choices from its own calls.

For each group, op class and size bucket (powers of two: bucket ``b`` holds
messages of ``2**(b-1)`` to ``2**b - 1`` bytes), the first calls of the job
run on each live backend able to take them, interleaved (one call on each in
turn, so a slow first call at a new size or a change of load hits every
backend alike): one warm-up round, then ``calls`` timed rounds. The call
after the last of them agrees on the winner: every member contributes its
median per backend, the group takes the minimum per backend (the member that
arrives last waits least: its time is the op's, the others' include waiting
for it), and the fastest backend wins; the seed (the tuning table's choice,
else the default backend) keeps the bucket unless another measures
``margin`` faster. The choice is then frozen, and the fast paths plan with it.

Every member picks the same backend for the same call without talking: the
schedule depends only on how many calls of the bucket the group has made,
which is the same on every member because collectives are called in the same
order everywhere (whether a member calls sync or async does not matter). The
agreement is itself a collective of the group at a call every member reaches.

Blocking calls are timed, from start to return; on CUDA tensors from an idle
stream to the results' arrival (the stream is synchronized before and after:
NCCL and staged MPI return once their results are stream-ordered). Async calls run on their
slot's backend (so the schedule holds however each member calls) but are not
timed: the time until an overlapped op is seen complete is not its cost to the
step. Measured on the DDP workload (docs/autotune.md): timed to when the
progress engine first saw completion, the 1 MiB gradient bucket measured gloo
1.7 ms and MPI 2.9 ms (MPI's nonblocking ops progress only when polled, gloo's
in its own threads) and picked gloo, and steps got 30% slower than on MPI. A
bucket only ever called async keeps its seed. Point-to-point is not explored
(a send's and its receive's call counts differ); it is selected as without
autotune.

Drift check (``drift=N``, ``MCRDL_AUTOTUNE_DRIFT=N``; off by default): a
frozen bucket's calls are counted, on the fast paths too, and the blocking
calls among the last :data:`DRIFT_SAMPLE` before each window's end are timed.
At the end of each window of ``N`` calls the group checks the bucket, at a
call every member reaches, as it agreed the winner. Each member's baseline is
its lowest window median so far; :data:`DRIFT_WINDOWS` windows in a row whose
median is at least :data:`DRIFT_FACTOR` times the baseline, on any member,
open the bucket again: it is explored as before, with the winner as seed,
from the next call. Barriers are not watched.

Trial over blocks (``block_ms``, ``MCRDL_AUTOTUNE_BLOCK_MS``; 100 by default, 0:
off): a challenger that wins per call still has to show it costs the job no
more than the seed does. A call's time cannot show what a backend costs the
work around it (under load, a gloo all-gather measured faster than MPI's while
the steps around it took twice as long: docs/results/autotune.md), so the
bucket's next calls run in blocks, seed and challenger in the order
:data:`TRIAL_ORDER`, each block enough calls to span about ``block_ms`` of the
job (the members agree on that count, the largest proposed, with the winner),
and each call is timed to the next: the job's own work between the calls
included. The call after the last block decides, again at a call every member
reaches: the challenger is refused, and the seed kept, if it took longer than
the seed on every member. Longer per period of the job's calls: while a trial
runs, the group's autotuned calls all take the general path, which counts
them, so each trial call has its place in the group's sequence of calls; when
the places repeat (a training step's calls), each side's time per period is
the sum of its mean time after each place of a period (blocks rarely hold whole
steps: the block that holds a step's slow part twice would count against its
backend). Otherwise, longer over its blocks in total. One bucket of a group is
on trial at a time (trials at once would time each other's blocks); another
winner runs on its seed until the group's trial ends, which every member sees
at the same call of the group.
"""
from __future__ import annotations

import copy
import datetime
import json
import math
import os
import socket
import statistics
import time
from typing import Optional

from . import settings
from .tuning import CLASS_METHODS, FORMAT, OP_CLASS
from .work import DONE

#: Classes explored (collectives, whose members call in the same order).
EXPLORED = frozenset(c for c in set(OP_CLASS.values()) if c != "p2p")
#: "Not measured" in the agreement (nanoseconds; int64 on the wire).
UNMEASURED = 2 ** 62
#: A window's median at least this many times the baseline is drift.
DRIFT_FACTOR = 2.0
#: Calls timed per drift window: its last ones (timing every call of a window costs more).
DRIFT_SAMPLE = 16
#: Slow windows in a row (on one member) that open a bucket again: one slow
#: window is often one descheduled rank or a call that took the general path.
DRIFT_WINDOWS = 2
#: The trial's blocks: seed (0) and challenger (1) in the Thue-Morse order, so
#: that a steady (linear or quadratic) change of load adds the same to both totals.
TRIAL_ORDER = (0, 1, 1, 0, 1, 0, 0, 1)
#: Calls per trial block at most.
TRIAL_MAX_CALLS = 1024
#: A trial has stalled (the job stopped calling its bucket) when the group made
#: a whole trial's worth (8 blocks of K) of gaps of this many calls, or of twice
#: the trial's largest gap between two of its calls if that is more, without a
#: call of its bucket. Until then the group's calls take the general path and
#: its other winners wait on their seeds. K spans about ``block_ms`` of the
#: bucket's calls, so this is about 8 x 2 x ``block_ms`` of the group's calls
#: at their pace (at least 8 x 64 / gap x ``block_ms`` when the gap is short):
#: seconds at the default 100 ms.
TRIAL_STALL_GAP = 64


def bucket(nbytes: int) -> int:
    """Size bucket of a message: ``nbytes.bit_length()``."""
    return nbytes.bit_length()


def bucket_bounds(b: int) -> tuple[int, int]:
    """Smallest and largest size (bytes) of bucket ``b``."""
    return (0, 0) if b == 0 else (1 << (b - 1), (1 << b) - 1)


def period_of(steps: list[int], longest: int = 256) -> Optional[int]:
    """The smallest ``p`` (at most ``longest`` and half the length) with
    ``steps[i] == steps[i + p]`` for all but one ``i`` in 16 (and 2 more), else
    None. An irregular call now and then (a barrier between warm-up and timed
    steps, a logging call every so many steps) changes one step and so two
    comparisons."""
    n = len(steps)
    for p in range(1, min(longest, n // 2) + 1):
        slack, misses = 2 + (n - p) // 16, 0
        for i in range(n - p):
            if steps[i] != steps[i + p]:
                misses += 1
                if misses > slack:
                    break
        else:
            return p
    return None


def per_period(gaps: list[float], sides: list[int], period: int) -> Optional[tuple[float, float]]:
    """Seed's (side 0) and challenger's time per period of the job's calls:
    over the period's places, the sum of the mean time from a call at that
    place to the next on that side. None if a place has no call on a side.
    Blocks of a trial rarely hold whole periods, and the Thue-Morse order does
    not even out where they cut one (8 blocks of 5 calls, 8 calls a step: one
    side holds three more calls of two places than the other, a step's slow
    part maybe); the means per place do."""
    sums, counts = [[0.0] * period, [0.0] * period], [[0] * period, [0] * period]
    for i, (gap, side) in enumerate(zip(gaps, sides)):
        sums[side][i % period] += gap
        counts[side][i % period] += 1
    if not all(all(c) for c in counts):
        return None
    seed, challenger = (sum(s / c for s, c in zip(sums[k], counts[k])) for k in (0, 1))
    return seed, challenger


class Bucket:
    """One (op class, size bucket) of one group: its schedule and its outcome."""

    __slots__ = ("candidates", "calls", "times", "winner", "agreed", "how", "since", "window", "base",
                 "slow", "reopened", "first", "trial", "block", "trial_from", "marks", "blocks", "trial_at", "max_gap")

    def __init__(self, candidates: tuple[str, ...]):
        self.reopened: list[dict] = []  # drift checks that opened the bucket again
        self._explore(candidates)
        if len(candidates) == 1:
            self.winner, self.how = candidates[0], "only backend able to run it"

    def _explore(self, candidates: tuple[str, ...]) -> None:
        """Start (or start again) exploring, ``candidates[0]`` as the seed."""
        self.candidates = candidates
        self.calls = 0
        self.times: dict[str, dict[int, float]] = {c: {} for c in candidates}  # round -> seconds
        self.winner: Optional[str] = None
        self.agreed: dict[str, Optional[float]] = {}  # backend -> group's median, µs (None: unmeasured)
        self.how = "exploring"
        self.since = 0  # calls since frozen (drift check)
        self.window: list[float] = []  # this rank's timed calls of the current drift window
        self.base: Optional[float] = None  # this rank's lowest window median since freezing
        self.slow = 0  # this rank's slow windows in a row
        self.first = 0.0  # when the first exploring call started (perf_counter)
        self.trial: Optional[str] = None  # the challenger on trial over blocks of calls
        self.block = 0  # calls per trial block (agreed)
        self.trial_from: Optional[int] = None  # the bucket's call count when its trial began
        self.marks: list[tuple[int, float]] = []  # every trial call: (the group's call count, when it began)
        self.blocks: Optional[dict] = None  # the trial's outcome on this rank (report)
        self.trial_at = 0  # the group's call count at the trial's last call (or start)
        self.max_gap = 1  # the most calls of the group between two of the trial's


class Autotuner:
    """Per-group exploration state; consulted by the API for every collective."""

    def __init__(self, selector, calls: int = 3, warmup: int = 1, margin: float = 0.05,
                 save: Optional[str] = None, drift: int = 0, block_ms: float = 100.0):
        if calls < 1 or warmup < 0 or drift < 0 or drift == 1 or not 0 <= block_ms < math.inf:
            raise ValueError(f"autotune: calls must be >= 1, warm-up >= 0, drift 0 (off) or >= 2 and the "
                             f"trial's block >= 0 ms, got {calls}, {warmup}, {drift}, {block_ms}")
        self.selector = selector
        self.calls, self.warmup, self.margin, self.save_path = calls, warmup, margin, save
        self.drift = drift  # drift-check window in calls (0: off)
        self.block_ms = block_ms  # a trial block's span (0: no trial)
        self.rounds = warmup + calls  # exploration rounds: one call on each candidate
        self.groups: list[tuple[str, int, dict]] = []  # (name, size, Group.tuned) of every group explored
        self.excess_s = 0.0  # this rank's timed calls on losers, beyond the winner's median

    @staticmethod
    def settings(enabled: Optional[bool]) -> Optional[dict]:
        """The job's autotune settings (``autotune=`` or ``MCRDL_AUTOTUNE=1``,
        ``MCRDL_AUTOTUNE_CALLS``, ``MCRDL_AUTOTUNE_SAVE``, ``MCRDL_AUTOTUNE_DRIFT``,
        ``MCRDL_AUTOTUNE_BLOCK_MS``), or None when off."""
        if enabled is None:
            enabled = settings.get("MCRDL_AUTOTUNE")
        if not enabled:
            return None
        return {"calls": settings.get("MCRDL_AUTOTUNE_CALLS"), "save": settings.get("MCRDL_AUTOTUNE_SAVE"),
                "drift": settings.get("MCRDL_AUTOTUNE_DRIFT"), "block_ms": settings.get("MCRDL_AUTOTUNE_BLOCK_MS")}

    def explores(self, op: str, explicit: Optional[str]) -> bool:
        """Does autotune decide this call (no ``backend=``, no static map entry)?"""
        cls = OP_CLASS[op]
        return explicit is None and cls in EXPLORED and cls not in self.selector.static

    def frozen(self, g, op: str, nbytes: int, device: str, chosen: str, ignore_trial: bool = False) -> Optional[str]:
        """The backend for a fast-path plan: ``chosen`` (the selector's) when
        autotune does not decide the op, the frozen winner, or None (the general
        path runs the call) while the bucket is unexplored or exploring, or
        while a bucket of the group is on trial (which counts the group's
        calls; with ``ignore_trial``, the winner then too: what the call runs)."""
        cls = OP_CLASS[op]
        if cls not in EXPLORED or cls in self.selector.static:
            return chosen
        b = g.tuned.get((cls, device, bucket(nbytes)))
        return None if b is None or (g.trying is not None and not ignore_trial) else b.winner

    def pick(self, rt, g, op: str, nbytes: int, device: str, runnable) -> tuple[str, Optional[Bucket]]:
        """The backend for this call of ``op`` (None: the selector's, when the
        bucket's backend cannot run it) and the bucket to time it for (None: not
        timed). ``runnable(name)``: can this backend run this call."""
        cls = OP_CLASS[op]
        key = (cls, device, bucket(nbytes))
        g.tuned_calls += 1
        b = g.tuned.get(key)
        if b is None:
            if not g.tuned:
                self.groups.append((g.name, g.size, g.tuned))
            b = g.tuned[key] = Bucket(self._candidates(cls, g.size, device, key[2], g.declined))
        owner = g.trying
        if owner is not None and owner is not b and self._stalled(g, owner):
            self._abandon(g, owner)
        if b.winner is not None:
            name = b.winner
            # (not timed during a trial: the general path's calls are no drift)
            timed = self._drifts(cls, b) and self._count(rt, g, b) and owner is None and runnable(name)
            return (name if runnable(name) else None), (b if timed else None)
        if b.trial is not None:
            name = self._trial_call(rt, g, b)
            return (name if runnable(name) else None), None
        rnd, slot = divmod(b.calls, len(b.candidates))
        if not b.calls:
            b.first = time.perf_counter()
        b.calls += 1
        if rnd == self.rounds:
            self._agree(rt, g, b)
            name = b.winner or b.candidates[0]  # (a trial begins at the next call)
            return (name if runnable(name) else None), None
        name = b.candidates[slot]
        if not runnable(name):  # e.g. a dtype only some backends take: not timed
            return None, None
        return name, (b if rnd >= self.warmup else None)

    def record(self, b: Bucket, name: str, seconds: float) -> None:
        """The time of the call :meth:`pick` just gave ``b`` for (it is in the
        round it counted, or in the drift window once ``b`` is frozen)."""
        if b.winner is not None:
            b.window.append(seconds)
        else:
            b.times[name][(b.calls - 1) // len(b.candidates)] = seconds

    def watched(self, rt, g, op: str, nbytes: int, start, timed: bool):
        """``start`` of a fast-path plan, counted for the drift check as the
        general path counts calls of a frozen bucket; ``timed`` (a blocking
        start on the winner): the window's sampled calls are timed too, waiting
        inside and returning DONE. The count is inlined (a method call per
        call would cost more than the rest of it)."""
        cls = OP_CLASS[op]
        b = g.tuned.get((cls, "cpu", bucket(nbytes)))
        if b is None or b.winner is None or not self._drifts(cls, b):
            return start
        every, first = self.drift, self._first_sampled()
        if not timed:
            def counted(*args):
                b.since += 1
                if not b.since % every:
                    self._check(rt, g, b)
                return start(*args)
            return counted
        engine, name = rt.engine, b.winner

        def counted_and_timed(*args):
            b.since += 1
            at = b.since % every
            if at < first:
                if not at:
                    self._check(rt, g, b)
                return start(*args)
            began = time.perf_counter()
            pending = start(*args)
            if pending is not DONE:
                engine.block(op, name, pending, g, args)
            b.window.append(time.perf_counter() - began)
            return DONE
        return counted_and_timed

    def _drifts(self, cls: str, b: Bucket) -> bool:
        """Is frozen ``b`` watched for drift? Not a barrier: its time is mostly
        how unevenly the ranks arrive, not the backend's."""
        return bool(self.drift) and len(b.candidates) > 1 and cls != "barrier"

    def _first_sampled(self) -> int:
        """The first timed call's place in a drift window (the last
        :data:`DRIFT_SAMPLE` calls before the check are timed)."""
        return self.drift - min(DRIFT_SAMPLE, self.drift - 1)

    def _count(self, rt, g, b: Bucket) -> bool:
        """Count a call of frozen ``b``; at the end of each window of ``drift``
        calls the group checks ``b``. True if this call is to be timed."""
        b.since += 1
        at = b.since % self.drift
        if not at:
            self._check(rt, g, b)
        return at >= self._first_sampled()

    def _check(self, rt, g, b: Bucket) -> None:
        """The drift check of frozen ``b``, a collective of ``g`` at a call every
        member reaches (the count is the same everywhere): it opens ``b`` again
        when a member's window median was :data:`DRIFT_FACTOR` times its
        baseline (its lowest window median so far) in :data:`DRIFT_WINDOWS`
        windows in a row. A window with fewer than half its sampled calls timed
        (async calls are not), or fewer than 5, judges nothing. The call that
        runs the check still runs on the old winner."""
        window, b.window = b.window, []
        sampled = self.drift - self._first_sampled()
        now = statistics.median(window) if 2 * len(window) >= sampled and len(window) >= min(5, sampled) \
            else None
        if now is not None:
            b.slow = b.slow + 1 if b.base is not None and now >= DRIFT_FACTOR * b.base else 0
            b.base = now if b.base is None else min(b.base, now)
        if not rt.control_max(g, int(b.slow >= DRIFT_WINDOWS)):
            return
        reopened = {"call": b.since, "winner": b.winner, "agreed_us": b.agreed, "trial": b.blocks,
                    "base_us": None if b.base is None else round(b.base * 1e6, 1),
                    "now_us": None if now is None else round(now * 1e6, 1)}
        b._explore((b.winner, *(c for c in b.candidates if c != b.winner)))
        b.reopened.append(reopened)
        b.how = f"exploring again: latency doubled on a member (drift check {len(b.reopened)})"
        g.plans.clear()  # plans are kept only for frozen buckets

    def _candidates(self, cls: str, size: int, device: str, bkt: int, declined: tuple) -> tuple[str, ...]:
        """The live backends that have this op class on ``device`` and serve the
        group, the table's (or default) choice first."""
        sel = self.selector
        seed = None
        if sel.table is not None:
            seed = sel.table.lookup(cls, size, bucket_bounds(bkt)[0], device)
        if seed is None:
            seed = sel.device_defaults.get(device, sel.default)
        refused = {n for n, _ in declined}
        live = sorted(n for n, be in sel.live.items()  # one order on every rank
                      if device in be.devices and CLASS_METHODS[cls] <= be.ops and n not in refused)
        return tuple(dict.fromkeys(([seed] if seed in live else []) + live))

    def _agree(self, rt, g, b: Bucket) -> None:
        """Freeze ``b`` (a collective of ``g``). Per backend the group takes the
        minimum over members of their medians; a backend other than the seed
        wins only if that is ``margin`` below the seed's and, on every member,
        it beat the seed in every round both were timed in (at least 2): calls
        of one round ran back to back, so a burst of load or a slow first call
        is no win. Otherwise the seed stays. With ``block_ms``, the winning
        challenger goes on trial (:meth:`_confirm` decides) instead; the members
        propose each a block (the calls spanning ``block_ms`` at this rank's pace
        so far) and the largest is agreed."""
        seed, n = b.candidates[0], len(b.candidates)
        medians = [-int(statistics.median(b.times[c].values()) * 1e9) if b.times[c] else -UNMEASURED
                   for c in b.candidates]
        verdicts = [-int(self._beats_every_round(b, c)) for c in b.candidates]
        every = max(1e-9, (time.perf_counter() - b.first) / (b.calls - 1))  # this rank's time per call
        block = min(TRIAL_MAX_CALLS, max(1, math.ceil(self.block_ms / 1e3 / every))) if self.block_ms else 0
        both = rt.control_max(g, medians + verdicts + [block])  # (medians, verdicts negated: minimum)
        group = [-t for t in both[:n]]
        clear_everywhere = [t == -1 for t in both[n:2 * n]]
        b.agreed = {c: (None if t >= UNMEASURED else t / 1e3) for c, t in zip(b.candidates, group)}
        best = min(zip(group, b.candidates))
        if best[0] >= UNMEASURED:
            b.winner, b.how = seed, "kept the seed: no call was timed (async calls only)"
        elif group[0] >= UNMEASURED or best[1] == seed:  # (the seed could not run these calls)
            b.winner, b.how = best[1], "measured fastest"
        else:
            ok = [(t, c) for t, c, clear in zip(group, b.candidates, clear_everywhere)
                  if c != seed and clear and t < group[0] * (1 - self.margin)]
            if ok and both[-1]:
                b.trial, b.block = min(ok)[1], both[-1]
                b.how = f"{b.trial} measured fastest per call: on trial in blocks of {b.block} calls"
                if g.trying is None:  # else it waits on the seed for the group's trial to end
                    self._begin_trial(g, b)
                return
            if ok:
                b.winner, b.how = min(ok)[1], "measured fastest, in every round on every rank"
            else:
                b.winner, b.how = seed, (f"kept the seed: {best[1]} was not {self.margin:.0%} faster, or not "
                                         "in every round on every rank")
        self._tally(b)

    def _trial_call(self, rt, g, b: Bucket) -> str:
        """The backend for this call of ``b`` on trial: its block's, or at the
        call after the last block the group's verdict; the seed while another
        bucket of the group is on trial (then this call may begin the trial).
        Every input is a call count, the same on every member."""
        if b.trial_from is None:
            if g.trying is not None:
                b.calls += 1
                return b.candidates[0]
            self._begin_trial(g, b)
        blk = (b.calls - b.trial_from) // b.block
        b.calls += 1
        b.max_gap, b.trial_at = max(b.max_gap, g.tuned_calls - b.trial_at), g.tuned_calls
        b.marks.append((g.tuned_calls, time.perf_counter()))
        if blk < len(TRIAL_ORDER):
            return b.trial if TRIAL_ORDER[blk] else b.candidates[0]
        self._confirm(rt, g, b)
        return b.winner

    @staticmethod
    def _begin_trial(g, b: Bucket) -> None:
        """Put ``b`` on trial, from its call number ``b.calls``. Until the
        verdict (or abandonment) every autotuned collective of ``g`` takes the
        general path (the group's plans are dropped and none is made), where
        :meth:`pick` counts it, so each trial call knows its place in the
        group's sequence of calls."""
        g.trying, b.trial_from, b.trial_at = b, b.calls, g.tuned_calls
        g.plans.clear()

    def _confirm(self, rt, g, b: Bucket) -> None:
        """Freeze ``b`` after its trial (a collective of ``g``): the seed stays
        if the challenger took longer on every member; otherwise the challenger
        wins. Longer per period of the group's calls when they repeat
        (:func:`per_period`: blocks need not hold whole steps), else over the
        blocks in total."""
        seed, challenger = names = b.candidates[0], b.trial
        at = [t for _, t in b.marks]  # 8 blocks of calls, then this one
        took: dict[str, list[float]] = {seed: [], challenger: []}
        for blk, side in enumerate(TRIAL_ORDER):
            took[names[side]].append(at[(blk + 1) * b.block] - at[blk * b.block])
        period = period_of([q - p for (p, _), (q, _) in zip(b.marks, b.marks[1:])])
        gaps = [t1 - t0 for t0, t1 in zip(at, at[1:])]  # from each trial call to the next
        per = period and per_period(gaps, [TRIAL_ORDER[i // b.block] for i in range(len(gaps))], period)
        slower = per[1] > per[0] if per else sum(took[challenger]) > sum(took[seed])
        refused = rt.control_max(g, -int(slower)) == -1  # negated: on every member
        b.blocks = {"calls": b.block, "ms": {n: [round(t * 1e3, 2) for t in ts] for n, ts in took.items()},
                    "period": period,
                    "per_period_ms": {n: round(t * 1e3, 3) for n, t in zip(names, per)} if per else None,
                    "refused": refused}
        b.trial, g.trying, b.marks = None, None, []
        judged = (f"per period of the job's calls ({period} calls of this bucket)" if per else
                  f"over its blocks of {b.block} calls in total")
        if refused:
            b.winner, b.how = seed, (f"kept the seed: {challenger} measured faster per call, but took longer "
                                     f"{judged}, the job's work between the calls included, than {seed} on every "
                                     f"rank")
        else:
            b.winner, b.how = challenger, (f"measured fastest, in every round on every rank, and took no longer "
                                           f"{judged} than {seed}")
        loser = challenger if refused else seed
        if per:  # the loser's periods (4 blocks of K calls) at its time per period beyond the winner's
            periods = len(TRIAL_ORDER) // 2 * b.block / period
            lost = (per[names.index(loser)] - per[names.index(b.winner)]) * periods
        else:  # the loser's blocks beyond the winner's
            lost = sum(took[loser]) - sum(took[b.winner])
        self.excess_s += max(0.0, lost)
        self._tally(b)

    @staticmethod
    def _stalled(g, b: Bucket) -> bool:
        """Has ``b``'s trial stalled (:data:`TRIAL_STALL_GAP`)? Counted in the
        group's calls since the trial's last call (or its start), which every
        member counts alike (they all take the general path meanwhile)."""
        return g.tuned_calls - b.trial_at > len(TRIAL_ORDER) * b.block * max(TRIAL_STALL_GAP, 2 * b.max_gap)

    def _abandon(self, g, b: Bucket) -> None:
        """Freeze ``b``, whose trial stalled, on its seed, and free the group's trial."""
        done = b.calls - b.trial_from
        b.blocks = {"calls": b.block, "ms": None, "refused": True, "stalled_after": done}
        b.winner, b.how = b.candidates[0], (f"kept the seed: {b.trial}'s trial stalled after {done} of "
                                            f"{len(TRIAL_ORDER) * b.block} calls (the job stopped calling it)")
        b.trial, g.trying, b.marks = None, None, []
        self._tally(b)

    def _tally(self, b: Bucket) -> None:
        """Add this rank's timed calls on the losers of frozen ``b``, beyond the winner's median, to the cost."""
        if b.times[b.winner]:  # (a refused challenger was faster per call: no cost there)
            best_s = statistics.median(b.times[b.winner].values())
            self.excess_s += max(0.0, sum(t - best_s for c in b.candidates if c != b.winner
                                          for t in b.times[c].values()))

    def _beats_every_round(self, b: Bucket, c: str) -> bool:
        """Was ``c`` faster than the seed in every round (at least 2) both were timed in here?"""
        seed = b.times[b.candidates[0]]
        rounds = [r for r in b.times[c] if r in seed]
        return len(rounds) >= 2 and all(b.times[c][r] < seed[r] for r in rounds)

    # -- reporting -------------------------------------------------------------------
    def report(self) -> list[dict]:
        """One row per explored bucket: group, op class, sizes, what each backend
        measured (``us``: the group's agreed median; ``mine_us``: this rank's
        timed calls), the winner and why."""
        rows = []
        for gname, size, buckets in self.groups:
            for (cls, device, bkt), b in sorted(buckets.items()):
                lo, hi = bucket_bounds(bkt)
                rows.append({"group": gname, "group_size": size, "op": cls, "device": device,
                             "min_bytes": lo, "max_bytes": hi, "calls": b.calls, "us": b.agreed,
                             "mine_us": {c: [round(t * 1e6, 1) for t in ts.values()] for c, ts in b.times.items()},
                             "winner": b.winner, "how": b.how, "trial": b.blocks, "reopened": b.reopened})
        return rows

    def peek(self, g, op: str, nbytes: int, device: str) -> str:
        """This call's place in its bucket's schedule, for debug mode's cross-rank check."""
        b = g.tuned.get((OP_CLASS[op], device, bucket(nbytes)))
        if b is None:
            return "new"
        return f"call {b.calls}" if b.winner is None else f"{b.winner}, frozen call {b.since}"

    def describe(self, g, op: str, nbytes: int, device: str = "cpu") -> Optional[str]:
        """What autotune did for this call's bucket (None: it does not decide it)."""
        cls = OP_CLASS[op]
        if cls not in EXPLORED or cls in self.selector.static:
            return None
        b = g.tuned.get((cls, device, bucket(nbytes)))
        if b is None:
            return "autotune: not called yet (the next calls explore)"
        if b.trial is not None and b.trial_from is None:
            return f"autotune: {b.trial} waits on {b.candidates[0]} for another bucket's trial to end"
        if b.trial is not None:
            return (f"autotune: {b.trial} on trial against {b.candidates[0]} ({b.calls - b.trial_from} of "
                    f"{len(TRIAL_ORDER) * b.block} calls, in blocks of {b.block})")
        if b.winner is None:
            return f"autotune: exploring ({b.calls} of {len(b.candidates) * self.rounds} calls)"
        us = ", ".join(f"{c} {'-' if t is None else f'{t:.1f} us'}" for c, t in b.agreed.items())
        again = f"; opened again by drift {len(b.reopened)}x" if b.reopened else ""
        return f"autotune: {b.how}" + (f" ({us})" if us else "") + again

    def table(self, world_size: int) -> dict:
        """What was learned, as a tuning table (``MCRDL_TUNING_TABLE`` next run):
        the seed table with the learned buckets written over it; where there is
        no seed, a size between learned buckets takes the next bucket above.
        Groups of one size share rules: the first group learned wins a bucket."""
        learned: dict[tuple[str, str, int], dict[tuple[int, int], str]] = {}
        for row in self.report():
            if row["winner"] is not None:
                learned.setdefault((row["device"], row["op"], row["group_size"]), {}).setdefault(
                    (row["min_bytes"], row["max_bytes"]), row["winner"])
        seed = self.selector.table
        rules = copy.deepcopy(seed.to_dict()["rules"]) if seed is not None else {}
        for (device, op, size), ranges in learned.items():
            base = seed.rules_for(op, size, device) if seed is not None else None
            rules.setdefault(device, {}).setdefault(op, {})[str(size)] = _overlay(base, ranges)
        return {"format": FORMAT,
                "metadata": {"learned": "in-situ autotune (MCRDL_AUTOTUNE=1)", "world_size": world_size,
                             "seed_table": None if seed is None else seed.source,
                             "hosts": [socket.gethostname()],
                             "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                             "calls_per_backend": self.calls, "warmup_calls": self.warmup,
                             "margin": self.margin, "drift_window": self.drift, "trial_block_ms": self.block_ms,
                             "exploration_excess_s": round(self.excess_s, 6),
                             "buckets": self.report()},
                "rules": rules}

    def save(self, path: str, world_size: int) -> None:
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.table(world_size), f, indent=2)
            f.write("\n")
        os.replace(tmp, path)


def _overlay(base: Optional[list[dict]], ranges: dict[tuple[int, int], str]) -> list[dict]:
    """Rules giving each learned (min_bytes, max_bytes) range its winner and
    every other size what ``base`` (tuning-table rules) gives it; without a
    base, the next learned range above, else the largest."""
    def backend_at(n: int) -> str:
        for (lo, hi), name in ranges.items():
            if lo <= n <= hi:
                return name
        if base:
            return next((r["backend"] for r in base if r["max_bytes"] is None or n <= r["max_bytes"]),
                        base[-1]["backend"])
        above = [(lo, name) for (lo, _), name in ranges.items() if lo > n]
        return min(above)[1] if above else max(ranges.items())[1]

    points = sorted({hi for _, hi in ranges} | {lo - 1 for lo, _ in ranges if lo > 0}
                    | {r["max_bytes"] for r in base or () if r["max_bytes"] is not None})
    rules: list[dict] = []
    for limit, name in [(p, backend_at(p)) for p in points] + [(None, backend_at(points[-1] + 1))]:
        if rules and rules[-1]["backend"] == name:
            rules[-1]["max_bytes"] = limit
        else:
            rules.append({"max_bytes": limit, "backend": name})
    return rules
