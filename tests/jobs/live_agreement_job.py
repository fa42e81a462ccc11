"""A backend that starts on some ranks only (as mpi_staged where only some
hosts have a GPU) and whose groups are MPI collectives: it is left out on every
rank, instead of hanging or crossing the first new_group. With ``fail``: its
start raises on rank 1, and every rank's init_process_group fails at once."""
import sys
import warnings

import torch

import mcrdl
from common import check
from mcrdl.backends.mpi import MPIBackend


@mcrdl.register_backend
class MPIOnRankZero(MPIBackend):
    name = "mpi_rank0"

    @classmethod
    def unavailable_reason(cls, ctx):
        return None if ctx.rank == 0 else "no accelerator on this rank"


class RaisesOnRankOne(MPIBackend):
    name = "mpi_raises"

    def __init__(self, ctx):
        if ctx.rank == 1:
            raise OSError("device lost")
        super().__init__(ctx)


if sys.argv[1:] == ["fail"]:
    mcrdl.register_backend(RaisesOnRankOne)
    try:
        mcrdl.init_process_group(timeout=30)
        print(f"rank {mcrdl.get_rank()}: init did not fail")
    except Exception as exc:
        print(f"init failed: {type(exc).__name__}: {exc}")
    sys.exit(0)

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    mcrdl.init_process_group(timeout=30)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
why = mcrdl.available_backends()["mpi_rank0"]
if rank == 0:
    check(why == f"not live on every rank (not on ranks {list(range(1, world))})", why)
    check(any("'mpi_rank0' is left out" in str(w.message) for w in caught), [str(w.message) for w in caught])
else:
    check(why == "no accelerator on this rank", why)
check("mpi_rank0" not in mcrdl.live_backends("cpu"), mcrdl.live_backends("cpu"))
sub = mcrdl.new_group(list(range(world)))
t = torch.full((8,), float(rank + 1))
mcrdl.all_reduce(t, group=sub, backend="mpi")
check(torch.equal(t, torch.full((8,), float(sum(range(1, world + 1))))), t)
mcrdl.destroy_process_group()
print(f"rank {rank}: backends agreed")
