"""The "mcrdl" torch backend: rank agreement, torch sub-groups mapped to mcrdl groups,
and the errors for what cannot work (run on 2 or 4 ranks)."""
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import mcrdl
from mcrdl.backends import OPS  # the libraries that have every op
import mcrdl.integrations.torch_backend as tb
import verdicts
from common import check

warnings.simplefilter("ignore", FutureWarning)
mcrdl.init_process_group(timeout=60)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
check(tb.register() == "mcrdl" and tb.register() == "mcrdl" and tb.is_registered(), "register")


def refused(fn, *needles):
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        msg = str(exc)
        check(all(n in msg for n in needles), "error message", repr(msg), "lacks", needles)
        return
    raise AssertionError(f"expected an error mentioning {needles}")


# 1. torch's rank/world_size must be mcrdl's: a swapped numbering is refused on every rank
bad = tb.init_kwargs()
bad["rank"] = world - 1 - rank
bad["store"] = dist.PrefixStore("swapped/", bad["store"])
if world - 1 - rank != rank:
    refused(lambda: dist.init_process_group("mcrdl", **bad), "torch.distributed says this process is rank",
            f"mcrdl (already initialised) says rank {rank}")
    check(not dist.is_initialized(), "torch default group left unset after the refusal")

# 2. the real default group
dist.init_process_group("mcrdl", **tb.init_kwargs())
check(dist.get_rank() == rank and dist.get_world_size() == world, "default group ranks")
check(dist.group.WORLD.mcrdl_group is mcrdl.api.current_runtime().world, "default group is mcrdl's world")
live = mcrdl.live_backends(ops=OPS)


def all_reduce_everywhere(group, ranks):
    """torch's all_reduce on ``group``, and mcrdl's on its group forced to every live backend."""
    t = torch.full((3,), float(rank + 1))
    dist.all_reduce(t, group=group)
    check(t.tolist() == [float(sum(r + 1 for r in ranks))] * 3, "all_reduce on", ranks, t)
    for b in live:
        t = torch.full((3,), float(rank + 1))
        mcrdl.all_reduce(t, group=group.mcrdl_group, backend=b)
        check(t.tolist() == [float(sum(r + 1 for r in ranks))] * 3, "all_reduce on", ranks, b, t)


# 3. torch groups are built by their members alone (torch calls the backend only there),
#    with every live library: singletons, the whole world, overlapping pairs
singles = [dist.new_group([r], backend="mcrdl") for r in range(world)]
all_reduce_everywhere(singles[rank], [rank])
check(all(g is dist.GroupMember.NON_GROUP_MEMBER for r, g in enumerate(singles) if r != rank),
      "non-members get torch's placeholder")
everyone = dist.new_group(backend="mcrdl")
all_reduce_everywhere(everyone, list(range(world)))
pairs = [[r, (r + 1) % world] for r in range(world)] if world > 2 else [[0, 1]]
pair_groups = [dist.new_group(sorted(p)) for p in pairs]  # default backend: mcrdl
for p, g in zip(pairs, pair_groups):
    if rank in p:
        all_reduce_everywhere(g, sorted(p))
check(dist.new_group([world - 1], backend="mcrdl") is not None, "more groups keep working")

# 4. sub-groups: ranks, roots and peers map between torch's group ranks and mcrdl's
odd = list(range(1, world, 2))
even = list(range(0, world, 2))
t_odd = dist.new_group(odd, backend="mcrdl")
t_even = dist.new_group(even, backend="mcrdl")
mine, my_ranks = (t_odd, odd) if rank in odd else (t_even, even)
check(list(mine.mcrdl_group.ranks) == my_ranks, "sub-group maps to an mcrdl group of its ranks")
check(dist.get_world_size(mine) == len(my_ranks) and dist.get_rank(mine) == my_ranks.index(rank),
      "sub-group rank/size")
t = torch.full((2,), float(rank + 1))
dist.all_reduce(t, group=mine)
check(t.tolist() == [float(sum(r + 1 for r in my_ranks))] * 2, "sub-group all_reduce", t)
root = my_ranks[-1]  # global rank; torch passes its group rank, the backend maps it back
t = torch.full((2,), float(rank))
dist.broadcast(t, root, group=mine)
check(t.tolist() == [float(root)] * 2, "sub-group broadcast from global", root, t)
out = [torch.empty(1) for _ in my_ranks] if rank == root else None
dist.gather(torch.tensor([float(rank)]), out, dst=root, group=mine)
if rank == root:
    check([o.item() for o in out] == [float(r) for r in my_ranks], "sub-group gather", out)
if len(my_ranks) > 1:
    a, b = my_ranks[0], my_ranks[1]
    if rank == a:
        dist.send(torch.tensor([7.0 + a]), b, group=mine)
    elif rank == b:
        got = torch.empty(1)
        dist.recv(got, a, group=mine)
        check(got.item() == 7.0 + a, "sub-group send/recv", got)
dist.barrier()

# 5. mcrdl.new_group follows torch's rule: every rank calls, only members build
m_even = mcrdl.new_group(even)
check(m_even.rank == (even.index(rank) if rank in even else -1), "mcrdl group rank", m_even.rank)
t = torch.ones(1)
res = mcrdl.all_reduce(t, group=m_even)
check(res is None and t.item() == (len(even) if rank in even else 1.0), "mcrdl sub-group", t)

refused(lambda: dist.all_reduce(torch.ones(1), op=dist.ReduceOp.BXOR), "ReduceOp.BXOR", "not supported")

# 6. groups created in a different order on different ranks: every rank gets an error
#    naming the group and the two views, at once (no hang, no crossed group)
if world > 2:
    first = [0, 1] if rank == 0 else list(range(world))
    refused(lambda: dist.new_group(first, backend="mcrdl"), "created in a different order",
            "rank 0 created it as ranks [0, 1]" if rank else f"rank 1 created it as ranks {list(range(world))}")
else:  # rank 0 makes [0] then [0, 1]; rank 1 [0, 1] then [0]
    quick = timedelta(seconds=2)
    if rank == 0:
        dist.new_group([0], backend="mcrdl", timeout=quick)
        refused(lambda: dist.new_group([0, 1], backend="mcrdl", timeout=quick),
                "ranks [1] did not create it within 2 s", "same order")
    else:
        refused(lambda: dist.new_group([0, 1], backend="mcrdl", timeout=quick),
                "created in a different order", "rank 0 created it as ranks [0]")
        dist.new_group([0], backend="mcrdl", timeout=quick)
dist.barrier()
verdicts.finished("torch backend groups")
print(f"rank {rank}: TORCH BACKEND GROUPS OK")
dist.destroy_process_group()
