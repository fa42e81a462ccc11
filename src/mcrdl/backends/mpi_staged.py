"""Host-staged MPI: CUDA tensors through host memory, for an MPI that is not
CUDA-aware.

Each op copies its inputs from the device into host buffers, runs the MPI
backend's op on those, and copies the outputs back. With CUDA tensors the
copies run on a side stream, ordered after the work already queued on the
caller's stream (an event, not a host-blocking synchronize), into pinned
buffers from torch's caching host allocator; the op starts when the progress
engine sees the copy's event complete, and completes when the copy back has
landed (later work on the caller's stream is also ordered after it). A
request therefore starts after it is submitted, so requests start strictly in
submission order (a FIFO per backend): every rank then starts its collectives
on a communicator in the same order, as MPI requires.

Selectable like any backend (``backend="mpi_staged"``, a table, autotune):
the tuner decides where staging beats NCCL.
"""
from __future__ import annotations

from collections import deque
from typing import Callable, Optional, Sequence

import torch

from ..work import Pending
from .base import Context
from .mpi import MPIBackend

#: (device tensor, host buffer, copy in before the op, copy back after it)
Entry = tuple[torch.Tensor, torch.Tensor, bool, bool]


class StagedPending(Pending):
    """One staged op: waiting for its inputs on the host, then its MPI
    request, then its outputs back on the device."""

    #: not "mpi": a wait on a plain MPI request must still poll this one, or
    #: its deferred start would never happen while that wait spins
    progress_domain = "mpi_staged"
    __slots__ = ("backend", "entries", "start", "ready_in", "inner", "ready_out", "stream")

    def __init__(self, backend: "StagedMPIBackend", entries: Sequence[Entry],
                 start: Callable[..., Pending], ready_in, stream):
        self.backend, self.entries, self.start = backend, entries, start
        self.ready_in, self.stream = ready_in, stream  # copy-in event, the caller's stream (CUDA)
        self.inner: Optional[Pending] = None
        self.ready_out = None

    def test(self) -> bool:
        self.backend.start_ready()
        if self.inner is None:
            return False
        if self.ready_out is None:
            if not self.inner.test():
                return False
            self.ready_out = self.backend.copy_out(self.entries, self.stream)
        return self.ready_out is True or self.ready_out.query()

    def cancel(self) -> None:
        if self.inner is not None:
            self.inner.cancel()
        else:
            self.backend.withdraw(self)

    def source(self) -> int:
        return self.inner.source()


class StagedMPIBackend(MPIBackend):
    name = "mpi_staged"
    devices = frozenset({"cuda"})

    @classmethod
    def unavailable_reason(cls, ctx: Context) -> Optional[str]:
        reason = super().unavailable_reason(ctx)
        if reason is None and not torch.cuda.is_available():
            return "no CUDA device (it moves CUDA tensors through host memory)"
        return reason

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.devices = type(self).devices  # (MPIBackend adds cuda when the MPI is CUDA-aware)
        self.queue: deque[StagedPending] = deque()  # submitted, not started: in submission order
        self.side: dict[torch.device, torch.cuda.Stream] = {}

    def version(self) -> str:
        return super().version() + " (host-staged)"

    def starter(self, op, h, timeout, tensors, *fixed):
        """Every op through its staging (not the compiled calls on device memory)."""
        return self.nonblocking(op, h, *fixed)

    # -- staging -------------------------------------------------------------------
    def staged(self, start: Callable[..., Pending], *tensors: tuple[Optional[torch.Tensor], bool, bool]
               ) -> Pending:
        """Run ``start(*host buffers)`` on host copies of ``tensors``, given as
        (tensor or None, copy in, copy back); None stays None."""
        entries = [(t, torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda), i, o)
                   for t, i, o in tensors if t is not None]
        hosts = iter(e[1] for e in entries)
        args = [None if t is None else next(hosts) for t, _, _ in tensors]
        stream = torch.cuda.current_stream(entries[0][0].device) if entries and entries[0][0].is_cuda else None
        pending = StagedPending(self, entries, lambda: start(*args), self.copy_in(entries, stream), stream)
        self.queue.append(pending)
        self.start_ready()
        return pending

    def start_ready(self) -> None:
        """Start the queued ops whose inputs are on the host, oldest first,
        stopping at the first that is not ready (so starts keep their order)."""
        queue = self.queue
        while queue and (queue[0].ready_in is True or queue[0].ready_in.query()):
            pending = queue.popleft()
            try:
                pending.inner = pending.start()
            except Exception as exc:  # the op's own failure, raised by its own work
                pending.inner = _Failed(exc)

    def withdraw(self, pending: StagedPending) -> None:
        """Drop a queued op that missed its deadline before it started."""
        try:
            self.queue.remove(pending)
        except ValueError:
            pass

    def _side(self, device: torch.device) -> "torch.cuda.Stream":
        stream = self.side.get(device)
        if stream is None:
            stream = self.side[device] = torch.cuda.Stream(device)
        return stream

    def copy_in(self, entries: Sequence[Entry], stream):
        """Copy the inputs to their host buffers: True when done, else the
        side stream's event marking it (queued after ``stream``'s work)."""
        with torch.no_grad():
            if stream is None:
                for t, host, into, _ in entries:
                    if into:
                        host.copy_(t)
                return True
            side = self._side(stream.device)
            side.wait_stream(stream)
            with torch.cuda.stream(side):
                for t, host, into, _ in entries:
                    if into:
                        host.copy_(t, non_blocking=True)
                        t.record_stream(side)  # the allocator must not reuse it before the copy ran
                event = torch.cuda.Event()
                event.record(side)
            return event

    def copy_out(self, entries: Sequence[Entry], stream):
        """Copy the outputs back to the device: True when done, else the event
        marking it, which the caller's ``stream`` also waits for."""
        with torch.no_grad():
            if stream is None:
                for t, host, _, back in entries:
                    if back:
                        t.copy_(host)
                return True
            side = self._side(stream.device)
            with torch.cuda.stream(side):
                for t, host, _, back in entries:
                    if back:
                        t.copy_(host, non_blocking=True)
                        t.record_stream(side)
                event = torch.cuda.Event()
                event.record(side)
            stream.wait_event(event)
            return event

    # -- operations: (tensor, copy in, copy back) per buffer ---------------------------
    def all_reduce(self, comm, tensor, op):
        return self.staged(lambda t: super(StagedMPIBackend, self).all_reduce(comm, t, op), (tensor, True, True))

    def broadcast(self, comm, tensor, root):
        is_root = comm.Get_rank() == root
        return self.staged(lambda t: super(StagedMPIBackend, self).broadcast(comm, t, root),
                           (tensor, is_root, not is_root))

    def reduce(self, comm, tensor, root, op):
        return self.staged(lambda t: super(StagedMPIBackend, self).reduce(comm, t, root, op),
                           (tensor, True, comm.Get_rank() == root))

    def all_gather_into_tensor(self, comm, output, input):
        return self.staged(lambda o, i: super(StagedMPIBackend, self).all_gather_into_tensor(comm, o, i),
                           (output, False, True), (input, True, False))

    def reduce_scatter_tensor(self, comm, output, input, op):
        return self.staged(lambda o, i: super(StagedMPIBackend, self).reduce_scatter_tensor(comm, o, i, op),
                           (output, False, True), (input, True, False))

    def gather(self, comm, output, input, root):
        return self.staged(lambda o, i: super(StagedMPIBackend, self).gather(comm, o, i, root),
                           (output, False, True), (input, True, False))

    def scatter(self, comm, output, input, root):
        return self.staged(lambda o, i: super(StagedMPIBackend, self).scatter(comm, o, i, root),
                           (output, False, True), (input, True, False))

    def all_to_all_single(self, comm, output, input, output_counts, input_counts):
        return self.staged(lambda o, i: super(StagedMPIBackend, self).all_to_all_single(
            comm, o, i, output_counts, input_counts), (output, False, True), (input, True, False))

    def barrier(self, comm):
        return self.staged(lambda: super(StagedMPIBackend, self).barrier(comm))

    def send(self, comm, tensor, peer, tag):
        return self.staged(lambda t: super(StagedMPIBackend, self).send(comm, t, peer, tag), (tensor, True, False))

    def recv(self, comm, tensor, peer, tag):
        return self.staged(lambda t: super(StagedMPIBackend, self).recv(comm, t, peer, tag), (tensor, False, True))



class _Failed(Pending):
    """A staged op whose MPI call raised when it was started."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error

    def test(self) -> bool:
        raise self.error
