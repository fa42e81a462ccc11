"""Start N ranks through an existing launcher (no launcher of our own).

``mpiexec`` (default) is the one installed beside this Python by the ``mpich``
wheel, or the one on PATH, or one given by path; multi-host runs use its
``-hosts``/``-f`` options. ``srun`` and ``torchrun`` are forwarded to as is.

Binding (``bind``): ``none`` (default) leaves placement to the OS; ``core``
pins each rank to one core (``mpiexec -bind-to core``, ``srun --cpu-bind=cores``).
Pinned, MPI calls no longer suffer the phases in which the scheduler puts two
busy-polling ranks on one core; but a library's own threads (gloo's TCP loop)
then share their rank's core with MPI's busy polling, and gloo send/recv after
an MPI call take about 2 ms instead of 0.1 ms. Measured in docs/results/binding.md.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from typing import Optional, Sequence

LAUNCHERS = ("mpiexec", "srun", "torchrun")
BINDINGS = ("none", "core")


def find_mpiexec(explicit: Optional[str] = None) -> str:
    """Path of the mpiexec to use: ``explicit``, the wheel's, or PATH's."""
    if explicit:
        found = shutil.which(explicit)
        if not found:
            raise FileNotFoundError(f"mpiexec {explicit!r} not found")
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("no mpiexec: install the 'mpich' wheel (pip install mpich) or "
                                "pass --mpiexec PATH")
    return found


def program(argv: Sequence[str]) -> list[str]:
    """The per-rank command: ``x.py`` and ``-m mod`` run under this Python."""
    if not argv:
        raise ValueError("no program to run")
    if argv[0] == "-m" or argv[0].endswith(".py"):
        return [sys.executable, *argv]
    exe = shutil.which(argv[0]) or shutil.which(argv[0], path=os.path.dirname(sys.executable))
    if exe is None:
        raise FileNotFoundError(f"program {argv[0]!r} not found")
    return [exe, *argv[1:]]


def build_command(nprocs: int, argv: Sequence[str], launcher: str = "mpiexec",
                  hosts: Optional[str] = None, hostfile: Optional[str] = None,
                  mpiexec: Optional[str] = None, extra: Sequence[str] = (),
                  bind: str = "none") -> list[str]:
    """The full launch command line (see module docstring)."""
    if nprocs < 1:
        raise ValueError(f"-n must be at least 1, got {nprocs}")
    if bind not in BINDINGS:
        raise ValueError(f"unknown binding {bind!r} (expected one of {', '.join(BINDINGS)})")
    prog = program(argv)
    if launcher == "mpiexec":
        cmd = [find_mpiexec(mpiexec), "-n", str(nprocs)]
        if hosts:
            cmd += ["-hosts", hosts]
        if hostfile:
            cmd += ["-f", hostfile]
        if bind == "core":
            cmd += ["-bind-to", "core"]
        return cmd + list(extra) + prog
    if launcher == "srun":
        return ["srun", "-n", str(nprocs), *(["--cpu-bind=cores"] if bind == "core" else []),
                *extra, *prog]
    if launcher == "torchrun":
        if bind == "core":
            raise ValueError("torchrun cannot bind ranks to cores: use mpiexec or srun, or --bind none")
        if hosts or hostfile:
            raise ValueError("torchrun takes its hosts from --nnodes/--rdzv-endpoint; pass them after --extra")
        if prog[0] == sys.executable:
            prog = prog[1:]
        else:
            prog = ["--no-python", *prog]
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nprocs}",
                *extra, *prog]
    raise ValueError(f"unknown launcher {launcher!r} (expected one of {', '.join(LAUNCHERS)})")


def run(cmd: Sequence[str], timeout: Optional[float] = None) -> int:
    """Run a launch command, forwarding Ctrl-C/SIGTERM; returns its exit code
    (124 when ``timeout`` seconds passed and the job was killed)."""
    proc = subprocess.Popen(list(cmd), start_new_session=True)
    forward = lambda signum, _frame: proc.send_signal(signum)
    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        print(f"mcrdl run: job killed after {timeout} s", file=sys.stderr)
        return 124
    finally:
        for s, h in old.items():
            signal.signal(s, h)
