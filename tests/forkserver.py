"""Ranks forked from a process that has imported torch already.

Most of a small test job's cost is each rank's ``import torch`` (about 1.4 CPU s).
The suite starts servers per pytest process (:func:`start`; :data:`SERVERS`), which
import torch, numpy, torch.distributed and DTensor once; a job's rank command is
then ``python tests/forkserver.py SCRIPT ARGS...`` (or ``-m MODULE ARGS...``, with
``python tests/forkserver.py`` as ``MCRDL_RANK_PYTHON``), a stub that imports only
the standard library. The stub hands the server everything a fresh process would
have inherited (open descriptors, environment, working directory, arguments, CPU
binding); the server forks a child, which takes them over and runs ``SCRIPT`` as
``__main__``, and reports how the child ended; the stub ends the same way (exit
status, or the same signal). The rank runs under the stub's launcher, MPI or not, as
a fresh process would: it talks to the launcher over the descriptors (MPICH's
``PMI_FD``) and prints to the stub's stdout and stderr.

A signal to the stub (the launcher's SIGTERM, a test's SIGABRT) is passed to the
rank; when a stub dies (SIGKILL) the server kills its rank, stopped or not. The
stub lives exactly as long as its rank, so looking for a job's processes by
command line finds it. The stub runs ``SCRIPT`` in a fresh interpreter instead
(``exec``) where no server is named (``TEST_FORKSERVER``) or ready, where a
variable that importing torch reads differs from the server's
(:data:`IMPORT_TIME`), or where it runs in another namespace or control group.
What fresh processes do not share, forked ranks do not either: ``random`` and
numpy's global generator are seeded anew, and the ranks of a job come from different
servers, so each hashes strings with a seed of its own.
"""
import json
import os
import signal
import socket
import sys

#: environment variables read while importing torch and numpy, or by their
#: libraries' loaders: a request that differs in one runs in a fresh process
IMPORT_TIME = ("LD_", "PYTHON", "TORCH", "PYTORCH", "OMP_", "KMP_", "MKL_", "OPENBLAS", "CUDA", "NCCL",
               "GOMP", "MALLOC")
#: ... except those the forked rank applies itself (:func:`become`) and those read after
#: import: by modules the server does not import (dynamo, inductor), by a process group
#: (the flight recorder's, NCCL's), and torchrun's per-worker variables
APPLIED = ("PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONFAULTHANDLER", "PYTHONDONTWRITEBYTECODE",
           "TORCHINDUCTOR_", "TORCHDYNAMO_", "TORCH_FR_", "TORCH_NCCL_", "TORCHELASTIC_", "TORCH_EXTENSIONS_DIR")
#: what the server imports before it forks
PRELOADED = ("numpy", "torch", "torch.distributed", "torch.distributed.tensor")
#: signals the stub passes on to its rank
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGABRT,
             signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT)
MAX_FDS = 250  # SCM_RIGHTS' limit per message is 253
#: servers per pytest process: rank r of a job is forked from server r % SERVERS, so
#: that, as fresh processes, a job's ranks do not share Python's hash seed (the order
#: of a set of strings)
SERVERS = 4


def _import_env(env):
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and not k.startswith(APPLIED)}


def _namespaces():
    """This process's namespaces and control group: a rank in another (a host of
    tests/multihost/netns.py, a Slurm step's) must not be forked from the server."""
    found = {f"ns:{name}": os.readlink(f"/proc/self/ns/{name}") for name in sorted(os.listdir("/proc/self/ns"))}
    with open("/proc/self/cgroup") as f:
        return {**found, "cgroup": f.read()}


def _recv_message(conn, fds=0):
    """One length-prefixed JSON message (and up to ``fds`` descriptors) from ``conn``."""
    head, got, *_ = socket.recv_fds(conn, 8, max(fds, 1))
    if len(head) < 8:
        raise EOFError("the other side closed the connection")
    size, body = int.from_bytes(head, "big"), b""
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise EOFError("the other side closed the connection")
        body += chunk
    return json.loads(body), got


def _send_message(conn, message, fds=()):
    body = json.dumps(message).encode()
    socket.send_fds(conn, [len(body).to_bytes(8, "big")], list(fds))
    conn.sendall(body)


# ---------------------------------------------------------------- the stub

def stub(argv):
    """The rank command: have the server fork a rank that runs ``argv``, end as it ended."""
    path = os.environ.get("TEST_FORKSERVER")
    server_env = None
    if path:
        rank = os.environ.get("RANK", os.environ.get("PMI_RANK", "0"))
        path = f"{path}.{int(rank) % SERVERS if rank.isdigit() else 0}"
        try:
            with open(path + ".env") as f:
                server_env = json.load(f)
        except OSError:
            pass
    fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    fds = [fd for fd in fds if _is_open(fd)]
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if server_env != {**_import_env(os.environ), **_namespaces()} or len(fds) > MAX_FDS:
            raise ConnectionRefusedError
        conn.connect(path)
    except OSError:  # no server (yet, or any more), or one this script must not be forked from
        conn.close()
        os.execv(sys.executable, [sys.executable, *argv])
    lifeline_r, lifeline_w = os.pipe()  # the write end closes when this process dies: the server's sign
    _send_message(conn, {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "fds": fds,
                         "umask": _umask(), "cpus": sorted(os.sched_getaffinity(0))}, [*fds, lifeline_r])
    os.close(lifeline_r)
    (started, _) = _recv_message(conn)
    rank = started["pid"]

    def forward(signum, _frame):
        try:
            os.kill(rank, signum)
        except ProcessLookupError:  # it ended meanwhile: the server says how
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    ended, _ = _recv_message(conn)
    status = ended["status"]
    if os.WIFSIGNALED(status):
        signum = os.WTERMSIG(status)
        if signum not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
    sys.exit(os.waitstatus_to_exitcode(status))


def _is_open(fd):
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


# ---------------------------------------------------------------- the server

def serve(path):
    """Import torch, then fork a rank per request on ``path``; returns, in a child,
    the request the child is to run. The server exits once its pytest is gone."""
    import gc
    import importlib
    import selectors

    for module in PRELOADED:
        importlib.import_module(module)
    # Out of the collector's reach, torch's objects are not touched by a rank's
    # collections, so its pages stay shared with the server instead of being
    # copied: 10 two-rank jobs took 11.5-12.0 CPU s in servers and ranks, 24.1 before.
    gc.freeze()

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    with open(path + ".env.tmp", "w") as f:
        json.dump({**_import_env(os.environ), **_namespaces()}, f)
    os.replace(path + ".env.tmp", path + ".env")  # the stubs' sign that the server is ready
    ranks = {}  # pid -> (the connection of its stub, the stub's lifeline)
    ended_r, ended_w = os.pipe()  # a byte per signal: a rank ended (SIGCHLD) and wakes the loop at once
    os.set_blocking(ended_w, False)
    signal.set_wakeup_fd(ended_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, lambda _s, _f: None)
    waiting = selectors.DefaultSelector()
    waiting.register(listener, selectors.EVENT_READ)
    waiting.register(ended_r, selectors.EVENT_READ)
    pytest = os.getppid()
    while os.getppid() == pytest:  # a server outlives no pytest, not even a killed one
        for key, _ in waiting.select(timeout=1):
            if key.fileobj == ended_r:
                os.read(ended_r, 4096)
                continue
            if key.fileobj is not listener:  # a stub died (the write end of its lifeline closed)
                os.kill(key.data, signal.SIGKILL)  # (stopped or not) its rank goes with it
                waiting.unregister(key.fileobj)
                continue
            conn, _ = listener.accept()
            try:
                request, fds = _recv_message(conn, MAX_FDS + 1)
            except (EOFError, OSError, ValueError):
                conn.close()
                continue
            *inherited, lifeline = fds
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                os.close(ended_r)
                os.close(ended_w)
                waiting.close()
                listener.close()
                for other, other_lifeline in ranks.values():
                    other.close()
                    os.close(other_lifeline)
                conn.close()
                os.close(lifeline)
                return request, inherited
            for fd in inherited:
                os.close(fd)
            ranks[pid] = conn, lifeline
            waiting.register(lifeline, selectors.EVENT_READ, pid)
            _send_message(conn, {"pid": pid})
        while ranks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn, lifeline = ranks.pop(pid)
            if lifeline in waiting.get_map():
                waiting.unregister(lifeline)
            os.close(lifeline)
            try:
                _send_message(conn, {"status": status})
            except OSError:
                pass
            conn.close()
    sys.exit(0)


def become(request, fds):
    """In a forked child: take over the stub's descriptors, environment, working
    directory and arguments; returns what to run as ``__main__``: ``[script, args...]``
    or ``["-m", module, args...]``."""
    import faulthandler
    import io
    import random

    # out of the way of the numbers the descriptors get back, then onto them
    high = [_dup_above(fd, 1024) for fd in fds]
    keep = set(request["fds"])
    for fd, number in zip(high, request["fds"]):
        os.dup2(fd, number)
        os.close(fd)
    for fd in (int(n) for n in os.listdir("/proc/self/fd")):
        if fd not in keep and _is_open(fd):
            try:
                os.close(fd)
            except OSError:
                pass
    os.setsid()
    os.umask(request["umask"])
    os.sched_setaffinity(0, request["cpus"])  # a launcher's binding (mpiexec -bind-to core)
    os.chdir(request["cwd"])
    old_path = os.environ.get("PYTHONPATH", "")
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    sys.argv = argv[1:] if argv[0] == "-m" else argv  # (runpy puts the module's path first)
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    first = os.getcwd() if argv[0] == "-m" else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = [first, *extra, *[p for p in sys.path[1:] if p not in old_path.split(os.pathsep)]]
    sys.dont_write_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    unbuffered = bool(os.environ.get("PYTHONUNBUFFERED"))
    def stream(fd, mode, **how):  # as the interpreter makes sys.stdin/stdout/stderr (None where closed)
        return io.TextIOWrapper(io.FileIO(fd, mode, closefd=False), **how) if fd in keep else None

    sys.stdin = sys.__stdin__ = stream(0, "r")
    sys.stdout = sys.__stdout__ = stream(1, "w", write_through=unbuffered, line_buffering=os.isatty(1))
    sys.stderr = sys.__stderr__ = stream(2, "w", write_through=True, errors="backslashreplace")
    if os.environ.get("PYTHONFAULTHANDLER"):
        faulthandler.enable(all_threads=True)
    else:
        faulthandler.disable()
    random.seed()
    import numpy
    numpy.random.seed()
    return argv


def _dup_above(fd, lowest):
    """``fd`` moved to a number at least ``lowest`` (closed on exec)."""
    import fcntl
    new = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, lowest)
    os.close(fd)
    return new


_servers = []  # this process's servers


def start():
    """Start this process's servers; returns the stubs' ``TEST_FORKSERVER``, the path
    their sockets (``.0``, ``.1``...) start with. Until a server has imported torch,
    its stubs run their scripts fresh."""
    import atexit
    import shutil
    import subprocess
    import tempfile

    directory = tempfile.mkdtemp(prefix="forkserver_")
    where = os.path.join(directory, "sock")
    _servers.extend(subprocess.Popen([sys.executable, __file__, "--serve", f"{where}.{i}"],
                                     stdin=subprocess.DEVNULL) for i in range(SERVERS))
    atexit.register(lambda: ([(p.kill(), p.wait()) for p in _servers],
                             shutil.rmtree(directory, ignore_errors=True)))
    return where


def cpu_seconds():
    """CPU seconds of this process's servers and of the ranks they forked and waited for."""
    total = 0
    for proc in _servers:
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                total += sum(map(int, f.read().rsplit(")", 1)[1].split()[11:15]))  # utime stime cutime cstime
        except OSError:
            pass
    return total / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the pytest's Ctrl-C is for pytest
        forked = serve(sys.argv[2])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        import runpy
        argv = become(*forked)
        if argv[0] == "-m":
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(argv[0], run_name="__main__")
    else:
        stub(sys.argv[1:])
