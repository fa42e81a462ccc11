"""A rank killed or frozen mid-training in real frameworks on "mcrdl":
`python benchmarks/faults/faults_frameworks.py`.

Each case runs an example of examples/frameworks/ (FSDP2, DeepSpeed ZeRO-3),
unchanged, through tests/jobs/fault_inject.py under `mcrdl run` (mpiexec) or
`mcrdl run --launcher torchrun`, at 2 and 4 ranks, with enough steps to still
be training when, ``--delay`` seconds after torch.distributed is initialized,
rank 1 is SIGKILLed (a crash) or SIGSTOPped (a node frozen in I/O or swap).
MCRDL_FROZEN_S keeps its default (15 s) unless ``--frozen-s`` is given.
Per case it records, from the moment of the fault (the victim's own clock
line; the harness timestamps each output line as it arrives):
when the first survivor's message named the victim (``rank 1 died`` / ``rank 1
is frozen``), when the launcher returned, its exit status, and how many of the
job's processes were left afterwards (then killed). Writes
docs/results/faults_frameworks.md and a JSON file beside it.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import threading
import time

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import environment, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = {"fsdp2": ("fsdp2.py",), "deepspeed_zero3": ("deepspeed_zero.py", "--stage", "3")}
INJECT = os.path.join(ROOT, "tests", "jobs", "fault_inject.py")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu"}


def left_over() -> list[str]:
    out = subprocess.run(["pgrep", "-f", INJECT], capture_output=True, text=True).stdout.split()
    return [p for p in out if p != str(os.getpid())]


def case(example, launcher, action, nprocs, delay, limit, env) -> dict:
    """One job with one fault; the times are seconds after the fault."""
    script, *args = EXAMPLES[example]
    cmd = [sys.executable, "-m", "mcrdl.cli", "run", "--launcher", launcher, "-n", str(nprocs),
           "--timeout", str(limit), INJECT, action, "1", str(delay),
           os.path.join(ROOT, "examples", "frameworks", script), *args, "--backend", "mcrdl",
           "--steps", "1000000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=ROOT, start_new_session=True)
    lines = []

    def read():
        for line in proc.stdout:
            lines.append((time.time(), line))
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc.wait()
    ended = time.time()
    reader.join(timeout=10)
    fault = next((float(m.group(1)) for _, l in lines if (m := re.search(r"FAULT rank 1 \w+ at ([\d.]+)", l))), None)
    named = next((t for t, l in lines if re.search(r"rank 1 (died|is frozen)", l)), None)
    left = left_over()
    for pid in left:
        subprocess.run(["kill", "-9", pid])
    return {"example": example, "launcher": launcher, "fault": action, "ranks": nprocs,
            "command": shlex.join(cmd), "exit": proc.returncode,
            "named_s": None if fault is None or named is None else round(named - fault, 2),
            "ended_s": None if fault is None else round(ended - fault, 2),
            "left": len(left), "message": next((l.strip() for _, l in lines
                                                if re.search(r"rank 1 (died|is frozen)", l)), None),
            "output_tail": "".join(l for _, l in lines)[-2000:]}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", default=",".join(EXAMPLES))
    p.add_argument("--launchers", default="mpiexec,torchrun")
    p.add_argument("--faults", default="kill,freeze")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--delay", type=float, default=8.0, help="seconds after init before the fault")
    p.add_argument("--frozen-s", type=float, default=None, help="MCRDL_FROZEN_S (default: mcrdl's, 15)")
    p.add_argument("--limit", type=int, default=300, help="mcrdl run --timeout per job")
    p.add_argument("--out", default="docs/results/faults_frameworks.md")
    args = p.parse_args()
    console = Console()
    env = dict(ENV)
    if args.frozen_s is not None:
        env["MCRDL_FROZEN_S"] = str(args.frozen_s)
    grid = [(e, l, f, int(n)) for e in args.examples.split(",") for l in args.launchers.split(",")
            for f in args.faults.split(",") for n in args.ranks.split(",")]
    load_before = os.getloadavg()
    rows = []
    with Progress(console=console) as progress:
        task = progress.add_task("faults", total=len(grid))
        for example, launcher, fault, n in grid:
            progress.update(task, description=f"{example} {launcher} {fault} {n} ranks")
            rows.append(case(example, launcher, fault, n, args.delay, args.limit, env))
            progress.advance(task)

    table = Table("example", "launcher", "fault", "ranks", "named (s)", "ended (s)", "exit", "left")
    for r in rows:
        table.add_row(r["example"], r["launcher"], r["fault"], str(r["ranks"]), str(r["named_s"]),
                      str(r["ended_s"]), str(r["exit"]), str(r["left"]))
    console.print(table)
    doc = {"environment": environment(), "load_before": load_before, "args": vars(args), "cases": rows}
    write_json(os.path.splitext(args.out)[0] + ".json", doc, console)
    write_page(doc, args.out)
    console.print(f"wrote {args.out}", highlight=False)


def write_page(doc: dict, out: str) -> None:
    """The results page from a run's JSON document."""
    args, env = doc["args"], doc["environment"]
    frozen = args["frozen_s"] if args["frozen_s"] is not None else "15 (default)"
    md = ["# A rank killed or frozen mid-training (FSDP2, DeepSpeed ZeRO-3)", "",
          "```bash", "python benchmarks/faults/faults_frameworks.py", "```", "",
          "Each example runs unchanged on \"mcrdl\" under `tests/jobs/fault_inject.py`, which "
          "SIGKILLs or SIGSTOPs rank 1 a fixed time after init (see the benchmark's docstring).", "",
          f"- {env['date']}, {env['cpus']} CPUs, load average before {doc['load_before'][0]:.2f}, "
          f"after {env['loadavg_at_end'][0]:.2f}; nothing else running",
          f"- fault {args['delay']:g} s after init, on rank 1; MCRDL_FROZEN_S = {frozen}; "
          f"`mcrdl run --timeout {args['limit']}`",
          "- named: the first survivor line naming rank 1, seconds after the fault (none: the "
          "launcher ended the job first); ended: the launcher's return; exit: its status; left: "
          "the job's processes still alive after it returned",
          "", "## Result", "",
          "| example | launcher | fault | ranks | named (s) | ended (s) | exit | left | first survivor's line |",
          "|---|---|---|---|---|---|---|---|---|"]
    for r in doc["cases"]:
        m = re.search(r"mcrdl: rank \d+: rank 1 (died|is frozen)[^)]*\)", r["message"] or "")
        md.append(f"| {r['example']} | {r['launcher']} | {r['fault']} | {r['ranks']} | "
                  f"{'none' if r['named_s'] is None else r['named_s']} | {r['ended_s']} | {r['exit']} | "
                  f"{r['left']} | {'`' + m.group(0) + '`' if m else ''} |")
    with open(out, "w") as f:
        f.write("\n".join(md) + "\n")


if __name__ == "__main__":
    main()
