"""Tensor fusion: all-reduce of many mixed-size tensors, fused vs one call each.

    mcrdl run -n 2 benchmarks/features/fusion.py [--tensors 1000] [--min-bytes 1K] [--max-bytes 1M]
                                        [--buckets 256K,4M,25M] [--rounds 5] [--iters 2]
                                        [--seed 0] [--pool-bytes 512M] [--async-baseline]
                                        [--json out.json]

Workload: ``--tensors`` float32 CPU tensors whose sizes are drawn log-uniformly between
``--min-bytes`` and ``--max-bytes`` (rounded to whole elements) with ``--seed``; the
same list on every rank. One "call" reduces the whole list (SUM).

Variants, for every live backend (``backend=``) and for selection (no ``backend=``):

* ``per-tensor``: one blocking ``mcrdl.all_reduce`` per tensor;
* ``per-tensor async`` (only with ``--async-baseline``): one ``async_op=True``
  all_reduce per tensor, then wait all (slow today: issuing checks every outstanding
  work for overlap, quadratic in the number of outstanding works);
* ``fused B``: ``all_reduce_coalesced`` with ``bucket_bytes=B`` (blocking).

Method: every variant is checked once on exact values against per-tensor results.
Then ``--rounds`` rounds; each round runs every variant once, interleaved, with the
starting variant rotating; a turn is one warm-up call, a barrier, and ``--iters``
timed calls (``time.perf_counter``); per-call time = elapsed / iters, max over ranks.
Reported: median over rounds [min-max]. Tensors hold zeros while timed.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time

import torch

import mcrdl
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from _record import environment, write_json  # noqa: E402
from mcrdl.features.fusion import all_reduce_coalesced, fusion_buffer_pool, parse_bytes, plan_buckets


def make_sizes(n: int, lo: int, hi: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    nbytes = torch.exp(math.log(lo) + u * (math.log(hi) - math.log(lo)))
    return [max(1, int(b) // 4) for b in nbytes.tolist()]


def fmt_size(n: int) -> str:
    for unit, div in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--min-bytes", default="1K")
    ap.add_argument("--max-bytes", default="1M")
    ap.add_argument("--buckets", default="256K,4M,25M", help="bucket sizes of the fused variants")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-bytes", default="512M",
                    help="fusion buffer pool bound (default 512M: holds every bucket size's buffers)")
    ap.add_argument("--async-baseline", action="store_true",
                    help="also time one async all_reduce per tensor, then wait all")
    ap.add_argument("--json", help="write results here (rank 0)")
    args = ap.parse_args()
    lo, hi = parse_bytes(args.min_bytes), parse_bytes(args.max_bytes)
    buckets = [parse_bytes(b) for b in args.buckets.split(",") if b.strip()]

    mcrdl.init_process_group()
    fusion_buffer_pool().max_bytes = parse_bytes(args.pool_bytes)
    rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
    live = mcrdl.live_backends("cpu")
    sizes = make_sizes(args.tensors, lo, hi, args.seed)
    total_bytes = 4 * sum(sizes)
    tensors = [torch.zeros(n) for n in sizes]

    from rich.console import Console
    from rich.table import Table
    console = Console() if sys.stdout.isatty() else Console(width=200, force_terminal=False)

    def per_tensor(backend):
        def call():
            for t in tensors:
                mcrdl.all_reduce(t, backend=backend)
        return call

    def per_tensor_async(backend):
        def call():
            works = [mcrdl.all_reduce(t, backend=backend, async_op=True) for t in tensors]
            for w in works:
                w.wait()
        return call

    def fused(backend, cap):
        return lambda: all_reduce_coalesced(tensors, backend=backend, bucket_bytes=cap)

    variants = {}  # name -> (backend label, kind, call)
    for backend in live + [None]:
        label = backend or "selected"
        variants[f"{label} per-tensor"] = (label, "per-tensor", per_tensor(backend), None)
        if args.async_baseline:
            variants[f"{label} per-tensor async"] = (label, "per-tensor async", per_tensor_async(backend), None)
        for cap in buckets:
            variants[f"{label} fused {cap}"] = (label, f"fused {fmt_size(cap)}", fused(backend, cap), cap)
    names = list(variants)

    # -- check: every variant on exact values equals the per-tensor result --------------------
    ref = [torch.arange(n, dtype=torch.float32) % 7 + rank for n in sizes]
    want = [torch.arange(n, dtype=torch.float32) % 7 * world + sum(range(world)) for n in sizes]
    for name in names:
        for t, r in zip(tensors, ref):
            t.copy_(r)
        variants[name][2]()
        bad = [i for i, (t, w) in enumerate(zip(tensors, want)) if not torch.equal(t, w)]
        if bad:
            raise AssertionError(f"rank {rank}: {name}: tensors {bad[:5]} differ from the reference")
    for t in tensors:
        t.zero_()

    def max_over_ranks(x: float) -> float:
        t = torch.tensor([x], dtype=torch.float64)
        mcrdl.all_reduce(t, op=mcrdl.ReduceOp.MAX)
        return float(t[0])

    samples = {n: [] for n in names}
    pool = fusion_buffer_pool()
    t0 = time.perf_counter()
    if rank == 0:
        console.print(f"fusion: {args.tensors} float32 tensors, {lo}-{hi} B log-uniform (seed "
                      f"{args.seed}), {total_bytes / 2**20:.1f} MiB per call, {world} ranks, "
                      f"{len(names)} variants x {args.rounds} rounds x {args.iters} iters", highlight=False)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            call = variants[name][2]
            call()  # warm-up
            mcrdl.barrier()
            start = time.perf_counter()
            for _ in range(args.iters):
                call()
            samples[name].append(max_over_ranks((time.perf_counter() - start) / args.iters))
        if rank == 0:
            console.print(f"  round {r + 1}/{args.rounds} done ({time.perf_counter() - t0:.1f} s)",
                          highlight=False)
    total_s = time.perf_counter() - t0

    if rank == 0:
        med = {n: statistics.median(samples[n]) for n in names}
        table = Table(title=f"all-reduce of {args.tensors} tensors ({total_bytes / 2**20:.1f} MiB), "
                            f"{world} ranks: ms per call, median of {args.rounds} rounds \\[min-max]")
        for col in ("backend", "variant", "buckets", "ms per call", "vs per-tensor", "GB/s (algbw)"):
            table.add_column(col, justify="right" if col not in ("backend", "variant") else "left")
        rows = []
        for name in names:
            label, kind = variants[name][:2]
            base = med[f"{label} per-tensor"]
            nb = len(plan_buckets(tensors, variants[name][3])) if kind.startswith("fused") \
                else args.tensors
            rows.append({"backend": label, "variant": kind, "bucket_bytes": variants[name][3], "collectives": nb,
                         "median_s": med[name], "min_s": min(samples[name]),
                         "max_s": max(samples[name]), "samples_s": samples[name],
                         "speedup_vs_per_tensor": base / med[name],
                         "algbw_gbps": total_bytes / med[name] / 1e9})
            table.add_row(label, kind, str(nb),
                          f"{fmt_ms(med[name])} [{fmt_ms(min(samples[name]))}-{fmt_ms(max(samples[name]))}]",
                          f"{base / med[name]:.2f}x", f"{total_bytes / med[name] / 1e9:.2f}")
        console.print(table)
        selected = {f"{fmt_size(cap)} bucket": mcrdl.explain("all_reduce", cap) for cap in buckets}
        selected["1 KiB tensor"] = mcrdl.explain("all_reduce", 1024)
        selected["1 MiB tensor"] = mcrdl.explain("all_reduce", 1 << 20)
        for k, v in selected.items():
            console.print(f"  selection, {k}: {v}", highlight=False)
        console.print(f"  buffer pool: {pool.stats()}", highlight=False)
        console.print(f"torch {torch.__version__}, mcrdl {mcrdl.__version__}, {platform.node()}, "
                      f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}; total "
                      f"{total_s:.1f} s", highlight=False)
        if args.json:
            out = {"benchmark": "tensor fusion: all_reduce of many tensors, fused vs per tensor",
                   "unit": "seconds per call (whole tensor list)",
                   "method": "interleaved rounds, rotating start; per turn: warm-up call, barrier, "
                             "iters timed calls; elapsed/iters, max over ranks; median over rounds",
                   "tensors": args.tensors, "min_bytes": lo, "max_bytes": hi, "seed": args.seed,
                   "total_bytes": total_bytes, "world_size": world, "rounds": args.rounds,
                   "iters": args.iters, "buckets": buckets, "async_baseline": args.async_baseline, "live_backends": live,
                   "results": rows, "selection": selected, "pool": pool.stats(),
                   **environment(), "total_seconds": total_s}
            write_json(args.json, out, console)
    mcrdl.barrier()
    mcrdl.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
