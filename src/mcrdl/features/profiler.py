"""mcrdl's ops in ``torch.profiler`` traces, and the observer seam they share.

While a torch profiler records (``torch.profiler.profile``, or
``torch.autograd.profiler.profile``), every op — through mcrdl's API and
through ``torch.distributed`` on the "mcrdl" backend, blocking and async — is
an event named ``mcrdl:<library>:<op>`` (``mcrdl:mpi:all_reduce``,
``mcrdl:gloo:all_gather_into_tensor``): the library that ran it is in the
name, as torch's own backends name theirs ``gloo:all_reduce``. Its inputs are
the op's first tensor, its bytes (the selector's size) and its group size, so
``record_shapes=True`` shows shape and dtype, and the trace's "Concrete Inputs"
hold ``[tensor, bytes, group size]``. An event spans from the op's start to its
completion: for async work until the runtime sees it complete (a wait, a poll,
``is_completed()``), ended from whichever thread saw it.

With no profiler recording the API reads one module flag per call (torch's
``_is_profiler_enabled``, kept for such checks).

The seam: the API reports each op to an *observer*, ``begin(op, backend,
group, nbytes, async_op, peer, counts, reads, writes)``, and runs the callable
it returns when the op completes. The communication logger
(:mod:`mcrdl.features.logger`), the flight recorder
(:mod:`mcrdl.features.flight_recorder`) and :data:`PROFILER` are observers;
:func:`observers` joins several into one.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
_enter = torch.autograd._record_function_with_args_enter
_exit = torch.autograd._record_function_with_args_exit
_end_on = torch.ops.profiler._call_end_callbacks_on_jit_fut


class ProfilerEvents:
    """The observer that opens one profiler event per op."""

    def begin(self, op: str, backend: str, group, nbytes: int, async_op: bool, peer: int = -1,
              counts=None, reads=(), writes=()) -> Callable[[], None]:
        tensors = reads or writes
        args = (tensors[0], nbytes, group.size) if tensors else (nbytes, group.size)
        handle = _enter(f"mcrdl:{backend}:{op}", *args)
        if not async_op:
            return lambda: _exit(handle)
        # an async op completes on whichever thread notices it: torch ends an
        # event from another thread only through a future it completes
        done = torch.futures.Future()
        _end_on(handle, done)
        return lambda: done.set_result(None)


#: The one profiler observer (it has no state).
PROFILER = ProfilerEvents()


class Observers:
    """Several observers as one: each begins, and each end runs, in order."""

    def __init__(self, parts: tuple):
        self.parts = parts

    def begin(self, *args) -> Callable[[], None]:
        ends = [part.begin(*args) for part in self.parts]

        def end() -> None:
            for finish in ends:
                finish()
        return end


def observers(*parts) -> Optional[object]:
    """The observer of ``parts`` (None entries skipped): None, the one part, or
    an :class:`Observers`."""
    live = tuple(p for p in parts if p is not None)
    if not live:
        return None
    return live[0] if len(live) == 1 else Observers(live)
