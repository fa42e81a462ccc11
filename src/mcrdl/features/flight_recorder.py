"""Flight recorder: the last ops of every group, dumped in torch's format when
a job goes wrong, so torch's own analyzer (``torchfrtrace``) says which rank
and which op.

It answers to torch's settings, so a user of torch's recorder needs nothing new:

* ``TORCH_FR_BUFFER_SIZE`` (or the older ``TORCH_NCCL_TRACE_BUFFER_SIZE``):
  ops kept per process. Unset or 0: off. (torch keeps 2000 by default for its
  own backends; mcrdl records only when asked, as recording costs about
  a microsecond per op: docs/observability.md.)
* ``TORCH_FR_DUMP_TEMP_FILE`` (or ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``): the
  dump's path prefix, the rank appended (default
  ``~/.cache/torch/comm_lib_trace_rank_``, as torch's).
* ``TORCH_INCLUDE_STACK_TRACE`` (default 1): each op's Python stack, from the
  caller of mcrdl (or of torch.distributed) up, at most 4 frames.
* ``TORCH_INCLUDE_ONLY_ACTIVE`` (default 0): dump only ops not completed.

Every rank dumps when an op of its times out or its library fails (and asks
every other rank, through the watchdog, to dump too, as torch's NCCL recorder
does through its store), when the watchdog names a dead or frozen peer, on
``SIGUSR1``, and on :func:`mcrdl.dump_flight_recorder`. Read the dumps with
``torchfrtrace DIR -p PREFIX`` (its report goes to stderr).

The format is torch's (a pickled dict, version "2.10"): ``pg_config``, and per
op ``record_id``, ``process_group``, ``collective_seq_id``/``p2p_seq_id``,
``profiling_name``, sizes, dtypes, ``state`` (started, completed) with the
times it was seen in each, and ``frames``; plus ``library``, the library mcrdl
ran it on. torch's analyzer accepts only the names of the libraries it knows
in ``profiling_name``, so that name is ``gloo:<op>`` for CPU tensors and
``nccl:<op>`` for CUDA ones, as torch's own backend for that device would
write it, followed by ``mcrdl=<library>`` (``gloo:all_reduce mcrdl=mpi``).
"""
from __future__ import annotations

import collections
import operator
import os
import pickle
import signal
import sys
import threading
import time
from typing import Callable

import torch

VERSION = "2.10"  # the dump format torch 2.13 writes and its analyzer reads
MAX_FRAMES = 4  # frames kept per op (a frame costs ~0.3 µs to take)
#: frames not kept: mcrdl's own and torch.distributed's
_SKIPPED = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
            os.path.dirname(os.path.abspath(torch.distributed.__file__)))
_shape, _dtype = operator.attrgetter("shape"), operator.attrgetter("dtype")
#: mcrdl's op names as torch's recorder names them (its analyzer knows only those)
TORCH_NAMES = {"all_gather_into_tensor": "_all_gather_base", "reduce_scatter_tensor": "_reduce_scatter_base",
               "monitored_barrier": "barrier", "isend": "send", "irecv": "recv"}
_C10_DTYPES = {torch.float16: "Half", torch.bfloat16: "BFloat16", torch.float32: "Float",
               torch.float64: "Double", torch.int8: "Char", torch.uint8: "Byte", torch.int16: "Short",
               torch.int32: "Int", torch.int64: "Long", torch.bool: "Bool"}


def _env_int(*names: str, default: int) -> int:
    for name in names:
        raw = os.environ.get(name)
        if raw is not None:
            try:
                return int(raw)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {raw!r}") from None
    return default


def buffer_size() -> int:
    """Ops kept per process (``TORCH_FR_BUFFER_SIZE``); 0: the recorder is off."""
    return max(0, _env_int("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE", default=0))


def dump_prefix() -> str:
    """The dump path without its rank (``TORCH_FR_DUMP_TEMP_FILE``, as torch's)."""
    return (os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
            or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                            "torch", "comm_lib_trace_rank_"))


def _frames() -> tuple:
    """The caller's innermost :data:`MAX_FRAMES` frames as (code, line), past
    mcrdl's and torch.distributed's own (so a DeepSpeed or user line comes first)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back
    out = []
    while frame is not None and len(out) < MAX_FRAMES:
        out.append((frame.f_code, frame.f_lineno))
        frame = frame.f_back
    return tuple(out)


class FlightRecorder:
    """A ring of the last ``size`` ops of this process, an observer of the API
    (:mod:`mcrdl.features.profiler`). An op costs a tuple at its start and a
    time at its completion; torch's dictionaries are built at a dump."""

    def __init__(self, rank: int, size: int, prefix: str):
        self.rank = rank
        self.prefix = prefix
        self.entries: collections.deque = collections.deque(maxlen=size)
        self.stacks = os.environ.get("TORCH_INCLUDE_STACK_TRACE", "1") not in ("0", "false", "False")
        self.only_active = os.environ.get("TORCH_INCLUDE_ONLY_ACTIVE", "0") in ("1", "true", "True")
        self._next_id = 0
        self._groups: dict = {}  # group -> [pg_id, collectives, p2p ops]
        self._handler = None  # ours on SIGUSR1, if installed

    def begin(self, op: str, backend: str, group, nbytes: int, async_op: bool, peer: int = -1,
              counts=None, reads=(), writes=()) -> Callable[[], None]:
        state = self._groups.get(group)
        if state is None:
            state = self._groups[group] = [len(self._groups), 0, 0]
        name = TORCH_NAMES.get(op, op)
        if name == "send" or name == "recv":
            state[2] += 1
        else:
            state[1] += 1
            peer = None
        ins, outs = reads or writes, writes or reads
        in_shapes, in_dtypes = tuple(map(_shape, ins)), tuple(map(_dtype, ins))
        if outs is ins or (len(outs) == 1 == len(ins) and outs[0] is ins[0]):  # in place (all_reduce)
            out_shapes, out_dtypes = in_shapes, in_dtypes
        else:
            out_shapes, out_dtypes = tuple(map(_shape, outs)), tuple(map(_dtype, outs))
        done = [None]  # the completion time, once seen
        self.entries.append((self._next_id, group, state[1], state[2], name, peer, backend, nbytes,
                             time.time_ns(), in_shapes, in_dtypes, out_shapes, out_dtypes,
                             not ins or ins[0].is_cpu, done, _frames() if self.stacks else ()))
        self._next_id += 1
        return lambda: done.__setitem__(0, time.time_ns())

    def snapshot(self) -> dict:
        """What a dump holds: torch's format (see the module's docstring)."""
        ops = list(self.entries)  # (atomic: the deque may grow meanwhile, on the caller's thread)
        groups = dict(self._groups)
        completed: dict = {}
        entries = []
        for (rid, g, seq, p2p_seq, name, peer, backend, nbytes, created, in_shapes, in_dtypes,
             out_shapes, out_dtypes, cpu, done, frames) in ops:
            ended = done[0]
            if ended is not None and peer is None:
                completed[g] = max(completed.get(g, 0), seq)
            if self.only_active and ended is not None:
                continue
            meta = f"mcrdl={backend}" if peer is None else (
                f"{g.rank}->{peer}" if name == "send" else f"{g.rank}<-{peer}")
            entries.append({
                "record_id": rid, "pg_id": groups[g][0], "process_group": (g.name, _desc(g)),
                "collective_seq_id": seq, "p2p_seq_id": p2p_seq, "op_id": rid,
                "profiling_name": f"{'gloo' if cpu else 'nccl'}:{name} {meta}",
                "time_created_ns": created,
                "input_sizes": [list(s) for s in in_shapes], "input_dtypes": [_c10(d) for d in in_dtypes],
                "output_sizes": [list(s) for s in out_shapes], "output_dtypes": [_c10(d) for d in out_dtypes],
                "state": "started" if ended is None else "completed",
                "time_discovered_started_ns": created, "time_discovered_completed_ns": ended,
                "retired": ended is not None, "timeout_ms": int(g.timeout * 1000), "is_p2p": peer is not None,
                "library": backend, "nbytes": nbytes,
                "frames": [{"name": code.co_name, "filename": code.co_filename, "line": line}
                           for code, line in frames],
            })
        return {
            "version": VERSION,
            "comm_lib_version": "mcrdl",
            "pg_config": {g.name: {"name": g.name, "desc": _desc(g), "ranks": str(list(g.ranks))}
                          for g in groups},
            "pg_status": {str(s[0]): {"last_enqueued_collective": s[1], "last_started_collective": s[1],
                                      "last_completed_collective": completed.get(g, 0)}
                          for g, s in groups.items()},
            "entries": entries,
        }

    def dump(self, why: str) -> str:
        """Write the dump to ``prefix + rank`` (replacing an older one) and say
        where on stderr; returns the path."""
        path = f"{self.prefix}{self.rank}"
        folder = os.path.dirname(path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        data = pickle.dumps(self.snapshot())
        # (named apart from the dumps: torch's analyzer reads every file holding the prefix)
        tmp = os.path.join(folder or ".", f".mcrdl-dump-{os.getpid()}-{threading.get_ident()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        print(f"mcrdl: rank {self.rank}: flight recorder dumped to {path} ({why})", file=sys.stderr, flush=True)
        return path

    def on_signal(self) -> None:
        """Dump on ``SIGUSR1`` when nothing else handles it (its default ends the process)."""
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL):
            self._handler = lambda *_: self.dump("SIGUSR1")
            signal.signal(signal.SIGUSR1, self._handler)

    def close(self) -> None:
        """Give ``SIGUSR1`` back (at destroy_process_group)."""
        handler = self._handler
        if (handler is not None and threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGUSR1) is handler):
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)


def _c10(dtype: torch.dtype) -> str:
    return _C10_DTYPES.get(dtype, str(dtype))


def _desc(group) -> str:
    return "default_pg" if group.name == "world" else "undefined"
