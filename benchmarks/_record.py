"""What the recorded benchmarks write beside their figures: the environment
and the JSON file itself."""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform

import torch

import mcrdl


def environment(**versions: str) -> dict:
    """Versions (torch, mcrdl, python and ``versions``), date, host, CPUs and load."""
    return {"versions": {"torch": torch.__version__, "mcrdl": mcrdl.__version__,
                         "python": platform.python_version(), **versions},
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "hostname": platform.node(), "cpus": os.cpu_count(),
            "loadavg_at_end": os.getloadavg()}


def write_json(path: str, doc: dict, console) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    console.print(f"wrote {path}", highlight=False)
