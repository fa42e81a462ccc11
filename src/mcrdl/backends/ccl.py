"""``ccl``: Intel oneCCL 2022.2 (CPU) through its C API (``oneapi/ccl.h``).

The libraries come from PyPI (``scripts/install_oneccl.sh VENV``, which
``make test`` and ``make demo`` run); the binding is ``ccl_lib.py``. Where they
are not installed the backend is not live and says why. What the library does
on CPU, and so all this backend declares (anything else falls through to the
next library, see docs/backends.md):

* ops: all_reduce, broadcast, reduce, all_gather_into_tensor,
  reduce_scatter_tensor, scatter, all_to_all_single (even splits with
  ``onecclAllToAll``, split sizes with ``onecclAllToAllV``) and barrier (a
  one-element all-reduce, as torch's NCCL backend does); the C API has no
  gather, and its send/recv have no tag and no any-source receive and block
  until matched, so mcrdl's tagged, nonblocking point-to-point stays with
  MPI/gloo;
* dtypes int8, uint8, int32, int64, float16, bfloat16, float32, float64 (bool
  moves as uint8 in the ops that only move data);
* reductions SUM, PRODUCT, MIN, MAX (AVG arrives as a sum: the API divides;
  the CPU plugin refuses ``onecclAvg``);
* CPU tensors; the world group only (docs/backends.md says why sub-groups are
  declined: one worker thread orders every group's async ops).

Start-up costs 0.5-1.2 s and three threads per process, so nothing happens
until a group's first ccl op: the library loads then (its ``CCL_*``/``FI_*``
settings, ``ccl_lib.environment``, go into the environment first), the group's
rank 0 makes a unique id and puts it in the group's store under a key carrying
a token rank 0 drew for the job at ``join``, and every member makes its
communicator from it (every member runs a group's collectives in one order, so
they all reach that first op). A job that never selects ``ccl`` loads nothing.

The library's calls block on host buffers and cannot be withdrawn. A blocking
call with nothing outstanding runs on the caller's thread; any other call runs
on one worker thread, in issue order (the library is entered by one thread at
a time), while the caller keeps every other library progressing. ctypes
releases the GIL for the call. A sentinel thread ends the process with a
message naming the op when one runs past its group's timeout or a peer's
process on this host is gone: the only way out of a wait that cannot be
interrupted, as NCCL's watchdog does.
"""
from __future__ import annotations

import os
import queue
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch

from ..types import ReduceOp
from ..work import DONE, Pending
from . import ccl_lib, sentinel
from .base import Backend, Context

#: the library's reductions on CPU (ccl_lib.REDUCTIONS)
REDUCE_CODES = {ReduceOp.SUM: ccl_lib.REDUCTIONS["sum"], ReduceOp.PRODUCT: ccl_lib.REDUCTIONS["prod"],
                ReduceOp.MAX: ccl_lib.REDUCTIONS["max"], ReduceOp.MIN: ccl_lib.REDUCTIONS["min"]}
#: torch dtype -> onecclDataType_t: what the library has (uint32/uint64 have no torch arithmetic)
DTYPE_CODES = {getattr(torch, n): ccl_lib.DTYPE_CODES[n]
               for n in ("int8", "uint8", "int32", "int64", "float16", "bfloat16", "float32", "float64")}
#: ops that reduce (the others only move data, so bool moves as uint8)
REDUCING = frozenset({"all_reduce", "reduce", "reduce_scatter_tensor"})
OPS = frozenset({"all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
                 "scatter", "all_to_all_single", "barrier"})


def _host() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _code(t: torch.Tensor) -> int:
    return DTYPE_CODES[torch.uint8 if t.dtype == torch.bool else t.dtype]


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


class CclGroup:
    """A group's handle: its communicator is made at its first ccl op."""

    __slots__ = ("ranks", "rank", "size", "store", "timeout", "comm", "key", "__weakref__")

    def __init__(self, ranks: Sequence[int], rank: int, store: Any, timeout: float, key: str):
        self.ranks, self.rank, self.size = list(ranks), rank, len(ranks)
        self.store, self.timeout, self.key = store, timeout, key
        self.comm: Optional[ccl_lib.Comm] = None


class CclPending(Pending):
    """An op queued on the worker thread."""

    __slots__ = ("done", "error")

    def __init__(self):
        self.done = threading.Event()
        self.error: Optional[BaseException] = None

    def test(self) -> bool:
        if not self.done.is_set():
            return False
        if self.error is not None:
            raise self.error
        return True

    def block(self, deadline: float) -> bool:
        return self.done.wait(max(deadline - time.monotonic(), 0)) and self.test()


class CclBackend(Backend):
    """Intel oneCCL's C API on CPU tensors (module docstring)."""

    name = "ccl"
    devices = frozenset({"cpu"})
    ops = OPS
    #: each communicator's unique id travels through the group's store
    needs = frozenset({"store"})
    raw_ops = frozenset({"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "scatter",
                         "all_to_all", "all_to_allv"})

    @classmethod
    def unavailable_reason(cls, ctx: Context) -> Optional[str]:
        why = ccl_lib.missing()
        if why is not None:
            return why
        if ctx.world_size > 1 and ctx.store is None:
            return "this job has no store, which carries each communicator's unique id"
        return None

    @classmethod
    def info_lines(cls, live):
        why = ccl_lib.missing()
        if why is not None:
            return [f"ccl: {why}"]
        try:
            ver = ccl_lib.version()  # (loads the library in this process: mcrdl info's, not a job's)
        except Exception as exc:
            return [f"ccl: oneCCL could not be loaded: {exc}"]
        return [f"ccl: oneCCL {ver} (C API) from {ccl_lib.lib_dir()}, libfabric {ccl_lib.libfabric()}"]

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._given = self._finished = 0  # ops handed to the worker (by callers), done by it
        self._worker: Optional[threading.Thread] = None
        self._sentinel: Optional[threading.Thread] = None
        self._started = self._ended = 0  # ops that entered / left the library on this rank
        self._current: tuple = ("", None, 0.0)  # (op, group handle, its timeout) of the op in the library
        self._stopped = threading.Event()
        self._handles: list[CclGroup] = []
        self._groups = 0
        self.token = ""
        self.pids: dict[int, int] = {}

    def join(self) -> None:
        token = secrets.token_hex(8) if self.ctx.rank == 0 else None
        peers = self.ctx.share((_host(), os.getpid(), token))
        self.token = peers[0][2]
        me = peers[self.ctx.rank][0]
        self.pids = {r: pid for r, (host, pid, _) in enumerate(peers) if host == me and r != self.ctx.rank}

    def version(self) -> str:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return f"oneCCL {version('oneccl-cpu')} (C API)"
        except PackageNotFoundError:
            return "oneCCL (C API)"

    def group_unsupported(self, ranks, world: bool) -> Optional[str]:
        if not world:
            return ("the world group only: on one worker thread, async ops of overlapping groups issued in "
                    "different orders on different ranks deadlock with other libraries' blocking ops")
        return None

    def unsupported(self, op, dtype, reduce_op, device):
        if dtype == torch.bool:
            if op in REDUCING:
                return "the library has no bool reductions"
            return None
        if dtype not in DTYPE_CODES:
            return f"the library has no {dtype} (it has {', '.join(str(d) for d in DTYPE_CODES)})"
        if reduce_op is not None and op in REDUCING and reduce_op not in REDUCE_CODES:
            return f"the library's CPU plugin has no {reduce_op.name} reduction"
        return None

    def new_group(self, ranks, group_rank, store, timeout):
        self._groups += 1
        h = CclGroup(ranks, group_rank, store, timeout, f"ccl/{self.token}/{self._groups}/uid")
        self._handles.append(h)
        return h

    def destroy_group(self, h) -> None:
        if h in self._handles:
            self._handles.remove(h)
        if h.comm is None:
            return
        if self._worker is not None and self._given != self._finished:
            self._submit(self._run, "destroy", CclBackend._destroy, h)  # (after the group's queued ops)
        else:
            self._run("destroy", CclBackend._destroy, h)

    def _destroy(self, h: CclGroup) -> None:
        comm, h.comm = h.comm, None
        if comm is not None:
            comm.destroy()

    # -- the communicator -----------------------------------------------------
    def _comm(self, h: CclGroup) -> ccl_lib.Comm:
        """The group's communicator, made at its first op (on every member: all
        of them are in this op)."""
        if h.comm is not None:
            return h.comm
        if h.size == 1:
            uid = ccl_lib.unique_id()
        elif h.rank == 0:
            uid = ccl_lib.unique_id()
            h.store.set(h.key, uid)
        else:
            h.store.wait([h.key], timedelta(seconds=h.timeout))
            uid = h.store.get(h.key)
        h.comm = ccl_lib.Comm(bytes(uid), h.size, h.rank)
        return h.comm

    def raw_calls(self, h, inp, out, part):
        """oneCCL's C calls themselves on the caller's thread, their arguments made once."""
        comm, n = self._comm(h), self.ctx.world_size
        f32, total = DTYPE_CODES[torch.float32], REDUCE_CODES[ReduceOp.SUM]
        a, b = (0 if t is None else t.data_ptr() for t in (inp, out))
        counts = [part] * n
        return {
            "all_reduce": lambda: comm.all_reduce(a, a, inp.numel(), f32, total),
            "broadcast": lambda: comm.broadcast(a, inp.numel(), f32, 0),
            "reduce": lambda: comm.reduce(a, a, inp.numel(), f32, total, 0),
            "all_gather": lambda: comm.all_gather(a, b, part, f32),
            "reduce_scatter": lambda: comm.reduce_scatter(a, b, part, f32, total),
            "scatter": lambda: comm.scatter(a or None, b, part, f32, 0),
            "all_to_all": lambda: comm.all_to_all(a, b, part, f32),
            "all_to_allv": lambda: comm.all_to_allv(a, counts, b, counts, f32),
        }

    # -- the ops, each run to completion ----------------------------------------
    def _all_reduce(self, h, t, op):
        if t.numel():
            self._comm(h).all_reduce(t.data_ptr(), t.data_ptr(), t.numel(), _code(t), REDUCE_CODES[op])

    def _broadcast(self, h, t, root):
        if t.numel():
            self._comm(h).broadcast(t.data_ptr(), t.numel(), _code(t), root)

    def _reduce(self, h, t, root, op):
        if t.numel():
            self._comm(h).reduce(t.data_ptr(), t.data_ptr(), t.numel(), _code(t), REDUCE_CODES[op], root)

    def _all_gather(self, h, output, input):
        n = input.numel()
        if not n:
            return
        if _overlap(output, input) and input.data_ptr() != output.data_ptr() + h.rank * n * input.element_size():
            input = input.clone()  # (in place only as the library defines it)
        self._comm(h).all_gather(input.data_ptr(), output.data_ptr(), n, _code(input))

    def _reduce_scatter(self, h, output, input, op):
        n = output.numel()
        if not n:
            return
        if _overlap(output, input):
            input = input.clone()
        self._comm(h).reduce_scatter(input.data_ptr(), output.data_ptr(), n, _code(output), REDUCE_CODES[op])

    def _scatter(self, h, output, input, root):
        n = output.numel()
        if not n:
            return
        send = 0
        if input is not None:
            if _overlap(output, input):
                input = input.clone()
            send = input.data_ptr()
        self._comm(h).scatter(send or None, output.data_ptr(), n, _code(output), root)

    def _all_to_all(self, h, output, input, output_counts, input_counts):
        if input_counts is None and not output.numel():
            return
        if _overlap(output, input):
            input = input.clone()  # (the library works out of place)
        comm = self._comm(h)
        if input_counts is None:
            comm.all_to_all(input.data_ptr(), output.data_ptr(), output.numel() // h.size, _code(output))
        else:
            comm.all_to_allv(input.data_ptr() or None, list(input_counts), output.data_ptr() or None,
                             list(output_counts), _code(output))

    def _barrier(self, h):
        t = torch.zeros(1, dtype=torch.int32)
        self._comm(h).all_reduce(t.data_ptr(), t.data_ptr(), 1, DTYPE_CODES[torch.int32], REDUCE_CODES[ReduceOp.SUM])

    RUN = {"all_reduce": _all_reduce, "broadcast": _broadcast, "reduce": _reduce,
           "all_gather_into_tensor": _all_gather, "reduce_scatter_tensor": _reduce_scatter,
           "scatter": _scatter, "all_to_all_single": _all_to_all, "barrier": _barrier}

    # -- running ops ----------------------------------------------------------
    def _run(self, op: str, fn: Callable, h: CclGroup, *args) -> None:
        if self._sentinel is None:
            self._sentinel = sentinel.start("ccl", self._stopped, lambda: (self._started, self._ended), self._verdict)
        self._current = (op, h, h.timeout)
        self._started += 1  # (the sentinel watches these two counts)
        try:
            fn(self, h, *args)
        finally:
            self._ended = self._started

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            run, args, pending = item
            try:
                run(*args)
            except BaseException as exc:
                if pending is not None:
                    pending.error = exc
            self._finished += 1
            if pending is not None:
                pending.done.set()

    def _submit(self, run: Callable, *args) -> CclPending:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, daemon=True, name="mcrdl-ccl")
            self._worker.start()
        pending = CclPending()
        self._given += 1
        self._queue.put((run, args, pending))
        return pending

    def _start(self, op: str, h, *args) -> CclPending:
        return self._submit(self._run, op, self.RUN[op], h, *args)

    def _verdict(self, number: int, inside: float) -> Optional[str]:
        """The sentinel's (sentinel.py): why op ``number``, ``inside`` the library
        that many seconds, cannot complete (past its group's timeout plus a grace,
        so an async op's own timeout error comes first, or a peer on this host gone)."""
        op, h, timeout = self._current
        ranks = h.ranks if h is not None else []
        dead = [r for r in ranks if r in self.pids and sentinel.gone(self.pids[r])]
        if not dead and inside <= timeout + sentinel.GRACE_S:
            return None
        why = f"rank(s) {dead} ended" if dead else f"it ran past the group's timeout of {timeout:g} s"
        return (f"mcrdl: rank {self.ctx.rank}: {op} #{number} on backend 'ccl' (group {ranks}) cannot complete: "
                f"{why}, and the library's wait cannot be withdrawn: ending this process")

    def all_reduce(self, h, tensor, op):
        return self._start("all_reduce", h, tensor, op)

    def broadcast(self, h, tensor, root):
        return self._start("broadcast", h, tensor, root)

    def reduce(self, h, tensor, root, op):
        return self._start("reduce", h, tensor, root, op)

    def all_gather_into_tensor(self, h, output, input):
        return self._start("all_gather_into_tensor", h, output, input)

    def reduce_scatter_tensor(self, h, output, input, op):
        return self._start("reduce_scatter_tensor", h, output, input, op)

    def scatter(self, h, output, input, root):
        return self._start("scatter", h, output, input, root)

    def all_to_all_single(self, h, output, input, output_counts, input_counts):
        return self._start("all_to_all_single", h, output, input, output_counts, input_counts)

    def barrier(self, h):
        return self._start("barrier", h)

    def starter(self, op, h, timeout, tensors, *fixed):
        """A blocking call with nothing queued runs here (the fast paths start
        one only when no work is outstanding); the rest queue on the worker."""
        fn = self.RUN[op]
        submit, run = self._submit, self._run

        if timeout <= 0:  # async
            return lambda *args: submit(run, op, fn, h, *args, *fixed)

        def start(*args):
            if self._given != self._finished:  # behind the worker's ops, in issue order
                return submit(run, op, fn, h, *args, *fixed)
            run(op, fn, h, *args, *fixed)
            return DONE
        return start

    def shutdown(self) -> None:
        for h in list(self._handles):
            self.destroy_group(h)
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=self.ctx.timeout)
        self._stopped.set()
