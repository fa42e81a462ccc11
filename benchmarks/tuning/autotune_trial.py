"""Autotune's trial over blocks of calls, on and off, with one core kept busy.

    python benchmarks/tuning/autotune_trial.py [--runs 6] [--rounds 4] [--steps 10] [--warmup 12] [--out OUT]

The case: megatron with sequence parallelism (all-gather and reduce-scatter of
128 KiB), where per-call timing under load can pick gloo for a bucket and the
steps then take twice as long (docs/results/autotune.md). One busy-looping
process takes a core throughout. Each run starts the workload (2 ranks) in
modes baseline-mpi and autotuned, ``--rounds`` rounds (autotune learns from
scratch every round), once with the trial off (``MCRDL_AUTOTUNE_BLOCK_MS=0``)
and once on (100 ms, the default), the two alternating which goes first. Prints and
writes OUT.json: per setting, each autotuned round's throughput over the same
run's baseline-mpi (from their median steps: above 1, autotuned is faster),
the buckets gloo won, the trials and their verdicts.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import bucket_name, busy, environment, trials, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SETTINGS = {"trial off": "0", "trial on": "100"}


def workload(args, block_ms: str, path: str) -> dict:
    cmd = [sys.executable, "-m", "mcrdl.cli", "run", "-n", "2", sys.executable, "-m", "mcrdl.tools.workloads.megatron",
           "--sequence-parallel", "--mode", "baseline-mpi,autotuned", "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--rounds", str(args.rounds), "--json", path, "--quiet"]
    subprocess.run(cmd, check=True, env={**os.environ, "MCRDL_AUTOTUNE_BLOCK_MS": block_ms},
                   stdout=subprocess.DEVNULL)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def rounds(doc: dict) -> list[dict]:
    """Per round: autotuned's throughput over baseline-mpi's (their median steps' inverse ratio), and
    what autotune decided (rank 0)."""
    runs = doc["runs"]
    mpi = [r for r in runs if r["mode"] == "baseline-mpi"]
    auto = [r for r in runs if r["mode"] == "autotuned"]
    out = []
    for base, a in zip(mpi, auto):
        buckets = a["autotune"][0]["buckets"]
        out.append({"vs_mpi": statistics.median(base["step_s"]) / statistics.median(a["step_s"]),
                    "auto_step_ms": statistics.median(a["step_s"]) * 1e3,
                    "mpi_step_ms": statistics.median(base["step_s"]) * 1e3,
                    "gloo_won": [bucket_name(b) for b in buckets if b["winner"] == "gloo"],
                    "trials": trials(buckets),
                    "exploring_after_warmup": max(r["exploring_after_warmup"] for r in a["autotune"])})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=12)
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "autotune_trial"),
                    help="summary: OUT.json (default docs/results/autotune_trial)")
    ap.add_argument("--tmp", default=os.path.join(ROOT, "out", "autotune_trial"), help="the runs' JSON files")
    args = ap.parse_args()
    console = Console(width=150)
    os.makedirs(args.tmp, exist_ok=True)
    results: dict[str, list[dict]] = {name: [] for name in SETTINGS}
    hog, = busy()
    try:
        for run in range(args.runs):
            order = list(SETTINGS) if run % 2 == 0 else list(SETTINGS)[::-1]
            for name in order:
                got = rounds(workload(args, SETTINGS[name], os.path.join(args.tmp, f"{run}-{SETTINGS[name]}.json")))
                results[name] += got
                console.print(f"run {run + 1}/{args.runs} {name}: autotuned / baseline-mpi per round "
                              + " ".join(f"{r['vs_mpi']:.2f}" for r in got)
                              + "; gloo won: " + ("; ".join(w for r in got for w in r["gloo_won"]) or "none")
                              + f"; trials {sum(len(r['trials']) for r in got)}", highlight=False)
    finally:
        hog.terminate()
    t = Table(title=f"megatron-sp, 2 ranks, one core busy: autotuned vs baseline-mpi ({args.runs} runs x "
                    f"{args.rounds} rounds, {args.steps} steps after {args.warmup} warm-up steps)")
    for col in ("setting", "rounds", "median", "min", "rounds with a gloo pick", "their median",
                "trials", "refused", "still exploring"):
        t.add_column(col, justify="left" if col == "setting" else "right")
    summary = {}
    for name, rs in results.items():
        ratios = [r["vs_mpi"] for r in rs]
        gloo = [r["vs_mpi"] for r in rs if r["gloo_won"]]
        trials = [tr for r in rs for tr in r["trials"]]
        summary[name] = {"rounds": len(rs), "median_vs_mpi": statistics.median(ratios), "min_vs_mpi": min(ratios),
                         "rounds_with_gloo": len(gloo), "gloo_rounds_median_vs_mpi":
                             statistics.median(gloo) if gloo else None,
                         "trials": len(trials), "refused": sum(tr["refused"] for tr in trials),
                         "still_exploring": max(r["exploring_after_warmup"] for r in rs)}
        s = summary[name]
        t.add_row(name, str(s["rounds"]), f"{s['median_vs_mpi']:.3f}", f"{s['min_vs_mpi']:.3f}",
                  str(s["rounds_with_gloo"]), "-" if not gloo else f"{s['gloo_rounds_median_vs_mpi']:.3f}",
                  str(s["trials"]), str(s["refused"]), str(s["still_exploring"]))
    console.print(t)
    write_json(args.out + ".json", {"command": " ".join(["python", "benchmarks/tuning/autotune_trial.py", *sys.argv[1:]]),
                                    "environment": environment(), "summary": summary, "rounds": results}, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
