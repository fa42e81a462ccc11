"""CUDA tensors under torch.profiler and the flight recorder: every library
that takes CUDA tensors here (NCCL at one rank per GPU, host-staged MPI, gloo)
runs a blocking and an async all_reduce; each is a ``mcrdl:<library>:all_reduce``
event with the tensor's shape, and a flight-recorder entry named
``nccl:all_reduce mcrdl=<library>``, completed. Needs TORCH_FR_BUFFER_SIZE and
TORCH_FR_DUMP_TEMP_FILE. Usage: cuda_observe_job.py OUTDIR"""
import json
import os
import pickle
import sys

import torch
from torch.profiler import ProfilerActivity, profile

import mcrdl
from verdicts import check

out_dir = sys.argv[1]
mcrdl.init_process_group(timeout=120)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
dev = torch.device("cuda", mcrdl.get_local_rank() % torch.cuda.device_count())
torch.cuda.set_device(dev)
libraries = [b for b in ("nccl", "mpi_staged", "gloo", "mpi") if b in mcrdl.live_backends("cuda")]
print(f"rank {rank}: CUDA libraries here: {libraries}", flush=True)
results = []
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
    for lib in libraries:
        t = torch.ones(1024, device=dev)
        mcrdl.all_reduce(t, backend=lib)
        u = torch.ones(1024, device=dev)
        mcrdl.all_reduce(u, backend=lib, async_op=True).wait()
        results.append((lib, t, u))
torch.cuda.synchronize()
for lib, t, u in results:
    check(f"{lib} results", bool((t == world).all() and (u == world).all()), world, (t[:2], u[:2]))
path = os.path.join(out_dir, f"cuda_trace_rank{rank}.json")
prof.export_chrome_trace(path)
events = [e for e in json.load(open(path))["traceEvents"]  # (CPU side: kineto mirrors them on the GPU's rows)
          if e.get("ph") == "X" and e.get("cat") == "user_annotation" and e["name"].startswith("mcrdl:")]
names = [e["name"] for e in events]
check("one event per op and library", names == [f"mcrdl:{lib}:all_reduce" for lib in libraries for _ in (0, 1)],
      "2 per library", names)
check("tensor shapes and bytes", all(e["args"].get("Input Dims", [None])[0] == [1024]
                                     and e["args"].get("Concrete Inputs", [])[1:] == ["4096", str(world)]
                                     for e in events), "[1024], 4096 bytes", [e["args"] for e in events])
check("every event finished", all("finished" not in e["args"] for e in events), "all finished", names)
dump = pickle.load(open(mcrdl.dump_flight_recorder(), "rb"))
entries = [e for e in dump["entries"] if e["input_sizes"] == [[1024]]]
check("flight recorder entries", [e["profiling_name"] for e in entries]
      == [f"nccl:all_reduce mcrdl={lib}" for lib in libraries for _ in (0, 1)],
      "nccl:all_reduce mcrdl=<library>, 2 per library", [e["profiling_name"] for e in entries])
check("entries completed", all(e["state"] == "completed" for e in entries), "completed", [e["state"] for e in entries])
mcrdl.destroy_process_group()
