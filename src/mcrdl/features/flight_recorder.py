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
  caller of mcrdl (or torch.distributed) up, at most 16 frames.
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
import os
import pickle
import signal
import sys
import threading
import time
from typing import Callable, Optional

import torch

VERSION = "2.10"  # the dump format torch 2.13 writes and its analyzer reads
MAX_FRAMES = 16
_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the mcrdl package
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


def _frames() -> list[dict]:
    """The caller's stack, innermost first, without mcrdl's own frames."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back
    out = []
    while frame is not None and len(out) < MAX_FRAMES:
        code = frame.f_code
        out.append({"name": code.co_name, "filename": code.co_filename, "line": frame.f_lineno})
        frame = frame.f_back
    return out


class FlightRecorder:
    """A ring of the last ``size`` ops of this process, an observer of the API
    (:mod:`mcrdl.features.profiler`)."""

    def __init__(self, rank: int, size: int, prefix: str):
        self.rank = rank
        self.prefix = prefix
        self.entries: collections.deque = collections.deque(maxlen=size)
        self.stacks = os.environ.get("TORCH_INCLUDE_STACK_TRACE", "1") not in ("0", "false", "False")
        self.only_active = os.environ.get("TORCH_INCLUDE_ONLY_ACTIVE", "0") in ("1", "true", "True")
        self._next_id = 0
        self._groups: dict = {}  # group -> [pg_id, collectives, p2p ops, last started, last completed]
        self._lock = threading.Lock()  # dumps come from other threads (watchdog, signal)
        self._handler = None  # ours on SIGUSR1, if installed

    def begin(self, op: str, backend: str, group, nbytes: int, async_op: bool, peer: int = -1,
              counts=None, reads=(), writes=()) -> Callable[[], None]:
        state = self._groups.get(group)
        if state is None:
            state = self._groups[group] = [len(self._groups), 0, 0, 0, 0]
        name = TORCH_NAMES.get(op, op)
        p2p = name in ("send", "recv")
        if p2p:
            state[2] += 1
            meta = f"{group.rank}->{peer}" if name == "send" else f"{group.rank}<-{peer}"
        else:
            state[1] += 1
            meta = f"mcrdl={backend}"
        ins, outs = reads or writes, writes or reads
        ref = ins[0] if ins else None
        now = time.time_ns()
        entry = {
            "record_id": self._next_id, "pg_id": state[0], "process_group": (group.name, _desc(group)),
            "collective_seq_id": state[1], "p2p_seq_id": state[2], "op_id": self._next_id,
            "profiling_name": f"{'gloo' if ref is None or ref.is_cpu else 'nccl'}:{name} {meta}",
            "time_created_ns": now, "input_sizes": [list(t.shape) for t in ins],
            "input_dtypes": [_C10_DTYPES.get(t.dtype, str(t.dtype)) for t in ins],
            "output_sizes": [list(t.shape) for t in outs],
            "output_dtypes": [_C10_DTYPES.get(t.dtype, str(t.dtype)) for t in outs],
            "state": "started", "time_discovered_started_ns": now, "time_discovered_completed_ns": None,
            "retired": False, "timeout_ms": int(group.timeout * 1000), "is_p2p": p2p,
            "library": backend, "nbytes": nbytes,
            "frames": _frames() if self.stacks else [],
        }
        self._next_id += 1
        self.entries.append(entry)
        if not p2p:
            state[3] = state[1]

        def end() -> None:
            entry["state"] = "completed"
            entry["time_discovered_completed_ns"] = time.time_ns()
            entry["retired"] = True
            if not p2p and entry["collective_seq_id"] > state[4]:
                state[4] = entry["collective_seq_id"]
        return end

    def snapshot(self) -> dict:
        """What a dump holds (torch's format)."""
        with self._lock:
            entries = [dict(e) for e in list(self.entries)]
            groups = dict(self._groups)
        if self.only_active:
            entries = [e for e in entries if e["state"] != "completed"]
        return {
            "version": VERSION,
            "comm_lib_version": "mcrdl",
            "pg_config": {g.name: {"name": g.name, "desc": _desc(g), "ranks": str(list(g.ranks))}
                          for g in groups},
            "pg_status": {str(s[0]): {"last_enqueued_collective": s[1], "last_started_collective": s[3],
                                      "last_completed_collective": s[4]} for s in groups.values()},
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
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
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


def _desc(group) -> str:
    return "default_pg" if group.name == "world" else "undefined"
