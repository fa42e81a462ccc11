"""Soak: many short mixed MPI + gloo jobs, every way a job ends, counting exit codes.

    python benchmarks/faults/soak.py --jobs 512 [--ranks 2 4] [--routes api torch] [--load 1] [--out OUT]

Each job (benchmarks/faults/soak_job.py under `mcrdl run`) starts mcrdl through its
own API or through torch.distributed's init_process_group("mcrdl") with a DDP
step, does mixed async work on MPI and gloo, then ends one of four ways:
destroy_process_group, the exit handler, an exception on every rank, or
SIGTERM to `mcrdl run`; with all async work completed or some still
outstanding. Jobs cycle through routes x ranks x endings x outstanding. A
job is clean when its exit code is the one its ending calls for
(0, 0, 1, 143), no rank aborted ("terminate called", SIGABRT, core dump) and no
rank process is left afterwards. ``--load N`` keeps N busy-looping processes
running meanwhile (a loaded machine). Writes OUT.json and OUT.md.
"""
import argparse
import itertools
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import busy, environment, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOB = os.path.join(ROOT, "benchmarks", "faults", "soak_job.py")
ENDINGS = {"destroy": 0, "atexit": 0, "exception": 1, "sigterm": 128 + signal.SIGTERM}
ABORT = re.compile(r"terminate called|core dumped|signal 6|SIGABRT|Aborted")


def _rank_pids(marker: str) -> list[int]:
    """Processes still running soak_job.py for this job (matched by its mark directory)."""
    out = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if int(p) != os.getpid()]


def run_job(route: str, nprocs: int, ending: str, outstanding: bool, timeout: float) -> dict:
    """One job; its outcome."""
    with tempfile.TemporaryDirectory(prefix="mcrdl-soak-") as marks:
        cmd = [sys.executable, "-m", "mcrdl.cli", "run", "-n", str(nprocs), "--timeout", str(timeout),
               JOB, route, ending, "1" if outstanding else "0", marks]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=ROOT)
        if ending == "sigterm":
            while (len([f for f in os.listdir(marks) if f.startswith("ready")]) < nprocs
                   and proc.poll() is None and time.monotonic() - start < timeout):
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=timeout + 30)
        seconds = time.monotonic() - start
        left = _rank_pids(marks)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    abort = ABORT.search(out)
    code = proc.returncode
    clean = code == ENDINGS[ending] and not abort and not left
    return {"route": route, "ranks": nprocs, "ending": ending, "outstanding": outstanding, "exit_code": code,
            "seconds": round(seconds, 2), "abort": abort.group(0) if abort else None,
            "left_running": len(left), "clean": clean, "tail": None if clean else out[-2000:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=512)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--routes", nargs="+", default=["api", "torch"], choices=["api", "torch"])
    ap.add_argument("--load", type=int, default=1, help="busy-looping processes meanwhile")
    ap.add_argument("--timeout", type=float, default=120, help="per job (s)")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "soak"))
    args = ap.parse_args()
    console = Console()
    cases = itertools.cycle(itertools.product(args.routes, args.ranks, ENDINGS, (False, True)))
    hogs = busy(args.load)
    results = []
    uptime_before = open("/proc/loadavg").read().split()[:3]
    try:
        with Progress(console=console) as progress:
            task = progress.add_task("soak", total=args.jobs)
            for _ in range(args.jobs):
                route, nprocs, ending, outstanding = next(cases)
                r = run_job(route, nprocs, ending, outstanding, args.timeout)
                results.append(r)
                if not r["clean"]:
                    progress.console.print(f"[red]not clean[/red]: {route}, {nprocs} ranks, {ending}, "
                                           f"outstanding={outstanding}: exit {r['exit_code']}, abort {r['abort']}, "
                                           f"{r['left_running']} left running")
                progress.advance(task)
    finally:
        for h in hogs:
            h.terminate()
    table = Table(title=f"soak: {len(results)} jobs, {args.load} busy process(es)")
    for col in ("route", "ranks", "ending", "outstanding", "jobs", "clean", "exit codes", "aborts",
                "left running", "median s"):
        table.add_column(col)
    rows = []
    case = lambda r: (r["route"], r["ranks"], r["ending"], r["outstanding"])  # noqa: E731
    for key, group in itertools.groupby(sorted(results, key=case), key=case):
        group = list(group)
        secs = sorted(r["seconds"] for r in group)
        row = [key[0], str(key[1]), key[2], str(key[3]), str(len(group)), str(sum(r["clean"] for r in group)),
               " ".join(f"{c}x{n}" for c, n in sorted(Counter(r["exit_code"] for r in group).items())),
               str(sum(bool(r["abort"]) for r in group)), str(sum(r["left_running"] for r in group)),
               f"{secs[len(secs) // 2]:.1f}"]
        rows.append(row)
        table.add_row(*row)
    console.print(table)
    clean = sum(r["clean"] for r in results)
    console.print(f"{clean}/{len(results)} clean")
    command = "python benchmarks/faults/soak.py " + " ".join(sys.argv[1:])
    doc = {"command": command, "environment": environment(), "loadavg_before": uptime_before,
           "clean": clean, "jobs": len(results), "results": results}
    write_json(args.out + ".json", doc, console)
    with open(args.out + ".md", "w") as f:
        f.write(f"# Soak: {len(results)} short mixed MPI + gloo jobs\n\n```bash\n{command}\n```\n\n"
                f"{doc['environment']['date']}, {os.cpu_count()} CPUs, {args.load} busy-looping "
                f"process(es) meanwhile; load average before {' '.join(uptime_before)}, at the end "
                f"{' '.join(f'{x:.2f}' for x in doc['environment']['loadavg_at_end'])}.\n\n"
                f"**{clean}/{len(results)} clean** (exit code as the ending calls for: destroy 0, "
                f"atexit 0, exception 1, sigterm 143; no abort; no rank left running).\n\n"
                "| " + " | ".join(c.header for c in table.columns) + " |\n"
                "|" + "---|" * len(table.columns) + "\n"
                + "".join("| " + " | ".join(r) + " |\n" for r in rows))
        for r in results:
            if not r["clean"]:
                f.write(f"\n## Not clean: {r['route']}, {r['ranks']} ranks, {r['ending']}, "
                        f"outstanding={r['outstanding']} (exit {r['exit_code']})\n\n```\n{r['tail']}\n```\n")
    console.print(f"wrote {args.out}.md")
    sys.exit(0 if clean == len(results) else 1)


if __name__ == "__main__":
    main()
