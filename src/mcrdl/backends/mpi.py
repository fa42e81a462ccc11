"""MPI backend: mpi4py over the MPI library the job was launched with.

CPU tensors are handed to MPI zero-copy as raw buffers (address, count,
datatype): no ``.numpy()``, no DLPack round trip, no pickling. CUDA tensors go
to MPI directly (through DLPack) only when the MPI is CUDA-aware
(:func:`cuda_support`); otherwise the ``mpi_staged`` backend
(backends/mpi_staged.py) moves them through host memory. MPI has no bfloat16 (and MPICH reduces
float16 in software): both move as 16-bit words, and reduce in float32,
rounded back.

Stream order without blocking the host: an op on CUDA tensors is not started
when it is called but once the work queued on the caller's stream before it
has run (a CUDA event the progress engine polls: no stream synchronize). MPI
matches the collectives of a communicator in the order they start, so every
op of the backend called meanwhile, on CPU tensors too, queues behind it
(:class:`DeferredPending`): starts keep program order on every rank.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import sys
import threading
from collections import deque
from typing import Any, Callable, Optional, Sequence

import torch

from .. import facts, settings
from ..types import ReduceOp
from ..work import DONE, Pending, busy_seconds, current_stream, spin_until
from . import native as native_path
from .base import ANY_SOURCE, OPS, Backend, Context


settings.declare(
    settings.Setting("MCRDL_MPI_CUDA_AWARE", "flag", None, "does MPI take CUDA memory (default: the MPI "
                     "library's own answer, else no)"),
    settings.Setting("MCRDL_MPI_RS_ALLTOALL", "text", None, "`LO:HI` output bytes per rank where "
                     "reduce_scatter_tensor runs as an all-to-all and a local reduction (default: a band on "
                     "MPICH)", accepts="LO:HI or off"))


def cuda_support() -> tuple[bool, str]:
    """(does MPI take CUDA device memory, how that was decided):
    ``MCRDL_MPI_CUDA_AWARE=1|0`` when set, else the loaded MPI library's own
    answer (``MPIX_Query_cuda_support``, in MPICH and Open MPI), else no."""
    aware = settings.get("MCRDL_MPI_CUDA_AWARE")
    if aware is not None:
        return aware, f"MCRDL_MPI_CUDA_AWARE={int(aware)}"
    for path in _mpi_library_paths():  # asking needs no CUDA
        try:
            query = ctypes.CDLL(path).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        return bool(query()), "MPIX_Query_cuda_support"
    return False, "the MPI library does not say"


def _mpi_library_paths() -> list[str]:
    """The MPI libraries loaded in this process (mpi4py's; Linux's /proc)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return sorted({f[5].strip() for f in (line.split(maxsplit=5) for line in maps)
                           if len(f) == 6 and "libmpi" in f[5] and f[5].startswith("/")})
    except OSError:
        return []


def library_name(MPI) -> str:
    """The first line of MPI's library version (Open MPI ends it in a NUL)."""
    return MPI.Get_library_version().replace("\0", "").strip().splitlines()[0].strip()


def import_mpi():
    """mpi4py's MPI module, with full thread support (the futures thread polls too).
    Importing it never starts MPI: mcrdl starts it (:func:`init_launched`, or
    :func:`mcrdl.pmi.bring_up` when no MPI launcher started the ranks)."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.thread_level = "multiple"
        mpi4py.rc.initialize = False  # a process no MPI launcher started would become a singleton
        mpi4py.rc.finalize = False  # finalize_at_exit: without the GIL
    from mpi4py import MPI

    return MPI


def _loaded_library() -> ctypes.CDLL:
    """The MPI library mpi4py loaded, to call without the GIL (ctypes releases it)."""
    for path in _mpi_library_paths():
        lib = ctypes.CDLL(path)
        if hasattr(lib, "MPI_Init_thread"):
            return lib
    raise RuntimeError("the MPI library mpi4py uses is not among this process's loaded libraries")


def init_thread(MPI) -> None:
    """``MPI_Init_thread`` (multiple) without the GIL, so a PMI service thread in this
    process can answer it; ``MPI_Finalize`` likewise at exit."""
    lib = _loaded_library()
    provided = ctypes.c_int(0)
    rc = lib.MPI_Init_thread(None, None, MPI.THREAD_MULTIPLE, ctypes.byref(provided))
    if rc != 0:
        raise RuntimeError(f"MPI_Init_thread failed (error {rc})")
    atexit.register(finalize_at_exit, lib)


def finalize_at_exit(lib: ctypes.CDLL) -> None:
    """MPI_Finalize, unless done already, without the GIL."""
    done = ctypes.c_int(0)
    lib.MPI_Finalized(ctypes.byref(done))
    if not done.value:
        lib.MPI_Finalize()


def init_launched():
    """MPI of a job an MPI launcher started (or of a single process), initialised."""
    MPI = import_mpi()
    if not MPI.Is_initialized():
        init_thread(MPI)
    return MPI


#: Tag of communicator creation on the world communicator: members check in on
#: the store first, so no two creations involving one rank overlap.
GROUP_TAG = 7411
INT_MAX = 2**31 - 1  # MPI's count type in the compiled calls
#: Seconds a compiled call waits before it hands the still-pending request to
#: the engine, whose wait sees the op's deadline, dead peers and Ctrl-C.
NATIVE_WAIT_S = 0.1
#: (lowest, highest output bytes per rank, largest group) for which
#: reduce_scatter_tensor runs as an all-to-all and a local reduction on MPICH:
#: at 2 ranks its nonblocking reduce-scatter there can take 3.5x its blocking
#: call (docs/backends.md, "reduce_scatter_tensor on MPICH").
MPICH_ROWS = (256 << 10, 512 << 10, 2)
NO_ROWS = (1, 0, 0)


def rows_rule(library: str) -> tuple[int, int, int]:
    """When reduce_scatter_tensor on CPU tensors reduces locally after an
    all-to-all: ``MCRDL_MPI_RS_ALLTOALL=LO:HI`` (output bytes per rank, any
    group; set alike on every rank, as the launcher does) or ``off`` when set,
    else :data:`MPICH_ROWS` on MPICH and never on other libraries."""
    spec = settings.get("MCRDL_MPI_RS_ALLTOALL")
    if spec is None:
        return MPICH_ROWS if library.startswith("MPICH") else NO_ROWS
    if spec.strip().lower() == "off":
        return NO_ROWS
    lo, sep, hi = spec.partition(":")
    if sep and lo.strip().isdigit() and hi.strip().isdigit():
        return int(lo), int(hi), INT_MAX
    raise ValueError(f"MCRDL_MPI_RS_ALLTOALL={spec!r}: expected LO:HI in bytes (such as 131072:524288) or off")


class MPIPending(Pending):
    """An mpi4py request; MPI progresses only inside MPI calls. It holds the
    tensors whose memory MPI uses (raw addresses keep nothing alive)."""

    progress_domain = "mpi"
    __slots__ = ("req", "keep")

    def __init__(self, req, *keep: torch.Tensor):
        self.req = req
        self.keep = keep

    def test(self) -> bool:
        return self.req.Test()

    def block(self, deadline: float) -> bool:
        test = self.req.Test
        return test() or spin_until(test, deadline)


class MPIP2PPending(MPIPending):
    """A point-to-point request: it can be withdrawn after a deadline."""

    __slots__ = ()

    def cancel(self) -> None:
        if not self.req:  # completed and freed (MPI_REQUEST_NULL): cancelling it is
            return        # erroneous, and Open MPI may crash instead of raising
        try:
            self.req.Cancel()
        except Exception:  # already matched or completed: nothing to withdraw
            pass


class MPIAnySourcePending(MPIP2PPending):
    """A receive from any source: its status names the sender."""

    __slots__ = ("status", "src")

    def __init__(self, req, status, *keep: torch.Tensor):
        super().__init__(req, *keep)
        self.status = status
        self.src = -1

    def test(self) -> bool:  # src: -1 pending, -2 cancelled (no sender), else the sender
        if self.src == -1 and self.req.Test(self.status):
            self.src = -2 if self.status.Is_cancelled() else self.status.Get_source()
        return self.src != -1

    def block(self, deadline: float) -> bool:
        return self.test() or spin_until(self.test, deadline)

    def source(self) -> int:
        return self.src


class DeferredPending(Pending):
    """An op started later: once ``ready`` (True, or an object whose
    ``query()`` says so: a CUDA event) and every op submitted before it on its
    backend has started (:meth:`MPIBackend.defer`). Polling it starts it."""

    __slots__ = ("backend", "start", "device", "ready", "inner", "cancelled")

    def __init__(self, backend: "MPIBackend", start: Callable[[], Pending], device: Optional[torch.device] = None):
        self.backend, self.start = backend, start
        self.device = device  # the CUDA device current while it starts (any thread may start it)
        self.ready: Any = True
        self.inner: Optional[Pending] = None
        self.cancelled = False

    @property
    def progress_domain(self) -> str:
        """Its backend's own (not "mpi"): a wait on another MPI request, or on
        another backend's queue, must still poll this one, or it never starts."""
        return self.backend.deferred_domain

    def test(self) -> bool:
        if self.backend.queue:  # whichever op is waited for starts those behind it: a wait
            self.backend.start_ready()  # on a receive must start the send its peer waits for
        return self.inner is not None and self.completed()

    def completed(self) -> bool:
        """Has the started op completed?"""
        return self.inner.test()

    def cancel(self) -> None:
        """A missed deadline. Nothing is withdrawn from the queue: MPI matches a
        communicator's collectives, and a peer's messages, in start order, and
        the other side may have started its part, so dropping this op would
        pair every later one with the wrong call. It starts in its turn (now,
        if ready), is cancelled in MPI then (a send or receive; a collective
        completes unobserved), and is polled until it completes."""
        with self.backend.lock:
            self.cancelled = True
            if self.inner is None:
                self.backend._start_ready()  # (cancels it if it starts)
            else:
                self.inner.cancel()

    def source(self) -> int:
        return self.inner.source()


class _Failed(Pending):
    """A deferred op whose MPI call raised when it was started."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error

    def test(self) -> bool:
        raise self.error


class MPIBackend(Backend):
    name = "mpi"
    needs = frozenset({"launcher"})
    #: CUDA tensors go to a CUDA-aware MPI as they are (False: a subclass moves them itself)
    direct_cuda = True
    raw_ops = frozenset({"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather",
                         "scatter", "all_to_all", "all_to_allv", "p2p"})

    @classmethod
    def unavailable_reason(cls, ctx: Context) -> Optional[str]:
        if ctx.mpi_comm is None:
            return ctx.mpi_missing or "MPI was not started (no MPI launcher and no store to start it over)"
        return None

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        MPI = self.MPI = import_mpi()
        self.cuda_aware, self.cuda_aware_source = cuda_support()
        self.devices = frozenset({"cpu", "cuda"} if self.cuda_aware and self.direct_cuda else {"cpu"})
        self.queue: deque[DeferredPending] = deque()  # submitted, not started: in submission order
        self.lock = threading.Lock()  # the queue: submitting threads and the engine's futures thread
        self.deferred_domain = "deferred:" + self.name
        self.ordered = False  # every op in stream order (order_after_streams)
        self.side: dict[torch.device, tuple] = {}  # per device: two private streams
        # Datatypes used to move bytes (every dtype) and to reduce (not bf16/bool).
        self.move_types = {
            torch.float16: MPI.UINT16_T, torch.bfloat16: MPI.UINT16_T, torch.float32: MPI.FLOAT,
            torch.float64: MPI.DOUBLE, torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T,
            torch.int16: MPI.INT16_T, torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
            torch.bool: MPI.UINT8_T,
        }
        self.reduce_types = {
            torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE,
            torch.int8: MPI.INT8_T, torch.uint8: MPI.UINT8_T, torch.int16: MPI.INT16_T,
            torch.int32: MPI.INT32_T, torch.int64: MPI.INT64_T,
        }
        # float16 reductions are widened to float32 like bfloat16: MPICH reduces
        # MPI_FLOAT16_T in software, 7x slower than float32 here.
        self.reduce_ops = {ReduceOp.SUM: MPI.SUM, ReduceOp.PRODUCT: MPI.PROD,
                           ReduceOp.MIN: MPI.MIN, ReduceOp.MAX: MPI.MAX}
        self._fromaddress = MPI.buffer.fromaddress  # bound once: on the latency-critical path
        self._in_place = MPI.IN_PLACE
        #: The compiled hot path (backends/native.py), or None: pure Python.
        self.native = native_path.load()
        if self.native is not None:
            self.native.set_busy(busy_seconds())
            checks = facts.load()
            if checks is not facts:  # the compiled driver starts its starters without Python
                checks.adopt_starter(self.native.Starter, self.native.start, self.native.Request,
                                     MPIPending.progress_domain)
                facts.provided("MPIBackend's starts of planned calls", "Starter (backends/mpi_native.c), "
                               "started by drive")
        self.rows_rule = rows_rule(self.version())
        if "cuda" in self.devices:
            self.order_after_streams()

    @classmethod
    def info_lines(cls, live):
        if not live:
            return []
        aware, how = cuda_support()
        return [f"MPI hot path: {native_path.status()}",
                f"MPI takes CUDA memory: {'yes' if aware else 'no'} ({how})"]

    def version(self) -> str:
        return library_name(self.MPI)

    def raw_calls(self, h, inp, out, part):
        """mpi4py's own calls on numpy views of the buffers (made once), on the launcher's communicator."""
        MPI, comm, rank = self.MPI, self.ctx.mpi_comm, self.ctx.rank
        a, b = (None if t is None else t.numpy() for t in (inp, out))
        counts = [part] * self.ctx.world_size
        displs = [i * part for i in range(self.ctx.world_size)]
        return {
            "all_reduce": lambda: comm.Allreduce(MPI.IN_PLACE, a),
            "broadcast": lambda: comm.Bcast(a, 0),
            "reduce": lambda: comm.Reduce(MPI.IN_PLACE if rank == 0 else a, a if rank == 0 else None, MPI.SUM, 0),
            "all_gather": lambda: comm.Allgather(a, b),
            "reduce_scatter": lambda: comm.Reduce_scatter_block(a, b, MPI.SUM),
            "gather": lambda: comm.Gather(a, b, 0),
            "scatter": lambda: comm.Scatter(a, b, 0),
            "all_to_all": lambda: comm.Alltoall(a, b),
            "all_to_allv": lambda: comm.Alltoallv([a, counts, displs, MPI.FLOAT], [b, counts, displs, MPI.FLOAT]),
            "p2p": (lambda t, peer: comm.Send(a, peer), lambda t, peer: comm.Recv(a, peer)),
        }

    def unsupported(self, op, dtype, reduce_op, device):
        if dtype not in self.move_types:
            return f"MPI backend has no datatype for {dtype}"
        return None

    def new_group(self, ranks, group_rank, store, timeout):
        world = self.ctx.mpi_comm
        if len(ranks) == world.Get_size():
            return world.Dup()
        world_group = world.Get_group()
        members = world_group.Incl(list(ranks))
        try:  # collective over the members only (MPI-3), like torch's new_group
            return world.Create_group(members, GROUP_TAG)
        finally:
            members.Free()
            world_group.Free()

    def destroy_group(self, handle):
        if handle is not None:
            handle.Free()

    # -- starts in stream order ------------------------------------------------------
    def order_after_streams(self) -> None:
        """Make every op start in stream order (module docstring): called when
        this backend takes CUDA tensors. The ops become instance attributes
        that defer a call with a CUDA tensor, and any call while others wait;
        the blocking fast paths' starts queue too while others wait."""
        if self.ordered:
            return
        self.ordered = True
        for op in OPS:
            run = getattr(self, op)
            setattr(self, op, lambda h, *args, _run=run: self._in_order(_run, h, args))

    def _in_order(self, run: Callable[..., Pending], h, args: tuple) -> Pending:
        t = self.device_tensor(args)
        if t is None and not self.queue:
            return run(h, *args)
        return self.defer(DeferredPending(self, lambda: run(h, *args), t.device if t is not None and t.is_cuda
                                          else None),
                          lambda: True if t is None else self.stream_event(t))

    @staticmethod
    def device_tensor(args: tuple) -> Optional[torch.Tensor]:
        """The first CUDA tensor among an op's arguments, if any."""
        return next((a for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)

    @staticmethod
    def stream_event(t: torch.Tensor):
        """An event after the work queued so far on ``t``'s current stream."""
        event = torch.cuda.Event()
        event.record(current_stream(t.get_device()))
        return event

    def defer(self, pending: DeferredPending, ready: Callable[[], Any]) -> DeferredPending:
        """Queue ``pending`` (its ``ready`` made under the lock, so side-stream
        work is queued in submission order too) and start what can start."""
        with self.lock:
            pending.ready = ready()
            self.queue.append(pending)
            self._start_ready()
        return pending

    def start_ready(self) -> None:
        with self.lock:
            self._start_ready()

    def _start_ready(self) -> None:
        """Start the queued ops that are ready, oldest first, stopping at the
        first that is not (so starts keep their order on every rank). A
        failure is the failing op's own."""
        queue = self.queue
        while queue:
            head = queue[0]
            try:
                if not (head.ready is True or head.ready.query()):
                    return
                if head.device is None:
                    head.inner = head.start()
                else:
                    with torch.cuda.device(head.device):
                        head.inner = head.start()
                if head.cancelled:  # its deadline passed while it waited
                    head.inner.cancel()
            except Exception as exc:
                head.inner = _Failed(exc)
            queue.popleft()

    def streams(self, device: torch.device) -> tuple:
        """Two private streams on ``device``: work into MPI's buffers, and back."""
        pair = self.side.get(device)
        if pair is None:
            pair = self.side[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return pair

    def _private(self, t: torch.Tensor, back: bool):
        """Where a deferred op's own CUDA work runs, finished before MPI (or
        the caller) sees its result; CPU: in place."""
        if not t.is_cuda:
            return contextlib.nullcontext()
        return _synchronized(self.streams(t.device)[back])

    # -- buffers -----------------------------------------------------------------
    def _buf(self, t: torch.Tensor, types=None):
        """Zero-copy [buffer, datatype] for a contiguous tensor (mpi4py derives
        the count, per peer for the gather/scatter families). A CUDA tensor is
        ready: its op started after its stream's work."""
        dt = (types or self.move_types)[t.dtype]
        if t.is_cuda:
            return [t, dt]
        return [self.MPI.buffer.fromaddress(t.data_ptr(), t.nbytes), dt]

    def _reduction(self, tensors, start):
        """Run a reduction; bf16 (no MPI type) runs in float32 and rounds back."""
        if tensors[0].dtype in self.reduce_types:
            return MPIPending(start(*[self._buf(t, self.reduce_types) for t in tensors]), *tensors)
        with torch.no_grad(), self._private(tensors[0], back=False):
            wide = [t.float() for t in tensors]
        pending = MPIPending(start(*[self._buf(w, self.reduce_types) for w in wide]), *wide)
        target, result = tensors[-1], wide[-1]
        return _Finish(pending, lambda: target.copy_(result), lambda: self._private(target, back=True))

    def _by_rows(self, comm, output: torch.Tensor, op: ReduceOp) -> bool:
        """Does this reduce_scatter_tensor run as an all-to-all of the input's
        rows and a local reduction (:func:`rows_rule`)?"""
        lo, hi, ranks = self.rows_rule
        return lo <= output.nbytes <= hi and output.is_cpu and comm.Get_size() <= ranks and op in ROW_REDUCTIONS

    # -- operations --------------------------------------------------------------
    def all_reduce(self, comm, tensor, op):
        mop = self.reduce_ops[op]
        dt = self.reduce_types.get(tensor.dtype)
        if dt is not None and tensor.is_cpu:  # the latency-critical case, inlined
            buf = [self._fromaddress(tensor.data_ptr(), tensor.nbytes), dt]
            return MPIPending(comm.Iallreduce(self._in_place, buf, mop), tensor)
        return self._reduction([tensor], lambda b: comm.Iallreduce(self._in_place, b, mop))

    # -- the fast paths' starters: compiled start-and-wait where possible ----------
    def starter(self, op, comm, timeout, tensors, *fixed):
        """The compiled start-and-wait where it applies, else Python. It does not
        call the op methods (a subclass that changes an op changes this too),
        except behind queued ops when ordered (:meth:`order_after_streams`)."""
        build = getattr(self, "_native_" + op, None) if self.native is not None else None
        if build is not None and all(t is None or t.numel() <= INT_MAX for t in tensors):
            start = build(comm, min(timeout, NATIVE_WAIT_S), *tensors, *fixed)
        else:  # (the compiled calls count in C int; mpi4py has MPI's large-count calls)
            start = None
        if start is None and op == "all_reduce":
            start = self._all_reduce_starter(comm, tensors[0].dtype, *fixed)
        if start is None or not self.ordered:
            return start or super().starter(op, comm, timeout, tensors, *fixed)
        # ops may be queued even with no work outstanding (one abandoned at its
        # deadline): this start must not overtake them
        queue, fast, queued = self.queue, start, self.nonblocking(op, comm, *fixed)
        return lambda *args: queued(*args) if queue else fast(*args)

    def _all_reduce_starter(self, comm, dtype, op):
        """Pure-Python all_reduce with its set-up done once."""
        dt = self.reduce_types.get(dtype)
        if dt is None:  # widened to float32 and rounded back: the general path
            return None
        iallreduce, in_place, fromaddress, mop = comm.Iallreduce, self._in_place, self._fromaddress, self.reduce_ops[op]
        return lambda t: MPIPending(iallreduce(in_place, [fromaddress(t.data_ptr(), t.nbytes), dt], mop), t)

    # Each builds the op's compiled starter (mpi_native.c's Starter: start(*args)
    # -> DONE, or the still-pending request after ``timeout``), or None where
    # the op or dtype has no compiled form here.
    def _native_all_reduce(self, comm, timeout, t, op):
        dt = self.reduce_types.get(t.dtype)
        return None if dt is None else self.native.Starter("all_reduce", comm, dt, t.numel(), timeout,
                                                           self.reduce_ops[op])

    def _native_broadcast(self, comm, timeout, t, root):
        return self.native.Starter("broadcast", comm, self.move_types[t.dtype], t.numel(), timeout,
                                   root=root)

    def _native_reduce(self, comm, timeout, t, root, op):
        dt = self.reduce_types.get(t.dtype)
        return None if dt is None else self.native.Starter("reduce", comm, dt, t.numel(), timeout,
                                                           self.reduce_ops[op], root)

    def _native_all_gather_into_tensor(self, comm, timeout, output, input):
        return self.native.Starter("all_gather_into_tensor", comm, self.move_types[input.dtype], input.numel(),
                                   timeout)

    def _native_reduce_scatter_tensor(self, comm, timeout, output, input, op):
        if self._by_rows(comm, output, op):
            return self._native_rows(comm, timeout, output, op)
        dt = self.reduce_types.get(output.dtype)
        return None if dt is None else self.native.Starter("reduce_scatter_tensor", comm, dt, output.numel(),
                                                           timeout, self.reduce_ops[op])

    def _native_rows(self, comm, timeout, output, op):
        """reduce_scatter_tensor as the compiled all-to-all, then the local reduction."""
        n, count = comm.Get_size(), output.numel()
        run = self.native.Starter("all_to_all_single", comm, self.move_types[output.dtype], count, timeout)

        def start(out, inp):
            rows = torch.empty((n, count), dtype=inp.dtype)
            pending = run(rows, inp, None, None)
            if pending is DONE:
                reduce_rows(rows, out, op)
                return DONE
            return _Finish(pending, lambda: reduce_rows(rows, out, op), contextlib.nullcontext)
        return start

    def _native_gather(self, comm, timeout, output, input, root):
        return self.native.Starter("gather", comm, self.move_types[input.dtype], input.numel(), timeout,
                                   root=root)

    def _native_scatter(self, comm, timeout, output, input, root):
        return self.native.Starter("scatter", comm, self.move_types[output.dtype], output.numel(), timeout,
                                   root=root)

    def _native_all_to_all_single(self, comm, timeout, output, input):
        return self.native.Starter("all_to_all_single", comm, self.move_types[input.dtype],
                                   input.numel() // comm.Get_size(), timeout)

    def _native_send(self, comm, timeout, t, peer, tag):
        return self.native.Starter("send", comm, self.move_types[t.dtype], t.numel(), timeout,
                                   root=peer, tag=tag)

    def _native_recv(self, comm, timeout, t, peer, tag):
        return self.native.Starter("recv", comm, self.move_types[t.dtype], t.numel(), timeout,
                                   root=peer, tag=tag)

    def broadcast(self, comm, tensor, root):
        return MPIPending(comm.Ibcast(self._buf(tensor), root), tensor)

    def reduce(self, comm, tensor, root, op):
        mop, MPI = self.reduce_ops[op], self.MPI
        if comm.Get_rank() == root:
            return self._reduction([tensor], lambda b: comm.Ireduce(MPI.IN_PLACE, b, mop, root))
        return self._reduction([tensor], lambda b: comm.Ireduce(b, None, mop, root))

    def all_gather_into_tensor(self, comm, output, input):
        return MPIPending(comm.Iallgather(self._buf(input), self._buf(output)), input, output)

    def reduce_scatter_tensor(self, comm, output, input, op):
        if self._by_rows(comm, output, op):
            rows = input.new_empty((comm.Get_size(), output.numel()))
            return _Finish(MPIPending(comm.Ialltoall(self._buf(input), self._buf(rows)), input, rows),
                           lambda: reduce_rows(rows, output, op), lambda: self._private(output, back=True))
        mop = self.reduce_ops[op]
        return self._reduction([input, output],
                               lambda i, o: comm.Ireduce_scatter_block(i, o, mop))

    def gather(self, comm, output, input, root):
        out = self._buf(output) if output is not None else None
        return MPIPending(comm.Igather(self._buf(input), out, root), input, output)

    def scatter(self, comm, output, input, root):
        inp = self._buf(input) if input is not None else None
        return MPIPending(comm.Iscatter(inp, self._buf(output), root), input, output)

    def all_to_all_single(self, comm, output, input, output_counts, input_counts):
        ib, ob = self._buf(input), self._buf(output)
        if input_counts is None:  # no split sizes on any rank: MPICH's Ialltoall is faster
            return MPIPending(comm.Ialltoall(ib, ob), input, output)
        return MPIPending(comm.Ialltoallv([ib[0], (input_counts, _displs(input_counts)), ib[1]],
                                          [ob[0], (output_counts, _displs(output_counts)), ob[1]]),
                          input, output)

    def barrier(self, comm):
        return MPIPending(comm.Ibarrier())

    def send(self, comm, tensor, peer, tag):
        return MPIP2PPending(comm.Isend(self._buf(tensor), peer, tag), tensor)

    def recv(self, comm, tensor, peer, tag):
        if peer == ANY_SOURCE:
            return MPIAnySourcePending(comm.Irecv(self._buf(tensor), self.MPI.ANY_SOURCE, tag),
                                       self.MPI.Status(), tensor)
        return MPIP2PPending(comm.Irecv(self._buf(tensor), peer, tag), tensor)


def _displs(counts: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


#: MPI's reduction ops as torch's elementwise ones (chained: a reduction over
#: dim 0, ``torch.sum(rows, 0)``, was slower than ``torch.add`` for 2 rows)
ROW_REDUCTIONS = {ReduceOp.SUM: torch.add, ReduceOp.PRODUCT: torch.mul,
                  ReduceOp.MIN: torch.minimum, ReduceOp.MAX: torch.maximum}


def reduce_rows(rows: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> None:
    """``out`` = ``op`` over the rows of ``rows`` (n x out.numel()), in rank
    order; 16-bit floats accumulate in float32 and round once, like MPI's
    widened path."""
    fn, flat = ROW_REDUCTIONS[op], out.view(-1)
    with torch.no_grad():
        if len(rows) == 1:
            flat.copy_(rows[0])
            return
        wide = out.dtype in (torch.float16, torch.bfloat16) and op in (ReduceOp.SUM, ReduceOp.PRODUCT)
        acc = fn(rows[0].float(), rows[1]) if wide else fn(rows[0], rows[1], out=flat)
        for row in rows[2:]:
            fn(acc, row, out=acc)
        if wide:
            flat.copy_(acc)


class _Finish(Pending):
    """A pending op with a local step once it completes: a widened reduction
    rounded back into 16-bit floats, an all-to-all's rows reduced."""

    progress_domain = "mpi"

    def __init__(self, inner: Pending, finish: Callable[[], Any], where: Callable):
        self.inner, self.finish, self.where = inner, finish, where  # where(): the step's context
        self.cancelled = self.finished = False

    def _finish(self, done: bool) -> bool:
        if done and not (self.cancelled or self.finished):  # (a missed deadline: the caller was told it failed)
            with torch.no_grad(), self.where():
                self.finish()
            self.finished = True
        return done

    def cancel(self) -> None:
        self.cancelled = True
        self.inner.cancel()

    def test(self) -> bool:
        return self._finish(self.inner.test())

    def block(self, deadline: float) -> bool:
        return self._finish(self.inner.block(deadline))


@contextlib.contextmanager
def _synchronized(stream):
    """Run on ``stream``, and wait for it on leaving (it holds only this work)."""
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()

