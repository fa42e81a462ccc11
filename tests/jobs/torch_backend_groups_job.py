"""The "mcrdl" torch backend: rank agreement, torch sub-groups mapped to mcrdl groups,
and the errors for what cannot work (run on 2 or 4 ranks)."""
import warnings

import torch
import torch.distributed as dist

import mcrdl
import mcrdl.integrations.torch_backend as tb
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
            f"mcrdl (started from an earlier mcrdl.init_process_group()) says rank {rank}")
    check(not dist.is_initialized(), "torch default group left unset after the refusal")

# 2. the real default group
dist.init_process_group("mcrdl", **tb.init_kwargs())
check(dist.get_rank() == rank and dist.get_world_size() == world, "default group ranks")
check(dist.group.WORLD.mcrdl_group is mcrdl.api._rt().world, "default group is mcrdl's world")

# 3. a torch group of all ranks maps to mcrdl's world
everyone = dist.new_group(backend="mcrdl")
check(everyone.mcrdl_group is mcrdl.api._rt().world, "all-rank group is mcrdl's world")
t = torch.full((3,), float(rank))
dist.all_reduce(t, group=everyone)
check(t.tolist() == [float(sum(range(world)))] * 3, "all-rank group all_reduce", t)

# 4. a torch sub-group with no mcrdl group of its ranks: torch calls the backend on its
#    members only, so mcrdl cannot create one there; refused with the remedy
lonely = [world - 1]
if rank == world - 1:
    refused(lambda: dist.new_group(lonely, backend="mcrdl"), f"no mcrdl group with ranks {lonely}",
            f"mcrdl.new_group({lonely})")
else:
    check(dist.new_group(lonely, backend="mcrdl") is dist.GroupMember.NON_GROUP_MEMBER, "non-member")

# 5. sub-groups: create the mcrdl group first (collective on every rank), then torch's
odd = list(range(1, world, 2))
even = list(range(0, world, 2))
m_odd, m_even = mcrdl.new_group(odd), mcrdl.new_group(even)
t_odd = dist.new_group(odd, backend="mcrdl")
t_even = dist.new_group(even, backend="mcrdl")
mine, my_ranks = (t_odd, odd) if rank in odd else (t_even, even)
check(mine.mcrdl_group is (m_odd if rank in odd else m_even), "sub-group maps to the mcrdl group")
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

refused(lambda: dist.all_reduce(torch.ones(1), op=dist.ReduceOp.BXOR), "ReduceOp.BXOR", "not supported")
print(f"rank {rank}: TORCH BACKEND GROUPS OK")
dist.destroy_process_group()
