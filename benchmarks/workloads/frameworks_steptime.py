"""Step time of real frameworks on "mcrdl" vs gloo: `python benchmarks/workloads/frameworks_steptime.py`.

Runs each example of examples/frameworks/ under each launcher (``--launchers``:
`mcrdl run -n 2`, i.e. mpiexec, and `mcrdl run --launcher torchrun -n 2`, where
mcrdl starts MPI over torchrun's store) with ``--backend gloo``, ``--backend
mcrdl`` (no table: every op on MPI, the default library) and ``--backend mcrdl``
with ``--table`` (``MCRDL_TUNING_TABLE``: each op on the library the table picks),
alternating (the order of the launches reverses every round), for ``--rounds`` rounds. Per launch: the median of rank 0's step times after
``--warmup`` steps; per example, launcher and backend: the median of those over
the rounds. Also checks that each round's launches gave bitwise identical losses. A failed launch is repeated once and listed
in the doc (a second failure stops the run). Writes docs/results/frameworks.md (command,
load, table) and a JSON file beside it. DeepSpeed examples are left out, and
said so, when deepspeed does not import.
"""
import argparse
import importlib.metadata
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import environment, write_json  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = {
    "deepspeed_moe_top1": ("deepspeed_moe.py", "--k", "1"),
    "deepspeed_moe_top2": ("deepspeed_moe.py", "--k", "2"),
    "deepspeed_zero1": ("deepspeed_zero.py", "--stage", "1"),
    "deepspeed_zero2": ("deepspeed_zero.py", "--stage", "2"),
    "deepspeed_zero3": ("deepspeed_zero.py", "--stage", "3"),
    "fsdp2": ("fsdp2.py",),
    "dtensor_mesh_tp": ("dtensor_mesh.py", "--mode", "tp"),
    "dtensor_mesh_hsdp": ("dtensor_mesh.py", "--mode", "hsdp"),
    "lightning_ddp": ("lightning_ddp.py",),
}
#: the variants: name -> (--backend, with the tuning table)
BACKENDS = {"gloo": ("gloo", False), "mcrdl": ("mcrdl", False), "tuned": ("mcrdl", True)}
LAUNCHERS = ("mpiexec", "torchrun")
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", "DS_ACCELERATOR": "cpu"}


def uptime():
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def launch(nprocs, script, args, variant, steps, launcher, table):
    """One `mcrdl run` job: (rank 0's RESULT or None, the job's wall time, command, output)."""
    backend, tuned = BACKENDS[variant]
    cmd = [sys.executable, "-m", "mcrdl.cli", "run", "--launcher", launcher, "-n", str(nprocs), "--timeout", "600",
           os.path.join(ROOT, "examples", "frameworks", script), *args, "--backend", backend,
           "--steps", str(steps)]
    env = {**ENV, "MCRDL_TUNING_TABLE": table} if tuned else ENV
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    lines = [l[len("RESULT "):] for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    ok = proc.returncode == 0 and len(lines) == 1
    return json.loads(lines[0]) if ok else None, wall, shlex.join(cmd), proc.stdout + proc.stderr


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("-n", "--nprocs", type=int, default=2)
    p.add_argument("--only", help="comma-separated example names (default: all)")
    p.add_argument("--launchers", default=",".join(LAUNCHERS), help="comma-separated, of: " + ", ".join(LAUNCHERS))
    p.add_argument("--out", default="docs/results/frameworks.md")
    p.add_argument("--json", default="docs/results/frameworks.json")
    p.add_argument("--table", default="docs/results/tuning-2ranks.json", help="the 'tuned' variant's tuning table")
    args = p.parse_args()
    if args.rounds < 1 or not 0 <= args.warmup < args.steps:
        p.error("need --rounds >= 1 and 0 <= --warmup < --steps")
    console = Console(width=max(Console().width, 140))
    names = args.only.split(",") if args.only else list(EXAMPLES)
    unknown = set(names) - set(EXAMPLES)
    if unknown:
        p.error(f"unknown examples {sorted(unknown)} (known: {', '.join(EXAMPLES)})")
    launchers = args.launchers.split(",")
    if not launchers or set(launchers) - set(LAUNCHERS):
        p.error(f"--launchers takes {', '.join(LAUNCHERS)}")
    skipped = []
    for framework in ("deepspeed", "lightning"):
        if subprocess.run([sys.executable, "-c", f"import {framework}"], capture_output=True, env=ENV).returncode:
            skipped += [n for n in names if n.startswith(framework)]
    names = [n for n in names if n not in skipped]
    legs = [(launcher, backend) for launcher in launchers for backend in BACKENDS]

    load_before = uptime()
    runs = {n: {leg: [] for leg in legs} for n in names}
    identical = {n: [] for n in names}
    failures = []
    with Progress(console=console) as progress:
        task = progress.add_task("launches", total=args.rounds * len(names) * len(legs))
        for rnd in range(args.rounds):
            for name in names:
                losses = []
                for launcher, backend in legs if rnd % 2 == 0 else legs[::-1]:
                    progress.update(task, description=f"round {rnd + 1}: {name} on {backend} under {launcher}")
                    for attempt in (1, 2):  # one retry: record the failure, stop on a second
                        result, wall, cmd, out = launch(args.nprocs, EXAMPLES[name][0], EXAMPLES[name][1:],
                                                        backend, args.steps, launcher, args.table)
                        if result is not None:
                            break
                        failures.append({"round": rnd + 1, "example": name, "backend": backend,
                                         "launcher": launcher, "command": cmd, "output_tail": out[-3000:]})
                        console.print(f"launch failed ({cmd}):\n{out[-3000:]}", highlight=False)
                        if attempt == 2:
                            sys.exit("failed twice in a row; stopping")
                    losses.append(result["losses"])
                    runs[name][(launcher, backend)].append(
                        {"median_step_s": statistics.median(result["step_times"][args.warmup:]),
                         "job_wall_s": wall, "step_times": result["step_times"]})
                    progress.advance(task)
                identical[name].append(all(l == losses[0] for l in losses))
    load_after = uptime()

    def med(name, leg, key="median_step_s"):
        return statistics.median(r[key] for r in runs[name][leg])

    def ratios(name, top, bottom):
        return [t["median_step_s"] / b["median_step_s"] for t, b in zip(runs[name][top], runs[name][bottom])]

    headers = ["example"]
    for launcher in launchers:
        headers += [f"{launcher}: gloo ms", "mcrdl (MPI only) ms", "mcrdl/gloo (per round)", "tuned ms",
                    "tuned/mcrdl (per round)", "job s mcrdl"]
    if len(launchers) > 1:
        headers += [f"mcrdl {launchers[1]}/{launchers[0]} (per round)"]
    headers += ["losses identical"]
    table = Table(title=f"median step time, {args.nprocs} ranks, {args.rounds} rounds")
    for h in headers:
        table.add_column(h, justify="left" if h == "example" else "right")
    rows = []
    for name in names:
        row = [name]
        for launcher in launchers:
            gloo, mcrdl, tuned = (launcher, "gloo"), (launcher, "mcrdl"), (launcher, "tuned")
            per_round = " ".join(f"{x:.2f}" for x in ratios(name, mcrdl, gloo))
            tuned_rounds = " ".join(f"{x:.2f}" for x in ratios(name, tuned, mcrdl))
            row += [f"{1e3 * med(name, gloo):.1f}", f"{1e3 * med(name, mcrdl):.1f}",
                    f"{med(name, mcrdl) / med(name, gloo):.2f}x ({per_round})", f"{1e3 * med(name, tuned):.1f}",
                    f"{med(name, tuned) / med(name, mcrdl):.2f}x ({tuned_rounds})",
                    f"{med(name, mcrdl, 'job_wall_s'):.1f}"]
        if len(launchers) > 1:
            a, b = (launchers[1], "mcrdl"), (launchers[0], "mcrdl")
            row += [f"{med(name, a) / med(name, b):.2f}x ({' '.join(f'{x:.2f}' for x in ratios(name, a, b))})"]
        row += [f"{sum(identical[name])}/{len(identical[name])}"]
        rows.append(row)
        table.add_row(*row)
    console.print(table)

    command = shlex.join([os.path.relpath(sys.executable, ROOT) if sys.executable.startswith(ROOT)
                          else sys.executable, *sys.argv])
    found = {}
    for framework in ("deepspeed", "lightning"):
        try:
            found[framework] = importlib.metadata.version(framework)
        except importlib.metadata.PackageNotFoundError:
            pass
    doc = environment(**found)
    md = [
        "# Real frameworks on \"mcrdl\" vs gloo, MPI only and tuned: step time",
        "",
        "Each example in `examples/frameworks/` (unchanged but for `--backend`) on "
        f"{args.nprocs} ranks under each launcher ({', '.join(launchers)}: `mcrdl run --launcher L`; "
        "under torchrun mcrdl starts MPI over torchrun's store), once per variant per round (gloo; "
        "\"mcrdl\" with no table, every op on MPI; \"mcrdl\" with the tuning table "
        f"`{args.table}`, each op on the library it picks), the "
        f"order of the launches reversed every round, {args.rounds} rounds. Per launch the median "
        "of rank 0's step times (forward, backward, optimizer step) after "
        f"{args.warmup} warm-up steps of {args.steps}; the table gives the median over the rounds "
        "with each round's ratio, the median wall time of a whole mcrdl job (launch, imports, "
        "init, steps, exit), mcrdl's step time under the second launcher over the first, and in "
        "how many rounds all launches' losses were bitwise identical.",
        "",
        "## Command",
        "",
        "```bash",
        command,
        "```",
        "",
        f"{doc['date']}, {doc['cpus']} CPUs, torch {doc['versions']['torch']}, "
        f"mcrdl {doc['versions']['mcrdl']}, Python {doc['versions']['python']}"
        + "".join(f", {k} {v}" for k, v in found.items()) + ".",
        "",
        f"- `uptime` before: `{load_before}`",
        f"- `uptime` after: `{load_after}`",
    ]
    if skipped:
        md += [f"- left out (their framework does not import): {', '.join(skipped)}"]
    for f in failures:
        md += [f"- launch failed and was repeated: round {f['round']}, {f['example']} on "
               f"{f['backend']} under {f['launcher']}; last line: `{f['output_tail'].strip().splitlines()[-1]}` "
               f"(full tail in the JSON)"]
    md += ["", "## Result", "", "| " + " | ".join(headers) + " |",
           "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"]
    md += ["| " + " | ".join(row) + " |" for row in rows]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write("\n".join(md) + "\n")
    console.print(f"wrote {args.out}", highlight=False)
    write_json(args.json, {"environment": doc, "command": command, "uptime_before": load_before,
                           "uptime_after": load_after, "skipped": skipped, "failures": failures,
                           "settings": vars(args),
                           "runs": {n: {f"{l}/{b}": r for (l, b), r in legs_.items()} for n, legs_ in runs.items()},
                           "losses_identical": identical},
               console)


if __name__ == "__main__":
    main()
