"""Compressed all-reduce: wire bytes, time and error per compressor and size.

    mcrdl run -n 2 benchmarks/features/compression.py [--sizes 64K,1M,16M] [--rounds 5]
                                             [--backend mpi|gloo] [--json out.json]

For every size (bytes of a float32 CPU tensor) and every compressor (none, fp16, bf16,
int8 with chunk 256, int8 with chunk 256 + error feedback):

* wire bytes per rank: the payload and the bytes one rank sends under the textbook
  model (ring all-reduce 2(n-1)/n x payload for summable payloads; all-gather
  (n-1) x payload for int8), vs the uncompressed float32 all-reduce;
* time per ``compressed_all_reduce`` (AVG, in place, so repeated calls stay bounded;
  compression, collective and decompression included): ``--rounds`` interleaved rounds
  (rotating start), each a warm-up call, a barrier and ``iters`` timed calls
  (more for small sizes); per-call time = elapsed / iters, max over ranks; median over
  rounds;
* error of one SUM call on seeded normal inputs (N(0,1) scaled by 10^k, k in -2..2
  by blocks of 37 elements), against the exact sum computed locally in float64
  from every rank's input: relative L2 error ||S^ - S|| / ||S|| and max |S^ - S| /
  max |S|; and the max of |S^ - S| / (documented bound) per element.
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import torch

import mcrdl
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import environment, write_json  # noqa: E402
from mcrdl.features.compression import (BF16Compressor, FP16Compressor, Int8Compressor,
                                       NoneCompressor, all_reduce_wire_bytes, compressed_all_reduce)
from mcrdl.features.fusion import parse_bytes

F64 = torch.float64


def inp(r: int, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * r + 1)
    x = torch.randn(numel, generator=g, dtype=F64)
    return (x * 10.0 ** ((torch.arange(numel) // 37 % 5) - 2).to(F64)).float()


def bound(comp, xs) -> torch.Tensor:
    """The documented per-element bound of |S^ - S| (SUM, float32 output)."""
    n = len(xs)
    xs = [x.to(F64) for x in xs]
    abs_sum = sum(x.abs() for x in xs)
    if isinstance(comp, (FP16Compressor, BF16Compressor)):
        u = comp.unit_roundoff
        b = n * u / (1 - n * u) * abs_sum + n * comp.underflow
    elif isinstance(comp, Int8Compressor):
        ss = []
        for x in xs:
            c = comp.chunk_size
            s = torch.stack([x[i:i + c].abs().max() for i in range(0, x.numel(), c)]) / 127
            ss.append(s.float().to(F64).repeat_interleave(c)[:x.numel()])
        b = sum(s / 2 for s in ss) + n * 2.0 ** -20 * sum(s + x.abs() for s, x in zip(ss, xs))
    else:
        b = torch.zeros_like(abs_sum)
    return b + 2.0 ** -24 * (sum(xs).abs() + b)


def iters_for(nbytes: int) -> int:
    return 50 if nbytes <= 64 << 10 else 10 if nbytes <= 1 << 20 else 3


def fmt_size(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="64K,1M,16M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backend", default=None, help="force a backend (default: selection)")
    ap.add_argument("--json", help="write results here (rank 0)")
    args = ap.parse_args()
    sizes = [parse_bytes(s) for s in args.sizes.split(",") if s.strip()]

    mcrdl.init_process_group()
    rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
    comps = {"none": NoneCompressor(), "fp16": FP16Compressor(), "bf16": BF16Compressor(),
             "int8": Int8Compressor(), "int8+EF": Int8Compressor(error_feedback=True)}
    names = list(comps)

    from rich.console import Console
    from rich.table import Table
    console = Console() if sys.stdout.isatty() else Console(width=200, force_terminal=False)

    def max_over_ranks(x: float) -> float:
        t = torch.tensor([x], dtype=F64)
        mcrdl.all_reduce(t, op=mcrdl.ReduceOp.MAX)
        return float(t[0])

    t0 = time.perf_counter()
    rows = []
    for nbytes in sizes:
        numel = nbytes // 4
        xs = [inp(r, numel) for r in range(world)]
        exact = sum(x.to(F64) for x in xs)
        iters = iters_for(nbytes)
        errors = {}
        for name in names:
            comp = comps[name]
            t = xs[rank].clone()
            compressed_all_reduce(t, comp, backend=args.backend, key=("error", nbytes))
            d = t.to(F64) - exact
            b = bound(comp, xs)
            errors[name] = {
                "rel_l2": float(d.norm() / exact.norm()),
                "rel_max": float(d.abs().max() / exact.abs().max()),
                "max_err_over_bound": float((d.abs() / b).max()) if bool((b > 0).all()) else 0.0,
            }
        bufs = {name: xs[rank].clone() for name in names}
        samples = {name: [] for name in names}
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for name in order:
                comp, buf = comps[name], bufs[name]
                compressed_all_reduce(buf, comp, op=mcrdl.ReduceOp.AVG, backend=args.backend)
                mcrdl.barrier()
                start = time.perf_counter()
                for _ in range(iters):
                    compressed_all_reduce(buf, comp, op=mcrdl.ReduceOp.AVG, backend=args.backend)
                samples[name].append(max_over_ranks((time.perf_counter() - start) / iters))
        base = statistics.median(samples["none"])
        for name in names:
            wire = all_reduce_wire_bytes(comps[name], numel, torch.float32, world)
            med = statistics.median(samples[name])
            rows.append({"size_bytes": nbytes, "compressor": name, "repr": repr(comps[name]),
                         **wire, "median_s": med, "min_s": min(samples[name]),
                         "max_s": max(samples[name]), "samples_s": samples[name],
                         "time_vs_none": med / base, "iters": iters, **errors[name]})
        if rank == 0:
            console.print(f"  {fmt_size(nbytes)} done ({time.perf_counter() - t0:.1f} s)", highlight=False)
    total_s = time.perf_counter() - t0

    if rank == 0:
        sel = args.backend or "selection: " + mcrdl.explain("all_reduce", sizes[-1] // 2).split(": ")[-1]
        table = Table(title=f"compressed_all_reduce of float32, {world} ranks ({sel}): bytes sent "
                            f"per rank (ring model), ms per call (AVG, median of {args.rounds} "
                            "rounds \\[min-max]), error of one SUM")
        for col in ("size", "compressor", "collective", "payload B", "sent B", "sent vs none",
                    "ms per call", "time vs none", "rel L2 err", "max err / max|S|", "max err/bound"):
            table.add_column(col, justify="left" if col in ("compressor", "collective") else "right")
        for row in rows:
            table.add_row(fmt_size(row["size_bytes"]), row["compressor"], row["collective"],
                          f"{row['payload_bytes']:,}", f"{row['sent_bytes']:,.0f}",
                          f"{row['ratio']:.3f}",
                          f"{row['median_s'] * 1e3:.2f} [{row['min_s'] * 1e3:.2f}-{row['max_s'] * 1e3:.2f}]",
                          f"{row['time_vs_none']:.2f}x", f"{row['rel_l2']:.2e}", f"{row['rel_max']:.2e}",
                          f"{row['max_err_over_bound']:.2f}")
        console.print(table)
        console.print(f"torch {torch.__version__}, mcrdl {mcrdl.__version__}, {platform.node()}, "
                      f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; total "
                      f"{total_s:.1f} s", highlight=False)
        if args.json:
            out = {"benchmark": "compressed_all_reduce: wire bytes, time, error",
                   "unit": "seconds per call", "world_size": world, "rounds": args.rounds,
                   "backend": args.backend, "selection_note": sel, "sizes": sizes,
                   "method": __doc__.split("\n\n", 2)[2].strip(), "results": rows,
                   **environment(), "total_seconds": total_s}
            write_json(args.json, out, console)
    mcrdl.barrier()
    mcrdl.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
