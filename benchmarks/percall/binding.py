"""Ranks pinned to cores or not: `python benchmarks/percall/binding.py [--repeats 3]`.

Launches the same small `mcrdl bench -n 2` sweep (p2p, all_reduce and
all_to_all at 4 B, 4 KiB and 64 KiB; every variant; 9 rounds) alternately with
`--bind none` and `--bind core`, `--repeats` times each. Per (op, size,
variant) and binding it reports the median result over the launches and the
share of slow rounds (a round over 3x the fastest round of that point in any
launch), and per launch how many points the selection ('mcrdl') ran within 5%
of the fastest forced backend.
"""
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
from _record import environment, write_json  # noqa: E402

BINDINGS = ("none", "core")
SWEEP = ["--ops", "p2p,all_reduce,all_to_all", "--sizes", "4,4K,64K", "--rounds", "9"]

p = argparse.ArgumentParser()
p.add_argument("--repeats", type=int, default=3)
p.add_argument("--json")
args = p.parse_args()
console = Console()
mcrdl_cli = os.path.join(os.path.dirname(sys.executable), "mcrdl")
runs = {b: [] for b in BINDINGS}
with tempfile.TemporaryDirectory() as tmp:
    for rep in range(args.repeats):
        for bind in BINDINGS:
            console.print(f"launch {rep + 1}/{args.repeats}, --bind {bind}", highlight=False)
            out = os.path.join(tmp, f"{bind}-{rep}.json")
            subprocess.run([mcrdl_cli, "bench", "-n", "2", "--bind", bind, *SWEEP, "--json", out],
                           check=True, stdout=subprocess.DEVNULL)
            with open(out) as f:
                runs[bind].append({(r["op"], r["bytes"], r["variant"]): r
                                   for r in json.load(f)["results"]})

points = list(runs["none"][0])
fastest = {k: min(min(run[k]["round_max_us"]) for b in BINDINGS for run in runs[b]) for k in points}
table = Table(title="µs per call (median over launches) and share of slow rounds")
for col in ("op", "bytes", "variant", "unpinned", "slow", "pinned", "slow "):
    table.add_column(col, justify="right")
rows = []
for k in points:
    row = {"op": k[0], "bytes": k[1], "variant": k[2]}
    for bind in BINDINGS:
        rounds = [t for run in runs[bind] for t in run[k]["round_max_us"]]
        row[bind] = {"us": statistics.median(run[k]["max_us"] for run in runs[bind]),
                     "slow_rounds": sum(t > 3 * fastest[k] for t in rounds) / len(rounds)}
    rows.append(row)
    table.add_row(k[0], str(k[1]), k[2], f"{row['none']['us']:.1f}", f"{row['none']['slow_rounds']:.0%}",
                  f"{row['core']['us']:.1f}", f"{row['core']['slow_rounds']:.0%}")
console.print(table)

within = {}
for bind in BINDINGS:
    within[bind] = []
    for run in runs[bind]:
        sel = [(op, size) for op, size, v in points if v == "mcrdl"]
        ok = sum(run[(op, size, "mcrdl")]["max_us"] <=
                 1.05 * min(run[(op, size, b)]["max_us"] for b in ("mpi", "gloo")) for op, size in sel)
        within[bind].append(ok)
    console.print(f"--bind {bind}: selection within 5% of the fastest forced backend at "
                  f"{', '.join(map(str, within[bind]))} of {len(sel)} points (per launch)", highlight=False)
if args.json:
    write_json(args.json, {"environment": environment(), "sweep": SWEEP, "repeats": args.repeats,
                           "points": rows, "selection_within_5pct": within}, console)
