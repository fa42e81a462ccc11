"""Every ``MCRDL_*`` environment variable, declared once: name, kind, default, what it does.

The runtime's are declared here; a library's own, by its backend's module
(:func:`declare`, so a library stays one module). This is the only module that
reads them (``tests/test_settings.py`` fails on a read anywhere else); each
component asks :func:`get` when it starts (init, a backend's load), so a bad value
fails there with an error naming the variable.
docs/settings.md is :func:`page` (``mcrdl settings > docs/settings.md``).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class Setting:
    name: str
    #: flag (0 or 1), number (a float >= 0 in ``unit``), integer (>= ``minimum``),
    #: bytes (4096, 64K, 25M, 1G), text (read by its owner)
    kind: str
    default: Any
    doc: str
    unit: str = ""
    minimum: int = 0
    #: what a valid value is, for the error (default: from the kind); ``valid``: a further test
    accepts: str = ""
    valid: Optional[Callable[[Any], bool]] = None

    def describe(self) -> str:
        return self.accepts or {"flag": "0 or 1", "number": f"{self.unit} >= 0",
                                "integer": f"an integer >= {self.minimum}",
                                "bytes": "a positive byte count (4096, 64K, 25M)", "text": "text"}[self.kind]


SETTINGS = {s.name: s for s in (
    # selection
    Setting("MCRDL_DEFAULT_BACKEND", "text", None, "the backend an op runs on when nothing else picks one "
            "(default: the first live one of mpi, gloo)", accepts="a backend's name"),
    Setting("MCRDL_OP_BACKENDS", "text", None, "a static map, `all_to_all:mpi,all_reduce:gloo`, above the "
            "tuning table (`op_backends=`)", accepts="op:backend, ..."),
    Setting("MCRDL_TUNING_TABLE", "text", None, "the tuning table the selector reads (`tuning_table=`)",
            accepts="a path"),
    Setting("MCRDL_AUTOTUNE", "flag", False, "learn each collective's backend from the job's own first calls "
            "(`autotune=`)"),
    Setting("MCRDL_AUTOTUNE_CALLS", "integer", 3, "timed calls per candidate backend while autotuning",
            minimum=1),
    Setting("MCRDL_AUTOTUNE_SAVE", "text", None, "where rank 0 saves what autotune learned, as a tuning table",
            accepts="a path"),
    Setting("MCRDL_AUTOTUNE_DRIFT", "integer", 0, "re-explore when a bucket's recent calls (a window of this "
            "many) drift from what was learned; 0: never", accepts="0 (off) or a window of at least 2 calls",
            valid=lambda calls: calls != 1),
    Setting("MCRDL_AUTOTUNE_BLOCK_MS", "number", 100.0, "span of a trial block that judges candidates by "
            "the job's steps; 0: no trial", unit="milliseconds"),
    # the compiled paths
    Setting("MCRDL_NATIVE", "flag", True, "build and use the compiled hot path and tensor checks; 0: pure Python"),
    Setting("MCRDL_CACHE", "text", None, "where compiled helpers are cached (default: "
            "`$XDG_CACHE_HOME/mcrdl` or `~/.cache/mcrdl`)", accepts="a directory"),
    Setting("MCRDL_WAIT", "text", "auto", "how waits use the CPU: busy-poll, give the CPU up, or spin when the "
            "host's ranks fit its cores", accepts="spin, yield or auto"),
    # launching
    Setting("MCRDL_RANK_PYTHON", "text", None, "the command `mcrdl run` (and bench, tune, demo) runs each rank's "
            "Python program (`x.py`, `-m mod`) under, split as a shell would: an interpreter, or a wrapper "
            "ending in one, e.g. a profiler's (default: the Python running mcrdl)", accepts="a command"),
    # rendezvous, liveness, debugging
    Setting("MCRDL_MASTER_ADDR", "text", None, "the address rank 0's store and watchdog bind and peers dial "
            "(default: loopback on one host, else chosen from the network)", accepts="an address"),
    Setting("MCRDL_WATCHDOG", "flag", True, "the watchdog that names a dead or frozen peer within a second"),
    Setting("MCRDL_FROZEN_S", "number", 15.0, "silence after which a rank is reported frozen; 0: never",
            unit="seconds"),
    Setting("MCRDL_HEARTBEAT_S", "number", 1.0, "heartbeat interval in the store, which explains timeouts; "
            "0: off", unit="seconds"),
    Setting("MCRDL_DEBUG", "flag", False, "check every collective's order and arguments across ranks (`debug=`)"),
    # features
    Setting("MCRDL_COMMS_LOG", "flag", False, "record every op in the communication logger (`comms_log=`)"),
    Setting("MCRDL_COMMS_LOG_DIR", "text", None, "where the logger exports each rank's records at destroy",
            accepts="a directory"),
    Setting("MCRDL_FUSION_BUCKET_BYTES", "bytes", 25 << 20, "tensor fusion's bucket cap"),
    Setting("MCRDL_FUSION_POOL_BYTES", "bytes", 256 << 20, "free fusion buffers kept for reuse"),
)}


def declare(*settings: Setting) -> None:
    """Add a library's own settings (its backend's module calls this when imported)."""
    for setting in settings:
        if SETTINGS.get(setting.name, setting) != setting:
            raise ValueError(f"{setting.name} is declared twice, differently")
        SETTINGS[setting.name] = setting


def get(name: str) -> Any:
    """The variable's value, parsed by its kind; its default when unset or empty. A bad
    value raises ValueError: ``NAME: expected <what it accepts>, got '<value>'``."""
    setting, text = _setting(name), os.environ.get(name)
    if not text:
        return setting.default
    value = _parse(setting.kind, text)
    if value is None or (setting.kind in ("number", "integer") and value < setting.minimum) \
            or (setting.valid is not None and not setting.valid(value)):
        raise ValueError(f"{name}: expected {setting.describe()}, got {text!r}")
    return value


def _parse(kind: str, text: str) -> Any:
    """``text`` as ``kind``, or None when it is not one."""
    if kind == "flag":
        return {"0": False, "1": True}.get(text)
    if kind == "number":
        try:
            value = float(text)
        except ValueError:
            return None
        return value if math.isfinite(value) else None
    if kind == "integer":
        return int(text) if text.strip().isdigit() else None
    if kind == "bytes":
        try:
            value = parse_bytes(text)
        except ValueError:
            return None
        return value if value > 0 else None
    return text


def parse_bytes(text, what: str = "size") -> int:
    """``4096``, ``64K``, ``25M``, ``1G`` (binary units; a trailing ``B`` is allowed)."""
    if isinstance(text, int) and not isinstance(text, bool):
        return text
    t = str(text).strip().upper()
    if t.endswith("IB"):
        t = t[:-2]
    elif t.endswith("B"):
        t = t[:-1]
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a byte count (e.g. 4096, 64K, 25M)") from None


def _setting(name: str) -> Setting:
    if name not in SETTINGS:
        from . import backends  # noqa: F401  (a library's own, declared when its module loads)
    try:
        return SETTINGS[name]
    except KeyError:
        raise KeyError(f"{name} is not an mcrdl setting (see mcrdl.settings.SETTINGS)") from None


def page() -> str:
    """docs/settings.md: every setting (the libraries' too) as a row of a markdown table."""
    from . import backends  # noqa: F401  (each library's module declares its own)

    def default(s: Setting) -> str:
        if s.default is None:
            return "unset"
        if s.kind == "flag":
            return str(int(s.default))
        if s.kind == "bytes":
            return f"{s.default >> 20}M"
        return f"{s.default:g}" if isinstance(s.default, float) else str(s.default)

    rows = [f"| `{s.name}` | {s.describe()} | {default(s)} | {s.doc} |"
            for s in SETTINGS.values()]
    return "\n".join([
        "# Settings", "",
        "Every `MCRDL_*` environment variable mcrdl reads, as declared in `src/mcrdl/settings.py`",
        "and by each library's module in `src/mcrdl/backends/` (this page is `mcrdl settings`'s output). An argument of `init_process_group` named in a",
        "row wins over its variable.", "",
        "| variable | accepts | default | what it does |", "|---|---|---|---|", *rows]) + "\n"
