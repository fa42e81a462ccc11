"""Regressions found in the core review; each case failed before its fix."""
import pytest

from conftest import run_job

CASES = ["staging", "aliased", "future", "callbacks", "polling", "parameters", "barrier", "destroy"]


@pytest.mark.parametrize("case", CASES)
def test_review_regression(case):
    out = run_job(2, "regressions_job.py", case, timeout=120)
    assert out.count(f"{case} OK") == 2, out[-3000:]
