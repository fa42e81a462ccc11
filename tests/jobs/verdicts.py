"""Structured verdicts of the test jobs: check name, rank, expected, got.

A job calls :func:`check` (or :func:`check_equal`) for what it verifies; each verdict
is one JSON line in ``$TEST_VERDICTS/rank<r>.jsonl``, a directory the test's runner
(tests/conftest.py) made and reads back. Ranks never share a file, so no verdict is lost
to two ranks' output being joined. A job that dies on an exception leaves a verdict
naming it (an ``uncaught`` check with the exception and the job's line), so the test
names the rank and the place even when no check ran. Run by hand (no
``TEST_VERDICTS``), verdicts print as ``CHECK <name> rank=<r> ok|FAIL ...`` lines.
"""
import json
import os
import sys
import traceback

import torch

_DIRECTORY = os.environ.get("TEST_VERDICTS")  # made and read back by tests/conftest.py
_RANK_VARIABLES = ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
_rank = None
_part = None  # the part of the job running now (run_parts)
_files = {}  # rank -> its verdict file, kept open (opening it per verdict cost 12 us against 1.5)


def set_rank(rank):
    """The rank verdicts are filed under (default: the launcher's rank variable)."""
    global _rank
    _rank = int(rank)


def rank():
    if _rank is not None:
        return _rank
    return int(next((os.environ[v] for v in _RANK_VARIABLES if v in os.environ), 0))


def record(name, ok, expected=None, got=None, where=None):
    """File one verdict; ``expected``/``got`` are kept as their repr (only on failure)."""
    entry = {"name": name, "rank": rank(), "ok": bool(ok)}
    if _part is not None:
        entry["part"] = _part
    if not ok:
        entry.update(expected=None if expected is None else _short(expected),
                     got=None if got is None else _short(got), where=where or _caller())
    if _DIRECTORY is None:
        tail = "ok" if ok else f"FAIL expected={entry['expected']} got={entry['got']} at {entry['where']}"
        print(f"CHECK {name} rank={entry['rank']} {tail}", flush=True)
        return bool(ok)
    f = _files.get(entry["rank"])
    if f is None:  # (line-buffered: each verdict is written whole at once, as a rank may die next)
        f = _files[entry["rank"]] = open(os.path.join(_DIRECTORY, f"rank{entry['rank']}.jsonl"), "a", buffering=1)
    f.write(json.dumps(entry) + "\n")
    return bool(ok)


def check(name, ok, expected=None, got=None):
    """One named check; returns ``ok`` (the job goes on either way)."""
    return record(name, ok, expected, got)


def finished(name):
    """This rank ran the job (or its part ``name``) to its end: a passing
    ``<name> finished`` verdict, which the test requires of every rank
    (tests/conftest.py, ``JobOutput.require``): a rank that stopped early is named."""
    return record(f"{name} finished", True)


def run_parts(names, parts, before_each=None, after_each=None):
    """Run the job's parts ``names`` in turn (``parts``: name -> function), so one
    launch checks many cases; each part's verdicts carry its name (tests/conftest.py,
    ``JobOutput.part``). ``before_each(name)`` and ``after_each()`` run around each
    part (a fresh runtime per part: init and destroy). A part that raises is an
    ``uncaught`` check of that part, ``after_each()`` is tried once more, and the
    next part still runs; one that returns, and ``after_each()`` after it, files
    ``<name> finished``."""
    global _part
    for name in names:
        _part = name
        try:
            if before_each is not None:
                before_each(name)
            parts[name]()
            if after_each is not None:
                after_each()
        except Exception as exc:  # noqa: BLE001 - filed as this part's failure
            if not isinstance(exc, CheckFailed):
                record("uncaught", False, "no exception", f"{type(exc).__name__}: {exc}",
                       _where(exc.__traceback__))
            traceback.print_exc()
            if after_each is not None:
                try:
                    after_each()
                except Exception:  # noqa: BLE001 - the part's failure is filed; the next part may run
                    traceback.print_exc()
        else:
            finished(name)
        finally:
            _part = None


def check_equal(name, got, want):
    """torch.equal on each pair of tensors (bitwise, same shape and dtype)."""
    got, want = list(got), list(want)
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g.shape != w.shape or not torch.equal(g, w)]
    return record(name, len(got) == len(want) and not bad, "torch.equal for all",
                  f"{len(got)} vs {len(want)} tensors; differ at {bad}: " + ", ".join(
                      f"#{i} {tuple(got[i].shape)} vs {tuple(want[i].shape)} max|d|={max_diff(got[i], want[i])}"
                      for i in bad), _caller())


def max_diff(a, b):
    """Largest absolute difference of two tensors ("n/a" when their shapes differ)."""
    if a.shape != b.shape:
        return "n/a"
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _short(value, limit=600):
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def _caller():
    """file:line of the job's frame that made the check (outside the shared helpers)."""
    helpers = (__file__, os.path.join(os.path.dirname(__file__), "common.py"))
    for frame in reversed(traceback.extract_stack()[:-1]):
        if frame.filename not in helpers:
            return f"{os.path.basename(frame.filename)}:{frame.lineno}"
    return "?"


class CheckFailed(AssertionError):
    """A failed check that stops the job (its verdict is already filed)."""


def _where(tb):
    """file:line of the job's deepest frame in a traceback."""
    frames = [f for f in traceback.extract_tb(tb) if "/tests/jobs/" in f.filename] or traceback.extract_tb(tb)
    return f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else "?"


def _uncaught(kind, exc, tb):
    """An exception that ends the job is a failed check named ``uncaught``."""
    if issubclass(kind, CheckFailed):
        return _previous_hook(kind, exc, tb)
    try:
        record("uncaught", False, "no exception", f"{kind.__name__}: {exc}", _where(tb))
    finally:
        _previous_hook(kind, exc, tb)


_previous_hook = sys.excepthook
sys.excepthook = _uncaught
