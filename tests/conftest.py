"""Helpers: launch real multi-rank jobs through `mcrdl run` (MPICH's mpiexec)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).parent / "jobs"


def run_job(nprocs, script, *args, timeout=300, env=None, expect_rc=0):
    """Run tests/jobs/<script> on ``nprocs`` ranks; return combined output."""
    cmd = [sys.executable, "-m", "mcrdl.cli", "run", "-n", str(nprocs), "--timeout", str(timeout),
           str(JOBS / script), *map(str, args)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout + 30)
    out = proc.stdout + proc.stderr
    if expect_rc is not None and proc.returncode != expect_rc:
        pytest.fail(f"{script} on {nprocs} ranks exited {proc.returncode}:\n{out[-6000:]}")
    return out
