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
"""
from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

from .bench import Result, human
from .tuning import FORMAT, OP_CLASS


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
    """{class: [(size, winner, advantage)]} from forced-backend results."""
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
    for cls, rows in decide(results, backends, margin).items():
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
