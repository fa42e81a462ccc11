"""Randomized mixing stress test: seeds x world sizes, every result checked."""
import re

import pytest

from conftest import run_job

OPS = 600


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_random_mixed_program(seed, nprocs):
    out = run_job(nprocs, "stress_job.py", seed, OPS, timeout=300)
    assert len(re.findall(r"STRESS OK", out)) == nprocs, out[-3000:]
