"""Argument errors on 2 ranks: each refused call is made on ONE rank only, and
raises there at once; then both ranks run a valid collective on every live
backend and check its result (if the refused call had sent anything, the
peer, which never made that call, would see a mismatched message or hang).

Usage: errors_job.py CASE   (CASE: local | batch)
"""
import sys

import torch

import mcrdl
from mcrdl.backends import OPS  # the libraries that have every op
import verdicts
from common import check

case = sys.argv[1]
mcrdl.init_process_group(timeout=30)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
check(world == 2, "errors_job needs 2 ranks, got", world)
peer = 1 - rank
live = mcrdl.live_backends("cpu", ops=OPS)
rounds = 0


def confirm():
    """A valid all_reduce on every live backend, checked on both ranks."""
    global rounds
    rounds += 1
    for backend in live:
        t = torch.full((4,), float(rank + 1 + rounds))
        mcrdl.all_reduce(t, backend=backend)
        expect = float(1 + rounds + 2 + rounds)
        check(torch.equal(t, torch.full((4,), expect)), f"confirm #{rounds} on {backend}: got {t}")


def refused(who, exc, words, fn):
    """On rank ``who`` only: ``fn()`` raises ``exc`` naming every word; then confirm()."""
    if rank == who:
        try:
            fn()
        except exc as e:
            msg = str(e)
            missing = [w for w in words if w not in msg]
            check(not missing, f"rank {rank}: message {msg!r} does not name {missing}")
            print(f"rank {rank}: refused {type(e).__name__}: {msg}")
        else:
            raise AssertionError(f"rank {rank}: expected {exc.__name__} naming {words}")
    confirm()


def local():
    f = lambda n=4: torch.ones(n)
    # gather_list / scatter_list given on a rank that is not the root
    refused(1, ValueError, ["gather", "gather_list", "non-destination"],
            lambda: mcrdl.gather(f(), [f(), f()], dst=0))
    refused(0, ValueError, ["scatter", "scatter_list", "non-source"],
            lambda: mcrdl.scatter(f(), [f(), f()], src=1))
    # the root's list is still checked on the root
    refused(0, ValueError, ["gather", "gather_list", "2 tensors"],
            lambda: mcrdl.gather(f(), [f()], dst=0))
    refused(1, ValueError, ["scatter", "scatter_list", "2 tensors"],
            lambda: mcrdl.scatter(f(), None, src=1))
    # a root that is not a member of the (sub)group: members refuse, the
    # non-member gets None without communicating
    g0 = mcrdl.new_group([0])
    for op, call in (("reduce", lambda: mcrdl.reduce(f(), dst=1, group=g0)),
                     ("broadcast", lambda: mcrdl.broadcast(f(), src=1, group=g0)),
                     ("gather", lambda: mcrdl.gather(f(), [f()], dst=1, group=g0)),
                     ("scatter", lambda: mcrdl.scatter(f(), [f()], src=1, group=g0))):
        what = "dst" if op in ("reduce", "gather") else "src"
        if rank == 1:
            check(call() is None, f"{op} on a group this rank is not in returned work")
        refused(0, ValueError, [op, what, "rank 1", "not in group"], call)
    # point to point: self, outside the world, negative tag (each rank alone)
    refused(0, ValueError, ["send", "dst=0", "itself"], lambda: mcrdl.send(f(), 0))
    refused(1, ValueError, ["irecv", "src=1", "itself"], lambda: mcrdl.irecv(f(), 1))
    refused(0, ValueError, ["isend", "dst", "rank 2", "not in group"], lambda: mcrdl.isend(f(), 2))
    refused(1, ValueError, ["send", "tag", "-1"], lambda: mcrdl.send(f(), peer, tag=-1))
    refused(0, ValueError, ["irecv", "tag", "-3"], lambda: mcrdl.irecv(f(), peer, tag=-3))
    refused(1, ValueError, ["send", "dst", "required"], lambda: mcrdl.send(f(), None))
    # sizes that depend on the group size
    refused(1, ValueError, ["all_gather_into_tensor", "output_tensor", "4 x 2 ranks = 8"],
            lambda: mcrdl.all_gather_into_tensor(torch.empty(4), f()))
    refused(0, ValueError, ["reduce_scatter_tensor", "input", "4 x 2 ranks = 8"],
            lambda: mcrdl.reduce_scatter_tensor(torch.empty(4), f(4)))
    refused(1, ValueError, ["all_gather", "tensor_list", "2 tensors"],
            lambda: mcrdl.all_gather([f()], f()))
    mcrdl.all_gather([f(), f()], f(), async_op=True).wait()  # (its plan: a later bad list is still named)
    refused(1, ValueError, ["all_gather", "tensor_list", "2 tensors", "got Tensor"],
            lambda: mcrdl.all_gather(torch.ones(2, 4), f(), async_op=True))
    refused(0, ValueError, ["reduce_scatter", "input_list", "2 tensors"],
            lambda: mcrdl.reduce_scatter(f(), [f(), f(), f()]))
    refused(1, ValueError, ["all_to_all_single", "input", "3 rows", "group size 2"],
            lambda: mcrdl.all_to_all_single(torch.empty(4), f(3)))
    refused(0, ValueError, ["all_to_all_single", "output", "5 rows", "group size 2"],
            lambda: mcrdl.all_to_all_single(torch.empty(5), f(4)))
    refused(0, ValueError, ["all_to_all_single", "without split sizes", "same rows", "4 and 6"],
            lambda: mcrdl.all_to_all_single(torch.empty(6), f(4)))
    refused(1, ValueError, ["all_to_all_single", "input_split_sizes", "2 non-negative"],
            lambda: mcrdl.all_to_all_single(torch.empty(4), f(4), [2, 2], [4]))
    refused(0, ValueError, ["all_to_all_single", "output_split_sizes", "sum to 3"],
            lambda: mcrdl.all_to_all_single(torch.empty(4), f(4), [1, 2], [2, 2]))
    refused(1, ValueError, ["all_to_all", "input_tensor_list", "2 tensors"],
            lambda: mcrdl.all_to_all([f(), f()], [f()]))
    # backend and device problems, refused on one rank only
    refused(0, mcrdl.UnsupportedError, ["all_reduce", "'foo'"],
            lambda: mcrdl.all_reduce(f(), backend="foo"))
    refused(1, TypeError, ["all_reduce", "backend must be a backend name", "['mpi']"],
            lambda: mcrdl.all_reduce(f(), backend=["mpi"]))
    refused(0, TypeError, ["broadcast", "src", "int"],
            lambda: mcrdl.broadcast(f(), src=[0]))
    refused(1, mcrdl.UnsupportedError, ["broadcast", "meta"],
            lambda: mcrdl.broadcast(torch.empty(4, device="meta"), src=0))
    refused(0, mcrdl.UnsupportedError, ["all_reduce", "torch.int32", "AVG"],
            lambda: mcrdl.all_reduce(torch.ones(4, dtype=torch.int32), op=mcrdl.ReduceOp.AVG))
    refused(1, mcrdl.UnsupportedError, ["all_gather_into_tensor", "complex64"],
            lambda: mcrdl.all_gather_into_tensor(torch.empty(8, dtype=torch.complex64),
                                                 torch.ones(4, dtype=torch.complex64)))
    mcrdl.barrier()


def batch():
    """batch_isend_irecv with a valid isend followed by a bad item: the whole
    call must be refused before the isend is posted. Rank 1 then receives one
    message with the same tag: a leaked isend would arrive first."""
    for backend in live:
        tag = 9
        if rank == 0:
            try:
                mcrdl.batch_isend_irecv([mcrdl.P2POp(mcrdl.isend, torch.full((4,), 1.0), 1, None, tag, backend),
                                         "not a P2POp"])
            except TypeError as e:
                check("item 1" in str(e), "message does not name item 1:", e)
            else:
                raise AssertionError("batch_isend_irecv accepted a non-P2POp item")
            mcrdl.send(torch.full((4,), 2.0), 1, tag=tag, backend=backend)
        else:
            got = torch.empty(4)
            mcrdl.recv(got, 0, tag=tag, backend=backend)
            leaked = bool((got == 1.0).all())
            if leaked:
                mcrdl.recv(torch.empty(4), 0, tag=tag, backend=backend)  # drain the real one
            else:
                check(torch.equal(got, torch.full((4,), 2.0)), "unexpected data", got)
            print(f"rank 1: batch {backend} leaked={leaked}")
        confirm()
    mcrdl.barrier()


{"local": local, "batch": batch}[case]()
mcrdl.destroy_process_group()
verdicts.finished(f"errors {case}")
print(f"rank {rank}: errors {case} OK after {rounds} confirmations")
