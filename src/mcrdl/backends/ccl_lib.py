"""Thin ctypes binding to Intel oneCCL's C API (``oneapi/ccl.h``, 2022.2.0, CPU).

Install the libraries with ``scripts/install_oneccl.sh VENV``. That puts
libccl.so.1 (from oneccl-cpu), libccl.so.2 (the C API) and
libccl_legacy_cpu.so (its CPU plugin) in ``VENV/lib``. oneCCL talks through
libfabric, here the copy bundled in the ``mpich`` wheel (``VENV/lib/mpich``).
Set ``MCRDL_CCL_LIB`` (their folder) or ``MCRDL_CCL_LIBFABRIC`` to use other files.

The calls are blocking on host buffers. Arguments are raw addresses
(``tensor.data_ptr()``) and element counts. The stream argument is always
NULL. Every call runs through :class:`ctypes.CDLL`, which releases the GIL, so
a thread blocked in a collective does not stop the rest of Python.

oneCCL reads its settings once, when it loads. :func:`load` therefore puts
:func:`environment` into ``os.environ`` first. Anything the user has already
set is left alone.

    uid = ccl_lib.unique_id() if rank == 0 else None   # then share the 4096 bytes
    comm = ccl_lib.Comm(uid, world, rank)
    comm.all_reduce(t.data_ptr(), t.data_ptr(), t.numel(),
                    ccl_lib.DTYPES[t.dtype], ccl_lib.REDUCTIONS["sum"])
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading
from typing import Optional, Sequence

from .. import settings

settings.declare(
    settings.Setting("MCRDL_CCL_LIB", "text", None, "the folder holding oneCCL's libccl.so.1, libccl.so.2 and "
                     "libccl_legacy_cpu.so (default: the virtualenv's `lib`, where scripts/install_oneccl.sh "
                     "puts them)", accepts="a directory"),
    settings.Setting("MCRDL_CCL_LIBFABRIC", "text", None, "the libfabric.so.1 oneCCL uses (default: the one "
                     "in the `mpich` wheel)", accepts="a path"))

#: Bytes in an ``onecclUniqueId``.
UNIQUE_ID_BYTES = 4096

#: ``onecclDataType_t`` codes by name (all of them in the header).
DTYPE_CODES = {"int8": 0, "uint8": 1, "int32": 2, "uint32": 3, "int64": 4, "uint64": 5,
               "float16": 6, "float32": 7, "float64": 8, "bfloat16": 9}

#: ``onecclRedOp_t`` codes for the predefined reductions that work on CPU. The header also has
#: ``onecclAvg`` (4), but the CPU plugin rejects it ("Unsupported onecclRedOp_t value").
REDUCTIONS = {"sum": 0, "prod": 1, "max": 2, "min": 3}

#: ``onecclResult_t`` names, for messages when the error string is unavailable.
RESULTS = {0: "onecclSuccess", 1: "onecclError", 2: "onecclSystemError",
           3: "onecclInternalError", 4: "onecclInvalidArgument", 5: "onecclInvalidUsage",
           6: "onecclInProgress", 7: "onecclFailureGPU", 8: "onecclFailureCPU",
           9: "onecclAllocFailureCPU", 10: "onecclAllocFailureGPU",
           11: "onecclPluginException", 12: "onecclNotImplemented"}


def environment() -> dict:
    """The CCL_*/FI_* defaults :func:`load` adds to ``os.environ``, leaving out
    any the user already set. They only take effect if they are in place
    before oneCCL loads."""
    defaults = {
        # No launcher or MPI under oneCCL: its own OFI transport, rendezvous via the unique id.
        "CCL_ATL_TRANSPORT": "ofi",
        # The providers the mpich wheel's libfabric has; "shm" alone aborts at init.
        "FI_PROVIDER": "shm,tcp",
        # Intra-node ranks use shared memory in the OFI transport.
        "CCL_ATL_SHM": "1",
        # With the default "pause" spin, every small op took 31-82 ms on 2 busy cores.
        "CCL_YIELD": "sched_yield",
        # Run ops on the calling thread, not a worker: small-op floor ~100 us -> ~9 us.
        "CCL_WORKER_OFFLOAD": "0",
        # One worker thread per process (the default spawns more).
        "CCL_WORKER_COUNT": "1",
        # Ranks of a communicator come from the unique id, not from a launcher's variables
        # (under mpiexec those describe the world, not a sub-group's communicator).
        "CCL_PROCESS_LAUNCHER": "none",
        # Its start-up warnings (every setting above "changed", ...) on every rank, every job.
        "CCL_LOG_LEVEL": "error",
    }
    return {k: v for k, v in defaults.items() if k not in os.environ}


#: the three libraries in :func:`lib_dir`, with the wheel each comes from
LIBRARIES = (("libccl.so.1", "oneccl-cpu"), ("libccl.so.2", "oneccl"), ("libccl_legacy_cpu.so", "oneccl"))


def lib_dir() -> str:
    return settings.get("MCRDL_CCL_LIB") or os.path.join(sys.prefix, "lib")


def libfabric() -> Optional[str]:
    """libfabric.so.1: $MCRDL_CCL_LIBFABRIC, else the mpich wheel's copy."""
    given = settings.get("MCRDL_CCL_LIBFABRIC")
    if given:
        return given
    found = sorted(glob.glob(os.path.join(sys.prefix, "lib", "mpich", "libfabric.so.1"))) + sorted(
        glob.glob(os.path.join(sys.prefix, "lib", "python3*", "site-packages", "mpich*", "**",
                               "libfabric.so.1"), recursive=True))
    return found[0] if found else None


class OneCCLError(RuntimeError):
    """A oneCCL call returned an error: ``func``, ``code`` and oneCCL's message."""

    def __init__(self, func: str, code: int, message: str):
        super().__init__(f"{func} failed: {RESULTS.get(code, code)} ({code}): {message}")
        self.func, self.code = func, code


class _UniqueId(ctypes.Structure):
    _fields_ = [("data", ctypes.c_char * UNIQUE_ID_BYTES)]


_P, _N, _I, _T = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int  # _T: enums
_PROTOS = {  # name: argtypes; all return onecclResult_t (int) unless listed in _RESTYPES
    "onecclGetVersion": [ctypes.POINTER(_I)],
    "onecclGetUniqueId": [ctypes.POINTER(_UniqueId)],
    "onecclCommInitRank": [ctypes.POINTER(_P), _N, _UniqueId, _I],
    "onecclCommSplit": [_P, _I, _I, ctypes.POINTER(_P), _P],
    "onecclCommFinalize": [_P],
    "onecclCommDestroy": [_P],
    "onecclCommCount": [_P, ctypes.POINTER(_I)],
    "onecclCommUserRank": [_P, ctypes.POINTER(_I)],
    "onecclGetErrorString": [_T],
    "onecclGetLastError": [_P],
    "onecclAllReduce": [_P, _P, _N, _T, _T, _P, _P],
    "onecclBroadcast": [_P, _P, _N, _T, _I, _P, _P],
    "onecclReduce": [_P, _P, _N, _T, _T, _I, _P, _P],
    "onecclReduceScatter": [_P, _P, _N, _T, _T, _P, _P],
    "onecclAllGather": [_P, _P, _N, _T, _P, _P],
    "onecclScatter": [_P, _P, _N, _T, _I, _P, _P],
    "onecclAllToAll": [_P, _P, _N, _T, _P, _P],
    "onecclAllToAllV": [_P, ctypes.POINTER(_N), _P, ctypes.POINTER(_N), _T, _P, _P],
    "onecclSend": [_P, _N, _T, _I, _P, _P],
    "onecclRecv": [_P, _N, _T, _I, _P, _P],
    "onecclGroupStart": [],
    "onecclGroupEnd": [],
}
_RESTYPES = {"onecclGetErrorString": ctypes.c_char_p, "onecclGetLastError": ctypes.c_char_p}

def missing() -> Optional[str]:
    """Why :func:`load` would fail for a missing file (checked without loading), or None."""
    fabric = libfabric()
    if not fabric or not os.path.exists(fabric):
        return (f"oneCCL needs libfabric.so.1 from the `mpich` wheel; not found "
                f"{'at ' + fabric if fabric else 'under ' + sys.prefix} (pip install mpich, or set "
                "MCRDL_CCL_LIBFABRIC)")
    folder = lib_dir()
    absent = [f"{name} (from the `{pkg}` wheel)" for name, pkg in LIBRARIES
              if not os.path.exists(os.path.join(folder, name))]
    if absent:
        return (f"oneCCL is not installed: {', '.join(absent)} missing in {folder}; run "
                f"scripts/install_oneccl.sh {sys.prefix} (or set MCRDL_CCL_LIB)")
    return None


_lock = threading.Lock()
_loaded: Optional[ctypes.CDLL] = None


def load() -> ctypes.CDLL:
    """Set the :func:`environment` defaults, load libfabric (global), then
    libccl.so.1, libccl.so.2 and libccl_legacy_cpu.so. Returns the C API
    library with argtypes/restype declared for every function used here.
    Cached. Raises OSError naming the missing file or package."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        why = missing()
        if why is not None:
            raise OSError(why)
        fabric = libfabric()
        paths = [os.path.join(lib_dir(), name) for name, _ in LIBRARIES]
        for k, v in environment().items():
            os.environ[k] = v
        ctypes.CDLL(fabric, mode=ctypes.RTLD_GLOBAL)  # oneCCL dlopen()s "libfabric.so.1" by name
        ctypes.CDLL(paths[0], mode=ctypes.RTLD_GLOBAL)
        lib = ctypes.CDLL(paths[1], mode=ctypes.RTLD_GLOBAL)
        ctypes.CDLL(paths[2], mode=ctypes.RTLD_GLOBAL)  # the plugin libccl.so.2 dlopen()s
        for name, argtypes in _PROTOS.items():
            fn = getattr(lib, name)
            fn.argtypes = argtypes
            fn.restype = _RESTYPES.get(name, ctypes.c_int)
        _loaded = lib
        return lib


def loaded() -> bool:
    """Has this process loaded oneCCL (a job that never ran a ccl op has not)?"""
    return _loaded is not None


def _check(func: str, code: int, comm=None) -> None:
    if code == 0:
        return
    lib = load()
    msg = (lib.onecclGetErrorString(code) or b"").decode(errors="replace")
    if comm:
        last = (lib.onecclGetLastError(comm) or b"").decode(errors="replace")
        if last and last != msg:
            msg = f"{msg}; last error: {last}"
    raise OneCCLError(func, code, msg or "(no message)")


def version() -> str:
    """oneCCL's version, e.g. ``'2022.2.0'`` (from ``onecclGetVersion``)."""
    v = ctypes.c_int()
    _check("onecclGetVersion", load().onecclGetVersion(ctypes.byref(v)))
    major, rest = divmod(v.value, 10000)
    return f"{major}.{rest // 100}.{rest % 100}"


def unique_id() -> bytes:
    """A new ``onecclUniqueId`` (4096 bytes). Make it on one rank and give it to all."""
    uid = _UniqueId()
    _check("onecclGetUniqueId", load().onecclGetUniqueId(ctypes.byref(uid)))
    return ctypes.string_at(ctypes.addressof(uid), UNIQUE_ID_BYTES)


def group_start() -> None:
    """``onecclGroupStart``: the following calls (e.g. matching send/recv) run together at :func:`group_end`."""
    _check("onecclGroupStart", load().onecclGroupStart())


def group_end() -> None:
    """``onecclGroupEnd``: start, and on host buffers complete, the grouped calls."""
    _check("onecclGroupEnd", load().onecclGroupEnd())


class Comm:
    """A oneCCL communicator. ``Comm(uid, world, rank)`` is collective over the
    ``world`` ranks that were given the same ``uid``. Pointer arguments are
    addresses (ints), counts are elements, ``dtype`` is a :data:`DTYPE_CODES`
    value and ``op`` a :data:`REDUCTIONS` value."""

    def __init__(self, uid: bytes, world: int, rank: int, *, _handle: Optional[int] = None):
        self._lib = lib = load()
        if _handle is not None:
            self._comm = ctypes.c_void_p(_handle)
        else:
            if len(uid) != UNIQUE_ID_BYTES:
                raise ValueError(f"unique id must be {UNIQUE_ID_BYTES} bytes, got {len(uid)}")
            if not 0 <= rank < world:
                raise ValueError(f"rank {rank} not in [0, {world})")
            cid = _UniqueId()
            ctypes.memmove(ctypes.addressof(cid), uid, UNIQUE_ID_BYTES)
            self._comm = ctypes.c_void_p()
            _check("onecclCommInitRank", lib.onecclCommInitRank(ctypes.byref(self._comm), world, cid, rank))
        n, r = ctypes.c_int(), ctypes.c_int()
        self._call("onecclCommCount", lib.onecclCommCount, self._comm, ctypes.byref(n))
        self._call("onecclCommUserRank", lib.onecclCommUserRank, self._comm, ctypes.byref(r))
        self.size, self.rank = n.value, r.value

    def _call(self, name: str, fn, *args) -> None:
        if not self._comm:
            raise RuntimeError(f"{name}: communicator already destroyed")
        code = fn(*args)
        if code:
            _check(name, code, self._comm)

    def all_reduce(self, send_ptr: int, recv_ptr: int, count: int, dtype: int, op: int) -> None:
        """``onecclAllReduce``: ``recv = op(send over ranks)``. In place when ``send_ptr == recv_ptr``."""
        self._call("onecclAllReduce", self._lib.onecclAllReduce, send_ptr, recv_ptr, count, dtype, op,
                   self._comm, None)

    def broadcast(self, ptr: int, count: int, dtype: int, root: int) -> None:
        """``onecclBroadcast`` in place: ``ptr`` on every rank gets root's ``count`` elements."""
        self._call("onecclBroadcast", self._lib.onecclBroadcast, ptr, ptr, count, dtype, root, self._comm, None)

    def reduce(self, send_ptr: int, recv_ptr: int, count: int, dtype: int, op: int, root: int) -> None:
        """``onecclReduce``: the reduction lands in ``recv_ptr`` on ``root`` only."""
        self._call("onecclReduce", self._lib.onecclReduce, send_ptr, recv_ptr, count, dtype, op, root,
                   self._comm, None)

    def all_gather(self, send_ptr: int, recv_ptr: int, send_count: int, dtype: int) -> None:
        """``onecclAllGather``: rank i's ``send_count`` elements go to ``recv[i*send_count:]`` everywhere."""
        self._call("onecclAllGather", self._lib.onecclAllGather, send_ptr, recv_ptr, send_count, dtype,
                   self._comm, None)

    def reduce_scatter(self, send_ptr: int, recv_ptr: int, recv_count: int, dtype: int, op: int) -> None:
        """``onecclReduceScatter``: rank i gets chunk i (``recv_count`` elements) of the reduction of
        ``size*recv_count`` elements."""
        self._call("onecclReduceScatter", self._lib.onecclReduceScatter, send_ptr, recv_ptr, recv_count,
                   dtype, op, self._comm, None)

    def scatter(self, send_ptr: int, recv_ptr: int, count: int, dtype: int, root: int) -> None:
        """``onecclScatter``: rank i gets ``root.send[i*count:(i+1)*count]`` (send ignored off root)."""
        self._call("onecclScatter", self._lib.onecclScatter, send_ptr, recv_ptr, count, dtype, root,
                   self._comm, None)

    def all_to_all(self, send_ptr: int, recv_ptr: int, count: int, dtype: int) -> None:
        """``onecclAllToAll``: block j (``count`` elements) of send goes to rank j; block i of recv is from rank i."""
        self._call("onecclAllToAll", self._lib.onecclAllToAll, send_ptr, recv_ptr, count, dtype,
                   self._comm, None)

    def all_to_allv(self, send_ptr: int, send_counts: Sequence[int], recv_ptr: int,
                    recv_counts: Sequence[int], dtype: int) -> None:
        """``onecclAllToAllV`` (out of place): blocks are packed, offsets are the running sums of the counts."""
        n = self.size
        if len(send_counts) != n or len(recv_counts) != n:
            raise ValueError(f"all_to_allv needs {n} send and recv counts")
        sc, rc = (_N * n)(*send_counts), (_N * n)(*recv_counts)
        self._call("onecclAllToAllV", self._lib.onecclAllToAllV, send_ptr, sc, recv_ptr, rc, dtype,
                   self._comm, None)

    def send(self, ptr: int, count: int, dtype: int, peer: int) -> None:
        """``onecclSend`` (blocking; matching send/recv pairs that must overlap go in a group)."""
        self._call("onecclSend", self._lib.onecclSend, ptr, count, dtype, peer, self._comm, None)

    def recv(self, ptr: int, count: int, dtype: int, peer: int) -> None:
        """``onecclRecv`` (blocking; see :meth:`send`)."""
        self._call("onecclRecv", self._lib.onecclRecv, ptr, count, dtype, peer, self._comm, None)

    def split(self, color: int, key: int) -> Optional["Comm"]:
        """``onecclCommSplit`` (collective): a new Comm of the ranks with the same ``color``, ordered
        by ``key``. Returns None for color ``-1`` (``ONECCL_SPLIT_NOCOLOR``)."""
        new = ctypes.c_void_p()
        self._call("onecclCommSplit", self._lib.onecclCommSplit, self._comm, color, key,
                   ctypes.byref(new), None)
        return Comm(b"", 0, 0, _handle=new.value) if new.value else None

    def destroy(self) -> None:
        """``onecclCommFinalize`` then ``onecclCommDestroy``; safe to call twice."""
        if self._comm:
            try:
                self._call("onecclCommFinalize", self._lib.onecclCommFinalize, self._comm)
            finally:
                comm, self._comm = self._comm, None
                _check("onecclCommDestroy", self._lib.onecclCommDestroy(comm))

    def __enter__(self) -> "Comm":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()


def __getattr__(name: str):
    """``DTYPES`` (torch dtype -> code) is built on first use, so importing this module needs no torch."""
    if name == "DTYPES":
        import torch

        table = {getattr(torch, n): c for n, c in DTYPE_CODES.items() if hasattr(torch, n)}
        globals()["DTYPES"] = table
        return table
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
