"""The small interface every backend implements.

The API layer hands a backend only what it can run: contiguous tensors on a
device the backend supports, reductions other than AVG, no bool reductions,
and flat buffers for the gather/scatter/all-to-all families (list variants are
packed by the API). Each method starts the operation and returns a
:class:`~mcrdl.work.Pending`; it never blocks.

Group ranks (``root``, ``peer``) are ranks *within* the group.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from ..types import ReduceOp
from ..work import Pending

#: ``peer`` of a receive from any source.
ANY_SOURCE = -1

#: Operations the runtime routes to backends (list variants map onto these).
OPS = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "reduce_scatter_tensor",
       "gather", "scatter", "all_to_all_single", "barrier", "send", "recv")


class BackendUnavailable(Exception):
    """Raised by a backend's constructor or :meth:`Backend.join` when what it
    learned (the same on every rank) rules it out in this job: it is then not
    live, with this message as the reason."""


class Context:
    """What a backend may use while starting: identity, launcher handles,
    timeout, and whether ranks share a GPU."""

    def __init__(self, rank: int, world_size: int, timeout: float, mpi_comm: Any = None,
                 store: Any = None, shared_gpu: bool = False, mpi_missing: Optional[str] = None,
                 local_size: int = 1):
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.mpi_comm = mpi_comm
        self.store = store
        #: two of this host's ranks use the same GPU (known where MPI launched the job)
        self.shared_gpu = shared_gpu
        #: why no MPI communicator could be had (None: an MPI launcher's, or MPI not asked for)
        self.mpi_missing = mpi_missing
        #: ranks of this job on this host
        self.local_size = local_size
        self._shared = 0

    def share(self, value: Any) -> list:
        """Every rank's ``value`` (picklable), in rank order: over MPI when it is
        live, else through the store. Collective: every rank's backends call it
        in the same order while they start."""
        if self.mpi_comm is not None:
            return self.mpi_comm.allgather(value)
        if self.store is None:
            raise RuntimeError("no MPI communicator and no store to exchange start-up data over")
        import pickle
        from datetime import timedelta

        self._shared += 1
        key = f"backends/share/{self._shared}/"
        self.store.set(key + str(self.rank), pickle.dumps(value))
        keys = [key + str(r) for r in range(self.world_size)]
        self.store.wait(keys, timedelta(seconds=self.timeout))
        return [pickle.loads(self.store.get(k)) for k in keys]


class Backend:
    """Base class: subclasses set ``name``/``devices`` and implement the ops."""

    name: str = ""
    #: Device types this backend accepts (``"cpu"``, ``"cuda"``).
    devices: frozenset = frozenset({"cpu"})
    #: The ops of :data:`OPS` it has (the others fall through to the next library).
    ops: frozenset = frozenset(OPS)
    #: What the job must provide before it starts: ``"launcher"`` (an MPI
    #: communicator: MPI, or PMI, launched the ranks), ``"store"`` (a rendezvous store).
    needs: frozenset = frozenset()
    #: Device types whose ops it runs when no default backend is named (NCCL: cuda).
    default_for: frozenset = frozenset()
    #: False: its async calls take a core from the caller's compute (a thread in a
    #: spinning wait), so selection sends them to the next library; ``backend=`` still reaches it.
    async_calls: bool = True
    #: The ops of ``mcrdl bench`` (bench.BENCH_OPS) its raw baseline times (:meth:`raw_calls`).
    raw_ops: frozenset = frozenset()

    @classmethod
    def unavailable_reason(cls, ctx: Context) -> Optional[str]:
        """Why this backend cannot start in this job, or None if it can."""
        return None

    def __init__(self, ctx: Context):
        self.ctx = ctx

    def join(self) -> None:
        """Called on every rank once every rank's backends started, in registry
        order: the place for start-up exchanges with the peers (:meth:`Context.share`),
        which a start that failed on some rank would otherwise leave waiting.
        Raise :class:`BackendUnavailable` to be left out (on every rank alike)."""

    @classmethod
    def info_lines(cls, live: bool) -> list:
        """Lines for ``mcrdl info`` (``live``: in this job): what the backend
        compiled and loaded, building it now if it has a compiled part."""
        return []

    def unsupported(self, op: str, dtype: torch.dtype, reduce_op: Optional[ReduceOp],
                    device: str) -> Optional[str]:
        """Why this backend cannot run ``op`` on ``dtype`` tensors of ``device``
        type (one of :attr:`devices`) correctly, or None."""
        return None

    def group_unsupported(self, ranks: Sequence[int], world: bool) -> Optional[str]:
        """Why this backend cannot serve a group of these global ``ranks`` (the
        same answer on every rank), or None; ``world``: the job's world group.
        A group it declines has no handle of it, and its ops fall through."""
        return None

    def version(self) -> str:
        return ""

    def raw_calls(self, h, inp: Optional[torch.Tensor], out: Optional[torch.Tensor], part: int) -> dict:
        """The library's own calls without mcrdl, which ``mcrdl bench`` times as
        ``raw-<name>`` beside this backend's (its per-call cost is mcrdl's over
        it): for each op of :attr:`raw_ops`, a call of no arguments on the
        bench's CPU buffers (``inp``/``out`` as ``mcrdl bench`` lays them out:
        ``part`` elements per rank's block, root 0, a sum); ``"p2p"``: a (send,
        recv) pair of functions of (tensor, peer). ``h``: this backend's world handle."""
        return {}

    def new_group(self, ranks: Sequence[int], group_rank: int, store: Any, timeout: float) -> Any:
        """Create this backend's handle for a group of global ``ranks``; called on
        the group's members only, each at its ``group_rank``, after they all
        checked in. ``store``: a torch Store private to this group (None when
        the job has none); ``timeout``: the group's, in seconds."""
        raise NotImplementedError

    def destroy_group(self, handle: Any) -> None:
        """Release a group handle."""

    def shutdown(self) -> None:
        """Release everything this backend holds."""

    # Operations: each returns a Pending and never blocks.
    def all_reduce(self, h, tensor: torch.Tensor, op: ReduceOp) -> Pending:
        raise NotImplementedError

    def starter(self, op: str, h, timeout: float, tensors: tuple, *fixed) -> Callable[..., Pending]:
        """``op`` for mcrdl's blocking fast paths, set up once per plan: a
        function called as ``start(*args)`` that starts ``self.<op>(h, *args,
        *fixed)``. ``tensors``: the plan's tensors (``None`` where a rank has
        none); later calls pass contiguous CPU tensors of the same shapes and
        dtypes. A backend may finish the op inside ``start`` (within ``timeout``
        s) and return :data:`~mcrdl.work.DONE`, or a Pending whose ``block``
        reports how it failed; a ``timeout`` of 0 (the async fast paths) asks
        for the op started, not waited for. Optional: the default is
        :meth:`nonblocking`."""
        return self.nonblocking(op, h, *fixed)

    def nonblocking(self, op: str, h, *fixed) -> Callable[..., Pending]:
        """``op`` for the async fast paths: ``start(*args)`` calls ``self.<op>(h,
        *args, *fixed)``, whose request the engine tracks like any async work."""
        method = getattr(self, op)
        return lambda *args: method(h, *args, *fixed)

    def broadcast(self, h, tensor: torch.Tensor, root: int) -> Pending:
        raise NotImplementedError

    def reduce(self, h, tensor: torch.Tensor, root: int, op: ReduceOp) -> Pending:
        raise NotImplementedError

    def all_gather_into_tensor(self, h, output: torch.Tensor, input: torch.Tensor) -> Pending:
        raise NotImplementedError

    def reduce_scatter_tensor(self, h, output: torch.Tensor, input: torch.Tensor, op: ReduceOp) -> Pending:
        raise NotImplementedError

    def gather(self, h, output: Optional[torch.Tensor], input: torch.Tensor, root: int) -> Pending:
        """``output`` (root only) is a flat buffer of ``size * input.numel()``."""
        raise NotImplementedError

    def scatter(self, h, output: torch.Tensor, input: Optional[torch.Tensor], root: int) -> Pending:
        """``input`` (root only) is a flat buffer of ``size * output.numel()``."""
        raise NotImplementedError

    def all_to_all_single(self, h, output: torch.Tensor, input: torch.Tensor,
                          output_counts: Optional[Sequence[int]],
                          input_counts: Optional[Sequence[int]]) -> Pending:
        """Contiguous tensors, split along their flat elements; counts are
        element counts per peer, or both None for
        an even split (then None on every rank: the caller passed no split
        sizes, which ranks must agree on, as with torch's MPI backend)."""
        raise NotImplementedError

    def barrier(self, h) -> Pending:
        raise NotImplementedError

    def send(self, h, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        raise NotImplementedError

    def recv(self, h, tensor: torch.Tensor, peer: int, tag: int) -> Pending:
        """``peer`` is :data:`ANY_SOURCE` for a receive from any peer; the
        Pending's ``source()`` then names the one that matched."""
        raise NotImplementedError
