#!/usr/bin/env python
"""Run PyTorch's own distributed test suite on gloo or on mcrdl; write each test's outcome as JSON.

::

    python tests/torch_suite/run_suite.py --backend gloo  -n 2 --out gloo-2.json
    python tests/torch_suite/run_suite.py --backend mcrdl -n 2 --route stand-in --out mcrdl-2.json
    python tests/torch_suite/run_suite.py --backend mcrdl -n 3 --route plugin -k 'all_reduce|barrier'
    python tests/torch_suite/run_suite.py --backend gloo --tests test_barrier test_send_recv --out x.json

What runs: every test of ``torch.testing._internal.distributed.distributed_test.
DistributedTest._DistTestBase`` (or those a filter selects), in the class PyTorch's
test/distributed/test_distributed_spawn.py builds (``TestDistBackend`` + the base;
see suite_case.py). As there, the driver process runs each test's unittest case,
whose set-up starts one process per rank; each rank inits the default group
(``init_method=file://``, ``backend=$BACKEND``), runs the test and exits; the driver
reads the exit codes and piped tracebacks. Tests that need CUDA skip themselves.
The ranks start from a forkserver that has torch's test module imported, each
a fresh process forked from it (``--start spawn``: a fresh interpreter each, as
PyTorch runs them; slower, same outcomes).

Routes (``--route``; ``--backend gloo`` is always the plain gloo run):

* ``plugin``: ``BACKEND=mcrdl``, "mcrdl" added to ``DistTestCases.backend_feature["plugin"]``.
  This is how the suite runs an out-of-tree backend; tests it gates on backend
  names ("Only gloo ...", ``backend_feature["ddp"]``, ``["subgroup"]``) skip.
* ``stand-in`` (default): ``BACKEND=gloo``, so the suite takes exactly the gloo
  test paths and skips, but in every rank ``torch.distributed.init_process_group``
  and ``new_group`` (in ``torch.distributed`` and in ``distributed_c10d``, which
  ``new_subgroups*`` call) are wrapped to pass ``backend="mcrdl"`` where the suite
  asks for gloo (``"gloo"``, ``Backend.GLOO``, ``"cpu:gloo,..."``). Groups with no
  backend inherit the default group's, mcrdl. Tests that assert the group's
  backend *name* is "gloo" see "mcrdl": those differences are the stand-in's.

Each rank registers "mcrdl" with ``mcrdl.integrations.torch_backend.register()``
unless it is registered already (mcrdl's ``torch.backends`` entry point does it
at ``import torch`` when installed). Each test is bounded by ``--timeout``
(torch's join loop terminates the ranks; a watchdog guards the driver).

Outcome per test: ``passed``, ``failed`` (an AssertionError in a rank), ``error``
(any other exception, a rank dying, a timeout) or ``skipped``, with a short reason
(the rank's exception line, the skip's message) and, if not passed, ``detail``
(the end of the traceback, or the ranks' stacks at a timeout). torch judges a
test by rank 0 (and by any rank's exception in the test body); a passed test in
which another rank exited non-zero gets a ``warning``. Ranks' stdout/stderr go to
``--log-dir/<test>/rank<N>.log``. The JSON is rewritten after every test, so an
interrupted run leaves what it did.

Imported, :func:`run_suite` runs the same in a child process (torch's test module
fixes the backend when imported) and returns the parsed JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ROUTES = ("stand-in", "plugin")
STATUSES = ("passed", "failed", "error", "skipped")
DETAIL_CHARS = 4000


def run_suite(backend: str, world_size: int = 2, route: str = "stand-in",
              tests: Union[None, str, Sequence[str]] = None, out: Union[None, str, Path] = None,
              timeout: float = 120, log_dir: Union[None, str, Path] = None,
              start: str = "forkserver", quiet: bool = True) -> dict:
    """Run the suite in a child process and return its JSON (see the module doc).
    ``tests``: a regex (``re.search`` on the name) or a list of names."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--backend", backend,
           "-n", str(world_size), "--route", route, "--timeout", str(timeout), "--start", start]
    if isinstance(tests, str):
        cmd += ["-k", tests]
    elif tests is not None:
        cmd += ["--tests", *tests]
    if log_dir is not None:
        cmd += ["--log-dir", str(log_dir)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(out) if out is not None else Path(tmp) / "result.json"
        cmd += ["--out", str(path)]
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=quiet, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(cmd)} exited {proc.returncode}:\n"
                               f"{(proc.stdout or '')[-3000:]}{(proc.stderr or '')[-3000:]}")
        return json.loads(path.read_text())


# -- driver ------------------------------------------------------------------------------------
class WatchdogTimeout(Exception):
    """The driver itself was stuck past a test's bound (torch's join loop did not end it)."""


def _alarm(signum, frame):
    raise WatchdogTimeout("the driver's watchdog fired: the test outlived its timeout")


def _select(names: Sequence[str], pattern: Optional[str], listed: Optional[Iterable[str]]) -> list:
    if listed:
        wanted = list(dict.fromkeys(listed))
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise SystemExit(f"no such tests in _DistTestBase: {', '.join(unknown)}")
        names = wanted
    if pattern:
        names = [n for n in names if re.search(pattern, n)]
    return list(names)


_EXC_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Timeout|Failure)\b")


def _exception_line(text: str) -> str:
    """The last 'SomeError: message' line of a traceback (with the message's first line)."""
    lines = text.rstrip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        if _EXC_LINE.match(lines[i]):
            return lines[i].strip()
    return lines[-1].strip() if lines else ""


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _skip_reason(text: str, report: Path, world_size: int) -> str:
    """torch reports a skip inside a rank as "skipped at subprocess level": use the rank's reason."""
    if text.startswith("Test skipped at subprocess level"):
        reasons = {_read(report / f"rank{r}.skip").strip() for r in range(world_size)} - {""}
        if reasons:
            return _short("; ".join(sorted(reasons)))
    return _short(text)


def _status(exception_line: str) -> str:
    return "failed" if exception_line.split(":")[0].endswith("AssertionError") else "error"


def _failure(text: str, report: Path, world_size: int, timeout: float, harness_log: str) -> tuple:
    """(status, reason, detail) of a test that did not pass, from unittest's traceback
    ``text`` (the ranks' piped tracebacks, a timeout, an exit code) and the ranks' files."""
    piped = re.findall(r"Process (\d+) exited with error code \d+ and exception:\n(.*?)"
                       r"(?=\nProcess \d+ exited with error code|\Z)", text, re.S)
    if piped:
        rank, tb = piped[0]
        line = _exception_line(tb)
        return _status(line), _short(f"rank {rank}: {line}"), tb[-DETAIL_CHARS:]
    if "terminated or timed out after" in text or "WatchdogTimeout" in text:
        return "error", f"timeout: not done after {timeout:g} s", (harness_log or text)[-DETAIL_CHARS:]
    rank_errors = {r: _read(report / f"rank{r}.error") for r in range(world_size)}
    rank_errors = {r: t for r, t in rank_errors.items() if t}
    if rank_errors:  # outside the test body: init_process_group, the barriers, destroy
        rank, tb = min(rank_errors.items())
        return ("error", _short(f"rank {rank}: {_exception_line(tb)}"),
                "\n".join(f"rank {r}:\n{t}" for r, t in sorted(rank_errors.items()))[-DETAIL_CHARS:])
    code = re.search(r"Expected exit code \d+ but got (-?\d+)", text)
    if code:
        return ("error", f"rank 0 exited with code {code.group(1)}",
                _read(report / "rank0.log")[-DETAIL_CHARS:])
    line = _exception_line(text)
    return _status(line), _short(line), text[-DETAIL_CHARS:]


def _relative(path: str) -> str:
    """``path`` relative to the repository when inside it (commands read the same anywhere)."""
    try:
        return str(Path(path).relative_to(ROOT))
    except ValueError:
        return path


def _mcrdl_tree() -> str:
    """Which mcrdl the ranks import: this repository's commit (and whether src/ has
    uncommitted changes), or the path of another copy."""
    spec = importlib.util.find_spec("mcrdl")
    where = Path(spec.origin).resolve().parents[1] if spec and spec.origin else None
    if where != ROOT / "src":
        return f"mcrdl at {where}"
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=ROOT, text=True,
                               capture_output=True, timeout=10).stdout.strip()
        return f"{head}{' + uncommitted changes in src/' if dirty else ''}" if head else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class _Collect(logging.Handler):
    """Keeps torch's multiprocess-harness log records (timed-out ranks' stacks) per test."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list = []

    def emit(self, record):
        self.lines.append(self.format(record))


def _world_size(text: str) -> int:
    n = int(text)
    if n < 2:
        raise argparse.ArgumentTypeError("the suite needs at least 2 ranks")
    return n


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=("gloo", "mcrdl"), required=True)
    p.add_argument("-n", "--world-size", type=_world_size, default=2,
                   help="ranks (default 2; the suite's group tests of ranks [1, 2] want 8)")
    p.add_argument("--route", choices=ROUTES, default="stand-in",
                   help="how mcrdl replaces gloo (ignored for --backend gloo)")
    p.add_argument("-k", "--filter", help="regex: run tests whose name it matches (re.search)")
    p.add_argument("--tests", nargs="+", metavar="NAME", help="run these tests (with -k: those matching)")
    p.add_argument("--timeout", type=float, default=120, help="seconds per test (default 120)")
    p.add_argument("--start", choices=("forkserver", "spawn"), default="forkserver",
                   help="how rank processes start (default forkserver)")
    p.add_argument("--out", help="JSON file to write (default: print the counts only)")
    p.add_argument("--log-dir", help="keep ranks' output here (default: a temporary directory)")
    p.add_argument("--list", action="store_true", help="print the selected test names and exit")
    return p.parse_args(argv)


def _environment(args: argparse.Namespace, route: str) -> None:
    """What torch's test module and the ranks read (set before importing suite_case)."""
    os.environ.update({
        "BACKEND": "mcrdl" if route == "plugin" else "gloo",
        "WORLD_SIZE": str(args.world_size),
        "MCRDL_SUITE_ROUTE": route,
        "MCRDL_SUITE_START": args.start,
        "MASTER_ADDR": "127.0.0.1",
        "PYTORCH_PRINT_REPRO_ON_FAILURE": "0",
        # both replaced per test by torch's set-up; INIT_METHOD's scheme decides skips at import
        "TEMP_DIR": tempfile.gettempdir(),
        "INIT_METHOD": "file://" + os.path.join(tempfile.gettempdir(), "shared_init_file"),
        # the forkserver imports suite_case by name (it does not get sys.path)
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    })


def _run_one(case_class, name: str, report: Path, args: argparse.Namespace,
             collect: _Collect, timeout: float) -> dict:
    """Run test ``name``; its JSON entry."""
    report.mkdir(parents=True, exist_ok=True)
    case_class.report_dir = str(report)
    collect.lines = []
    outcome = unittest.TestResult()
    t0 = time.monotonic()
    signal.alarm(int(timeout + 90))
    case = case_class(name)
    try:  # torch's harness prints to the driver's stdout/stderr: keep the progress display clean
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            case.run(outcome)
    except WatchdogTimeout as exc:
        outcome.errors.append((None, f"WatchdogTimeout: {exc}"))
    finally:
        signal.alarm(0)
    seconds = round(time.monotonic() - t0, 2)
    if outcome.skipped:
        status, reason, detail = "skipped", _skip_reason(outcome.skipped[0][1], report,
                                                         args.world_size), ""
    elif outcome.errors or outcome.failures:
        status, reason, detail = _failure((outcome.errors + outcome.failures)[0][1], report,
                                          args.world_size, timeout, "\n".join(collect.lines))
    else:
        status, reason, detail = "passed", "", ""
    entry = {"status": status, "reason": reason, "duration_s": seconds}
    if status == "passed":  # torch checks rank 0's exit code only
        entry.update(_rank_warning(report, [p.exitcode for p in getattr(case, "processes_seen", [])]))
    lives = [set(json.loads(f.read_text())) for f in sorted(report.glob("rank*.live"))]
    if lives:  # the backends live on mcrdl in every rank of the test
        entry["live"] = sorted(set.intersection(*lives))
    if detail:
        entry["detail"] = detail
    return entry


def _rank_warning(report: Path, exit_codes: list) -> dict:
    """``warning``/``detail`` for a passed test in which another rank did not exit 0."""
    bad = [(r, c) for r, c in enumerate(exit_codes) if c != 0]
    if not bad:
        return {}
    rank, code = bad[0]
    error = _read(report / f"rank{rank}.error")
    warning = f"rank {rank} exited with code {code}" + (f": {_exception_line(error)}" if error else "")
    return {"warning": _short(warning), "detail": error[-DETAIL_CHARS:]} if error else {"warning": warning}


def _write(result: dict, out: str) -> None:
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parse(argv)
    route = "gloo" if args.backend == "gloo" else args.route
    _environment(args, route)
    sys.path.insert(0, str(HERE))
    import suite_case
    import torch
    from torch.testing._internal import common_distributed

    names = _select(suite_case.all_tests(), args.filter, args.tests)
    if args.list:
        print("\n".join(names))
        return 0
    suite_case.set_timeout(args.timeout)
    if args.start == "forkserver":
        torch.multiprocessing.get_context("forkserver").set_forkserver_preload(["suite_case"])

    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    collect = _Collect()
    common_distributed.logger.addHandler(collect)
    common_distributed.logger.propagate = False
    signal.signal(signal.SIGALRM, _alarm)
    command = [_relative(sys.executable), _relative(os.path.abspath(sys.argv[0])), *sys.argv[1:]]
    result = {
        "backend": args.backend, "route": route, "world_size": args.world_size,
        "torch": torch.__version__, "mcrdl_tree": _mcrdl_tree(), "start": args.start,
        "timeout_s": args.timeout, "command": shlex.join(command),
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "duration_s": 0.0, "counts": dict.fromkeys(STATUSES, 0), "tests": {},
    }
    colors = {"passed": "green", "failed": "red", "error": "red", "skipped": "yellow"}
    label = f"{args.backend}{'' if route == 'gloo' else ' ' + route} n={args.world_size}"
    console = Console(file=sys.stdout)  # the real stdout, before tests redirect sys.stdout
    t_start = time.monotonic()
    with contextlib.ExitStack() as stack:
        log_root = Path(args.log_dir or stack.enter_context(
            tempfile.TemporaryDirectory(prefix="torch_suite_")))
        progress = stack.enter_context(Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TextColumn("{task.fields[counts]}"), console=console))
        task = progress.add_task(label, total=len(names), counts="")
        suite_case.SuiteCase.setUpClass()
        for name in names:
            timeout = max(args.timeout, common_distributed.get_timeout(name))
            entry = _run_one(suite_case.SuiteCase, name, log_root / name, args, collect, timeout)
            result["tests"][name] = entry
            result["counts"][entry["status"]] += 1
            result["duration_s"] = round(time.monotonic() - t_start, 1)
            if args.out:
                _write(result, args.out)
            reason = f" - {entry['reason']}" if entry["reason"] else ""
            if "warning" in entry:
                reason += f" (warning: {entry['warning']})"
            progress.console.print(
                f"[{colors[entry['status']]}]{entry['status'].upper():7}[/] "
                f"{escape(name)} ({entry['duration_s']:.1f} s){escape(reason)}",
                highlight=False, soft_wrap=True)
            progress.update(task, advance=1, counts=" ".join(
                f"{k} {v}" for k, v in result["counts"].items()))
        suite_case.SuiteCase.tearDownClass()
    console.print(f"{label}: " + ", ".join(f"{v} {k}" for k, v in result["counts"].items())
                  + f" in {result['duration_s']:.0f} s" + (f"; JSON: {args.out}" if args.out else ""),
                  highlight=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
