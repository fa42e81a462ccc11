"""The three ways to mix backends: `mcrdl run -n 2 examples/mixing.py`.

1. per call:   mcrdl.all_reduce(t, backend="gloo")
2. static map: init_process_group(op_backends={"all_to_all": "mpi", "all_reduce": "gloo"})
               (or MCRDL_OP_BACKENDS=all_to_all:mpi,all_reduce:gloo)
3. table:      init_process_group(tuning_table="examples/tables/example.json")
               (or MCRDL_TUNING_TABLE=...); `mcrdl tune` writes such tables.
"""
from pathlib import Path

import torch

import mcrdl

TABLE = Path(__file__).parent / "tables" / "example.json"


def show(title: str) -> None:
    rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
    rows = []
    for numel in (1, 1 << 20):  # 4 B and 4 MB
        t = torch.full((numel,), float(rank + 1))
        work = mcrdl.all_reduce(t, async_op=True)
        work.wait()
        assert torch.all(t == world * (world + 1) / 2)
        rows.append(f"all_reduce {4 * numel:>8d} B -> {work.backend}")
        inp = torch.arange(world * numel, dtype=torch.float32)
        out = torch.empty_like(inp)
        work = mcrdl.all_to_all_single(out, inp, async_op=True)
        work.wait()
        rows.append(f"all_to_all {4 * world * numel:>8d} B -> {work.backend}")
    if rank == 0:
        print(f"== {title}")
        for row in rows:
            print("  ", row)
        print("  ", mcrdl.explain("all_reduce", 1 << 22))


mcrdl.init_process_group()
t = torch.ones(4)
mcrdl.all_reduce(t, backend="gloo")  # 1. per call
show(f"default backend ({mcrdl.get_default_backend()}), one call forced to gloo")
mcrdl.destroy_process_group()

mcrdl.init_process_group(op_backends={"all_to_all": "mpi", "all_reduce": "gloo"})
show("static map: all_to_all -> mpi, all_reduce -> gloo")
mcrdl.destroy_process_group()

mcrdl.init_process_group(tuning_table=str(TABLE))
show(f"tuning table {TABLE.name}: all_reduce mpi up to 64 KB, gloo above")
mcrdl.destroy_process_group()
