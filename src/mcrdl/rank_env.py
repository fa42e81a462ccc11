"""torchrun's per-rank environment for ranks that an MPI launcher or srun started.

DeepSpeed asserts ``LOCAL_RANK``; torch's ``env://`` rendezvous, Lightning and
HF Accelerate read ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``... `mcrdl run`
starts every rank as ``python -m mcrdl.rank_env PROGRAM ARGS...``: this module
reads the rank from the launcher's own variables, sets what torchrun would
set, and replaces itself with ``PROGRAM`` (``exec``), so the program starts
with them, consistent with MPI's ranks. ``MASTER_ADDR``/``MASTER_PORT`` come
from `mcrdl run` (the same on every rank), or from the environment.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Mapping, Optional

#: Per launcher: the variables holding rank, world size, local rank, local size.
LAUNCHER_VARS = (
    ("MPICH Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
     "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None),
)


def mpi_launched() -> bool:
    """True when an MPI launcher (Hydra, Open MPI, PMIx, Slurm+PMI) started us."""
    return any(k in os.environ for k in ("PMI_RANK", "PMI_SIZE", "PMIX_RANK",
                                         "OMPI_COMM_WORLD_SIZE", "MPI_LOCALRANKID"))


def in_job() -> bool:
    """True in a rank of a job: an MPI launcher's, or torchrun-style ``RANK``/``WORLD_SIZE``."""
    return mpi_launched() or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _slurm_local_size(env: Mapping[str, str]) -> Optional[int]:
    """Tasks on this node from ``SLURM_TASKS_PER_NODE`` (e.g. ``2(x3),1``) and ``SLURM_NODEID``."""
    per_node = []
    for part in env.get("SLURM_STEP_TASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", "")).split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            return None
        per_node += [int(m.group(1))] * int(m.group(2) or 1)
    node = int(env.get("SLURM_NODEID", "0"))
    return per_node[node] if node < len(per_node) else None


def _slurm_master(env: Mapping[str, str]) -> dict:
    """First node of the step and a port derived from the job id (every rank computes the same)."""
    found = {}
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    if nodes and "MASTER_ADDR" not in env:
        try:
            out = subprocess.run(["scontrol", "show", "hostnames", nodes], capture_output=True,
                                 text=True, timeout=30, check=True).stdout.split()
            found["MASTER_ADDR"] = out[0]
        except (OSError, subprocess.SubprocessError, IndexError):
            pass
    if "MASTER_PORT" not in env and env.get("SLURM_JOB_ID", "").isdigit():
        found["MASTER_PORT"] = str(20000 + int(env["SLURM_JOB_ID"]) % 20000)
    return found


def srun_without_pmi(env: Mapping[str, str]) -> bool:
    """srun started this task, one of several, and gave it no PMI (``--mpi=none``)."""
    return ("SLURM_STEP_ID" in env and "RANK" not in env and int(env.get("SLURM_NTASKS", "1")) > 1
            and not any(k in env for k in ("PMI_RANK", "PMI_FD", "PMIX_RANK")))


def torchrun_env(env: Mapping[str, str]) -> dict:
    """The variables torchrun would set for this rank, from the launcher's variables in ``env``.

    Raises RuntimeError when no known launcher started this process."""
    order = LAUNCHER_VARS
    if "SLURM_STEP_ID" in env and env.get("PMI_SIZE", env.get("SLURM_NTASKS")) == env.get("SLURM_NTASKS"):
        # srun started us (its PMI plugin sets PMI_RANK too): Slurm also knows the first node.
        # A batch script has no SLURM_STEP_ID; an mpiexec inside a one-task step has other sizes.
        order = sorted(LAUNCHER_VARS, key=lambda launcher: launcher[0] != "Slurm")
    for name, rank, size, local_rank, local_size in order:
        if rank in env and size in env:
            out = {"RANK": env[rank], "WORLD_SIZE": env[size],
                   "LOCAL_RANK": env.get(local_rank, "0")}
            if name == "Slurm":
                out["LOCAL_WORLD_SIZE"] = str(_slurm_local_size(env) or 1)
                out["GROUP_RANK"] = env.get("SLURM_NODEID", "0")
                out.update(_slurm_master(env))
            else:
                out["LOCAL_WORLD_SIZE"] = env.get(local_size, "1")
            out["ROLE_RANK"], out["ROLE_WORLD_SIZE"] = out["RANK"], out["WORLD_SIZE"]
            return out
    raise RuntimeError("mcrdl.rank_env: no launcher variables found (PMI_RANK, "
                       "OMPI_COMM_WORLD_RANK or SLURM_PROCID): start it with mpiexec or srun")


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        sys.exit("usage: python -m mcrdl.rank_env PROGRAM [ARGS...]")
    env = dict(os.environ)
    env.update(torchrun_env(env))
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        sys.exit("mcrdl.rank_env: MASTER_ADDR and MASTER_PORT are not set (`mcrdl run` sets them)")
    os.execvpe(argv[0], argv, env)


if __name__ == "__main__":
    main()
