"""The sentinel of libraries whose waits cannot be withdrawn (``shm``, ``ccl``).

Their calls block inside the library with no deadline, so an op that never
completes (a frozen or dead peer) would hang its rank forever. A sentinel
thread watches the backend's count of ops that entered and left the library;
when one stays inside and the backend's ``verdict`` names why it cannot
complete, it ends the process with that message, the only way out, as NCCL's
watchdog does.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, Optional

#: how often the sentinel looks at a running op
SENTINEL_S = 0.25
#: past the deadline, the engine's own timeout error is raised first
GRACE_S = 2.0


def gone(pid: int) -> bool:
    """Has process ``pid`` ended (a zombie counts)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def start(name: str, stopped: threading.Event, progress: Callable[[], tuple],
          verdict: Callable[[int, float], Optional[str]]) -> threading.Thread:
    """Watch until ``stopped``: ``progress()`` gives (ops started, ops ended);
    ``verdict(op number, seconds it has been inside)`` gives the message that
    ends the process, or None while it may still complete."""
    def watch() -> None:
        seen, since = 0, 0.0
        while not stopped.wait(SENTINEL_S):
            started, ended = progress()
            if started == ended:
                continue
            now = time.monotonic()
            if started != seen:
                seen, since = started, now
            message = verdict(started, now - since)
            if message is not None and progress() == (started, ended):
                sys.stderr.write(message + "\n")
                sys.stderr.flush()
                os._exit(1)

    thread = threading.Thread(target=watch, daemon=True, name=f"mcrdl-{name}-sentinel")
    thread.start()
    return thread
