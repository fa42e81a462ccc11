"""In-situ autotune against the offline-tuned table and the single backends.

    python benchmarks/tuning/autotune.py [--rounds 5] [--steps 10] [--warmup 12] [--out OUT] [--runs RUNS]

Runs ``mcrdl demo --no-variants`` (every workload, 2 ranks) twice, modes interleaved per
round: on the machine as it is, with ``tuned`` using the quick tune made
then; and again with one busy-looping process taking a core, where ``tuned``
still uses the idle machine's table while ``autotuned`` learns under the load.
Every mode runs the same warm-up steps (enough for autotune to finish
exploring: the runs record whether it did) and the same timed steps. Prints
and writes OUT.json (the demo runs stay in RUNS/idle and RUNS/loaded): per condition and workload, samples/s of tuned,
autotuned and the best single backend, their ratios, the exploration's cost
(each rank's timed calls on losing backends beyond the winner's median) and
where autotune chose other backends than the table.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import busy, environment, trials, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODES = "baseline-gloo,baseline-mpi,tuned,autotuned"


def demo(args, out: str, table=None) -> None:
    cmd = [sys.executable, "-m", "mcrdl.cli", "demo", "--modes", MODES, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--out", out, "--no-variants"]
    if table:
        cmd += ["--table", table]
    print("+", " ".join(cmd[2:]), flush=True)
    subprocess.run(cmd, check=True)


def picks(doc: dict, mode: str) -> dict:
    """(op, lookup bytes) -> backend, from the first run of ``mode`` (rank 0's view)."""
    run = next(r for r in doc["runs"] if r["mode"] == mode)
    return {(op, nbytes): backend for op, nbytes, backend, _ in run["profile"]}


def summarise(out: str) -> list[dict]:
    with open(os.path.join(out, "results.json"), encoding="utf-8") as f:
        results = json.load(f)
    rows = []
    for name in results["workloads"]:
        with open(os.path.join(out, f"{name}.json"), encoding="utf-8") as f:
            doc = json.load(f)
        sps = {m: s["samples_per_s"] for m, s in doc["summary"].items()}
        best = max((m for m in sps if m.startswith("baseline-")), key=sps.get)
        autotuned = [r["autotune"] for r in doc["runs"] if r["mode"] == "autotuned"]
        tuned, learned = picks(doc, "tuned"), picks(doc, "autotuned")
        rows.append({
            "workload": name, "unit": doc["sample_unit"], "tuned": sps["tuned"], "autotuned": sps["autotuned"],
            "best_single": best, "best_single_sps": sps[best],
            "autotuned_vs_tuned": sps["autotuned"] / sps["tuned"], "autotuned_vs_best": sps["autotuned"] / sps[best],
            "exploration_excess_ms": max(max(r["exploration_excess_s"] for r in ranks) for ranks in autotuned) * 1e3,
            "buckets": max(len(ranks[0]["buckets"]) for ranks in autotuned),
            "exploring_after_warmup": max(r["exploring_after_warmup"] for ranks in autotuned for r in ranks),
            "differs_from_table": sorted(f"{op} {nbytes} B: table {tuned[k]}, autotune {learned[k]}"
                                         for k in tuned if k in learned and tuned[k] != learned[k]
                                         for op, nbytes in [k]),
            "buckets_learned": autotuned[0][0]["buckets"],
            "trials": [{"run": i, **tr} for i, ranks in enumerate(autotuned) for tr in trials(ranks[0]["buckets"])]})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=12, help="untimed steps of every mode (default 12)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "autotune"),
                    help="summary: OUT.json (default docs/results/autotune)")
    ap.add_argument("--runs", default=os.path.join(ROOT, "out", "autotune"),
                    help="the demo runs' directories, RUNS/idle and RUNS/loaded (default out/autotune)")
    args = ap.parse_args()
    console = Console(width=150)
    idle, loaded = (os.path.join(args.runs, c) for c in ("idle", "loaded"))
    demo(args, idle)
    hog, = busy()
    try:
        demo(args, loaded, table=os.path.join(idle, "table.json"))
    finally:
        hog.terminate()
    doc = {"command": " ".join(["python", "benchmarks/tuning/autotune.py", *sys.argv[1:]]), "modes": MODES,
           "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "environment": environment(),
           "conditions": {"idle": summarise(idle), "one core busy": summarise(loaded)}}
    t = Table(title=f"autotuned vs tuned (idle machine's table) vs best single backend: 2 ranks, "
                    f"{args.rounds} rounds x {args.steps} steps after {args.warmup} warm-up steps")
    for col in ("condition", "workload", "tuned", "autotuned", "best single", "auto/tuned", "auto/best",
                "explore ms", "still exploring", "trials (refused)", "autotune differs from the table"):
        t.add_column(col, justify="left" if col in ("condition", "workload", "autotune differs from the table")
                     else "right")
    for cond, rows in doc["conditions"].items():
        for r in rows:
            t.add_row(cond, r["workload"], f"{r['tuned']:.1f}", f"{r['autotuned']:.1f}",
                      f"{r['best_single_sps']:.1f} ({r['best_single'][9:]})", f"{r['autotuned_vs_tuned']:.3f}",
                      f"{r['autotuned_vs_best']:.3f}", f"{r['exploration_excess_ms']:.1f}",
                      str(r["exploring_after_warmup"]),
                      f"{len(r['trials'])} ({sum(tr['refused'] for tr in r['trials'])})",
                      "; ".join(r["differs_from_table"]) or "-")
        t.add_section()
    console.print(t)
    write_json(args.out + ".json", doc, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
