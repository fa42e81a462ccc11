"""Real frameworks, unchanged but for the backend word, on "mcrdl" and on gloo.

Each example in examples/frameworks/ runs under `mcrdl run` once with
``--backend gloo`` and once with ``--backend mcrdl``: at 2 ranks the per-step
losses must be bitwise identical; at 4 ranks they must agree to float32
rounding (a sum over 4 ranks may be added in another order by MPI than by gloo).
Some run under other launchers too (torchrun, DeepSpeed's, Lightning's), where
mcrdl starts MPI over the launcher's store: its communication log must show ops on
MPI, and the losses must still equal gloo's.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from conftest import FORKED

EXAMPLES = Path(__file__).parents[1] / "examples" / "frameworks"
# a test runs two jobs (each bounded by mcrdl run's --timeout); the first DeepSpeed one
# also builds DeepSpeed's shm op in its fixture when `make test` did not
pytestmark = pytest.mark.timeout(1800)
ENV = {"PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "DS_ACCELERATOR": "cpu"}
#: a gloo reference job's time limit (s): the slowest took about 40 s here under load
REFERENCE_TIMEOUT = 180


@pytest.fixture(scope="session")
def deepspeed(tmp_path_factory):
    """DeepSpeed importable, with its CPU shm op in this session's own
    TORCH_EXTENSIONS_DIR: every DeepSpeed process takes a lock file in that directory
    even when the op is built, and one killed there (a timed-out job, a cancelled run)
    leaves the lock behind, on which every later process in ~/.cache waits forever.
    The op `make test` built (the Makefile's DS_OP) is copied in, times kept, so
    ninja finds it up to date; without it the op is built here."""
    extensions = tmp_path_factory.mktemp("torch_extensions")
    built = Path(sys.prefix) / "torch_extensions" / "deepspeed_shm_comm"
    if built.is_dir():
        # (copy2 keeps modification times; a lock left by a killed build stays behind)
        shutil.copytree(built, extensions / built.name, ignore=shutil.ignore_patterns("lock"))
    ENV["TORCH_EXTENSIONS_DIR"] = str(extensions)
    env = {**os.environ, **ENV}
    proc = subprocess.run([sys.executable, "-c", "import deepspeed"], capture_output=True,
                          text=True, env=env, timeout=300)
    if proc.returncode != 0:
        why = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        pytest.skip(f"deepspeed is not importable ({why}); pip install deepspeed to run this test")
    build = "from deepspeed.comm.torch import build_shm_op; assert build_shm_op() is not None"
    proc = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, f"DeepSpeed's shm op did not build:\n{(proc.stdout + proc.stderr)[-4000:]}"


def launch_command(launcher, nprocs, script, args, timeout):
    """The command line starting ``script`` on ``nprocs`` local ranks with ``launcher``:
    mpiexec, torchrun or srun (through `mcrdl run`, the ranks forked: conftest's
    ``FORKED``), DeepSpeed's own launcher, or Lightning's (the script run as is: the
    Trainer starts the other ranks)."""
    path = str(EXAMPLES / script)
    if launcher in ("mpiexec", "torchrun", "srun"):
        return [sys.executable, "-m", "mcrdl.cli", "run", "--launcher", launcher, "-n", str(nprocs),
                "--timeout", str(timeout), FORKED, path, *args]
    if launcher == "deepspeed":
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(nprocs), path, *args]
    if launcher == "lightning":
        return [sys.executable, path, *args, "--devices", str(nprocs)]
    raise ValueError(launcher)


def run(cmd, env, timeout):
    """``cmd``'s exit status and output; on a timeout its whole process group is killed
    (a launcher's ranks with it)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n(killed after {timeout} s)"
    return proc.returncode, out, err


@pytest.fixture(scope="session")
def lightning():
    """Lightning importable (skips, saying how to get it, where it is not)."""
    proc = subprocess.run([sys.executable, "-c", "import lightning"], capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        pytest.skip("lightning is not importable; pip install lightning to run this test")


def run_example(nprocs, script, backend, *args, launcher="mpiexec", timeout=480, env=None):
    """Run examples/frameworks/<script> on ``nprocs`` ranks; return rank 0's RESULT and the
    job's output.

    A gloo reference run that aborts at exit after its RESULT ("terminate called
    without an active exception": torch's gloo worker thread drops the last
    reference to an all_reduce that was still running when the interpreter
    began finalizing, benchmarks/faults/gloo_exit_abort.py) is run once more; one
    that hangs on its way out after its RESULT (seen in tests/test_launchers.py's
    gloo reference) is ended after ``REFERENCE_TIMEOUT`` and its RESULT kept; any
    other failure, and any on mcrdl, fails."""
    if backend == "gloo":
        timeout = min(timeout, REFERENCE_TIMEOUT)
    cmd = launch_command(launcher, nprocs, script, [*args, "--backend", backend], timeout)
    what = " ".join([script, *args, "--backend", backend, "under", launcher])
    for attempt in (1, 2):
        rc, stdout, stderr = run(cmd, {**os.environ, **ENV, **(env or {})}, timeout + 30)
        out = stdout + stderr
        results = [line[len("RESULT "):] for line in stdout.splitlines() if line.startswith("RESULT ")]
        exit_abort = (backend == "gloo" and len(results) == 1
                      and "terminate called without an active exception" in out)
        if backend == "gloo" and len(results) == 1 and rc == 124:  # mcrdl run's timeout
            warnings.warn(f"{what} on {nprocs} ranks hung on its way out after its RESULT (torch's "
                          f"gloo); its RESULT stands:\n{out[-2000:]}")
            rc = 0
        if rc == 0 or not exit_abort or attempt == 2:
            break
        warnings.warn(f"{what} on {nprocs} ranks aborted at exit after its RESULT (torch's gloo "
                      f"exit race); run again")
    if rc != 0 or len(results) != 1:
        pytest.fail(f"{what} on {nprocs} ranks exited {rc} with {len(results)} RESULT lines:\n{out[-6000:]}")
    result = json.loads(results[0])
    assert (result["backend"], result["world"]) == (backend, nprocs)
    return result, out


_GLOO = {}


def gloo_losses(nprocs, script, *args):
    """gloo's losses under mpiexec, run once per session for each case: with one
    compute thread per rank (OMP_NUM_THREADS=1, set for every test job in conftest)
    every launcher gives the same floats, so one reference serves them all."""
    key = (nprocs, script, *args)
    if key not in _GLOO:
        _GLOO[key] = run_example(nprocs, script, "gloo", *args)[0]["losses"]
    return _GLOO[key]


def gloo_and_mcrdl(nprocs, script, *args, launcher="mpiexec"):
    """gloo's losses (under mpiexec) and mcrdl's under ``launcher``. On mcrdl the
    communication log is on: every launcher must leave MPI live, and the log's
    summary (rank 0) must show ops that MPI ran."""
    gloo = gloo_losses(nprocs, script, *args)
    result, out = run_example(nprocs, script, "mcrdl", *args, launcher=launcher,
                              env={"MCRDL_COMMS_LOG": "1"})
    assert "MPI is not live" not in out and re.search(r"\b\w+/mpi\b", out), \
        f"no op ran on MPI under {launcher}:\n{out[-4000:]}"
    assert len(gloo) == len(result["losses"]) > 0
    return gloo, result["losses"]


CASES = [
    pytest.param("deepspeed_moe.py", ["--k", "1"], id="deepspeed_moe_top1"),
    pytest.param("deepspeed_moe.py", ["--k", "2"], id="deepspeed_moe_top2"),
    pytest.param("deepspeed_zero.py", ["--stage", "1"], id="deepspeed_zero1"),
    pytest.param("deepspeed_zero.py", ["--stage", "2"], id="deepspeed_zero2"),
    pytest.param("deepspeed_zero.py", ["--stage", "3"], id="deepspeed_zero3"),
    pytest.param("fsdp2.py", [], id="fsdp2"),
    pytest.param("dtensor_mesh.py", ["--mode", "tp"], id="dtensor_mesh_tp"),
    pytest.param("dtensor_mesh.py", ["--mode", "hsdp"], id="dtensor_mesh_hsdp"),
    pytest.param("lightning_ddp.py", [], id="lightning_ddp"),
]


def needs(request, script):
    """The framework's fixture (skips where it does not import)."""
    for prefix in ("deepspeed", "lightning"):
        if script.startswith(prefix):
            request.getfixturevalue(prefix)


@pytest.mark.parametrize("script,args", CASES)
def test_two_ranks_losses_identical_to_gloo(request, script, args):
    needs(request, script)
    gloo, mcrdl = gloo_and_mcrdl(2, script, *args)
    assert mcrdl == gloo  # bitwise: the same floats, step by step


@pytest.mark.parametrize("script,args", [
    pytest.param("deepspeed_moe.py", ["--k", "2"], id="deepspeed_moe_top2"),
    pytest.param("deepspeed_zero.py", ["--stage", "3"], id="deepspeed_zero3"),
    pytest.param("dtensor_mesh.py", ["--mode", "tp"], id="dtensor_mesh_tp"),
])
def test_four_ranks_losses_match_gloo(request, script, args):
    needs(request, script)
    gloo, mcrdl = gloo_and_mcrdl(4, script, *args)
    assert mcrdl == pytest.approx(gloo, rel=1e-5, abs=0)


@pytest.mark.parametrize("script,args,launcher", [
    pytest.param("deepspeed_moe.py", ["--k", "2"], "torchrun", id="deepspeed_moe_top2-torchrun"),
    pytest.param("deepspeed_zero.py", ["--stage", "3"], "torchrun", id="deepspeed_zero3-torchrun"),
    # DTensor's distribute_tensor scatters 2-D blocks: gloo refused them until torch_pg.scatter
    # shaped its blocks like the output (tests/jobs/regressions_job.py multidim_blocks)
    pytest.param("dtensor_mesh.py", ["--mode", "tp"], "torchrun", id="dtensor_mesh_tp-torchrun"),
    pytest.param("lightning_ddp.py", [], "torchrun", id="lightning_ddp-torchrun"),
    pytest.param("deepspeed_zero.py", ["--stage", "3"], "deepspeed", id="deepspeed_zero3-deepspeed"),
])
def test_other_launchers_run_mpi_and_match_gloo(request, script, args, launcher):
    """torchrun's and DeepSpeed's launchers start ranks with no MPI: mcrdl starts MPI
    over their store, and the losses are gloo's, bitwise."""
    needs(request, script)
    gloo, mcrdl = gloo_and_mcrdl(2, script, *args, launcher=launcher)
    assert mcrdl == gloo


def test_lightning_launcher_falls_back_loudly(request):
    """Lightning's own launcher (the script run as is, devices=2) probes for an MPI launcher
    by starting MPI (mpi4py's import, a singleton of one process) before torch's
    rendezvous: MPI cannot join those processes any more. mcrdl says so at init, with
    what to do, and trains on gloo with gloo's losses."""
    needs(request, "lightning")
    gloo = gloo_losses(2, "lightning_ddp.py")
    result, out = run_example(2, "lightning_ddp.py", "mcrdl", launcher="lightning")
    assert "mcrdl: MPI is not live" in out and "LightningEnvironment()" in out, out[-3000:]
    assert out.count("mcrdl: MPI is not live") == 1  # said once, by rank 0
    assert result["losses"] == gloo


@pytest.mark.alone  # the survivor must name the lost rank within a bound
@pytest.mark.parametrize("example,launcher,fault,frozen_s", [
    pytest.param("fsdp2", "mpiexec", "freeze", "3", id="fsdp2-mpiexec-freeze"),
    pytest.param("deepspeed_zero3", "torchrun", "kill", "15", id="deepspeed_zero3-torchrun-kill"),
])
def test_a_rank_lost_mid_training_ends_the_job(request, example, launcher, fault, frozen_s):
    """benchmarks/faults/faults_frameworks.py's case, 2 ranks: rank 1 of a training job
    SIGKILLed or SIGSTOPped 6 s after init. A survivor names it (frozen: from
    liveness, MCRDL_FROZEN_S=3 here, not the group timeout), the job ends
    non-zero and no process of it is left. (Every case, 2 and 4 ranks, both
    launchers: docs/results/faults_frameworks.md.)"""
    needs(request, example)
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks" / "faults"))
    from faults_frameworks import case
    row = case(example, launcher, fault, 2, delay=6, limit=240,
               env={**os.environ, **ENV, "MCRDL_FROZEN_S": frozen_s})
    out = row["output_tail"]
    assert row["exit"] != 0 and row["named_s"] is not None and row["left"] == 0, (row, out)
    assert row["named_s"] <= (1.0 if fault == "kill" else 3.0 + 1.5), row
