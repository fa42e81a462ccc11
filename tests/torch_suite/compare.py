#!/usr/bin/env python
"""Compare run_suite.py's JSON results of gloo and of mcrdl; write a markdown report.

::

    python tests/torch_suite/compare.py out/record/torch_suite/*.json --out docs/results/torch_suite.md

Each mcrdl result is compared with the gloo result of the same world size. The
report gives the counts per (backend, route, world size), the commands that made
the results, then per mcrdl result the tests that pass on gloo but not on mcrdl
(failed/error listed one by one with mcrdl's reason, skipped grouped by reason)
and the tests that pass on mcrdl but not on gloo. ``--notes FILE`` appends a
hand-written section (e.g. the diagnosis) verbatim.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections import defaultdict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

STATUSES = ("passed", "failed", "error", "skipped")


def load(paths: Sequence) -> List[dict]:
    return [json.loads(Path(p).read_text()) for p in paths]


def label(result: dict) -> str:
    route = "" if result["route"] == "gloo" else f" ({result['route']})"
    return f"{result['backend']}{route}"


def lost(base: dict, other: dict) -> Dict[str, dict]:
    """Tests that pass in ``base`` and were run in ``other`` without passing: name -> other's entry."""
    return {name: other["tests"][name] for name, entry in sorted(base["tests"].items())
            if entry["status"] == "passed" and name in other["tests"]
            and other["tests"][name]["status"] != "passed"}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _lost_section(base: dict, other: dict) -> List[str]:
    name = f"{label(other)}, {other['world_size']} ranks"
    out = [f"### {name}", ""]
    gone = lost(base, other)
    broken = {t: e for t, e in gone.items() if e["status"] != "skipped"}
    skipped = {t: e for t, e in gone.items() if e["status"] == "skipped"}
    out.append(f"Pass on gloo but not on mcrdl: {len(broken)} failed or errored, "
               f"{len(skipped)} skipped.")
    out.append("")
    if broken:
        out += ["| test | mcrdl | reason |", "|---|---|---|"]
        out += [f"| `{t}` | {e['status']} | {_cell(e['reason'])} |" for t, e in broken.items()]
        out.append("")
    if skipped:
        by_reason = defaultdict(list)
        for t, e in skipped.items():
            by_reason[e["reason"]].append(t)
        out += ["Skipped on mcrdl, by reason:", ""]
        for reason, tests in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            out.append(f"* {_cell(reason)} ({len(tests)}): " + ", ".join(f"`{t}`" for t in tests))
        out.append("")
    warned = {t: e for t, e in other["tests"].items() if "warning" in e
              and "warning" not in base["tests"].get(t, {})}
    if warned:
        out += ["Pass, but another rank exited abnormally (torch checks rank 0's exit code only):", "",
                "| test | warning |", "|---|---|"]
        out += [f"| `{t}` | {_cell(e['warning'])} |" for t, e in sorted(warned.items())]
        out.append("")
    gained = lost(other, base)
    out.append(f"Pass on mcrdl but not on gloo: {len(gained)}.")
    out.append("")
    if gained:
        out += ["| test | gloo | gloo's reason |", "|---|---|---|"]
        out += [f"| `{t}` | {e['status']} | {_cell(e['reason'])} |" for t, e in gained.items()]
        out.append("")
    return out


def report(results: Sequence[dict], command: Optional[str] = None,
           notes: Optional[str] = None) -> str:
    order = {"gloo": 0, "stand-in": 1, "plugin": 2}
    results = sorted(results, key=lambda r: (r["world_size"], order.get(r["route"], 3)))
    out = ["# PyTorch's distributed test suite: gloo against mcrdl", ""]
    out += ["`torch.testing._internal.distributed.distributed_test.DistributedTest._DistTestBase`, "
            "run by tests/torch_suite/run_suite.py (see its docstring for the routes).", ""]
    out += ["Commands:", "", "```"]
    out += [r["command"] for r in results]
    if command:
        out.append(command)
    out += ["```", ""]
    out += ["| backend (route) | ranks | " + " | ".join(STATUSES) + " | total | minutes | torch | mcrdl tree |",
            "|---|---|" + "---|" * (len(STATUSES) + 5)]
    for r in results:
        counts = " | ".join(str(r["counts"][s]) for s in STATUSES)
        out.append(f"| {label(r)} | {r['world_size']} | {counts} | {len(r['tests'])} | "
                   f"{r['duration_s'] / 60:.1f} | {r['torch']} | {r['mcrdl_tree']} |")
    out.append("")
    gloo = {r["world_size"]: r for r in results if r["backend"] == "gloo"}
    mcrdl = [r for r in results if r["backend"] == "mcrdl"]
    if mcrdl:
        out += ["## Differences from gloo", ""]
    for r in mcrdl:
        base = gloo.get(r["world_size"])
        if base is None:
            out += [f"### {label(r)}, {r['world_size']} ranks", "", "No gloo result at this world size.", ""]
        else:
            out += _lost_section(base, r)
    if notes:
        out += [notes.rstrip(), ""]
    return "\n".join(out)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", help="run_suite.py JSON files")
    p.add_argument("--out", help="markdown file to write (default: stdout)")
    p.add_argument("--notes", help="markdown file appended verbatim")
    args = p.parse_args(argv)
    notes = Path(args.notes).read_text() if args.notes else None
    text = report(load(args.results), shlex.join(["python", "tests/torch_suite/compare.py",
                                                   *(argv if argv is not None else sys.argv[1:])]),
                  notes)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
