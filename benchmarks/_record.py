"""What the recorded benchmarks share: interleaved timing rounds, and what
they write beside their figures (the environment and the JSON file itself)."""
from __future__ import annotations

import datetime as _dt
import json
import multiprocessing
import os
import platform
import time

import torch

import mcrdl
from mcrdl.tools.bench import cpu_model


def environment(**versions: str) -> dict:
    """Versions (torch, mcrdl, python and ``versions``), date, host, CPUs (count and
    model) and load."""
    return {"versions": {"torch": torch.__version__, "mcrdl": mcrdl.__version__,
                         "python": platform.python_version(), **versions},
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "hostname": platform.node(), "cpus": os.cpu_count(), "cpu_model": cpu_model(),
            "loadavg_at_end": os.getloadavg()}


def _spin() -> None:
    while True:
        pass


def busy(n: int = 1) -> list[multiprocessing.Process]:
    """Start ``n`` busy-looping processes (the "cores kept busy" load); the
    caller terminates them (they are daemons: they also end with it)."""
    hogs = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(n)]
    for h in hogs:
        h.start()
    return hogs


def bucket_name(row: dict) -> str:
    """An autotune report row's bucket, e.g. ``all_gather 131072-262143 B``."""
    return f"{row['op']} {row['min_bytes']}-{row['max_bytes']} B"


def trials(rows: list[dict]) -> list[dict]:
    """The trials over blocks in an autotune report's rows, each with its bucket's name."""
    return [{"bucket": bucket_name(r), **r["trial"]} for r in rows if r.get("trial")]


def write_json(path: str, doc: dict, console) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    console.print(f"wrote {path}", highlight=False)


def interleaved(order: list, rounds: int, calls: int, warmup: int, comm, per_call: float = 1) -> dict:
    """``{name: [µs per round]}`` for the ``(name, fn)`` variants of ``order``:
    each round runs them in turn, in reverse order every other round; each
    runs ``warmup`` calls, a barrier, then ``calls`` timed calls. A round's
    figure is elapsed / (calls * per_call), the slowest rank's."""
    times = {name: [] for name, _ in order}
    for r in range(rounds):
        for name, fn in order if r % 2 == 0 else order[::-1]:
            for _ in range(warmup):
                fn()
            comm.Barrier()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append(max(comm.allgather((time.perf_counter() - start) / (calls * per_call))) * 1e6)
    return times
