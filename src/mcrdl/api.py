"""The user-facing API, shaped like ``torch.distributed``: the job's lifecycle,
groups, and one thin function per operation. Each operation is described once
in :mod:`mcrdl.ops`, whose driver validates it on the calling rank, asks the
selector for a backend, orders it after conflicting outstanding work, and
starts it. ``backend=`` forces a backend.
"""
from __future__ import annotations

import atexit
import hashlib
import json
import sys
import time
from datetime import timedelta
from typing import Callable, Iterable, List, Mapping, Optional, Sequence, Union

import torch

from . import ops
from .backends import REGISTRY
from .ops import DTYPES, MAX_TAG  # noqa: F401  (public: the dtypes the API accepts, the largest tag)
from .runtime import Group, Runtime
from .tuning import TuningTable
from .types import P2POp, ReduceOp
from .work import DEFAULT_TIMEOUT, Work, _seconds

_runtime: Optional[Runtime] = None
#: The driver every op call goes through, ``run_op(runtime, op, group, async_op, backend,
#: tensors, fixed=(), splits=None)`` with an :mod:`mcrdl.ops` description: csrc/driver.cpp's
#: compiled ``drive`` once init has loaded it, else :func:`mcrdl.ops.general`. Internal
#: surface: the torch backend calls it without the layer of this module's functions.
run_op = ops.general


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
    global _runtime, run_op
    if _runtime is not None:
        raise RuntimeError("mcrdl is already initialized; call destroy_process_group() first")
    run_op = ops.driver()
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
    return ops.group_of(_runtime, group, op)


def wait_for_conflicts(op: str, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    """Program order (hazard 3): wait for outstanding work that writes what
    ``op`` reads, or touches what it writes. For features that read or write
    tensors locally (packing, compressing)."""
    ops.wait_for_conflicts(current_runtime(), op, reads, writes)


def combine(op: str, works: Sequence[Optional[Work]], post: Sequence[Callable[[], None]] = (),
            result: Sequence[torch.Tensor] = (), async_op: bool = True,
            group: Optional[Group] = None, reads: Sequence[torch.Tensor] = (),
            writes: Sequence[torch.Tensor] = ()) -> Optional[Work]:
    """One Work for several async works (features built on the API, e.g.
    fusion): it completes when all have, then runs ``post`` (e.g. unpacking).
    ``reads``/``writes``: the tensors ``post`` touches, so later ops order
    after it. With ``async_op=False`` waits and returns None."""
    return ops.combine(current_runtime(), op, _group(group, op), works, post, result, async_op, reads, writes)


def available_backends() -> dict[str, str]:
    """Every registered backend: ``"live"`` or the reason it is not."""
    rt = current_runtime()
    return {name: ("live" if name in rt.backends else rt.unavailable.get(name, "not requested"))
            for name in REGISTRY}


def live_backends(device: str = "cpu", ops: Optional[Iterable[str]] = None) -> list[str]:
    """The live backends that take tensors on ``device`` (``"cpu"``, ``"cuda"``);
    with ``ops`` (backend op names, :data:`mcrdl.backends.OPS`), only those that have every one."""
    need = frozenset(ops or ())
    return [name for name, b in current_runtime().backends.items() if device in b.devices and need <= b.ops]


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
            backend: Optional[str] = None, group_size: Optional[int] = None, device: str = "cpu",
            async_op: bool = False) -> str:
    """Which backend would run ``op`` for this tensor (or message size in bytes), and why.

    For tensors the size is the op's lookup size (see docs/tuning-table.md) and
    the device theirs; for a size, ``device`` is the tensors' device type.
    ``group_size`` asks about a group size other than ``group``'s; ``async_op``
    about an async call (a library may decline those: ``Backend.async_calls``)."""
    from .tuning import DEVICES, OP_CLASS

    if op not in OP_CLASS:
        raise ValueError(f"unknown op {op!r} (expected one of {', '.join(OP_CLASS)})")
    rt, g = current_runtime(), _group(group)
    if isinstance(tensor_or_nbytes, torch.Tensor):
        t = tensor_or_nbytes
        nbytes = t.nbytes * (g.size if OP_CLASS[op] in ("all_gather", "gather", "scatter") else 1)
        # (all_gather/gather/scatter tensors are the per-rank part)
        device, dtype = t.device.type, t.dtype
    else:
        if device not in DEVICES:
            raise ValueError(f"explain: unknown device type {device!r} (expected one of {', '.join(DEVICES)})")
        nbytes, dtype = int(tensor_or_nbytes), torch.float32
    size = group_size or g.size
    declined = (g.declined_async if async_op and backend is None else g.declined) if group_size in (None, g.size) \
        else ()
    name, why = rt.selector.explain(op, nbytes, size, device, dtype, explicit=backend, declined=declined)
    tuner = rt.autotune
    if tuner is not None and tuner.explores(op, backend) and group_size in (None, g.size):
        learned = tuner.describe(g, op, nbytes, device)
        won = tuner.frozen(g, op, nbytes, device, name, ignore_trial=True)
        if won is not None and rt.selector.why_not(won, op, device, dtype, declined=declined) is None:
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


# -- collectives: each one description (mcrdl.ops) and the one driver --------------------------
def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group: Optional[Group] = None,
               async_op: bool = False, backend: Optional[str] = None) -> Optional[Work]:
    """Reduce ``tensor`` across the group, in place on every rank."""
    return run_op(_runtime, ops.ALL_REDUCE, group, async_op, backend, (tensor,), (op,))


def broadcast(tensor: torch.Tensor, src: int, group: Optional[Group] = None,
              async_op: bool = False, backend: Optional[str] = None) -> Optional[Work]:
    """Copy ``tensor`` from global rank ``src`` to every rank of the group."""
    return run_op(_runtime, ops.BROADCAST, group, async_op, backend, (tensor,), (src,))


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group: Optional[Group] = None,
           async_op: bool = False, backend: Optional[str] = None) -> Optional[Work]:
    """Reduce ``tensor`` onto global rank ``dst`` (other ranks' tensors are scratch)."""
    return run_op(_runtime, ops.REDUCE, group, async_op, backend, (tensor,), (dst, op))


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Optional[Group] = None, async_op: bool = False,
                           backend: Optional[str] = None) -> Optional[Work]:
    """Concatenate every rank's ``input_tensor`` into ``output_tensor`` (dim 0)."""
    return run_op(_runtime, ops.ALL_GATHER_INTO_TENSOR, group, async_op, backend, (output_tensor, input_tensor))


def all_gather(tensor_list: List[torch.Tensor], tensor: torch.Tensor, group: Optional[Group] = None,
               async_op: bool = False, backend: Optional[str] = None) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``tensor_list[rank]``."""
    return run_op(_runtime, ops.ALL_GATHER, group, async_op, backend, (tensor_list, tensor))


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op=ReduceOp.SUM,
                          group: Optional[Group] = None, async_op: bool = False,
                          backend: Optional[str] = None) -> Optional[Work]:
    """Reduce ``input`` across ranks and leave block ``rank`` of it in ``output``."""
    return run_op(_runtime, ops.REDUCE_SCATTER_TENSOR, group, async_op, backend, (output, input), (op,))


#: torch 2.13's names for the same two calls (it deprecates the ones above).
all_gather_single = all_gather_into_tensor
reduce_scatter_single = reduce_scatter_tensor


def reduce_scatter(output: torch.Tensor, input_list: List[torch.Tensor], op=ReduceOp.SUM,
                   group: Optional[Group] = None, async_op: bool = False,
                   backend: Optional[str] = None) -> Optional[Work]:
    """Reduce ``input_list[i]`` across ranks into ``output`` on group rank ``i``."""
    return run_op(_runtime, ops.REDUCE_SCATTER, group, async_op, backend, (output, input_list), (op,))


def gather(tensor: torch.Tensor, gather_list: Optional[List[torch.Tensor]] = None, dst: int = 0,
           group: Optional[Group] = None, async_op: bool = False,
           backend: Optional[str] = None) -> Optional[Work]:
    """Gather every rank's ``tensor`` into ``gather_list`` on global rank ``dst``."""
    return run_op(_runtime, ops.GATHER, group, async_op, backend, (gather_list, tensor), (dst,))


def scatter(tensor: torch.Tensor, scatter_list: Optional[List[torch.Tensor]] = None, src: int = 0,
            group: Optional[Group] = None, async_op: bool = False,
            backend: Optional[str] = None) -> Optional[Work]:
    """Scatter ``scatter_list[i]`` from global rank ``src`` to group rank ``i``'s ``tensor``."""
    return run_op(_runtime, ops.SCATTER, group, async_op, backend, (tensor, scatter_list), (src,))


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: Optional[List[int]] = None,
                      input_split_sizes: Optional[List[int]] = None, group: Optional[Group] = None,
                      async_op: bool = False, backend: Optional[str] = None) -> Optional[Work]:
    """Split ``input`` along dim 0, send block ``i`` to group rank ``i``, and
    concatenate what arrives into ``output`` (uneven with split sizes; ranks
    agree on passing them or not, as with torch's MPI backend: without, MPI
    runs the faster Alltoall)."""
    splits = None if not output_split_sizes and not input_split_sizes else (output_split_sizes, input_split_sizes)
    return run_op(_runtime, ops.ALL_TO_ALL_SINGLE, group, async_op, backend, (output, input), (), splits)


def all_to_all(output_tensor_list: List[torch.Tensor], input_tensor_list: List[torch.Tensor],
               group: Optional[Group] = None, async_op: bool = False,
               backend: Optional[str] = None) -> Optional[Work]:
    """Send ``input_tensor_list[i]`` to group rank ``i``; receive into ``output_tensor_list``."""
    op = "all_to_all"
    rt, g = _runtime, _group(group, op)
    for what, lst in (("input_tensor_list", input_tensor_list), ("output_tensor_list", output_tensor_list)):
        if not isinstance(lst, (list, tuple)) or len(lst) != g.size:
            raise ValueError(f"{op}: {what} must be a list of {g.size} tensors")
        for i, t in enumerate(lst):
            ops.check(op, t, f"{what}[{i}]")
            ops.same_kind(op, input_tensor_list[0], t, f"{what}[{i}]")
    if g.rank < 0:
        return None
    ref = input_tensor_list[0]
    ops.wait_for_conflicts(rt, op, tuple(input_tensor_list), tuple(output_tensor_list))
    flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
    flat_out = ref.new_empty(sum(t.numel() for t in output_tensor_list))
    in_counts = [t.numel() for t in input_tensor_list]
    out_counts = [t.numel() for t in output_tensor_list]
    return ops.submit(rt, op, g, flat_in.nbytes, ref, backend, async_op,
                      lambda b, h: b.all_to_all_single(h, flat_out, flat_in, out_counts, in_counts),
                      reads=tuple(input_tensor_list), writes=tuple(output_tensor_list),
                      post=[ops._unpack(flat_out, output_tensor_list)], result=list(output_tensor_list),
                      agree=True, skip_empty=False, counts=in_counts)


def barrier(group: Optional[Group] = None, async_op: bool = False,
            backend: Optional[str] = None) -> Optional[Work]:
    """Wait until every rank of the group reached this barrier."""
    g = _group(group, "barrier")
    if g.rank < 0:
        return None
    _runtime.engine.drain()  # like gloo's barrier: after all outstanding work
    return ops.submit(_runtime, "barrier", g, 0, _BARRIER_REF, backend, async_op, lambda b, h: b.barrier(h),
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
    return run_op(_runtime, ops.ISEND, group, True, backend, (tensor,), (dst, tag))


def irecv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[Group] = None,
          tag: int = 0, backend: Optional[str] = None) -> Optional[Work]:
    """Start receiving into ``tensor`` from global rank ``src`` (None: from any
    rank of the group; ``Work.source_rank()`` names it)."""
    return run_op(_runtime, ops.IRECV, group, True, backend, (tensor,), (src, tag))


def send(tensor: torch.Tensor, dst: int, group: Optional[Group] = None, tag: int = 0,
         backend: Optional[str] = None) -> None:
    """Send ``tensor`` to global rank ``dst`` and wait until it is sent."""
    run_op(_runtime, ops.SEND, group, False, backend, (tensor,), (dst, tag))


def recv(tensor: torch.Tensor, src: Optional[int] = None, group: Optional[Group] = None,
         tag: int = 0, backend: Optional[str] = None) -> int:
    """Receive into ``tensor`` from global rank ``src`` (None: from any rank of
    the group); returns the sender's global rank (-1 on a non-member)."""
    if src is not None:
        run_op(_runtime, ops.RECV, group, False, backend, (tensor,), (src, tag))
        return src if group is None or group.rank >= 0 else -1
    work = run_op(_runtime, ops.IRECV, group, True, backend, (tensor,), (src, tag))
    if work is None:
        return -1
    work.wait()
    return work.source_rank()


def batch_isend_irecv(p2p_op_list: List[P2POp]) -> List[Work]:
    """Start every send/recv of the list; returns one work per op. Every item is
    validated before any is started."""
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("batch_isend_irecv: p2p_op_list must be a non-empty list of P2POp")
    starts = []
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"batch_isend_irecv: item {i} is {type(p).__name__}, expected P2POp")
        fn = getattr(p.op, "__name__", "")
        if fn not in ("isend", "irecv"):
            raise ValueError(f"batch_isend_irecv: item {i}: op must be mcrdl.isend or mcrdl.irecv")
        starts.append(ops.general(_runtime, ops.ISEND if fn == "isend" else ops.IRECV, p.group, True, p.backend,
                                  (p.tensor,), (p.peer, p.tag), prepare=True))
    return [start(True) for start in starts if start is not None]
