"""Time per op: alpha-beta fits per (op, backend) and the backend choice.

A bench/tune result (``mcrdl-bench/1``, docs/bench.md) gives, per op, backend
and size n (the op's lookup size), the slowest rank's median time ``max_us``.
Each (op, backend) is fitted to t(n) = alpha + beta n by non-negative least
squares. One line misses a library's protocol and algorithm switches by up to
~50 % (eager vs rendezvous, recursive doubling vs ring), so a time is the fit
times the measured/fitted ratio at the bench's sizes, interpolated in log n
(the nearest end's ratio beyond them): the measurements themselves at g0,
alpha-beta between and past them. The fit holds at the bench's group size
g0; other group sizes scale it with the algorithm's step count L(g) and
volume factor W(g) (DESIGN section 5 cost models):
t_g(n) = alpha L(g)/L(g0) + beta n W(g)/W(g0), i.e. per-step alpha_s =
alpha/L(g0) and per-byte beta_s = beta/W(g0). The reduction cost gamma cannot
be told apart from beta with one group size; it is folded into beta.

========================  =============  ==============
op (lookup size n)        L(g) steps      W(g) volume
========================  =============  ==============
all_reduce (ring)         2(g-1)          2(g-1)/g
all_gather, reduce_scatter, gather, scatter  g-1  (g-1)/g
all_to_all(v) (pairwise)  g-1             (g-1)/g
broadcast, reduce         ceil(lg g)      ceil(lg g)
p2p                       1               1
========================  =============  ==============
"""
from __future__ import annotations

import bisect
import math
import os
import statistics
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional

from ...tuning import OP_CLASS

#: Preference when deriving an op nobody measured from another op of the same backend.
_DERIVE_FROM = ("all_reduce", "all_gather", "reduce_scatter", "p2p", "all_to_all", "broadcast",
                "reduce", "gather", "scatter")
MODEL_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "all_to_allv", "p2p",
             "broadcast", "reduce", "gather", "scatter")


def steps(op: str, g: int) -> float:
    """L(g): latency steps of the algorithm assumed for ``op`` (as its selection
    class: all_to_allv as all_to_all) on ``g`` ranks."""
    op = OP_CLASS.get(op, op)
    if g < 2:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (g - 1)
    if op in ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all"):
        return float(g - 1)
    if op in ("broadcast", "reduce"):
        return float(math.ceil(math.log2(g)))
    return 1.0  # p2p


def volume(op: str, g: int) -> float:
    """W(g): bytes crossing a rank's link per byte of lookup size (as L(g))."""
    op = OP_CLASS.get(op, op)
    if g < 2:
        return 0.0
    if op == "all_reduce":
        return 2.0 * (g - 1) / g
    if op in ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all"):
        return (g - 1) / g
    if op in ("broadcast", "reduce"):
        return float(math.ceil(math.log2(g)))
    return 1.0


def fit_alpha_beta(sizes: Iterable[float], times: Iterable[float],
                   weighting: str = "relative") -> tuple[float, float, float]:
    """Non-negative least squares of t = alpha + beta n.

    ``weighting``: "relative" minimises sum(((alpha + beta n - t) / t)^2), so a
    4 B point counts as much as a 16 MB one (latencies span orders of
    magnitude); "absolute" minimises the plain squared error. Returns (alpha,
    beta, rms relative residual)."""
    xs, ys = [float(x) for x in sizes], [float(y) for y in times]
    if len(xs) != len(ys) or not xs:
        raise ValueError("fit_alpha_beta: needs as many times as sizes, at least one")
    if weighting not in ("relative", "absolute"):
        raise ValueError(f"weighting must be 'relative' or 'absolute', got {weighting!r}")
    ws = [1.0 / y if (weighting == "relative" and y > 0) else 1.0 for y in ys]
    w2 = [w * w for w in ws]
    s1 = sum(w2)
    sx = sum(w * x for w, x in zip(w2, xs))
    sxx = sum(w * x * x for w, x in zip(w2, xs))
    sy = sum(w * y for w, y in zip(w2, ys))
    sxy = sum(w * x * y for w, x, y in zip(w2, xs, ys))

    def sse(a: float, b: float) -> float:
        return sum(w * (a + b * x - y) ** 2 for w, x, y in zip(w2, xs, ys))

    cands = []
    det = s1 * sxx - sx * sx
    if det > 1e-12 * max(s1 * sxx, 1e-300):
        a = (sxx * sy - sx * sxy) / det
        b = (s1 * sxy - sx * sy) / det
        if a >= 0 and b >= 0:
            cands.append((a, b))
    cands.append((0.0, max(sxy / sxx, 0.0) if sxx > 0 else 0.0))  # alpha = 0
    cands.append((max(sy / s1, 0.0), 0.0))  # beta = 0
    a, b = min(cands, key=lambda ab: sse(*ab))
    rel = [((a + b * x - y) / y) ** 2 for x, y in zip(xs, ys) if y > 0]
    return a, b, math.sqrt(sum(rel) / len(rel)) if rel else 0.0


@dataclass(frozen=True)
class Fit:
    """t(n, g) = (alpha_step L(g) + beta_step W(g) n) x correction(n) (us, n in bytes)."""
    op: str
    backend: str
    alpha_step_us: float
    beta_step_us: float  # us per byte crossing a link
    group_size: int  # where it was measured (or declared)
    points: int = 0
    rel_rms: float = 0.0
    source: str = ""
    curve: tuple = ()  # ((n, measured / fitted time at group_size), ...), ascending n > 0

    def time_us(self, nbytes: float, group: int) -> float:
        if group < 2:
            return 0.0
        return (self.alpha_step_us * steps(self.op, group)
                + self.beta_step_us * volume(self.op, group) * nbytes) * self.correction(nbytes)

    def correction(self, nbytes: float) -> float:
        """Measured / fitted time at ``nbytes``, interpolated in log n between
        the measured sizes, the nearest end's beyond them; 1 without points."""
        c = self.curve
        if not c:
            return 1.0
        if nbytes <= c[0][0]:
            return c[0][1]
        if nbytes >= c[-1][0]:
            return c[-1][1]
        i = bisect.bisect_right([n for n, _ in c], nbytes)
        (n0, r0), (n1, r1) = c[i - 1], c[i]
        return r0 + (r1 - r0) * math.log(nbytes / n0) / math.log(n1 / n0)

    @property
    def alpha_us(self) -> float:
        """alpha at the measured group size."""
        return self.alpha_step_us * steps(self.op, self.group_size)

    @property
    def beta_us(self) -> float:
        """beta (us per byte of lookup size) at the measured group size."""
        return self.beta_step_us * volume(self.op, self.group_size)

    @property
    def bandwidth_gbps(self) -> float:
        """Link bandwidth 1/beta_step in GB/s."""
        return 1e-3 / self.beta_step_us if self.beta_step_us > 0 else math.inf

    def derive(self, op: str) -> "Fit":
        """The same per-step costs applied to another op's algorithm."""
        return Fit(op, self.backend, self.alpha_step_us, self.beta_step_us, self.group_size, 0,
                   0.0, f"derived from {self.op}")


def make_fit(op: str, backend: str, sizes, times, group: int, source: str,
             weighting: str = "relative") -> Fit:
    """Fit measured (size, us) points taken on ``group`` ranks, with the
    measured/fitted ratio per size (repeated sizes: their mean time)."""
    sizes, times = list(sizes), list(times)
    a, b, rms = fit_alpha_beta(sizes, times, weighting)
    L, W = steps(op, group), volume(op, group)
    if L == 0 or W == 0:
        raise ValueError(f"cannot fit {op} on a group of {group}: needs at least 2 ranks")
    at: dict = {}
    for n, t in zip(sizes, times):
        at.setdefault(n, []).append(t)
    curve = tuple((n, sum(ts) / len(ts) / (a + b * n)) for n, ts in sorted(at.items())
                  if n > 0 and a + b * n > 0)
    return Fit(op, backend, a / L, b / W, group, len(sizes), rms, source, curve)


#: Built-in points (bytes, us) on 2 ranks of one node, used when no bench result is
#: given, fixed here: all_reduce medians of docs/results/allreduce_latency.json as
#: committed in 06850a4 (2026-11-22T00:09, mcrdl on MPICH 5.0.2 and torch 2.13 gloo,
#: 2 vCPUs); all_to_all: the 32 MB figures of DESIGN section 5, with the 4 B
#: all-reduce latency for small messages.
DEFAULT_POINTS = {
    ("all_reduce", "mpi"): [(4, 3.49), (1024, 3.56), (16384, 14.81), (262144, 44.69),
                            (4194304, 463.5)],
    ("all_reduce", "gloo"): [(4, 226.4), (1024, 960.1), (16384, 796.3), (262144, 960.1),
                             (4194304, 3413.4)],
    ("all_to_all", "mpi"): [(4, 3.49), (33554432, 5200.0)],
    ("all_to_all", "gloo"): [(4, 226.4), (33554432, 44000.0)],
}
DEFAULT_SOURCE = ("built-in defaults (docs/model.md): CPU, 2 ranks on one node, MPICH 5.0.2 "
                  "and torch gloo; pass --bench for measured values")


@dataclass
class Choice:
    backend: str
    time_us: float
    reason: str
    fit: Fit


@dataclass
class CostModel:
    """Fits per (op, backend) plus an optional tuning table for the choice."""
    fits: dict = field(default_factory=dict)  # (op, backend) -> Fit
    table: object = None  # mcrdl.TuningTable or None
    device: Optional[str] = None  # the measured tensors' device type (bench metadata), None: built-in values
    table_device: str = "cpu"  # whose rules of the table decide
    source: str = ""
    notes: list = field(default_factory=list)

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def defaults(cls) -> "CostModel":
        fits = {}
        for (op, backend), pts in DEFAULT_POINTS.items():
            fits[(op, backend)] = make_fit(op, backend, [p[0] for p in pts], [p[1] for p in pts], 2,
                                           "built-in default")
        return cls(fits, source=DEFAULT_SOURCE)

    @classmethod
    def from_bench(cls, sources, weighting: str = "relative") -> "CostModel":
        """Fit every forced-backend variant of ``mcrdl-bench/1`` results
        (``mcrdl bench --json`` or ``mcrdl tune --results``): one path or
        document, or a list of several sweeps of the same group size and mode,
        whose times are combined per (op, backend, size) by their median, so
        one sweep taken in a slow phase of the machine does not set the
        calibration. The source names the mode (back-to-back or cold calls,
        docs/bench.md) and the number of sweeps."""
        from ..bench import from_doc, load_json, mode_of
        from ...tuning import shown

        many = isinstance(sources, (list, tuple))
        sweeps = []
        for src in (sources if many else [sources]):
            if isinstance(src, (str, os.PathLike)):
                sweeps.append((os.fspath(src), *load_json(os.fspath(src))))
            else:
                sweeps.append(("<bench>", *from_doc(src, "<bench>")))
        if not sweeps:
            raise ValueError("no bench results given")
        path, _, meta = sweeps[0]
        group = meta.get("world_size")
        if group is None or group < 2:
            raise ValueError(f"{path}: metadata.world_size: must be the bench's group size (>= 2), "
                             f"got {shown(group)}")
        for other, _, m in sweeps[1:]:
            for key, got, want in (("world_size", m.get("world_size"), group),
                                   ("mode", mode_of(m), mode_of(meta)),
                                   ("device", m.get("device", "cpu"), meta.get("device", "cpu"))):
                if got != want:
                    raise ValueError(f"{other}: metadata.{key}: {shown(got)} differs from {path}'s "
                                     f"{shown(want)}; sweeps combined must match")
        samples: dict = {}
        skipped = 0
        for _, results, _ in sweeps:
            for r in results:
                if r.variant == "mcrdl" or r.variant.startswith("raw-") or r.check == "FAIL":
                    continue
                if r.max_us == 0:
                    skipped += 1
                    continue
                samples.setdefault((r.op, r.variant), {}).setdefault(r.bytes, []).append(r.max_us)
        label = path if len(sweeps) == 1 else f"{len(sweeps)} sweeps ({', '.join(p for p, _, _ in sweeps)})"
        fits, notes = {}, []
        for (op, backend), by_size in sorted(samples.items()):
            if len(by_size) < 2:
                notes.append(f"{op}/{backend}: one size only, not fitted")
                continue
            sizes = sorted(by_size)
            times = [statistics.median(by_size[n]) for n in sizes]
            try:
                fit = make_fit(op, backend, sizes, times, group, f"fit of {label}", weighting)
                finite = all(math.isfinite(v) for v in (fit.alpha_step_us, fit.beta_step_us, fit.rel_rms,
                                                         *(fit.time_us(n, group) for n in sizes)))
            except (OverflowError, ZeroDivisionError):  # the float arithmetic of a fit
                finite = False
            if not finite:
                raise ValueError(f"{label}: results: {op} on {backend}: times from {min(times):g} to "
                                 f"{max(times):g} us are beyond what a fit can use")
            fits[(op, backend)] = fit
        if not fits:
            raise ValueError(f"{label}: no forced-backend results with two or more sizes to fit")
        if skipped:
            notes.append(f"{skipped} results with a time of 0 skipped")
        hosts = meta.get("hosts")
        src = (f"fitted from {label if len(sweeps) == 1 else label + ', median per size'} ({group} ranks"
               + (f" on {', '.join(hosts)}" if hosts else "") + f", {mode_of(meta)} calls)")
        return cls(fits, source=src, notes=notes, device=meta.get("device", "cpu"))

    def add_declared(self, alpha_beta: dict) -> None:
        """Per-step alpha/bandwidth declared per backend (config ``alpha_beta``):
        every op of that backend without a measured fit uses them."""
        for backend, ab in alpha_beta.items():
            for op in MODEL_OPS:
                if (op, backend) not in self.fits:
                    self.fits[(op, backend)] = Fit(op, backend, ab.alpha_us, 1e-3 / ab.bandwidth_gbps,
                                                   2, 0, 0.0, "declared in the config (alpha_beta)")

    def load_table(self, path: str) -> None:
        """Use a tuning table for the choice (``TuningTable.lookup``); the
        backends it names count as known. The rules used are the fitted bench's
        device's, else the table's only device's, else its ``cpu`` rules."""
        from ...tuning import TuningTable, TuningTableError, named_backends, read_json

        doc = read_json(path, "tuning table", TuningTableError)
        names = {b for _, b in self.fits} | {"mpi", "nccl", "gloo"} | named_backends(doc)
        self.table = TuningTable.from_dict(doc, known=names, source=path)
        devices = self.table.devices()
        self.table_device = self.device or (devices[0] if len(devices) == 1 else "cpu")
        if self.table_device not in devices:
            self.notes.append(f"{path}: no rules for {self.table_device} tensors (it has "
                              f"{', '.join(devices) or 'none'}): the fastest fit decides")

    def calibrate(self, docs, label: str = "logged calls") -> None:
        """Correct every (op, backend) that a logger export (``load_log``'s
        documents) ran, and that this model has alpha-beta values for, to the
        job's own calls. Calls are pooled per size bucket (sizes within a
        factor of sqrt(2) of a power of two): the correction at the bucket's
        mean size is the calls' total arrival-corrected time
        (:func:`mcrdl.features.logger.arrival_times`) over their total
        uncorrected alpha-beta time at each call's group size. So a call of
        a bucket's mean size on one group size costs the mean of the bucket's
        calls in the job, compute interference included (means, not medians:
        the model predicts totals); alpha-beta carries it to other sizes and groups, and the
        bench's own per-size correction is replaced. Receives and barriers are
        not used (the model counts sends); an all-to-all logged with split
        sizes or lists (``counts``: MPI Alltoallv) calibrates ``all_to_allv``,
        one without ``all_to_all``. A backend with no alpha-beta values is left
        out (a note says so): one op's calls cannot give the others'."""
        from ...features.logger import arrival_times

        points: dict = {}  # (model op, backend) -> [(bytes, group size, us)]
        for doc, times in zip(docs, arrival_times(docs)):
            for rec, t in zip(doc["records"], times):
                op = rec["op"]
                if rec.get("end", -1) < 0 or not math.isfinite(t) or op in ("recv", "irecv", "barrier"):
                    continue
                cls = OP_CLASS.get(op, op)
                model_op = "all_to_allv" if cls == "all_to_all" and rec.get("counts") is not None else cls
                group = 2 if model_op == "p2p" else len(rec.get("ranks") or ())
                if model_op in MODEL_OPS and group >= 2 and t > 0 and rec["nbytes"] > 0:
                    points.setdefault((model_op, rec["backend"]), []).append((rec["nbytes"], group, t * 1e6))
        bases = {key: self.fit_for(*key) for key in points}  # before any is replaced
        used = 0
        for (op, backend), pts in sorted(points.items()):
            base = bases[(op, backend)]
            if base is None:
                self.notes.append(f"{op}/{backend}: {len(pts)} logged calls not used (no alpha-beta "
                                  f"values for {backend}: give --bench results that include it)")
                continue
            line = replace(base, op=op, curve=())
            buckets: dict = {}  # round(log2 n) -> [sizes, measured us, fitted us]
            for n, g, t in pts:
                b = buckets.setdefault(round(math.log2(n)), [[], 0.0, 0.0])
                b[0].append(n)
                b[1] += t
                b[2] += line.time_us(n, g)
            curve = tuple((sum(ns) / len(ns), meas / fitted)
                          for _, (ns, meas, fitted) in sorted(buckets.items()) if fitted > 0)
            if not curve:
                continue
            used += len(pts)
            self.fits[(op, backend)] = replace(line, curve=curve, points=len(pts),
                                               source=f"{base.source}; corrected by {len(pts)} "
                                                      f"call records in {label}")
        if not used:
            raise ValueError(f"{label}: no completed collective or send with data that this model "
                             f"has alpha-beta values for")
        self.source = "; ".join(x for x in (self.source, f"corrected by {used} call records in {label}") if x)

    # -- queries ---------------------------------------------------------------------------
    @property
    def backends(self) -> list[str]:
        return sorted({b for _, b in self.fits})

    def fit_for(self, op: str, backend: str) -> Optional[Fit]:
        """The measured fit, else the fit of the other form of the op's class
        (``all_to_allv`` -> ``all_to_all``), else one derived from another op
        of the backend."""
        fit = self.fits.get((op, backend))
        if fit is not None:
            return fit
        base = self.fits.get((OP_CLASS.get(op, op), backend))
        if base is not None:
            return replace(base, op=op, source=f"{base.source}; {base.op}'s (no {op} measured)")
        for other in _DERIVE_FROM:
            base = self.fits.get((other, backend))
            if base is not None and base.source != "derived":
                return base.derive(op)
        return None

    def choose(self, op: str, nbytes: float, group: int, select_group: Optional[int] = None) -> Choice:
        """Backend and time of one call: the tuning table's backend when it
        names one with a fit, else the fastest fitted backend at this size."""
        cands = {b: f for b in self.backends if (f := self.fit_for(op, b)) is not None}
        if not cands:
            raise ValueError(f"no alpha-beta values for {op} on any backend")
        note = ""
        if self.table is not None:
            tb = self.table.lookup(OP_CLASS.get(op, op), select_group or group, int(round(nbytes)),
                                   self.table_device)
            if tb in cands:
                f = cands[tb]
                return Choice(tb, f.time_us(nbytes, group), "tuning table", f)
            note = (f"table names {tb} (no alpha-beta); " if tb else "not in table; ")
        best = min(cands, key=lambda b: (cands[b].time_us(nbytes, group), b))
        f = cands[best]
        return Choice(best, f.time_us(nbytes, group), note + "fastest fit", f)
