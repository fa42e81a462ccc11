"""Autotune's drift check: what it costs, and what it does when load appears.

    python benchmarks/tuning/drift.py [--rounds 3] [--steps 600] [--window 50] [--out docs/results/drift.json]

Runs 2-rank jobs of a small training step (matmuls, then a blocking 64 KiB
gradient all-reduce and a 64 B all-reduce) under in-situ autotune, with the
drift check off (``MCRDL_AUTOTUNE_DRIFT=0``) and on (``--window`` calls),
interleaved per round, in two conditions:

- ``idle``: the machine as it is. After the steps each job also times
  back-to-back 4 B all-reduces, where the check's per-call cost shows most.
- ``load``: from step ``steps/3`` a busy-looping process takes a core, so
  every rank's calls slow down after autotune decided on the idle machine.

Prints and writes OUT: per job, the median step time before and after the
load came (the last third of the steps, after any re-exploration), the
back-to-back call time, and each drift reopening (step, op, bytes, winner
before and after).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from rich.console import Console
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import busy, environment, write_json  # noqa: E402


def job(args) -> None:
    """One rank of one job; rank 0 writes ``args.result``."""
    import torch

    import mcrdl
    from mcrdl import api

    os.environ["MCRDL_AUTOTUNE_DRIFT"] = str(args.drift)
    mcrdl.init_process_group(autotune=True)
    rank = mcrdl.get_rank()
    tuner = api._runtime.autotune
    torch.manual_seed(0)
    a, w = torch.randn(128, 256), torch.randn(256, 256)
    grad, small = torch.ones(16384), torch.ones(16)
    load_at = args.steps // 3 if args.load else -1
    hog = None
    steps, events, seen = [], [], {}
    for step in range(args.steps):
        if step == load_at and rank == 0:
            hog, = busy()
        began = time.perf_counter()
        for _ in range(4):
            a = torch.tanh(a @ w) * 0.5
        mcrdl.all_reduce(grad)
        mcrdl.all_reduce(small)
        steps.append(time.perf_counter() - began)
        for _, _, buckets in tuner.groups:
            for (op, _, bkt), b in buckets.items():
                if len(b.reopened) > seen.get((op, bkt), 0):
                    seen[(op, bkt)] = len(b.reopened)
                    events.append({"step": step, "op": op, "min_bytes": 1 << (bkt - 1),
                                   "was": b.reopened[-1]["winner"], "base_us": b.reopened[-1]["base_us"],
                                   "now_us": b.reopened[-1]["now_us"], "bucket": b})
    for e in events:  # what the re-exploration chose
        e["then"] = e.pop("bucket").winner
    b2b = None
    if not args.load:
        t = torch.ones(1)
        for _ in range(500):
            mcrdl.all_reduce(t)
        began = time.perf_counter()
        for _ in range(args.calls):
            mcrdl.all_reduce(t)
        b2b = (time.perf_counter() - began) / args.calls
    if hog is not None:
        hog.terminate()
    if rank == 0:
        cut = args.steps // 3
        doc = {"drift": args.drift, "load": args.load,
               "before_ms": statistics.median(steps[cut // 2:cut]) * 1e3,
               "after_ms": statistics.median(steps[-cut:]) * 1e3,
               "b2b_4B_us": None if b2b is None else b2b * 1e6, "reopened": events,
               "winners": {f"{r['op']} {r['min_bytes']}-{r['max_bytes']}": r["winner"]
                           for r in tuner.report()}}
        with open(args.result, "w", encoding="utf-8") as f:
            json.dump(doc, f)
    mcrdl.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=600)
    ap.add_argument("--window", type=int, default=50, help="MCRDL_AUTOTUNE_DRIFT of the 'on' jobs")
    ap.add_argument("--calls", type=int, default=20000, help="back-to-back 4 B calls (idle jobs)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--drift", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--load", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.job:
        return job(args)
    console = Console(width=200)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for load in (False, True):
                for drift in (0, args.window):
                    result = os.path.join(tmp, "result.json")
                    cmd = [sys.executable, "-m", "mcrdl.cli", "run", "-n", "2", os.path.abspath(__file__), "--job",
                           "--drift", str(drift), "--steps", str(args.steps), "--calls", str(args.calls),
                           "--result", result] + (["--load"] if load else [])
                    console.print(f"round {rnd + 1}/{args.rounds}: {'load' if load else 'idle'}, "
                                  f"drift {drift or 'off'}", highlight=False)
                    subprocess.run(cmd, check=True, timeout=600)
                    with open(result, encoding="utf-8") as f:
                        runs.append({"round": rnd, **json.load(f)})
    t = Table(title=f"drift check: 2 ranks, {args.steps} steps, window {args.window} calls")
    for col in ("round", "condition", "drift", "step before (ms)", "step after (ms)", "4 B b2b (us)",
                "reopened (step op bytes: before -> after)"):
        t.add_column(col)
    for r in runs:
        t.add_row(str(r["round"] + 1), "load from step %d" % (args.steps // 3) if r["load"] else "idle",
                  str(r["drift"] or "off"), f"{r['before_ms']:.3f}", f"{r['after_ms']:.3f}",
                  "-" if r["b2b_4B_us"] is None else f"{r['b2b_4B_us']:.2f}",
                  "; ".join(f"{e['step']} {e['op']} {e['min_bytes']}: {e['was']} -> {e['then']} "
                            f"({e['base_us']} -> {e['now_us']} us)" for e in r["reopened"]) or "-")
    console.print(t)
    if args.out:
        write_json(args.out, {"command": " ".join(sys.argv), "environment": environment(), "runs": runs}, console)


if __name__ == "__main__":
    main()
