"""Randomized mixing stress test: seeds x world sizes, every result checked (one job
runs every seed's program in turn)."""
import re

import pytest

from conftest import run_job

OPS = 600
SEEDS = (1, 2, 3, 4)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_random_mixed_programs(nprocs):
    out = run_job(nprocs, "stress_job.py", ",".join(map(str, SEEDS)), OPS, timeout=300)
    out.require(["stress finished"], range(nprocs))
    assert sorted(re.findall(r"STRESS OK seed=(\d+)", out)) == sorted(str(s) for s in SEEDS * nprocs), out[-3000:]
