"""Every mcrdl op in a torch.profiler trace: through the API and through
torch.distributed on "mcrdl", blocking and async, fast and general paths, on
MPI and gloo; an async op's event spans until its completion.

Usage: profiler_job.py OUTDIR [logged]  (logged: the comms logger records too,
and must see the same ops). Files its checks as verdicts (tests/jobs/verdicts.py)."""
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import mcrdl
from verdicts import check
import mcrdl.integrations.torch_backend as tb

warnings.simplefilter("ignore", FutureWarning)
out_dir, logged = sys.argv[1], sys.argv[2:] == ["logged"]
tb.init_process_group(mcrdl_options={"timeout": 60, "comms_log": logged})
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(256)  # 1 KiB
peer = 1 - rank
with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
    mcrdl.all_reduce(t)                               # fast path, MPI
    mcrdl.all_reduce(t, backend="gloo")               # fast path, gloo
    mcrdl.all_reduce(torch.ones(16, 16).t(), op=mcrdl.ReduceOp.MAX)  # general path
    dist.all_reduce(t)                                # torch.distributed on "mcrdl"
    out = torch.empty(256 * world)
    work = mcrdl.all_gather_into_tensor(out, t, async_op=True)
    time.sleep(0.05)  # the event must span this: it ends at completion
    work.wait()
    dist.broadcast(t, src=0, async_op=True).wait()
    if rank == 0:
        mcrdl.send(torch.ones(8), dst=1)
    else:
        mcrdl.recv(torch.empty(8), src=0)
    mcrdl.barrier()
mcrdl.all_reduce(t)  # after the profiler: no event, and nothing breaks

path = os.path.join(out_dir, f"trace_rank{rank}.json")
prof.export_chrome_trace(path)
events = [e for e in json.load(open(path))["traceEvents"]
          if e.get("ph") == "X" and e["name"].startswith("mcrdl:")]
names = [e["name"] for e in events]
print(f"rank {rank} events: {names}", flush=True)
want = ["mcrdl:mpi:all_reduce", "mcrdl:gloo:all_reduce", "mcrdl:mpi:all_reduce", "mcrdl:mpi:all_reduce",
        "mcrdl:mpi:all_gather_into_tensor", "mcrdl:mpi:broadcast",
        "mcrdl:mpi:send" if rank == 0 else "mcrdl:mpi:recv", "mcrdl:mpi:barrier"]
check("one event per op, library and op in its name", names == want, want, names)
first = events[0]["args"] if events else {}
check("bytes and group size as inputs", first.get("Concrete Inputs", [])[1:] == ["1024", str(world)]
      and first.get("Input Dims", [None])[0] == [256] and first.get("Input type", [None])[0] == "float",
      "1024 bytes, group of 2, [256] float", first)
spans = {e["name"]: e["dur"] for e in events}
check("an async op spans until completion", spans.get("mcrdl:mpi:all_gather_into_tensor", 0) >= 50_000,
      ">= 50000 us", f"all_gather_into_tensor lasted {spans.get('mcrdl:mpi:all_gather_into_tensor')} us")
check("every event finished", all("finished" not in e["args"] for e in events),
      "all finished", str([e["name"] for e in events if "finished" in e["args"]]))
if logged:
    ops = [r.op for r in mcrdl.comms_records()]
    check("the logger sees the same ops", ops[:len(want)] == [n.split(":")[2] for n in want], want, ops)
dist.destroy_process_group()
mcrdl.destroy_process_group()
