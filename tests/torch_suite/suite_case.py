"""The test class that run_suite.py runs: torch's ``DistributedTest._DistTestBase``
on ``TestDistBackend`` (as PyTorch's test/distributed/test_distributed_spawn.py
builds it), plus the per-rank set-up of the chosen route.

Imported by the runner's driver after it set the environment (``BACKEND``,
``WORLD_SIZE``, ``MCRDL_SUITE_ROUTE``, ``MCRDL_SUITE_START``), and by every
rank process when it unpickles its target. torch's test module reads
``BACKEND`` and decides skips when it is imported, so one process runs one
(backend, world size, route).
"""
from __future__ import annotations

import functools
import inspect
import json
import os
import re
import sys
import traceback
import unittest

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.testing._internal import common_distributed

ROUTE = os.environ["MCRDL_SUITE_ROUTE"]  # "gloo", "plugin" or "stand-in"
START_METHOD = os.environ.get("MCRDL_SUITE_START", "forkserver")
#: Per-test values torch's set-up puts in the driver's environment; a rank forked
#: from the forkserver would otherwise see those of the server's start.
PER_TEST_ENV = ("TEMP_DIR", "INIT_METHOD")


def register_mcrdl() -> None:
    """Make "mcrdl" a torch backend in this process. mcrdl's ``torch.backends``
    entry point may have registered it at ``import torch`` already; keep that."""
    if "mcrdl" not in dist.Backend.backend_list:
        from mcrdl.integrations import torch_backend

        torch_backend.register()


def _to_mcrdl(backend):
    """``"gloo"`` (any case, also inside ``"cpu:gloo,cuda:nccl"``) -> ``"mcrdl"``."""
    if isinstance(backend, str):
        return re.sub(r"(?i)\bgloo\b", "mcrdl", str(backend))
    return backend


def _mapping_backend(fn):
    """``fn`` (init_process_group or new_group) with its ``backend`` argument mapped."""
    sig = inspect.signature(fn)

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        bound = sig.bind_partial(*args, **kwargs)
        if "backend" in bound.arguments:
            bound.arguments["backend"] = _to_mcrdl(bound.arguments["backend"])
        return fn(*bound.args, **bound.kwargs)

    wrapper.__mcrdl_stand_in__ = True
    return wrapper


def install_stand_in() -> None:
    """Route every process group the suite asks of gloo to mcrdl: wrap
    ``init_process_group`` and ``new_group`` where the tests call them
    (``torch.distributed``) and where torch's helpers do (``distributed_c10d``:
    ``new_subgroups``, ``new_subgroups_by_enumeration``). ``backend=None`` groups
    inherit the default group's backend, mcrdl."""
    for name in ("init_process_group", "new_group"):
        fn = getattr(c10d, name)
        if not getattr(fn, "__mcrdl_stand_in__", False):
            fn = _mapping_backend(fn)
        setattr(c10d, name, fn)
        setattr(dist, name, fn)


if ROUTE in ("plugin", "stand-in"):
    register_mcrdl()
if ROUTE == "plugin":
    # require_backend_is_available() accepts plugin backends; it runs at import below.
    common_distributed.DistTestCases.backend_feature["plugin"].add("mcrdl")

from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402


class SuiteCase(dt.TestDistBackend, dt.DistributedTest._DistTestBase):
    """One test of the suite; the driver makes one instance per test name."""

    #: Where a rank records its output, skip reason and escaping error
    #: (``rank<N>.log``, ``rank<N>.skip``, ``rank<N>.error``); set by the driver.
    report_dir = ""

    def setUp(self):
        self.processes_seen = []
        super().setUp()
        self._spawn_processes()

    def tearDown(self):
        super().tearDown()  # terminates ranks still running (a timeout)
        for p in self.processes_seen:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        if os.path.exists(self.file_name):
            os.remove(self.file_name)

    def _spawn_processes(self):
        ctx = torch.multiprocessing.get_context(START_METHOD)
        self._start_processes(ctx.Process)
        self.processes_seen = list(self.processes)

    def _start_processes(self, proc):
        extra = {"suite_env": {k: os.environ[k] for k in PER_TEST_ENV},
                 "report_dir": self.report_dir}

        def make(*args, kwargs, **kw):
            return proc(*args, kwargs={**kwargs, **extra}, **kw)

        super()._start_processes(make)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe, suite_env=None, report_dir="", **kwargs):
        """A rank: this test's environment, output to its log, the route's set-up,
        then torch's own ``_run`` (init the group, barrier, test, barrier, destroy)."""
        os.environ.update(suite_env or {})
        dt.INIT_METHOD = os.environ.get("INIT_METHOD", dt.INIT_METHOD)
        base = os.path.join(report_dir, f"rank{rank}")
        log = os.open(base + ".log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        cls.report_dir = report_dir
        try:
            if ROUTE in ("plugin", "stand-in"):
                register_mcrdl()
            if ROUTE == "stand-in":
                install_stand_in()
            super()._run(rank, test_name, file_name, pipe, **kwargs)
        except Exception:  # init_process_group and the barriers run outside run_test's catch
            with open(base + ".error", "w") as f:
                f.write(traceback.format_exc())
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()

    def run_test(self, test_name, parent_pipe):
        """torch's run_test, recording a skip's reason (torch reports only "skipped")."""
        fn = getattr(self, test_name)

        @functools.wraps(fn)
        def recorded():
            import mcrdl  # the backends mcrdl runs on in this rank, when it serves the test

            if mcrdl.is_initialized():
                with open(os.path.join(self.report_dir, f"rank{self.rank}.live"), "w") as f:
                    json.dump(mcrdl.live_backends(), f)
            try:
                fn()
            except unittest.SkipTest as exc:
                with open(os.path.join(self.report_dir, f"rank{self.rank}.skip"), "w") as f:
                    f.write(str(exc))
                raise

        setattr(self, test_name, recorded)
        super().run_test(test_name, parent_pipe)


def all_tests() -> list[str]:
    """Every test of ``_DistTestBase``, sorted."""
    return sorted(n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test_"))


def set_timeout(seconds: float) -> None:
    """Bound every test (torch's join loop): ``seconds``, or torch's own longer override."""
    common_distributed.TIMEOUT_DEFAULT = seconds
    for name, value in list(common_distributed.TIMEOUT_OVERRIDE.items()):
        common_distributed.TIMEOUT_OVERRIDE[name] = max(value, seconds)
