"""The user-facing API, shaped like ``torch.distributed``.

Every op validates its arguments on the calling rank, computes its
rank-invariant message size, asks the selector for a backend, orders itself
after conflicting outstanding work, and submits. ``backend=`` forces a backend.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import sys
import time
from datetime import timedelta
from typing import Callable, List, Mapping, Optional, Sequence, Union

import torch
from torch.autograd import profiler as _torch_profiler

from . import facts
from .backends import REGISTRY
from .backends.base import ANY_SOURCE
from .runtime import Group, Runtime
from .tuning import TuningTable
from .types import CommError, P2POp, ReduceOp, UnsupportedError
from .work import DEFAULT_TIMEOUT, DONE, AfterAll, Done, Work, _overlap, _seconds, current_stream

_runtime: Optional[Runtime] = None

#: Dtypes the API accepts (per backend limits are checked by the selector).
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                    torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool})
_SUM = ReduceOp.SUM
_SENDS = ("send", "isend")
MAX_TAG = 2**31 - 1  # a C int (MPI's own bound, MPI_TAG_UB, may be lower)
#: The fast paths' tensor checks (facts.py), compiled once init has loaded them.
_key, _pair, _span_at = facts.key, facts.pair, facts.span


# -- lifecycle -------------------------------------------------------------------------
def init_process_group(backends: Union[None, str, Sequence[str]] = None, default_backend: Optional[str] = None,
                       timeout: Union[timedelta, float] = timedelta(seconds=DEFAULT_TIMEOUT),
                       op_backends: Optional[Mapping[str, str]] = None,
                       tuning_table: Union[None, str, dict, TuningTable] = None,
                       debug: Optional[bool] = None, comms_log: Optional[bool] = None,
                       store=None, rank: Optional[int] = None,
                       world_size: Optional[int] = None, autotune: Optional[bool] = None) -> None:
    """Start every requested backend that can start in this job.

    Identity and rendezvous: from MPI when an MPI launcher started the job, else
    from torchrun's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT``); or, as torch's, from ``store`` (any torch Store) with
    ``rank`` and ``world_size`` — MPI is then live too if an MPI launcher
    started a world of that size.

    ``backends``: names to start, a list or one comma-separated string
    (default: all registered; those that cannot start here are listed by
    :func:`available_backends`). ``default_backend``:
    used when nothing else decides (default: first live of mpi, nccl, gloo).
    ``op_backends``: static per-op map (or ``MCRDL_OP_BACKENDS``).
    ``tuning_table``: path, dict or table (or ``MCRDL_TUNING_TABLE``).
    ``debug``: check collective order across ranks (or ``MCRDL_DEBUG=1``).
    ``comms_log``: record every op (or ``MCRDL_COMMS_LOG=1``; see
    :mod:`mcrdl.features.logger`). ``autotune``: learn the backend of each
    collective from the job's own first calls (or ``MCRDL_AUTOTUNE=1``; see
    :mod:`mcrdl.autotune`).
    """
    global _runtime, _key, _pair, _span_at
    if _runtime is not None:
        raise RuntimeError("mcrdl is already initialized; call destroy_process_group() first")
    checks = facts.load()
    _key, _pair, _span_at = checks.key, checks.pair, checks.span
    _runtime = Runtime(backends, default_backend, _seconds(timeout), op_backends, tuning_table, debug,
                       comms_log, store, rank, world_size, autotune)
    atexit.register(destroy_process_group)  # runs before mpi4py's MPI_Finalize
    if sys.excepthook is not _note_uncaught:
        _note_uncaught.previous, sys.excepthook = sys.excepthook, _note_uncaught
    try:
        _check_same_selection(_runtime)
    except Exception:
        destroy_process_group()
        raise


def _check_same_selection(rt: Runtime) -> None:
    """Every rank must select alike (hazard 2): compare what selection depends on
    — live backends, default, static map, tuning table, debug — across the world."""
    table = rt.selector.table
    config = {"live": sorted(rt.backends), "default": rt.default_backend,
              "device_defaults": rt.selector.device_defaults,
              "static": rt.selector.static, "debug": rt.debug,
              "autotune": None if rt.autotune is None else [rt.autotune.calls, rt.autotune.warmup,
                                                            rt.autotune.drift, rt.autotune.block_ms],
              "table": None if table is None else json.dumps(table.to_dict(), sort_keys=True)}
    mine = json.dumps(config, sort_keys=True)
    digest = hashlib.sha256(mine.encode()).hexdigest()
    digests = [b.decode() for b in rt.control_allgather(rt.world, digest.encode())]
    if len(set(digests)) > 1:
        odd = [r for r, d in enumerate(digests) if d != digests[0]]
        raise RuntimeError(f"init_process_group: ranks {odd} select backends differently from "
                           f"rank 0 (live backends, default backend, op_backends / "
                           f"MCRDL_OP_BACKENDS, tuning table, debug or autotune differ); rank "
                           f"{rt.rank} has {mine[:300]}")


def _note_uncaught(kind, value, traceback) -> None:
    """An uncaught exception ends this rank: its peers, which may wait for it in an op,
    must hear of a death, not of a rank leaving (Runtime.shutdown)."""
    if _runtime is not None:
        _runtime.dying = f"an uncaught {kind.__name__}: {value}"[:300]
    _note_uncaught.previous(kind, value, traceback)


def destroy_process_group() -> None:
    """Release every backend and group; init may be called again afterwards."""
    global _runtime
    atexit.unregister(destroy_process_group)
    if _runtime is not None:
        if _runtime.logger is not None:
            _runtime.logger.close()
        tuner = _runtime.autotune
        if tuner is not None and tuner.save_path and _runtime.rank == 0:
            tuner.save(tuner.save_path, _runtime.world_size)
        rt, _runtime = _runtime, None
        rt.shutdown()


def is_initialized() -> bool:
    return _runtime is not None


def current_runtime() -> Runtime:
    """The job's :class:`Runtime`: the internal surface mcrdl's own layers (the torch
    backend, the DDP hook, bench) and the tests use; not part of the user API."""
    if _runtime is None:
        raise RuntimeError("mcrdl is not initialized: call mcrdl.init_process_group() first")
    return _runtime


def _group(group: Optional[Group], op: str = "mcrdl") -> Group:
    rt = _runtime
    if rt is None:
        current_runtime()  # raises the not-initialized error
    if group is None:
        return rt.world
    if not isinstance(group, Group):
        raise TypeError(f"{op}: group must be an mcrdl Group from mcrdl.new_group(), "
                        f"got {type(group).__name__}")
    if group.owner is not rt:
        raise ValueError(f"{op}: {group!r} belongs to a process group that was destroyed")
    return group


def available_backends() -> dict[str, str]:
    """Every registered backend: ``"live"`` or the reason it is not."""
    rt = current_runtime()
    return {name: ("live" if name in rt.backends else rt.unavailable.get(name, "not requested"))
            for name in REGISTRY}


def live_backends(device: str = "cpu") -> list[str]:
    """The live backends that take tensors on ``device`` (``"cpu"``, ``"cuda"``)."""
    return [name for name, b in current_runtime().backends.items() if device in b.devices]


def get_backend_versions() -> dict[str, str]:
    return {name: b.version() for name, b in current_runtime().backends.items()}


def get_default_backend() -> str:
    return current_runtime().default_backend


def wait_policy() -> str:
    """How waits use the CPU here: "spin" or "yield" (``MCRDL_WAIT``, default auto)."""
    return current_runtime().wait_policy


def get_rank(group: Optional[Group] = None) -> int:
    """This process's rank in ``group`` (-1 if not a member)."""
    return current_runtime().rank if group is None else _group(group).rank


def get_world_size(group: Optional[Group] = None) -> int:
    """Size of ``group`` (-1 on a rank that is not a member, as torch)."""
    g = _group(group)
    return g.size if g.rank >= 0 else -1


def get_local_rank() -> int:
    return current_runtime().local_rank


def get_local_size() -> int:
    return current_runtime().local_size


def new_group(ranks: Optional[Sequence[int]] = None,
              timeout: Union[None, timedelta, float] = None) -> Group:
    """A group of ``ranks`` (all ranks when None). As ``torch.distributed.new_group``:
    every rank calls it, in the same order, but only the members build
    anything; non-members get a group whose ops return None. Members that
    disagree (groups made in another order) get an error naming the ranks."""
    rt = current_runtime()
    return rt.new_group(range(rt.world_size) if ranks is None else ranks, timeout)


def get_group_rank(group: Group, global_rank: int) -> int:
    return _group(group).group_rank(global_rank)


def get_global_rank(group: Group, group_rank: int) -> int:
    g = _group(group, "get_global_rank")
    if not 0 <= group_rank < g.size:
        raise ValueError(f"group rank {group_rank} is outside group {g.name} of size {g.size}")
    return g.ranks[group_rank]


def explain(op: str, tensor_or_nbytes: Union[torch.Tensor, int], group: Optional[Group] = None,
            backend: Optional[str] = None, group_size: Optional[int] = None, device: str = "cpu") -> str:
    """Which backend would run ``op`` for this tensor (or message size in bytes), and why.

    For tensors the size is the op's lookup size (see docs/tuning-table.md) and
    the device theirs; for a size, ``device`` is the tensors' device type.
    ``group_size`` asks about a group size other than ``group``'s."""
    from .tuning import DEVICES, OP_CLASS

    if op not in OP_CLASS:
        raise ValueError(f"unknown op {op!r} (expected one of {', '.join(OP_CLASS)})")
    rt, g = current_runtime(), _group(group)
    if isinstance(tensor_or_nbytes, torch.Tensor):
        t = tensor_or_nbytes
        nbytes = _nbytes(t) * (g.size if OP_CLASS[op] in ("all_gather", "gather", "scatter") else 1)
        # (all_gather/gather/scatter tensors are the per-rank part)
        device, dtype = t.device.type, t.dtype
    else:
        if device not in DEVICES:
            raise ValueError(f"explain: unknown device type {device!r} (expected one of {', '.join(DEVICES)})")
        nbytes, dtype = int(tensor_or_nbytes), torch.float32
    size = group_size or g.size
    name, why = rt.selector.explain(op, nbytes, size, device, dtype, explicit=backend)
    tuner = rt.autotune
    if tuner is not None and tuner.explores(op, backend) and group_size in (None, g.size):
        learned = tuner.describe(g, op, nbytes, device)
        won = tuner.frozen(g, op, nbytes, device, name, ignore_trial=True)
        if won is not None and rt.selector.why_not(won, op, device, dtype) is None:
            name, why = won, learned
        else:
            why = f"{why}; {learned}"
    return f"{op} of {nbytes} B on {device}, group size {size}: {name} ({why})"


def dump_flight_recorder() -> Optional[str]:
    """Write this rank's flight recorder dump now (torch's format, for
    ``torchfrtrace``; see :mod:`mcrdl.features.flight_recorder`); returns its
    path, or None when the recorder is off (``TORCH_FR_BUFFER_SIZE`` unset or 0)."""
    return current_runtime().dump_flight_recorder("requested")


def autotune_report() -> Optional[dict]:
    """What in-situ autotune tried, measured and chose on this rank (None when
    it is off): ``buckets`` (one row per group, op class and size bucket; a
    ``winner`` of None is still exploring or on trial) and
    ``exploration_excess_s`` (this rank's timed calls on losing backends,
    beyond the winner's median, and a trial's blocks on the loser beyond the
    winner's)."""
    tuner = current_runtime().autotune
    if tuner is None:
        return None
    return {"buckets": tuner.report(), "exploration_excess_s": tuner.excess_s}


# -- helpers ------------------------------------------------------------------------------
def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _check(op: str, t, what: str = "tensor") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise UnsupportedError(f"{op}: {what} has unsupported dtype {t.dtype} "
                               f"(supported: {', '.join(sorted(str(d) for d in DTYPES))})")
    return t


def _same_kind(op: str, ref: torch.Tensor, t: torch.Tensor, what: str) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: {what} has dtype {t.dtype}, expected {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{op}: {what} is on {t.device}, expected {ref.device}")


def wait_for_conflicts(op: str, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    """Program order (hazard 3): wait for outstanding work that writes what
    ``op`` reads, or touches what it writes, before anything reads them
    (staging copies included). Public for features that read or write
    tensors locally (packing, compressing)."""
    engine = current_runtime().engine
    if engine.outstanding:
        engine.order_before(reads, writes, op)


def _private(t: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """``t``, or a copy when it shares memory with ``other`` (no library
    accepts aliased send and receive buffers)."""
    return t.clone() if _overlap(t, other) else t


def _contiguous(t: torch.Tensor, written: bool, post: list) -> torch.Tensor:
    """A contiguous stand-in for ``t``; results are copied back when written."""
    if t.is_contiguous():
        return t
    c = t.contiguous()
    if written:
        post.append(lambda: t.copy_(c))
    return c


def _root(op: str, g: Group, global_rank: int, what: str = "src") -> int:
    if not isinstance(global_rank, int) or isinstance(global_rank, bool):
        raise TypeError(f"{op}: {what} must be an int rank, got {global_rank!r}")
    try:
        return g.group_rank(global_rank)
    except ValueError as exc:
        raise ValueError(f"{op}: {what}: {exc}") from None


def _reduction(op: str, tensors: Sequence[torch.Tensor], reduce_op, g: Group, post: list,
               holds_result: bool = True):
    """Map a reduction to what every backend can do exactly.

    bool -> uint8 with SUM/MAX as logical or, PRODUCT/MIN as logical and;
    AVG -> SUM, then the rank holding the result divides (floating point
    only). Returns (tensors, op)."""
    if reduce_op is ReduceOp.SUM and tensors[0].dtype is not torch.bool:
        return tensors, reduce_op  # the common case, kept cheap
    try:
        rop = ReduceOp.coerce(reduce_op)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None
    dtype = tensors[0].dtype
    if dtype == torch.bool:
        if rop is ReduceOp.AVG:
            raise UnsupportedError(f"{op}: ReduceOp.AVG is undefined for torch.bool")
        rop = ReduceOp.MAX if rop in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN
        return [t.view(torch.uint8) for t in tensors], rop
    if rop is ReduceOp.AVG:
        if not dtype.is_floating_point:
            raise UnsupportedError(f"{op}: ReduceOp.AVG on {dtype} is refused (an integer mean "
                                   "is not exact); use SUM and divide")
        if holds_result:
            out, n = tensors[-1], g.size
            post.insert(0, lambda: out.div_(n))
        return list(tensors), ReduceOp.SUM
    return list(tensors), rop


def _fingerprint(rt: Runtime, g: Group, op: str, backend: Optional[str], **fields) -> None:
    """Debug mode: all ranks compare what they are about to issue (and count
    their arrival, so a timeout can name the rank that did not come)."""
    g.seq += 1
    if rt.health is not None:
        rt.health.arrive(g.name)
    mine = {"seq": g.seq, "op": op, "backend": backend, **fields}
    try:
        blobs = rt.control_allgather(g, json.dumps(mine, sort_keys=True, default=str).encode())
    except CommError as exc:  # name the user's op, not the control message
        where = f"{op} on backend '{backend}'" if backend else op
        exc.args = (f"{where}: debug-mode order check failed: {exc.args[0]}", *exc.args[1:])
        raise
    prints = [json.loads(b) for b in blobs]
    keys = sorted({k for p in prints for k in p})
    differ = [k for k in keys if len({json.dumps(p.get(k), sort_keys=True) for p in prints}) > 1]
    if differ:
        detail = "; ".join(f"rank {g.ranks[i]}: " + ", ".join(f"{k}={p.get(k)}" for k in differ)
                           for i, p in enumerate(prints))
        raise CommError(f"collective mismatch on group {g.name} at collective #{g.seq}: fields "
                        f"{differ} differ across ranks ({detail})")


def _submit(op: str, g: Group, nbytes: int, ref: torch.Tensor, explicit: Optional[str],
            async_op: bool, start: Callable, reads=(), writes=(), post=(), result=(),
            reduce_op=None, collective: bool = True, invariant=None, agree: bool = False,
            skip_empty: bool = True, peer: int = -1, counts=None):
    """Select, check order, start and track one operation.

    The local choice comes first: it refuses what no backend can run before
    any message (agreement, fingerprint) is sent. ``agree``: the size differs
    per rank (all-to-all), so ranks agree on its maximum when that matters.
    ``skip_empty``: a zero-byte op (same on every rank) sends nothing.
    ``peer`` (root or p2p peer, group rank) and ``counts`` (all-to-all element
    counts per peer) only feed the communication logger."""
    rt = _runtime
    sel = rt.selector
    device = "cpu" if ref.is_cpu else ref.device.type
    name = sel.choose(op, nbytes, g.size, device, ref.dtype, reduce_op, explicit)
    tuner = rt.autotune if rt.autotune is not None and rt.autotune.explores(op, explicit) else None
    if agree and (tuner is not None or sel.needs_agreement(op, g.size, explicit, device)):
        if rt.debug:
            _fingerprint(rt, g, op, None, dtype=str(ref.dtype), device=device, shape=invariant,
                         explicit=explicit)
        nbytes = rt.control_max(g, nbytes)
        name = sel.choose(op, nbytes, g.size, device, ref.dtype, reduce_op, explicit)
    elif rt.debug and collective:
        _fingerprint(rt, g, op, name, dtype=str(ref.dtype), device=device, shape=invariant,
                     explicit=explicit, **({} if tuner is None else
                                           {"autotune": tuner.peek(g, op, nbytes, device)}))
    if nbytes == 0 and skip_empty:
        return _skip(rt, op, async_op, result)
    timing = None  # the autotune bucket this call is timed for
    if tuner is not None:
        picked, timing = tuner.pick(rt, g, op, nbytes, device,
                                    lambda n: sel.why_not(n, op, device, ref.dtype, reduce_op) is None)
        name = picked or name
    engine = rt.engine
    observer = rt.traced if _torch_profiler._is_profiler_enabled else rt.observer
    if observer is not None:
        elem = ref.element_size()
        post = [observer.begin(op, name, g, nbytes, async_op, peer,
                               None if counts is None else [c * elem for c in counts], reads, writes), *post]
    if async_op:  # not timed: see mcrdl.autotune
        timing = None
    # CUDA: NCCL and staged MPI return once their results are stream-ordered,
    # so a timed call is timed from an idle stream to the results' arrival
    stream = None if timing is None or device == "cpu" else current_stream(ref.get_device())
    if stream is not None:
        stream.synchronize()
    began = 0.0 if timing is None else time.perf_counter()
    try:
        pending = start(rt.backends[name], g.handles[name])
    except Exception as exc:
        raise CommError(f"{op} on backend '{name}' could not start: {exc}") from exc
    work = engine.run(op, name, pending, reads, writes, post, g, result, async_op)
    if timing is not None:
        if stream is not None:
            stream.synchronize()
        tuner.record(timing, name, time.perf_counter() - began)
    if work is not None:
        work.peer = peer
    return work


def combine(op: str, works: Sequence[Optional[Work]], post: Sequence[Callable[[], None]] = (),
            result: Sequence[torch.Tensor] = (), async_op: bool = True,
            group: Optional[Group] = None, reads: Sequence[torch.Tensor] = (),
            writes: Sequence[torch.Tensor] = ()) -> Optional[Work]:
    """One Work for several async works (features built on the API, e.g.
    fusion): it completes when all have, then runs ``post`` (e.g. unpacking).
    ``reads``/``writes``: the tensors ``post`` touches, so later ops order
    after it. With ``async_op=False`` waits and returns None."""
    rt, g = current_runtime(), _group(group, op)
    works = [w for w in works if w is not None]
    backends = "+".join(dict.fromkeys(w.backend for w in works)) or "none"
    return rt.engine.run(op, backends, AfterAll(rt.engine, works), tuple(reads), tuple(writes),
                         post, g, result, async_op)


def _skip(rt: Runtime, op: str, async_op: bool, result=()) -> Optional[Work]:
    """Zero-byte collective: every rank agrees (sizes are rank-invariant) to do nothing."""
    if not async_op:
        return None
    work = Work(rt.engine, op, "none", Done(), result=result)
    work._finish()
    return work


# -- fast paths ---------------------------------------------------------------------------
# A blocking op on contiguous CPU tensors, with nothing outstanding and debug mode
# off, skips the general path's no-op steps (order checks, staging, reduction
# mapping, aliasing copies): its checks and selection run once per group and
# plan key (sizes or shapes, dtype, backend=), kept in ``Group.starters``. A
# call right after compute pays for every line it runs in cache misses
# (docs/results/cold_calls.md), so these paths matter more in a training step
# than back to back. The ops with an async fast path (``async_ok``) start the
# backend's nonblocking op from their plan instead, after outstanding work
# their tensors conflict with, and track it as any async work (see _fast).
def _fast_group(rt: Optional[Runtime], group: Optional[Group], async_op: bool,
                backend: Optional[str], async_ok: bool = False) -> Optional[Group]:
    """The group an op may take its fast path on, or None (then the general
    path runs, and reports bad arguments or a dead peer)."""
    if (rt is None or rt.debug or rt.engine.lost or (rt.engine.outstanding if not async_op else not async_ok)
            or not (backend is None or type(backend) is str)):
        return None
    g = rt.world if group is None else group
    return g if type(g) is Group and g.owner is rt and g.rank >= 0 else None


def _remember(g: Group, key, plan):
    """Keep ``plan`` as ``g``'s plan for ``key`` (at most 4096 per group); None
    (no plan while autotune explores) is not kept."""
    if plan is None:
        return None
    if len(g.starters) >= 4096:
        g.starters.clear()
    g.starters[key] = plan
    return plan


def _planned(rt: Runtime, g: Group, op: str, nbytes: int, dtype: torch.dtype, reduce_op,
             backend: Optional[str], tensors: tuple, fixed: tuple, async_op: bool = False):
    """A fast-path plan's backend and start function (:func:`_starter`), with
    the selector's choice or autotune's frozen one (counted for its drift
    check); None while autotune explores the op's bucket (the general path
    runs those calls, on every rank alike, and no plan is kept)."""
    name = rt.selector.choose(op, nbytes, g.size, "cpu", dtype, reduce_op, backend)
    tuner = rt.autotune
    if tuner is not None and backend is None:
        won = tuner.frozen(g, op, nbytes, "cpu", name)
        if won is None:
            return None
        runs = won == name or rt.selector.why_not(won, op, "cpu", dtype, reduce_op) is None
        name = won if runs else name  # (the winner cannot run this dtype or reduction)
        start = _starter(rt, g, name, op, tensors, fixed, async_op)
        return name, tuner.watched(rt, g, op, nbytes, start, timed=runs and not async_op)
    return name, _starter(rt, g, name, op, tensors, fixed, async_op)


def _starter(rt: Runtime, g: Group, name: str, op: str, tensors: tuple, fixed: tuple, async_op: bool):
    """A plan's start function: the backend's blocking fast path, or (async: a
    wait of 0 s) one that only starts the op."""
    return rt.backends[name].starter(op, g.handles[name], 0.0 if async_op else g.timeout, tensors, *fixed)


def _fast(rt: Runtime, g: Group, op: str, name: str, start: Callable, args: tuple, nbytes: int,
          reads, writes, result, async_op: bool, peer: int = -1, skip_empty: bool = True) -> Optional[Work]:
    """Run a fast-path op: blocking (``_block``), or started and tracked as
    async work after outstanding work it conflicts with. ``skip_empty``: a
    zero-byte op (a collective: same on every rank) sends nothing."""
    if not nbytes and skip_empty:
        return _skip(rt, op, async_op, result)
    observer = rt.traced if _torch_profiler._is_profiler_enabled else rt.observer
    if not async_op:
        if observer is None:  # _block's unobserved case, inline: one call fewer
            pending = start(*args)
            if pending is not DONE:
                rt.engine.block(op, name, pending, g, reads, writes)
        else:
            _block(rt, g, op, name, start, args, nbytes, reads, writes, peer)
        return None
    engine = rt.engine
    spans = engine.order_before(reads, writes, op) if engine.outstanding else None
    post = () if observer is None else (observer.begin(op, name, g, nbytes, True, peer, None, reads, writes),)
    try:
        pending = start(*args)
    except Exception as exc:
        raise CommError(f"{op} on backend '{name}' could not start: {exc}") from exc
    work = engine.run(op, name, pending, reads, writes, post, g, result, True, spans)
    work.peer = peer
    return work


def _block(rt: Runtime, g: Group, op: str, name: str, start: Callable, args: tuple, nbytes: int,
           reads, writes, peer: int = -1, counts=None) -> None:
    """``start(*args)`` a fast-path op (observed as the general path observes it) and wait for it."""
    observer = rt.traced if _torch_profiler._is_profiler_enabled else rt.observer
    if observer is None:
        pending = start(*args)
        if pending is not DONE:  # not finished inside the backend
            rt.engine.block(op, name, pending, g, reads, writes)
        return
    end = observer.begin(op, name, g, nbytes, False, peer, counts, reads, writes)
    pending = start(*args)
    if pending is DONE:  # (finished inside the backend: the observer's end alone)
        end()
    else:
        rt.engine.block(op, name, pending, g, reads, writes, (end,))


# -- collectives --------------------------------------------------------------------------
def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group: Optional[Group] = None,
               async_op: bool = False, backend: Optional[str] = None) -> Optional[Work]:
    """Reduce ``tensor`` across the group, in place on every rank."""
    rt = _runtime
    # The fast path, with _fast_group and _block inlined for the unlogged case
    # (two calls fewer on the 4-byte latency path).
    if (op is _SUM and not async_op and rt is not None and not rt.debug and not rt.engine.outstanding
            and not rt.engine.lost and (backend is None or type(backend) is str)):
        g = rt.world if group is None else group
        kind = _key(tensor)
        if type(g) is Group and g.owner is rt and g.rank >= 0 and kind is not None and kind[1] is not torch.bool:
            key = (kind, backend)
            plan = g.starters.get(key) or _remember(g, key, _all_reduce_plan(rt, g, tensor, backend))
            if plan is not None:
                nbytes = kind[0]
                if nbytes:
                    if rt.observer is None and not _torch_profiler._is_profiler_enabled:
                        pending = plan[1](tensor)
                        if pending is not DONE:
                            rt.engine.block("all_reduce", plan[0], pending, g, (tensor,))
                    else:
                        _block(rt, g, "all_reduce", plan[0], plan[1], (tensor,), nbytes, (tensor,), (tensor,))
                return None
    if async_op and op is _SUM:
        g = _fast_group(rt, group, True, backend, async_ok=True)
        kind = _key(tensor)
        if g is not None and kind is not None and kind[1] is not torch.bool:
            key = ("all_reduce", kind, backend, True)
            plan = g.starters.get(key) or _remember(g, key, _all_reduce_plan(rt, g, tensor, backend, True))
            if plan is not None:
                return _fast(rt, g, "all_reduce", plan[0], plan[1], (tensor,), kind[0], (tensor,),
                             (tensor,), (tensor,), True)
    return _all_reduce(tensor, op, group, async_op, backend)


def _all_reduce_plan(rt: Runtime, g: Group, tensor: torch.Tensor, backend: Optional[str],
                     async_op: bool = False):
    _check("all_reduce", tensor)
    return _planned(rt, g, "all_reduce", tensor.nbytes, tensor.dtype, ReduceOp.SUM, backend, (tensor,),
                    (ReduceOp.SUM,), async_op)


def _all_reduce(tensor, op, group, async_op, backend) -> Optional[Work]:
    g = _group(group, "all_reduce")
    _check("all_reduce", tensor)
    if g.rank < 0:
        return None
    wait_for_conflicts("all_reduce", (tensor,), (tensor,))
    post: list = []
    t = tensor if tensor.is_contiguous() else _contiguous(tensor, True, post)
    (t,), rop = _reduction("all_reduce", (t,), op, g, post)
    nbytes = tensor.nbytes
    return _submit("all_reduce", g, nbytes, tensor, backend, async_op,
                   lambda b, h: b.all_reduce(h, t, rop), reads=(tensor,), writes=(tensor,),
                   post=post, result=[tensor], reduce_op=rop, invariant=tensor.shape)


def broadcast(tensor: torch.Tensor, src: int, group: Optional[Group] = None,
              async_op: bool = False, backend: Optional[str] = None) -> Optional[Work]:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group."""
    rt = _runtime
    g = _fast_group(rt, group, async_op, backend, async_ok=True)
    kind = _key(tensor) if g is not None and type(src) is int else None
    if kind is not None:
        key = ("broadcast", kind, backend, src, async_op)
        plan = g.starters.get(key) or _remember(g, key, _broadcast_plan(rt, g, tensor, src, backend, async_op))
        if plan is not None:
            name, start, root = plan
            return _fast(rt, g, "broadcast", name, start, (tensor,), kind[0], (tensor,), (tensor,), (tensor,),
                         async_op, root)
    g = _group(group, "broadcast")
    _check("broadcast", tensor)
    if g.rank < 0:
        return None
    root = _root("broadcast", g, src)
    wait_for_conflicts("broadcast", (tensor,), (tensor,))
    post: list = []
    t = _contiguous(tensor, True, post)
    nbytes = _nbytes(tensor)
    return _submit("broadcast", g, nbytes, tensor, backend, async_op,
                   lambda b, h: b.broadcast(h, t, root), reads=(tensor,), writes=(tensor,),
                   post=post, result=[tensor], invariant=[list(tensor.shape), src], peer=root)


def _broadcast_plan(rt: Runtime, g: Group, tensor: torch.Tensor, src: int, backend: Optional[str],
                    async_op: bool):
    _check("broadcast", tensor)
    root = _root("broadcast", g, src)
    plan = _planned(rt, g, "broadcast", tensor.nbytes, tensor.dtype, None, backend, (tensor,), (root,), async_op)
    return plan and (*plan, root)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group: Optional[Group] = None,
           async_op: bool = False, backend: Optional[str] = None) -> Optional[Work]:
    """Reduce ``tensor`` onto global rank ``dst`` (other ranks' tensors are scratch)."""
    rt = _runtime
    g = _fast_group(rt, group, async_op, backend)
    kind = _key(tensor) if g is not None and op is _SUM and type(dst) is int else None
    if kind is not None and kind[1] is not torch.bool:
        key = ("reduce", kind, backend, dst)
        plan = g.starters.get(key) or _remember(g, key, _reduce_plan(rt, g, tensor, dst, backend))
        if plan is not None:
            nbytes = kind[0]
            if nbytes:
                _block(rt, g, "reduce", plan[0], plan[1], (tensor,), nbytes, (tensor,), (tensor,), plan[2])
            return None
    g = _group(group, "reduce")
    _check("reduce", tensor)
    if g.rank < 0:
        return None
    root = _root("reduce", g, dst, "dst")
    wait_for_conflicts("reduce", (tensor,), (tensor,))
    post: list = []
    (t,), rop = _reduction("reduce", [_contiguous(tensor, True, post)], op, g, post,
                           holds_result=g.rank == root)
    nbytes = _nbytes(tensor)
    return _submit("reduce", g, nbytes, tensor, backend, async_op,
                   lambda b, h: b.reduce(h, t, root, rop), reads=(tensor,), writes=(tensor,),
                   post=post, result=[tensor], reduce_op=rop, invariant=[list(tensor.shape), dst],
                   peer=root)


def _reduce_plan(rt: Runtime, g: Group, tensor: torch.Tensor, dst: int, backend: Optional[str]):
    _check("reduce", tensor)
    root = _root("reduce", g, dst, "dst")
    plan = _planned(rt, g, "reduce", tensor.nbytes, tensor.dtype, ReduceOp.SUM, backend, (tensor,),
                    (root, ReduceOp.SUM))
    return plan and (*plan, root)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Optional[Group] = None, async_op: bool = False,
                           backend: Optional[str] = None) -> Optional[Work]:
    """Concatenate every rank's ``input_tensor`` into ``output_tensor`` (dim 0)."""
    op = "all_gather_into_tensor"
    done = _pair_fast(op, output_tensor, input_tensor, group, async_op, backend)
    if done is not _GENERAL:
        return done
    g = _group(group, "all_gather_into_tensor")
    _check(op, output_tensor, "output_tensor")
    _check(op, input_tensor, "input_tensor")
    _holds_blocks(op, g, input_tensor, output_tensor, "output_tensor")
    if g.rank < 0:
        return None
    wait_for_conflicts(op, (input_tensor,), (output_tensor,))
    post: list = []
    out = _contiguous(output_tensor, True, post)
    inp = _private(_contiguous(input_tensor, False, post), out)
    nbytes = _nbytes(output_tensor)
    return _submit(op, g, nbytes, input_tensor, backend, async_op,
                   lambda b, h: b.all_gather_into_tensor(h, out, inp),
                   reads=(input_tensor,), writes=(output_tensor,), post=post,
                   result=[output_tensor], invariant=list(input_tensor.shape))


def _holds_blocks(op: str, g: Group, block: torch.Tensor, whole: torch.Tensor, what: str) -> None:
    """``whole`` (named ``what``) is one ``block`` per rank of ``g``, of the same kind."""
    _same_kind(op, block, whole, what)
    if whole.numel() != block.numel() * g.size:
        raise ValueError(f"{op}: {what} has {whole.numel()} elements, expected "
                         f"{block.numel()} x {g.size} ranks = {block.numel() * g.size}")


#: What a fast path returns when the general path must run the call.
_GENERAL = object()


def _pair_fast(op: str, output, input, group: Optional[Group], async_op: bool, backend: Optional[str]):
    """The fast path of all_gather_into_tensor or reduce_scatter_tensor (SUM):
    its result, or _GENERAL when the general path must run the call."""
    rt = _runtime
    g = _fast_group(rt, group, async_op, backend, async_ok=True)
    return _GENERAL if g is None else _pair_run(rt, g, op, output, input, async_op, backend)


def _pair_run(rt: Runtime, g: Group, op: str, output, input, async_op: bool, backend: Optional[str]):
    """:func:`_pair_fast` on a fast-path group (the general path runs aliased
    tensors: it copies)."""
    both = _pair(input, output)
    if both is None or (both[1] is torch.bool and op == "reduce_scatter_tensor"):  # (reduced as uint8)
        return _GENERAL
    key = (op, both, backend, async_op)
    plan = g.starters.get(key) or _remember(g, key, _gather_plan(rt, g, op, output, input, backend, async_op))
    if plan is None:
        return _GENERAL
    return _fast(rt, g, op, plan[0], plan[1], (output, input), max(both[0], both[3]), (input,), (output,),
                 (output,), async_op)  # (logged as the general path logs it: the whole buffer)


def _gather_plan(rt: Runtime, g: Group, op: str, output: torch.Tensor, input: torch.Tensor,
                 backend: Optional[str], async_op: bool = False):
    """Fast-path plan of all_gather_into_tensor (``output`` holds ``g.size``
    inputs) or reduce_scatter_tensor SUM (``input`` holds ``g.size`` outputs)."""
    gather = op == "all_gather_into_tensor"
    small, large = (input, output) if gather else (output, input)
    if gather:  # checked in the general path's order
        _check(op, output, "output_tensor")
        _check(op, input, "input_tensor")
    else:
        _check(op, output, "output")
        _check(op, input, "input")
    _holds_blocks(op, g, small, large, "output_tensor" if gather else "input")
    return _planned(rt, g, op, large.nbytes, small.dtype, None if gather else ReduceOp.SUM, backend,
                    (output, input), () if gather else (ReduceOp.SUM,), async_op)


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Optional[Group] = None,
               async_op: bool = False, backend: Optional[str] = None) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``tensor_list[rank]``."""
    op = "all_gather"
    g = _fast_group(_runtime, group, async_op, backend)
    kind = None if g is None else _key(tensor)
    if kind is not None:
        whole = _span(g, op, tensor_list, kind)  # tensor_list: views of one buffer
        if whole is not None:
            done = _pair_run(_runtime, g, "all_gather_into_tensor", whole, tensor, False, backend)
            # (aliased, or autotune exploring: the tensor op's general path copies less than the list's)
            return all_gather_into_tensor(whole, tensor, group, False, backend) if done is _GENERAL else done
    g = _group(group, "all_gather")
    _check(op, tensor)
    _check_list(op, tensor_list, "tensor_list", tensor, g.size)
    if g.rank < 0:
        return None
    wait_for_conflicts(op, (tensor,), tuple(tensor_list))
    flat = tensor.new_empty(g.size * tensor.numel())
    post = [_unpack(flat, tensor_list)]
    inp = tensor.contiguous()
    return _submit(op, g, _nbytes(flat), tensor, backend, async_op,
                   lambda b, h: b.all_gather_into_tensor(h, flat, inp.view(-1)),
                   reads=(tensor,), writes=tuple(tensor_list), post=post, result=tensor_list,
                   invariant=tensor.shape)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                          group: Optional[Group] = None, async_op: bool = False,
                          backend: Optional[str] = None) -> Optional[Work]:
    """Reduce ``input`` across ranks and leave block ``rank`` of it in ``output``."""
    name = "reduce_scatter_tensor"
    if op is _SUM:
        done = _pair_fast(name, output, input, group, async_op, backend)
        if done is not _GENERAL:
            return done
    g = _group(group, "reduce_scatter_tensor")
    _check(name, output, "output")
    _check(name, input, "input")
    _holds_blocks(name, g, output, input, "input")
    if g.rank < 0:
        return None
    wait_for_conflicts(name, (input,), (output,))
    post: list = []
    out = _contiguous(output, True, post)
    inp = _private(_contiguous(input, False, post), out)
    (inp, out), rop = _reduction(name, [inp, out], op, g, post)
    nbytes = _nbytes(input)
    return _submit(name, g, nbytes, output, backend, async_op,
                   lambda b, h: b.reduce_scatter_tensor(h, out, inp, rop),
                   reads=(input,), writes=(output,), post=post, result=[output],
                   reduce_op=rop, invariant=list(output.shape))


#: torch 2.13's names for the same two calls (it deprecates the ones above).
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def reduce_scatter(output: torch.Tensor, input_list: List[torch.Tensor], op=ReduceOp.SUM,
                   group: Optional[Group] = None, async_op: bool = False,
                   backend: Optional[str] = None) -> Optional[Work]:
    """Reduce ``input_list[i]`` across ranks into ``output`` on group rank ``i``."""
    name = "reduce_scatter"
    g = _fast_group(_runtime, group, async_op, backend)
    kind = _key(output) if g is not None and op is _SUM else None
    if kind is not None:
        whole = _span(g, name, input_list, kind)  # input_list: views of one buffer
        if whole is not None:
            done = _pair_run(_runtime, g, "reduce_scatter_tensor", output, whole, False, backend)
            return reduce_scatter_tensor(output, whole, op, group, False, backend) if done is _GENERAL else done
    g = _group(group, "reduce_scatter")
    _check(name, output, "output")
    _check_list(name, input_list, "input_list", output, g.size)
    if g.rank < 0:
        return None
    wait_for_conflicts(name, tuple(input_list), (output,))
    post: list = []
    out = _contiguous(output, True, post)
    flat = torch.cat([t.reshape(-1) for t in input_list]) if input_list else output.new_empty(0)
    (flat, out), rop = _reduction(name, [flat, out], op, g, post)
    return _submit(name, g, _nbytes(flat), output, backend, async_op,
                   lambda b, h: b.reduce_scatter_tensor(h, out.view(-1), flat, rop),
                   reads=tuple(input_list), writes=(output,), post=post, result=[output],
                   reduce_op=rop, invariant=list(output.shape))


def gather(tensor: torch.Tensor, gather_list: Optional[List[torch.Tensor]] = None, dst: int = 0,
           group: Optional[Group] = None, async_op: bool = False,
           backend: Optional[str] = None) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
    op = "gather"
    if _rooted_fast(op, tensor, gather_list, dst, group, async_op, backend):
        return None
    g = _group(group, "gather")
    _check(op, tensor)
    if g.rank < 0:
        return None
    root = _root(op, g, dst, "dst")
    flat = None
    post: list = []
    if g.rank == root:
        _check_list(op, gather_list, "gather_list", tensor, g.size)
        flat = tensor.new_empty(g.size * tensor.numel())
        post.append(_unpack(flat, gather_list))
    elif gather_list:
        raise ValueError(f"{op}: gather_list must be None or empty on non-destination rank {get_rank()}")
    wait_for_conflicts(op, (tensor,), tuple(gather_list or ()))
    inp = tensor.contiguous().view(-1)
    return _submit(op, g, _nbytes(tensor) * g.size, tensor, backend, async_op,
                   lambda b, h: b.gather(h, flat, inp, root), reads=(tensor,),
                   writes=tuple(gather_list or ()), post=post, result=gather_list or [],
                   invariant=[list(tensor.shape), dst], peer=root)


def scatter(tensor: torch.Tensor, scatter_list: Optional[List[torch.Tensor]] = None, src: int = 0,
            group: Optional[Group] = None, async_op: bool = False,
            backend: Optional[str] = None) -> Optional[Work]:
    """Scatter ``scatter_list[i]`` from global rank ``src`` to group rank ``i``'s ``tensor``."""
    op = "scatter"
    if _rooted_fast(op, tensor, scatter_list, src, group, async_op, backend):
        return None
    g = _group(group, "scatter")
    _check(op, tensor)
    if g.rank < 0:
        return None
    root = _root(op, g, src)
    flat = None
    if g.rank == root:
        _check_list(op, scatter_list, "scatter_list", tensor, g.size)
        wait_for_conflicts(op, tuple(scatter_list), (tensor,))
        flat = torch.cat([t.reshape(-1) for t in scatter_list])
    elif scatter_list:
        raise ValueError(f"{op}: scatter_list must be None or empty on non-source rank {get_rank()}")
    wait_for_conflicts(op, (), (tensor,))
    post: list = []
    out = _contiguous(tensor, True, post)
    return _submit(op, g, _nbytes(tensor) * g.size, tensor, backend, async_op,
                   lambda b, h: b.scatter(h, out.view(-1), flat, root),
                   reads=tuple(scatter_list or ()), writes=(tensor,), post=post, result=[tensor],
                   invariant=[list(tensor.shape), src], peer=root)


def _rooted_fast(op: str, tensor, parts, global_root, group: Optional[Group], async_op: bool,
                 backend: Optional[str]) -> bool:
    """The fast path of gather (``parts``: the root's gather_list) or scatter
    (its scatter_list); False when the general path must run the call.
    (:func:`_fast_group` inline, and the list copied only when the op did not
    finish in its start: a few tenths of a µs of a 3 µs call.)"""
    rt = _runtime
    if (async_op or rt is None or rt.debug or rt.engine.outstanding or rt.engine.lost
            or not (backend is None or type(backend) is str) or type(global_root) is not int):
        return False
    g = rt.world if group is None else group
    kind = _key(tensor) if type(g) is Group and g.owner is rt and g.rank >= 0 else None
    if kind is None:
        return False
    key = (op, kind, backend, global_root)
    plan = g.starters.get(key) or _remember(g, key, _rooted_plan(rt, g, op, tensor, global_root, backend))
    if plan is None:
        return False
    name, start, root = plan
    whole = None
    if g.rank == root:
        whole = _span(g, op, parts, kind, tensor)
        if whole is None:  # (also when the list holds ``tensor``: the general path copies)
            return False
    elif parts:
        return False
    if not kind[0]:
        return True
    gather = op == "gather"
    args = (whole, tensor) if gather else (tensor, whole)
    unobserved = rt.observer is None and not _torch_profiler._is_profiler_enabled
    pending = start(*args) if unobserved else None
    if pending is not DONE:
        blocks = () if whole is None else tuple(parts)  # (kept alive if the op is abandoned: not the caller's list)
        reads, writes = ((tensor,), blocks) if gather else (blocks, (tensor,))
        if unobserved:
            rt.engine.block(op, name, pending, g, reads, writes)
        else:
            _block(rt, g, op, name, start, args, kind[0] * g.size, reads, writes, root)
    return True


def _rooted_plan(rt: Runtime, g: Group, op: str, tensor: torch.Tensor, global_root: int,
                 backend: Optional[str]):
    """Fast-path plan of gather or scatter: (backend, start(output, input), group root)."""
    _check(op, tensor)
    root = _root(op, g, global_root, "dst" if op == "gather" else "src")
    tensors = (None, tensor) if op == "gather" else (tensor, None)
    plan = _planned(rt, g, op, tensor.nbytes * g.size, tensor.dtype, None, backend, tensors, (root,))
    return plan and (*plan, root)


#: Largest list (bytes) whose spanning view a group remembers between calls.
SPAN_MEMO_BYTES = 64 << 10


def _span(g: Group, op: str, parts, kind: tuple, apart=None) -> Optional[torch.Tensor]:
    """One flat tensor over ``parts`` if they are ``g.size`` tensors of
    ``kind`` (nbytes, dtype) lying back to back in memory (as ``x.chunk(n)``
    makes them) and sharing no byte with tensor ``apart`` (when given), else
    None: the general path checks and copies. A group
    remembers the view of its last small list per op: a list at the same
    address next time reuses it while the view is still there (its storage
    keeps that memory allocated unless it was resized or freed in place, as
    FSDP frees parameters: then the view has moved and is not reused)."""
    nbytes, dtype = kind
    at = _span_at(parts, g.size, dtype, nbytes, apart)
    if at is None:
        return None
    memo = g.starters.get(op)  # (address, nbytes, dtype, view), under the op's bare name (plans: tuples)
    if memo is not None and memo[0] == at and memo[1] == nbytes and memo[2] is dtype and memo[3].data_ptr() == at:
        return memo[3]
    try:  # a view of the first part's storage, which must hold them all
        whole = parts[0].as_strided((g.size * parts[0].numel(),), (1,))
    except RuntimeError:
        return None
    if nbytes * g.size <= SPAN_MEMO_BYTES:
        _remember(g, op, (at, nbytes, dtype, whole))
    return whole


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None, group: Optional[Group] = None,
                      async_op: bool = False, backend: Optional[str] = None) -> Optional[Work]:
    """Split ``input`` along dim 0, send block ``i`` to group rank ``i``, and
    concatenate what arrives into ``output`` (uneven with split sizes)."""
    rt = _runtime
    g = _fast_group(rt, group, async_op, backend)
    both = None if g is None else _pair(input, output)  # (aliased buffers: the general path copies)
    if both is not None:
        even = not output_split_sizes and not input_split_sizes
        key = ("all_to_all_single", both, backend, even)
        plan = g.starters.get(key)
        if plan is None:
            plan = _remember(g, key, _all_to_all_plan(rt, g, output, input, backend, even))
        if plan:  # False: ranks must agree on the size first (general path)
            name, run, row = plan
            if even:
                out_counts = in_counts = None
            else:
                out_counts = _counts(output_split_sizes, g.size, both[5], row)
                in_counts = _counts(input_split_sizes, g.size, both[2], row)
                if out_counts is None or in_counts is None:  # the general path names what is wrong
                    return _all_to_all_single(output, input, output_split_sizes, input_split_sizes, group,
                                              async_op, backend)
            counts = None  # bytes per peer with split sizes (Alltoallv), for the logger only
            if rt.observer is not None and not even:
                counts = [c * input.element_size() for c in in_counts]
            _block(rt, g, "all_to_all_single", name, run, (output, input, out_counts, in_counts),
                   both[0], (input,), (output,), counts=counts)
            return None
    return _all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op, backend)


def _all_to_all_plan(rt: Runtime, g: Group, output: torch.Tensor, input: torch.Tensor,
                     backend: Optional[str], even: bool):
    """(backend name, start, elements per row) for the fast path; False where
    the general path must run (ranks must agree on the size first), None while
    autotune explores the bucket."""
    op = "all_to_all_single"
    _check(op, output, "output")
    _check(op, input, "input")
    _same_kind(op, input, output, "output")
    row = _row_elements(op, input, output)
    if even:  # the same size on every rank: no agreement
        _even_rows(op, _splits(op, "input", input, None, g.size), _splits(op, "output", output, None, g.size))
    elif rt.selector.needs_agreement(op, g.size, backend) or (rt.autotune is not None
                                                               and rt.autotune.explores(op, backend)):
        return False
    plan = _planned(rt, g, op, input.nbytes, input.dtype, None, backend, (output, input), ())
    return plan and (*plan, row)


def _counts(splits, size: int, shape: tuple, row: int) -> Optional[list]:
    """Elements per peer from valid split sizes of a tensor of ``shape`` (a
    list of ``size`` non-negative ints summing to its rows), else None."""
    if type(splits) is not list or len(splits) != size:
        return None
    total = 0
    for s in splits:
        if type(s) is not int or s < 0:
            return None
        total += s
    if total * row != (shape[0] if shape else 1) * row:
        return None
    return splits if row == 1 else [s * row for s in splits]


def _row_elements(op: str, input: torch.Tensor, output: torch.Tensor) -> int:
    """Elements per dim-0 row, the same in ``input`` and ``output``."""
    row = _row(input)
    if row != _row(output):
        raise ValueError(f"{op}: input rows have {row} elements but output rows have {_row(output)}")
    return row


def _even_rows(op: str, in_rows: list, out_rows: list) -> None:
    """Without split sizes every rank sends and receives the same rows."""
    if in_rows != out_rows:
        raise ValueError(f"{op}: without split sizes input and output need the same rows, got "
                         f"{sum(in_rows)} and {sum(out_rows)}")


def _all_to_all_single(output, input, output_split_sizes, input_split_sizes, group, async_op,
                       backend) -> Optional[Work]:
    op = "all_to_all_single"
    g = _group(group, "all_to_all_single")
    _check(op, output, "output")
    _check(op, input, "input")
    _same_kind(op, input, output, "output")
    if g.rank < 0:
        return None
    in_rows = _splits(op, "input", input, input_split_sizes, g.size)
    out_rows = _splits(op, "output", output, output_split_sizes, g.size)
    row_in = _row_elements(op, input, output)
    # No split sizes: an even split on every rank (ranks agree on passing split
    # sizes or not; debug mode checks), which MPI runs as the faster Alltoall.
    even = not output_split_sizes and not input_split_sizes
    if even:
        _even_rows(op, in_rows, out_rows)
    wait_for_conflicts(op, (input,), (output,))
    post: list = []
    out = _contiguous(output, True, post)
    inp = _private(_contiguous(input, False, post), out)
    in_counts = [r * row_in for r in in_rows]
    out_counts = [r * row_in for r in out_rows]
    counts = (None, None) if even else (out_counts, in_counts)
    return _submit(op, g, _nbytes(input), input, backend, async_op,
                   lambda b, h: b.all_to_all_single(h, out, inp, *counts),
                   reads=(input,), writes=(output,), post=post, result=[output],
                   invariant={"row": list(input.shape[1:]), "split sizes": "none" if even else "given"},
                   agree=not even, skip_empty=False, counts=None if even else in_counts)


def all_to_all(output_tensor_list: List[torch.Tensor], input_tensor_list: List[torch.Tensor],
               group: Optional[Group] = None, async_op: bool = False,
               backend: Optional[str] = None) -> Optional[Work]:
    """Send ``input_tensor_list[i]`` to group rank ``i``; receive into ``output_tensor_list``."""
    op = "all_to_all"
    g = _group(group, "all_to_all")
    for what, lst in (("input_tensor_list", input_tensor_list), ("output_tensor_list", output_tensor_list)):
        if not isinstance(lst, (list, tuple)) or len(lst) != g.size:
            raise ValueError(f"{op}: {what} must be a list of {g.size} tensors")
        for i, t in enumerate(lst):
            _check(op, t, f"{what}[{i}]")
            _same_kind(op, input_tensor_list[0], t, f"{what}[{i}]")
    if g.rank < 0:
        return None
    ref = input_tensor_list[0]
    wait_for_conflicts(op, tuple(input_tensor_list), tuple(output_tensor_list))
    flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
    flat_out = ref.new_empty(sum(t.numel() for t in output_tensor_list))
    in_counts = [t.numel() for t in input_tensor_list]
    out_counts = [t.numel() for t in output_tensor_list]
    return _submit(op, g, _nbytes(flat_in), ref, backend, async_op,
                   lambda b, h: b.all_to_all_single(h, flat_out, flat_in, out_counts, in_counts),
                   reads=tuple(input_tensor_list), writes=tuple(output_tensor_list),
                   post=[_unpack(flat_out, output_tensor_list)], result=list(output_tensor_list),
                   invariant=None, agree=True, skip_empty=False, counts=in_counts)


def barrier(group: Optional[Group] = None, async_op: bool = False,
            backend: Optional[str] = None) -> Optional[Work]:
    """Wait until every rank of the group reached this barrier."""
    g = _group(group, "barrier")
    if g.rank < 0:
        return None
    _runtime.engine.drain()  # like gloo's barrier: after all outstanding work
    return _submit("barrier", g, 0, _BARRIER_REF, backend, async_op, lambda b, h: b.barrier(h),
                   skip_empty=False)


_BARRIER_REF = torch.empty(0, dtype=torch.uint8)
#: Tag of monitored_barrier's messages.
MONITORED_BARRIER_TAG = 32001


def monitored_barrier(group: Optional[Group] = None, timeout: Union[None, timedelta, float] = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that names who is missing (torch's ``monitored_barrier``, with
    gloo's messages): group rank 0 waits up to ``timeout`` (default: the
    group's) for every other rank's message, then releases them; it raises
    naming the first rank that did not arrive (every such rank with
    ``wait_all_ranks``), and the others raise when rank 0 does not release them."""
    g = _group(group, "monitored_barrier")
    if g.rank < 0:
        return
    seconds = g.timeout if timeout is None else _seconds(timeout)
    start = time.monotonic()
    deadline = start + seconds
    engine = _runtime.engine
    token = torch.zeros(1, dtype=torch.uint8)
    if g.rank != 0:
        send(token, g.ranks[0], g, MONITORED_BARRIER_TAG)
        work = irecv(token, g.ranks[0], g, MONITORED_BARRIER_TAG)
        engine.wait(work, deadline)
        if work._error is not None:
            raise RuntimeError(f"Rank {g.rank} successfully reached monitoredBarrier, but received "
                               f"errors while waiting for send/recv from rank 0. Please check rank "
                               f"0 logs for faulty rank.")
        return
    works = [irecv(torch.zeros(1, dtype=torch.uint8), r, g, MONITORED_BARRIER_TAG)
             for r in g.ranks[1:]]
    failed = []
    for i, work in enumerate(works, 1):
        if not wait_all_ranks and time.monotonic() >= deadline:
            raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {seconds * 1e3:.0f} ms")
        engine.wait(work, deadline)
        if work._error is not None:
            failed.append(i)
            if not wait_all_ranks:
                break
    if failed:
        for work in works:  # withdraw the receives still outstanding
            engine.wait(work, time.monotonic())
        ranks = ", ".join(map(str, failed))
        raise RuntimeError(f"Rank{'s' if len(failed) > 1 else ''} {ranks} failed to pass "
                           f"monitoredBarrier in {seconds * 1e3:.0f} ms")
    for r in g.ranks[1:]:
        send(token, r, g, MONITORED_BARRIER_TAG)


# -- point to point -----------------------------------------------------------------------
def isend(tensor: torch.Tensor, dst: int, group: Optional[Group] = None, tag: int = 0,
          backend: Optional[str] = None) -> Optional[Work]:
    """Start sending ``tensor`` to global rank ``dst``."""
    return (_p2p_fast("isend", tensor, dst, group, tag, backend, True)
            or _p2p("isend", tensor, dst, group, tag, backend, True))


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[Group] = None,
          tag: int = 0, backend: Optional[str] = None) -> Optional[Work]:
    """Start receiving into ``tensor`` from global rank ``src`` (None: from any
    rank of the group; ``Work.source_rank()`` names it)."""
    return (_p2p_fast("irecv", tensor, src, group, tag, backend, True)
            or _p2p("irecv", tensor, src, group, tag, backend, True))


def send(tensor: torch.Tensor, dst: int, group: Optional[Group] = None, tag: int = 0,
         backend: Optional[str] = None) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until it is sent."""
    if not _p2p_fast("send", tensor, dst, group, tag, backend):
        _p2p("send", tensor, dst, group, tag, backend, False)


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[Group] = None,
         tag: int = 0, backend: Optional[str] = None) -> int:
    """Receive into ``tensor`` from global rank ``src`` (None: from any rank of
    the group); returns the sender's global rank (-1 on a non-member)."""
    if src is not None and _p2p_fast("recv", tensor, src, group, tag, backend):
        return src
    work = _p2p("recv", tensor, src, group, tag, backend, True)
    if work is None:
        return -1
    work.wait()
    return work.source_rank() if src is None else src


def _p2p_fast(op: str, tensor, peer, group, tag, backend, async_op: bool = False):
    """The fast path (see "fast paths") of send/recv (True once done) and
    isend/irecv (their Work); None when the call must take the general path."""
    rt = _runtime
    if (rt is None or rt.debug or rt.engine.lost or (rt.engine.outstanding and not async_op)
            or not (backend is None or type(backend) is str) or type(peer) is not int or type(tag) is not int):
        return None  # (_fast_group's checks inline: a blocking receive's reply runs them on a cold core)
    g = rt.world if group is None else group
    kind = _key(tensor) if type(g) is Group and g.owner is rt and g.rank >= 0 else None
    if kind is None:
        return None
    key = (op, kind, backend, peer, tag)
    name, start, gpeer = g.starters.get(key) or _remember(
        g, key, _p2p_fast_plan(rt, g, op, tensor, peer, tag, backend, async_op))
    if not async_op and rt.observer is None and not _torch_profiler._is_profiler_enabled:
        # _fast's unobserved blocking case, inline
        pending = start(tensor)
        if pending is not DONE:
            rt.engine.block(op, name, pending, g, *_p2p_touches(op, tensor))
        return True
    work = _fast(rt, g, op, name, start, (tensor,), kind[0], *_p2p_touches(op, tensor), (tensor,), async_op,
                 gpeer, skip_empty=False)
    return work if async_op else True


def _p2p_touches(op: str, tensor) -> tuple:
    """(reads, writes) of a send or receive."""
    return ((tensor,), ()) if op in _SENDS else ((), (tensor,))


def _p2p_fast_plan(rt: Runtime, g: Group, op: str, tensor: torch.Tensor, peer: int, tag: int,
                   backend: Optional[str], async_op: bool):
    gpeer = _p2p_peer(op, g, tensor, peer, tag)
    name = rt.selector.choose(op, tensor.nbytes, g.size, "cpu", tensor.dtype, None, backend)
    method = "send" if op in _SENDS else "recv"
    return name, _starter(rt, g, name, method, (tensor,), (gpeer, tag), async_op), gpeer


def _p2p(op: str, tensor, peer, group, tag, backend, async_op):
    start = _p2p_plan(op, tensor, peer, group, tag, backend)
    return None if start is None else start(async_op)


def _p2p_peer(op: str, g: Group, tensor, peer, tag) -> int:
    """Check one send/recv by a member of ``g``; the peer's group rank."""
    _check(op, tensor)
    what = "dst" if op in _SENDS else "src"
    if peer is None:
        if what == "dst":
            raise ValueError(f"{op}: dst is required")
        gpeer = ANY_SOURCE
    else:
        gpeer = _root(op, g, peer, what)
    if gpeer == g.rank:
        raise ValueError(f"{op}: {what}={peer} is this rank itself")
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= MAX_TAG:
        raise ValueError(f"{op}: tag must be an int from 0 to {MAX_TAG}, got {tag!r}")
    return gpeer


def _p2p_plan(op: str, tensor, peer, group, tag, backend, precheck: bool = False):
    """Validate one send/recv; return a function that starts it (None: not a member).
    ``precheck`` also asks the selector now, so a batch refuses before sending."""
    g = _group(group, op)
    if g.rank < 0:
        _check(op, tensor)
        return None
    gpeer = _p2p_peer(op, g, tensor, peer, tag)
    if precheck:
        _runtime.selector.choose(op, _nbytes(tensor), g.size, tensor.device.type, tensor.dtype,
                                 None, backend)
    sending = op in _SENDS
    reads, writes = ((tensor,), ()) if sending else ((), (tensor,))

    def start(async_op: bool):
        wait_for_conflicts(op, reads, writes)
        post: list = []
        t = _contiguous(tensor, not sending, post)
        begin = (lambda b, h: b.send(h, t, gpeer, tag)) if sending else \
            (lambda b, h: b.recv(h, t, gpeer, tag))
        return _submit(op, g, _nbytes(tensor), tensor, backend, async_op, begin, reads=reads,
                       writes=writes, post=post, result=[tensor], collective=False,
                       skip_empty=False, peer=gpeer)
    return start


def batch_isend_irecv(p2p_op_list: List[P2POp]) -> List[Work]:
    """Start every send/recv of the list; returns one work per op. Every item is
    validated before any is started."""
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
    plans = []
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"batch_isend_irecv: item {i} is {type(p).__name__}, expected P2POp")
        fn = getattr(p.op, "__name__", "")
        if fn not in ("isend", "irecv"):
            raise ValueError(f"batch_isend_irecv: item {i}: op must be mcrdl.isend or mcrdl.irecv")
        plans.append(_p2p_plan(fn, p.tensor, p.peer, p.group, p.tag, p.backend, precheck=True))
    return [start(True) for start in plans if start is not None]


# -- argument helpers -----------------------------------------------------------------------
def _check_list(op: str, lst, what: str, ref: torch.Tensor, size: int) -> None:
    if not isinstance(lst, (list, tuple)) or len(lst) != size:
        raise ValueError(f"{op}: {what} must be a list of {size} tensors (one per rank), "
                         f"got {type(lst).__name__ if not isinstance(lst, (list, tuple)) else len(lst)}")
    for i, t in enumerate(lst):
        _check(op, t, f"{what}[{i}]")
        _same_kind(op, ref, t, f"{what}[{i}]")
        if t.numel() != ref.numel():
            raise ValueError(f"{op}: {what}[{i}] has {t.numel()} elements, expected {ref.numel()}")


def _unpack(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> Callable[[], None]:
    def copy_out() -> None:
        offset = 0
        for t in outs:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view(t.shape))
            offset += n
    return copy_out


def _row(t: torch.Tensor) -> int:
    """Elements per dim-0 row."""
    n = 1
    for s in t.shape[1:]:
        n *= s
    return n


def _splits(op: str, what: str, t: torch.Tensor, splits, size: int) -> list[int]:
    """Rows per peer along dim 0 (even when ``splits`` is None or empty)."""
    rows = t.shape[0] if t.dim() else t.numel()
    if not splits:
        if rows % size:
            raise ValueError(f"{op}: {what} has {rows} rows, not divisible by the group size "
                             f"{size}; pass {what}_split_sizes")
        return [rows // size] * size
    if len(splits) != size or any(not isinstance(s, int) or s < 0 for s in splits):
        raise ValueError(f"{op}: {what}_split_sizes must be {size} non-negative ints, got {list(splits)}")
    if sum(splits) != rows:
        raise ValueError(f"{op}: {what}_split_sizes sum to {sum(splits)} but {what} has {rows} rows")
    return list(splits)
