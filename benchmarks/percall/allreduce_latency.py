"""All-reduce latency: mcrdl (mpi, gloo, default selection) against raw mpi4py and raw
torch.distributed gloo, measured in one job, interleaved.

    mcrdl run -n 2 benchmarks/percall/allreduce_latency.py [--sizes 4,4194304] [--iters N]
                                                   [--rounds R] [--json out.json]

Method (OSU-style): for every size, ``R`` rounds; each round runs every variant once,
round-robin (the starting variant rotates from round to round so no variant always
follows the same one). A variant's turn is a warm-up loop, an MPI barrier, then a timed
loop of ``N`` blocking SUM all-reduces of one float32 CPU tensor timed with
``time.perf_counter``; per-call latency = elapsed / N. The ``C MPI_Allreduce`` variant
runs the same loop in C (benchmarks/percall/c/allreduce_loop.c, built with the job's mpicc and
called through ctypes): what OSU's C benchmark measures, in the same run. The per-round value is the max of
that over ranks; the report is the median over rounds (min and max over rounds too).
Every variant's result is checked once per size, with values whose sums are exact,
before any timing. Timed buffers hold zeros so repeated sums stay finite.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import socket
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

import mcrdl
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import environment, write_json  # noqa: E402

DEFAULT_SIZES = [4, 1 << 10, 16 << 10, 64 << 10, 256 << 10, 4 << 20]
VARIANTS = ["mcrdl mpi", "mcrdl gloo", "mcrdl selected", "raw mpi4py", "raw torch.distributed gloo",
            "C MPI_Allreduce"]
SHORT = {"mcrdl mpi": "mcrdl mpi", "mcrdl gloo": "mcrdl gloo",
         "mcrdl selected": "mcrdl selected", "raw mpi4py": "raw mpi4py",
         "raw torch.distributed gloo": "raw torch gloo", "C MPI_Allreduce": "C"}
C_LOOP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "c", "allreduce_loop.c")


def build_c(src: str, workdir: str):
    """A C file of benchmarks/percall/c built with the job's own mpicc (the one beside
    this Python, e.g. the mpich wheel's) and loaded (ctypes.CDLL)."""
    import ctypes
    import shutil
    import subprocess

    mpicc = os.path.join(os.path.dirname(sys.executable), "mpicc")
    mpicc = mpicc if os.path.exists(mpicc) else shutil.which("mpicc")
    if mpicc is None:
        raise RuntimeError("no mpicc beside this Python or on PATH: cannot build the C baseline")
    lib = os.path.join(workdir, os.path.splitext(os.path.basename(src))[0] + ".so")
    subprocess.run([mpicc, "-O2", "-shared", "-fPIC", src, "-o", lib], check=True)
    return ctypes.CDLL(lib)


def build_c_loop(workdir: str):
    """benchmarks/percall/c/allreduce_loop.c, built and loaded: the C baseline."""
    import ctypes

    fn = build_c(C_LOOP, workdir).allreduce_loop
    fn.restype = ctypes.c_double
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    return fn


def parse_size(text: str) -> int:
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
    t = text.strip().lower().rstrip("b")
    mult = units.get(t[-1:], 1)
    n = int(float(t[:-1] if t[-1:] in units else t) * mult)
    if n < 4 or n % 4:
        raise argparse.ArgumentTypeError(f"size {text!r}: must be a positive multiple of 4 bytes "
                                         "(float32 elements)")
    return n


def default_iters(nbytes: int) -> int:
    """More iterations for small messages (OSU-like schedule)."""
    if nbytes < 8 << 10:
        return 2000
    if nbytes < 64 << 10:
        return 1000
    if nbytes < 512 << 10:
        return 200
    if nbytes < 2 << 20:
        return 100
    return 50


def fmt_size(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def fmt_us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.1f}" if us < 1000 else f"{us:,.0f}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=lambda s: [parse_size(x) for x in s.split(",") if x.strip()],
                    default=DEFAULT_SIZES, help="message sizes in bytes, comma-separated "
                    "(K/M suffixes allowed); default " + ",".join(map(str, DEFAULT_SIZES)))
    ap.add_argument("--iters", type=int, help="timed iterations per round for every size "
                    "(default: 2000 below 8 KiB, 1000 below 64 KiB, 200 below 512 KiB, "
                    "100 below 2 MiB, 50 from 2 MiB)")
    ap.add_argument("--warmup", type=int, help="warm-up iterations per round "
                    "(default: iters/10, at least 5)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per size (default 5)")
    ap.add_argument("--json", help="write the results to this JSON file (rank 0)")
    args = ap.parse_args()
    if args.rounds < 1 or (args.iters is not None and args.iters < 1):
        ap.error("--rounds and --iters must be at least 1")

    # -- setup: mcrdl first (it initialises MPI with its thread level), then the raw APIs.
    mcrdl.init_process_group()
    import mpi4py
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    live = mcrdl.available_backends()
    for need in ("mpi", "gloo"):
        if live.get(need) != "live":
            if rank == 0:
                print(f"backend {need} is not live: {live.get(need)}", file=sys.stderr)
            mcrdl.destroy_process_group()
            return 1

    port = comm.bcast(free_port() if rank == 0 else None, root=0)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", init_method="env://", rank=rank, world_size=world,
                            timeout=_dt.timedelta(minutes=5))

    from rich.console import Console
    from rich.table import Table

    console = Console() if sys.stdout.isatty() else Console(width=200, force_terminal=False)

    # -- the variants: each is (make buffers for n elements) -> (call, check-view) -------
    def mcrdl_variant(backend):
        def make(n):
            t = torch.zeros(n, dtype=torch.float32)
            if backend is None:
                return (lambda: mcrdl.all_reduce(t)), t
            return (lambda: mcrdl.all_reduce(t, backend=backend)), t
        return make

    def make_raw_mpi(n):
        arr = np.zeros(n, dtype=np.float32)
        allreduce, in_place = comm.Allreduce, MPI.IN_PLACE
        return (lambda: allreduce(in_place, arr)), arr

    def make_raw_gloo(n):
        t = torch.zeros(n, dtype=torch.float32)
        return (lambda: dist.all_reduce(t)), t

    c_loop = build_c_loop(tempfile.mkdtemp(prefix="mcrdl-bench-"))
    fcomm = comm.py2f()

    def make_c(n):
        arr = np.zeros(n, dtype=np.float32)
        run = lambda iters, warmup: c_loop(fcomm, arr.ctypes.data, n, iters, warmup)  # keeps arr
        run.c_loop = True  # times itself (see timed)
        return run, arr

    makers = {"mcrdl mpi": mcrdl_variant("mpi"), "mcrdl gloo": mcrdl_variant("gloo"),
              "mcrdl selected": mcrdl_variant(None), "raw mpi4py": make_raw_mpi,
              "raw torch.distributed gloo": make_raw_gloo, "C MPI_Allreduce": make_c}

    def timed(call, iters: int, warmup: int) -> float:
        """Warm-up, barrier, timed loop; per-call seconds (max over ranks)."""
        if getattr(call, "c_loop", False):
            return comm.allreduce(call(iters, warmup), op=MPI.MAX)
        for _ in range(warmup):
            call()
        comm.Barrier()
        perf = time.perf_counter
        if iters % 10 == 0:  # unrolled a little: loop overhead stays negligible at ~1 us
            start = perf()
            for _ in range(iters // 10):
                call(); call(); call(); call(); call(); call(); call(); call(); call(); call()
            elapsed = perf() - start
        else:
            start = perf()
            for _ in range(iters):
                call()
            elapsed = perf() - start
        return comm.allreduce(elapsed / iters, op=MPI.MAX)

    expected_factor = world * (world + 1) / 2  # sum over ranks of (rank + 1)

    def check(name: str, n: int) -> None:
        """One call on exact values: element i = (rank+1)*(i%7+1)."""
        call, buf = makers[name](n)
        pattern = (np.arange(n) % 7 + 1).astype(np.float32)
        view = buf if isinstance(buf, np.ndarray) else buf.numpy()
        view[:] = pattern * (rank + 1)
        if getattr(call, "c_loop", False):
            call(1, 0)
        else:
            call()
        if not np.array_equal(view, pattern * np.float32(expected_factor)):
            bad = int(np.flatnonzero(view != pattern * np.float32(expected_factor))[0])
            raise AssertionError(f"rank {rank}: {name} all_reduce of {n * 4} B is wrong at "
                                 f"element {bad}: {view[bad]} != {pattern[bad] * expected_factor}")

    # -- run --------------------------------------------------------------------------
    sizes = args.sizes
    samples = {v: [[] for _ in sizes] for v in VARIANTS}
    iters_used, warmup_used, selected = [], [], []
    t_start = time.perf_counter()
    if rank == 0:
        console.print(f"all_reduce latency: {world} ranks, {len(sizes)} sizes, {args.rounds} rounds, "
                      f"{len(VARIANTS)} variants (interleaved)")
    for si, nbytes in enumerate(sizes):
        n = nbytes // 4
        iters = args.iters or default_iters(nbytes)
        warmup = args.warmup if args.warmup is not None else max(5, iters // 10)
        iters_used.append(iters)
        warmup_used.append(warmup)
        selected.append(mcrdl.explain("all_reduce", torch.empty(n, dtype=torch.float32)))
        for name in VARIANTS:
            check(name, n)
        calls = {name: makers[name](n)[0] for name in VARIANTS}
        t_size = time.perf_counter()
        for r in range(args.rounds):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for name in order:
                samples[name][si].append(timed(calls[name], iters, warmup))
        if rank == 0:
            med = {v: statistics.median(samples[v][si]) for v in VARIANTS}
            console.print(f"[{si + 1}/{len(sizes)}] {fmt_size(nbytes):>8}: "
                          f"{iters} iters x {args.rounds} rounds in "
                          f"{time.perf_counter() - t_size:.1f} s; median us: "
                          + ", ".join(f"{SHORT[v]} {fmt_us(med[v])}" for v in VARIANTS),
                          highlight=False)
    total_s = time.perf_counter() - t_start

    # -- report -----------------------------------------------------------------------
    if rank == 0:
        medians = {v: [statistics.median(s) for s in samples[v]] for v in VARIANTS}
        mins = {v: [min(s) for s in samples[v]] for v in VARIANTS}
        maxs = {v: [max(s) for s in samples[v]] for v in VARIANTS}
        mpi_lib = " ".join(MPI.Get_library_version().splitlines()[0].split())
        table = Table(title=f"SUM all_reduce of float32 CPU tensor, {world} ranks — per-call "
                            f"latency in µs, median of {args.rounds} interleaved rounds "
                            f"[min–max over rounds]")
        table.add_column("size", justify="right")
        table.add_column("iters", justify="right")
        for v in VARIANTS:
            table.add_column(v, justify="right")
        table.add_column("mcrdl mpi / raw mpi4py", justify="right")
        table.add_column("mcrdl gloo / raw gloo", justify="right")
        table.add_column("raw mpi4py / C", justify="right")
        table.add_column("mcrdl mpi / C", justify="right")
        for si, nbytes in enumerate(sizes):
            cells = [f"{fmt_us(medians[v][si])} [{fmt_us(mins[v][si])}–{fmt_us(maxs[v][si])}]"
                     for v in VARIANTS]
            r_mpi = medians["mcrdl mpi"][si] / medians["raw mpi4py"][si]
            r_gloo = medians["mcrdl gloo"][si] / medians["raw torch.distributed gloo"][si]
            c = medians["C MPI_Allreduce"][si]
            table.add_row(fmt_size(nbytes), str(iters_used[si]), *cells,
                          f"{r_mpi:.2f}x", f"{r_gloo:.2f}x", f"{medians['raw mpi4py'][si] / c:.2f}x",
                          f"{medians['mcrdl mpi'][si] / c:.2f}x")
        console.print(table)
        for si, nbytes in enumerate(sizes):
            console.print(f"  selected at {fmt_size(nbytes)}: {selected[si]}", highlight=False)
        console.print(f"torch {torch.__version__} (gloo), mpi4py {mpi4py.__version__}, {mpi_lib}, "
                      f"mcrdl {mcrdl.__version__}, {platform.node()}, {os.cpu_count()} CPUs; "
                      f"total {total_s:.1f} s", highlight=False)
        if args.json:
            out = {
                "benchmark": "all_reduce latency (SUM, float32, CPU)",
                "unit": "seconds per call",
                "method": "per round: warm-up, MPI barrier, timed loop of `iters` calls "
                          "(perf_counter), elapsed/iters, max over ranks; variants interleaved "
                          "round-robin with rotating start; median/min/max over rounds",
                "sizes": sizes,
                "variants": VARIANTS,
                "medians": medians,
                "mins": mins,
                "maxs": maxs,
                "samples": {v: samples[v] for v in VARIANTS},
                "ratios": {
                    "mcrdl mpi / raw mpi4py": [medians["mcrdl mpi"][i] / medians["raw mpi4py"][i]
                                               for i in range(len(sizes))],
                    "mcrdl gloo / raw gloo": [medians["mcrdl gloo"][i] /
                                              medians["raw torch.distributed gloo"][i]
                                              for i in range(len(sizes))],
                    **{f"{v} / C": [medians[v][i] / medians["C MPI_Allreduce"][i]
                                    for i in range(len(sizes))] for v in ("raw mpi4py", "mcrdl mpi")},
                },
                "selected": selected,
                "iters": iters_used,
                "warmup": warmup_used,
                "rounds": args.rounds,
                "world_size": world,
                **environment(mpi4py=mpi4py.__version__, mpi_library=mpi_lib, numpy=np.__version__),
                "total_seconds": total_s,
            }
            write_json(args.json, out, console)

    comm.Barrier()
    dist.destroy_process_group()
    mcrdl.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
