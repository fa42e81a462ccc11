"""The compiled MPI hot path's build, its fallback, and the wait policy."""
import os
import re
import subprocess
import sys

import pytest
import torch

from conftest import FORKED, cached_files, check_built_once_and_reused, compiled_status


def test_hot_path_builds_into_an_empty_cache_and_is_reused(tmp_path):
    check_built_once_and_reused("mcrdl.backends.native", tmp_path)


def test_without_a_compiler_the_pure_python_path_runs(tmp_path):
    status = compiled_status("mcrdl.backends.native", tmp_path, MPICC="/bin/false")
    assert status.startswith("build failed (") and status.endswith("pure-Python path"), status
    assert not cached_files(tmp_path)


@pytest.mark.parametrize("nprocs,policy,expected,bind", [
    (2, "auto", "spin", "none"),    # one rank per core (this machine has 2)
    (2, "auto", "spin", "core"),    # each rank bound to its own core (Open MPI's default): still one each
    (4, "auto", "yield", "none"),   # oversubscribed
    (2, "yield", "yield", "none"),
    (4, "spin", "spin", "none"),
])
def test_wait_policy(nprocs, policy, expected, bind):
    if len(os.sched_getaffinity(0)) != 2 and policy == "auto":
        pytest.skip("auto's choice is checked on a 2-core machine")
    proc = subprocess.run([sys.executable, "-m", "mcrdl.cli", "run", "-n", str(nprocs), "--timeout", "120",
                           "--bind", bind, FORKED, "-m", "mcrdl.cli", "info"], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "MCRDL_WAIT": policy})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    plain = re.sub(r"\x1b\[[0-9;]*m", "", proc.stdout)  # Open MPI's mpiexec gives ranks a terminal: rich colours
    assert f"waits: {expected} (MCRDL_WAIT={policy})" in plain, proc.stdout


@pytest.mark.parametrize("policy,sleeps", [("spin", False), ("yield", True)])
def test_long_waits_sleep_only_under_the_yield_policy(monkeypatch, policy, sleeps):
    """Under spin a wait never sleeps (Open MPI's nonblocking collectives move
    only inside MPI_Test: docs/results/openmpi.md). Oversubscribed, it sleeps."""
    import time

    from mcrdl import work

    slept, real_sleep = [], time.sleep
    monkeypatch.setattr(work.time, "sleep", lambda s: (slept.append(s), real_sleep(0))[1])
    previous = work.set_wait_policy(policy, 1)
    try:
        end = time.monotonic() + 0.15
        assert work.spin_until(lambda: time.monotonic() > end, time.monotonic() + 5)
    finally:
        work.set_wait_policy(previous, 1)
    assert bool(slept) == sleeps, f"{len(slept)} sleeps under {policy}"


def test_unknown_wait_policy_is_refused():
    proc = subprocess.run([sys.executable, "-m", "mcrdl.cli", "info"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "MCRDL_WAIT": "busy"})
    assert proc.returncode != 0
    assert "MCRDL_WAIT='busy': expected one of auto, spin, yield" in proc.stdout + proc.stderr


BAD_CALLS = """
import torch
from mpi4py import MPI
from mcrdl.backends import native
import time
from mcrdl.types import CommError
from mcrdl.work import DONE
mod = native.load()
t = torch.zeros(4)
def refused(call, error, words):
    try:
        call()
    except error as exc:
        assert all(w.lower() in str(exc).lower() for w in words), exc  # MPICH "Invalid rank", Open MPI "invalid rank"
    else:
        raise AssertionError(f"no {error.__name__}")
comm = MPI.COMM_SELF
Starter = mod.Starter
refused(lambda: Starter("all_reduce", comm, MPI.FLOAT, 2**31, 1.0, MPI.SUM), OverflowError,
        ["2147483648"])
a2a = Starter("all_to_all_single", comm, MPI.FLOAT, 4, 1.0)
refused(lambda: a2a(t, t, [1], [2**31]), OverflowError, ["C int"])
refused(lambda: a2a(t, t, [1], [-1]), ValueError, ["negative"])
refused(lambda: a2a(t, t, [1, 1], [2]), ValueError, ["expected 1 counts"])
refused(lambda: Starter("send", comm, MPI.FLOAT, 4, 1.0, root=7)(t), CommError,
        ["MPI_Isend on backend 'mpi' failed", "Invalid rank"])
refused(lambda: Starter("broadcast", comm, "float", 4, 1.0), TypeError, [])
refused(lambda: Starter("all_reduce", comm, MPI.FLOAT, 4, 1.0), TypeError, [])  # no reduction
refused(lambda: Starter("barrier", comm, MPI.FLOAT, 4, 1.0), ValueError, ["no compiled form", "barrier"])
refused(lambda: Starter("broadcast", comm, MPI.FLOAT, 4, 1.0)(t, t), TypeError,
        ["broadcast starter takes 1 arguments (2 given)"])
refused(lambda: Starter("broadcast", comm, MPI.FLOAT, 4, 1.0)(4), AttributeError, ["data_ptr"])
t += 1
assert Starter("all_reduce", comm, MPI.FLOAT, 4, 1.0, MPI.SUM)(t) is DONE and t.tolist() == [1] * 4
out = torch.zeros(4)
assert Starter("all_to_all_single", comm, MPI.FLOAT, 0, 1.0)(out, t, [4], [4]) is DONE  # uneven
assert out.tolist() == [1] * 4
# a start that only starts (timeout 0) returns its compiled request, keeping the tensors alive
pending = Starter("all_gather_into_tensor", comm, MPI.FLOAT, 4, 0.0)(out, t)
assert type(pending) is mod.Request and pending.keep == (out, t), pending.keep
assert pending.progress_domain == "mpi" and pending.stream is None and pending.resumable_block
while not pending.test():
    pass
assert pending.test() and pending.block(0.0)  # complete stays complete
# a receive nobody sends to: its deadline passes, then it is withdrawn
pending = Starter("recv", comm, MPI.FLOAT, 4, 0.0, root=0, tag=5)(out)
start = time.monotonic()
assert not pending.test() and not pending.block(start + 0.05) and time.monotonic() - start >= 0.05
pending.cancel()
assert pending.block(time.monotonic() + 5), "a cancelled receive completes"
# an uneven all-to-all that only starts keeps its counts until it completes
pending = Starter("all_to_all_single", comm, MPI.FLOAT, 0, 0.0)(out, t, [4], [4])
assert type(pending) is mod.Request and pending.block(time.monotonic() + 5)
print("BAD CALLS OK")
"""


def test_compiled_calls_refuse_what_mpi_cannot_count_and_raise_mpi_errors_as_comm_errors():
    proc = subprocess.run([sys.executable, "-c", BAD_CALLS], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "BAD CALLS OK" in proc.stdout, proc.stdout + proc.stderr


def test_reduce_scatter_rows_rule_and_local_reduction(monkeypatch):
    """Which calls reduce by rows (MPICH's rule, the override, bad values named),
    and the local reduction: 16-bit floats accumulate in float32 and round once."""
    from mcrdl.backends.mpi import INT_MAX, MPICH_ROWS, NO_ROWS, reduce_rows, rows_rule
    from mcrdl.types import ReduceOp

    monkeypatch.delenv("MCRDL_MPI_RS_ALLTOALL", raising=False)
    assert rows_rule("MPICH Version:      5.0.2") == MPICH_ROWS
    assert rows_rule("Open MPI v5.0.5") == NO_ROWS
    for spec, rule in (("off", NO_ROWS), ("0:1024", (0, 1024, INT_MAX))):
        monkeypatch.setenv("MCRDL_MPI_RS_ALLTOALL", spec)
        assert rows_rule("MPICH") == rule
    monkeypatch.setenv("MCRDL_MPI_RS_ALLTOALL", "64K")
    with pytest.raises(ValueError, match="MCRDL_MPI_RS_ALLTOALL='64K': expected LO:HI in bytes"):
        rows_rule("MPICH")

    rows = torch.tensor([[256.0, 3.0], [1.0, -4.0], [1.0, 2.0]], dtype=torch.bfloat16)
    out = torch.empty(2, dtype=torch.bfloat16)
    reduce_rows(rows, out, ReduceOp.SUM)  # bf16 one by one: 256 + 1 = 256, + 1 = 256
    assert out.tolist() == [258.0, 1.0]
    ints = torch.tensor([[2, -3], [5, 7]], dtype=torch.int32)
    for op, expected in ((ReduceOp.PRODUCT, [10, -21]), (ReduceOp.MIN, [2, -3]), (ReduceOp.MAX, [5, 7])):
        got = torch.empty(2, dtype=torch.int32)
        reduce_rows(ints, got, op)
        assert got.tolist() == expected and got.dtype is torch.int32
