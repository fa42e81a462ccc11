"""The compiled MPI hot path's build, its fallback, and the wait policy."""
import os
import subprocess
import sys

import pytest

STATUS = "from mcrdl.backends import native; print(native.status())"


def _status(tmp_path, **env):
    proc = subprocess.run([sys.executable, "-c", STATUS], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "MCRDL_CACHE": str(tmp_path), **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def test_hot_path_builds_into_an_empty_cache_and_is_reused(tmp_path):
    first = _status(tmp_path)
    assert first.startswith(f"compiled ({tmp_path}"), first
    built = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert len(built) == 1 and built[0].endswith(".so"), built  # no temporary file left
    module = first[len("compiled ("):-1]
    made = os.stat(module).st_mtime_ns
    assert _status(tmp_path) == first and os.stat(module).st_mtime_ns == made  # reused, not rebuilt


def test_without_a_compiler_the_pure_python_path_runs(tmp_path):
    status = _status(tmp_path, MPICC="/bin/false")
    assert status.startswith("build failed (") and status.endswith("pure-Python path"), status
    assert not any(files for _, _, files in os.walk(tmp_path))


@pytest.mark.parametrize("nprocs,policy,expected", [
    (2, "auto", "spin"),    # one rank per core (this machine has 2)
    (4, "auto", "yield"),   # oversubscribed
    (2, "yield", "yield"),
    (4, "spin", "spin"),
])
def test_wait_policy(nprocs, policy, expected):
    if len(os.sched_getaffinity(0)) != 2 and policy == "auto":
        pytest.skip("auto's choice is checked on a 2-core machine")
    proc = subprocess.run([sys.executable, "-m", "mcrdl.cli", "run", "-n", str(nprocs), "--timeout", "120",
                           sys.executable, "-m", "mcrdl.cli", "info"], capture_output=True, text=True,
                          timeout=180, env={**os.environ, "MCRDL_WAIT": policy})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"waits: {expected} (MCRDL_WAIT={policy})" in proc.stdout, proc.stdout


def test_unknown_wait_policy_is_refused():
    proc = subprocess.run([sys.executable, "-m", "mcrdl.cli", "info"], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "MCRDL_WAIT": "busy"})
    assert proc.returncode != 0
    assert "MCRDL_WAIT='busy': expected one of auto, spin, yield" in proc.stdout + proc.stderr
