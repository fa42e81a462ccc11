"""A known op sequence with the logger on: counts, sizes, backends, trace, matrix."""
import json
import os
import sys

import torch

import mcrdl
import verdicts
from common import check

outdir = sys.argv[1]
mcrdl.init_process_group(comms_log=True)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
for _ in range(3):
    mcrdl.all_reduce(torch.ones(256), backend="mpi")            # 1 KB
mcrdl.all_reduce(torch.ones(1 << 18), backend="gloo")           # 1 MB
works = [mcrdl.broadcast(torch.ones(10), 0, async_op=True, backend="gloo") for _ in range(2)]
for w in works:
    w.wait()
out = torch.empty(world * 4)
mcrdl.all_gather_into_tensor(out, torch.ones(4), backend="mpi")  # full buffer: world * 16 B
splits_in = [1 + rank + j for j in range(world)]                 # uneven all-to-all
splits_out = [1 + r + rank for r in range(world)]
mcrdl.all_to_all_single(torch.empty(sum(splits_out)), torch.ones(sum(splits_in)), splits_out, splits_in,
                        backend="mpi")
nxt, prv = (rank + 1) % world, (rank - 1) % world
ws = mcrdl.batch_isend_irecv([mcrdl.P2POp(mcrdl.irecv, torch.empty(25), prv, backend="mpi"),
                              mcrdl.P2POp(mcrdl.isend, torch.ones(25), nxt, backend="mpi")])
for w in ws:
    w.wait()
recs = mcrdl.comms_records()
got = [(r.op, r.backend, r.nbytes, r.async_op) for r in recs]
want = ([("all_reduce", "mpi", 1024, False)] * 3 + [("all_reduce", "gloo", 1 << 20, False)]
        + [("broadcast", "gloo", 40, True)] * 2 + [("all_gather_into_tensor", "mpi", world * 16, False),
           ("all_to_all_single", "mpi", 4 * sum(splits_in), False), ("irecv", "mpi", 100, True),
           ("isend", "mpi", 100, True)])
check(got == want, "records", got, "expected", want)
check(all(r.end >= r.start >= 0 for r in recs), "every record completed")
summary = mcrdl.comms_summary()
rows = {(r["op"], r["backend"], r["size_bin"]): r for r in summary["summary"]}
check(rows[("all_reduce", "mpi", "<=1K")]["count"] == 3, rows)
check(abs(rows[("all_reduce", "gloo", "64K-1M")]["mean_bytes"] - (1 << 20)) < 1, rows)
check(len(summary["stragglers_s"]["all_reduce/mpi"]) == world, summary["stragglers_s"])
paths = mcrdl.export_comms(outdir)
if rank == 0:
    trace = json.load(open(paths["trace"]))
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    check(len(spans) == world * len(want), "trace spans", len(spans))
    check({e["pid"] for e in spans} == set(range(world)), "one row per rank")
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    check({n for _, n in names} == {"mpi", "gloo"}, "one row per backend", names)
    m = json.load(open(paths["matrix"]))
    check(len(m["total"]) == world and all(m["total"][i][i] == 0 for i in range(world)), m)
    # all-to-all: rank i sends 4*(1+i+j) bytes to j
    for i in range(world):
        for j in range(world):
            if i != j:
                check(m["ops"]["all_to_all"][i][j] == 4 * (1 + i + j), "all_to_all traffic", i, j, m["ops"]["all_to_all"])
    check(m["ops"]["p2p"][0][1 % world] == 100, "send traffic", m["ops"]["p2p"])
    check(os.path.getsize(paths["heatmap"]) > 1000, "heatmap written")
    print("rank 0: exported", sorted(paths))
mcrdl.destroy_process_group()
verdicts.finished("logger")
print(f"rank {rank}: LOGGER OK")
