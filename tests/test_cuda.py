"""CUDA paths: NCCL ops and program order against the CPU backends, with one
rank per GPU (NCCL refuses two ranks on one GPU); skipped without CUDA."""
import json
import subprocess
import sys

import pytest
import torch

from conftest import run_job

GPUS = torch.cuda.device_count()
pytestmark = pytest.mark.skipif(GPUS < 1, reason="needs a CUDA GPU")


@pytest.mark.parametrize("nprocs", [1, 2])
def test_nccl_and_order_against_cpu_backends(nprocs):
    if nprocs > GPUS:
        pytest.skip(f"needs {nprocs} CUDA GPUs (one per rank)")
    out = run_job(nprocs, "cuda_job.py", timeout=300)
    assert out.count("CUDA OK") == nprocs


@pytest.mark.parametrize("nprocs", [1, 2])
def test_host_staged_mpi_on_cuda_tensors(nprocs):
    """Ranks may share a GPU here: staging goes through host memory."""
    out = run_job(nprocs, "cuda_staged_job.py", timeout=300)
    assert out.count("CUDA mpi_staged OK") == nprocs


@pytest.mark.parametrize("nprocs", [1, 2])
def test_gloo_collectives_on_cuda_tensors(nprocs):
    """torch's gloo stages CUDA tensors itself; mcrdl orders the submitting
    stream after the results and refuses p2p, which gloo cannot do on CUDA."""
    out = run_job(nprocs, "cuda_staged_job.py", "gloo", timeout=300)
    assert out.count("CUDA gloo OK") == nprocs


@pytest.mark.parametrize("nprocs", [1, 2])
def test_cuda_aware_mpi_in_stream_order(nprocs):
    """The mpi backend on CUDA tensors when the MPI is CUDA-aware: started
    after an event on the caller's stream, never a stream synchronize."""
    out = run_job(nprocs, "cuda_staged_job.py", "mpi", timeout=300)
    if "SKIP" in out:
        pytest.skip("the MPI library is not CUDA-aware")
    assert out.count("CUDA mpi OK") == nprocs


@pytest.mark.parametrize("backend", ["mpi_staged", "gloo"])
def test_stream_order_check_fails_without_the_stream_waits(backend):
    """The ablation: with mcrdl's stream waits removed, the stream-order checks
    of cuda_staged_job see an op run before its producer, or its results read
    before they landed."""
    out = run_job(2, "cuda_staged_job.py", backend, "unordered", timeout=300)
    assert out.count("unordered: caught") == 2, out[-3000:]


@pytest.mark.parametrize("nprocs", [1, 2])
def test_ddp_on_cuda_tensors(nprocs):
    """DDP on CUDA through the "mcrdl" torch backend and through mcrdl's hooks
    trains the same parameters as DDP over gloo on the CPU."""
    out = run_job(nprocs, "cuda_ddp_job.py", timeout=300)
    assert out.count("CUDA DDP OK") == nprocs, out[-3000:]


def test_demo_on_cuda_tensors(tmp_path):
    """`mcrdl demo --device cuda` at 2 ranks: the workloads train on the GPU
    (shared when there is one: then without NCCL) in the CUDA baselines and the
    tuned mode, and every mode's losses agree."""
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "mcrdl.cli", "demo", "-n", "2", "--device", "cuda", "--workloads", "moe,ddp",
           "--steps", "2", "--warmup", "1", "--rounds", "1", "--out", str(out), "--timeout", "400"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=430, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["device"] == "cuda" and doc["agree"]
    modes = {r["mode"] for r in doc["rows"]}
    assert {"baseline-gloo", "baseline-mpi_staged", "tuned"} <= modes
    assert ("baseline-nccl" in modes) == (GPUS >= 2)


@pytest.mark.parametrize("nprocs", [1, 2])
def test_cuda_ops_in_the_profiler_and_the_flight_recorder(tmp_path, nprocs):
    out = run_job(nprocs, "cuda_observe_job.py", tmp_path, timeout=300,
                  env={"TORCH_FR_BUFFER_SIZE": "100", "TORCH_FR_DUMP_TEMP_FILE": str(tmp_path / "fr_rank_")})
    out.require(["one event per op and library", "tensor shapes and bytes", "every event finished",
                 "flight recorder entries", "entries completed"], range(nprocs))
