"""``shm``: DeepSpeed's CPU shared-memory all-reduce, for a world on one host.

The kernels are DeepSpeed's (``deepspeed/ops/csrc/cpu/comm/shm.cpp`` of the
installed package), compiled once per machine with mcrdl's own small binding
(``shm_native.cpp``, which says why not DeepSpeed's). What the library can do,
and so all this backend declares (anything else falls through to the next
library, see docs/backends.md):

* one op, all_reduce, summing (AVG arrives as a sum: the API divides);
* float32 (AVX2), bfloat16 and float16 only where the host has AVX-512
  (without it those kernels fault, and the peers spin forever);
* the world group only, every rank on one host: the library has one channel
  per process, with no group argument, so two groups sharing it in different
  orders on different ranks would sum each other's data;
* CPU tensors (contiguous: the API hands backends nothing else).

At its first op each rank maps a 69 MB segment of every rank under
``/dev/shm`` (a job that never selects the backend creates none); their names
carry a token rank 0 draws for the job (DeepSpeed's own name them from
MASTER_ADDR/MASTER_PORT, so two jobs on one port corrupt each other), and each
rank unlinks its own once every peer has mapped it, so a job leaves
``/dev/shm`` as it found it, even when killed.

The kernels' OpenMP loops use the caller's torch threads, at most this rank's
share of the CPUs it may run on: beyond it, a peer spinning in its wait holds
the core a descheduled OpenMP thread of the op needs (2 ranks with 2 torch
threads each on 2 cores: 10-16 ms a call instead of 7-18 us, docs/backends.md).

The library's waits spin without a deadline and cannot be withdrawn. A
blocking call with nothing outstanding runs on the caller's thread; any other
call runs on one worker thread, in issue order, while the caller keeps every
other library progressing (hazard 1); the worker runs an op only once the
process tests or waits for some work, as MPI progresses, so its spinning wait
never takes a core from the caller's compute. A sentinel thread ends the process with
a message naming the op when one runs past its group's deadline or a peer's
process is gone: the only way out of a wait that cannot be interrupted, as
NCCL's watchdog does.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import queue
import secrets
import sys
import sysconfig
import threading
import time
from typing import Optional

import torch

from .. import compiled, facts
from ..types import ReduceOp
from ..work import DONE, Pending
from . import sentinel
from .base import Backend, BackendUnavailable, Context

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shm_native.cpp")
MODULE = "mcrdl_shm_native"
BUILD_TIMEOUT_S = 300
SEGMENT_PREFIX = "deepspeed_allreduce_buffer"  # shm.cpp's SHM_BUFFER_NAME
#: what each dtype needs of the host (vector_kernel_level())
KERNEL_LEVEL = {torch.float32: 1, torch.bfloat16: 2, torch.float16: 2}


def deepspeed_sources() -> str:
    """The folder of DeepSpeed's shm.cpp (without importing deepspeed, which
    takes seconds); OSError naming what is missing."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        raise OSError("deepspeed is not installed (pip install deepspeed): this backend compiles "
                      "DeepSpeed's shared-memory all-reduce")
    folder = os.path.join(spec.submodule_search_locations[0], "ops", "csrc", "cpu", "comm")
    if not os.path.exists(os.path.join(folder, "shm.cpp")):
        raise OSError(f"deepspeed's shared-memory all-reduce source is missing ({folder}/shm.cpp)")
    return folder


def _target(folder: str) -> str:
    key = [sys.version, torch.__version__]
    for name in ("shm.cpp", "shm.h", os.path.join("x86_64", "shm.h")):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                key.append(hashlib.sha256(f.read()).hexdigest())
    return compiled.target("shm", MODULE, SOURCE, key)


def build(folder: str, target: str) -> None:
    """Compile DeepSpeed's shm.cpp with shm_native.cpp into ``target`` (raises on failure)."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libs = cpp_extension.library_paths()
    cmd = [cxx, "-O2", "-fopenmp", "-shared", "-fPIC", "-std=c++17", "-w",
           f"-DTORCH_EXTENSION_NAME={MODULE}", "-DTORCH_API_INCLUDE_EXTENSION_H",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-I" + folder, "-I" + sysconfig.get_paths()["include"]]
    cmd += ["-I" + p for p in cpp_extension.include_paths()]
    cmd += [SOURCE, os.path.join(folder, "shm.cpp")]
    cmd += ["-L" + p for p in libs] + ["-Wl,-rpath," + p for p in libs]
    cmd += ["-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
    compiled.build(cmd, target, BUILD_TIMEOUT_S)


@functools.lru_cache(maxsize=None)
def load():
    """The compiled module (built on first use); OSError/RuntimeError saying why not."""
    folder = deepspeed_sources()
    target = _target(folder)
    if not os.path.exists(target):
        build(folder, target)
    return compiled.load(MODULE, target)


def _host() -> tuple:
    """What ranks sharing this host's /dev/shm have in common."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    st = os.stat("/dev/shm")
    return boot, st.st_dev, st.st_ino


def thread_share(mine: frozenset, everyone: list) -> int:
    """This rank's share of its CPUs: those it may run on, over the ranks that may
    run on any of them (itself included). The kernels' OpenMP threads stay within it."""
    sharing = sum(1 for cpus in everyone if cpus & mine)
    return max(1, len(mine) // max(sharing, 1))


#: the world (size, rank) this process's library was set up for: it has one channel per process
_SET_UP: Optional[tuple] = None


class ShmPending(Pending):
    """An all-reduce queued on the worker thread, which runs it once someone
    tests or waits for it (or for anything else, as the engine polls every
    outstanding work then: the "shm" domain progresses only when polled)."""

    progress_domain = "shm"
    __slots__ = ("done", "error", "go")

    def __init__(self, go: threading.Event):
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.go = go

    def test(self) -> bool:
        if not self.done.is_set():
            self.go.set()
            return False
        if self.error is not None:
            raise self.error
        return True

    def block(self, deadline: float) -> bool:
        self.go.set()
        return self.done.wait(max(deadline - time.monotonic(), 0)) and self.test()


class ShmBackend(Backend):
    """DeepSpeed's shared-memory all-reduce (module docstring)."""

    name = "shm"
    devices = frozenset({"cpu"})
    ops = frozenset({"all_reduce"})
    async_calls = False  # (DDP's bucket all-reduces during backward: 0.89x MPI's step, docs/backends.md)
    raw_ops = frozenset({"all_reduce"})

    @classmethod
    def unavailable_reason(cls, ctx: Context) -> Optional[str]:
        if ctx.world_size < 2:
            return "a job of one rank has nothing to share"
        if _SET_UP is not None and _SET_UP != (ctx.world_size, ctx.rank):
            return (f"this process already set up DeepSpeed's shared memory as rank {_SET_UP[1]} of "
                    f"{_SET_UP[0]} (the library has one channel per process)")
        try:
            level = load().vector_kernel_level()
        except Exception as exc:  # no deepspeed, no compiler, a failed build
            return f"DeepSpeed's shared-memory all-reduce could not be loaded: {exc}"
        if level < 1:
            return "this CPU has no AVX2, which the library's float32 kernel needs"
        return None

    @classmethod
    def info_lines(cls, live):
        try:
            level = load().vector_kernel_level()
            return [f"shm kernels: compiled ({_target(deepspeed_sources())}), "
                    f"{'float32, bfloat16, float16' if level >= 2 else 'float32'} on this CPU"]
        except Exception as exc:
            return [f"shm kernels: not available: {exc}"]

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.lib = load()
        self.level = self.lib.vector_kernel_level()
        self.timeout = ctx.timeout
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._worker: Optional[threading.Thread] = None
        self._stopped = threading.Event()
        self._go = threading.Event()  # set while the process polls or waits: the worker may run ops
        self._lock = threading.Lock()
        self._ready = False  # (_set_up runs at this runtime's first op)
        checks = facts.load()
        if checks is not facts:  # the compiled driver starts the blocking fast path's starter itself
            checks.adopt_starter(self.lib.Starter, self.lib.start)
            facts.provided("ShmBackend's blocking starts", "Starter (backends/shm_native.cpp), started by drive")

    def join(self) -> None:
        token = secrets.token_hex(8) if self.ctx.rank == 0 else None
        cpus = frozenset(os.sched_getaffinity(0))
        peers = self.ctx.share((_host(), os.getpid(), token, cpus))
        if len({host for host, _, _, _ in peers}) > 1:
            raise BackendUnavailable("the job's ranks do not share one host's /dev/shm")
        self.pids = [pid for _, pid, _, _ in peers]
        self._names = f"mcrdl-{peers[0][2]}", str(self.pids[0])  # the segments' job and tag
        self.lib.set_thread_cap(thread_share(cpus, [c for _, _, _, c in peers]))

    def _set_up(self, tensor: torch.Tensor) -> None:
        """The first op of the job's first runtime: the library maps every
        rank's segment (every rank is in this op: the world's collectives
        come in one order), runs it, and each rank unlinks its own segment,
        which every peer has mapped once the op is done."""
        global _SET_UP
        sentinel.start("shm", self._stopped, self.lib.counts, self._verdict)
        job, tag = self._names
        if _SET_UP is None:
            self.lib.initialize(self.ctx.world_size, self.ctx.rank, job, tag)
            _SET_UP = (self.ctx.world_size, self.ctx.rank)
            self.lib.all_reduce(tensor)
            os.unlink(f"/dev/shm/{SEGMENT_PREFIX}_{os.getuid()}_{job}_{tag}_{self.ctx.rank}")
            self.lib.mark_ready()
        else:
            self.lib.all_reduce(tensor)
        self._ready = True

    def version(self) -> str:
        from importlib.metadata import version

        return f"deepspeed {version('deepspeed')} shm (kernel level {self.level})"

    def unsupported(self, op, dtype, reduce_op, device):
        need = KERNEL_LEVEL.get(dtype)
        if need is None:
            return f"the library sums float32, bfloat16 and float16 only, not {dtype}"
        if need > self.level:
            return f"{dtype} needs AVX-512 on this host (its kernels would fault without it)"
        if reduce_op is not None and reduce_op != ReduceOp.SUM:
            return f"the library only sums (not {reduce_op.name})"
        return None

    def group_unsupported(self, ranks, world: bool) -> Optional[str]:
        if not world:
            return "the library serves the world group only (it has one channel per process)"
        return None

    def new_group(self, ranks, group_rank, store, timeout):
        return None  # (the world's: the library's one channel)

    def raw_calls(self, h, inp, out, part):
        """The library's all-reduce itself on the caller's thread (its shared memory mapped first)."""
        if not self._ready:
            self._set_up(torch.zeros(1))  # (collective: every rank's bench makes its calls alike)
        return {"all_reduce": lambda: self.lib.all_reduce(inp)}

    # -- running ops ----------------------------------------------------------
    def _run(self, tensor: torch.Tensor) -> None:
        if not self._ready:
            return self._set_up(tensor)
        self.lib.all_reduce(tensor)

    def _work(self) -> None:
        """Run the queued ops in issue order, each once this process polls or
        waits (``_go``): between polls, while the caller computes, the
        library's spinning wait would take a core from it (DDP's async
        all-reduces during backward ran 6x slower)."""
        threads = 0
        while True:
            item = self._queue.get()
            if item is None:
                return
            tensor, pending, wanted = item
            if wanted != threads:  # the kernels' OpenMP threads: the caller's torch setting, not
                self.lib.set_threads(wanted)  # a new thread's default of every core (DDP: 6x slower)
                threads = wanted
            self._go.wait()
            try:
                self._run(tensor)
            except BaseException as exc:
                pending.error = exc
            with self._lock:  # (a submit after the count went to 0 sets _go again when polled)
                if self.lib.queue(-1) == 0:
                    self._go.clear()
            pending.done.set()

    def _submit(self, tensor: torch.Tensor) -> ShmPending:
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, daemon=True, name="mcrdl-shm")
            self._worker.start()
        pending = ShmPending(self._go)
        with self._lock:
            self.lib.queue(1)
        self._queue.put((tensor, pending, torch.get_num_threads()))
        return pending

    def _verdict(self, number: int, inside: float) -> Optional[str]:
        """The sentinel's (sentinel.py): why all_reduce ``number``, ``inside`` the
        library that many seconds, cannot complete (past the world's timeout plus a
        grace, so an async op's own timeout error comes first, or a peer gone)."""
        dead = [r for r, pid in enumerate(self.pids) if r != self.ctx.rank and sentinel.gone(pid)]
        if not dead and inside <= self.timeout + sentinel.GRACE_S:
            return None
        why = f"rank(s) {dead} ended" if dead else f"it ran past the world's timeout of {self.timeout:g} s"
        return (f"mcrdl: rank {self.ctx.rank}: all_reduce #{number} on backend 'shm' cannot complete: {why}, "
                "and the library's wait cannot be withdrawn: ending this process")

    def all_reduce(self, h, tensor, op):
        return self._submit(tensor)

    def starter(self, op, h, timeout, tensors, *fixed):
        """A blocking call with nothing queued runs on the caller's thread, in
        the compiled starter (``shm_native.cpp``, which drive() starts without
        Python) once the job's first op is done; the rest queue on the worker."""
        if timeout <= 0:  # async
            return self._submit
        return self.lib.starter(self._inline, DONE)

    def _inline(self, t: torch.Tensor):
        """The starter's fallback: the first op, or one behind the worker's (in issue order)."""
        if self.lib.queue(0):
            return self._submit(t)
        self._run(t)
        return DONE

    def shutdown(self) -> None:
        self._stopped.set()
        if self._worker is not None:
            self._go.set()
            self._queue.put(None)
