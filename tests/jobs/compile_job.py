"""torch.compile over the "mcrdl" torch backend: functional collectives, DTensor, DDP.

Usage: compile_job.py [PARTS]   PARTS: comma list of funcol,dtensor,ddp,c10d_eager,ddp_outer
(default: all, in that order)

Every check is a verdict (tests/jobs/verdicts.py); every part prints
``TIME <part> rank=<r> <seconds>s``. A part that raises fails the check
``<part>_ran`` and the job goes on.
All compiles use the default backend (inductor) on CPU; "equal" means torch.equal
(bitwise, same shape and dtype), "close" allclose(rtol=1e-5, atol=1e-6).

* funcol: a small model whose forward calls torch.distributed._functional_collectives
  (all_reduce sum/max/avg, all_gather_single (was all_gather_tensor), reduce_scatter_single
  (was reduce_scatter_tensor), all_to_all_single even and uneven, broadcast) on the
  "mcrdl" group, compiled with fullgraph=True: no graph break (explain and counters),
  one inductor graph, the same mcrdl ops as eager, every output equal to eager's.
* dtensor: a DeviceMesh on "mcrdl"; DTensor redistributes (all_gather, all_reduce,
  reduce_scatter) and a column/row-parallel MLP (parallelize_module), forward and
  backward, compiled with fullgraph=True: equal to eager (eager close to unsharded).
* ddp: DDP(torch.compile(model)) with torch._dynamo.config.optimize_ddp at its default
  (DDPOptimizer splits the graph at DDP's buckets): losses and final parameters via
  "mcrdl" equal to the same run via plain gloo, close to eager DDP.
* c10d_eager: dist.broadcast inside a compiled function (a graph break: it runs eagerly
  between graphs) on "mcrdl": same graph breaks and result as on gloo.
* ddp_outer: torch.compile(DDP(model)): same graph breaks, losses, parameters as gloo.
The last two need torch's calls into ProcessGroupMCRDL to run outside dynamo (see
tests/test_compile.py).
"""
import time

T_START = time.perf_counter()

import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

os.environ.setdefault("MCRDL_COMMS_LOG", "1")  # mcrdl records every op: the compiled code must go through it

import torch
import torch._dynamo
import torch.distributed as dist
import torch.distributed._functional_collectives as fc
import torch.nn as nn
from torch._dynamo.utils import counters

import mcrdl
from verdicts import check, check_equal, max_diff

# torch 2.13 renamed these (the old names warn); same signatures
all_gather_single = getattr(fc, "all_gather_single", fc.all_gather_tensor)
reduce_scatter_single = getattr(fc, "reduce_scatter_single", fc.reduce_scatter_tensor)

dist.init_process_group("mcrdl")  # env:// rendezvous from `mcrdl run`
rank, world = dist.get_rank(), dist.get_world_size()
PG = dist.group.WORLD
assert dist.get_backend(PG) == "mcrdl" and world == 2, (dist.get_backend(PG), world)
print(f"TIME import_and_init rank={rank} {time.perf_counter() - T_START:.2f}s", flush=True)


def say(line):
    print(line, flush=True)


def fail(name, exc):
    text = " | ".join(str(exc).strip().splitlines()[:3])
    check(name, False, "no exception", f"{type(exc).__name__}: {text}")
    traceback.print_exc()


def mcrdl_ops():
    return [r.op for r in mcrdl.comms_records()]


def graph_breaks():
    return sum(counters["graph_break"].values())


def fresh():
    torch._dynamo.reset()
    counters.clear()


def inductor_graphs():
    """Graphs inductor produced since fresh(): {"fxgraph_cache_hit": n, "fxgraph_cache_miss": m, ...}."""
    return {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")}


# -- 1: functional collectives -----------------------------------------------------------------
class FunColModel(nn.Module):
    """Tensor-parallel by hand: every functional collective on the "mcrdl" group."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x):
        h = torch.relu(self.inp(x))                                   # [4, 16]
        s = fc.all_reduce(h, "sum", PG)
        g = all_gather_single(s * (rank + 1), 0, PG)               # [8, 16]
        rs = reduce_scatter_single(g - 1, "sum", 0, PG)            # [4, 16]
        a2a = fc.all_to_all_single(rs * 0.5, None, None, PG)          # even splits
        splits = [1, 3] if rank == 0 else [3, 1]                      # uneven: out = in splits here
        a2a_u = fc.all_to_all_single(a2a + x.repeat(1, 2), splits, splits, PG)
        b = fc.broadcast(a2a_u, 1, PG)
        mx = fc.all_reduce(b + rank, "max", PG)
        av = fc.all_reduce(b * (rank + 2), "avg", PG)
        y = self.out(mx + av)
        return y, s, g, rs, a2a, a2a_u, b, mx, av


def part_funcol():
    torch.manual_seed(0)  # same weights on every rank; per-rank input
    model = FunColModel()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + rank))
    with torch.no_grad():
        n0 = len(mcrdl.comms_records())
        eager = model(x)
        eager_ops = mcrdl_ops()[n0:]
        eager2 = model(x)
    check("funcol_eager_deterministic", all(torch.equal(a, b) for a, b in zip(eager, eager2)))
    # the first three collectives against a one-process reference (sums of two: exact)
    with torch.no_grad():
        h = [torch.relu(model.inp(torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + r))))
             for r in range(world)]
    ref_s = h[0] + h[1]
    ref_g = torch.cat([ref_s * (r + 1) for r in range(world)])
    ref_rs = ((ref_g - 1) + (ref_g - 1))[4 * rank:4 * rank + 4]
    check_equal("funcol_eager_matches_reference", list(eager[1:4]), [ref_s, ref_g, ref_rs])
    check("funcol_eager_via_mcrdl", len(eager_ops) == 8, "8 mcrdl ops", eager_ops)

    # explain: dynamo alone (eager backend), graph and break counts
    fresh()
    with torch.no_grad():
        ex = torch._dynamo.explain(model)(x)
    ops = sorted({str(op) for g in ex.ops_per_graph for op in g})
    coll = [o for o in ops if "functional" in o or "c10d" in o]
    check("funcol_explain_no_break", (ex.graph_count, ex.graph_break_count) == (1, 0),
          "1 graph, 0 breaks", (ex.graph_count, ex.graph_break_count, [str(b.reason) for b in ex.break_reasons]))
    say(f"INFO funcol rank={rank} explain graphs={ex.graph_count} breaks={ex.graph_break_count} "
        f"collective ops in graph: {coll}")

    fresh()
    compiled = torch.compile(model, fullgraph=True)  # default backend: inductor
    t = time.perf_counter()
    with torch.no_grad():
        n0 = len(mcrdl.comms_records())
        got = compiled(x)
        compiled_ops = mcrdl_ops()[n0:]
    first = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():
        got2 = compiled(x)
    again = time.perf_counter() - t
    check("funcol_compiled_no_graph_break", graph_breaks() == 0, 0, dict(counters["graph_break"]))
    check("funcol_compiled_one_graph", counters["stats"]["unique_graphs"] == 1, 1,
          counters["stats"]["unique_graphs"])
    check("funcol_compiled_by_inductor", sum(inductor_graphs().values()) >= 1, "an inductor graph",
          dict(counters["inductor"]))
    check("funcol_compiled_ops_via_mcrdl", sorted(compiled_ops) == sorted(eager_ops), eager_ops, compiled_ops)
    check_equal("funcol_compiled_equal_eager", list(got), list(eager))
    check_equal("funcol_compiled_rerun_equal_eager", list(got2), list(eager))
    say(f"INFO funcol rank={rank} mcrdl ops eager={eager_ops} compiled={compiled_ops}")
    say(f"INFO funcol rank={rank} first compiled call {first:.2f}s (compile; inductor {inductor_graphs()}), "
        f"next {1e3 * again:.2f} ms")


# -- 2: DTensor on a DeviceMesh over "mcrdl" -----------------------------------------------------
def part_dtensor():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (world,))
    check("dtensor_mesh_on_mcrdl", dist.get_backend(mesh.get_group()) == "mcrdl", "mcrdl",
          dist.get_backend(mesh.get_group()))

    # plain redistributes: each placement change is one collective
    def redistribute(a, p):
        r = a.redistribute(mesh, [Replicate()])            # Shard(0) -> Replicate: all_gather
        s1 = (r * 2).redistribute(mesh, [Shard(1)])         # Replicate -> Shard(1): local chunk
        s0 = s1.redistribute(mesh, [Shard(0)])              # Shard(1) -> Shard(0): all_to_all on GPU;
        # torch does all_gather + chunk on any CPU mesh ("CPU process group does not support alltoall yet")
        pr = (p + 1).redistribute(mesh, [Replicate()])      # Partial -> Replicate: all_reduce
        ps = (p * 3).redistribute(mesh, [Shard(0)])         # Partial -> Shard(0): reduce_scatter
        return r.to_local(), s1.to_local(), s0.to_local(), pr.to_local(), ps.to_local()

    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6) / 7
    a = distribute_tensor(full, mesh, [Shard(0)])
    local_p = torch.randn(8, 6, generator=torch.Generator().manual_seed(200 + rank))
    p = DTensor.from_local(local_p, mesh, [Partial()], run_check=False)
    n0 = len(mcrdl.comms_records())
    eager = redistribute(a, p)
    eager_ops = mcrdl_ops()[n0:]
    check("dtensor_redistribute_eager_correct",
          torch.equal(eager[0], full) and torch.equal(eager[1], (full * 2).chunk(world, 1)[rank])
          and torch.equal(eager[2], (full * 2).chunk(world, 0)[rank]),
          "replicate/shard values of full", "mismatch")
    fresh()
    n0 = len(mcrdl.comms_records())
    got = torch.compile(redistribute, fullgraph=True)(a, p)
    compiled_ops = mcrdl_ops()[n0:]
    check("dtensor_redistribute_no_graph_break", graph_breaks() == 0, 0, dict(counters["graph_break"]))
    check("dtensor_redistribute_ops_via_mcrdl", sorted(compiled_ops) == sorted(eager_ops)
          and len(eager_ops) >= 4, eager_ops, compiled_ops)
    check_equal("dtensor_redistribute_compiled_equal_eager", list(got), list(eager))
    say(f"INFO dtensor rank={rank} redistribute mcrdl ops eager={eager_ops} compiled={compiled_ops}")

    # column/row-parallel MLP, forward and backward
    def mlp():
        torch.manual_seed(1)
        return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 8))

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(300))  # replicated input

    def step(model):
        """Forward and backward; returns output, gradients (whole) and the mcrdl ops they ran."""
        n0 = len(mcrdl.comms_records())
        out = model(x)
        out.pow(2).sum().backward()
        ops = mcrdl_ops()[n0:]
        grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
        return [out.detach()] + grads, ops

    ref, _ = step(mlp())  # unsharded, one process
    eager, eager_ops = step(parallelize_module(mlp(), mesh, plan))
    close = all(torch.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(eager, ref))
    check("dtensor_tp_eager_close_to_unsharded", close, "allclose(rtol=1e-5, atol=1e-6)",
          [max_diff(g, w) for g, w in zip(eager, ref)])
    fresh()
    tp = parallelize_module(mlp(), mesh, plan)
    got, compiled_ops = step(torch.compile(tp, fullgraph=True))
    check("dtensor_tp_no_graph_break", graph_breaks() == 0, 0, dict(counters["graph_break"]))
    check("dtensor_tp_compiled_by_inductor", sum(inductor_graphs().values()) >= 2, "forward and backward graphs",
          dict(counters["inductor"]))
    check("dtensor_tp_ops_via_mcrdl", compiled_ops == eager_ops and "all_reduce" in compiled_ops,
          eager_ops, compiled_ops)
    check_equal("dtensor_tp_compiled_equal_eager", got, eager)
    say(f"INFO dtensor rank={rank} tp fwd+bwd mcrdl ops eager={eager_ops} compiled={compiled_ops}")


# -- 3: DDP, compiled (DDPOptimizer) ------------------------------------------------------------
DDP_STEPS = 4
_gloo = None


def gloo_group():
    global _gloo
    if _gloo is None:
        _gloo = dist.new_group(backend="gloo")  # plain torch gloo over the same ranks
    return _gloo


def ddp_train(pg, how):
    """DDP_STEPS of SGD on a ~1.1 MB MLP. how: "eager"; "inner": DDP(torch.compile(model));
    "outer": torch.compile(DDP(model)). Returns losses, final parameters, mcrdl ops."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(rank)  # different weights per rank: DDP broadcasts rank 0's
    model = nn.Sequential(nn.Linear(16, 512), nn.ReLU(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 4))
    # 1 MiB buckets: two. DDPOptimizer asserts bucket_cap >= its first bucket (1 MiB,
    # dist._DEFAULT_FIRST_BUCKET_BYTES): "First bucket should be smaller/equal to other buckets"
    ddp = DDP(torch.compile(model) if how == "inner" else model, process_group=pg, bucket_cap_mb=1)
    run = torch.compile(ddp) if how == "outer" else ddp
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    true_w = torch.randn(16, 4, generator=torch.Generator().manual_seed(12345))
    losses = []
    n0 = len(mcrdl.comms_records())
    for step in range(DDP_STEPS):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1000 * step + rank))
        opt.zero_grad()
        loss = nn.functional.mse_loss(run(x), torch.tanh(x @ true_w))
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()], mcrdl_ops()[n0:]


def part_ddp():
    """DDP(torch.compile(model)): DDP's forward runs eagerly and the compiled module,
    called inside it, is split by DDPOptimizer at bucket boundaries."""
    from torch._dynamo.backends.distributed import DDPOptimizer

    check("ddp_optimize_ddp_default_on", torch._dynamo.utils.get_optimize_ddp_mode() == "ddp_optimizer",
          "ddp_optimizer", torch._dynamo.utils.get_optimize_ddp_mode())
    splits = []
    orig = DDPOptimizer.compile_fn

    def spy(self, gm, example_inputs, **kw):
        out = orig(self, gm, example_inputs, **kw)
        splits.append(len(self.buckets))
        return out

    DDPOptimizer.compile_fn = spy
    try:
        fresh()
        t = time.perf_counter()
        via_mcrdl = ddp_train(PG, "inner")
        t_mcrdl = time.perf_counter() - t
        breaks, graphs, n_split = dict(counters["graph_break"]), counters["stats"]["unique_graphs"], list(splits)
        by_inductor = inductor_graphs()
        fresh()
        t = time.perf_counter()
        via_gloo = ddp_train(gloo_group(), "inner")
        t_gloo = time.perf_counter() - t
        breaks_gloo = dict(counters["graph_break"])
    finally:
        DDPOptimizer.compile_fn = orig
    eager = ddp_train(PG, "eager")
    check("ddp_compiled_no_graph_break", not breaks and not breaks_gloo, {}, (breaks, breaks_gloo))
    check("ddp_compiled_one_graph", graphs == 1, 1, graphs)
    check("ddp_optimizer_split_graph", n_split[:1] == [2], "DDPOptimizer: 2 buckets", n_split)
    check("ddp_compiled_by_inductor", sum(by_inductor.values()) >= 4, "2 submodules, forward and backward",
          by_inductor)
    ar = via_mcrdl[2].count("all_reduce")
    check("ddp_compiled_grads_via_mcrdl", ar >= DDP_STEPS and "broadcast" in via_mcrdl[2],
          "all_reduce per step", sorted(set(via_mcrdl[2])))
    check("ddp_gloo_run_went_around_mcrdl", via_gloo[2] == [], [], via_gloo[2][:5])
    check_equal("ddp_compiled_losses_mcrdl_equal_gloo", [via_mcrdl[0]], [via_gloo[0]])
    check_equal("ddp_compiled_params_mcrdl_equal_gloo", via_mcrdl[1], via_gloo[1])
    check("ddp_compiled_close_to_eager", torch.allclose(via_mcrdl[0], eager[0], rtol=1e-5, atol=1e-6)
          and all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(via_mcrdl[1], eager[1])),
          "allclose(rtol=1e-5, atol=1e-6)", max_diff(via_mcrdl[0], eager[0]))
    say(f"INFO ddp rank={rank} losses mcrdl={via_mcrdl[0].tolist()} gloo={via_gloo[0].tolist()}")
    say(f"INFO ddp rank={rank} DDPOptimizer buckets per compiled graph: {n_split}; "
        f"inductor {by_inductor}; "
        f"{ar} all_reduce via mcrdl in {DDP_STEPS} steps; time incl. compile: mcrdl {t_mcrdl:.2f}s, "
        f"gloo {t_gloo:.2f}s (caches warm from the first)")


def part_ddp_outer():
    """torch.compile(DDP(model)): dynamo runs DDP's own forward frames, graph-breaks in
    them (the same breaks on gloo), and meanwhile DDP's reducer calls the group from C++
    (bucket rebuild broadcast) while dynamo's frame hook is live."""
    fresh()
    via_mcrdl = ddp_train(PG, "outer")
    breaks = dict(counters["graph_break"])
    fresh()
    via_gloo = ddp_train(gloo_group(), "outer")
    breaks_gloo = dict(counters["graph_break"])
    short = {k.splitlines()[0][:60]: v for k, v in breaks.items()}
    check("ddp_outer_same_graph_breaks_as_gloo", breaks == breaks_gloo, breaks_gloo, breaks)
    check_equal("ddp_outer_losses_mcrdl_equal_gloo", [via_mcrdl[0]], [via_gloo[0]])
    check_equal("ddp_outer_params_mcrdl_equal_gloo", via_mcrdl[1], via_gloo[1])
    say(f"INFO ddp_outer rank={rank} graph breaks (same on gloo: {breaks == breaks_gloo}): {short}; "
        f"graphs compiled: {counters['stats']['unique_graphs']}")


# -- 4: torch.distributed calls that run eagerly inside a compiled function -----------------------
def part_c10d_eager():
    """dist.all_reduce is traced (dynamo rewrites it to a functional collective);
    dist.broadcast is a graph break: it runs eagerly between two graphs, with dynamo's
    frame hook live, and torch calls the group's Python method from there."""
    def f(x, pg):
        y = x * 2
        dist.all_reduce(y, group=pg)
        dist.broadcast(y, 1, group=pg)
        return y + 1

    x = torch.arange(6, dtype=torch.float32) * (rank + 1)
    eager = f(x, PG)
    out = {}
    for name, pg in (("gloo", gloo_group()), ("mcrdl", PG)):  # gloo first: a failure on mcrdl leaves ranks in step
        fresh()
        n0 = len(mcrdl.comms_records())
        got = torch.compile(f)(x, pg)
        out[name] = got, dict(counters["graph_break"]), mcrdl_ops()[n0:]
    (g_out, g_breaks, _), (m_out, m_breaks, m_ops) = out["gloo"], out["mcrdl"]
    check("c10d_eager_same_graph_breaks_as_gloo", m_breaks == g_breaks, g_breaks, m_breaks)
    check("c10d_eager_ops_via_mcrdl", sorted(m_ops) == ["all_reduce", "broadcast"], ["all_reduce", "broadcast"], m_ops)
    check_equal("c10d_eager_compiled_equal_eager", [m_out, g_out], [eager, eager])
    say(f"INFO c10d_eager rank={rank} graph breaks: {sum(m_breaks.values())} "
        f"({'; '.join(k.splitlines()[0][:60] for k in m_breaks)})")


PART_FNS = (("funcol", part_funcol), ("dtensor", part_dtensor), ("ddp", part_ddp),
            ("c10d_eager", part_c10d_eager), ("ddp_outer", part_ddp_outer))
PARTS = (sys.argv[1] if len(sys.argv) > 1 else ",".join(p for p, _ in PART_FNS)).split(",")
for part, fn in PART_FNS:
    if part not in PARTS:
        continue
    t0 = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - report and go on with the next part
        fail(f"{part}_ran", exc)
    else:
        check(f"{part}_ran", True)
    say(f"TIME {part} rank={rank} {time.perf_counter() - t0:.2f}s")
    dist.barrier()
dist.destroy_process_group()
say(f"TIME total rank={rank} {time.perf_counter() - T_START:.2f}s")
say(f"COMPILE JOB DONE rank={rank}")
