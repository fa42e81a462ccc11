"""The ``mcrdl`` command: run, info, explain, bench, tune."""
from __future__ import annotations

import argparse
import functools
import math
import sys
from typing import Optional, Sequence

from . import settings
from .launcher import BINDINGS, STOP_GRACE_S
from .rank_env import in_job
from .tuning import DEVICES, MAX_INT, shown


def _cmd_run(args) -> int:
    from . import launcher

    argv = list(args.program)
    if argv and argv[0] == "--":
        argv = argv[1:]
    cmd = launcher.build_command(args.nprocs, argv, args.launcher, args.hosts, args.hostfile,
                                 args.mpiexec, args.extra.split() if args.extra else (), args.bind)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    return launcher.run(cmd, args.timeout, args.stop_grace)


def _cmd_info(args) -> int:
    import mpi4py
    import torch
    from rich.console import Console
    from rich.table import Table

    import mcrdl

    mcrdl.init_process_group()
    try:
        if mcrdl.get_rank() != 0:
            return 0
        versions = mcrdl.get_backend_versions()
        table = Table(title=f"mcrdl {mcrdl.__version__} — world size {mcrdl.get_world_size()}, "
                            f"default backend {mcrdl.get_default_backend()}")
        table.add_column("backend")
        table.add_column("status")
        table.add_column("library")
        for name, status in mcrdl.available_backends().items():
            table.add_row(name, status, versions.get(name, ""))
        console = Console()
        console.print(table)
        console.print(f"torch {torch.__version__}, mpi4py {mpi4py.__version__}, Python {sys.version.split()[0]}")
        from . import facts
        console.print(f"fast-path tensor checks: {facts.status()}")
        if facts.load() is not facts:
            console.print("compiled in place of Python in this job (MCRDL_NATIVE=0 runs the Python):")
            for python, native in facts.IN_PLACE.items():
                console.print(f"  {python}: {native}", highlight=False)
            console.print("  on torch.distributed's \"mcrdl\" backend also: ProcessGroupMCRDL."
                          f"{', .'.join(m for m in facts.load().TORCH_METHODS if m != 'wait')} and "
                          "MCRDLTorchWork.wait: TorchMethod (csrc/torch_method.cpp)", highlight=False)
        from .backends import REGISTRY
        for name, cls in REGISTRY.items():  # (each builds its compiled part here: set-up runs this)
            for line in cls.info_lines(name in versions):
                console.print(line)
        console.print(f"waits: {mcrdl.wait_policy()} (MCRDL_WAIT={settings.get('MCRDL_WAIT')})")
    finally:
        mcrdl.destroy_process_group()
    return 0


def _cmd_explain(args) -> int:
    import mcrdl

    from .tools.bench import default_device

    mcrdl.init_process_group(op_backends=_parse_map(args.op_backends), tuning_table=args.table,
                             default_backend=args.default)
    try:
        if mcrdl.get_rank() == 0:
            print(mcrdl.explain(args.op, args.nbytes, backend=args.backend, group_size=args.group_size,
                                device=args.device or default_device()))
    finally:
        mcrdl.destroy_process_group()
    return 0


def _relaunch(args, argv: Sequence[str]) -> Optional[int]:
    """``mcrdl bench -n N ...`` outside a job starts N ranks of itself."""
    if not args.nprocs or in_job():
        return None
    from . import launcher

    rest, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
        elif a in ("-n", "--nprocs"):
            skip = True
        elif not a.startswith(("-n=", "--nprocs=")) and not (a.startswith("-n") and a[2:].isdigit()):
            rest.append(a)
    return launcher.run(launcher.build_command(args.nprocs, ["-m", "mcrdl.cli", *rest],
                                               bind=args.bind))


def _cmd_bench(args, argv) -> int:
    rc = _relaunch(args, argv)
    if rc is not None:
        return rc
    from .tools import bench

    failed = bench.run(variants=args.variants.split(",") if args.variants else None, device=args.device,
                       ops=args.ops.split(",") if args.ops else None, sizes=args.sizes, quick=args.quick,
                       max_bytes=args.max_bytes, step=args.step, iters=args.iters, large_iters=args.large_iters,
                       warmup=args.warmup, rounds=args.rounds, cold=args.cold, check=args.check, table=args.table,
                       json_path=args.json, csv_path=args.csv, plot=args.plot, timeout=args.timeout,
                       threads=args.threads)
    return 1 if failed else 0


def _cmd_tune(args, argv) -> int:
    rc = _relaunch(args, argv)
    if rc is not None:
        return rc
    from .tools import tune

    tune.run(args.out, device=args.device, backends=args.backends.split(",") if args.backends else None,
             ops=args.ops.split(",") if args.ops else None, sizes=args.sizes, quick=args.quick,
             max_bytes=args.max_bytes, step=args.step, iters=args.iters, large_iters=args.large_iters,
             warmup=args.warmup, rounds=args.rounds, cold=args.cold, margin=args.margin, merge=args.merge,
             results=args.results, plot=args.plot, timeout=args.timeout, threads=args.threads)
    return 0


def _cmd_model(args) -> int:
    from .tools.model.report import cli_main

    return cli_main(args)


def _cmd_demo(args) -> int:
    from .tools import demo

    return demo.main(args)


def _parse_map(spec: Optional[str]):
    from .selector import parse_op_backends

    return parse_op_backends(spec) if spec else None


def _size(text: str, minimum: int = 0) -> int:
    """argparse type: bytes from "4", "64K", "1.5M", "1G" (binary units, an
    optional "B"); anything else, or not a whole number of bytes, is refused."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().removesuffix("b")
    mult = units.get(t[-1:], 1)
    num = t[:-1] if t[-1:] in units else t
    try:
        value = int(num) * mult
    except ValueError:
        try:
            value = float(num) * mult
        except ValueError:
            value = math.nan
    if not (minimum <= value <= MAX_INT and value == int(value)):
        raise argparse.ArgumentTypeError(f"invalid size {shown(text)}: expected a whole number of bytes "
                                         f">= {minimum}, such as 4, 64K, 1.5M or 1G")
    return int(value)


def _sizes(text: str) -> list[int]:
    """argparse type: comma-separated sizes (see :func:`_size`)."""
    return [_size(s) for s in text.split(",")]


def _count(minimum: int):
    """argparse type: an integer >= ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {shown(text)}")
        return value
    return parse


BIND_OPTION = dict(choices=BINDINGS, default="none",
                   help="core: pin each launched rank to a core (docs/results/binding.md)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mcrdl", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="start N ranks of a program through mpiexec/srun/torchrun")
    r.add_argument("-n", "--nprocs", type=int, required=True)
    r.add_argument("--launcher", choices=("mpiexec", "srun", "torchrun"), default="mpiexec")
    r.add_argument("--hosts", help="comma-separated hosts (mpiexec -hosts)")
    r.add_argument("--hostfile", help="hostfile (mpiexec -f)")
    r.add_argument("--mpiexec", help="mpiexec to use instead of the mpich wheel's")
    r.add_argument("--extra", help="extra launcher options, quoted")
    r.add_argument("--bind", **BIND_OPTION)
    r.add_argument("--timeout", type=float, help="kill the job after this many seconds")
    r.add_argument("--stop-grace", type=float, default=STOP_GRACE_S, metavar="S",
                   help="after Ctrl-C/SIGTERM, kill ranks still running S seconds later "
                        f"(default {STOP_GRACE_S:g})")
    r.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    r.add_argument("program", nargs=argparse.REMAINDER, help="script.py args... | -m module | program")
    r.set_defaults(func=_cmd_run)

    i = sub.add_parser("info", help="versions and which backends are live")
    i.set_defaults(func=_cmd_info)

    s = sub.add_parser("settings", help="every MCRDL_* variable: what it accepts, its default, what it does")
    s.set_defaults(func=lambda args: print(settings.page(), end="") or 0)

    e = sub.add_parser("explain", help="which backend would run an op, and why")
    e.add_argument("op")
    e.add_argument("nbytes", type=_size, help="message size for lookup, e.g. 4, 64K, 4M")
    e.add_argument("--group-size", type=_count(1), help="group size (default: this job's world)")
    e.add_argument("--table", help="tuning table file")
    e.add_argument("--op-backends", help="static map, e.g. all_to_all:mpi,all_reduce:gloo")
    e.add_argument("--default", help="default backend")
    e.add_argument("--backend", help="forced backend")
    e.add_argument("--device", choices=DEVICES, help="device type of the op's tensors "
                                                     "(default: cuda where torch sees a GPU, else cpu)")
    e.set_defaults(func=_cmd_explain)

    for name, fn, helptext in (("bench", _cmd_bench, "OSU-style micro-benchmarks of every op and backend"),
                               ("tune", _cmd_tune, "measure every backend and write a tuning table")):
        c = sub.add_parser(name, help=helptext)
        c.add_argument("-n", "--nprocs", type=_count(1), help="launch this many local ranks (outside a job)")
        c.add_argument("--bind", **BIND_OPTION)
        c.add_argument("--ops", help="comma-separated ops (default: all)")
        c.add_argument("--sizes", type=_sizes, help="comma-separated sizes, e.g. 4,64K,1M")
        c.add_argument("--max-bytes", type=functools.partial(_size, minimum=4),
                       help="largest size of the default doubling range (from 4 B)")
        c.add_argument("--step", type=_count(1), default=1, help="keep every STEP-th size of the doubling range")
        c.add_argument("--iters", type=_count(1), help="timed iterations below 8 KB")
        c.add_argument("--large-iters", type=_count(1), help="timed iterations from 8 KB")
        c.add_argument("--warmup", type=_count(0), default=3)
        c.add_argument("--rounds", type=_count(1), help="interleaved rounds (median taken)")
        c.add_argument("--quick", action="store_true", help="few sizes and iterations (demo, tests)")
        c.add_argument("--plot", metavar="PNG", help="write one PNG with a panel per op")
        c.add_argument("--timeout", type=float, default=300, help="per-op timeout (s)")
        c.add_argument("--device", choices=DEVICES, help="device type of the tensors measured "
                                                         "(default: cuda where torch sees a GPU, else cpu)")
        c.add_argument("--cold", action="store_true",
                       help="run a fixed compute step (1 matmul) before each timed call, as in a training "
                            "step (default: back to back, OSU)")
        c.add_argument("--threads", type=_count(1),
                       help="torch threads per rank while measuring (default: as launched; --cold: 1), "
                            "as many as the job will use")
        if name == "bench":
            c.add_argument("--variants", help="e.g. mpi,gloo,mcrdl,raw-mpi,raw-shm "
                                              "(default: every live backend, mcrdl, each library's raw calls)")
            c.add_argument("--check", action="store_true", help="verify results on exact values")
            c.add_argument("--table", help="tuning table for the 'mcrdl' (selected) variant")
            c.add_argument("--json", help="write results as JSON")
            c.add_argument("--csv", help="write results as CSV")
        else:
            c.add_argument("--backends", help="backends to compare (default: all live)")
            c.add_argument("--margin", type=float, default=0.05,
                           help="a new backend must be this much faster to take over (default 0.05)")
            c.add_argument("--out", default="mcrdl-tuning.json", help="tuning table to write")
            c.add_argument("--merge", metavar="TABLE",
                           help="write TABLE's rules with the measured ones in place of theirs (device, op, "
                                "group size): one table for CPU and CUDA tensors, or several world sizes")
            c.add_argument("--results", help="also write the raw measurements as JSON")
        c.set_defaults(func=fn, wants_argv=True)

    mo = sub.add_parser("model", help="communication model of a Megatron-style job (docs/model.md)")
    mo.add_argument("config", help="model description, JSON (or YAML with PyYAML)")
    mo.add_argument("--bench", action="append", metavar="FILE",
                    help="mcrdl-bench/1 results to fit alpha-beta (default: built-in values); "
                         "repeat it to combine several sweeps (median per size)")
    mo.add_argument("--table", help="tuning table deciding the backend (default: fastest fit)")
    mo.add_argument("--out", help="write matrix.png, breakdown.png and model.json here")
    mo.add_argument("--calibrate-log", metavar="LOG",
                    help="logger export of this job's own calls: correct each logged op's time to what it "
                         "cost there (docs/model.md, 'Calibrating from the job')")
    mo.add_argument("--compare-log", help="logger export (directory or records_rank*.json) to compare with")
    mo.add_argument("--log-iterations", type=int, default=1, help="iterations in the logged run")
    mo.add_argument("--sweep", type=int, metavar="WORLD", help="rank every valid (p, t, d) on WORLD ranks")
    mo.add_argument("--top", type=int, default=10, help="layouts to show with --sweep")
    mo.add_argument("--peak-tflops", type=float, help="peak TFLOP/s per device (overrides the config)")
    mo.add_argument("--utilization", type=float, help="achieved fraction of the peak (overrides the config)")
    mo.set_defaults(func=_cmd_model)

    d = sub.add_parser("demo", help="quick tune + every workload in every mode on local ranks: table + chart")
    from .tools.demo import add_args as _demo_args
    _demo_args(d)
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    try:
        if getattr(args, "wants_argv", False):
            return args.func(args, argv)
        return args.func(args)
    except Exception as exc:
        if not _bad_input(exc):
            raise
        print(f"mcrdl {args.command}: {exc}", file=sys.stderr)
        return 2


def _bad_input(exc: Exception) -> bool:
    """An error the command reports in one line: a bad value, a missing file, an
    op no live backend takes (mcrdl.types is loaded whenever one of its errors was raised;
    `mcrdl run` never loads torch)."""
    types = sys.modules.get("mcrdl.types")
    return isinstance(exc, (ValueError, FileNotFoundError)) or (
        types is not None and isinstance(exc, types.UnsupportedError))


if __name__ == "__main__":
    sys.exit(main())
