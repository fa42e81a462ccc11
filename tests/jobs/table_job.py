"""A table written by ``mcrdl tune`` drives selection (MCRDL_TUNING_TABLE).

Arguments: NBYTES:BACKEND pairs, the backend the table names for all_reduce
at that size. For each: explain() names the table and that backend, an
all_reduce of that many bytes runs on it and gives the right result.
"""
import os
import sys

import torch

import mcrdl

from common import check

path = os.environ["MCRDL_TUNING_TABLE"]
mcrdl.init_process_group(comms_log=True)  # (the logger says which backend ran each call)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
for item in sys.argv[1:]:
    nbytes, expected = item.split(":")
    nbytes = int(nbytes)
    text = mcrdl.explain("all_reduce", nbytes)
    check(f": {expected} (tuning table {path}: all_reduce on cpu, group size {world}, {nbytes} B" in text,
          "explain:", text, "expected", expected)
    t = torch.arange(nbytes // 4, dtype=torch.float32) + rank
    mcrdl.all_reduce(t)  # (blocking: a library may decline selected async calls, Backend.async_calls)
    ran = mcrdl.comms_records()[-1].backend
    check(ran == expected, "ran on", ran, "expected", expected, "at", nbytes)
    ref = sum(torch.arange(nbytes // 4, dtype=torch.float32) + r for r in range(world))
    check(torch.equal(t, ref), "wrong all_reduce result at", nbytes, "on", ran)
    print(f"rank {rank}: {nbytes} B -> {ran} ok", flush=True)
mcrdl.destroy_process_group()
