"""Prediction beside a logger export of a real run (``mcrdl.export_comms``).

Each logged op is assigned to a parallel dimension by its group: the ranks of
a collective are compared with the model's tensor, data, expert and
expert-data groups; a send (``send``/``isend``; receives are not counted, as
the model counts sends) to the adjacent pipeline stage is pipeline traffic.
Anything else is ``other`` (not modelled: e.g. loss all-reduces, barriers,
initial broadcasts). Counts, bytes (the logger's ``nbytes``: the op's lookup
size, as the model's message bytes) and times are averaged over all ranks and
set beside the prediction per rank x ``iterations`` (averaged over the same ranks).
Two measured times: as logged (from each rank's call, so including waits for
later peers) and arrival-corrected (each collective call timed on the rank
that arrived last: :func:`mcrdl.features.logger.arrival_times`); the
prediction, which has no skew, is compared with the corrected one.
"""
from __future__ import annotations

import glob
import os
from dataclasses import MISSING, dataclass, fields
from typing import Any, Optional

from ...features.logger import Record, arrival_times
from ...tuning import OP_CLASS, is_int, is_number, key_path, read_json, shown
from .config import Config
from .cost import CostModel
from .traffic import DIMS, all_stage_traffic, coords, group_of


def load_log(path: str) -> list[dict]:
    """Per-rank logger documents from a directory of ``records_rank{r}.json``
    or one such file, each validated; one rank in two files is an error."""
    if os.path.isdir(path):
        files = sorted(glob.glob(os.path.join(path, "records_rank*.json")),
                       key=lambda p: int(''.join(ch for ch in os.path.basename(p) if ch.isdigit()) or 0))
        if not files:
            raise ValueError(f"{path}: no records_rank*.json (write them with mcrdl.export_comms)")
    elif os.path.exists(path):
        files = [path]
    else:
        raise ValueError(f"{path}: no such file or directory")
    docs, seen = [], {}
    for f in files:
        doc = read_json(f, "logger records")
        _check_log(doc, f)
        if doc["rank"] in seen:
            raise ValueError(f"{f}: rank: rank {doc['rank']} is also in {seen[doc['rank']]}")
        seen[doc["rank"]] = f
        docs.append(doc)
    return docs


_LOG_KEYS = ("rank", "world_size", "wall_start", "records")
_RECORD_REQUIRED = {f.name for f in fields(Record) if f.default is MISSING and f.default_factory is MISSING}


def _check_log(doc: Any, source: str) -> None:
    """Validate one ``records_rank{r}.json`` (``CommsLogger.to_json``); a
    ValueError names the file and the key, e.g. ``records[3].nbytes``."""
    def fail(key: str, msg: str):
        raise ValueError(f"{source}: {key_path(key)}: {msg}")

    if not isinstance(doc, dict):
        fail("(top level)", f"expected a logger records object, got {type(doc).__name__}")
    for key in sorted(set(doc) - set(_LOG_KEYS), key=str)[:1]:
        fail(key, f"unknown key (expected {', '.join(_LOG_KEYS)})")
    for key in ("rank", "world_size", "records"):
        if key not in doc:
            fail(key, "required (not a logger records file?)")
    world = doc["world_size"]
    if not is_int(world, 1):
        fail("world_size", f"expected an integer >= 1, got {shown(world)}")
    if not (is_int(doc["rank"]) and doc["rank"] < world):
        fail("rank", f"expected an integer from 0 to {world - 1}, got {shown(doc['rank'])}")
    if not is_number(doc.get("wall_start", 0)):
        fail("wall_start", f"expected a finite number, got {shown(doc['wall_start'])}")
    if not isinstance(doc["records"], list):
        fail("records", f"expected a list, got {type(doc['records']).__name__}")
    checks = {  # Record field -> (check, what it expects)
        "seq": (is_int, "an integer >= 0"),
        "op": (lambda v: isinstance(v, str), "an op name"),
        "backend": (lambda v: isinstance(v, str), "a backend name"),
        "group": (lambda v: isinstance(v, str), "a group name"),
        "ranks": (lambda v: isinstance(v, list) and all(is_int(r) and r < world for r in v),
                  f"a list of ranks below world_size {world}"),
        "nbytes": (is_int, "a byte count (integer >= 0)"),
        "async_op": (lambda v: isinstance(v, bool), "true or false"),
        "start": (is_number, "a finite number"),
        "end": (is_number, "a finite number"),
        "root": (lambda v: is_int(v, -1), "an integer >= -1"),
        "counts": (lambda v: v is None or (isinstance(v, list) and all(is_int(c) for c in v)),
                   "null or a list of byte counts"),
    }
    for i, rec in enumerate(doc["records"]):
        at = f"records[{i}]"
        if not isinstance(rec, dict):
            fail(at, f"expected an object, got {type(rec).__name__}")
        for key in sorted(set(rec) - set(checks), key=str)[:1]:
            fail(f"{at}.{key}", f"unknown key (expected {', '.join(checks)})")
        for key, (check, expected) in checks.items():
            if key not in rec:
                if key in _RECORD_REQUIRED:
                    fail(f"{at}.{key}", "required")
            elif not check(rec[key]):
                fail(f"{at}.{key}", f"expected {expected}, got {shown(rec[key])}")


def _classify(cfg: Config, rec: dict, group_dims: dict) -> Optional[tuple[str, str]]:
    """(dim, op class) of a record, or None for records the model does not count
    (receives)."""
    op = rec["op"]
    cls = OP_CLASS.get(op, op)
    ranks = list(rec.get("ranks") or [])
    if cls == "p2p":
        if op not in ("send", "isend"):
            return None
        root = rec.get("root", -1)
        if not ranks or not 0 <= root < len(ranks):
            return ("other", cls)
        me, peer = rec["_rank"], ranks[root]
        if 0 <= me < cfg.world and 0 <= peer < cfg.world:
            a, b = coords(cfg, me), coords(cfg, peer)
            if (a["tensor"], a["data"]) == (b["tensor"], b["data"]) and abs(a["pipeline"] - b["pipeline"]) == 1:
                return ("pp", cls)
        return ("other", cls)
    dims = group_dims.get(frozenset(ranks), [])
    prefer = ("ep", "tp", "dp", "edp") if cls == "all_to_all" else ("tp", "dp", "edp", "ep")
    for d in prefer:
        if d in dims:
            return (d, cls)
    return ("other", cls)


@dataclass
class Row:
    dim: str
    op: str
    pred_count: float
    meas_count: float
    pred_bytes: float
    meas_bytes: float
    pred_s: float
    meas_s: float  # as logged
    meas_comm_s: float  # arrival-corrected; meas_s - meas_comm_s is waiting for later peers
    pred_backend: str
    meas_backend: str

    @staticmethod
    def diff(pred: float, meas: float) -> Optional[float]:
        """(predicted - measured) / measured in percent; None when nothing was measured."""
        return (pred - meas) / meas * 100 if meas else None


def compare(cfg: Config, log: list[dict], cost: Optional[CostModel] = None,
            iterations: int = 1) -> list[Row]:
    """Rows per (dimension, op class): predicted per rank x ``iterations`` vs
    measured per rank, both averaged over the ranks in the log (all ranks of a
    full export, or the one rank of a single ``records_rank{r}.json``)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    worlds = {d.get("world_size") for d in log}
    if worlds != {cfg.world}:
        raise ValueError(f"the log has world size {', '.join(map(str, sorted(w for w in worlds if w is not None)))} "
                         f"but the model's layout has {cfg.world} ranks")
    ranks = sorted({int(doc["rank"]) for doc in log})
    bad = [r for r in ranks if not 0 <= r < cfg.world]
    if bad:
        raise ValueError(f"the log has rank {bad[0]}, outside the model's {cfg.world} ranks")
    group_dims: dict = {}
    for d in ("tp", "dp", "ep", "edp"):
        if d in ("ep", "edp") and cfg.model.moe is None:
            continue
        for r in range(cfg.world):
            g = group_of(cfg, d, r)
            if len(g) > 1:
                dims = group_dims.setdefault(frozenset(g), [])
                if d not in dims:
                    dims.append(d)
    meas: dict = {}
    for doc, comm in zip(log, arrival_times(log)):
        for rec, comm_s in zip(doc["records"], comm):
            if rec.get("end", -1) < 0:
                continue
            key = _classify(cfg, {**rec, "_rank": doc["rank"]}, group_dims)
            if key is None:
                continue
            cell = meas.setdefault(key, {"count": 0, "bytes": 0.0, "s": 0.0, "comm": 0.0,
                                         "backends": set()})
            cell["count"] += 1
            cell["bytes"] += rec["nbytes"]
            cell["s"] += rec["end"] - rec["start"]
            cell["comm"] += comm_s
            cell["backends"].add(rec["backend"])
    # prediction: averaged over the logged ranks (all of them for a full export)
    cost = cost or CostModel.defaults()
    pred: dict = {}
    stages = [[(x, cost.choose(x.op, x.message_bytes, x.group_size, x.select_group)) for x in entries]
              for entries in all_stage_traffic(cfg)]
    n = len(ranks)
    for r in ranks:
        for x, ch in stages[coords(cfg, r)["pipeline"]]:
            cell = pred.setdefault((x.dim, OP_CLASS.get(x.op, x.op)),
                                   {"count": 0.0, "bytes": 0.0, "s": 0.0, "backends": set()})
            cell["count"] += x.count * iterations / n
            cell["bytes"] += x.count * x.message_bytes * iterations / n
            cell["s"] += x.count * ch.time_us * 1e-6 * iterations / n
            cell["backends"].add(ch.backend)
    order = {d: i for i, d in enumerate(DIMS + ("other",))}
    rows = []
    for key in sorted(set(pred) | set(meas), key=lambda k: (order.get(k[0], 99), k[1])):
        pc = pred.get(key, {"count": 0.0, "bytes": 0.0, "s": 0.0, "backends": set()})
        mc = meas.get(key, {"count": 0, "bytes": 0.0, "s": 0.0, "comm": 0.0, "backends": set()})
        rows.append(Row(key[0], key[1], pc["count"], mc["count"] / n, pc["bytes"], mc["bytes"] / n,
                        pc["s"], mc["s"] / n, mc["comm"] / n, "+".join(sorted(pc["backends"])) or "-",
                        "+".join(sorted(mc["backends"])) or "-"))
    return rows


__all__ = ["Row", "compare", "load_log"]
