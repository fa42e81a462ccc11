"""``mcrdl demo``: the end-to-end comparison of the published MCR-DL, at this machine's scale.

One command, outside any job::

    mcrdl demo                      # 2 local ranks, a few minutes at most

It starts ``-n`` local ranks of itself (``mcrdl run``), and in that job:

1. runs a quick tune of the ops the workloads use (``mcrdl tune --quick``,
   sizes around the workloads' messages) into ``OUT/table.json``;
2. runs every workload (``mcrdl.tools.workloads``: moe, dlrm, megatron, megatron
   with sequence parallelism, tensor-parallel decoding, data parallelism with the gradient
   all-reduce after backward, ddp) in every mode for a fixed number of steps,
   modes interleaved over rounds: ``baseline-gloo`` (one library for
   everything: what a PyTorch CPU user has today), ``baseline-mpi`` (the other
   single library), ``coarse`` (one library per op class, chosen from the tune),
   ``tuned`` (the tuning table: per op and message size); DDP also runs
   ``torch`` (plain DDP, no hook), ``tuned+polled``, ``tuned+fused`` and
   ``tuned+fp16`` (hook variants; ``--no-variants`` leaves these four out). With CUDA tensors (``--device cuda``, the
   default when torch sees a GPU for every rank) the baselines are gloo,
   ``mpi_staged`` and, with a GPU per rank, NCCL. ``--modes`` picks others: ``autotuned``
   learns its choices from the run's own first calls (``mcrdl.autotune``); a
   demo without ``coarse`` and ``tuned`` skips the quick tune;
3. each workload writes ``OUT/<workload>.json`` (rank 0).

Then (outside the job) it prints one table: workload x mode, samples/s, step
time, communication share, speed-up over the gloo-only baseline and over the
best single backend, and whether the losses after the same steps from the
same seed agree across modes (they must: the runtime changes speed, not
results); writes ``OUT/results.json`` and the bar chart ``OUT/demo.png``.
Exit status 0 only when every workload ran and every lossless mode agreed.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List, Optional

from ..rank_env import in_job, mpi_launched

FORMAT = "mcrdl-demo/1"

#: label -> (workload module, extra arguments, extra modes)
WORKLOADS = {
    "moe": ("moe", [], ""),
    "dlrm": ("dlrm", [], ""),
    "megatron": ("megatron", [], ""),
    "megatron-sp": ("megatron", ["--sequence-parallel"], ""),
    "decode": ("decode", [], ""),
    "dp": ("dp", [], ""),
    "ddp": ("ddp", [], ",tuned+polled,tuned+fused,tuned+fp16,torch"),
}
#: Per device type of the workloads' tensors, the single-library baselines: what
#: a user of one library has today (CUDA: MPI host-staged; NCCL where every rank
#: has its own GPU), then the mixed modes.
BASELINES = {"cpu": ("baseline-gloo", "baseline-mpi"),
             "cuda": ("baseline-gloo", "baseline-mpi_staged", "baseline-nccl")}
MIXED_MODES = ("coarse", "tuned")
#: Every mode the demo can run, in the order it reports them.
MODES = tuple(dict.fromkeys(BASELINES["cpu"] + BASELINES["cuda"])) + MIXED_MODES + ("autotuned",)
#: Modes that need the tuning table (the quick tune, or --table).
TABLE_MODES = ("coarse", "tuned")
TUNE_OPS = ("all_reduce", "all_to_all", "all_gather", "reduce_scatter")
#: Sizes of the demo's tune: the quick sweep's span, denser where the workloads' messages are.
TUNE_SIZES = "4,1K,16K,64K,128K,256K,1M,4M"


def add_args(p) -> None:
    p.add_argument("-n", "--nprocs", type=int, default=2, help="local ranks to launch (default 2)")
    p.add_argument("--launcher", choices=("mpiexec", "torchrun"), default="mpiexec",
                   help="what starts the ranks (default mpiexec; under torchrun mcrdl starts MPI over its store)")
    p.add_argument("--out", default=os.path.join("out", "demo"), help="output directory (default out/demo)")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma list of {', '.join(WORKLOADS)} (default: all)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run (default 2)")
    p.add_argument("--rounds", type=int, default=6,
                   help="rounds; every mode runs once per round, interleaved (default 6)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=tuple(BASELINES),
                   help="where the workloads' models and data live (default: cuda when torch sees a "
                        "GPU for every rank, else cpu)")
    p.add_argument("--modes", help=f"comma list of {', '.join(MODES)} (default: the device's "
                                   f"baselines, {','.join(MIXED_MODES)})")
    p.add_argument("--table", help="use this tuning table instead of running the quick tune")
    p.add_argument("--no-variants", action="store_true",
                   help="ddp runs only the modes asked for (not its hook variants of tuned, nor plain DDP)")
    p.add_argument("--tune-sizes", default=TUNE_SIZES, help=f"sizes of the quick tune (default {TUNE_SIZES})")
    p.add_argument("--timeout", type=float, default=900, help="kill the job after this many seconds")
    p.add_argument("--no-report", action="store_true", help=argparse_suppress())


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def _selected(spec: str) -> List[str]:
    names = [w.strip() for w in spec.split(",") if w.strip()]
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise ValueError(f"unknown workloads {bad} (expected some of {', '.join(WORKLOADS)})")
    return names


def default_device(nprocs: int) -> str:
    """cuda when torch sees a GPU for each of ``nprocs`` local ranks, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "cpu"


def main_modes(device: str, nprocs: int) -> List[str]:
    """The default modes: the device's baselines (NCCL only with a GPU per rank), then the mixed ones."""
    import torch
    import torch.distributed as dist

    nccl = device == "cuda" and torch.cuda.device_count() >= nprocs and dist.is_nccl_available()
    return [m for m in BASELINES[device] if m != "baseline-nccl" or nccl] + list(MIXED_MODES)


def _modes(spec: str, device: str) -> List[str]:
    modes = [m.strip() for m in spec.split(",") if m.strip()]
    known = [m for m in MODES if not m.startswith("baseline-") or m in BASELINES[device]]
    bad = [m for m in modes if m not in known]
    if bad or not modes:
        raise ValueError(f"unknown modes {bad} for {device} tensors (expected some of {', '.join(known)})")
    return modes


def main(args) -> int:
    names = _selected(args.workloads)
    args.device = args.device or default_device(args.nprocs)
    args.modes = ",".join(_modes(args.modes or ",".join(main_modes(args.device, args.nprocs)), args.device))
    if not in_job():
        return _outer(args, names)
    rc = _inner(args, names)
    if args.no_report:
        return rc
    rank = 0
    if mpi_launched():
        from mpi4py import MPI
        rank = MPI.COMM_WORLD.Get_rank()
    elif "RANK" in os.environ:
        rank = int(os.environ["RANK"])
    if rank == 0:
        rc2 = report(args, names, args.out, elapsed=None, command=" ".join(["mcrdl", "demo", *sys.argv[2:]]))
        rc = rc or rc2
    return rc


def _outer(args, names: List[str]) -> int:
    """Launch the job, then report from its files."""
    from .. import launcher

    os.makedirs(args.out, exist_ok=True)
    for name in names:  # stale results must not be reported
        path = os.path.join(args.out, f"{name}.json")
        if os.path.exists(path):
            os.remove(path)
    argv = ["-m", "mcrdl.cli", "demo", "--no-report", "--out", args.out, "--workloads", ",".join(names),
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
            "--seed", str(args.seed), "--tune-sizes", args.tune_sizes, "--modes", args.modes,
            "--device", args.device]
    if args.table:
        argv += ["--table", args.table]
    if args.no_variants:
        argv.append("--no-variants")
    tune = "" if args.table or not set(TABLE_MODES) & set(args.modes.split(",")) else "quick tune, then "
    print(f"mcrdl demo: {args.nprocs} local ranks ({args.launcher}), {args.device} tensors; {tune}{', '.join(names)} in modes "
          f"{args.modes.replace(',', ', ')} ({args.steps} timed steps x {args.rounds} rounds each)", flush=True)
    t0 = time.time()
    load0 = _loadavg()
    rc = launcher.run(launcher.build_command(args.nprocs, argv, args.launcher), args.timeout)
    elapsed = time.time() - t0
    args.loadavg = {"start": load0, "end": _loadavg()}
    if rc != 0:
        print(f"mcrdl demo: the job exited {rc}", file=sys.stderr)
    command = "mcrdl demo" + "".join(f" {a}" for a in sys.argv[2:])
    rc2 = report(args, names, args.out, elapsed, command)
    return rc or rc2


def _loadavg() -> Optional[list]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _inner(args, names: List[str]) -> int:
    """In the job: tune, then every workload in every mode."""
    import importlib

    from . import tune
    from ..settings import parse_bytes

    os.makedirs(args.out, exist_ok=True)
    modes = args.modes.split(",")
    table = args.table
    if table is None and set(TABLE_MODES) & set(modes):
        table = os.path.join(args.out, "table.json")
        tune.run(table, quick=True, device=args.device, ops=TUNE_OPS, rounds=5,
                 sizes=[parse_bytes(s, "--tune-sizes") for s in args.tune_sizes.split(",")])
    worst = 0
    for name in names:
        module, extra, more_modes = WORKLOADS[name]
        mod = importlib.import_module(f"mcrdl.tools.workloads.{module}")
        extra_modes = more_modes if "tuned" in modes and not args.no_variants else ""  # DDP's hook variants of tuned
        argv = ["--mode", ",".join(modes) + extra_modes, *(["--table", table] if table else []),
                "--steps", str(args.steps), "--warmup", str(args.warmup), "--rounds", str(args.rounds),
                "--seed", str(args.seed), "--device", args.device, "--json", os.path.join(args.out, f"{name}.json"),
                "--quiet", *extra]
        _say(f"== {name}: {module}.py {' '.join(argv)}")
        rc = mod.main(argv)
        worst = worst or rc
    return worst


def _say(text: str) -> None:
    """Print on rank 0 only."""
    if mpi_launched():
        from mpi4py import MPI
        if MPI.COMM_WORLD.Get_rank() != 0:
            return
    elif int(os.environ.get("RANK", 0)) != 0:
        return
    print(text, flush=True)


# -- report -----------------------------------------------------------------------------------
def collect(out: str, names: List[str]) -> Dict[str, dict]:
    docs = {}
    for name in names:
        path = os.path.join(out, f"{name}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                docs[name] = json.load(f)
    return docs


def rows_of(docs: Dict[str, dict]) -> List[dict]:
    """One row per workload x mode with the speed-ups."""
    rows = []
    for name, doc in docs.items():
        summ = doc["summary"]
        sps = {m: s["samples_per_s"] for m, s in summ.items()}
        gloo = sps.get("baseline-gloo")
        singles = {m: v for m, v in sps.items() if m.startswith("baseline-") and v}
        best_single = max(singles, key=singles.get) if singles else None
        agree = doc["agreement"]["modes"]
        for mode, s in summ.items():
            a = agree[mode]
            rows.append({
                "workload": name, "mode": mode, "unit": doc.get("sample_unit", "samples"),
                "samples_per_s": s["samples_per_s"], "step_ms": s["step_ms"],
                "step_ms_p25": s.get("step_ms_p25"), "step_ms_p75": s.get("step_ms_p75"),
                "timed_steps": s.get("timed_steps"),
                "comm_share": s["comm_share"],
                "vs_gloo": s["samples_per_s"] / gloo if gloo else None,
                "vs_best_single": s["samples_per_s"] / singles[best_single] if best_single else None,
                "best_single": best_single,
                "losses": "identical" if a["exact"] else
                          (f"max rel {a['max_rel']:.1e}" + ("" if a["ok"] else
                                                            (" (lossy)" if a["lossy"] else " MISMATCH"))),
                "agree": bool(a["ok"] or a["lossy"]), "lossy": a["lossy"],
                "final_loss": s["final_loss"]})
    return rows


def _table_doc(path: str) -> dict:
    """A tuning table file in the current format (version 1 files are converted)."""
    import warnings

    from ..backends import REGISTRY
    from ..tuning import TuningTable

    with warnings.catch_warnings():  # this report runs no op: liveness does not matter
        warnings.simplefilter("ignore")
        return TuningTable.load(path, REGISTRY).to_dict()


def report(args, names: List[str], out: str, elapsed: Optional[float], command: str) -> int:
    from rich.console import Console
    from rich.table import Table

    docs = collect(out, names)
    console = Console(width=None if os.isatty(1) else 150)
    missing = [n for n in names if n not in docs]
    rows = rows_of(docs)
    t = Table(title=f"mcrdl demo: {next(iter(docs.values()))['world_size'] if docs else '?'} ranks, "
                    f"{args.steps} timed steps x {args.rounds} rounds per mode (median step)")
    for col in ("workload", "mode", "samples/s", "step ms (p25-p75)", "comm share", "vs gloo baseline",
                "vs best single", "losses vs baseline-gloo"):
        t.add_column(col, justify="left" if col in ("workload", "mode", "losses vs baseline-gloo") else "right")
    last = None
    for r in rows:
        if last is not None and r["workload"] != last:
            t.add_section()
        last = r["workload"]
        t.add_row(r["workload"], r["mode"], f"{r['samples_per_s']:.1f} {r['unit']}",
                  f"{r['step_ms']:.1f} ({r['step_ms_p25']:.1f}-{r['step_ms_p75']:.1f})",
                  "—" if r["comm_share"] is None else f"{100 * r['comm_share']:.0f}%",
                  "—" if r["vs_gloo"] is None else f"{r['vs_gloo']:.2f}x",
                  "—" if r["vs_best_single"] is None else f"{r['vs_best_single']:.2f}x",
                  r["losses"])
    console.print(t)
    for name, doc in docs.items():
        if doc.get("coarse_map"):
            console.print(f"  {name}: coarse map " + ", ".join(f"{k}->{v}" for k, v in doc["coarse_map"].items()))
    table_path = next((d.get("table") for d in docs.values() if d.get("table")), None)
    rules = None
    if table_path and os.path.exists(table_path):
        tdoc = _table_doc(table_path)
        rules = tdoc.get("rules")
        console.print(f"tuning table {table_path}:")
        from .tune import crossovers

        for line in crossovers(tdoc):
            console.print("  " + line)
    agree_ok = all(r["agree"] for r in rows) and not missing
    console.print("losses after the same steps agree across modes: " +
                  ("yes (every lossless mode; compressed variants are lossy by design)" if agree_ok else
                   "NO" + (f" (missing results: {', '.join(missing)})" if missing else "")))
    os.makedirs(out, exist_ok=True)
    png = os.path.join(out, "demo.png")
    try:
        chart(rows, png)
        console.print(f"chart: {png}")
    except ImportError:
        console.print("chart: skipped (matplotlib not installed: pip install matplotlib)")
        png = None
    import platform
    load = getattr(args, "loadavg", None)
    if load:
        console.print(f"load average (1, 5, 15 min) at start {load['start']}, at end {load['end']} "
                      f"on {os.cpu_count()} CPUs")
    doc = {"format": FORMAT, "command": command, "elapsed_s": elapsed,
           "host": platform.node(), "cpus": os.cpu_count(), "loadavg": load, "device": args.device,
           "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "seed": args.seed,
           "table": table_path, "tuning_rules": rules, "rows": rows, "agree": agree_ok,
           "missing": missing, "chart": png,
           "workloads": {n: {k: d[k] for k in ("config", "samples_per_step", "sample_unit", "coarse_map",
                                                 "summary", "agreement", "world_size")}
                         for n, d in docs.items()}}
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    console.print(f"results: {os.path.join(out, 'results.json')}" +
                  (f"  (total {elapsed:.0f} s)" if elapsed is not None else ""))
    return 0 if agree_ok else 1


def chart(rows: List[dict], path: str) -> None:
    """Grouped bars: speed-up over the gloo-only baseline, per workload and mode
    (left: the four modes every workload runs; right: DDP's extra variants)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    by = {(r["workload"], r["mode"]): r for r in rows}
    main = [m for m in MODES if any(r["mode"] == m for r in rows)]
    extra = [m for m in dict.fromkeys(r["mode"] for r in rows if r["workload"] == "ddp")
             if m not in MODES]
    fig, axes = plt.subplots(1, 2 if extra else 1, figsize=(12 if extra else 9, 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 1.2]} if extra else None)
    ax = axes[0][0]
    colors = {"baseline-gloo": "#9e9e9e", "baseline-mpi": "#607d8b", "baseline-mpi_staged": "#607d8b",
              "baseline-nccl": "#8d6e63", "coarse": "#64b5f6",
              "tuned": "#1565c0", "torch": "#bdbdbd", "tuned+polled": "#00897b", "tuned+fused": "#2e7d32",
              "tuned+fp16": "#f9a825", "autotuned": "#6a1b9a"}
    w = 0.8 / len(main)
    for i, mode in enumerate(main):
        xs, ys = [], []
        for j, wl in enumerate(workloads):
            r = by.get((wl, mode))
            if r and r["vs_gloo"]:
                xs.append(j + (i - (len(main) - 1) / 2) * w)
                ys.append(r["vs_gloo"])
        lo, hi = [], []
        for j, wl in enumerate(workloads):
            r = by.get((wl, mode))
            if r and r["vs_gloo"]:
                # throughput at the step-time quartiles, relative to the same baseline
                lo.append(max(0.0, r["vs_gloo"] - r["vs_gloo"] * r["step_ms"] / r["step_ms_p75"]))
                hi.append(max(0.0, r["vs_gloo"] * r["step_ms"] / r["step_ms_p25"] - r["vs_gloo"]))
        bars = ax.bar(xs, ys, w, label=mode, color=colors.get(mode), yerr=[lo, hi],
                      error_kw={"elinewidth": 0.7, "capsize": 1.5, "ecolor": "#444"})
        for b, y, h in zip(bars, ys, hi):
            ax.text(b.get_x() + b.get_width() / 2, y + h, f"{y:.2f}", ha="center", va="bottom",
                    fontsize=6)
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels(workloads)
    ax.set_ylabel("throughput / gloo-only baseline")
    ax.set_title("training throughput / gloo-only baseline (median step; bars: step-time IQR)",
                 fontsize=10)
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    ymax = max([r["vs_gloo"] * r["step_ms"] / r["step_ms_p25"] for r in rows if r["vs_gloo"]] + [1.0])
    ax.set_ylim(0, ymax * 1.25)
    if extra:
        ax2 = axes[0][1]
        modes = ["baseline-gloo", "tuned", *extra]
        vals = [by[("ddp", m)]["vs_gloo"] if ("ddp", m) in by else 0 for m in modes]
        bars = ax2.bar(range(len(modes)), vals, 0.6, color=[colors.get(m, "#888") for m in modes])
        for b, y in zip(bars, vals):
            ax2.text(b.get_x() + b.get_width() / 2, y, f"{y:.2f}", ha="center", va="bottom", fontsize=7)
        ax2.axhline(1.0, color="black", lw=0.8, ls="--")
        ax2.set_xticks(range(len(modes)))
        ax2.set_xticklabels(modes, rotation=30, ha="right", fontsize=8)
        ax2.set_title("ddp: hook variants and plain DDP", fontsize=10)
        ax2.set_ylim(0, max(vals + [1.0]) * 1.25)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
