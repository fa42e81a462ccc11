"""Host-staged MPI: CUDA tensors through host memory, for an MPI that is not
CUDA-aware.

Each op copies its inputs from the device into host buffers, runs the MPI
backend's op on those, and copies the outputs back. With CUDA tensors the
copies run on two side streams (copies in, copies back), each ordered after
the work queued on the caller's stream before the op (an event, not a
host-blocking synchronize), with pinned buffers from torch's caching host
allocator; the op starts when the progress engine sees the copy's event
complete, and completes when the copy back has landed (later work on the
caller's stream is also ordered after it). A request therefore starts after
it is submitted, so requests start strictly in submission order (a queue per
backend, under a lock: the engine's helper threads poll too): every rank then
starts its collectives on a communicator in the same order, as MPI requires.
A cancelled op (a missed deadline) copies nothing back.

Selectable like any backend (``backend="mpi_staged"``, a table, autotune):
the tuner decides where staging beats NCCL.
"""
from __future__ import annotations

import threading
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
    __slots__ = ("backend", "entries", "start", "stream", "submitted", "ready_in", "inner", "ready_out",
                 "cancelled")

    def __init__(self, backend: "StagedMPIBackend", entries: Sequence[Entry], start: Callable[[], Pending],
                 stream=None):
        self.backend, self.entries, self.start = backend, entries, start
        self.stream = stream  # CUDA: the caller's stream, and an event at the op's place in it
        self.submitted = None
        if stream is not None:
            self.submitted = torch.cuda.Event()
            self.submitted.record(stream)
        self.ready_in = True  # or the copy-in's event
        self.inner: Optional[Pending] = None
        self.ready_out = None
        self.cancelled = False

    def test(self) -> bool:
        if self.inner is None:
            self.backend.start_ready()
            if self.inner is None:
                return self.cancelled  # withdrawn before it started
        if self.ready_out is None:
            if not self.inner.test():
                return False
            if self.cancelled:  # the buffers hold nothing of the op's: copy nothing back
                return True
            self.ready_out = self.backend.copy_out(self)
        return self.ready_out is True or self.ready_out.query()

    def cancel(self) -> None:
        """Withdraw it: from the queue if it has not started (under the lock,
        so it cannot start meanwhile), else from MPI (a point-to-point op)."""
        self.cancelled = True
        if not self.backend.withdraw(self):
            self.inner.cancel()

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
        self.lock = threading.Lock()  # the queue: submitting threads and the engine's helper threads
        self.side: dict[torch.device, tuple] = {}  # per device: (copy-in stream, copy-back stream)

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
        pending = StagedPending(self, entries, lambda: start(*args), stream)
        with self.lock:
            pending.ready_in = self.copy_in(pending)
            self.queue.append(pending)
            self._start_ready()
        return pending

    def start_ready(self) -> None:
        with self.lock:
            self._start_ready()

    def _start_ready(self) -> None:
        """Start the queued ops whose inputs are on the host, oldest first,
        stopping at the first that is not ready (so starts keep their order
        on every rank). A failure is the failing op's own."""
        queue = self.queue
        while queue:
            head = queue[0]
            try:
                if not (head.ready_in is True or head.ready_in.query()):
                    return
                head.inner = head.start()
            except Exception as exc:
                head.inner = _Failed(exc)
            queue.popleft()

    def withdraw(self, pending: StagedPending) -> bool:
        """Drop ``pending`` from the queue if it has not started; False when it has."""
        with self.lock:
            if pending.inner is not None:
                return False
            if pending in self.queue:  # (not after an earlier withdrawal)
                self.queue.remove(pending)
            return True

    def _streams(self, device: torch.device) -> tuple:
        streams = self.side.get(device)
        if streams is None:  # two: a copy back never queues behind later ops' copies in
            streams = self.side[device] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
        return streams

    def copy_in(self, pending: StagedPending):
        """Copy the inputs to their host buffers: True when done (or none),
        else the event marking it, queued after the caller's stream's work."""
        copies = [(t, host) for t, host, into, _ in pending.entries if into]
        with torch.no_grad():
            if not copies:
                return True
            if pending.submitted is None:
                for t, host in copies:
                    host.copy_(t)
                return True
            side = self._streams(copies[0][0].device)[0]
            side.wait_event(pending.submitted)
            with torch.cuda.stream(side):
                for t, host in copies:
                    host.copy_(t, non_blocking=True)
                    t.record_stream(side)  # the allocator must not reuse it before the copy ran
                event = torch.cuda.Event()
                event.record(side)
            return event

    def copy_out(self, pending: StagedPending):
        """Copy the outputs back to the device: True when done, else the event
        marking it (after the caller's work queued before the op, which may
        still use those tensors); the caller's stream waits for it."""
        copies = [(t, host) for t, host, _, back in pending.entries if back]
        with torch.no_grad():
            if pending.submitted is None or not copies:
                for t, host in copies:
                    t.copy_(host)
                return True
            side = self._streams(copies[0][0].device)[1]
            side.wait_event(pending.submitted)
            with torch.cuda.stream(side):
                for t, host in copies:
                    t.copy_(host, non_blocking=True)
                    t.record_stream(side)
                event = torch.cuda.Event()
                event.record(side)
            pending.stream.wait_event(event)
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
