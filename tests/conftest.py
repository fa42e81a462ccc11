"""Helpers: launch real multi-rank jobs through `mcrdl run` (MPICH's mpiexec)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOBS = Path(__file__).parent / "jobs"


def run_job(nprocs, script, *args, timeout=300, env=None, expect_rc=0):
    """Run tests/jobs/<script> on ``nprocs`` ranks; return combined output."""
    out, rc = run_job_rc(nprocs, script, *args, timeout=timeout, env=env)
    if expect_rc is not None and rc != expect_rc:
        pytest.fail(f"{script} on {nprocs} ranks exited {rc}:\n{out[-6000:]}")
    return out


def run_job_rc(nprocs, script, *args, timeout=300, env=None, launcher="mpiexec"):
    """:func:`run_job`'s output and the job's exit status (``launcher``: mcrdl run's)."""
    cmd = [sys.executable, "-m", "mcrdl.cli", "run", "-n", str(nprocs), "--launcher", launcher,
           "--timeout", str(timeout), str(JOBS / script), *map(str, args)]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout + 30)
    return proc.stdout + proc.stderr, proc.returncode


def compiled_status(module, cache, **env):
    """``module.status()`` of a compiled helper (mcrdl.facts, mcrdl.backends.native),
    in a fresh process building into ``cache``."""
    proc = subprocess.run([sys.executable, "-c", f"from {module} import status; print(status())"],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "MCRDL_CACHE": str(cache), **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def cached_files(cache):
    """The files a build left in ``cache`` (its lock file aside)."""
    return [f for _, _, files in os.walk(cache) for f in files if f != ".lock"]


def check_built_once_and_reused(module, cache):
    """An empty ``cache`` gets one module and no temporary file; a second
    process loads it without building again."""
    first = compiled_status(module, cache)
    assert first.startswith(f"compiled ({cache}"), first
    built = cached_files(cache)
    assert len(built) == 1 and built[0].endswith(".so"), built
    path = first[len("compiled ("):-1]
    made = os.stat(path).st_mtime_ns
    assert compiled_status(module, cache) == first and os.stat(path).st_mtime_ns == made
