"""Turn interleaved measurements into a tuning table.

For each op, sizes are walked in increasing order; the fastest backend (median
over rounds of the slowest rank's time) wins a size, but the previous size's
winner keeps it unless the new one is faster by more than ``margin`` (no
flipping on noise). Adjacent sizes with one winner merge into one range whose
``max_bytes`` is its largest measured size; the last range is open-ended.
Each range records the smallest measured advantage of its backend over the
runner-up (``margin``). Bench ops of one selection class (``all_to_all`` and
``all_to_allv``) share the class's rules: a backend's time at a size is then
the sum over the forms measured there, so the rule serves both.

A slow phase of one backend during the sweep (the scheduler putting both
polling ranks on one core, another job's burst) would leave a range for the
other backend in the table. So sizes won by a backend other than the one
that wins most of the class (:func:`contested`) are measured again after the
sweep, and each backend is judged by its better pass (:func:`best_of`).

:func:`run` is the whole procedure in a job (``mcrdl tune``; the demo and the
workloads' ``--tune`` call it too).
"""
from __future__ import annotations

import json
import math
import warnings
from collections import Counter
from typing import Optional, Sequence

from .. import api
from . import bench
from .bench import Result, human
from ..tuning import FORMAT, OP_CLASS


def _class_times(results: Sequence[Result], backends: Sequence[str]) -> dict:
    """{class: {size: {backend: time}}}: per selection class, each backend's
    time summed over the class's bench ops measured at that size (a backend
    missing one of them there is left out)."""
    forms: dict[str, dict[int, dict[str, dict[str, float]]]] = {}
    for r in results:
        if r.variant in backends:
            forms.setdefault(OP_CLASS[r.op], {}).setdefault(r.bytes, {}).setdefault(r.op, {})[r.variant] = r.max_us
    out: dict = {}
    for cls, by_size in forms.items():
        for size, by_op in by_size.items():
            common = set.intersection(*(set(t) for t in by_op.values()))
            if common:
                out.setdefault(cls, {})[size] = {b: sum(t[b] for t in by_op.values())
                                                 for b in backends if b in common}
    return out


def decide(results: Sequence[Result], backends: Sequence[str], margin: float = 0.05):
    """{class: [(size, winner, advantage)]} from forced-backend results: each
    size's winner (:func:`per_size`), but one backend for every all_to_all size
    (:func:`one_for_all_to_all`)."""
    out = per_size(results, backends, margin)
    if "all_to_all" in out:
        out["all_to_all"] = one_for_all_to_all(out["all_to_all"], _class_times(results, backends)["all_to_all"])
    return out


def one_for_all_to_all(rows: list, by_size: dict) -> list:
    """The all_to_all rows on the one backend with the least geometric mean of
    its time over each size's best: with two backends in its rules, ranks
    sending uneven sizes agree on the size at every call (a control all-reduce
    and the general path: 60 us per call here at 2 ranks, 12x MPI's planned call
    below 4 KiB, docs/tuning-table.md), more than a faster library gains on the
    largest sizes."""
    if len({b for _, b, _ in rows}) < 2:
        return rows
    sizes = [size for size, _, _ in rows]
    every = [b for b in by_size[sizes[0]] if all(b in by_size[s] for s in sizes)]
    spread = lambda b: sum(math.log(by_size[s][b] / min(by_size[s].values())) for s in sizes)
    one = min(every, key=spread)
    return [(s, one, min((t for b, t in by_size[s].items() if b != one), default=by_size[s][one])
             / by_size[s][one] - 1) for s in sizes]


def per_size(results: Sequence[Result], backends: Sequence[str], margin: float = 0.05):
    """{class: [(size, winner, advantage)]}: each size's fastest backend (the
    previous size's while within ``margin`` of it)."""
    out = {}
    for op, by_size in _class_times(results, backends).items():
        rows, incumbent = [], None
        for size in sorted(by_size):
            times = by_size[size]
            best = min(times, key=times.get)
            if incumbent in times and times[incumbent] <= times[best] * (1 + margin):
                best = incumbent
            others = [t for b, t in times.items() if b != best]
            advantage = (min(others) / times[best] - 1) if others else 0.0
            rows.append((size, best, advantage))
            incumbent = best
        out[op] = rows
    return out


def contested(results: Sequence[Result], backends: Sequence[str], margin: float = 0.05) -> dict:
    """{bench op: [sizes]} to measure again: the sizes where the class's
    winner is not the backend that wins most of the class's sizes (every
    bench op of the class is measured there)."""
    ops_of: dict[str, set] = {}
    for r in results:
        ops_of.setdefault(OP_CLASS[r.op], set()).add(r.op)
    out = {}
    for cls, rows in per_size(results, backends, margin).items():
        majority = Counter(b for _, b, _ in rows).most_common(1)[0][0]
        sizes = [size for size, b, _ in rows if b != majority]
        if sizes:
            out.update({op: sizes for op in sorted(ops_of[cls])})
    return out


def best_of(first: Sequence[Result], again: Sequence[Result]) -> list[Result]:
    """``first`` with each (op, size, variant) measured ``again`` replaced by
    the faster of its two results."""
    key = lambda r: (r.op, r.bytes, r.variant)
    second = {key(r): r for r in again}
    return [min((r, second.get(key(r), r)), key=lambda x: x.max_us) for r in first]


def changed(before: dict, after: dict) -> list[tuple[str, int, str, str]]:
    """(class, size, old winner, new winner) where two :func:`decide` results differ."""
    return [(cls, size, w0, w1) for cls, rows in after.items()
            for (size, w0, _), (_, w1, _) in zip(before.get(cls, ()), rows) if w0 != w1]


def ranges(rows):
    """Merge adjacent sizes with the same winner: [(max_bytes|None, backend, margin)]."""
    merged = []
    for size, backend, adv in rows:
        if merged and merged[-1][1] == backend:
            merged[-1] = (size, backend, min(merged[-1][2], adv))
        else:
            merged.append((size, backend, adv))
    return [(None if i == len(merged) - 1 else s, b, a) for i, (s, b, a) in enumerate(merged)]


def make_table(results: Sequence[Result], backends: Sequence[str], world: int, meta: dict,
               margin: float = 0.05, remeasured: Optional[dict] = None, device: str = "cpu") -> dict:
    """A tuning-table document (``mcrdl-tuning/2``) with rules for ``device``
    tensors at group size ``world``; ``remeasured``: {bench op: [sizes]}
    measured twice (:func:`contested`)."""
    rules = {}
    for op, rows in decide(results, backends, margin).items():
        rules[op] = {str(world): [
            {"max_bytes": mb, "backend": b, "margin": round(a, 4)} for mb, b, a in ranges(rows)]}
    return {"format": FORMAT, "metadata": {**meta, "decision": {
        "statistic": "median over rounds of the slowest rank's per-call time",
        "hysteresis": margin, "remeasured": remeasured or {}}}, "rules": {device: rules}}


def crossovers(table: dict) -> list[str]:
    """Readable lines: which backend each op uses up to which size."""
    lines = []
    for device, op, by_size in ((d, op, by) for d, by_op in table["rules"].items() for op, by in by_op.items()):
        for g, rules in by_size.items():
            parts, prev = [], None
            for r in rules:
                span = (f"<= {human(r['max_bytes'])}" if r["max_bytes"] is not None
                        else (f"> {human(prev)}" if prev is not None else "all sizes"))
                margin = f" ({100 * r['margin']:+.0f}%)" if "margin" in r else ""
                parts.append(f"{r['backend']} {span}{margin}")
                prev = r["max_bytes"]
            lines.append(f"{op} [{g} ranks, {device}]: " + ", ".join(parts))
    return lines


def gains(results: Sequence[Result], table: dict, backends: Sequence[str], device: str = "cpu",
          world: Optional[int] = None) -> dict:
    """Expected speed-up of the table's ``device`` rules (of group size
    ``world``; None: the first listed) over each single backend, per op:
    geometric mean and max of time(single) / time(table's choice) over sizes."""
    import math

    times: dict[str, dict[int, dict[str, float]]] = {}
    for r in results:
        if r.variant in backends:
            times.setdefault(r.op, {}).setdefault(r.bytes, {})[r.variant] = r.max_us
    out = {}
    for op, by_size in times.items():
        by_group = table["rules"][device][OP_CLASS[op]]
        rules = by_group[str(world) if str(world) in by_group else next(iter(by_group))]
        per_backend = {}
        for b in backends:
            ratios = []
            for size, t in by_size.items():
                chosen = next(r["backend"] for r in rules
                              if r["max_bytes"] is None or size <= r["max_bytes"])
                if b in t and chosen in t:
                    ratios.append(t[b] / t[chosen])
            if ratios:
                per_backend[b] = (math.exp(sum(map(math.log, ratios)) / len(ratios)), max(ratios))
        out[op] = per_backend
    return out


def run(out: str, *, device: Optional[str] = None, backends: Optional[Sequence[str]] = None,
        ops: Optional[Sequence[str]] = None, sizes: Optional[Sequence[int]] = None, quick: bool = False,
        max_bytes: Optional[int] = None, step: int = 1, iters: Optional[int] = None,
        large_iters: Optional[int] = None, warmup: int = 3, rounds: Optional[int] = None, cold: bool = False,
        margin: float = 0.05, merge: Optional[str] = None, results: Optional[str] = None,
        plot: Optional[str] = None, timeout: float = 300, threads: Optional[int] = None) -> dict:
    """Measure ``backends`` (default: every live one) on every rank of this job and
    write the tuning table to ``out`` (rank 0); returns the table. Starts and ends
    mcrdl itself; every rank calls it. ``merge``: keep that table's rules where this
    run measured nothing (device, op, group size). A ValueError names a bad argument."""
    api.init_process_group(timeout=timeout)
    try:
        rank, world = api.get_rank(), api.get_world_size()
        device = device or bench.default_device()
        live = bench.live_for(device)
        backends = list(backends or live)
        bad = [b for b in backends if b not in live]
        if bad:
            raise ValueError(f"--backends {bad} are not live backends for {device} tensors (live: {', '.join(live)})")
        merged = _merged_rules(merge) if merge else None
        ops = bench.ops_for(ops, world)
        sizes = bench.sweep_sizes(sizes, quick, [4, 256, 4096, 65536, 1 << 20, 4 << 20], max_bytes or 16 << 20,
                                  step)
        iters = iters or (20 if quick else 100)
        large = large_iters or (4 if quick else 10)
        rounds = rounds or (3 if quick else 5)
        progress, task, advance = bench.progress_bar(len(ops) * len(sizes), rank == 0)
        with progress:
            b = bench.Bench(backends, iters, large, warmup, rounds, False, advance, cold, device, threads)
            try:
                measured = b.sweep(ops, sizes)
                again = contested(measured, backends, margin)
                if again:  # a minority winner must win again later (the module's docstring)
                    progress.update(task, total=len(ops) * len(sizes) + sum(map(len, again.values())))
                    second = [r for op, op_sizes in again.items() for r in b.sweep([op], op_sizes)]
                    before = decide(measured, backends, margin)
                    measured = best_of(measured, second)
            finally:
                b.close()
            progress.update(task, advance=1, description="done")
        meta = bench.metadata({"ops": ops, "sizes": sizes, "backends": backends, "iters": iters,
                               "large_iters": large, "rounds": rounds, "warmup": warmup, "quick": quick,
                               "torch_threads": b.threads},
                              b.mode, device)
        table = make_table(measured, backends, world, meta, margin, again, device)
        if merged:  # what was measured (device, op, group size) replaces OLD's, the rest stays
            for op, by_size in table["rules"][device].items():
                merged["rules"].setdefault(device, {}).setdefault(op, {}).update(by_size)
            table["rules"] = merged["rules"]
            table["metadata"]["merged"] = merged["metadata"]
        if rank == 0:
            with open(out, "w", encoding="utf-8") as f:
                json.dump(table, f, indent=2)
                f.write("\n")
            print(f"tuning table written to {out}")
            if again:
                flips = [f"{op} {human(size)} {w0} -> {w1}" for op, size, w0, w1
                         in changed(before, decide(measured, backends, margin))]
                print("measured again (won by a minority backend): "
                      + ", ".join(f"{op} {','.join(map(human, ss))}" for op, ss in again.items())
                      + f"; winners changed: {', '.join(flips) or 'none'}")
            print("crossovers:")
            for line in crossovers(table):
                print("  " + line)
            print("expected speed-up of the table over each single backend (geomean / max over sizes):")
            for op, per in gains(measured, table, backends, device, world).items():
                print(f"  {op:15s} " + "  ".join(f"vs {b}: {g:.2f}x / {m:.2f}x" for b, (g, m) in per.items()))
            if results:
                bench.write_json(results, measured, meta)
            if plot:
                from .plots import plot_ops
                print("plot:", plot_ops(measured, plot, table, f"mcrdl tune ({world} ranks, {device})", device))
        return table
    finally:
        api.destroy_process_group()


def _merged_rules(path: str) -> dict:
    """A table's rules and where they came from (``merge``); read before the
    sweep so a bad file fails early."""
    from ..backends import REGISTRY
    from ..tuning import TuningTable

    with warnings.catch_warnings():  # its backends need not be live in this job
        warnings.simplefilter("ignore")
        old = TuningTable.load(path, REGISTRY, live=())
    return {"rules": old.to_dict()["rules"], "metadata": {"table": path, "metadata": old.metadata}}
