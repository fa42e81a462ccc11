"""mcrdl as a ``torch.distributed`` backend, written in Python.

::

    import torch.distributed as dist
    import mcrdl.integrations.torch_backend as tb

    tb.register()                       # once per process; idempotent
    dist.init_process_group("mcrdl")    # under torchrun (env:// rendezvous), or
    tb.init_process_group()             # under `mcrdl run` / mpiexec (no MASTER_ADDR needed)

Afterwards ``torch.distributed`` collectives on the group, and
``DistributedDataParallel`` built on it, run through mcrdl: every call goes
through mcrdl's op path, so the selector (``backend=`` > static map >
tuning table > default) picks MPI, gloo or NCCL per op and message size, with
mcrdl's progress, ordering and deadline guarantees, and the comms logger
records them.

How it plugs in (tested with torch 2.13): :func:`register` calls
``torch.distributed.Backend.register_backend("mcrdl", creator,
extended_api=True, devices=["cpu", "cuda"])``. torch calls the creator with
the group's store, rank, size, timeout and global ranks; it starts mcrdl if
needed (identity from MPI, or from torch's own rendezvous store), checks that
torch and mcrdl agree on rank and size, and returns a
:class:`ProcessGroupMCRDL`, a Python subclass of
``torch.distributed.ProcessGroup``. Calls from Python
(``dist.all_reduce`` ...) reach its methods by attribute lookup; calls from
C++ (DDP's reducer, parameter broadcast and shape check) reach the methods
torch's ``PyProcessGroup`` trampoline forwards to Python (``allreduce``,
``broadcast``, ``allgather``, ...). Each method runs its op through mcrdl's
driver (:data:`mcrdl.api.run_op`, what the API's functions call, with the op's
:mod:`mcrdl.ops` description) and returns a :class:`MCRDLTorchWork` (a Python ``torch.distributed.Work``) whose
``wait()`` drives mcrdl's progress engine and whose ``get_future()`` is
completed by mcrdl's futures thread, as DDP requires. With mcrdl's compiled
helpers loaded, the common calls of the ops torch calls most (:data:`_COMPILED`)
and of ``MCRDLTorchWork.wait`` run in C (csrc/torch_method.cpp's ``TorchMethod``) and every
other call in these methods.

See docs/torch_backend.md for the supported ops and the limits.
"""
from __future__ import annotations

import functools
import threading
from datetime import timedelta
from typing import Callable, Optional, Sequence

import mcrdl_torch_plugin as plugin_module
import torch
import torch.distributed as dist

from .. import api, facts, ops
from .. import work as work_module
from ..runtime import Group
from ..types import ReduceOp, UnsupportedError

__all__ = ["BACKEND_NAME", "MCRDLTorchWork", "ProcessGroupMCRDL", "init_kwargs",
           "init_process_group", "is_registered", "register"]

#: The name torch knows the backend by (``init_process_group("mcrdl")``).
BACKEND_NAME = plugin_module.BACKEND_NAME
#: Device types declared to torch. A device no live mcrdl backend takes
#: (e.g. CUDA without NCCL) is refused per op by mcrdl's selector, naming op and device.
DEVICES = plugin_module.DEVICES

_register_lock = threading.Lock()

_REDUCE_OPS = {"SUM": ReduceOp.SUM, "AVG": ReduceOp.AVG, "PRODUCT": ReduceOp.PRODUCT,
               "MIN": ReduceOp.MIN, "MAX": ReduceOp.MAX}
#: int(torch's RedOpType) -> mcrdl ReduceOp: the same table keyed by the enum's
#: value (a pybind enum's ``name``, and even its ``==``, costs a microsecond per call).
_REDUCE_KINDS = {int(getattr(dist.ReduceOp.RedOpType, n)): op for n, op in _REDUCE_OPS.items()}
_TORCH_SUM = dist.ReduceOp.SUM  # (a torch ReduceOp compares with it cheaply)


class BackendError(RuntimeError):
    """The mcrdl torch backend cannot do what was asked (message names the op)."""


# -- registration ------------------------------------------------------------------------
def _plugin(name: str):
    plugins = getattr(dist.Backend, "_plugins", {})
    return plugins.get(name.upper())


def is_registered(name: str = BACKEND_NAME) -> bool:
    """True if ``name`` is registered with torch as mcrdl."""
    plugin = _plugin(name)
    return plugin is not None and getattr(plugin, "creator_fn", plugin) is plugin_module.create_backend


def register(name: str = BACKEND_NAME) -> str:
    """Register mcrdl with ``torch.distributed`` under ``name`` (idempotent);
    returns the name to pass to ``init_process_group``. An installed mcrdl is
    registered as "mcrdl" at ``import torch`` already (see
    :mod:`mcrdl_torch_plugin`); this is for other names, or when torch's
    autoloading is off."""
    if not dist.is_available():
        raise BackendError("torch.distributed is not available in this torch build")
    with _register_lock:
        if is_registered(name):
            return name
        if _plugin(name) is not None or name.lower() in ("gloo", "nccl", "mpi", "ucc", "xccl"):
            raise BackendError(f"a different torch.distributed backend is already registered as "
                               f"{name!r}; register mcrdl under another name")
        dist.Backend.register_backend(name, plugin_module.create_backend, extended_api=True,
                                      devices=list(DEVICES))
    return name


# -- starting mcrdl from torch's rendezvous --------------------------------------------------
def _create_backend(dist_opts, backend_options=None) -> "ProcessGroupMCRDL":
    """The creator torch calls (extended API) for every group using "mcrdl", on the
    group's members only. The default group starts mcrdl on torch's store, rank
    and size (whatever the ``init_method``; MPI joins when an MPI launcher
    started the job); a sub-group becomes an mcrdl group built by its members
    on the sub-group's store."""
    rank, size = int(dist_opts.group_rank), int(dist_opts.group_size)
    global_ranks = [int(r) for r in (dist_opts.global_ranks_in_group or [])]
    is_world = not global_ranks  # torch passes no ranks for the default group
    timeout = _wait_seconds(dist_opts.timeout)
    if not api.is_initialized():
        if not is_world:
            raise BackendError(
                f"mcrdl backend: the sub-group {global_ranks} cannot start mcrdl (starting it is "
                f"collective over all ranks, but torch calls the backend only on the group's "
                f"members): make \"mcrdl\" the default group's backend, or call "
                f"mcrdl.init_process_group() on every rank first")
        api.init_process_group(store=dist_opts.store, rank=rank, world_size=size,
                               **({"timeout": timeout} if timeout else {}))
        return ProcessGroupMCRDL(api.current_runtime().world, rank, size, owns_mcrdl=True)
    rt = api.current_runtime()
    if is_world:
        if (rank, size) != (rt.rank, rt.world_size):
            raise BackendError(
                f"torch.distributed says this process is rank {rank} of {size}, but mcrdl (already "
                f"initialised) says rank {rt.rank} of {rt.world_size}: torch's rank/world_size must "
                f"be mcrdl's (use mcrdl.integrations.torch_backend.init_process_group(), or "
                f"init_process_group('mcrdl', **init_kwargs()))")
        return ProcessGroupMCRDL(rt.world, rank, size)
    t_rank = _torch_global_rank()
    if t_rank is not None and t_rank != rt.rank:
        raise BackendError(f"torch.distributed's global rank {t_rank} differs from mcrdl's rank "
                           f"{rt.rank}: the torch default group and mcrdl must number ranks alike")
    if global_ranks[rank] != rt.rank or global_ranks[-1] >= rt.world_size:
        raise BackendError(f"mcrdl backend: group ranks {global_ranks} (this process at position "
                           f"{rank}) do not match mcrdl's world of {rt.world_size} (this process "
                           f"rank {rt.rank})")
    if global_ranks != sorted(set(global_ranks)):
        raise BackendError(f"mcrdl backend: group ranks {global_ranks} are not in ascending "
                           "order; mcrdl groups order their ranks ascending")
    group = rt.new_group(global_ranks, timeout, name=f"torch:{dist_opts.group_id}",
                         store=dist_opts.store)
    return ProcessGroupMCRDL(group, rank, size)


def _torch_global_rank() -> Optional[int]:
    try:
        return dist.get_rank() if dist.is_initialized() else None
    except Exception:  # noqa: BLE001 - the default group may be mid-construction
        return None


def init_kwargs(timeout=None) -> dict:
    """Keyword arguments for ``torch.distributed.init_process_group("mcrdl", **init_kwargs())``
    after mcrdl is initialised: mcrdl's rank and size, and a store under
    mcrdl's own (so no MASTER_ADDR/MASTER_PORT are needed). Collective on
    every rank when mcrdl has no store yet."""
    rt = api.current_runtime()
    store = rt.ensure_store()  # (made now if only MPI was started: collective)
    return {"store": dist.PrefixStore("torch/", store), "rank": rt.rank,
            "world_size": rt.world_size,
            "timeout": timeout if timeout is not None else timedelta(seconds=rt.timeout)}


def init_process_group(timeout=None, mcrdl_options: Optional[dict] = None, **torch_kwargs) -> None:
    """Register the backend, start mcrdl if needed (``mcrdl_options`` go to
    :func:`mcrdl.init_process_group`) and make the "mcrdl" group torch's
    default group. Works under `mcrdl run`/mpiexec, torchrun or a single process."""
    register()
    if not api.is_initialized():
        opts = dict(mcrdl_options or {})
        if timeout is not None:
            opts.setdefault("timeout", timeout)
        api.init_process_group(**opts)
    kwargs = init_kwargs(timeout)
    kwargs.update(torch_kwargs)
    dist.init_process_group(BACKEND_NAME, **kwargs)


# -- reduce ops, timeouts ----------------------------------------------------------------------
def _reduce_op(opts, what: str, dtype: torch.dtype) -> ReduceOp:
    """The mcrdl ReduceOp of torch's ``opts.reduceOp`` (SUM without ``opts``), or a clear refusal."""
    if opts is None:
        return ReduceOp.SUM
    op = opts.reduceOp
    if type(op) is dist.ReduceOp and op == _TORCH_SUM:  # most calls: one comparison, cheaper than below
        return ReduceOp.SUM
    return _other_reduce_op(op, what, dtype)


def _other_reduce_op(op, what: str, dtype: torch.dtype) -> ReduceOp:
    """:func:`_reduce_op` of any ``ReduceOp`` (or its RedOpType)."""
    kind = getattr(op, "op", op)  # ReduceOp -> RedOpType
    try:
        known = _REDUCE_KINDS.get(int(kind))
    except TypeError:
        known = None
    if known is not None:
        return known
    name = getattr(kind, "name", None) or str(kind).rsplit(".", 1)[-1]
    if name in _REDUCE_OPS:
        return _REDUCE_OPS[name]
    if dtype == torch.bool and name in ("BAND", "BOR"):
        return ReduceOp.MIN if name == "BAND" else ReduceOp.MAX  # logical and / or
    raise UnsupportedError(f"{what}: ReduceOp.{name} is not supported by the mcrdl torch backend "
                           f"(supported: SUM, AVG, PRODUCT, MIN, MAX; BAND/BOR on torch.bool)")


def _wait_seconds(timeout) -> Optional[float]:
    """torch passes timedelta(0) or a negative one for "no timeout given"."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
    return seconds if seconds > 0 else None


def _one(what: str, tensors: Sequence, kind: str = "tensor") -> object:
    if len(tensors) != 1:
        raise BackendError(f"{what}: the mcrdl torch backend takes exactly one {kind} per process "
                           f"(got {len(tensors)}); multi-device lists are not supported")
    return tensors[0]


def _sparse_all_reduce(t: torch.Tensor, g: Group) -> None:
    """Sum a sparse COO tensor over ``g`` in place: every rank's indices and
    values are all-gathered (padded to the largest count) and summed."""
    s = t.coalesce()
    idx, val = s.indices(), s.values()
    counts = torch.empty(g.size, dtype=torch.int64)
    api.all_gather_into_tensor(counts, torch.tensor([idx.shape[1]]), group=g)
    most = int(counts.max())
    pad = most - idx.shape[1]
    idx = torch.nn.functional.pad(idx, (0, pad))
    val = torch.cat([val, val.new_zeros((pad, *val.shape[1:]))])
    all_idx = idx.new_empty((g.size * idx.shape[0], most))
    all_val = val.new_empty((g.size * most, *val.shape[1:]))
    api.all_gather_into_tensor(all_idx, idx.contiguous(), group=g)
    api.all_gather_into_tensor(all_val, val.contiguous(), group=g)
    all_idx = all_idx.view(g.size, idx.shape[0], most)
    all_val = all_val.view(g.size, most, *val.shape[1:])
    keep = [slice(0, int(c)) for c in counts]
    total = torch.sparse_coo_tensor(torch.cat([all_idx[r][:, k] for r, k in enumerate(keep)], 1),
                                    torch.cat([all_val[r][k] for r, k in enumerate(keep)]), t.shape)
    t.copy_(total.coalesce())


# -- Work --------------------------------------------------------------------------------------
class MCRDLTorchWork(dist.Work):
    """A ``torch.distributed.Work`` over an mcrdl :class:`~mcrdl.Work` (or over
    an op that already completed). ``wait()`` drives mcrdl's progress on the
    calling thread; ``get_future()`` is completed by mcrdl's futures thread."""

    __slots__ = ("_work", "_result", "_op", "__dict__")  # (the three every Work sets need no dict)
    _future: Optional[torch.futures.Future] = None  # made by get_future()

    def __init__(self, work, result, op: str):  # (csrc/torch_method.cpp's TorchMethod makes one alike, without this frame)
        dist.Work.__init__(self)
        self._work = work  # mcrdl Work, or None when the op already completed
        self._result = result
        self._op = op

    def __repr__(self) -> str:
        return f"<MCRDLTorchWork {self._op}: {self._work!r}>"

    def wait(self, timeout=None) -> bool:
        if self._work is not None:
            self._work.wait(None if timeout is None else _wait_seconds(timeout))
        return True

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def is_success(self) -> bool:
        return self._work is None or self._work.is_success()

    def exception(self):
        return None if self._work is None else self._work.exception()

    def result(self):
        return self._result

    def _source_rank(self) -> int:
        """The sender's group rank, as torch's recv(src=None) reads it."""
        return self._work.group.group_rank(self._work.source_rank())

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            if self._work is None:
                fut = torch.futures.Future()
                fut.set_result(self._result)
            else:
                result = self._result
                fut = self._work.get_future().then(lambda f: (f.wait(), result)[1])
            self._future = fut
        return self._future


# -- the process group -------------------------------------------------------------------------
class ProcessGroupMCRDL(dist.ProcessGroup):
    """A torch ``ProcessGroup`` whose ops run through mcrdl (see the module doc).

    ``rank``/``size`` are torch's group rank and size; roots and peers torch
    passes (group ranks) are mapped to mcrdl's global ranks."""

    # (csrc/torch_method.cpp's TorchMethod reads _g and _coalescing at their slots' offsets; torch may set others)
    __slots__ = ("_g", "_owns_mcrdl", "_coalescing", "_group_name", "_group_desc", "__dict__")

    def __init__(self, group: Group, rank: int, size: int, owns_mcrdl: bool = False):
        super().__init__(rank, size)
        if group.size != size or group.rank != rank:
            raise BackendError(f"mcrdl group {group!r} (rank {group.rank} of {group.size}) does "
                               f"not match torch's group rank {rank} of {size}")
        self._g = group
        self._owns_mcrdl = owns_mcrdl  # torch's default group started mcrdl: it ends it too
        self._coalescing: Optional[list] = None  # works started inside _start/_end_coalescing
        self._group_name = ""
        self._group_desc = ""
        _compile_methods()

    # -- identity -------------------------------------------------------------------------
    # torch keeps a group's name in its C++ backends; a Python group has none,
    # so it keeps them itself (functional collectives look groups up by name).
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._group_name = name

    def getGroupName(self) -> str:
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:
        self._group_desc = desc

    def getGroupDesc(self) -> str:
        return self._group_desc

    def shutdown(self) -> None:
        """torch's ``destroy_process_group``: a sub-group releases its mcrdl group; the
        default group ends mcrdl if it started it (a later init starts afresh, with
        the new store and timeout), else leaves the user's mcrdl running."""
        if self._owns_mcrdl:
            if api.is_initialized() and api.current_runtime() is self._g.owner:
                api.destroy_process_group()
        elif self._g is not self._g.owner.world:
            self._g.owner.destroy_group(self._g)

    @property
    def mcrdl_group(self) -> Group:
        """The mcrdl group the ops run on (use it with the mcrdl API directly)."""
        return self._g

    def __repr__(self) -> str:
        return f"<ProcessGroupMCRDL rank {self._g.rank} of {self._g.size} over {self._g!r}>"

    # -- helpers --------------------------------------------------------------------------
    def _global(self, group_rank: int, what: str) -> int:
        if not 0 <= group_rank < self._g.size:
            raise ValueError(f"{what} {group_rank} is outside the group of size {self._g.size}")
        return self._g.ranks[group_rank]

    def _sync(self, opts) -> bool:
        """Run the mcrdl op blocking (its fastest path) when torch will wait at once."""
        return (self._coalescing is None and opts is not None
                and getattr(opts, "asyncOp", True) is False)

    def _start(self, name: str, opts, op: ops.Op, tensors: tuple, fixed: tuple, result,
               splits=None) -> Optional[MCRDLTorchWork]:
        """Run ``op`` on the group through mcrdl's driver, as the API's functions do
        (without their layer). A blocking op returns no Work: torch's API waits
        only on a Work it gets ("the backend has sync'ed")."""
        blocking = opts is not None and getattr(opts, "asyncOp", True) is False and self._coalescing is None
        work = api.run_op(api.current_runtime(), op, self._g, not blocking, None, tensors, fixed, splits)
        if blocking:
            return None
        if self._coalescing is not None and work is not None:
            self._coalescing.append(work)
        return MCRDLTorchWork(work, result, name)

    def _run(self, name: str, opts, start: Callable[[bool], object], result) -> Optional[MCRDLTorchWork]:
        """As :meth:`_start`, for an op the API adapts: ``start(async_op)`` issues it."""
        if self._sync(opts):
            start(False)
            return None
        work = start(True)
        if self._coalescing is not None and work is not None:
            self._coalescing.append(work)
        return MCRDLTorchWork(work, result, name)

    def _run_many(self, op: str, opts, starts: Sequence[Callable[[], object]],
                  result) -> Optional[MCRDLTorchWork]:
        """Several async mcrdl ops behind one Work (none when blocking, as ``_run``)."""
        works = [s() for s in starts]
        if self._coalescing is not None:
            self._coalescing.extend(w for w in works if w is not None)
        sync = self._sync(opts)
        work = api.combine(op, works, result=(), async_op=not sync, group=self._g)
        return None if sync else MCRDLTorchWork(work, result, op)

    # -- collectives ------------------------------------------------------------------------
    def allreduce(self, tensors, opts=None):
        op = "allreduce"
        t = _one(op, tensors)
        rop = _reduce_op(opts, op, t.dtype)
        if t.layout == torch.sparse_coo:
            if rop is not ReduceOp.SUM:
                raise UnsupportedError(f"{op}: sparse tensors reduce with SUM only (as gloo), not {rop.name}")
            _sparse_all_reduce(t, self._g)
            return MCRDLTorchWork(None, [t], op)
        return self._start(op, opts, ops.ALL_REDUCE, (t,), (rop,), [t])

    def allreduce_coalesced(self, tensors, opts=None):
        op = "allreduce_coalesced"
        if not tensors:
            return MCRDLTorchWork(None, [], op)
        rop = _reduce_op(opts, op, tensors[0].dtype)
        g = self._g
        return self._run_many(op, opts, [
            (lambda t=t: api.all_reduce(t, rop, group=g, async_op=True)) for t in tensors],
            list(tensors))

    def broadcast(self, tensors, opts=None):
        op = "broadcast"
        t = _one(op, tensors)
        if opts is not None and getattr(opts, "rootTensor", 0) != 0:
            raise BackendError(f"{op}: rootTensor {opts.rootTensor} is not supported (one tensor per process)")
        src = self._global(opts.rootRank if opts is not None else 0, "broadcast root")
        return self._start(op, opts, ops.BROADCAST, (t,), (src,), [t])

    def reduce(self, tensors, opts=None):
        op = "reduce"
        t = _one(op, tensors)
        if opts is not None and getattr(opts, "rootTensor", 0) != 0:
            raise BackendError(f"{op}: rootTensor {opts.rootTensor} is not supported (one tensor per process)")
        rop = _reduce_op(opts, op, t.dtype)
        dst = self._global(opts.rootRank if opts is not None else 0, "reduce root")
        return self._start(op, opts, ops.REDUCE, (t,), (dst, rop), [t])

    def allgather(self, output_tensors, input_tensors, opts=None):
        op = "allgather"
        out = _one(op, output_tensors, "output list")
        inp = _one(op, input_tensors)
        return self._start(op, opts, ops.ALL_GATHER, (list(out), inp), (), output_tensors)

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """``output_lists[r][i]``: rank r's ``input_list[i]`` (torch's layout)."""
        op = "allgather_coalesced"
        g = self._g
        if len(output_lists) != g.size or any(len(o) != len(input_list) for o in output_lists):
            raise ValueError(f"{op}: output lists must be {g.size} (one per rank) of "
                             f"{len(input_list)} tensors (one per input), got "
                             f"{[len(o) for o in output_lists]}")
        return self._run_many(op, opts, [
            (lambda i=i: api.all_gather([o[i] for o in output_lists], input_list[i], group=g,
                                        async_op=True))
            for i in range(len(input_list))], output_lists)

    def all_gather_single(self, output, input, opts=None):
        return self._start("all_gather_single", opts, ops.ALL_GATHER_INTO_TENSOR, (output, input), (),
                           [output])

    _allgather_base = all_gather_single  # torch < 2.11 name

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        op = "all_gather_single_coalesced"
        if len(outputs) != len(inputs):
            raise ValueError(f"{op}: {len(outputs)} outputs for {len(inputs)} inputs")
        g = self._g
        return self._run_many(op, opts, [
            (lambda o=o, i=i: api.all_gather_into_tensor(o, i, group=g, async_op=True))
            for o, i in zip(outputs, inputs)], list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # older name

    def reduce_scatter(self, output_tensors, input_lists, opts=None):
        op = "reduce_scatter"
        out = _one(op, output_tensors)
        inp = _one(op, input_lists, "input list")
        rop = _reduce_op(opts, op, out.dtype)
        return self._start(op, opts, ops.REDUCE_SCATTER, (out, list(inp)), (rop,), [out])

    def reduce_scatter_single(self, output, input, opts=None):
        op = "reduce_scatter_single"
        rop = _reduce_op(opts, op, output.dtype)
        return self._start(op, opts, ops.REDUCE_SCATTER_TENSOR, (output, input), (rop,), [output])

    _reduce_scatter_base = reduce_scatter_single  # torch < 2.11 name

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = "reduce_scatter_single_coalesced"
        if len(outputs) != len(inputs):
            raise ValueError(f"{op}: {len(outputs)} outputs for {len(inputs)} inputs")
        if not outputs:
            return MCRDLTorchWork(None, [], op)
        rop = _reduce_op(opts, op, outputs[0].dtype)
        g = self._g
        return self._run_many(op, opts, [
            (lambda o=o, i=i: api.reduce_scatter_tensor(o, i, rop, group=g, async_op=True))
            for o, i in zip(outputs, inputs)], list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # older name

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        splits = None if not output_split_sizes and not input_split_sizes else (
            [int(s) for s in output_split_sizes] or None, [int(s) for s in input_split_sizes] or None)
        return self._start("all_to_all_single", opts, ops.ALL_TO_ALL_SINGLE, (output, input), (), [output],
                           splits)

    alltoall_base = all_to_all_single  # torch < 2.11 name

    def alltoall(self, output_tensors, input_tensors, opts=None):
        g = self._g
        return self._run("alltoall", opts, lambda a: api.all_to_all(
            list(output_tensors), list(input_tensors), group=g, async_op=a), list(output_tensors))

    def gather(self, output_tensors, input_tensors, opts=None):
        op = "gather"
        inp = _one(op, input_tensors)
        dst = self._global(opts.rootRank if opts is not None else 0, "gather root")
        if self._g.rank == self._g.group_rank(dst):
            gather_list = list(_one(op, output_tensors, "output list"))
        else:
            if output_tensors and any(len(o) for o in output_tensors):
                raise ValueError(f"{op}: output tensors given on non-root rank {self._g.rank}")
            gather_list = None
        return self._start(op, opts, ops.GATHER, (gather_list, inp), (dst,), output_tensors)

    def scatter(self, output_tensors, input_tensors, opts=None):
        op = "scatter"
        out = _one(op, output_tensors)
        src = self._global(opts.rootRank if opts is not None else 0, "scatter root")
        if self._g.rank == self._g.group_rank(src):
            scatter_list = list(_one(op, input_tensors, "input list"))
        else:
            if input_tensors and any(len(i) for i in input_tensors):
                raise ValueError(f"{op}: input tensors given on non-root rank {self._g.rank}")
            scatter_list = None
        return self._start(op, opts, ops.SCATTER, (out, scatter_list), (src,), [out])

    def barrier(self, opts=None):
        g = self._g
        return self._run("barrier", opts, lambda a: api.barrier(group=g, async_op=a), [])

    # -- point to point ---------------------------------------------------------------------
    def _p2p(self, name: str, op: ops.Op, t: torch.Tensor, peer: Optional[int], tag) -> MCRDLTorchWork:
        """torch's send and recv are always async: mcrdl's isend/irecv through the driver."""
        work = api.run_op(api.current_runtime(), op, self._g, True, None, (t,), (peer, int(tag)))
        if self._coalescing is not None:
            self._coalescing.append(work)
        return MCRDLTorchWork(work, [t], name)

    def send(self, tensors, dstRank, tag=0):
        return self._p2p("send", ops.ISEND, _one("send", tensors), self._global(int(dstRank), "send dst"), tag)

    def recv(self, tensors, srcRank, tag=0):
        return self._p2p("recv", ops.IRECV, _one("recv", tensors), self._global(int(srcRank), "recv src"), tag)

    def recv_anysource(self, tensors, tag=0):
        return self._p2p("recvAnySource", ops.IRECV, _one("recv", tensors), None, tag)

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        api.monitored_barrier(self._g, timeout, wait_all_ranks=bool(wait_all_ranks))

    # -- old-style coalescing (torch's _coalescing_manager with a device) ----------------------
    def _start_coalescing(self, device=None) -> None:
        if self._coalescing is not None:
            raise BackendError("coalescing: already inside a coalescing block on this group")
        self._coalescing = []

    def _end_coalescing(self, device=None):
        works, self._coalescing = self._coalescing or [], None
        return MCRDLTorchWork(api.combine("coalesced", works, async_op=True, group=self._g), [],
                              "coalesced")

    start_coalescing = _start_coalescing
    end_coalescing = _end_coalescing


def _run_outside_dynamo(*classes) -> None:
    """torch calls these classes' methods from eager code while dynamo's frame
    hook is live (a graph break at ``dist.broadcast`` in a compiled function,
    DDP's own forward under ``torch.compile(DDP(model))``); dynamo would then
    trace them and fail on the opaque ProcessGroup. Marked, they and every
    frame they call run as plain Python, at no cost per call (the mark torch's
    own ``skip_code`` sets, recursive); a torch without it gets
    ``torch.compiler.disable`` (a wrapper on every call). The mark comes from
    torch's C module, as ``torch._dynamo.types`` takes it: importing dynamo
    itself would cost every rank about a second at start."""
    try:
        from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy
        skip = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)
    except ImportError:
        set_code_exec_strategy = skip = None
    for cls in classes:
        for name, fn in list(vars(cls).items()):
            if name.startswith("__") or not callable(fn) or not hasattr(fn, "__code__"):
                continue
            if skip is not None:
                set_code_exec_strategy(fn.__code__, skip)
            else:
                setattr(cls, name, torch.compiler.disable(fn))


_run_outside_dynamo(ProcessGroupMCRDL, MCRDLTorchWork)

#: The methods csrc/torch_method.cpp's TorchMethod serves, by name, and their ops (and
#: MCRDLTorchWork.wait): the compiled module's TORCH_METHODS, checked when they are put in place.
_COMPILED = (("allreduce", ops.ALL_REDUCE), ("broadcast", ops.BROADCAST),
             ("all_gather_single", ops.ALL_GATHER_INTO_TENSOR),
             ("reduce_scatter_single", ops.REDUCE_SCATTER_TENSOR), ("all_to_all_single", ops.ALL_TO_ALL_SINGLE),
             ("send", ops.ISEND), ("recv", ops.IRECV))


@functools.cache  # once per process, after mcrdl's init has set the compiled driver up
def _compile_methods() -> bool:
    """Serve the common calls of :data:`_COMPILED`'s methods from csrc/torch_method.cpp
    (``TorchMethod``: torch's options read in C++, the driver called without a
    Python frame); every other call still runs the Python method, which the
    compiled one falls back to. False without the compiled facts."""
    native = facts.load()
    if native is facts:
        return False
    methods = [(ProcessGroupMCRDL, method, op, vars(api)) for method, op in _COMPILED]
    methods.append((MCRDLTorchWork, "wait", None, vars(work_module)))  # (reads its wait policy)
    if sorted(m for _, m, _, _ in methods) != sorted(native.TORCH_METHODS):
        raise RuntimeError(f"the compiled TorchMethod serves {sorted(native.TORCH_METHODS)}, torch_backend.py "
                           f"asks for {sorted(m for _, m, _, _ in methods)}: rebuild or edit both")
    for cls, method, op, module_globals in methods:
        python = vars(cls)[method]
        compiled = native.TorchMethod(op, method, python, module_globals, MCRDLTorchWork, dist.Work.__init__,
                                      _REDUCE_KINDS, ProcessGroupMCRDL)
        facts.provided(f"{cls.__name__}.{method}", "TorchMethod (csrc/torch_method.cpp)")
        for name, value in list(vars(cls).items()):
            if value is python:  # its older names too (_allgather_base ...)
                setattr(cls, name, compiled)
    return True
