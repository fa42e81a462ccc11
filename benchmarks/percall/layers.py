"""What each layer above a library costs per call, in one job, interleaved:
mcrdl's API on gloo against raw torch gloo, and torch.distributed on the
"mcrdl" backend (ProcessGroupMCRDL) against mcrdl's own API.

    mcrdl run -n 2 benchmarks/percall/layers.py [--layers gloo,torch] [--sizes 4,1K,16K,256K] [--rounds R] [--iters N] [--json out.json]

The job starts through ``torch.distributed.init_process_group("mcrdl")``.
"gloo": ``mcrdl.<op>(..., backend="gloo")`` against the same op on a
``ProcessGroupGloo`` the benchmark makes itself on torch's store (``pg.<op>(...)
.wait()``). "torch": ``torch.distributed.<op>`` on an "mcrdl" group of every rank, named
by ``group=`` as torch alone's group is (on the default group torch's Python
also looks the group up, ``_get_default_group``: the benchmark times that
too), against ``mcrdl.<op>`` with the same (selected) backend. Blocking calls back to back
(a barrier, then ``N`` calls; elapsed / N), ``R`` rounds alternating which
variant goes first; a round's figure is the slowest rank's; reported: the
median time of each and the median per-round ratio. Before timing, both
variants run on rank-dependent data and must give equal outputs. send/recv is
a ping-pong between ranks 0 and 1 (one way = round trip / 2). "torch alone":
the same ``torch.distributed`` call on a group whose backend does nothing
(returns no Work), timed the same way: what torch's own Python costs per call,
which no backend can remove. "added": the layer's time less the API's and
torch alone's in the same round (median over the rounds), what #39 holds
to 1 us. torch's send and recv are an isend or
irecv and a wait on its Work; "API async" times that on mcrdl's API
(``mcrdl.isend(...).wait()``), so its excess over the blocking API is a floor
of the torch layer's send/recv that the layer itself does not add. So is the
``torch.distributed.Work`` a backend must return for each of them (torch
alone's group returns none): "torch Work" times making and freeing one per
send and per receive of the ping-pong, interleaved with the rest. "layer's
own" is what is added less both floors (the layer's time less API async's,
torch alone's and torch Work's, round by round).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import timeit
from datetime import timedelta

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

import mcrdl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import environment, interleaved, write_json  # noqa: E402
from hotpath import label, parse_size  # noqa: E402

OPS = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
       "send/recv"]
LAYERS = {"gloo": ("mcrdl (gloo)", "raw gloo"), "torch": ("torch.distributed on mcrdl", "mcrdl API")}


class NullGroup(dist.ProcessGroup):
    """A backend that does nothing: what is left is torch's own per-call cost."""

    def getBackendName(self) -> str:
        return "layers_null"

    def _nothing(self, *args, **kwargs):
        return None

    allreduce = broadcast = all_gather_single = reduce_scatter_single = all_to_all_single = _nothing
    send = recv = _nothing


def iterations(nbytes: int) -> int:
    return 500 if nbytes <= 16384 else 100


def torch_alone(op: str, n: int, null, rank: int, world: int):
    """The torch.distributed call of ``op`` on the do-nothing group."""
    x, a, a2, b = torch.zeros(n), torch.empty(n * world), torch.empty(n * world), torch.empty(max(1, n // world))
    calls = {"all_reduce": lambda: dist.all_reduce(x, group=null),
             "broadcast": lambda: dist.broadcast(x, 0, group=null),
             "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(a, x, group=null),
             "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(b, a, group=null),
             "all_to_all_single": lambda: dist.all_to_all_single(a, a2, group=null)}
    if op in calls:
        return calls[op]

    def ping_pong():
        if rank < 2:
            dist.send(x, 1 - rank, group=null)
            dist.recv(x, 1 - rank, group=null)
    return ping_pong


def variants(layer: str, op: str, n: int, pg, tg, rank: int, world: int, fill):
    """(layer call, reference call, layer outputs, reference outputs); ``tg``: the
    "mcrdl" torch group of every rank the torch layer's calls name."""
    gloo = layer == "gloo"
    x = fill(n)
    y = x.clone()
    if op == "all_reduce":
        if gloo:
            return (lambda: mcrdl.all_reduce(x, backend="gloo"), lambda: pg.allreduce([y]).wait(), [x], [y])
        return lambda: dist.all_reduce(x, group=tg), lambda: mcrdl.all_reduce(y), [x], [y]
    if op == "broadcast":
        if gloo:
            opts = dist.BroadcastOptions()
            opts.rootRank = 0
            return (lambda: mcrdl.broadcast(x, 0, backend="gloo"), lambda: pg.broadcast([y], opts).wait(),
                    [x], [y])
        return lambda: dist.broadcast(x, 0, group=tg), lambda: mcrdl.broadcast(y, 0), [x], [y]
    if op == "all_gather_into_tensor":
        a, b = torch.empty(n * world), torch.empty(n * world)
        if gloo:
            return (lambda: mcrdl.all_gather_into_tensor(a, x, backend="gloo"),
                    lambda: pg._allgather_base(b, y).wait(), [a], [b])
        return (lambda: dist.all_gather_into_tensor(a, x, group=tg), lambda: mcrdl.all_gather_into_tensor(b, y),
                [a], [b])
    if op == "reduce_scatter_tensor":
        n = max(world, n - n % world)
        x = fill(n)
        y = x.clone()
        a, b = torch.empty(n // world), torch.empty(n // world)
        if gloo:
            return (lambda: mcrdl.reduce_scatter_tensor(a, x, backend="gloo"),
                    lambda: pg._reduce_scatter_base(b, y).wait(), [a], [b])
        return (lambda: dist.reduce_scatter_tensor(a, x, group=tg), lambda: mcrdl.reduce_scatter_tensor(b, y),
                [a], [b])
    if op == "all_to_all_single":
        n = max(world, n - n % world)
        x = fill(n)
        y = x.clone()
        a, b = torch.empty(n), torch.empty(n)
        if gloo:
            return (lambda: mcrdl.all_to_all_single(a, x, backend="gloo"),
                    lambda: pg.alltoall_base(b, y, [], []).wait(), [a], [b])
        return lambda: dist.all_to_all_single(a, x, group=tg), lambda: mcrdl.all_to_all_single(b, y), [a], [b]
    # send/recv ping-pong between ranks 0 and 1
    peer = 1 - rank
    if gloo:
        def layer_call():
            if rank == 0:
                mcrdl.send(x, 1, backend="gloo")
                mcrdl.recv(x, 1, backend="gloo")
            elif rank == 1:
                mcrdl.recv(x, 0, backend="gloo")
                mcrdl.send(x, 0, backend="gloo")

        def reference():
            if rank == 0:
                pg.send([y], peer, 0).wait()
                pg.recv([y], peer, 0).wait()
            elif rank == 1:
                pg.recv([y], peer, 0).wait()
                pg.send([y], peer, 0).wait()
        return layer_call, reference, [x], [y]

    def torch_call():
        if rank == 0:
            dist.send(x, 1, group=tg)
            dist.recv(x, 1, group=tg)
        elif rank == 1:
            dist.recv(x, 0, group=tg)
            dist.send(x, 0, group=tg)

    def api_call():
        if rank == 0:
            mcrdl.send(y, 1)
            mcrdl.recv(y, 1)
        elif rank == 1:
            mcrdl.recv(y, 0)
            mcrdl.send(y, 0)
    return torch_call, api_call, [x], [y]


def api_async_ping_pong(n: int, rank: int):
    """The send/recv ping-pong on mcrdl's isend/irecv, each waited for (torch's send and recv)."""
    z = torch.zeros(n)

    def call():
        if rank == 0:
            mcrdl.isend(z, 1).wait()
            mcrdl.irecv(z, 1).wait()
        elif rank == 1:
            mcrdl.irecv(z, 0).wait()
            mcrdl.isend(z, 0).wait()
    return call


def torch_works():
    """A send's and a receive's ``torch.distributed.Work``, made and freed (each rank's per round trip)."""
    def call():
        dist.Work()
        dist.Work()
    return call


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="4,1K,16K,256K")
    parser.add_argument("--layers", default=",".join(LAYERS))
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=None, help="calls per timing (default: by size)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ops, sizes = args.ops.split(","), [parse_size(s) for s in args.sizes.split(",")]
    layers = {k: LAYERS[k] for k in args.layers.split(",")}

    dist.Backend.register_backend("layers_null", lambda store, rank, size, timeout: NullGroup(rank, size),
                                  devices=["cpu"])
    dist.init_process_group("mcrdl")
    rank, world = dist.get_rank(), dist.get_world_size()
    null = dist.new_group(backend="layers_null")
    tg = dist.new_group(backend="mcrdl")  # (named as torch alone's group is: the same torch Python)
    store = dist.PrefixStore("layers-bench/", dist.distributed_c10d._get_default_store())
    pg = dist.ProcessGroupGloo(store, rank, world, timedelta(seconds=120))
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    console = Console(stderr=True, width=200)
    gen = torch.Generator().manual_seed(rank + 1)
    fill = lambda k: torch.randint(-8, 8, (k,), generator=gen).float()  # noqa: E731  sums stay exact

    results = []
    with Progress(console=console, disable=rank != 0, transient=True) as progress:
        task = progress.add_task("layers", total=len(layers) * len(ops) * len(sizes))
        for layer in layers:
            for op in ops:
                for nbytes in sizes:
                    call, ref, outs, ref_outs = variants(layer, op, max(1, nbytes // 4), pg, tg, rank, world, fill)
                    call()
                    ref()
                    for a, b in zip(outs, ref_outs):
                        if not torch.equal(a, b):
                            raise SystemExit(f"rank {rank}: {layer} {op} {label(nbytes)}: outputs differ")
                    iters = args.iters or iterations(nbytes)
                    order = [("layer", call), ("ref", ref)]
                    if layer == "torch":
                        order.append(("alone", torch_alone(op, max(1, nbytes // 4), null, rank, world)))
                        if op == "send/recv":
                            order.append(("api async", api_async_ping_pong(max(1, nbytes // 4), rank)))
                            order.append(("torch work", torch_works()))
                    times = interleaved(order, args.rounds, iters, max(10, iters // 20), comm,
                                        per_call=2 if op == "send/recv" else 1)
                    ratios = [a / b for a, b in zip(times["layer"], times["ref"])]
                    row = {"layer": layer, "op": op, "bytes": nbytes, "iters": iters,
                           "layer_us": statistics.median(times["layer"]), "ref_us": statistics.median(times["ref"]),
                           "ratio": statistics.median(ratios), "ratios": ratios}
                    if "alone" in times:  # (differences within a round: a slow phase moves all of them)
                        row["torch_alone_us"] = statistics.median(times["alone"])
                        row["added_us"] = statistics.median(
                            a - b - c for a, b, c in zip(times["layer"], times["ref"], times["alone"]))
                    if "api async" in times:
                        row["api_async_us"] = statistics.median(times["api async"])
                        row["api_async_added_us"] = statistics.median(
                            a - b for a, b in zip(times["api async"], times["ref"]))
                        row["torch_work_us"] = statistics.median(times["torch work"])
                        row["own_us"] = statistics.median(
                            a - b - c - d for a, b, c, d in zip(times["layer"], times["api async"], times["alone"],
                                                                times["torch work"]))
                    results.append(row)
                    progress.advance(task)
                    if rank == 0:
                        console.print(f"[{LAYERS[layer][0]} / {LAYERS[layer][1]}: {op} {label(nbytes)}] "
                                      f"{row['layer_us']:.2f} vs {row['ref_us']:.2f} us = {row['ratio']:.2f}x",
                                      highlight=False, markup=False)
    lookup_us = min(timeit.repeat(dist.distributed_c10d._get_default_group, number=20000, repeat=5)) / 20000 * 1e6
    if rank == 0:
        for layer, (name, ref_name) in layers.items():
            alone = "; torch alone) added" if layer == "torch" else ")"
            table = Table(title=f"{name} / {ref_name}, {world} ranks, back to back, median of {args.rounds} "
                                f"rounds (times in us: {name} / {ref_name}{alone})")
            table.add_column("op")
            for nbytes in sizes:
                table.add_column(label(nbytes), justify="right")
            for op in ops:
                cells = []
                for nbytes in sizes:
                    row = next(r for r in results if (r["layer"], r["op"], r["bytes"]) == (layer, op, nbytes))
                    alone = (f"; {row['torch_alone_us']:.1f}) {row['added_us']:+.2f}" if "added_us" in row
                             else ")")
                    cells.append(f"{row['ratio']:.2f}x ({row['layer_us']:.1f} / {row['ref_us']:.1f}{alone}")
                table.add_row(op, *cells)
            Console(width=200).print(table)
            floors = [r for r in results if r["layer"] == layer and "api_async_us" in r]
            if floors:
                Console(width=200).print("send/recv floor (torch's are async): API isend/irecv + wait "
                                         + ", ".join(f"{label(r['bytes'])} {r['api_async_us']:.2f} us "
                                                     f"({r['api_async_added_us']:+.2f} over the blocking "
                                                     f"API)" for r in floors), highlight=False)
                Console(width=200).print("send/recv floor (torch needs a Work per call): torch Work made and freed "
                                         + ", ".join(f"{label(r['bytes'])} {r['torch_work_us']:.2f} us" for r in floors)
                                         + "; the layer's own, less both floors: "
                                         + ", ".join(f"{label(r['bytes'])} {r['own_us']:+.2f} us" for r in floors),
                                         highlight=False)
        if "torch" in layers:
            Console(width=200).print(f"torch's own lookup of the default group (_get_default_group), which calls "
                                     f"without group= add: {lookup_us:.2f} us", highlight=False)
        if args.json:
            write_json(args.json, {"benchmark": "layers", "world_size": world, "rounds": args.rounds,
                                   "default_group_lookup_us": lookup_us,
                                   "backends": mcrdl.live_backends(),
                                   "environment": environment(mpi=MPI.Get_library_version().splitlines()[0]),
                                   "command": " ".join(sys.argv), "results": results}, Console())
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
