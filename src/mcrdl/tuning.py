"""Tuning tables: which backend runs an op, per device, group size and message size.

Format (``docs/tuning-table.md`` is the reference)::

    {
      "format": "mcrdl-tuning/2",
      "metadata": {"hosts": [...], "world_size": 2, "date": "...", ...},
      "rules": {
        "cpu": {
          "all_reduce": {
            "2": [{"max_bytes": 65536, "backend": "mpi"},
                  {"max_bytes": null,  "backend": "gloo"}]
          }
        },
        "cuda": {...}
      }
    }

Rules are kept per device type of the op's tensors (:data:`DEVICES`). For each
op (a selection class, see :data:`SELECT_OPS`) and group size, rules are ordered
by ``max_bytes`` (inclusive upper bound, strictly increasing); a message of
``n`` bytes takes the first rule with ``n <= max_bytes``; the last rule also
covers every larger size (``null`` says so explicitly). A group size not in the
table uses the largest listed group size below it, or the smallest listed one
when all are larger. A device the table has no rules for gets no answer.
Version 1 files (``mcrdl-tuning/1``: ``rules`` maps ops directly, no device
level) still load, as the rules for ``cpu``.
"""
from __future__ import annotations

import bisect
import builtins
import json
import reprlib
import sys
import warnings
from typing import Any, Iterable, Optional

FORMAT = "mcrdl-tuning/2"
#: The previous format: the same without the device level (its rules are for CPU tensors).
FORMAT_V1 = "mcrdl-tuning/1"
#: Device types a table may have rules for.
DEVICES = ("cpu", "cuda")
#: Largest integer (byte count, size) a file may give: sizes are int64 on the wire.
MAX_INT = 2 ** 63 - 1

#: Selection classes: every API op is selected as one of these.
SELECT_OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather",
              "scatter", "all_to_all", "barrier", "p2p")

#: API op name -> selection class (variants that move the same data share one).
OP_CLASS = {op: op for op in SELECT_OPS}
OP_CLASS.update(all_gather_into_tensor="all_gather", reduce_scatter_tensor="reduce_scatter",
                all_to_all_single="all_to_all", send="p2p", recv="p2p", isend="p2p",
                irecv="p2p", batch_isend_irecv="p2p",
                # the bench's and model's name for all_to_all_single with split sizes (MPI Alltoallv)
                all_to_allv="all_to_all")

#: Selection class -> the backend ops (:data:`mcrdl.backends.OPS`) that run it.
CLASS_METHODS = {cls: frozenset({cls}) for cls in SELECT_OPS}
CLASS_METHODS.update(all_gather=frozenset({"all_gather_into_tensor"}),
                     reduce_scatter=frozenset({"reduce_scatter_tensor"}),
                     all_to_all=frozenset({"all_to_all_single"}), p2p=frozenset({"send", "recv"}))


def busbw_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (docs/bench.md) of ``op`` (an API op,
    a bench op or an op class) on ``n`` ranks: busbw = algbw x factor."""
    op_class = OP_CLASS.get(op, op)
    if op_class == "all_reduce":
        return 2 * (n - 1) / n
    if op_class in ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter"):
        return (n - 1) / n
    return 1.0

_RULE_KEYS = {"max_bytes", "backend", "margin", "note"}


class TuningTableError(ValueError):
    """A tuning table is malformed; the message names the file and key at fault."""


# -- reading the files users give (tuning tables, model descriptions, bench results, logs) --
def read_text(path, what: str, error: type = ValueError) -> str:
    """A UTF-8 text file; ``error`` naming the file when it cannot be read."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise error(f"{path}: cannot read {what}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: byte {exc.start}: not UTF-8 text") from None


def read_json(path, what: str, error: type = ValueError) -> Any:
    """A JSON file, parsed (no validation); ``error`` naming the file (and the
    line and column of malformed JSON) for any problem."""
    text = read_text(path, what, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{path}:{exc.lineno}:{exc.colno}: malformed JSON: {exc.msg}") from None
    except RecursionError:
        raise error(f"{path}: JSON nested too deeply") from None
    except ValueError:  # the only other: an integer beyond Python's digit limit
        raise error(f"{path}: a JSON number has more than {sys.get_int_max_str_digits()} digits") from None


class _Repr(reprlib.Repr):
    """reprlib that does not turn a huge int into digits (Python refuses past 4300)."""

    def repr_int(self, x, level):
        return builtins.repr(x) if x.bit_length() <= 128 else f"<integer of {x.bit_length()} bits>"


_repr = _Repr()
_repr.maxlevel, _repr.maxstring, _repr.maxother = 3, 40, 40


def shown(value: Any) -> str:
    """``repr(value)`` cut to 60 characters, for error messages about a file's values."""
    text = _repr.repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def key_path(path: str) -> str:
    """A key path for an error message, cut to 80 characters (keys are the file's)."""
    return path if len(path) <= 80 else path[:77] + "..."


def is_int(value: Any, low: int = 0) -> bool:
    """An integer (not a boolean) from ``low`` to :data:`MAX_INT`."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= MAX_INT


def is_number(value: Any, low: Optional[float] = None) -> bool:
    """A finite number (not a boolean; a float holds it), at least ``low``."""
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and abs(value) <= sys.float_info.max and (low is None or value >= low))


Rules = dict[str, dict[int, list[dict]]]  # op -> group size -> rules (one device's)


class TuningTable:
    """A validated table with O(log n) lookup. ``rules``: device -> op ->
    group size -> rules."""

    def __init__(self, rules: dict[str, Rules], metadata: Optional[dict] = None, source: str = "<table>"):
        self.rules = rules
        self.metadata = dict(metadata or {})
        self.source = source
        self._raw: Optional[dict] = None  # the document it was loaded from
        self._compiled: dict[tuple[str, str], tuple[list[int], dict[int, tuple[list[float], list]]]] = {}
        for device, by_op in rules.items():
            for op, by_size in by_op.items():
                self._compiled[device, op] = (sorted(by_size), {
                    g: ([float("inf") if r["max_bytes"] is None else r["max_bytes"] for r in rs],
                        [r["backend"] for r in rs]) for g, rs in by_size.items()})

    # -- loading ----------------------------------------------------------------
    @classmethod
    def load(cls, path: str, known: Iterable[str], live: Optional[Iterable[str]] = None) -> "TuningTable":
        """Read and validate a table file (see :meth:`from_dict`)."""
        return cls.from_dict(read_json(path, "tuning table", TuningTableError), known, live, source=path)

    @classmethod
    def from_dict(cls, doc: Any, known: Iterable[str], live: Optional[Iterable[str]] = None,
                  source: str = "<table>") -> "TuningTable":
        """Validate a parsed table (either format). ``known``: registered backend
        names (others are an error); ``live``: backends running in this job
        (rules naming a known but absent backend warn and fall back to the
        selector's next choice). Where ``known`` maps names to backend classes
        (the registry), a rule naming a backend for an op it lacks is an error."""
        has = {n: b.ops for n, b in known.items()} if isinstance(known, dict) else {}
        known = set(known)
        live = known if live is None else set(live)

        def fail(key: str, msg: str):
            raise TuningTableError(f"{source}: {key_path(key)}: {msg}")

        if not isinstance(doc, dict):
            fail("(top level)", f"expected a JSON object, got {type(doc).__name__}")
        extra = set(doc) - {"format", "metadata", "rules"}
        if extra:
            fail(sorted(extra, key=str)[0], "unknown key (expected format, metadata, rules)")
        if doc.get("format") not in (FORMAT, FORMAT_V1):
            fail("format", f"expected {FORMAT!r} (or {FORMAT_V1!r}), got {shown(doc.get('format'))}")
        metadata = doc.get("metadata", {})
        if not isinstance(metadata, dict):
            fail("metadata", "expected an object")
        raw = doc.get("rules")
        absent: set[str] = set()
        if doc["format"] == FORMAT_V1:
            if not isinstance(raw, dict):
                fail("rules", "expected an object mapping op names to group sizes")
            rules = {"cpu": _check_ops(raw, "rules", known, has, live, absent, fail)} if raw else {}
        else:
            if not isinstance(raw, dict):
                fail("rules", f"expected an object mapping device types ({', '.join(DEVICES)}) to ops")
            rules = {}
            for device, by_op in raw.items():
                if device not in DEVICES:
                    hint = (f"; {FORMAT!r} groups rules by device type first, e.g. rules.cpu.{device}"
                            if device in SELECT_OPS else "")
                    fail(f"rules.{device}", f"unknown device type (expected one of {', '.join(DEVICES)}){hint}")
                if not isinstance(by_op, dict):
                    fail(f"rules.{device}", "expected an object mapping op names to group sizes")
                rules[device] = _check_ops(by_op, f"rules.{device}", known, has, live, absent, fail)
        if absent:
            warnings.warn(f"{source}: backends {sorted(absent)} are not live in this job; their "
                          "rules fall back to the static map / default backend", stacklevel=3)
        table = cls(rules, metadata, source)
        table._raw = doc
        return table

    # -- lookup -------------------------------------------------------------------
    def _rules_at(self, op: str, group_size: int, device: str):
        entry = self._compiled.get((device, op))
        if entry is None:
            return None
        sizes, by_size = entry
        i = bisect.bisect_right(sizes, group_size)
        return by_size[sizes[i - 1] if i else sizes[0]]

    def lookup(self, op: str, group_size: int, nbytes: int, device: str = "cpu") -> Optional[str]:
        """The backend for ``op`` on ``device`` tensors at this group size and
        message size, or None."""
        found = self._rules_at(op, group_size, device)
        if found is None:
            return None
        bounds, names = found
        j = bisect.bisect_left(bounds, nbytes)
        return names[j if j < len(names) else -1]

    def devices(self) -> list[str]:
        """The device types this table has rules for."""
        return [d for d, by_op in self.rules.items() if by_op]

    def learned(self, op: str, group_size: int, nbytes: int, device: str = "cpu") -> Optional[str]:
        """What an autotuned job measured for this op's size bucket (a table
        saved by ``MCRDL_AUTOTUNE_SAVE`` says in its metadata), or None."""
        rows = self.metadata.get("buckets")
        for row in rows if isinstance(rows, list) else ():
            try:
                if (row["op"] == op and row["group_size"] == group_size and row["device"] == device
                        and row["winner"] is not None and row["min_bytes"] <= nbytes <= row["max_bytes"]):
                    us = ", ".join(f"{b} {'-' if t is None else f'{t:.1f} us'}" for b, t in row["us"].items())
                    return f"learned in-situ by group {row['group']}: {us}; {row['how']}"
            except (KeyError, TypeError, AttributeError):  # not a row autotune wrote
                continue
        return None

    def device_rules(self, device: str) -> dict:
        """The rules for ``device`` as written in the file: op -> group size
        (a string) -> rules (backends named as written, live or not)."""
        return self.to_dict()["rules"].get(device, {})

    def rules_for(self, op: str, group_size: int, device: str = "cpu") -> Optional[list[dict]]:
        """The rules (as written in the file) that lookups of ``op`` at this
        group size use, or None when the table has none for ``op``."""
        raw = self.device_rules(device).get(op)
        if not raw:
            return None
        by_size = {int(k): v for k, v in raw.items()}
        sizes = sorted(by_size)
        i = bisect.bisect_right(sizes, group_size)
        return by_size[sizes[i - 1] if i else sizes[0]]

    def distinct_backends(self, op: str, group_size: int, device: str = "cpu") -> int:
        """How many different backends the rules for ``op`` at this size use."""
        found = self._rules_at(op, group_size, device)
        return 0 if found is None else len(set(found[1]))

    def to_dict(self) -> dict:
        """The table as a JSON-ready document (round-trips through :meth:`from_dict`);
        a table loaded from a version 1 file is written in the current format."""
        raw = self._raw
        if raw is None:
            rules = {device: {op: {str(g): rs for g, rs in sorted(by.items())} for op, by in by_op.items()}
                     for device, by_op in self.rules.items()}
        elif raw["format"] == FORMAT:
            return raw
        else:
            rules = {"cpu": raw["rules"]} if raw["rules"] else {}
        return {"format": FORMAT, "metadata": self.metadata, "rules": rules}

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=2)
            f.write("\n")


def _check_ops(raw: dict, where: str, known: set, has: dict, live: set, absent: set, fail) -> Rules:
    """One device's rules, validated: op -> group size -> rules, a backend that
    is known but not live written as None (and added to ``absent``); ``has``:
    each backend's ops, where known."""
    rules: Rules = {}
    for op, by_size in raw.items():
        at_op = f"{where}.{op}"
        if op not in SELECT_OPS:
            fail(at_op, f"unknown op (expected one of {', '.join(SELECT_OPS)})")
        if not isinstance(by_size, dict) or not by_size:
            fail(at_op, "expected a non-empty object mapping group sizes to rule lists")
        rules[op] = {}
        for gkey, rs in by_size.items():
            at_g = f"{at_op}.{gkey}"
            g = (int(gkey) if isinstance(gkey, str) and gkey.isascii() and gkey.isdigit()
                 and len(gkey) < 20 else 0)
            if not 0 < g <= MAX_INT:
                fail(at_g, 'group size must be a positive integer written as a string, e.g. "8"')
            if g in rules[op]:
                fail(at_g, f"group size {g} is listed twice")
            if not isinstance(rs, list) or not rs:
                fail(at_g, "expected a non-empty list of rules")
            out, prev = [], -1
            for i, rule in enumerate(rs):
                at = f"{at_g}[{i}]"
                if not isinstance(rule, dict):
                    fail(at, "expected an object with max_bytes and backend")
                unknown = set(rule) - _RULE_KEYS
                if unknown:
                    fail(f"{at}.{sorted(unknown, key=str)[0]}",
                         f"unknown key (expected {', '.join(sorted(_RULE_KEYS))})")
                if "max_bytes" not in rule or "backend" not in rule:
                    fail(at, "needs both max_bytes and backend")
                mb, be = rule["max_bytes"], rule["backend"]
                if mb is None:
                    if i != len(rs) - 1:
                        fail(f"{at}.max_bytes", "null (no upper bound) is only allowed on the last rule")
                elif not is_int(mb):
                    fail(f"{at}.max_bytes", "expected a non-negative integer or null "
                                            f"(at most {MAX_INT}), got {shown(mb)}")
                elif mb <= prev:
                    fail(f"{at}.max_bytes", f"{mb} is not above the previous rule's {prev}: "
                                            "ranges must be ordered and must not overlap")
                else:
                    prev = mb
                if not isinstance(be, str) or be not in known:
                    fail(f"{at}.backend", f"unknown backend {shown(be)} (known: {', '.join(sorted(known))})")
                if be in has and not CLASS_METHODS[op] <= has[be]:
                    fail(f"{at}.backend", f"backend {be!r} has no {op} (it has {', '.join(sorted(has[be]))})")
                if "margin" in rule and not is_number(rule["margin"]):
                    fail(f"{at}.margin", f"expected a finite number, got {shown(rule['margin'])}")
                if "note" in rule and not isinstance(rule["note"], str):
                    fail(f"{at}.note", f"expected a string, got {shown(rule['note'])}")
                if be not in live:
                    absent.add(be)
                out.append({**rule, "backend": be if be in live else None})
            rules[op][g] = out
    return rules


def named_backends(doc: Any) -> set[str]:
    """Backend names a parsed table document's rules mention (either format;
    whatever is malformed is skipped: validation reports it)."""
    rules = doc.get("rules") if isinstance(doc, dict) else None
    if not isinstance(rules, dict):
        return set()
    levels = [rules] if doc.get("format") == FORMAT_V1 else list(rules.values())
    lists = [rs for by_op in levels if isinstance(by_op, dict)
             for by_size in by_op.values() if isinstance(by_size, dict)
             for rs in by_size.values() if isinstance(rs, list)]
    return {r["backend"] for rs in lists for r in rs if isinstance(r, dict) and isinstance(r.get("backend"), str)}
