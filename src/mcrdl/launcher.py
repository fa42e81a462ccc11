"""Start N ranks through an existing launcher (no launcher of our own).

``mpiexec`` (default) is the one installed beside this Python by the ``mpich``
wheel, or the one on PATH, or one given by path; multi-host runs use its
``-hosts``/``-f`` options (Open MPI's: ``--host``/``--hostfile``, and ``-x``
for the environment, told apart by ``mpiexec --version``). ``srun`` and
``torchrun`` are forwarded to as is.

Every rank started through ``mpiexec`` or ``srun`` runs under
:mod:`mcrdl.rank_env`, which gives it torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``) before the program starts; ``MASTER_ADDR``/``MASTER_PORT``
(from the environment, else the first host and a free port) are the same on
every rank.

Binding (``bind``): ``none`` (default) leaves placement to the OS (Open MPI's
``mpiexec``, which binds each rank to a core by default, is told
``--bind-to none``); ``core`` pins each rank to one core (``mpiexec -bind-to
core``, ``srun --cpu-bind=cores``). A binding in ``extra`` (``--bind-to``,
``--map-by ...:PE=n``) replaces mcrdl's.
Pinned, MPI calls no longer suffer the phases in which the scheduler puts two
busy-polling ranks on one core; but a library's own threads (gloo's TCP loop)
then share their rank's core with MPI's busy polling, and gloo send/recv after
an MPI call take about 2 ms instead of 0.1 ms. Measured in docs/results/binding.md.
"""
from __future__ import annotations

import functools
import os
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from typing import Optional, Sequence

from . import settings

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


#: Per mpiexec family: (the options giving every rank NAME=value, the hosts option,
#: the hostfile option, the options of each binding). Open MPI binds each rank to
#: a core unless told not to: ``none`` must say so.
OPTIONS = {"hydra": (lambda k, v: ["-genv", k, v], "-hosts", "-f", {"core": ["-bind-to", "core"], "none": []}),
           "openmpi": (lambda k, v: ["-x", f"{k}={v}"], "--host", "--hostfile",
                       {"core": ["--bind-to", "core"], "none": ["--bind-to", "none"]})}


@functools.cache
def mpiexec_family(path: str) -> str:
    """``openmpi`` when ``path --version`` names Open MPI (or its OpenRTE), else
    ``hydra`` (MPICH, Intel MPI, MVAPICH: the mpich wheel's mpiexec)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "hydra"
    return "openmpi" if "Open MPI" in out or "OpenRTE" in out else "hydra"


def program(argv: Sequence[str]) -> list[str]:
    """The per-rank command: ``x.py`` and ``-m mod`` run under this Python, or
    under ``MCRDL_RANK_PYTHON``."""
    if not argv:
        raise ValueError("no program to run")
    if argv[0] == "-m" or argv[0].endswith(".py"):
        python = shlex.split(settings.get("MCRDL_RANK_PYTHON") or "")
        return [*(python or [sys.executable]), *argv]
    exe = shutil.which(argv[0]) or shutil.which(argv[0], path=os.path.dirname(sys.executable))
    if exe is None:
        raise FileNotFoundError(f"program {argv[0]!r} not found")
    return [exe, *argv[1:]]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now, for a rank to listen on soon: one below
    the kernel's ephemeral range where it has one. The OS's own pick (port 0)
    lies inside that range, where any process's outgoing connection may take
    it before the rank binds it (seen: a job's TCPStore failed with EADDRINUSE
    while the test suite's other jobs connected); below it only an explicit
    bind can."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    tries = random.sample(range(10000, low), min(50, low - 10000)) if low > 10050 else []
    for port in [*tries, 0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host}")


def master_address(hosts: Optional[str] = None, hostfile: Optional[str] = None) -> tuple[str, str]:
    """``MASTER_ADDR``/``MASTER_PORT`` for an mpiexec job: the environment's, else the
    first host (Hydra places rank 0 there) or loopback, and a port free on this host."""
    env = os.environ
    addr = env.get("MASTER_ADDR")
    if not addr:
        first = None
        if hosts:
            first = hosts.split(",")[0]
        elif hostfile:
            with open(hostfile) as f:
                first = next((ln.split("#")[0].strip() for ln in f if ln.split("#")[0].strip()), None)
        addr = first.split(":")[0] if first else "127.0.0.1"
    return addr, env.get("MASTER_PORT") or str(free_port())


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
    with_env = [sys.executable, "-m", "mcrdl.rank_env", *prog]  # torchrun's variables per rank
    if launcher == "mpiexec":
        addr, port = master_address(hosts, hostfile)
        exe = find_mpiexec(mpiexec)
        env_option, hosts_option, hostfile_option, bindings = OPTIONS[mpiexec_family(exe)]
        cmd = [exe, "-n", str(nprocs), *env_option("MASTER_ADDR", addr), *env_option("MASTER_PORT", port)]
        if hosts:
            cmd += [hosts_option, hosts]
        if hostfile:
            cmd += [hostfile_option, hostfile]
        if any("bind-to" in a or "PE=" in a for a in extra):  # the user's binding, not a conflicting one
            return cmd + list(extra) + with_env
        return cmd + bindings[bind] + list(extra) + with_env
    if launcher == "srun":
        return ["srun", "-n", str(nprocs), *(["--cpu-bind=cores"] if bind == "core" else []),
                *extra, *with_env]
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


#: Seconds a job has to end after Ctrl-C/SIGTERM reached it before it is killed.
STOP_GRACE_S = 5.0
#: Seconds the processes a launcher leaves behind when it ends have to end too
#: before `mcrdl run` says they still ran and kills them.
ORPHAN_GRACE_S = 1.0


def processes_below(pid: int) -> list[int]:
    """The processes below ``pid`` (children, theirs...), from /proc; none where there is no /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):  # not a process, or gone meanwhile
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait_gone(pids: Sequence[int], seconds: float) -> list[int]:
    """Wait up to ``seconds`` for ``pids`` to end; those still running then."""
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [p for p in pids if _alive(p)]


def _adopt_orphans() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux
    ``PR_SET_CHILD_SUBREAPER``), so ranks whose launcher exited first stay below
    it, where :func:`_kill_job` finds them. False where that is not possible."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        return False


def _kill_job(pid: int, also: Sequence[int] = ()) -> None:
    """SIGKILL the launch's process group, every process below the launcher and
    ``also``, then wait (up to 5 s) until those are gone: MPICH's proxy starts each
    rank in a session of its own, out of the group's reach, and ends it only some
    time after the launcher's death."""
    below = [*processes_below(pid), *also]
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in below:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    _wait_gone(below, 5)


def run(cmd: Sequence[str], timeout: Optional[float] = None, grace: float = STOP_GRACE_S) -> int:
    """Run a launch command in a session of its own; returns its exit code.

    Ctrl-C/SIGTERM is forwarded to the launcher, which passes it to the ranks;
    whatever is still running ``grace`` s later (or at a second signal) is
    killed, and the exit code is 128 + the signal's number. After ``timeout``
    s the job is killed and 124 returned. No process of the launch outlives
    this call."""
    adopting = _adopt_orphans()
    before = set(processes_below(os.getpid()))
    proc = subprocess.Popen(list(cmd), start_new_session=True)
    received: list[tuple[int, float]] = []  # (signal, when)

    def forward(signum, _frame):
        if received:  # a second Ctrl-C: do not wait any longer
            _kill_job(proc.pid)
        received.append((signum, time.monotonic()))
        proc.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    start = time.monotonic()
    code = None
    try:
        while True:
            try:
                code = proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            if received and time.monotonic() - received[0][1] > grace:
                _kill_job(proc.pid)
            elif not received and timeout is not None and time.monotonic() - start > timeout:
                _kill_job(proc.pid)
                proc.wait()
                print(f"mcrdl run: job killed after {timeout} s", file=sys.stderr)
                return 124
    finally:
        # ranks or proxies the launcher left behind; those orphaned when it exited
        # (ranks of MPICH's proxy live in sessions of their own) are below us now
        orphans = [p for p in processes_below(os.getpid()) if p not in before] if adopting else []
        if code is not None and not received:  # (a launcher that ended before its ranks: say so)
            running = _wait_gone(orphans, ORPHAN_GRACE_S)  # (ranks a launcher killed as it ended take a moment)
            if running:
                print(f"mcrdl run: the launcher exited with {code} while {len(running)} process(es) of its job "
                      f"still ran {ORPHAN_GRACE_S:g} s later (pids {' '.join(map(str, running))}); killing them",
                      file=sys.stderr)
        _kill_job(proc.pid, orphans)
        for p in orphans:  # our children now: reap them
            try:
                os.waitpid(p, os.WNOHANG)
            except ChildProcessError:
                pass
        for s, h in old.items():
            signal.signal(s, h)
    if received:
        signum = received[0][0]
        print(f"mcrdl run: stopped by {signal.Signals(signum).name} (the launcher exited with "
              f"{code})", file=sys.stderr)
        return 128 + signum
    return code
