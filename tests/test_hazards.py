"""Design hazards through the public API (each test fails without its fix)."""
import re

import pytest

from conftest import run_job


def test_cross_backend_progress_does_not_deadlock():
    # MPI irecv of 64 MB outstanding while blocking in gloo (barrier, all_reduce,
    # and reduce_scatter, whose is_completed() lies until wait()).
    out = run_job(2, "hazards_job.py", "progress", timeout=120)
    times = [float(t) for t in re.findall(r"hazard-1 with gloo \w+: ([\d.]+) ms", out)]
    assert len(times) == 6, out
    assert max(times) < 1000, times


def test_program_order_across_backends():
    run_job(2, "hazards_job.py", "order", timeout=120)


def test_uneven_all_to_all_straddling_a_threshold_agrees():
    run_job(2, "hazards_job.py", "straddle", timeout=120)


def test_debug_mode_catches_mismatched_collectives():
    out = run_job(2, "hazards_job.py", "debug", timeout=120)
    out.require(["debug finished"], range(2))


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_waits_have_deadlines(launcher):
    out = run_job(2, "hazards_job.py", "timeout", timeout=120, launcher=launcher)
    assert "mpi timeout after" in out and "gloo timeout after" in out
    assert "mpi blocking recv deadline after" in out and "gloo blocking recv deadline after" in out, out[-3000:]
