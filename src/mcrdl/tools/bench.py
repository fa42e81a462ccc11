"""OSU-style micro-benchmarks of every op on every variant, in one interleaved run.

A *variant* is one way to run an op: a live backend forced through mcrdl
(``mpi``, ``gloo``, ...), mcrdl's own selection (``mcrdl``), or the raw
library call without mcrdl (``raw-<backend>``: what each backend declares as
its library's own calls, ``Backend.raw_calls``: mpi4py on numpy views, torch.distributed
on a gloo group of its own, DeepSpeed's shm kernel, oneCCL's C calls). Tensors are on
one device type (``device``, metadata ``device``): ``cpu``, or ``cuda`` (the
rank's GPU, local rank modulo the GPUs seen; each call is timed to the end
of its work on the GPU: the stream is synchronised inside the timed region,
and raw variants are CPU only). Message size ``S``
is the op's lookup size (docs/tuning-table.md): the full buffer for
gather-type ops, the bytes each rank sends for all-to-all, the message for p2p.
``all_to_allv`` is ``all_to_all_single`` with split sizes (even ones; the form
MoE dispatch calls, MPI ``Alltoallv``); ``all_to_all`` passes none (MPI
``Alltoall``). Both are selected as ``all_to_all`` (one tuning-table entry).

Method: per (op, size), one set of buffers for every variant, warm-up, then
``rounds`` rounds that run every variant in turn (interleaved, the order
rotated each round); each runs ``iters`` calls
(more below 8 KB), each timed alone with a barrier between calls (as OSU, so
rooted ops cannot pipeline), per-call time = their median (a shared 2-core
machine deschedules ranks now and then; OSU's mean would carry those spikes).
Per round the per-call
times are reduced across ranks (avg, min, max); a result is the median over
rounds. algbw = S / t; busbw = algbw x factor (nccl-tests). p2p is a ping-pong
between ranks 0 and 1: latency is half the round trip.

Mode (``metadata.mode``): ``back-to-back`` (default, OSU) times calls that run
one after another, barrier right before, with the library's code and the
buffers hot in cache. ``cold`` (``--cold``) times calls as a training step
makes them and as the communication logger measures them: barrier, then
:data:`COLD_STEP` (untimed compute that evicts caches), then the call, with
no barrier in between; each call counts the duration of the rank that
arrived last (the shortest over ranks: the others' extra time was waiting
for it, as :func:`mcrdl.features.logger.arrival_times`), so avg = min = max
(docs/bench.md, "Cold mode").

:func:`run` is ``mcrdl bench`` in a job, as :func:`mcrdl.tools.tune.run` is ``mcrdl tune``.
"""
from __future__ import annotations

import csv
import datetime as _dt
import json
import os
import platform
import socket
import statistics
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Callable, Optional, Sequence

import torch

from .. import api
from ..tuning import (DEVICES, OP_CLASS, SELECT_OPS, busbw_factor, is_int, is_number, key_path, read_json,
                     shown)

FORMAT = "mcrdl-bench/1"
#: Ops the bench knows: the selection classes but barrier, and all_to_all with split sizes.
BENCH_OPS = tuple(x for op in SELECT_OPS if op != "barrier"
                  for x in ((op, "all_to_allv") if op == "all_to_all" else (op,)))
#: Ops whose buffers are ``world`` blocks.
_BLOCKED = ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all", "all_to_allv")
SMALL = 8192  # bytes: below this, more iterations (as OSU)
MODES = ("back-to-back", "cold")
#: The compute before each call in cold mode (on one torch thread per rank).
COLD_STEP = "1 matmul 256x512 @ 512x512 fp32 (1.5 MiB of operands)"


def default_sizes(max_bytes: int = 32 << 20, min_bytes: int = 4) -> list[int]:
    """Doubling sizes from ``min_bytes`` to ``max_bytes``."""
    sizes, s = [], min_bytes
    while s <= max_bytes:
        sizes.append(s)
        s *= 2
    return sizes


@dataclass
class Result:
    op: str
    bytes: int
    variant: str
    backend: str  # the backend that ran it ("raw" for raw calls)
    iters: int
    rounds: int
    avg_us: float  # median over rounds of the mean across ranks
    min_us: float  # ... of the fastest rank
    max_us: float  # ... of the slowest rank (the collective's time; cold mode: all three
    #                are the last-arriving rank's, see the module docstring)
    round_max_us: list = field(default_factory=list)
    algbw_gbps: float = 0.0
    busbw_gbps: float = 0.0
    check: str = "skipped"


# -- the calls ------------------------------------------------------------------
class _Case:
    """Buffers and the call for one (op, size, variant); ``check`` verifies a
    result made from exact values."""

    def __init__(self, op: str, nbytes: int, variant: str, world: int, rank: int,
                 buffers: Optional["_Case"] = None, device: torch.device = torch.device("cpu")):
        self.op, self.variant, self.world, self.rank, self.device = op, variant, world, rank, device
        n = world
        elems = max(nbytes // 4, 0)
        if op in _BLOCKED:
            elems = max(elems // n, 1) * n  # divisible into n blocks
        self.nbytes = elems * 4
        self.elems = elems
        self.part = elems // n if op in _BLOCKED else elems
        self._setup(buffers)

    # exact inputs: small integers depending on rank and position
    def _value(self, rank: int, count: int) -> torch.Tensor:
        return ((torch.arange(count, device=self.device) + rank) % 7 + 1).float()

    def _setup(self, buffers: Optional["_Case"]) -> None:
        """The buffers of ``buffers`` (another variant's case) if given, else new ones."""
        if buffers is not None:
            self.inp, self.out, self.fresh = buffers.inp, buffers.out, buffers.fresh
        else:
            self.inp, self.out = self._buffers()
            self.fresh = {k: (v.clone() if v is not None else None) for k, v in
                          (("inp", self.inp), ("out", self.out))}
        if self.variant.startswith("raw-"):
            self.call = self._raw_call()
        else:
            self.call = self._mcrdl_call(None if self.variant == "mcrdl" else self.variant)
        if self.device.type == "cuda":  # a call ends when its work on the GPU has
            call, sync = self.call, torch.cuda.current_stream(self.device).synchronize
            self.call = lambda: (call(), sync())

    def _buffers(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(input, output) with exact values; the same tensor for in-place ops."""
        op, rank = self.op, self.rank
        empty = lambda n: torch.empty(n, device=self.device)
        full = self._value(rank, self.elems)
        part = self._value(rank, self.part)
        if op in ("all_reduce", "broadcast", "reduce", "p2p"):
            return full, full
        if op == "all_gather":
            return part, empty(self.elems)
        if op == "reduce_scatter":
            return full, empty(self.part)
        if op == "gather":
            return part, empty(self.elems) if rank == 0 else None
        if op == "scatter":
            return (full if rank == 0 else None), empty(self.part)
        return full, empty(self.elems)  # all_to_all

    def reset(self) -> None:
        """Restore the exact inputs (in-place ops overwrite them while timing)."""
        for k, v in self.fresh.items():
            if v is not None:
                getattr(self, k).copy_(v)

    def _mcrdl_call(self, backend: Optional[str]) -> Callable[[], None]:
        op, inp, out, kw = self.op, self.inp, self.out, {"backend": backend}
        if op == "all_reduce":
            return lambda: api.all_reduce(inp, **kw)
        if op == "broadcast":
            return lambda: api.broadcast(inp, 0, **kw)
        if op == "reduce":
            return lambda: api.reduce(inp, 0, **kw)
        if op == "all_gather":
            return lambda: api.all_gather_into_tensor(out, inp, **kw)
        if op == "reduce_scatter":
            return lambda: api.reduce_scatter_tensor(out, inp, **kw)
        if op == "gather":
            chunks = list(out.chunk(self.world)) if out is not None else None
            return lambda: api.gather(inp, chunks, 0, **kw)
        if op == "scatter":
            chunks = list(inp.chunk(self.world)) if inp is not None else None
            return lambda: api.scatter(out, chunks, 0, **kw)
        if op == "all_to_all":
            return lambda: api.all_to_all_single(out, inp, **kw)
        if op == "all_to_allv":
            splits = [self.part] * self.world
            return lambda: api.all_to_all_single(out, inp, splits, splits, **kw)
        return self._pingpong(lambda t, peer: api.send(t, peer, **kw),
                              lambda t, peer: api.recv(t, peer, **kw))

    def _pingpong(self, send, recv) -> Callable[[], None]:
        t = self.inp
        self.send, self.recv = send, recv  # for check()
        if self.rank == 0:
            return lambda: (send(t, 1), recv(t, 1))
        if self.rank == 1:
            return lambda: (recv(t, 0), send(t, 0))
        return lambda: None

    def _raw_call(self) -> Callable[[], None]:
        """The library's own call (its backend's :meth:`~mcrdl.backends.base.Backend.raw_calls`)."""
        rt, name = api.current_runtime(), self.variant[4:]
        call = rt.backends[name].raw_calls(rt.world.handles[name], self.inp, self.out, self.part)[self.op]
        return self._pingpong(*call) if self.op == "p2p" else call

    def check(self) -> bool:
        """Run once on exact inputs and compare with the local reference."""
        self.reset()
        if self.op == "p2p":
            return self._check_pingpong()
        self.call()
        op, n, rank = self.op, self.world, self.rank
        vals = [self._value(r, self.elems) for r in range(n)]
        parts = [self._value(r, self.part) for r in range(n)]
        if op == "all_reduce":
            return torch.equal(self.inp, sum(vals))
        if op == "broadcast":
            return torch.equal(self.inp, vals[0])
        if op == "reduce":
            return rank != 0 or torch.equal(self.inp, sum(vals))
        if op == "all_gather":
            return torch.equal(self.out, torch.cat(parts))
        if op == "reduce_scatter":
            return torch.equal(self.out, sum(vals)[rank * self.part:(rank + 1) * self.part])
        if op == "gather":
            return rank != 0 or torch.equal(self.out, torch.cat(parts))
        if op == "scatter":
            return torch.equal(self.out, vals[0][rank * self.part:(rank + 1) * self.part])
        if op in ("all_to_all", "all_to_allv"):
            return torch.equal(self.out, torch.cat([v[rank * self.part:(rank + 1) * self.part] for v in vals]))
        raise ValueError(op)

    def _check_pingpong(self) -> bool:
        """Both legs: rank 1 receives rank 0's values; rank 0 clears its buffer
        after sending, so what it holds at the end came back from rank 1."""
        t, rank = self.inp, self.rank
        if rank == 0:
            self.send(t, 1)
            t.zero_()
            self.recv(t, 1)
        elif rank == 1:
            self.recv(t, 0)
            self.send(t, 0)
        return rank > 1 or torch.equal(t, self._value(0, self.elems))


# -- the harness ------------------------------------------------------------------------
class Bench:
    """Runs interleaved measurements inside an initialised mcrdl job."""

    def __init__(self, variants: Sequence[str], iters: int = 200, large_iters: int = 20,
                 warmup: int = 5, rounds: int = 5, check: bool = False,
                 progress: Optional[Callable[[str], None]] = None, cold: bool = False,
                 device: str = "cpu", threads: Optional[int] = None):
        self.rank, self.world = api.get_rank(), api.get_world_size()
        self.device = rank_device(device)
        self.mode = "cold" if cold else "back-to-back"
        self.prepare = lambda: None
        self._threads = torch.get_num_threads()
        # torch threads while measuring: as asked, else cold mode's COLD_STEP on one thread as the
        # workloads run (no idle OpenMP threads spinning), else as launched
        self.threads = threads or (1 if cold else self._threads)
        torch.set_num_threads(self.threads)
        if cold:
            a, b = torch.randn(256, 512, device=self.device), torch.randn(512, 512, device=self.device)
            self.prepare = lambda: a @ b
        self.variants = list(variants)
        self.iters, self.large_iters, self.warmup, self.rounds = iters, large_iters, warmup, rounds
        self.do_check = check
        self.progress = progress
        self.harness = api.current_runtime().control_backend  # (MPI where it is live)

    def close(self) -> None:
        torch.set_num_threads(self._threads)

    def _reduce3(self, value: float) -> tuple[float, float, float]:
        """(avg, min, max) of a per-rank value across the world."""
        t = torch.tensor([value, -value, value], dtype=torch.float64)
        s = t[:1].clone()
        api.all_reduce(s, backend=self.harness)
        api.all_reduce(t[1:], op=api.ReduceOp.MAX, backend=self.harness)
        return float(s[0]) / self.world, -float(t[1]), float(t[2])

    def _last_arrival(self, samples: Sequence[float]) -> float:
        """Median over calls (us) of each call's shortest duration over ranks:
        the last-arriving rank's (same on every rank)."""
        t = torch.tensor(samples, dtype=torch.float64)
        api.all_reduce(t, op=api.ReduceOp.MIN, backend=self.harness)
        return statistics.median(t.tolist()) * 1e6

    def measure(self, op: str, nbytes: int) -> list[Result]:
        """All variants at one (op, size), interleaved over rounds."""
        # every variant on the same buffers: where a buffer lands in memory stays fixed
        # for the whole measurement and would favour one variant over another
        variants = [v for v in self.variants if _runs(v, op, self.device.type)]
        if not variants:
            return []
        first = _Case(op, nbytes, variants[0], self.world, self.rank, device=self.device)
        cases = {v: first if v == first.variant else
                 _Case(op, nbytes, v, self.world, self.rank, first, self.device) for v in variants}
        size = next(iter(cases.values())).nbytes
        checks = {}
        if self.do_check:
            for v, case in cases.items():
                ok = case.check()
                flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
                api.all_reduce(flag, op=api.ReduceOp.MAX, backend=self.harness)
                checks[v] = "ok" if int(flag) == 0 else "FAIL"
        iters = self.iters if size < SMALL else self.large_iters
        if op == "p2p":
            iters = max(iters // 2, 1)
        for case in cases.values():
            for _ in range(self.warmup):
                case.call()
        per_round = {v: [] for v in cases}
        order = list(cases)
        barrier = lambda: api.barrier(backend=self.harness)
        clock, prepare = time.perf_counter, self.prepare
        for rnd in range(self.rounds):
            for v in order[rnd % len(order):] + order[:rnd % len(order)]:  # rotate the order
                call = cases[v].call
                samples = []
                for _ in range(iters):  # OSU: time each call, a barrier between calls
                    barrier()
                    prepare()  # cold mode: compute, untimed, between the barrier and the call
                    start = clock()
                    call()
                    samples.append(clock() - start)
                half = 2 if op == "p2p" else 1  # p2p: one way of the ping-pong
                if self.mode == "cold":
                    per_call = self._last_arrival(samples) / half
                    per_round[v].append((per_call, per_call, per_call))
                else:  # median: robust to descheduling spikes
                    per_round[v].append(self._reduce3(statistics.median(samples) * 1e6 / half))
        out = []
        for v, rounds in per_round.items():
            avg = statistics.median(r[0] for r in rounds)
            mn = statistics.median(r[1] for r in rounds)
            mx = statistics.median(r[2] for r in rounds)
            backend = "raw" if v.startswith("raw-") else (
                v if v != "mcrdl" else _selected(op, size, self.device.type))
            algbw = size / (mx * 1e-6) / 1e9 if mx > 0 else 0.0
            out.append(Result(op, size, v, backend, iters, self.rounds, avg, mn, mx,
                              [r[2] for r in rounds], algbw, algbw * busbw_factor(op, self.world),
                              checks.get(v, "skipped")))
        return out

    def sweep(self, ops: Sequence[str], sizes: Sequence[int]) -> list[Result]:
        results = []
        for op in ops:
            for nbytes in sizes:
                if self.progress:
                    self.progress(f"{op} {human(nbytes)}")
                results.extend(self.measure(op, nbytes))
        return results


def _runs(variant: str, op: str, device: str) -> bool:
    """Can ``variant`` run this benchmark's ``op`` on ``device`` tensors? (gloo
    has no CUDA p2p: its cells stay empty, and a tune leaves it out there)"""
    rt = api.current_runtime()
    if variant.startswith("raw-"):
        return op in type(rt.backends[variant[4:]]).raw_ops
    if variant == "mcrdl":
        return True
    return rt.selector.why_not(variant, OP_CLASS[op], device, torch.float32, None, rt.world.declined) is None


def _selected(op: str, nbytes: int, device: str) -> str:
    """The backend mcrdl's selection picks for this benchmark's call."""
    rt = api.current_runtime()
    return rt.selector.choose(OP_CLASS[op], nbytes, rt.world.size, device, torch.float32, None, None,
                              rt.world.declined)


def raw_variants(live: Sequence[str]) -> list:
    """``raw-<name>`` of each live backend whose library has raw calls (``raw_ops``)."""
    rt = api.current_runtime()
    return [f"raw-{b}" for b in live if type(rt.backends[b]).raw_ops]


def default_device() -> str:
    """The device type a job's tensors are on when nobody says: ``cuda`` where
    torch sees a GPU, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def live_for(device: str) -> list:
    """The live backends taking ``device`` tensors; a ValueError when none does."""
    live = api.live_backends(device)
    if not live:
        why = " (torch sees no CUDA device)" if device == "cuda" and not torch.cuda.is_available() else ""
        raise ValueError(f"no live backend takes {device} tensors in this job{why}")
    return live


def ops_for(ops: Optional[Sequence[str]], world_size: int) -> list:
    """The ops to measure (default: every one); p2p (a ping-pong between two ranks)
    only with two or more."""
    ops = list(ops) if ops else [o for o in BENCH_OPS if o != "p2p" or world_size > 1]
    bad = [o for o in ops if o not in BENCH_OPS]
    if bad:
        raise ValueError(f"unknown ops {bad} (expected {', '.join(BENCH_OPS)})")
    if "p2p" in ops and world_size < 2:
        raise ValueError("p2p is a ping-pong between two ranks: it needs -n 2 or more")
    return ops


def sweep_sizes(sizes: Optional[Sequence[int]], quick: bool, quick_sizes: Sequence[int], max_bytes: int,
                step: int = 1) -> list:
    """``sizes`` if given, else ``quick_sizes`` when quick, else every STEP-th
    doubling from 4 B to ``max_bytes``."""
    if sizes:
        return list(sizes)
    if quick:
        return list(quick_sizes)
    return default_sizes(max_bytes)[::step]


def progress_bar(total: int, enabled: bool):
    """A rich progress bar over ``total`` cases, its task, and the ``step(label)``
    a sweep calls at each case."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description:<28}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), disable=not enabled, transient=False)
    task = progress.add_task("starting", total=total)

    def step(label: str) -> None:
        progress.update(task, description=label, advance=0 if step.first else 1)
        step.first = False
    step.first = True
    return progress, task, step


def rank_device(device: str) -> torch.device:
    """This rank's device of type ``device`` (``cuda``: local rank modulo the
    GPUs seen, made current); a ValueError naming what is missing."""
    if device == "cpu":
        return torch.device("cpu")
    if device != "cuda":
        raise ValueError(f"unknown device type {device!r} (expected cpu or cuda)")
    if not torch.cuda.is_available():
        raise ValueError("device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False)")
    dev = torch.device("cuda", api.get_local_rank() % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


def human(nbytes: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div}{unit}"
    return f"{nbytes}"


def cpu_model() -> str:
    """This host's CPU model (/proc/cpuinfo's "model name", else ``platform.processor()``):
    the same code's costs differ by CPU, and so do raw MPI's."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def metadata(settings: dict, mode: str = "back-to-back", device: str = "cpu") -> dict:
    """Where and how a measurement was made (hosts, versions, date, mode, settings)."""
    import mpi4py

    hosts = sorted(set(_allgather_str(socket.gethostname())))
    cpus = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    return {"hosts": hosts, "cpu_models": sorted(set(_allgather_str(cpu_model()))), "world_size": api.get_world_size(),
            "rank_cpus": _allgather_str(cpus),  # per rank: the CPUs it may run on (pinned or not)
            "versions": {"mcrdl": __import__("mcrdl").__version__, "torch": torch.__version__,
                         "mpi4py": mpi4py.__version__, **api.get_backend_versions()},
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "mode": mode, "device": device,
            **({"cold_step": COLD_STEP} if mode == "cold" else {}), "sweep": settings}


def mode_of(meta: dict) -> str:
    """The bench mode of validated metadata (files without one: back-to-back)."""
    return meta.get("mode", "back-to-back")


def _allgather_str(text: str) -> list[str]:
    rt = api.current_runtime()
    return [b.decode() for b in rt.control_allgather(rt.world, text.encode())]


def write_json(path: str, results: Sequence[Result], meta: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"format": FORMAT, "metadata": meta, "results": [asdict(r) for r in results]},
                  f, indent=1)
        f.write("\n")


CSV_FIELDS = ("op", "bytes", "variant", "backend", "iters", "rounds", "avg_us", "min_us",
              "max_us", "algbw_gbps", "busbw_gbps", "check")


def write_csv(path: str, results: Sequence[Result]) -> None:
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in results:
            w.writerow(asdict(r))


def load_json(path: str) -> tuple[list[Result], dict]:
    """Read and validate a ``mcrdl-bench/1`` file (see :func:`from_doc`)."""
    return from_doc(read_json(path, "bench result"), str(path))


#: Result field -> (check, what it expects).
_FIELD_CHECKS = {
    "op": (lambda v: v in BENCH_OPS, f"one of {', '.join(BENCH_OPS)}"),
    "bytes": (is_int, "a byte count (integer >= 0)"),
    "variant": (lambda v: isinstance(v, str) and v != "", "a variant name"),
    "backend": (lambda v: isinstance(v, str), "a backend name"),
    "iters": (lambda v: is_int(v, 1), "an integer >= 1"),
    "rounds": (lambda v: is_int(v, 1), "an integer >= 1"),
    "round_max_us": (lambda v: isinstance(v, list) and all(is_number(t, 0) for t in v),
                     "a list of finite numbers >= 0"),
    "check": (lambda v: v in ("ok", "FAIL", "skipped"), "'ok', 'FAIL' or 'skipped'"),
}
_RESULT_FIELDS = {f.name: f for f in fields(Result)}


def from_doc(doc: Any, source: str = "<bench>") -> tuple[list[Result], dict]:
    """Validate a parsed ``mcrdl-bench/1`` document: (results, metadata).
    Metadata is free-form except ``world_size``, ``hosts`` and ``mode``. Errors are
    ValueErrors naming the source and the key, e.g. ``results[3].max_us``."""
    def fail(key: str, msg: str):
        raise ValueError(f"{source}: {key_path(key)}: {msg}")

    if not isinstance(doc, dict):
        fail("(top level)", f"expected a JSON object, got {type(doc).__name__}")
    if doc.get("format") != FORMAT:
        fail("format", f"not an mcrdl bench result: expected {FORMAT!r}, got {shown(doc.get('format'))}")
    for key in sorted(set(doc) - {"format", "metadata", "results"}, key=str)[:1]:
        fail(key, "unknown key (expected format, metadata, results)")
    meta = doc.get("metadata", {})
    if not isinstance(meta, dict):
        fail("metadata", f"expected an object, got {type(meta).__name__}")
    if "world_size" in meta and not is_int(meta["world_size"], 1):
        fail("metadata.world_size", f"expected an integer >= 1, got {shown(meta['world_size'])}")
    if meta.get("mode", MODES[0]) not in MODES:
        fail("metadata.mode", f"expected one of {', '.join(MODES)}, got {shown(meta['mode'])}")
    if meta.get("device", "cpu") not in DEVICES:
        fail("metadata.device", f"expected one of {', '.join(DEVICES)}, got {shown(meta['device'])}")
    hosts = meta.get("hosts", [])
    if not (isinstance(hosts, list) and all(isinstance(h, str) for h in hosts)):
        fail("metadata.hosts", f"expected a list of host names, got {shown(hosts)}")
    if not isinstance(doc.get("results"), list):
        fail("results", f"expected a list of results, got {shown(doc.get('results'))}")
    results = []
    for i, r in enumerate(doc["results"]):
        at = f"results[{i}]"
        if not isinstance(r, dict):
            fail(at, f"expected an object, got {type(r).__name__}")
        for key in sorted(set(r) - set(_RESULT_FIELDS), key=str)[:1]:
            fail(f"{at}.{key}", f"unknown key (expected {', '.join(_RESULT_FIELDS)})")
        for key, f in _RESULT_FIELDS.items():
            if key not in r:
                if f.default is MISSING and f.default_factory is MISSING:
                    fail(f"{at}.{key}", "required")
                continue
            check, expected = _FIELD_CHECKS.get(key, (lambda v: is_number(v, 0), "a finite number >= 0"))
            if not check(r[key]):
                fail(f"{at}.{key}", f"expected {expected}, got {shown(r[key])}")
        results.append(Result(**r))
    return results, meta


def selection_summary(results: Sequence[Result]) -> Optional[str]:
    """How mcrdl's selection did against the forced backends, over every
    (op, size) measured with 'mcrdl' and at least one backend forced: where it
    picked the fastest, where it measured within 5 % of the fastest, and, as
    the run's noise floor, how it compared with the same backend forced (the
    same calls through the same code)."""
    by_point: dict[tuple, dict[str, Result]] = {}
    for r in results:
        by_point.setdefault((r.op, r.bytes), {})[r.variant] = r
    picked = within = slower = faster = 0
    same = []
    for rs in by_point.values():
        forced = {v: r.max_us for v, r in rs.items() if v != "mcrdl" and not v.startswith("raw-")}
        if "mcrdl" not in rs or not forced:
            continue
        mine, best = rs["mcrdl"], min(forced, key=forced.get)
        picked += mine.backend == best
        within += mine.max_us <= 1.05 * forced[best]
        if mine.backend in forced:
            ratio = mine.max_us / forced[mine.backend]
            same.append(ratio)
            slower, faster = slower + (ratio > 1.05), faster + (ratio < 1 / 1.05)
    if not same:
        return None
    n = len(same)
    return (f"selection over {n} points: picked the fastest forced backend at {picked}/{n}; "
            f"within 5% of the fastest at {within}/{n}; against the same backend forced "
            f"(same calls: the run's noise) median {statistics.median(same):.2f}x, "
            f"over 5% slower at {slower}, over 5% faster at {faster}")


def print_tables(results: Sequence[Result], console=None) -> None:
    """One rich table per op: latency per variant, the fastest backend through
    mcrdl, and the ratios users care about: selection over that best, and each
    backend through mcrdl over its raw library call."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if os.isatty(1) else 160)
    by_op: dict[str, dict[int, dict[str, Result]]] = {}
    for r in results:
        by_op.setdefault(r.op, {}).setdefault(r.bytes, {})[r.variant] = r
    for op, by_size in by_op.items():
        variants = list(next(iter(by_size.values())))
        raw_pairs = [(v[4:], v) for v in variants if v.startswith("raw-") and v[4:] in variants]
        table = Table(title=f"{op}: latency in us (slowest rank, median over rounds)")
        table.add_column("bytes", justify="right")
        for v in variants:
            table.add_column(v, justify="right")
        table.add_column("best", justify="left")
        table.add_column("busbw GB/s", justify="right")
        if "mcrdl" in variants:
            table.add_column("mcrdl/best", justify="right")
        for b, raw in raw_pairs:
            table.add_column(f"{b}/{raw}", justify="right")
        for size, rs in sorted(by_size.items()):
            forced = {v: r for v, r in rs.items() if v != "mcrdl" and not v.startswith("raw-")}
            best = min(forced, key=lambda v: forced[v].max_us) if forced else None
            row = [human(size)]
            for v in variants:
                cell = f"{rs[v].max_us:.1f}"
                row.append(f"[red]{cell} FAIL[/red]" if rs[v].check == "FAIL" else cell)
            row += [best or "", f"{forced[best].busbw_gbps:.2f}" if best else ""]
            if "mcrdl" in variants:
                row.append(f"{rs['mcrdl'].max_us / forced[best].max_us:.2f}" if best else "")
            row += [f"{rs[b].max_us / rs[raw].max_us:.2f}" for b, raw in raw_pairs]
            table.add_row(*row)
        console.print(table)


def run(*, variants: Optional[Sequence[str]] = None, device: Optional[str] = None,
        ops: Optional[Sequence[str]] = None, sizes: Optional[Sequence[int]] = None, quick: bool = False,
        max_bytes: Optional[int] = None, step: int = 1, iters: Optional[int] = None,
        large_iters: Optional[int] = None, warmup: int = 3, rounds: Optional[int] = None, cold: bool = False,
        check: bool = False, table: Optional[str] = None, json_path: Optional[str] = None,
        csv_path: Optional[str] = None, plot: Optional[str] = None, timeout: float = 300,
        threads: Optional[int] = None) -> list[Result]:
    """``mcrdl bench`` in this job: sweep ``variants`` (default: every live backend,
    ``mcrdl`` and the raw libraries) over ``ops`` and ``sizes``; rank 0 prints the
    tables and writes the files asked for. Starts and ends mcrdl itself (``table``:
    the tuning table of the ``mcrdl`` variant); every rank calls it. Returns the
    results whose check failed (``check``). A ValueError names a bad argument."""
    api.init_process_group(tuning_table=table, timeout=timeout)
    try:
        rank, world = api.get_rank(), api.get_world_size()
        device = device or default_device()
        live = live_for(device)
        raw = raw_variants(live) if device == "cpu" else []
        variants = list(variants or live + ["mcrdl"] + raw)
        unknown = [v for v in variants if v not in live + ["mcrdl"] + raw]
        if unknown:
            raise ValueError(f"unknown or not live variants {unknown} for {device} tensors (live backends: "
                             f"{', '.join(live)}; raw variants, CPU tensors only: "
                             f"{', '.join(raw_variants(live)) or 'none'})")
        ops = ops_for(ops, world)
        sizes = sweep_sizes(sizes, quick, [4, 1024, 65536, 1 << 20], max_bytes or 16 << 20, step)
        iters = iters or (20 if quick else 100)
        large = large_iters or (5 if quick else 10)
        rounds = rounds or (2 if quick else 5)
        progress, task, advance = progress_bar(len(ops) * len(sizes), rank == 0)
        with progress:
            b = Bench(variants, iters, large, warmup, rounds, check, advance, cold, device, threads)
            try:
                results = b.sweep(ops, sizes)
            finally:
                b.close()
            progress.update(task, advance=1, description="done")
        meta = metadata({"ops": ops, "sizes": sizes, "variants": variants, "iters": iters,
                         "large_iters": large, "rounds": rounds, "warmup": warmup,
                         "torch_threads": b.threads}, b.mode, device)
        failed = [r for r in results if r.check == "FAIL"]
        if rank == 0:
            print_tables(results)
            summary = selection_summary(results)
            if summary:
                print(summary)
            if json_path:
                write_json(json_path, results, meta)
            if csv_path:
                write_csv(csv_path, results)
            if plot:
                from .plots import plot_ops
                print("plot:", plot_ops(results, plot, title=f"mcrdl bench ({world} ranks)"))
            if failed:
                print(f"CHECK FAILED: {len(failed)} results: " + ", ".join(
                    f"{r.op} {r.bytes} B on {r.variant}" for r in failed[:10]))
        return failed
    finally:
        api.destroy_process_group()
