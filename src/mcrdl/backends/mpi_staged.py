"""Host-staged MPI: CUDA tensors through host memory, for an MPI that is not
CUDA-aware.

Each op copies its inputs from the device into host buffers, runs the MPI
backend's op on those, and copies the outputs back. With CUDA tensors the
copies run on two side streams (copies in, copies back), each ordered after
the work queued on the caller's stream before the op (an event, not a
host-blocking synchronize), with pinned buffers from torch's caching host
allocator; the op starts when the progress engine sees the copy's event
complete (the MPI backend's deferred start, in submission order:
backends/mpi.py), and completes when the copy back is queued with the caller's
stream ordered after it (stream-ordered, like NCCL: the host does not wait for
the copy). A cancelled op (a missed deadline) copies nothing back.

Selectable like any backend (``backend="mpi_staged"``, a table, autotune):
the tuner decides where staging beats NCCL.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..work import Pending, current_stream, on_stream
from .base import Context
from .mpi import DeferredPending, MPIBackend

#: (device tensor, host buffer, copy in before the op, copy back after it)
Entry = tuple[torch.Tensor, torch.Tensor, bool, bool]


def _copy_all(pairs, side) -> None:
    """``dst.copy_(src)`` for each pair, without blocking, on the current
    stream ``side``; the device tensors are kept from the allocator until it ran."""
    for dst, src in pairs:
        dst.copy_(src, non_blocking=True)
        (src if src.is_cuda else dst).record_stream(side)


class StagedPending(DeferredPending):
    """One staged op: waiting for its inputs on the host (``ready``: the copy
    in), then its MPI request; complete once its outputs are on their way back
    (the submitting stream waits for them)."""

    __slots__ = ("entries", "stream", "submitted", "copied_out")

    def __init__(self, backend: "StagedMPIBackend", entries: Sequence[Entry], start: Callable[[], Pending],
                 stream=None):
        super().__init__(backend, start)
        self.entries = entries
        self.stream = stream  # CUDA: the caller's stream, and an event at the op's place in it
        self.submitted = None
        if stream is not None:
            self.submitted = torch.cuda.Event()
            self.submitted.record(stream)
        self.copied_out = False

    def completed(self) -> bool:
        if not self.inner.test():
            return False
        if not (self.copied_out or self.cancelled):  # cancelled: the buffers hold nothing of the op's
            self.backend.copy_out(self)
            self.copied_out = True
        return True


class StagedMPIBackend(MPIBackend):
    name = "mpi_staged"
    devices = frozenset({"cuda"})
    direct_cuda = False

    @classmethod
    def info_lines(cls, live):
        return []  # (the mpi backend's)

    @classmethod
    def unavailable_reason(cls, ctx: Context) -> Optional[str]:
        reason = super().unavailable_reason(ctx)
        if reason is None and not torch.cuda.is_available():
            return "no CUDA device (it moves CUDA tensors through host memory)"
        return reason

    def __init__(self, ctx: Context):
        super().__init__(ctx)
        self.devices = type(self).devices

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
        stream = current_stream(entries[0][0].get_device()) if entries and entries[0][0].is_cuda else None
        pending = StagedPending(self, entries, lambda: start(*args), stream)
        return self.defer(pending, lambda: self.copy_in(pending))

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
            side = self.streams(copies[0][0].device)[0]
            side.wait_event(pending.submitted)
            on_stream(side, _copy_all, [(host, t) for t, host in copies], side)
            event = torch.cuda.Event()
            event.record(side)
            return event

    def copy_out(self, pending: StagedPending) -> None:
        """Copy the outputs back to the device: CUDA tensors on a side stream,
        after the caller's work queued before the op (which may still read
        them), with the caller's stream ordered after the copies, as NCCL
        orders it after its kernels: nobody waits for them on the host (the
        caching host allocator keeps each buffer until its copy has run)."""
        copies = [(t, host) for t, host, _, back in pending.entries if back]
        with torch.no_grad():
            if pending.submitted is None or not copies:
                for t, host in copies:
                    t.copy_(host)
                return
            side = self.streams(copies[0][0].device)[1]
            side.wait_event(pending.submitted)
            on_stream(side, _copy_all, copies, side)
            event = torch.cuda.Event()
            event.record(side)
            pending.stream.wait_event(event)

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
