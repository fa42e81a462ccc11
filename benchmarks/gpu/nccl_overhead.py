"""What mcrdl adds to an NCCL op: mcrdl.all_reduce(backend="nccl") against
the same call made directly on the NCCL process group mcrdl holds, one rank
per GPU, interleaved rounds.

    mcrdl run -n 1 python3 benchmarks/gpu/nccl_overhead.py [NBYTES...]

Per size and round, each variant runs N calls back to back and a stream
synchronize; the figure is elapsed / N (µs per op, host submission and GPU
run together: at 1 rank an NCCL all_reduce is a local copy, so the host cost
shows). Styles: sync (``wait()`` on each op) and async (20 works on as
many tensors started, then waited for, as DDP's buckets are). The report is the median over rounds of
each variant and of the per-round ratio mcrdl / raw."""
import statistics
import sys
import time

import torch
import torch.distributed as dist

import mcrdl
from mcrdl import api

NBYTES = [int(a) for a in sys.argv[1:]] or [4, 4096, 1 << 20]
N, ROUNDS = 2000, 7
mcrdl.init_process_group(timeout=120)
dev = torch.device("cuda", mcrdl.get_local_rank() % torch.cuda.device_count())
torch.cuda.set_device(dev)
pg = api.current_runtime().backends["nccl"].pgs[0]  # the world group's NCCL communicator
opts = dist.AllreduceOptions()
opts.reduceOp = dist.ReduceOp.SUM


def raw_sync(x):
    pg.allreduce([x], opts).wait()


def raw_async(xs):
    for w in [pg.allreduce([x], opts) for x in xs]:
        w.wait()


def mcrdl_sync(x):
    mcrdl.all_reduce(x, backend="nccl")


def mcrdl_async(xs):
    for w in [mcrdl.all_reduce(x, backend="nccl", async_op=True) for x in xs]:
        w.wait()


def per_op(call, x, calls: int, per_call: int) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call(x)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / (calls * per_call) * 1e6


BATCH = 20  # async works in flight at once
styles = {"sync": (raw_sync, mcrdl_sync, N, 1), "async": (raw_async, mcrdl_async, N // BATCH, BATCH)}
print(f"torch {torch.__version__}, nccl {torch.cuda.nccl.version()}, {torch.cuda.get_device_name(dev)}, "
      f"{mcrdl.get_world_size()} rank(s), {N} ops x {ROUNDS} rounds", flush=True)
for nbytes in NBYTES:
    x = torch.ones(max(1, nbytes // 4), device=dev)
    buckets = [x.clone() for _ in range(BATCH)]
    for style, (raw, ours, calls, per_call) in styles.items():
        arg = x if style == "sync" else buckets
        for call in (raw, ours):
            per_op(call, arg, max(1, calls // 10), per_call)  # warm-up
        times = {"raw": [], "mcrdl": []}
        for r in range(ROUNDS):
            order = [("raw", raw), ("mcrdl", ours)] if r % 2 == 0 else [("mcrdl", ours), ("raw", raw)]
            for name, call in order:
                times[name].append(per_op(call, arg, calls, per_call))
        ratio = statistics.median(m / r for m, r in zip(times["mcrdl"], times["raw"]))
        print(f"{nbytes:>9} B {style:>5}: raw {statistics.median(times['raw']):7.2f} µs  "
              f"mcrdl {statistics.median(times['mcrdl']):7.2f} µs  ratio {ratio:.2f}x", flush=True)
mcrdl.destroy_process_group()
