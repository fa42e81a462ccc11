"""MPI under launchers other than MPI's (torchrun here). Usage: launch_job.py MODE

restart    every rank starts MPI over torchrun's store and all-reduces on it. Rank 1
           fails in torchrun's first attempt before mcrdl starts and in the second
           after MPI ran, so torchrun (--max-restarts 2) starts every rank twice
           again; each attempt's ranks must get a fresh MPI world, whatever the
           last attempt left in torchrun's store.
singleton  rank 1 starts MPI itself first (mpi4py's import, as a singleton): MPI
           cannot be brought up over the store, so every rank runs on gloo, and
           rank 0 says why at init.
stale      the drop-in start (torch.distributed.init_process_group("mcrdl") on
           torch's store, which torchrun's agent keeps across restarts) with no
           MPI to line the ranks up: rank 1 dies in attempt 0 once groups exist;
           in attempt 1 it makes each group 1.5 s late, so rank 0 reads whatever
           attempt 0 left under the groups' keys first (torchrun --max-restarts 1).
bad-gloo   rank 1's gloo cannot start (GLOO_SOCKET_IFNAME names no interface) after
           MPI is up, while rank 0 waits for it: rank 1 must fail at once, not wait
           in MPI_Finalize for rank 0 (which waits for rank 1 until the timeout).
two-agents DIR   one rank under each of two torchrun agents (--nnodes 2), drop-in
           start: in the first start rank 1 dies while rank 0 sleeps in no op; rank 1's
           agent restarts it counting a restart, rank 0's (healthy) without, so their
           TORCHELASTIC_RESTART_COUNTs differ in the second start over the same store
           (DIR keeps which ranks started before)."""
import os
import sys
from datetime import timedelta

if sys.argv[1] == "singleton" and os.environ["RANK"] == "1":
    from mpi4py import MPI  # noqa: F401  (mpi4py.rc.initialize is on: MPI starts here)
if sys.argv[1] == "bad-gloo" and os.environ["RANK"] == "1":
    os.environ["GLOO_SOCKET_IFNAME"] = "nope0"
if sys.argv[1] == "stale":
    sys.modules["mpi4py"] = None  # MPI's group calls would line the ranks up

import torch  # noqa: E402

import mcrdl  # noqa: E402
from mcrdl.backends import OPS  # noqa: E402  (the libraries that have every op)
from common import check  # noqa: E402

mode = sys.argv[1]


def stale_keys_job(attempt: int) -> None:
    import signal
    import time

    import torch.distributed as dist

    import mcrdl.integrations.torch_backend  # noqa: F401  (registers "mcrdl")

    rank = int(os.environ["RANK"])
    late = attempt == 1 and rank == 1
    dist.init_process_group("mcrdl", timeout=timedelta(seconds=60))
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)
    check(bool(torch.all(t == 3.0)), "all_reduce on the world", t.tolist())
    for make in (lambda: dist.new_group([0, 1], backend="mcrdl"), lambda: mcrdl.new_group([0, 1])):
        if late:
            time.sleep(1.5)
        group = make()
        t = torch.full((8,), float(rank + 1))
        dist.all_reduce(t, group=group) if isinstance(group, dist.ProcessGroup) else mcrdl.all_reduce(t, group=group)
        check(bool(torch.all(t == 3.0)), "all_reduce on a new group", t.tolist())
    if attempt == 0:
        dist.barrier()
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)  # torchrun ends this rank when it restarts the job
    print(f"rank {rank}: OK stale keys attempt {attempt}", flush=True)
    dist.destroy_process_group()


def two_agents_job(marks: str) -> None:
    import signal
    import time

    import torch.distributed as dist

    import mcrdl.integrations.torch_backend  # noqa: F401  (registers "mcrdl")

    rank = int(os.environ["RANK"])
    open(os.path.join(marks, f"pid-{os.getpid()}"), "w").close()  # the test ends what is left
    mark = os.path.join(marks, f"started{rank}")
    first = not os.path.exists(mark)
    open(mark, "w").close()
    dist.init_process_group("mcrdl", timeout=timedelta(seconds=60))
    t = torch.full((8,), float(rank + 1))
    dist.all_reduce(t)
    check(bool(torch.all(t == 3.0)), "all_reduce on the world", t.tolist())
    if first:
        if rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(120)  # healthy: its agent ends it for the next round
    restarts = os.environ["TORCHELASTIC_RESTART_COUNT"]
    print(f"rank {rank}: OK two agents, restart count {restarts}", flush=True)
    dist.destroy_process_group()


attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if mode == "restart" and attempt == 0 and os.environ["RANK"] == "1":
    print("rank 1: attempt 0 fails on purpose before init", flush=True)
    sys.exit(3)
if mode == "stale":
    stale_keys_job(attempt)
    sys.exit(0)
if mode == "two-agents":
    two_agents_job(sys.argv[2])
    sys.exit(0)
mcrdl.init_process_group(timeout=60)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
live = mcrdl.live_backends(ops=OPS)
expected = float(world * (world + 1) // 2)
if mode == "restart":
    from mpi4py import MPI

    check("mpi" in live, "MPI not live:", mcrdl.available_backends())
    check(MPI.COMM_WORLD.Get_rank() == rank and MPI.COMM_WORLD.Get_size() == world,
          "MPI's world differs from torch's", MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
    t = torch.full((1000,), float(rank + 1))
    mcrdl.all_reduce(t, backend="mpi")
    check(bool(torch.all(t == expected)), "all_reduce on mpi", t[:4].tolist())
    if attempt == 1 and rank == 1:
        print(f"rank {rank}: attempt {attempt} fails on purpose", flush=True)
        os._exit(3)
    mcrdl.barrier(backend="mpi")
    print(f"rank {rank}: OK restart attempt {attempt}, MPI world {MPI.COMM_WORLD.Get_size()}", flush=True)
elif mode == "singleton":
    check(live == ["gloo"], "live backends", live)
    t = torch.full((8,), float(rank + 1))
    mcrdl.all_reduce(t)
    check(bool(torch.all(t == expected)), "all_reduce on gloo", t.tolist())
    print(f"rank {rank}: OK singleton fallback; mpi: {mcrdl.available_backends()['mpi']}", flush=True)
mcrdl.destroy_process_group()
