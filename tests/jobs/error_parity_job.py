"""Every op x style (blocking, async; list forms; split sizes) called right after a
valid call like it (so the compiled build has its plan) with bad input: the
exception each raises, written to ``<dir>/rank<r>.json``, which tests/test_errors.py compares between the compiled and the pure-Python build
(MCRDL_NATIVE=0). Errors are local: every rank raises before anything is sent."""
import json
import os
import sys

import torch

import mcrdl
import verdicts

mcrdl.init_process_group(timeout=60)
rank, n = mcrdl.get_rank(), mcrdl.get_world_size()
f = lambda k=4, dtype=torch.float32: torch.ones(k, dtype=dtype)  # noqa: E731
BAD_ROOT = n + 3


def cases():
    """(name, valid call, bad call): each a function of async_op."""
    yield "all_reduce: a non-tensor", lambda a: mcrdl.all_reduce(f(), async_op=a), \
        lambda a: mcrdl.all_reduce(3, async_op=a)
    yield "all_reduce: integer AVG", lambda a: mcrdl.all_reduce(f(dtype=torch.int32), async_op=a), \
        lambda a: mcrdl.all_reduce(f(dtype=torch.int32), mcrdl.ReduceOp.AVG, async_op=a)
    yield "broadcast: a root outside the world", lambda a: mcrdl.broadcast(f(), 0, async_op=a), \
        lambda a: mcrdl.broadcast(f(), BAD_ROOT, async_op=a)
    yield "reduce: a root outside the world", lambda a: mcrdl.reduce(f(), 0, async_op=a), \
        lambda a: mcrdl.reduce(f(), BAD_ROOT, async_op=a)
    yield "all_gather_into_tensor: an output of the wrong size", \
        lambda a: mcrdl.all_gather_into_tensor(f(4 * n), f(), async_op=a), \
        lambda a: mcrdl.all_gather_into_tensor(f(4 * n + 1), f(), async_op=a)
    yield "all_gather_into_tensor: dtypes that differ", \
        lambda a: mcrdl.all_gather_into_tensor(f(4 * n), f(), async_op=a), \
        lambda a: mcrdl.all_gather_into_tensor(f(4 * n, torch.float64), f(), async_op=a)
    yield "all_gather: a list of the wrong length", \
        lambda a: mcrdl.all_gather(list(f(4 * n).chunk(n)), f(), async_op=a), \
        lambda a: mcrdl.all_gather(list(f(4 * (n + 1)).chunk(n + 1)), f(), async_op=a)
    yield "reduce_scatter_tensor: an input of the wrong size", \
        lambda a: mcrdl.reduce_scatter_tensor(f(), f(4 * n), async_op=a), \
        lambda a: mcrdl.reduce_scatter_tensor(f(), f(4 * n - 1), async_op=a)
    yield "reduce_scatter: blocks of another dtype", \
        lambda a: mcrdl.reduce_scatter(f(), list(f(4 * n).chunk(n)), async_op=a), \
        lambda a: mcrdl.reduce_scatter(f(), list(f(4 * n, torch.float64).chunk(n)), async_op=a)
    yield "gather: a list on a rank that is not the root", \
        lambda a: mcrdl.gather(f(), list(f(4 * n).chunk(n)) if rank == 0 else None, 0, async_op=a), \
        lambda a: mcrdl.gather(f(), list(f(4 * n).chunk(n)), n - 1 if rank != n - 1 else 0, async_op=a)
    yield "scatter: a root outside the world", \
        lambda a: mcrdl.scatter(f(), list(f(4 * n).chunk(n)) if rank == 0 else None, 0, async_op=a), \
        lambda a: mcrdl.scatter(f(), list(f(4 * n).chunk(n)), BAD_ROOT, async_op=a)
    yield "all_to_all_single: split sizes that do not sum to the rows", \
        lambda a: mcrdl.all_to_all_single(f(2 * n), f(2 * n), [2] * n, [2] * n, async_op=a), \
        lambda a: mcrdl.all_to_all_single(f(2 * n), f(2 * n), [2] * n, [3] * n, async_op=a)
    yield "all_to_all_single: too few split sizes", \
        lambda a: mcrdl.all_to_all_single(f(2 * n), f(2 * n), [2] * n, [2] * n, async_op=a), \
        lambda a: mcrdl.all_to_all_single(f(2 * n), f(2 * n), [2] * n, [2 * n], async_op=a)
    yield "all_to_all_single: rows that do not split evenly", \
        lambda a: mcrdl.all_to_all_single(f(2 * n), f(2 * n), async_op=a), \
        lambda a: mcrdl.all_to_all_single(f(2 * n), f(2 * n + 1), async_op=a)
    yield "send: a peer outside the world", \
        lambda a: None, lambda a: (mcrdl.isend if a else mcrdl.send)(f(), BAD_ROOT)
    yield "recv: a tag that is no int", \
        lambda a: None, lambda a: (mcrdl.irecv if a else mcrdl.recv)(f(), 0, tag="7")


def finish(work):
    if work is not None:
        work.wait()


raised = []
for name, valid, bad in cases():
    for async_op in (False, True):
        finish(valid(async_op))
        try:
            finish(bad(async_op))
            raised.append([name, async_op, None, None])
        except Exception as exc:  # noqa: BLE001  (what the build raises is the point)
            raised.append([name, async_op, type(exc).__name__, str(exc)])
        mcrdl.barrier()
verdicts.check("every bad call raised", all(r[2] for r in raised), "an exception each",
               [r[:2] for r in raised if not r[2]])
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as out:
    json.dump(raised, out)
mcrdl.destroy_process_group()
verdicts.finished("error parity")
