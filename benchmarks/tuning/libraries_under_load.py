"""Each CPU library's all_reduce idle and under load, in alternated runs.

    python benchmarks/tuning/libraries_under_load.py [--runs 3] [--sizes 4,1K,64K,1M,16M] [--out OUT]

A training step keeps the cores busy with compute while gradients are reduced,
so a table tuned on an idle machine may pick the wrong library then. This runs
``mcrdl bench -n 2`` over every live CPU library (each forced, plus ``mcrdl``
with the idle machine's table) ``--runs`` times on the idle machine and as
many times with one busy-looping process per core (``benchmarks/_record.py``'s
``busy``), alternating idle and loaded runs, and reports each library's median
time per size and condition, its ratio to MPI's and which library wins where.
Writes OUT.json (default docs/results/libraries_under_load.json).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import busy, environment, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONDITIONS = ("idle", "every core busy")


def bench(args, out: str, table: str) -> list[dict]:
    cmd = [sys.executable, "-m", "mcrdl.cli", "bench", "-n", "2", "--ops", "all_reduce", "--sizes", args.sizes,
           "--rounds", str(args.rounds), "--check", "--json", out]
    if table:
        cmd += ["--table", table]
    print("+", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    with open(out, encoding="utf-8") as f:
        return json.load(f)["results"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3, help="bench runs per condition, alternated (default 3)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per bench run (default 5)")
    ap.add_argument("--sizes", default="4,1K,64K,1M,16M")
    ap.add_argument("--table", default=os.path.join(ROOT, "docs", "results", "tuning-2ranks.json"),
                    help="the idle machine's table, for the 'mcrdl' variant (default: the recorded one)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "libraries_under_load"),
                    help="writes OUT.json")
    args = ap.parse_args()
    console = Console(width=160)
    us: dict = {}  # (condition, variant, bytes) -> [max_us per run]
    picked: dict = {}  # (condition, bytes) -> backends the table's selection ran
    cores = os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as tmp:
        for run in range(args.runs):
            for condition in (CONDITIONS if run % 2 == 0 else CONDITIONS[::-1]):
                hogs = busy(cores) if condition != "idle" else []
                try:
                    rows = bench(args, os.path.join(tmp, f"{run}-{len(hogs)}.json"), args.table)
                finally:
                    for h in hogs:
                        h.terminate()
                for r in rows:
                    us.setdefault((condition, r["variant"], r["bytes"]), []).append(r["max_us"])
                    if r["variant"] == "mcrdl":
                        picked.setdefault((condition, r["bytes"]), set()).add(r["backend"])
    sizes = sorted({b for _, _, b in us})
    variants = list(dict.fromkeys(v for _, v, _ in us))
    libraries = [v for v in variants if v != "mcrdl" and not v.startswith("raw-")]
    med = {k: statistics.median(v) for k, v in us.items()}
    rows = []
    for condition in CONDITIONS:
        t = Table(title=f"all_reduce fp32, 2 ranks, {condition}: median of {args.runs} runs' per-call µs "
                        f"(x MPI's)")
        for col in ("bytes", *variants, "fastest", "table picked"):
            t.add_column(col, justify="right")
        for b in sizes:
            mpi = med[condition, "mpi", b]
            cells = {v: med[condition, v, b] for v in variants if (condition, v, b) in med}
            fastest = min((v for v in libraries if v in cells), key=cells.get)
            chosen = sorted(picked.get((condition, b), ()))
            rows.append({"condition": condition, "bytes": b, "us": cells, "fastest": fastest,
                         "table_picked": chosen})
            t.add_row(str(b), *(f"{cells[v]:.1f} ({cells[v] / mpi:.2f}x)" if v in cells else "-" for v in variants),
                      fastest, ",".join(chosen))
        console.print(t)
    doc = {"command": " ".join(["python", "benchmarks/tuning/libraries_under_load.py", *sys.argv[1:]]),
           "runs": args.runs, "rounds": args.rounds, "load": f"{cores} busy-looping processes (one per core)",
           "table": os.path.relpath(args.table, ROOT), "environment": environment(), "results": rows}
    write_json(args.out + ".json", doc, console)


if __name__ == "__main__":
    main()
