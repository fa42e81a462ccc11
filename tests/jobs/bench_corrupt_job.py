"""--check catches a backend that returns a wrong result.

A test-only backend ``gloo_corrupt`` (a gloo subclass registered here, not in
product code) completes all_reduce correctly and then adds 1 to element 0; on
rank 0 its recv drops what arrives (receives into a scratch copy): the echo
leg of the p2p ping-pong, where rank 0 gets back the values it sent, so only
a check that clears rank 0's buffer before the echo can see it.

Modes:
  api  run mcrdl.tools.bench.Bench on [mpi, gloo_corrupt] with check=True and print
       "CHECK <op> <bytes> <variant> <status>" per result (rank 0);
  cli  run ``mcrdl bench --check`` (mcrdl.cli.main inside this job, so the
       registered backend is live) and exit with its return code.
"""
import sys

import mcrdl
import verdicts  # noqa: F401  (an exception that ends a rank is a failed check)
from mcrdl.backends.torch_pg import GlooBackend
from mcrdl.work import Pending


class CorruptingPending(Pending):
    """Wraps the real request; corrupts the tensor once, when it completes."""

    def __init__(self, inner, tensor):
        self.inner, self.tensor, self.corrupted = inner, tensor, False
        self.progress_domain = inner.progress_domain

    def _corrupt(self, done):
        if done and not self.corrupted:
            self.corrupted = True
            self.tensor.view(-1)[0] += 1
        return done

    def test(self):
        return self._corrupt(self.inner.test())

    def block(self, deadline):
        return self._corrupt(self.inner.block(deadline))

    def prepare_poll(self):
        self.inner.prepare_poll()


@mcrdl.register_backend
class CorruptGloo(GlooBackend):
    name = "gloo_corrupt"

    def all_reduce(self, pg, tensor, op):
        return CorruptingPending(super().all_reduce(pg, tensor, op), tensor)

    def recv(self, pg, tensor, peer, tag):
        return super().recv(pg, tensor.clone() if self.ctx.rank == 0 else tensor, peer, tag)


mode = sys.argv[1] if len(sys.argv) > 1 else "api"
if mode == "cli":
    from mcrdl import cli

    sys.exit(cli.main(["bench", "--variants", "mpi,gloo_corrupt", "--ops", "all_reduce",
                       "--sizes", "4,4K", "--iters", "3", "--large-iters", "2", "--warmup", "1",
                       "--rounds", "1", "--check"]))

from mcrdl.tools import bench  # noqa: E402

mcrdl.init_process_group(backends=["mpi", "gloo", "gloo_corrupt"])
assert mcrdl.available_backends()["gloo_corrupt"] == "live", mcrdl.available_backends()
b = bench.Bench(["mpi", "gloo_corrupt"], iters=3, large_iters=2, warmup=1, rounds=1, check=True)
try:
    results = b.sweep(["all_reduce", "p2p"], [4, 4096])
finally:
    b.close()
if mcrdl.get_rank() == 0:
    for r in results:
        print(f"CHECK {r.op} {r.bytes} {r.variant} {r.check}", flush=True)
mcrdl.destroy_process_group()
