"""Ranks busy in mcrdl work when `mcrdl run` is stopped (tests/test_cli.py).

Usage: stop_job.py PIDDIR BACKEND MODE. Each rank writes its pid to PIDDIR and
prints READY; then rank 0 waits in a barrier on BACKEND that rank 1 never
joins. MODE "default" keeps Python's signal handling; "ignore" ignores SIGINT
and SIGTERM, so only the launcher's kill can end the rank."""
import os
import signal
import sys
import time

import mcrdl

piddir, backend, mode = sys.argv[1:4]
mcrdl.init_process_group(timeout=600)
rank = mcrdl.get_rank()
if mode == "ignore":
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
with open(os.path.join(piddir, f"rank{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
mcrdl.barrier()
print(f"rank {rank}: READY", flush=True)
if rank == 0:
    mcrdl.barrier(backend=backend)
else:
    time.sleep(600)
