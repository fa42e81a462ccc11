"""Which of torch's gloo ops take CUDA tensors, and how long they take (#17:
mcrdl's gloo backend is CPU-only until this says which ops it may take).

Run on a GPU machine: ``torchrun --nproc-per-node 2 benchmarks/gpu/gloo_cuda_ops.py``
(ranks may share one GPU). Each op runs on float32 CUDA tensors at each size,
is checked against the expected values, and is timed (median of ``ITERS``
calls, each waited and followed by a device synchronize); an op gloo refuses
prints its error.
"""
import os
import statistics
import time

import torch
import torch.distributed as dist

SIZES = (4, 64 << 10, 1 << 20, 16 << 20, 64 << 20)
ITERS = 10

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
torch.cuda.set_device(dev)


def full(n, v):
    return torch.full((n,), float(v), device=dev)


def case(op, n):
    """(run, check) for ``op`` on ``n`` floats per rank."""
    peer = (rank + 1) % world
    if op == "all_reduce":
        t = full(n, rank + 1)
        return lambda: dist.all_reduce(t.fill_(rank + 1)), lambda: t.eq(world * (world + 1) / 2).all()
    if op == "broadcast":
        t = full(n, rank)
        return lambda: dist.broadcast(t.fill_(rank), 0), lambda: t.eq(0).all()
    if op == "reduce":
        t = full(n, rank + 1)
        return lambda: dist.reduce(t.fill_(rank + 1), 0), lambda: rank or t.eq(world * (world + 1) / 2).all()
    if op == "all_gather_into_tensor":
        out, inp = torch.empty(world * n, device=dev), full(n, rank)
        return (lambda: dist.all_gather_into_tensor(out, inp),
                lambda: out.view(world, n).eq(torch.arange(world, device=dev)[:, None]).all())
    if op == "all_gather":
        outs, inp = [torch.empty(n, device=dev) for _ in range(world)], full(n, rank)
        return lambda: dist.all_gather(outs, inp), lambda: all(o.eq(r).all() for r, o in enumerate(outs))
    if op == "reduce_scatter_tensor":
        out, inp = torch.empty(n, device=dev), full(world * n, 1)
        return lambda: dist.reduce_scatter_tensor(out, inp), lambda: out.eq(world).all()
    if op == "all_to_all_single":
        out, inp = torch.empty(world * n, device=dev), full(world * n, rank)
        return (lambda: dist.all_to_all_single(out, inp),
                lambda: out.view(world, n).eq(torch.arange(world, device=dev)[:, None]).all())
    if op == "gather":
        outs, inp = [torch.empty(n, device=dev) for _ in range(world)], full(n, rank)
        return (lambda: dist.gather(inp, outs if rank == 0 else None, 0),
                lambda: rank or all(o.eq(r).all() for r, o in enumerate(outs)))
    if op == "scatter":
        out, ins = torch.empty(n, device=dev), [full(n, r) for r in range(world)]
        return lambda: dist.scatter(out, ins if rank == 0 else None, 0), lambda: out.eq(rank).all()
    if op == "send/recv":
        t, r = full(n, rank), torch.empty(n, device=dev)

        def run():
            if rank % 2 == 0:
                dist.send(t, peer), dist.recv(r, (rank - 1) % world)
            else:
                dist.recv(r, (rank - 1) % world), dist.send(t, peer)
        return run, lambda: r.eq((rank - 1) % world).all()
    raise ValueError(op)


OPS = ("all_reduce", "broadcast", "reduce", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
       "all_to_all_single", "gather", "scatter", "send/recv")
if rank == 0:
    print(f"torch {torch.__version__}, {world} ranks on {torch.cuda.get_device_name(dev)}; "
          f"float32 CUDA tensors; median of {ITERS} calls (µs)")
    print("op".ljust(24) + "".join(f"{s:>12}" for s in SIZES))
for op in OPS:
    row, error = [], None
    for nbytes in SIZES:
        try:
            run, ok = case(op, max(1, nbytes // 4))
            run()
            torch.cuda.synchronize()
            good = bool(ok())
            times = []
            for _ in range(ITERS):
                start = time.perf_counter()
                run()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            row.append(f"{statistics.median(times) * 1e6:.0f}" + ("" if good else " WRONG"))
        except Exception as e:  # gloo refuses the op on CUDA tensors: say why
            error = str(e).strip().splitlines()[0][:150]
            break
        dist.barrier()
    if rank == 0:
        print(op.ljust(24) + ("".join(f"{c:>12}" for c in row) if error is None else f"refused: {error}"))
dist.destroy_process_group()
