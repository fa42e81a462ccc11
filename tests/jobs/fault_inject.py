"""Run a training program unchanged while one of its ranks dies or freezes.

    fault_inject.py kill|freeze VICTIM SECONDS PROGRAM.py [ARGS...]

A thread waits until torch.distributed is initialized, then SECONDS more;
on rank VICTIM (torchrun's RANK) it then prints ``FAULT rank R ACTION at T``
(T: time.time()) and sends its own process SIGKILL or SIGSTOP, as a crashed or
stuck node would. Meanwhile PROGRAM runs as ``__main__`` with ARGS.
"""
import os
import runpy
import signal
import sys
import threading
import time

import torch.distributed as dist

action, victim, seconds, program, *args = sys.argv[1:]
if action not in ("kill", "freeze"):
    sys.exit(f"fault_inject.py: unknown action {action!r} (kill | freeze)")


def strike() -> None:
    while not dist.is_initialized():
        time.sleep(0.05)
    time.sleep(float(seconds))
    print(f"FAULT rank {victim} {action} at {time.time():.3f}", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL if action == "kill" else signal.SIGSTOP)


if os.environ.get("RANK") == victim:
    threading.Thread(target=strike, daemon=True).start()
sys.argv = [program, *args]
runpy.run_path(program, run_name="__main__")
