"""CUDA paths; skipped on machines without at least two GPUs (NCCL needs one per rank)."""
import pytest
import torch

from conftest import run_job

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs >= 2 CUDA GPUs")


def test_nccl_and_order_against_cpu_backends():
    out = run_job(2, "cuda_job.py", timeout=300)
    assert out.count("CUDA OK") == 2
