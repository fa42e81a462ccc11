"""The shm backend: DeepSpeed's shared-memory all-reduce as a third library
(src/mcrdl/backends/shm.py). Jobs: tests/jobs/shm_job.py."""
import os
import re
import subprocess
import sys
import threading
import time

import pytest
import torch

from conftest import JOBS, run_job, run_job_rc

import mcrdl
from mcrdl.backends import shm
from mcrdl.backends.base import Context


def left_by(out: str) -> list:
    """The segments in /dev/shm of the job whose output is ``out`` (its names, printed by
    shm_job.py: DeepSpeed's prefix, mcrdl's job token and rank 0's pid)."""
    infix = re.search(r"^shm segments: (\S+)$", out, re.M)
    assert infix, out[-3000:]
    return [f for f in os.listdir("/dev/shm")
            if f.startswith(f"{shm.SEGMENT_PREFIX}_{os.getuid()}_") and infix.group(1) in f]


@pytest.mark.parametrize("nprocs,launcher,native", [(2, "mpiexec", "1"), (4, "mpiexec", "1"), (2, "torchrun", "1"),
                                                    (2, "mpiexec", "0")])
def test_what_shm_serves_runs_there_and_the_rest_falls_through(nprocs, launcher, native):
    """Every dtype x reduction x size x sync/async x group through a table that
    prefers shm: float32/bf16/fp16 sums (and AVG) on the world run on it, all
    else on the next library; every result equals the local reference; a
    64 MB MPI message outstanding across it does not deadlock (hazard 1); an
    MPI op after an async shm one waits for it (hazard 3); no segment is left;
    the kernels' OpenMP threads stay within the rank's share of the cores.
    Compiled, drive() starts the blocking plans' starter (shm_native.cpp) itself;
    MCRDL_NATIVE=0, Python calls it."""
    out = run_job(nprocs, "shm_job.py", timeout=600, launcher=launcher, env={"MCRDL_NATIVE": native})
    out.require(["matrix finished", "views finished", "narrow finished", "mixed finished",
                 "files finished", "threads finished"], range(nprocs))
    assert not left_by(out)


def test_two_jobs_on_one_master_port_are_both_correct():
    """DeepSpeed names its segments from MASTER_ADDR/MASTER_PORT, so two jobs on
    one port would sum each other's data; mcrdl's names carry a per-job token."""
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29517"}
    results = {}

    def job(salt):
        results[salt] = run_job_rc(2, "shm_job.py", "repeat", timeout=300, env={**env, "SHM_JOB_SALT": str(salt)})

    threads = [threading.Thread(target=job, args=(s,)) for s in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for salt, (out, rc) in results.items():
        assert rc == 0 and not out.failures(), f"job {salt}: rc {rc}\n{out[-3000:]}"
        out.require(["repeat finished"], range(2))


def test_a_frozen_peer_ends_the_job_and_leaves_no_segment():
    """The library's wait cannot be withdrawn: past the world's timeout the
    sentinel ends the waiting rank with a message naming the op and backend,
    and /dev/shm holds nothing of the job afterwards."""
    began = time.monotonic()
    out, rc = run_job_rc(2, "shm_job.py", "stop", timeout=120, env={"SHM_JOB_TIMEOUT": "3"})
    assert rc != 0
    assert "on backend 'shm' cannot complete: it ran past the world's timeout of 3 s" in out, out[-3000:]
    took = time.monotonic() - began
    assert took < 60, f"the job took {took:.0f} s: {out[-3000:]}"
    assert not left_by(out)


# -- in-process -------------------------------------------------------------------
def test_declares_exactly_what_the_library_does():
    backend = object.__new__(shm.ShmBackend)  # (no job: only the declarations)
    backend.level = 1  # an AVX2-only host
    assert backend.ops == frozenset({"all_reduce"})
    assert backend.unsupported("all_reduce", torch.float32, mcrdl.ReduceOp.SUM, "cpu") is None
    assert "AVX-512" in backend.unsupported("all_reduce", torch.bfloat16, mcrdl.ReduceOp.SUM, "cpu")
    assert "AVX-512" in backend.unsupported("all_reduce", torch.float16, None, "cpu")
    for dtype in (torch.float64, torch.int64, torch.int32, torch.bool):
        assert "only" in backend.unsupported("all_reduce", dtype, mcrdl.ReduceOp.SUM, "cpu")
    for op in (mcrdl.ReduceOp.MAX, mcrdl.ReduceOp.MIN, mcrdl.ReduceOp.PRODUCT):
        assert "only sums" in backend.unsupported("all_reduce", torch.float32, op, "cpu")
    backend.level = 2
    assert backend.unsupported("all_reduce", torch.bfloat16, mcrdl.ReduceOp.SUM, "cpu") is None
    assert "world group only" in backend.group_unsupported([0, 1], world=False)
    assert backend.group_unsupported([0, 1], world=True) is None
    assert shm.ShmBackend.devices == frozenset({"cpu"})


def test_thread_share_is_the_rank_s_part_of_the_cpus_it_may_run_on():
    two, four = frozenset({0, 1}), frozenset(range(4))
    assert shm.thread_share(two, [two, two]) == 1                    # unbound, 2 ranks on 2 cpus
    assert shm.thread_share(frozenset({0}), [{0}, {1}]) == 1         # bound, a core each
    assert shm.thread_share(four, [four, four]) == 2
    assert shm.thread_share(frozenset({0, 1}), [{0, 1}, {2, 3}]) == 2  # bound, 2 cores each
    assert shm.thread_share(two, [two, two, two, two]) == 1          # oversubscribed: still one


def test_not_live_without_deepspeed_or_with_one_rank(monkeypatch):
    assert "one rank" in shm.ShmBackend.unavailable_reason(Context(0, 1, 10))
    shm.load.cache_clear()
    real = shm.importlib.util.find_spec
    monkeypatch.setattr(shm.importlib.util, "find_spec", lambda name: None if name == "deepspeed" else real(name))
    try:
        reason = shm.ShmBackend.unavailable_reason(Context(0, 2, 10))
        assert "deepspeed is not installed" in reason, reason
    finally:
        shm.load.cache_clear()
