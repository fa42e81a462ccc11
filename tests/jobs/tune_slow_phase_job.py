"""tune measures a minority winner again: a slow phase of one backend during
the sweep does not end up in the table.

A test-only backend ``mpi_slow_phase`` (an MPI subclass registered here, not
in product code) sleeps 20 ms before its first ``SLOW_CALLS`` all_reduce calls
of 64 KiB (the sweep's warm-up and timed calls there) and is plain MPI after
that. ``mcrdl tune`` (mcrdl.cli.main inside this job, so the backend is live)
over [mpi_slow_phase, gloo] at 4 B, 256 B and 64 KiB writes the table to
argv[1]; the slow sweep gave 64 KiB to gloo, the second pass must give it back.
The small sizes take the median of 50 calls: with 3, one slow call under load
handed 4 B to gloo, made mpi the minority and the wrong size was measured again.
64 KiB takes the median of 10: with 2, one slow call of the second pass under
load kept 64 KiB with gloo. The rival, ``gloo_steady``, is gloo with 5 ms added to
every all_reduce: under another job's load MPI's polled waits lost a plain gloo's
second pass twice (CI, 2026-11-29 and 2026-12-04) and, under four spinning loads,
the 4 B cell: a property of the load, not of tune. With 5 ms gloo still wins the
first pass at 64 KiB (against 20 ms) and loses every other cell on a loaded machine too.
"""
import sys
import time

import mcrdl
import verdicts  # noqa: F401  (an exception that ends a rank is a failed check)
from mcrdl import cli
from mcrdl.backends.mpi import MPIBackend
from mcrdl.backends.torch_pg import GlooBackend

SLOW_BYTES, SLOW_CALLS = 65536, 11  # --warmup 1, --large-iters 10, --rounds 1: the whole first pass


@mcrdl.register_backend
class SlowPhaseMPI(MPIBackend):
    name = "mpi_slow_phase"
    slow_left = SLOW_CALLS

    def _phase(self, tensor):
        if tensor.nbytes == SLOW_BYTES and self.slow_left > 0:
            self.slow_left -= 1
            time.sleep(0.02)

    def all_reduce(self, comm, tensor, op):
        self._phase(tensor)
        return super().all_reduce(comm, tensor, op)

    def starter(self, op, comm, timeout, tensors, *fixed):  # the fast path's start
        start = super().starter(op, comm, timeout, tensors, *fixed)
        if op != "all_reduce":
            return start
        return lambda tensor: (self._phase(tensor), start(tensor))[1]


@mcrdl.register_backend
class SteadyGloo(GlooBackend):
    name = "gloo_steady"

    def all_reduce(self, h, tensor, op):
        time.sleep(0.005)
        return super().all_reduce(h, tensor, op)

    def starter(self, op, h, timeout, tensors, *fixed):  # the fast path's start
        start = super().starter(op, h, timeout, tensors, *fixed)
        if op != "all_reduce":
            return start
        return lambda tensor: (time.sleep(0.005), start(tensor))[1]


sys.exit(cli.main(["tune", "--backends", "mpi_slow_phase,gloo_steady", "--ops", "all_reduce",
                   "--sizes", "4,256,64K", "--iters", "50", "--large-iters", "10", "--warmup", "1",
                   "--rounds", "1", "--out", sys.argv[1]]))
