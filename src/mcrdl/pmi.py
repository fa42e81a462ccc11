"""MPI whatever started the ranks: a PMI-1 service in each rank, backed by the job's torch Store.

An MPICH process finds its process manager through PMI: Hydra's proxies (mpiexec) and
Slurm's PMI plugin serve it. torchrun, ``torch.multiprocessing.spawn``, Lightning's and
DeepSpeed's launchers serve none, but they give every rank what a process manager knows:
its rank, the world size and a torch Store that all ranks reach. So each rank serves its
own MPI library the PMI-1 wire protocol on a socket pair (``PMI_FD``), answering from
that store: ``put``/``get`` are store keys, ``barrier_in`` a store counter, and
``PMI_process_mapping`` (which ranks share a host) comes from the hostnames every rank
published. ``MPI_Init`` then builds COMM_WORLD over exactly torch's ranks (``PMI_RANK``
is the torch rank), across hosts too: MPICH's business cards travel through the store.

The service is a Python thread, so every MPI call that talks PMI must run without the
GIL: ``MPI_Init_thread`` and ``MPI_Finalize`` are called through ctypes (mpi4py holds
the GIL there). MPICH reads everything it needs at init; the last PMI message,
``finalize``, is sent from a C exit handler after Python is gone, so its answer is
queued once MPI is finalized (:func:`_finalize`).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import os
import socket
import threading
import time
from datetime import timedelta
from typing import Optional, Sequence

#: Environment variables this rank's MPI library reads at init (removed afterwards, so a
#: child process does not take itself for an MPI-launched rank).
PMI_VARS = ("PMI_FD", "PMI_RANK", "PMI_SIZE")
MAX_VALUE = 1024 - 64  # MPICH's PMI line is 1024 bytes: a value leaves room for the command

_state: dict = {}  # the MPI world this process started: {"world", "rank", "size"}


def process_mapping(hosts: Sequence[str]) -> str:
    """MPICH's ``PMI_process_mapping`` of ranks to nodes: ``(vector,(node,nodes,ranks),...)``,
    each triple giving ``ranks`` consecutive ranks to each of ``nodes`` nodes from
    ``node`` on. Node ids number the hosts in order of first appearance."""
    ids: dict[str, int] = {}
    runs: list[list[int]] = []  # [node, count] per run of consecutive ranks on one host
    for host in hosts:
        node = ids.setdefault(host, len(ids))
        if runs and runs[-1][0] == node:
            runs[-1][1] += 1
        else:
            runs.append([node, 1])
    blocks: list[list[int]] = []  # [first node, nodes, ranks each]
    for node, count in runs:
        last = blocks[-1] if blocks else None
        if last and last[2] == count and last[0] + last[1] == node:
            last[1] += 1
        else:
            blocks.append([node, 1, count])
    return "(vector," + ",".join(f"({a},{b},{c})" for a, b, c in blocks) + ")"


class PMIService(threading.Thread):
    """The PMI-1 server of one rank's MPI library, on one end of a socket pair."""

    def __init__(self, sock: socket.socket, store, rank: int, size: int, mapping: str,
                 kvsname: str, timeout: float):
        super().__init__(name="mcrdl-pmi", daemon=True)
        self.sock, self.store, self.rank, self.size = sock, store, rank, size
        self.mapping, self.kvsname, self.timeout = mapping, kvsname, timeout
        self.barriers = 0
        self.error: Optional[str] = None  # the last request it could not serve

    def run(self) -> None:
        pending = b""
        while True:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                reply = self.answer(line.decode(errors="replace"))
                try:
                    self.sock.sendall(reply.encode() + b"\n")
                except OSError:
                    return

    def answer(self, line: str) -> str:
        """The reply to one PMI-1 request line (``cmd=... key=value ...``)."""
        req = dict(item.split("=", 1) for item in line.split() if "=" in item)
        cmd = req.get("cmd", "")
        try:
            if cmd == "init":
                return "cmd=response_to_init pmi_version=1 pmi_subversion=1 rc=0"
            if cmd == "get_maxes":
                return f"cmd=maxes kvsname_max=256 keylen_max=256 vallen_max={MAX_VALUE} rc=0"
            if cmd == "get_appnum":
                return "cmd=appnum appnum=0 rc=0"
            if cmd == "get_universe_size":
                return f"cmd=universe_size size={self.size} rc=0"
            if cmd == "get_my_kvsname":
                return f"cmd=my_kvsname kvsname={self.kvsname} rc=0"
            if cmd == "put":
                self.store.set(f"kvs/{req['key']}", req.get("value", ""))
                return "cmd=put_result rc=0"
            if cmd == "get":
                return self._get(req.get("key", ""))
            if cmd == "barrier_in":
                self._barrier()
                return "cmd=barrier_out rc=0"
            if cmd == "finalize":
                return "cmd=finalize_ack rc=0"
            if cmd == "abort":
                return "cmd=abort_ack rc=0"
        except Exception as exc:  # noqa: BLE001 - answered as a PMI error, MPI reports it
            self.error = f"PMI {cmd} on rank {self.rank}: {type(exc).__name__}: {exc}"
            return f"cmd={cmd or 'error'} rc=-1 msg={self.error.replace(' ', '_')[:200]}"
        self.error = f"PMI request {line!r} is not served by mcrdl"
        return f"cmd={cmd or 'error'} rc=-1 msg=unsupported"

    def _get(self, key: str) -> str:
        if key == "PMI_process_mapping" and len(self.mapping) < MAX_VALUE:
            return f"cmd=get_result rc=0 value={self.mapping}"
        if key and self.store.check([f"kvs/{key}"]):  # put before the barrier that preceded this get
            return f"cmd=get_result rc=0 value={self.store.get(f'kvs/{key}').decode()}"
        return "cmd=get_result rc=-1 msg=key_not_found"

    def _barrier(self) -> None:
        """Every rank's ``barrier_in`` number n meets on the store: the last to count in
        opens the barrier. A rank absent past the timeout is an error naming the ranks."""
        self.barriers += 1
        key = f"barrier/{self.barriers}"
        self.store.set(f"{key}/{self.rank}", "")
        if self.store.add(key, 1) == self.size:
            self.store.set(f"{key}/open", "")
        try:
            self.store.wait([f"{key}/open"], timedelta(seconds=self.timeout))
        except RuntimeError:  # the store's timeout
            missing = [r for r in range(self.size) if not self.store.check([f"{key}/{r}"])]
            raise TimeoutError(f"ranks {missing} did not reach MPI's barrier {self.barriers} "
                               f"within {self.timeout:g} s") from None


def _answer_finalize(service: PMIService) -> None:
    """At exit, after MPI_Finalize (which needs the service for its PMI barrier): the
    answer to MPICH's last request, ``finalize``, queued now, since MPICH sends it from
    a C exit handler once Python (and so the service) has stopped."""
    try:
        service.sock.sendall(b"cmd=finalize_ack rc=0\n")
    except OSError:
        pass
    service.sock.detach()  # left open: MPICH writes its request after Python has gone


def _kvsname(token: str) -> str:
    """The job's PMI name: MPICH derives the names of its shared-memory segments from
    it, so two jobs on a host (or one and an aborted one's leftovers) must differ."""
    return "mcrdl_" + hashlib.sha1(token.encode()).hexdigest()[:16]


def why_not(MPI) -> Optional[str]:
    """Why this process cannot start MPI through mcrdl's PMI service, or None."""
    version = MPI.Get_library_version()
    if "MPICH" not in version:  # Open MPI speaks PMIx, not PMI-1
        return (f"mpi4py loaded {version.splitlines()[0].strip()}, which does not speak PMI-1 "
                "(mcrdl serves MPICH-family libraries here; launch with that library's mpiexec, "
                "or `mcrdl run`)")
    if MPI.Is_initialized():
        return ("MPI was started in this process before mcrdl could start it over the job's store "
                "(as a singleton: mpi4py.MPI was imported with mpi4py.rc.initialize on; Lightning's "
                "own launcher does so when it probes for MPI: give the Trainer "
                "plugins=[LightningEnvironment()], or start the ranks with torchrun or `mcrdl run`)")
    return None


def _agree(store, rank: int, size: int, mine: dict, timeout: float) -> list[dict]:
    """Every rank's ``mine``, in rank order (each published on the store)."""
    store.set(f"ready/{rank}", json.dumps(mine))
    keys = [f"ready/{r}" for r in range(size)]
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except RuntimeError:  # the store's timeout
        missing = [r for r in range(size) if not store.check([f"ready/{r}"])]
        raise TimeoutError(f"ranks {missing} did not join MPI's start within {timeout:g} s") from None
    return [json.loads(store.get(k)) for k in keys]


def _decide(everyone: list[dict]) -> tuple[str, Optional[str]]:
    """("start" | "reuse" | "none", why not): the same on every rank, from every rank's facts."""
    refusals = [(r, e["why"]) for r, e in enumerate(everyone) if e["why"]]
    if refusals:
        r, why = refusals[0]
        more = f" (and on {len(refusals) - 1} more ranks)" if len(refusals) > 1 else ""
        return "none", f"on rank {r}: {why}{more}"
    worlds = {e["world"] for e in everyone}
    if worlds == {None}:
        return "start", None
    if len(worlds) == 1:
        return "reuse", None
    return "none", ("the ranks' processes already run MPI worlds of other starts, and MPI "
                    "cannot start twice in a process")


def bring_up(store, rank: int, size: int, timeout: float):
    """COMM_WORLD over the ranks that share ``store`` (``rank`` of ``size``), or why not.

    Returns ``(MPI, None)`` with MPI started and its world rank equal to ``rank``, or
    ``(None, why)``, alike on every rank: each rank publishes on the store whether it
    can before any starts MPI, so none is left waiting in MPI_Init. A process whose MPI
    this service started before reuses it when every rank's comes from that same start
    (MPI cannot start twice in a process). ``store`` must be this start's own
    (:func:`mcrdl.rendezvous.fresh_keys`): a store outlives torchrun's restarts and
    re-initialisations."""
    from torch.distributed import PrefixStore

    store = PrefixStore("pmi/", store)
    MPI, why = None, None
    try:
        from .backends.mpi import import_mpi
        MPI = import_mpi()
        if not _state:
            why = why_not(MPI)
        elif (_state["rank"], _state["size"]) != (rank, size):
            why = f"this process's MPI world was started as rank {_state['rank']} of {_state['size']}"
    except Exception as exc:  # noqa: BLE001 - no mpi4py or no MPI library: said, not raised
        why = f"mpi4py cannot load an MPI library ({type(exc).__name__}: {exc})"
    token = f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
    everyone = _agree(store, rank, size, {"host": socket.gethostname(), "why": why,
                                          "world": _state.get("world"), "token": token}, timeout)
    verdict, why = _decide(everyone)
    if verdict != "start":
        return (MPI, None) if verdict == "reuse" else (None, why)
    server, client = socket.socketpair()
    fd = client.detach()  # the library's PMI_FD: open for the life of the process, never closed by Python
    service = PMIService(server, store, rank, size, process_mapping([e["host"] for e in everyone]),
                         _kvsname(everyone[0]["token"]), timeout)
    service.start()
    atexit.register(_answer_finalize, service)  # runs after init_thread's MPI_Finalize
    os.environ.update(PMI_FD=str(fd), PMI_RANK=str(rank), PMI_SIZE=str(size))
    from .backends.mpi import init_thread
    try:
        init_thread(MPI)
    except RuntimeError as exc:
        raise RuntimeError(f"rank {rank}: {exc}" + (f"; {service.error}" if service.error else "")) from None
    finally:
        for var in PMI_VARS:
            os.environ.pop(var, None)
    _state.update(world=everyone[0]["token"], rank=rank, size=size)
    return MPI, None
