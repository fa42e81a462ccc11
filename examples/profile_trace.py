"""A DDP training job on "mcrdl" under torch.profiler: its trace, and a picture of it.

    mcrdl run -n 2 examples/profile_trace.py OUTDIR

Each rank writes OUTDIR/trace_rank<R>.json (open it in https://ui.perfetto.dev
or chrome://tracing); rank 0 prints the profiler's table of mcrdl's events and
draws OUTDIR/profiler_trace.png: every rank's steps, with each mcrdl op
coloured by the library that ran it (DDP's gradient all-reduces, async, span
the backward pass they overlap; the async all-gather spans until its wait).
"""
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

import mcrdl

out_dir = sys.argv[1] if len(sys.argv) > 1 else "profile_out"
os.makedirs(out_dir, exist_ok=True)
dist.init_process_group("mcrdl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 512)),
            bucket_cap_mb=1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
gathered = torch.empty(world * 4096)



def train_step(step: int) -> None:
    x = torch.randn(64, 512, generator=torch.Generator().manual_seed(step * world + rank))
    with record_function("forward"):
        loss = model(x).square().mean()
    with record_function("backward"):
        loss.backward()
    # a metric gathered asynchronously while the optimizer steps
    work = mcrdl.all_gather_into_tensor(gathered, torch.full((4096,), loss.item()), async_op=True)
    with record_function("optimizer"):
        opt.step()
        opt.zero_grad()
    work.wait()
    mcrdl.all_reduce(torch.ones(1), backend="gloo")  # a small op on the other library


train_step(0)  # warm-up, not traced
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    for step in range(1, 4):
        with record_function(f"ProfilerStep#{step}"):
            train_step(step)

path = os.path.join(out_dir, f"trace_rank{rank}.json")
prof.export_chrome_trace(path)
table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
dist.barrier()
if rank == 0:
    print("\n".join(line for line in table.splitlines() if "mcrdl:" in line or "Name" in line or "---" in line))
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"mpi": "tab:blue", "gloo": "tab:orange", "nccl": "tab:green", "mpi_staged": "tab:purple"}
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.1 * world))
    t0 = None
    for r in range(world):
        events = [e for e in json.load(open(os.path.join(out_dir, f"trace_rank{r}.json")))["traceEvents"]
                  if e.get("ph") == "X"]
        t0 = t0 if t0 is not None else min(e["ts"] for e in events)
        for e in events:
            name, start, dur = e["name"], (e["ts"] - t0) / 1e3, e["dur"] / 1e3
            if name.startswith("ProfilerStep#"):
                ax.broken_barh([(start, dur)], (r - 0.45, 0.9), facecolors="0.92", edgecolors="0.6")
            elif name in ("forward", "backward", "optimizer"):
                ax.broken_barh([(start, dur)], (r - 0.05, 0.4), facecolors="0.75")
                ax.text(start + dur / 2, r + 0.15, name, ha="center", va="center", fontsize=7)
            elif name.startswith("mcrdl:"):
                _, library, op = name.split(":")
                ax.broken_barh([(start, dur)], (r - 0.4, 0.3), facecolors=colours.get(library, "tab:red"),
                               alpha=0.8)
                if dur > 8:
                    ax.text(start, r - 0.45, op, fontsize=6, va="bottom")
    ax.set_yticks(range(world), [f"rank {r}" for r in range(world)])
    ax.invert_yaxis()
    ax.set_xlabel("ms (torch.profiler's clock, both ranks from rank 0's first event)")
    ax.set_title('DDP on "mcrdl" under torch.profiler: mcrdl:<library>:<op> events '
                 '(blue: MPI, orange: gloo) beside forward/backward/optimizer')
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "profiler_trace.png"), dpi=130)
    print(f"wrote {out_dir}/trace_rank*.json and {out_dir}/profiler_trace.png")
dist.destroy_process_group()
