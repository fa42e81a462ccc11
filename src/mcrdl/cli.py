"""The ``mcrdl`` command: run, info, explain."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _cmd_run(args) -> int:
    from . import launcher

    argv = list(args.program)
    if argv and argv[0] == "--":
        argv = argv[1:]
    cmd = launcher.build_command(args.nprocs, argv, args.launcher, args.hosts, args.hostfile,
                                 args.mpiexec, args.extra.split() if args.extra else ())
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    return launcher.run(cmd, args.timeout)


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
    finally:
        mcrdl.destroy_process_group()
    return 0


def _cmd_explain(args) -> int:
    import mcrdl

    mcrdl.init_process_group(op_backends=_parse_map(args.op_backends), tuning_table=args.table,
                             default_backend=args.default)
    try:
        if mcrdl.get_rank() == 0:
            print(mcrdl.explain(args.op, args.nbytes, backend=args.backend,
                                group_size=args.group_size))
    finally:
        mcrdl.destroy_process_group()
    return 0


def _parse_map(spec: Optional[str]):
    from .selector import parse_op_backends

    return parse_op_backends(spec) if spec else None


def _size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("b")
    mult = units.get(t[-1:], 1)
    return int(float(t[:-1] if t[-1:] in units else t) * mult)


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
    r.add_argument("--timeout", type=float, help="kill the job after this many seconds")
    r.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    r.add_argument("program", nargs=argparse.REMAINDER, help="script.py args... | -m module | program")
    r.set_defaults(func=_cmd_run)

    i = sub.add_parser("info", help="versions and which backends are live")
    i.set_defaults(func=_cmd_info)

    e = sub.add_parser("explain", help="which backend would run an op, and why")
    e.add_argument("op")
    e.add_argument("nbytes", type=_size, help="message size for lookup, e.g. 4, 64K, 4M")
    e.add_argument("--group-size", type=int, help="group size (default: this job's world)")
    e.add_argument("--table", help="tuning table file")
    e.add_argument("--op-backends", help="static map, e.g. all_to_all:mpi,all_reduce:gloo")
    e.add_argument("--default", help="default backend")
    e.add_argument("--backend", help="forced backend")
    e.set_defaults(func=_cmd_explain)
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"mcrdl {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
