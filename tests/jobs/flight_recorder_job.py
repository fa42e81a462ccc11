"""A job that goes wrong on purpose, with torch's flight-recorder variables set
(TORCH_FR_BUFFER_SIZE, TORCH_FR_DUMP_TEMP_FILE: the test sets them).

Usage: flight_recorder_job.py SCENARIO, after two all_reduces every rank does:
  skip   rank 1 skips the third all_reduce (it computes instead): rank 0 hangs
  op     rank 0 gathers to rank 0, rank 1 takes part in a scatter from rank 0
  size   rank 1's third all_reduce is larger
  signal nothing goes wrong; each rank dumps on SIGUSR1, rank 1 on request too
  killed rank 1 dies in the middle of the job
"""
import os
import signal
import sys
import time

import torch
from verdicts import record  # (an exception that ends a rank is filed too, as ``uncaught``)

import mcrdl

scenario = sys.argv[1]
mcrdl.init_process_group(timeout=4 if scenario != "killed" else 60)
rank = mcrdl.get_rank()
t = torch.ones(4, 3)
for _ in range(2):
    mcrdl.all_reduce(t)
# the failed op's error, filed where MPICH's launcher cannot drop it (it may drop what a
# rank printed just before the job's abort)
try:
    if scenario == "skip":
        if rank == 0:
            mcrdl.all_reduce(t)
        else:
            time.sleep(60)  # "computing": rank 0's timeout asks this rank for its dump
    elif scenario == "op":
        if rank == 0:
            mcrdl.gather(t, [torch.empty(4, 3) for _ in range(2)], dst=0)
        else:
            mcrdl.scatter(t, None, src=0)
    elif scenario == "size":
        mcrdl.all_reduce(t if rank == 0 else torch.ones(64, 1024, 3))
        time.sleep(60)  # (whichever rank did not fail waits to be asked for its dump)
    elif scenario == "signal":
        os.kill(os.getpid(), signal.SIGUSR1)
        if rank == 1:
            print("requested dump:", mcrdl.dump_flight_recorder(), flush=True)
        mcrdl.barrier()
    elif scenario == "killed":
        if rank == 1:
            os._exit(3)
        time.sleep(60)  # the watchdog names the dead rank, and this rank dumps
except mcrdl.CommError as exc:
    record("the error names every rank's dumps", "every rank's flight recorder dumped (" in str(exc),
           "every rank's flight recorder dumped (...)", str(exc)[-400:])
    raise
mcrdl.destroy_process_group()
