"""Communication logger: what ran where, how big, how long — and the views on it.

Off by default; when off the API pays one ``is None`` test per call. When on
(``init_process_group(comms_log=True)`` or ``MCRDL_COMMS_LOG=1``) every op is
recorded at submission (op, chosen backend, group, lookup bytes, sync/async)
and completed when its handle completes: the end is taken by the callback the
engine runs at completion, so async work is neither serialised nor synced to
be timed. (For async work the end is when the runtime *noticed* completion:
at a wait, a poll or ``is_completed()``.)

Views: :func:`summary` (per op, backend, size bin: count, total and trimmed
mean latency, algbw, busbw with nccl-tests factors and the full-buffer size
for gather-type ops), a straggler view across ranks, the arrival-corrected
communication and wait time across ranks (:func:`arrival_times`), a size histogram, JSON
export of raw records, a Chrome/Perfetto trace with one row per rank and
backend, and a rank-to-rank communication matrix from the algorithms'
known traffic, as JSON and a heatmap PNG.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

from .. import settings
from ..tuning import OP_CLASS, busbw_factor

#: Size classes of the histogram and the summary (upper bounds, bytes).
SIZE_BINS = (1 << 10, 64 << 10, 1 << 20, 16 << 20)
BIN_NAMES = ("<=1K", "1K-64K", "64K-1M", "1M-16M", ">16M")


def size_bin(nbytes: int) -> str:
    for bound, name in zip(SIZE_BINS, BIN_NAMES):
        if nbytes <= bound:
            return name
    return BIN_NAMES[-1]


@dataclass
class Record:
    seq: int
    op: str            # the API op name (all_reduce, all_to_all_single, isend, ...)
    backend: str
    group: str
    ranks: tuple       # global ranks of the group, in group order
    nbytes: int        # the op's lookup size (full buffer for gather-type ops)
    async_op: bool
    start: float       # seconds since the logger started (perf_counter based)
    end: float = -1.0  # -1 until the op completed
    root: int = -1     # group rank of root/peer (rooted ops, p2p)
    counts: Optional[list] = None  # all-to-all with split sizes or lists (Alltoallv): bytes to each group rank

    @property
    def latency(self) -> float:
        return self.end - self.start if self.end >= 0 else float("nan")


#: The logger of the live process group, if it logs (what ``mcrdl.comms_*`` read).
_active: Optional["CommsLogger"] = None


class CommsLogger:
    """Per-rank record store, an observer of the API: it calls :meth:`begin`
    for each op and the returned callback at completion. ``gather(bytes)``
    returns every rank's bytes (a control all-gather over the world, not
    logged): the views across ranks use it."""

    def __init__(self, rank: int, world_size: int, gather: Callable[[bytes], list[bytes]],
                 autotune: Optional[Callable[[], list[dict]]] = None):
        global _active
        self.rank, self.world_size = rank, world_size
        self.autotune = autotune  # in-situ autotune's report (what was tried, measured, won), if on
        self.records: list[Record] = []
        self._gather = gather
        self._t0 = time.perf_counter()
        self._wall0 = time.time()
        _active = self

    def close(self) -> None:
        """At destroy_process_group (collective: every rank destroys): export
        to ``MCRDL_COMMS_LOG_DIR`` if set, print the summary on rank 0, stop
        being the active logger."""
        global _active
        try:
            directory = settings.get("MCRDL_COMMS_LOG_DIR")
            if directory:
                export_comms(directory)
            summary = comms_summary(all_ranks=True)
            if self.rank == 0:
                print_comms_summary(summary)
        finally:
            if _active is self:
                _active = None

    def gather(self, doc: dict) -> list[dict]:
        """Every rank's ``doc``, in rank order."""
        return [json.loads(b) for b in self._gather(json.dumps(doc).encode())]

    def begin(self, op: str, backend: str, group, nbytes: int, async_op: bool,
              root: int = -1, counts=None, reads=(), writes=()):
        """Record a submitted op; returns the callback that completes it."""
        rec = Record(len(self.records), op, backend, group.name, group.ranks, nbytes, async_op,
                     time.perf_counter() - self._t0, root=root,
                     counts=list(counts) if counts is not None else None)
        self.records.append(rec)

        def end() -> None:
            rec.end = time.perf_counter() - self._t0
        return end

    def completed(self) -> list[Record]:
        return [r for r in self.records if r.end >= 0]

    # -- views -------------------------------------------------------------------------
    def summary(self) -> list[dict]:
        """Per (op, backend, size bin): count, total/mean/trimmed-mean latency (s),
        mean bytes, algbw and busbw (GB/s, from total bytes / total time)."""
        groups: dict[tuple, list[Record]] = {}
        for r in self.completed():
            groups.setdefault((r.op, r.backend, size_bin(r.nbytes)), []).append(r)
        rows = []
        for (op, backend, b), recs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], BIN_NAMES.index(kv[0][2]))):
            lats = sorted(r.latency for r in recs)
            total = sum(lats)
            cut = len(lats) // 10  # trim 10% at each end
            trimmed = lats[cut:len(lats) - cut] if len(lats) - 2 * cut > 0 else lats
            nbytes = sum(r.nbytes for r in recs)
            algbw = nbytes / total / 1e9 if total > 0 else 0.0
            n = len(recs[0].ranks)
            rows.append({"op": op, "backend": backend, "size_bin": b, "count": len(recs),
                         "total_s": total, "mean_s": total / len(recs),
                         "trimmed_mean_s": sum(trimmed) / len(trimmed),
                         "mean_bytes": nbytes / len(recs), "algbw_gbps": algbw,
                         "busbw_gbps": algbw * busbw_factor(op, n)})
        return rows

    def histogram(self) -> dict[str, dict[str, dict[str, float]]]:
        """{op: {size bin: {count, total_s}}}: where the time goes by size class."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for r in self.completed():
            cell = out.setdefault(r.op, {}).setdefault(size_bin(r.nbytes), {"count": 0, "total_s": 0.0})
            cell["count"] += 1
            cell["total_s"] += r.latency
        return out

    def traffic_row(self) -> dict[str, list[float]]:
        """Bytes this rank sends to each global rank, per op class, from the
        algorithms' known traffic: all-reduce as a ring (2(n-1)/n of S to the
        next rank), all-gather and reduce-scatter as a ring ((n-1)/n of S),
        broadcast and scatter linear from the root (S, S/n to each), reduce and
        gather linear to the root (S, S/n), all-to-all by its splits (S/n
        to each without), send exact."""
        rows: dict[str, list[float]] = {}
        me = self.rank
        for r in self.completed():
            cls = OP_CLASS.get(r.op, r.op)
            ranks = list(r.ranks)
            n = len(ranks)
            if me not in ranks or n < 2:
                continue
            i = ranks.index(me)
            row = rows.setdefault(cls, [0.0] * self.world_size)
            nxt = ranks[(i + 1) % n]
            S = r.nbytes
            if cls == "all_reduce":
                row[nxt] += 2 * (n - 1) / n * S
            elif cls in ("all_gather", "reduce_scatter"):
                row[nxt] += (n - 1) / n * S
            elif cls in ("broadcast", "scatter"):
                if i == r.root:
                    for j, g in enumerate(ranks):
                        if j != i:
                            row[g] += S if cls == "broadcast" else S / n
            elif cls in ("reduce", "gather"):
                if i != r.root:
                    row[ranks[r.root]] += S if cls == "reduce" else S / n
            elif cls == "all_to_all":  # by its splits; without (counts None) S/n to each
                for j, c in enumerate(r.counts or [S / n] * n):
                    if j != i:
                        row[ranks[j]] += c
            elif r.op in ("send", "isend"):
                row[ranks[r.root]] += S
        return rows

    def trace_events(self) -> list[dict]:
        """Chrome trace events: pid = rank, one thread row per backend."""
        tids: dict[str, int] = {}
        events = [{"name": "process_name", "ph": "M", "pid": self.rank,
                   "args": {"name": f"rank {self.rank}"}}]
        for r in self.completed():
            if r.backend not in tids:
                tids[r.backend] = len(tids)
                events.append({"name": "thread_name", "ph": "M", "pid": self.rank,
                               "tid": tids[r.backend], "args": {"name": r.backend}})
            events.append({"name": r.op, "cat": r.backend, "ph": "X", "pid": self.rank,
                           "tid": tids[r.backend],
                           "ts": (self._wall0 + r.start) * 1e6, "dur": max(r.latency, 0) * 1e6,
                           "args": {"bytes": r.nbytes, "group": r.group, "async": r.async_op,
                                    "seq": r.seq}})
        return events

    def to_json(self) -> dict:
        return {"rank": self.rank, "world_size": self.world_size, "wall_start": self._wall0,
                "records": [asdict(r) for r in self.records]}


def arrival_times(docs: Sequence[dict]) -> list[list[float]]:
    """Arrival-corrected duration of every record of every rank's document
    (:meth:`CommsLogger.to_json`), in the same order; NaN while incomplete.

    A rank's logged duration runs from its call to completion, so it includes
    waiting for the peers that arrived later. The k-th collective on a group
    is the same call on every member, and the member that arrived last waited
    least: every member gets the minimum of the members' durations in ``docs``
    (own duration when it is the only one). Point-to-point ops keep their own
    duration; so do async ops, timed until the runtime noticed completion."""
    keyed, best = [], {}
    for doc in docs:
        seq: dict = {}
        keys = []
        for r in doc["records"]:
            key = None
            if OP_CLASS.get(r["op"], r["op"]) != "p2p":
                g = (r.get("group"), tuple(r.get("ranks") or ()))
                seq[g] = seq.get(g, -1) + 1
                key = (g, seq[g], r["op"])
                if r.get("end", -1) >= 0:
                    best[key] = min(best.get(key, math.inf), r["end"] - r["start"])
            keys.append(key)
        keyed.append(keys)
    return [[math.nan if r.get("end", -1) < 0 else best.get(k, r["end"] - r["start"])
             for r, k in zip(doc["records"], keys)] for doc, keys in zip(docs, keyed)]


def arrival_summary(docs: Sequence[dict]) -> dict[str, dict[str, list[float]]]:
    """Per "op/backend", lists over the documents' ranks (s): ``time_s`` as
    logged, ``comm_time_s`` arrival-corrected (:func:`arrival_times`) and
    ``wait_time_s`` = the difference (waiting for later peers: skew)."""
    out: dict = {}
    for i, (doc, comm) in enumerate(zip(docs, arrival_times(docs))):
        for r, c in zip(doc["records"], comm):
            if r["end"] < 0:
                continue
            row = out.setdefault(f"{r['op']}/{r['backend']}",
                                 {k: [0.0] * len(docs) for k in ("time_s", "comm_time_s", "wait_time_s")})
            lat = r["end"] - r["start"]
            row["time_s"][i] += lat
            row["comm_time_s"][i] += c
            row["wait_time_s"][i] += lat - c
    return dict(sorted(out.items()))


def stragglers(totals: Sequence[dict]) -> dict[str, list[float]]:
    """Per "op/backend": each rank's total time minus the fastest rank's (s).

    ``totals[r]`` maps "op/backend" to rank r's total latency."""
    keys = sorted({k for t in totals for k in t})
    out = {}
    for k in keys:
        vals = [t.get(k, 0.0) for t in totals]
        fastest = min(vals)
        out[k] = [v - fastest for v in vals]
    return out


def write_matrix_png(matrix: dict, path: str) -> None:
    """Heatmap of the total bytes matrix (and one panel per op class)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [("all ops", matrix["total"])] + sorted(matrix["ops"].items())
    cols = min(len(panels), 4)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.4 * cols, 3.1 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (name, m) in zip(axes.flat, panels):
        data = np.array(m, dtype=float)
        im = ax.imshow(data, cmap="viridis")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("to rank", fontsize=8)
        ax.set_ylabel("from rank", fontsize=8)
        n = data.shape[0]
        ax.set_xticks(range(n))
        ax.set_yticks(range(n))
        fig.colorbar(im, ax=ax, fraction=0.046, label="bytes")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_json(path: str, doc) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


# -- public functions (mcrdl.comms_*) ----------------------------------------------------
def _logger() -> CommsLogger:
    lg = _active
    if lg is None:
        raise RuntimeError("the communication logger is off: init_process_group(comms_log=True) "
                           "or MCRDL_COMMS_LOG=1")
    return lg


def comms_records() -> list[Record]:
    """This rank's raw records (completed or not)."""
    return list(_logger().records)


def comms_reset() -> None:
    """Forget this rank's records so far (e.g. warm-up steps). Call it at the
    same point of the program on every rank, with no op in flight, so that
    the ranks' records start at the same collective."""
    _logger().records.clear()


def comms_summary(all_ranks: bool = True) -> dict:
    """This rank's summary, histogram and (``all_ranks``: a collective call on
    the world) the views across ranks: stragglers (each rank's total time per
    op/backend minus the fastest rank's) and the arrival-corrected
    communication and wait time (:func:`arrival_summary`)."""
    lg = _logger()
    out = {"rank": lg.rank, "summary": lg.summary(), "histogram": lg.histogram()}
    if lg.autotune is not None:
        out["autotune"] = lg.autotune()
    if all_ranks:
        out.update(_across_ranks([d["doc"] for d in lg.gather({"doc": lg.to_json()})]))
    return out


def _across_ranks(docs: Sequence[dict]) -> dict:
    arrival = arrival_summary(docs)
    totals = [{k: v["time_s"][i] for k, v in arrival.items()} for i in range(len(docs))]
    return {"stragglers_s": stragglers(totals), "arrival": arrival}


def print_comms_summary(summary: Optional[dict] = None) -> None:
    """Print a summary (default: :func:`comms_summary`) as rich tables."""
    from rich.console import Console
    from rich.table import Table

    summary = summary or comms_summary()
    console = Console(width=None if os.isatty(1) else 140)
    t = Table(title=f"mcrdl communication summary (rank {summary['rank']})")
    for col in ("op", "backend", "size", "count", "total ms", "mean us", "trimmed us",
                "algbw GB/s", "busbw GB/s"):
        t.add_column(col, justify="left" if col in ("op", "backend", "size") else "right")
    for row in summary["summary"]:
        t.add_row(row["op"], row["backend"], row["size_bin"], str(row["count"]),
                  f"{row['total_s'] * 1e3:.2f}", f"{row['mean_s'] * 1e6:.1f}",
                  f"{row['trimmed_mean_s'] * 1e6:.1f}", f"{row['algbw_gbps']:.3f}",
                  f"{row['busbw_gbps']:.3f}")
    console.print(t)
    if summary.get("autotune"):
        a = Table(title="autotune: backends tried per group, op and size (group's median per call, us)")
        for col in ("group", "op", "bytes", "measured", "winner", "why"):
            a.add_column(col)
        for row in summary["autotune"]:
            measured = ", ".join(f"{b} {'-' if us is None else f'{us:.1f}'}" for b, us in row["us"].items())
            again = f"; opened again by drift {len(row['reopened'])}x" if row.get("reopened") else ""
            a.add_row(row["group"], row["op"], f"{row['min_bytes']}-{row['max_bytes']}", measured,
                      row["winner"] or "(exploring)", row["how"] + again)
        console.print(a)
    if summary.get("stragglers_s"):
        s = Table(title="stragglers: each rank's total time minus the fastest rank's (ms)")
        s.add_column("op/backend")
        n = len(next(iter(summary["stragglers_s"].values())))
        for r in range(n):
            s.add_column(f"rank {r}", justify="right")
        for k, vals in summary["stragglers_s"].items():
            s.add_row(k, *(f"{v * 1e3:.2f}" for v in vals))
        console.print(s)
    if summary.get("arrival"):
        a = Table(title="time per rank (ms): logged = communication (arrival-corrected: the "
                        "last-arriving rank's duration) + waiting for later peers")
        a.add_column("op/backend")
        n = len(next(iter(summary["arrival"].values()))["time_s"])
        for r in range(n):
            a.add_column(f"rank {r}", justify="right")
        for k, v in summary["arrival"].items():
            a.add_row(k, *(f"{t * 1e3:.2f} = {c * 1e3:.2f} + {w * 1e3:.2f}"
                           for t, c, w in zip(v["time_s"], v["comm_time_s"], v["wait_time_s"])))
        console.print(a)


def export_comms(directory: str, records_only: bool = False) -> dict:
    """Write every rank's records and, on rank 0, the merged Chrome trace, the
    communication matrix (JSON + heatmap PNG) and the summary. Collective over
    the world. With ``records_only`` each rank writes its records file and
    nothing else, with no communication: a cheap snapshot in the middle of a
    run. Returns the paths written on this rank."""
    lg = _logger()
    os.makedirs(directory, exist_ok=True)
    paths = {"records": os.path.join(directory, f"records_rank{lg.rank}.json")}
    write_json(paths["records"], lg.to_json())
    if records_only:
        return paths
    gathered = lg.gather({"events": lg.trace_events(), "traffic": lg.traffic_row(),
                          "doc": lg.to_json()})
    if lg.rank != 0:
        return paths
    trace = {"traceEvents": [e for d in gathered for e in d["events"]], "displayTimeUnit": "ms"}
    paths["trace"] = os.path.join(directory, "trace.json")
    write_json(paths["trace"], trace)
    n = lg.world_size
    ops = sorted({op for d in gathered for op in d["traffic"]})
    matrix = {"ranks": n, "unit": "bytes", "rows_send_to_columns": True,
              "ops": {op: [d["traffic"].get(op, [0.0] * n) for d in gathered] for op in ops}}
    matrix["total"] = [[sum(matrix["ops"][op][i][j] for op in ops) for j in range(n)] for i in range(n)]
    paths["matrix"] = os.path.join(directory, "matrix.json")
    write_json(paths["matrix"], matrix)
    paths["heatmap"] = os.path.join(directory, "matrix.png")
    write_matrix_png(matrix, paths["heatmap"])
    paths["summary"] = os.path.join(directory, "summary.json")
    write_json(paths["summary"], {"summary": lg.summary(), "histogram": lg.histogram(),
                                  "autotune": lg.autotune() if lg.autotune is not None else None,
                                  **_across_ranks([d["doc"] for d in gathered])})
    return paths
