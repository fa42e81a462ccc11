"""``torch.distributed`` process-group backends: ``gloo`` (CPU, and CUDA
collectives through torch's host staging) and ``nccl`` (CUDA).

With CUDA tensors the library runs the op on its own streams, ordered after
the work queued on the caller's stream at submission; when mcrdl sees the op
complete (in whichever thread), that same stream is made to wait for the
results (``Pending.stream``; ``Work.wait()`` then orders the stream current
there too, as torch does).

Process groups are constructed directly on mcrdl's own store (no
``torch.distributed.init_process_group``), so torch's global default group
stays free for the user's code.
"""
from __future__ import annotations

import functools
import math
import threading
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..tuning import OP_CLASS
from ..types import ReduceOp
from ..work import DONE, Pending, current_stream, on_stream
from .base import ANY_SOURCE, Backend

_TORCH_OPS = {ReduceOp.SUM: dist.ReduceOp.SUM, ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
              ReduceOp.MIN: dist.ReduceOp.MIN, ReduceOp.MAX: dist.ReduceOp.MAX}


@functools.cache
def _options(kind: type, **fields):
    """A c10d options object, made once per kind and fields (c10d copies it per call)."""
    options = kind()
    for name, value in fields.items():
        setattr(options, name, value)
    return options


#: A blocking wait whose deadline is within this of the group's whole timeout
#: (set moments ago) waits without a timeout: the process group applies its own,
#: as long and counted from now, so it ends no sooner, and gloo's untimed wait
#: costs less per send/recv (docs/results/layers.md).
FRESH_S = 0.1

#: Helper threads blocked in c10d ``wait()``; joined at shutdown so none is
#: still inside torch when the interpreter tears down.
_WAITERS: list = []


def join_waiters(timeout: float = 1.0) -> None:
    """Wait (bounded) for every helper thread to leave torch."""
    deadline = time.monotonic() + timeout
    while _WAITERS:
        thread = _WAITERS.pop()
        thread.join(max(deadline - time.monotonic(), 0))


class TorchPending(Pending):
    """A c10d ``Work``. Gloo progresses on its own threads, but for some ops
    (reduce_scatter, send, recv) ``is_completed()`` stays False until
    ``wait()`` is called, so a mixed wait hands ``wait()`` to a helper thread."""

    __slots__ = ("work", "lies", "stream", "timeout_s", "_waiter", "_error")

    def __init__(self, work, lies: bool = False, tensor: Optional[torch.Tensor] = None,
                 timeout_s: float = math.inf):
        self.work = work
        self.lies = lies  # is_completed() stays False until wait() (gloo: reduce_scatter, send, recv)
        self.timeout_s = timeout_s  # the process group's own timeout, which its wait() applies unasked
        #: CUDA: the caller's stream at submission, which must wait for the results
        self.stream = current_stream(tensor.get_device()) if tensor is not None and tensor.is_cuda else None
        self._waiter: Optional[threading.Event] = None
        self._error: Optional[BaseException] = None

    def _finish(self, wait, *args) -> None:
        """``wait(*args)`` (the work's wait): raises if the op failed, and
        orders the current stream, made the submitting one, after its results
        (gloo's reduce_scatter even copies its output in wait())."""
        if self.stream is None:
            wait(*args)
        else:
            on_stream(self.stream, wait, *args)

    def test(self) -> bool:
        if self._waiter is None and self.lies:
            self.prepare_poll()  # polled, not blocked on: only wait() completes it
        if self._waiter is not None:
            if not self._waiter.is_set():
                return False
            if self._error is not None:
                raise self._error
            return True
        if self.work.is_completed():
            self._finish(self.work.wait)
            return True
        return False

    @property
    def resumable_block(self) -> bool:
        """gloo fails a send/recv whose wait(timeout) expired; a helper's wait() does not."""
        return not self.lies or self._waiter is not None

    def block(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if self._waiter is not None:
            return self._waiter.wait(max(remaining, 0)) and self.test()
        try:
            if 0 < self.timeout_s - FRESH_S <= remaining <= self.timeout_s:  # the group's deadline, set just
                self._finish(self.work.wait)  # now: the library's own timeout ends no sooner, costs less
            else:
                self._finish(self.work.wait, timedelta(seconds=max(remaining, 0.001)))
        except RuntimeError as exc:
            if "timed out" in str(exc).lower() and time.monotonic() >= deadline - 0.01:
                return False
            raise
        return True

    def prepare_poll(self) -> None:
        """Only ops whose is_completed() lies need a thread to call wait()."""
        if self._waiter is None and self.lies:
            self._waiter = threading.Event()
            thread = threading.Thread(target=self._wait_in_background, daemon=True,
                                      name="mcrdl-torch-wait")
            _WAITERS.append(thread)
            thread.start()

    def source(self) -> int:
        return self.work._source_rank()

    def native_future(self):
        """The library's own future for this op (completed by gloo's threads),
        or None where it cannot be trusted (the ops whose is_completed lies)."""
        return None if self.lies else self.work.get_future()

    def _wait_in_background(self) -> None:
        try:
            self._finish(self.work.wait)
        except BaseException as exc:
            self._error = exc
        self._waiter.set()


class WaitedPending(TorchPending):
    """A send/recv whose untimed ``wait()`` inside its start
    (:meth:`TorchBackend.starter`) failed: blocking on it reports the failure,
    as a missed deadline when gloo's wait ran out the group's own timeout."""

    __slots__ = ("failure", "timed_out")
    #: one block, which reports the failure (the wait already took its time)
    resumable_block = False

    def __init__(self, work, failure: RuntimeError, timed_out: bool):
        super().__init__(work, lies=True)
        self.failure = failure
        self.timed_out = timed_out

    def block(self, deadline: float) -> bool:
        if self.timed_out:
            return False
        raise self.failure


class OrderedPending(TorchPending):
    """A c10d ``Work`` of a library that orders its results on the caller's
    stream itself (NCCL). Waited for (a blocking op, ``Work.wait()``), it is
    complete once ``wait()`` queued that order, as torch's own NCCL ops are:
    the host does not wait for the GPU. Polled (``is_completed()``, a wait
    that must keep another library progressing), it is complete once the GPU
    ran it, as torch's ``is_completed()`` says. An op whose peer never comes
    is failed by NCCL's watchdog after the group timeout."""

    __slots__ = ()

    def test(self) -> bool:
        if not self.work.is_completed():
            return False
        self._finish(self.work.wait)
        return True

    def block(self, deadline: float) -> bool:
        self._finish(self.work.wait)
        return True


class TorchBackend(Backend):
    """A torch.distributed process-group library; subclasses name it."""

    needs = frozenset({"store"})
    #: the library orders an op's results on the caller's stream by itself (NCCL)
    stream_ordered = False
    #: a send or receive of no elements moves one element of its dtype instead, on
    #: both sides (torch's gloo refuses an empty buffer in an any-source receive)
    empty_message_carries_one = False

    def version(self) -> str:
        return f"torch {torch.__version__}"

    def __init__(self, ctx):
        super().__init__(ctx)
        self.timeouts: dict = {}  # process group -> its timeout (s)

    def _pending(self, work, lies: bool = False, tensor: Optional[torch.Tensor] = None,
                 timeout_s: float = math.inf) -> TorchPending:
        if self.stream_ordered:
            return OrderedPending(work, tensor=tensor)
        return TorchPending(work, lies, tensor, timeout_s)

    def starter(self, op, pg, timeout, tensors, *fixed):
        """A blocking send/recv with one peer waits inside its start, with the
        untimed ``wait()``: gloo applies the process group's timeout, the
        group's, so the deadline holds. Code that runs after gloo wakes the
        caller runs on a cold core and costs several times its own time
        (docs/results/layers.md), so no Pending or engine wait follows a
        completed one; a failed one returns a :class:`WaitedPending`. Other
        ops, an empty message the library carries as one element (send and
        recv do that), and a subclass's own send or recv: the default."""
        if (op not in ("send", "recv") or fixed[0] == ANY_SOURCE or self.stream_ordered
                or timeout != self.timeouts.get(pg) or getattr(type(self), op) is not getattr(TorchBackend, op)
                or (self.empty_message_carries_one and not tensors[0].numel())):  # (a plan's calls share its shapes)
            return super().starter(op, pg, timeout, tensors, *fixed)
        peer, tag = fixed
        begin = pg.send if op == "send" else pg.recv

        def start(t):
            work = begin([t], peer, tag)
            began = time.monotonic()
            try:
                work.wait()
            except RuntimeError as exc:  # (gloo says "timed out" of a connection's timeout too)
                ran_out = "timed out" in str(exc).lower() and time.monotonic() - began >= timeout - FRESH_S
                return WaitedPending(work, exc, ran_out)
            return DONE
        return start

    def shutdown(self) -> None:
        join_waiters()
        self.timeouts.clear()

    def _make_pg(self, store, group_rank: int, size: int, timeout: timedelta):
        raise NotImplementedError

    def new_group(self, ranks, group_rank, store, timeout):
        store = dist.PrefixStore(f"{self.name}/", store)
        pg = self._make_pg(store, group_rank, len(ranks), timedelta(seconds=timeout))
        self.timeouts[pg] = timeout
        return pg

    def destroy_group(self, handle) -> None:
        self.timeouts.pop(handle, None)

    # -- operations --------------------------------------------------------------
    def all_reduce(self, pg, tensor, op):
        opts = _options(dist.AllreduceOptions, reduceOp=_TORCH_OPS[op])
        return self._pending(pg.allreduce([tensor], opts), tensor=tensor)

    def broadcast(self, pg, tensor, root):
        opts = _options(dist.BroadcastOptions, rootRank=root)
        return self._pending(pg.broadcast([tensor], opts), tensor=tensor)

    def reduce(self, pg, tensor, root, op):
        opts = _options(dist.ReduceOptions, rootRank=root, reduceOp=_TORCH_OPS[op])
        return self._pending(pg.reduce([tensor], opts), tensor=tensor)

    def all_gather_into_tensor(self, pg, output, input):
        return self._pending(pg._allgather_base(output, input), tensor=input)

    def reduce_scatter_tensor(self, pg, output, input, op):
        opts = _options(dist.ReduceScatterOptions, reduceOp=_TORCH_OPS[op])
        return self._pending(pg._reduce_scatter_base(output, input, opts), lies=True, tensor=input)

    def gather(self, pg, output, input, root):
        opts = _options(dist.GatherOptions, rootRank=root)
        # gloo wants every block shaped like the input (a multi-dim tensor gets flat blocks)
        outputs = [[b.view(input.shape) for b in output.chunk(pg.size())]] if output is not None else []
        return self._pending(pg.gather(outputs, [input], opts), tensor=input)

    def scatter(self, pg, output, input, root):
        opts = _options(dist.ScatterOptions, rootRank=root)
        inputs = [[b.view(output.shape) for b in input.chunk(pg.size())]] if input is not None else []
        return self._pending(pg.scatter([output], inputs, opts), tensor=output)

    def all_to_all_single(self, pg, output, input, output_counts, input_counts):
        return self._pending(pg.alltoall_base(output.view(-1), input.view(-1), list(output_counts or ()),
                                              list(input_counts or ()), dist.AllToAllOptions()), tensor=input)

    def barrier(self, pg):  # NCCL's barrier waits on the host in wait(): a deadline applies
        return TorchPending(pg.barrier(dist.BarrierOptions()))

    def send(self, pg, tensor, peer, tag):
        return self._pending(pg.send([self._carrier(tensor)], peer, tag), True, tensor,
                             self.timeouts.get(pg, math.inf))

    def recv(self, pg, tensor, peer, tag):
        buffer = self._carrier(tensor)
        work = pg.recv_anysource([buffer], tag) if peer == ANY_SOURCE else pg.recv([buffer], peer, tag)
        return self._pending(work, True, tensor, self.timeouts.get(pg, math.inf))

    def _carrier(self, tensor):
        """What a send or receive of ``tensor`` moves: ``tensor``, or one element of its
        dtype for an empty one where the library refuses empty messages."""
        return tensor.new_zeros(1) if self.empty_message_carries_one and not tensor.numel() else tensor


class GlooBackend(TorchBackend):
    name = "gloo"
    empty_message_carries_one = True
    devices = frozenset({"cpu", "cuda"})  # CUDA: collectives only, where the torch build has CUDA

    @classmethod
    def unavailable_reason(cls, ctx):
        if not dist.is_gloo_available():
            return "this torch build has no gloo"
        if ctx.store is None:
            return "no rendezvous store"
        return None

    def __init__(self, ctx):
        super().__init__(ctx)
        if not torch.cuda.is_available():
            self.devices = frozenset({"cpu"})
        self.raw_group = False  # raw_calls made torch.distributed's default group

    def unsupported(self, op, dtype, reduce_op, device):
        if dtype == torch.int16:
            return "gloo has no int16 support"
        if device == "cuda" and OP_CLASS.get(op) == "p2p":
            return "torch's gloo cannot send or receive CUDA tensors (its socket writes fail on device memory)"
        return None

    def _make_pg(self, store, group_rank, size, timeout):
        return dist.ProcessGroupGloo(store, group_rank, size, timeout)

    raw_ops = frozenset({"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "gather",
                         "scatter", "all_to_all", "all_to_allv", "p2p"})

    def raw_calls(self, h, inp, out, part):
        """``torch.distributed``'s own calls on a gloo default group of its own
        (made on mcrdl's store at the first, destroyed at shutdown), as a PyTorch
        user's code makes them; where the job made a default group, on that one."""
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.PrefixStore("raw-gloo/", self.ctx.store),
                                    rank=self.ctx.rank, world_size=self.ctx.world_size,
                                    timeout=timedelta(seconds=self.ctx.timeout))
            self.raw_group = True
        n, splits = self.ctx.world_size, [part] * self.ctx.world_size
        # torch >= 2.13 names (the older ones warn there); torch < 2.13 has only the older
        all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
        reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
        gathered = None if out is None else list(out.chunk(n))
        scattered = None if inp is None else list(inp.chunk(n))
        return {
            "all_reduce": lambda: dist.all_reduce(inp),
            "broadcast": lambda: dist.broadcast(inp, 0),
            "reduce": lambda: dist.reduce(inp, 0),
            "all_gather": lambda: all_gather(out, inp),
            "reduce_scatter": lambda: reduce_scatter(out, inp),
            "gather": lambda: dist.gather(inp, gathered, 0),
            "scatter": lambda: dist.scatter(out, scattered, 0),
            "all_to_all": lambda: dist.all_to_all_single(out, inp),
            "all_to_allv": lambda: dist.all_to_all_single(out, inp, splits, splits),
            "p2p": (dist.send, dist.recv),
        }

    def shutdown(self) -> None:
        super().shutdown()
        if self.raw_group and dist.is_initialized():
            dist.destroy_process_group()


class NCCLBackend(TorchBackend):
    name = "nccl"
    devices = default_for = frozenset({"cuda"})
    stream_ordered = True

    @classmethod
    def unavailable_reason(cls, ctx):
        if not torch.cuda.is_available():
            return "no CUDA device"
        if not dist.is_nccl_available():
            return "this torch build has no NCCL"
        if ctx.shared_gpu:
            return "ranks on this host share a GPU (NCCL needs one per rank)"
        if ctx.store is None:
            return "no rendezvous store"
        return None

    def __init__(self, ctx):
        super().__init__(ctx)
        self.pgs = []  # shut down with the backend: torch warns of (and leaks) any that is not

    def version(self):
        return "nccl " + ".".join(map(str, torch.cuda.nccl.version()))

    def destroy_group(self, handle) -> None:
        super().destroy_group(handle)
        if handle in self.pgs:
            self.pgs.remove(handle)
            handle.shutdown()

    def shutdown(self) -> None:
        super().shutdown()
        for pg in self.pgs:
            pg.shutdown()
        self.pgs.clear()

    def _make_pg(self, store, group_rank, size, timeout):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, group_rank, size, opts)
        self.pgs.append(pg)
        return pg
