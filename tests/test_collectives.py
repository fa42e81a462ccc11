"""Every op on every live CPU backend, in real 2- and 4-rank jobs."""
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FORKED, run_job, run_job_rc


@pytest.mark.parametrize("nprocs", [2, 4])
def test_all_ops_all_backends(nprocs):
    out = run_job(nprocs, "ops_job.py", timeout=600)
    out.require(["ops finished"], range(nprocs))
    # the mpich wheel brings mpicc: the compiled hot path must be what ran
    assert out.count("MPI hot path compiled") == nprocs, out[-3000:]


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_a_broken_op_fails_naming_its_check_and_rank(launcher):
    """The harness itself: rank 1's all_reduce made wrong, the test's failure names the
    check (backend, group, dtype, size), the rank and the job's line; the job ends at
    once (rank 1's exception is a death to rank 0, not a goodbye), not at the timeout."""
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as failure:
        run_job(2, "ops_job.py", "mpi", timeout=120, env={"OPS_JOB_BREAK": "all_reduce@1"}, launcher=launcher)
    assert time.monotonic() - start < 60, "the job waited for its timeout"
    lines = str(failure.value).splitlines()
    assert lines[0] == "ops_job.py on 2 ranks exited 1", lines[:3]
    broken = [line for line in lines if line.startswith(
        "check '[mpi group=[0, 1] torch.float16 numel=1 async=False]' failed on rank 1 at ops_job.py:")]
    assert broken and "expected true, got all_reduce sum tensor([" in broken[0], lines[:3]
    # rank 0 ends by the launcher's hand (MPI_Abort, torchrun's agent) or, when it hears
    # of rank 1's death first, on an error that names it: never on a check of its own
    others = [line for line in lines[1:lines.index("--- job output (tail) ---")] if line != broken[0]]
    assert all(line.startswith("check 'uncaught' failed on rank 0") and "rank 1 died" in line
               for line in others), others


@pytest.mark.parametrize("nprocs", [2, 4])
def test_all_ops_on_the_pure_python_build(nprocs):
    """The build without the compiled module (no compiler, MCRDL_NATIVE=0: every call on
    the general path, no plan kept) gives the same results, world and sub-groups."""
    out = run_job(nprocs, "ops_job.py", "mpi", timeout=600, env={"MCRDL_NATIVE": "0"})
    out.require(["ops finished"], range(nprocs))
    assert out.count("MPI hot path off (MCRDL_NATIVE=0)") == nprocs, out[-3000:]


@pytest.mark.parametrize("nprocs,env", [(2, {}), (4, {}), (2, {"MCRDL_NATIVE": "0"})])
def test_reduce_scatter_by_rows_at_every_size(nprocs, env):
    """reduce_scatter_tensor as an all-to-all and a local reduction (on MPICH
    for a band of sizes at 2 ranks; forced here for every size and group): every dtype, op, group
    and sync/async call, on the compiled and on the pure-Python path."""
    out = run_job(nprocs, "ops_job.py", "mpi", timeout=600, env={"MCRDL_MPI_RS_ALLTOALL": "0:1073741824", **env})
    out.require(["ops finished"], range(nprocs))
    assert out.count("by rows for outputs of 0-1073741824 bytes, groups of <= 2147483647") == nprocs, out[-3000:]
    assert out.count("MPI hot path compiled" if not env else "MPI hot path off") == nprocs, out[-3000:]


def test_hello_example():
    hello = Path(__file__).parents[1] / "examples" / "hello.py"
    proc = subprocess.run([sys.executable, "-m", "mcrdl.cli", "run", "-n", "2", "--timeout", "120", FORKED,
                           str(hello)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ran = re.findall(r"rank [01]/2 (\w+)\s+all_reduce on cpu -> \[3.0, 3.0, 3.0, 3.0\]", proc.stdout)
    assert {"mpi", "gloo"} <= set(ran) and len(ran) == 2 * len(set(ran)), proc.stdout  # 2 ranks x each live one


def test_backend_added_by_one_module():
    out = run_job(2, "extra_backend_job.py", timeout=300)
    assert out.count("gloo2 selected by table and static map") == 2
    assert out.count("OK") >= 2 and "['gloo2']" in out


@pytest.mark.parametrize("nprocs", [2, 4])
def test_host_staging_on_cpu(nprocs):
    """mpi_staged's copies in and back, its start queue, program order against
    mpi and gloo, any-source receives, a receive's deadline, then every op
    (CPU tensors stand for the device: the CUDA copies and events need a GPU)."""
    out = run_job(nprocs, "staged_job.py", timeout=600)
    out.require(["staging checks finished", "ops finished"], range(nprocs))
    assert out.count("['mpi_staged_cpu']") == nprocs, out[-3000:]


@pytest.mark.parametrize("nprocs", [2, 4])
def test_stream_ordered_starts_on_cpu(nprocs):
    """The mpi backend's deferred starts (its path for CUDA tensors on a
    CUDA-aware MPI): late device ops, host ops queued behind them, send order,
    then every op (float64 stands for CUDA tensors: the events need a GPU)."""
    out = run_job(nprocs, "ordered_job.py", timeout=600)
    out.require(["ordering checks finished", "ops finished"], range(nprocs))
    assert out.count("['mpi_ordered_cpu']") == nprocs, out[-3000:]


def test_mpi_declared_cuda_aware_still_runs_cpu_tensors():
    """``MCRDL_MPI_CUDA_AWARE=1``: the mpi backend orders its ops after streams
    (wrapped ops, queue-checking fast paths); every CPU op still runs right."""
    out = run_job(2, "ops_job.py", "mpi", timeout=600, env={"MCRDL_MPI_CUDA_AWARE": "1"})
    out.require(["ops finished"], range(2))
    assert out.count("checks on ['mpi']") == 2, out[-3000:]


def test_late_collective_is_not_withdrawn(tmp_path):
    """A collective still waiting for its device work on one rank at its
    deadline starts in its turn; the next collective pairs with the right call
    (the job aborts at exit, as after any failed collective). The ranks' verdicts
    come in files: at MPI_Abort Hydra can drop forwarded output, a rank's last
    lines or everything."""
    out, rc = run_job_rc(2, "ordered_job.py", "late", tmp_path, timeout=120)
    verdicts = {f.name: f.read_text() for f in tmp_path.iterdir()}
    assert verdicts == {f"rank{r}": "late collective OK\n" for r in range(2)}, (verdicts, out[-3000:])
    assert rc not in (0, 124), (rc, out[-3000:])  # aborted, not hung in MPI_Finalize (the launcher's kill: 124)


def test_backend_live_on_some_ranks_is_left_out_everywhere():
    out = run_job(2, "live_agreement_job.py", timeout=120)
    assert out.count("backends agreed") == 2, out[-3000:]
    # a backend whose start raises on one rank: every rank's init fails, none waits
    out = run_job(2, "live_agreement_job.py", "fail", timeout=120)
    assert "init failed: OSError: device lost" in out, out[-3000:]
    assert "init failed: RuntimeError: mcrdl: a backend failed to start on rank 1: OSError: device lost" in out, \
        out[-3000:]


@pytest.mark.parametrize("nprocs,args,env,launcher", [
    (2, (), {"MCRDL_WAIT": "spin"}, "mpiexec"), (4, ("--sizes", "0,1,7,16384,262144"), {}, "mpiexec"),
    (2, (), {"MCRDL_NATIVE": "0", "MCRDL_WAIT": "spin"}, "mpiexec"), (2, ("--sizes", "0,1,7,16384"), {}, "torchrun")],
    ids=["2-ranks-to-4MiB", "4-ranks-to-1MiB", "2-ranks-pure-python", "torchrun-2-ranks-to-64KiB"])
def test_every_op_through_every_driver_again_and_again(nprocs, args, env, launcher):
    """Each op, called three times with fresh inputs through the API's driver
    (compiled: the calls after the first run from the plan, the MPI starters
    called from C), the Python driver and the general path, x dtypes x sizes x
    blocking/async on MPI and gloo: every result equals its local reference, so a
    plan never serves a stale or misplaced buffer (#39); under mcrdl run's mpiexec and
    under torchrun (MPI started over torch's store) alike. The 2-rank mpiexec cases
    wait by spinning, the default where each rank has a core (conftest makes waits
    yield under pytest-xdist)."""
    out = run_job(nprocs, "paths_job.py", *args, timeout=300, env=env, launcher=launcher)
    out.require(["paths done"], range(nprocs))
