"""The ccl backend: Intel oneCCL's C API as another library
(src/mcrdl/backends/ccl.py, binding ccl_lib.py). Jobs: tests/jobs/ccl_job.py.
The libraries come from scripts/install_oneccl.sh (make test runs it)."""
import os
import time

import pytest
import torch

from conftest import run_job, run_job_rc

import mcrdl
from mcrdl.backends import REGISTRY, ccl, ccl_lib
from mcrdl.backends.base import Context

installed = pytest.mark.skipif(ccl_lib.missing() is not None, reason=str(ccl_lib.missing()))


@installed
@pytest.mark.parametrize("nprocs,launcher", [(2, "mpiexec"), (4, "mpiexec"), (2, "torchrun")])
def test_what_ccl_serves_runs_there_and_the_rest_falls_through(nprocs, launcher):
    """Every declared op x dtype x reduction x size (4 B .. 4 MiB) x sync/async x
    group through a table that prefers ccl for every op runs on ccl (the
    world) or falls through (a new_group of every rank, [1, 3] at 4 ranks),
    equal to the local reference; int16, gather and send/recv fall through, also right; the
    library is not loaded before the first ccl op; a 64 MB MPI message
    outstanding across a ccl op does not deadlock; another library's op after
    an async ccl one waits for it."""
    out = run_job(nprocs, "ccl_job.py", timeout=600, launcher=launcher)
    out.require(["lazy finished", "matrix finished", "fall finished", "mixed finished"], range(nprocs))


@installed
def test_a_frozen_peer_ends_the_job_with_the_sentinels_message():
    """The library's wait cannot be withdrawn: past the group's timeout the
    sentinel ends the waiting rank with a message naming the op and backend."""
    began = time.monotonic()
    out, rc = run_job_rc(2, "ccl_job.py", "stop", timeout=120, env={"CCL_JOB_TIMEOUT": "3"})
    assert rc != 0
    assert "all_reduce #2 on backend 'ccl' (group [0, 1]) cannot complete: it ran past the group's timeout " \
           "of 3 s" in out, out[-3000:]
    assert time.monotonic() - began < 60


# -- in-process -------------------------------------------------------------------
def test_declares_exactly_what_the_library_does():
    backend = object.__new__(ccl.CclBackend)  # (no job: only the declarations)
    assert backend.ops == frozenset({"all_reduce", "broadcast", "reduce", "all_gather_into_tensor",
                                     "reduce_scatter_tensor", "scatter", "all_to_all_single", "barrier"})
    assert ccl.CclBackend.devices == frozenset({"cpu"})
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
                  torch.int32, torch.int64):
        for op in (mcrdl.ReduceOp.SUM, mcrdl.ReduceOp.PRODUCT, mcrdl.ReduceOp.MIN, mcrdl.ReduceOp.MAX):
            assert backend.unsupported("all_reduce", dtype, op, "cpu") is None
    assert "no torch.int16" in backend.unsupported("all_reduce", torch.int16, mcrdl.ReduceOp.SUM, "cpu")
    assert "no torch.int16" in backend.unsupported("broadcast", torch.int16, None, "cpu")
    assert backend.unsupported("broadcast", torch.bool, None, "cpu") is None  # (moves as uint8)
    assert "bool" in backend.unsupported("all_reduce", torch.bool, mcrdl.ReduceOp.MAX, "cpu")
    assert "AVG" in backend.unsupported("all_reduce", torch.float32, mcrdl.ReduceOp.AVG, "cpu")
    assert "the world group only" in backend.group_unsupported([1, 3], world=False)
    assert backend.group_unsupported([0, 1], world=True) is None


def test_never_the_fallback_while_mpi_or_gloo_is_live():
    names = list(REGISTRY)
    assert names.index("ccl") > names.index("mpi") and names.index("ccl") > names.index("gloo")


def test_not_live_without_its_files_and_says_why(monkeypatch, tmp_path):
    monkeypatch.setenv("MCRDL_CCL_LIB", str(tmp_path))
    reason = ccl.CclBackend.unavailable_reason(Context(0, 2, 10, store=object()))
    assert reason.startswith("oneCCL is not installed: libccl.so.1 (from the `oneccl-cpu` wheel), "
                             "libccl.so.2 (from the `oneccl` wheel), libccl_legacy_cpu.so"), reason
    assert "scripts/install_oneccl.sh" in reason
    assert ccl.CclBackend.info_lines(False) == [f"ccl: {reason}"]
    monkeypatch.delenv("MCRDL_CCL_LIB")
    monkeypatch.setenv("MCRDL_CCL_LIBFABRIC", str(tmp_path / "libfabric.so.1"))
    assert "libfabric.so.1" in ccl.CclBackend.unavailable_reason(Context(0, 2, 10, store=object()))


@installed
def test_needs_a_store_beyond_one_rank():
    assert "no store" in ccl.CclBackend.unavailable_reason(Context(0, 2, 10))
    assert ccl.CclBackend.unavailable_reason(Context(0, 1, 10)) is None


def test_the_installer_writes_inside_the_venv_only():
    text = open(os.path.join(os.path.dirname(__file__), "..", "scripts", "install_oneccl.sh")).read()
    assert "--no-deps" in text and 'TMP="$VENV/' in text and "PIP_NO_CACHE_DIR=1" in text
