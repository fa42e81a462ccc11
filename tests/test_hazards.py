"""Design hazards through the public API (each test fails without its fix)."""
import re

import pytest

from conftest import run_job, run_job_rc


#: one job runs these in turn, each on a runtime of its own
TOGETHER = ["progress", "order", "straddle", "debug"]


@pytest.fixture(scope="module")
def together():
    return run_job_rc(2, "hazards_job.py", ",".join(TOGETHER), timeout=240)[0]


def test_cross_backend_progress_does_not_deadlock(together):
    # MPI irecv of 64 MB outstanding while blocking in gloo (barrier, all_reduce,
    # and reduce_scatter, whose is_completed() lies until wait()).
    together.part("progress").require(["progress finished"], range(2))
    times = [float(t) for t in re.findall(r"hazard-1 with gloo \w+: ([\d.]+) ms", together)]
    assert len(times) == 6, together
    assert max(times) < 1000, times


def test_program_order_across_backends(together):
    together.part("order").require(["order finished"], range(2))


def test_uneven_all_to_all_straddling_a_threshold_agrees(together):
    together.part("straddle").require(["straddle finished"], range(2))


def test_debug_mode_catches_mismatched_collectives(together):
    together.part("debug").require(["debug finished"], range(2))


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_waits_have_deadlines(launcher):
    out = run_job(2, "hazards_job.py", "timeout", timeout=120, launcher=launcher)
    assert "mpi timeout after" in out and "gloo timeout after" in out
    assert "mpi blocking recv deadline after" in out and "gloo blocking recv deadline after" in out, out[-3000:]
