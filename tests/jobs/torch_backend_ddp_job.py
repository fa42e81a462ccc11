"""DDP trained through the "mcrdl" torch backend vs the same DDP through plain gloo.

Usage: torch_backend_ddp_job.py DEFAULT_BACKEND [STEPS]
Both runs start from the same seed and data; losses and parameters must match
(and match a one-process reference on the whole batch). With MCRDL_OP_BACKENDS
set, the comms log must show each op on the mapped backend."""
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import mcrdl
import mcrdl.integrations.torch_backend as tb
from mcrdl.selector import parse_op_backends
import verdicts
from common import check

backend = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 6
tb.init_process_group(mcrdl_options={"default_backend": backend, "timeout": 120, "comms_log": True})
rank, world = dist.get_rank(), dist.get_world_size()
gloo = dist.new_group(backend="gloo")  # plain torch gloo over the same ranks
mcrdl_pg = dist.group.WORLD
check(dist.get_backend(mcrdl_pg) == "mcrdl" and dist.get_backend(gloo) == "gloo", "backends")
BATCH = 8


def make_model(seed, batchnorm):
    torch.manual_seed(seed)
    layers = [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)]
    if batchnorm:
        layers.insert(1, nn.BatchNorm1d(64))
    return nn.Sequential(*layers).double()


TRUE_W = torch.randn(16, 4, generator=torch.Generator().manual_seed(12345), dtype=torch.float64)


def batch(step, r):
    """Rank r's batch at ``step``: a learnable target, different data per rank and step."""
    g = torch.Generator().manual_seed(1000 * step + r)
    x = torch.randn(BATCH, 16, generator=g, dtype=torch.float64)
    return x, torch.tanh(x @ TRUE_W)


EVAL = batch(999, 999)  # a fixed batch no rank trains on


def eval_loss(model):
    with torch.no_grad():
        return nn.functional.mse_loss(model(EVAL[0]), EVAL[1]).item()


def train(pg, batchnorm=False, hook=None, **ddp_kwargs):
    # different initial weights per rank: DDP must broadcast rank 0's
    model = make_model(seed=rank, batchnorm=batchnorm)
    ddp = DDP(model, process_group=pg, bucket_cap_mb=0.01, **ddp_kwargs)  # several buckets
    if hook is not None:
        ddp.register_comm_hook(pg, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    losses = []
    model.eval()
    first = eval_loss(model)
    model.train()
    start = time.perf_counter()
    for step in range(steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    elapsed = time.perf_counter() - start
    model.eval()
    losses.append(first - eval_loss(model))  # improvement on the held-out batch
    return losses, [p.detach().clone() for p in model.state_dict().values()], elapsed


def reference():
    """One process, whole batch: DDP's averaged gradient is this one's."""
    model = make_model(seed=0, batchnorm=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    first = eval_loss(model)
    for step in range(steps):
        xs, ys = zip(*(batch(step, r) for r in range(world)))
        opt.zero_grad()
        per_rank = [nn.functional.mse_loss(model(x), y) for x, y in zip(xs, ys)]
        sum(per_rank).div(world).backward()
        opt.step()
        losses.append(per_rank[rank].item())  # what rank `rank` saw
    losses.append(first - eval_loss(model))
    return losses, [p.detach().clone() for p in model.state_dict().values()]


def compare(a, b, what, tol):
    (la, pa), (lb, pb) = a[:2], b[:2]
    dl = max(abs(x - y) for x, y in zip(la, lb))
    dp = max((x - y).abs().max().item() for x, y in zip(pa, pb))
    check(len(la) == len(lb) == steps + 1 and len(pa) == len(pb), what, "lengths")
    check(dl <= tol and dp <= tol, what, f"differ: loss {dl:.3g}, params {dp:.3g} (tol {tol})")
    return dl, dp


before = len(mcrdl.comms_records())
via_mcrdl = train(mcrdl_pg)
records = mcrdl.comms_records()[before:]
via_gloo = train(gloo)
check(len(mcrdl.comms_records()) == before + len(records), "gloo run went around mcrdl")
dl, dp = compare(via_mcrdl, via_gloo, "mcrdl vs gloo", 1e-12)
compare(via_mcrdl, reference(), "mcrdl vs one-process reference", 1e-9)
check(via_mcrdl[0][-1] > 0, "held-out loss went down by", via_mcrdl[0][-1])
print(f"rank {rank}: plain DDP: {steps} steps, max |loss diff| {dl:.2g}, max |param diff| {dp:.2g}; "
      f"{1e3 * via_mcrdl[2] / steps:.2f} ms/step via mcrdl, {1e3 * via_gloo[2] / steps:.2f} via gloo")

# every gradient all-reduce and the initial parameter broadcast went through the selector
static = parse_op_backends(os.environ.get("MCRDL_OP_BACKENDS", ""))
ops = {}
for r in records:
    ops.setdefault(r.op, set()).add(r.backend)
check("all_reduce" in ops and "broadcast" in ops, "ops recorded for DDP", ops)
for op, backends in ops.items():
    want = static.get(op, backend)
    check(backends == {want}, f"{op} ran on {backends}, expected {want}")
n_allreduce = sum(r.op == "all_reduce" for r in records)
check(n_allreduce > steps, "several buckets per step", n_allreduce)
print(f"rank {rank}: DDP ops via mcrdl ({n_allreduce} all_reduce): "
      + ", ".join(f"{op} on {'/'.join(sorted(b))}" for op, b in sorted(ops.items())))

# buffers broadcast every step (BatchNorm), gradient views, a Python comm hook (futures)
compare(train(mcrdl_pg, batchnorm=True), train(gloo, batchnorm=True), "batchnorm", 1e-12)
compare(train(mcrdl_pg, gradient_as_bucket_view=True), via_gloo, "gradient_as_bucket_view", 1e-12)
compare(train(mcrdl_pg, hook=default_hooks.allreduce_hook),
        train(gloo, hook=default_hooks.allreduce_hook), "allreduce_hook", 1e-12)
verdicts.finished("torch backend ddp")
print(f"rank {rank}: TORCH BACKEND DDP OK (backend {backend})")
dist.destroy_process_group()
