"""Common runner of the end-to-end workloads: modes, seeding, timing, results.

A workload (``moe``, ``dlrm``, ``megatron``, ``ddp``) is a :class:`Workload`:
it builds its model from a seed after mcrdl is initialised and runs one
training step at a time, sending every communication call through
:data:`comm` (a timing proxy of the ``mcrdl`` module). The runner:

* initialises mcrdl once per *run* in the run's mode:

  ========================  ====================================================
  ``baseline`` / ``baseline-B``  every op class on one backend ``B`` (default:
                            ``--baseline-backend``, gloo: what a PyTorch CPU user
                            has today)
  ``coarse``                one backend per op class, every size (a static
                            ``op_backends`` map): ``--coarse-map``, else derived
                            from the tuning table (per op, the backend that wins
                            most of the table's measured sizes: the published
                            system's "best library per operation")
  ``tuned``                 the tuning table (``--table``, else a quick
                            ``mcrdl tune`` of the workload's ops, run in the job)
  ``torch``                 (DDP only) torch's own DDP all-reduce on its gloo
                            group, no mcrdl in the gradient path
  ========================  ====================================================

  A mode may carry a workload variant after ``+`` (``tuned+fused``,
  ``tuned+fp16`` for DDP).
* builds the model from ``--seed`` (identical initial weights on every rank
  and in every mode) and synthetic data from (seed, rank, step);
* runs ``--warmup`` untimed and ``--steps`` timed steps; rounds
  (``--rounds``) repeat every mode in turn, so machine noise hits all alike;
* times each step (``perf_counter``, after a barrier before the first) and the
  communication inside it: the union of the intervals during which a call
  through :data:`comm` (or a DDP hook's future) was outstanding;
* gathers per-rank losses, step times, communication times and a parameter
  digest to rank 0, which prints a table, checks that every mode produced the
  same losses and parameters as the first mode (within ``--rtol``), and
  writes ``--json``.

Reported: step time = median over timed steps (all rounds) of the slowest
rank's step time; samples/s = global samples per step / step time; comm share
= communication time / step time, summed over timed steps, mean over ranks.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

import mcrdl
from mcrdl.backends import REGISTRY
from mcrdl.tools.bench import rank_device
from mcrdl.tuning import TuningTable

FORMAT = "mcrdl-workload/1"

#: Lookup tensor position per op (for explain): the tensor whose bytes decide.
_LOOKUP_ARG = {"all_reduce": 0, "broadcast": 0, "all_gather_into_tensor": 1,
               "reduce_scatter_tensor": 1, "all_to_all_single": 1}

#: Relative/absolute tolerance for "same losses in every mode" (float32).
DEFAULT_RTOL = 1e-5
DEFAULT_ATOL = 1e-6


# -- communication timing --------------------------------------------------------------------
class CommTimer:
    """Intervals during which communication was outstanding, and a profile of
    the calls of one step (op, lookup tensor, group) when ``profiling``."""

    def __init__(self):
        self.intervals: List[tuple] = []
        self.profiling = False
        self.profile: List[tuple] = []

    def add(self, t0: float, t1: float) -> None:
        self.intervals.append((t0, t1))

    def note(self, op: str, tensor: torch.Tensor, group=None, async_op: bool = False) -> None:
        if self.profiling:
            self.profile.append((op, tensor, group, async_op))

    def take(self, lo: float, hi: float) -> float:
        """Seconds of [lo, hi] covered by recorded intervals; clears them."""
        spans = sorted((max(a, lo), min(b, hi)) for a, b in self.intervals if b > lo and a < hi)
        self.intervals = []
        total, cur_a, cur_b = 0.0, None, None
        for a, b in spans:
            if cur_b is None or a > cur_b:
                if cur_b is not None:
                    total += cur_b - cur_a
                cur_a, cur_b = a, b
            else:
                cur_b = max(cur_b, b)
        if cur_b is not None:
            total += cur_b - cur_a
        return total


class _TimedWork:
    """An mcrdl Work whose completion (wait, or its future) closes the interval."""

    def __init__(self, work, timer: CommTimer, t0: float):
        self._work, self._timer, self._t0, self._closed = work, timer, t0, False

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            self._timer.add(self._t0, time.perf_counter())

    def wait(self, timeout=None):
        try:
            return self._work.wait(timeout)
        finally:
            self._close()

    def get_future(self):
        def done(fut):
            self._close()
            return fut.value()
        return self._work.get_future().then(done)

    def __getattr__(self, name):
        return getattr(self._work, name)


class TimedComm:
    """``comm.all_reduce(t)`` runs ``mcrdl.all_reduce(t)`` and records how long
    it was outstanding (sync: the call; async: until ``wait()`` returns or the
    future completes)."""

    def __init__(self, timer: CommTimer):
        self.timer = timer
        self._cache: Dict[str, Callable] = {}

    def __getattr__(self, name: str):
        try:
            return self._cache[name]
        except KeyError:
            pass
        fn = getattr(mcrdl, name)
        timer = self.timer
        arg = _LOOKUP_ARG.get(name)

        def call(*args, **kwargs):
            if timer.profiling and arg is not None:
                t = args[arg] if len(args) > arg else kwargs.get(
                    "input" if name in ("reduce_scatter_tensor", "all_to_all_single") else
                    "input_tensor" if name == "all_gather_into_tensor" else "tensor")
                timer.note(name, t, kwargs.get("group"), bool(kwargs.get("async_op")))
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if kwargs.get("async_op") and out is not None:
                return _TimedWork(out, timer, t0)
            timer.add(t0, time.perf_counter())
            return out

        self._cache[name] = call
        return call


#: The one timer and proxy every workload uses.
timer = CommTimer()
comm = TimedComm(timer)


# -- gradient all-reduce used by several workloads --------------------------------------------
def all_reduce_grads(params: Sequence[torch.Tensor], group=None, scale: float = 1.0) -> None:
    """SUM-all-reduce the gradients of ``params`` over ``group`` in one fused
    call (mcrdl's tensor fusion when present, else one flat buffer), then
    multiply by ``scale``."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    try:
        from mcrdl.features.fusion import all_reduce_coalesced
    except ImportError:  # fusion not available: pack by hand
        all_reduce_coalesced = None
    if all_reduce_coalesced is not None:
        t0 = time.perf_counter()
        timer.note("all_reduce", sum(g.numel() * g.element_size() for g in grads), group)
        all_reduce_coalesced(grads, group=group)  # one bucket up to 25 MB
        timer.add(t0, time.perf_counter())
    else:
        flat = torch.cat([g.reshape(-1) for g in grads])
        comm.all_reduce(flat, group=group)
        off = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[off:off + n].view_as(g))
            off += n
    if scale != 1.0:
        for g in grads:
            g.mul_(scale)


# -- autograd collectives -------------------------------------------------------------------
class AllToAll(torch.autograd.Function):
    """Rows of ``x`` go to ranks by ``in_splits``; backward sends gradients back."""

    @staticmethod
    def forward(ctx, x, out_splits: List[int], in_splits: List[int], group=None):
        ctx.splits = (out_splits, in_splits, group)
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits, group = ctx.splits
        gi = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all_single(gi, grad.contiguous(), in_splits, out_splits, group=group)
        return gi, None, None, None


# -- seeding --------------------------------------------------------------------------------
def generator(seed: int, *salt: int) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and ``salt`` (rank, step, ...)."""
    h = seed & 0x7FFFFFFF
    for s in salt:
        h = (h * 1000003 + int(s) + 1) % (2 ** 61 - 1)
    return torch.Generator().manual_seed(h)


# -- workloads ------------------------------------------------------------------------------
class Workload:
    """One training workload. Subclasses set ``name``, ``ops`` (the op classes
    it uses: the baseline map and the quick tune cover these), ``variants``
    (names accepted after ``+`` in a mode) and implement the methods."""

    name = "workload"
    ops: tuple = ("all_reduce",)
    variants: tuple = ()
    modes_extra: tuple = ()     # extra mode names (DDP: "torch")
    lossy_variants: tuple = ()  # variants whose results may differ (compression)
    sample_unit = "samples"
    #: where this rank's model and data live (``--device``); set by the runner before build
    device = torch.device("cpu")

    def add_args(self, p: argparse.ArgumentParser) -> None:
        pass

    def config(self, args) -> dict:
        return {}

    def samples_per_step(self, args, world: int) -> int:
        raise NotImplementedError

    def build(self, args, mode: str, variant: Optional[str], run_id: int) -> None:
        """Make groups, model, optimizer from ``args.seed`` (mcrdl is initialised)."""
        raise NotImplementedError

    def step(self, i: int) -> float:
        """One training step on batch ``i``; returns this rank's loss."""
        raise NotImplementedError

    def parameters(self) -> List[torch.Tensor]:
        """This rank's parameters (for the final-parameter digest)."""
        raise NotImplementedError

    def teardown(self) -> None:
        pass


class Classifier(Workload):
    """A data-parallel MLP classifier (GELU between layers, SGD with momentum) on
    synthetic data: inputs ~ N(0, 1), labels from a fixed random teacher (argmax
    of a linear map), seeded by (seed, rank, step). ``batch``, ``hidden`` and
    ``bucket_mb`` are the subclass's defaults; ``bucket_help`` says what a bucket is."""

    ops = ("all_reduce",)
    sample_unit = "samples"
    batch_default, hidden_default, bucket_default, bucket_help = 32, "1024,1024", 2.0, ""

    def add_args(self, p):
        g = p.add_argument_group(self.name)
        g.add_argument("--batch", type=int, default=self.batch_default,
                       help=f"samples per rank (default {self.batch_default})")
        g.add_argument("--inputs", type=int, default=256)
        g.add_argument("--hidden", default=self.hidden_default, help="hidden sizes (comma)")
        g.add_argument("--classes", type=int, default=10)
        g.add_argument("--bucket-mb", type=float, default=self.bucket_default, help=self.bucket_help)
        g.add_argument("--lr", type=float, default=0.05)

    def config(self, args):
        return {"batch": args.batch, "mlp": f"{args.inputs}-{args.hidden.replace(',', '-')}-{args.classes}",
                "bucket_mb": args.bucket_mb}

    def samples_per_step(self, args, world):
        return args.batch * world

    def make_net(self, args) -> torch.nn.Module:
        """The model from ``args.seed`` (the same on every rank), and the teacher."""
        self.args, self.rank = args, mcrdl.get_rank()
        torch.manual_seed(args.seed)
        sizes = [args.inputs, *(int(x) for x in args.hidden.split(",") if x), args.classes]
        layers = []
        for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(torch.nn.Linear(m, n))
            if i < len(sizes) - 2:
                layers.append(torch.nn.GELU())
        self.net = torch.nn.Sequential(*layers).to(self.device)
        self.teacher = torch.randn(args.inputs, args.classes, generator=generator(args.seed, 3)).to(self.device)
        return self.net

    def batch(self, i):
        a = self.args
        g = generator(a.seed, self.rank, i)
        x = torch.randn(a.batch, a.inputs, generator=g).to(self.device)
        return x, (x @ self.teacher).argmax(1)

    def parameters(self):
        return list(self.net.parameters())


# -- modes ----------------------------------------------------------------------------------
#: The single-library baselines of mode ``all`` per device type (CUDA: MPI host-staged).
BASELINES = {"cpu": ("gloo", "mpi"), "cuda": ("gloo", "mpi_staged")}


def parse_modes(spec: str, workload: Workload, baseline_backend: str, device: str = "cpu") -> List[tuple]:
    """``"baseline,coarse,tuned+fused"`` -> [(label, kind, backend, variant)]."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if item == "all":
            for lbl in [f"baseline-{b}" for b in BASELINES[device]] + ["coarse", "tuned"]:
                out.extend(parse_modes(lbl, workload, baseline_backend, device))
            continue
        base, _, variant = item.partition("+")
        variant = variant or None
        if variant is not None and variant not in workload.variants:
            raise ValueError(f"{workload.name}: unknown variant {variant!r} in mode {item!r} "
                             f"(variants: {', '.join(workload.variants) or 'none'})")
        backend = None
        if base == "baseline":
            kind, backend = "baseline", baseline_backend
        elif base.startswith("baseline-"):
            kind, backend = "baseline", base[len("baseline-"):]
        elif base in ("coarse", "tuned", "autotuned") or base in workload.modes_extra:
            kind = base
        else:
            raise ValueError(f"{workload.name}: unknown mode {base!r} (expected baseline, "
                             f"baseline-<backend>, coarse, tuned, autotuned"
                             + "".join(f", {m}" for m in workload.modes_extra) + ")")
        label = (f"baseline-{backend}" if kind == "baseline" else kind) + \
            (f"+{variant}" if variant else "")
        out.append((label, kind, backend, variant))
    if not out:
        raise ValueError("no mode given")
    return out


def coarse_map_from_table(doc: dict, ops: Sequence[str], world: int, device: str = "cpu") -> Dict[str, str]:
    """Per op class: the backend the table picks for most of its measured sizes
    (ties: the one picked for the largest size). Coarse mixing = one backend per
    operation, chosen from the same measurements as the tuned table. ``doc``:
    a table document in the current format (``TuningTable.to_dict()``), whose
    rules for the workload's ``device`` decide."""
    rules = doc.get("rules", {}).get(device, {})
    sizes = sorted(doc.get("metadata", {}).get("sweep", {}).get("sizes") or [])
    out = {}
    for op in ops:
        by_group = rules.get(op)
        if not by_group:
            continue
        groups = sorted(int(g) for g in by_group)
        below = [g for g in groups if g <= world]
        rs = by_group[str(below[-1] if below else groups[0])]
        pts = sizes or [r["max_bytes"] for r in rs if r["max_bytes"] is not None] or [0]
        votes: Dict[str, int] = {}
        last = None
        for s in pts:
            b = next(r["backend"] for r in rs if r["max_bytes"] is None or s <= r["max_bytes"])
            votes[b] = votes.get(b, 0) + 1
            last = b
        best = max(votes.values())
        winners = [b for b, v in votes.items() if v == best]
        out[op] = last if last in winners else winners[0]
    return out


def init_kwargs(kind: str, backend: Optional[str], ops: Sequence[str], table: Optional[dict],
                coarse: Optional[Dict[str, str]]) -> dict:
    from mcrdl.tuning import SELECT_OPS

    if kind == "baseline":
        return {"default_backend": backend, "op_backends": {op: backend for op in SELECT_OPS}}
    if kind == "coarse":
        return {"op_backends": dict(coarse or {})}
    if kind == "tuned":
        return {"tuning_table": table}
    if kind == "autotuned":  # learns from the run's own calls: no table
        return {"autotune": True}
    return {}


def _share_table(path: str) -> dict:
    """Rank 0 reads and validates a tuning table; every rank gets it, or the
    same error (a file written by rank 0 need not be visible on other hosts).
    Collective."""
    reply: dict = {}
    if mcrdl.get_rank() == 0:
        try:
            reply = {"table": TuningTable.load(path, REGISTRY).to_dict()}
        except (OSError, ValueError) as exc:
            reply = {"error": str(exc)}
    reply = json.loads(_bcast_bytes(json.dumps(reply).encode()).decode())
    if "error" in reply:
        raise ValueError(f"--table {path}: {reply['error']}")
    return reply["table"]


def _bcast_bytes(data: bytes) -> bytes:
    n = torch.tensor([len(data)], dtype=torch.int64)
    mcrdl.broadcast(n, 0)
    buf = torch.zeros(int(n[0]), dtype=torch.uint8)
    if mcrdl.get_rank() == 0 and data:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    mcrdl.broadcast(buf, 0)
    return buf.numpy().tobytes()


def gather_json(obj) -> Optional[list]:
    """Every rank's JSON-able ``obj``, on rank 0 (None elsewhere). Collective."""
    data = json.dumps(obj).encode()
    n = torch.tensor([len(data)], dtype=torch.int64)
    mcrdl.all_reduce(n, op=mcrdl.ReduceOp.MAX)
    width = int(n[0]) + 8
    mine = torch.zeros(width, dtype=torch.uint8)
    mine[:8] = torch.tensor([len(data)], dtype=torch.int64).view(torch.uint8)
    mine[8:8 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    world = mcrdl.get_world_size()
    out = torch.empty(world * width, dtype=torch.uint8)
    mcrdl.all_gather_into_tensor(out, mine)
    if mcrdl.get_rank() != 0:
        return None
    raw = out.numpy().tobytes()
    rows = [raw[i * width:(i + 1) * width] for i in range(world)]
    return [json.loads(r[8:8 + int.from_bytes(r[:8], "little")]) for r in rows]


def _quick_tune(ops: Sequence[str], out: str, device: str) -> None:
    """``mcrdl tune --quick`` of ``ops`` on ``device`` tensors inside this job
    (every rank calls it)."""
    from mcrdl.tools import tune

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tune.run(out, quick=True, device=device, ops=ops)


# -- the runner -----------------------------------------------------------------------------
def parser(workload: Workload) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"{workload.name}.py",
        description=f"{workload.name} workload on mcrdl "
                    f"(run with `mcrdl run -n 2 examples/workloads/{workload.name}.py`)")
    p.add_argument("--mode", default="tuned",
                   help="baseline | baseline-<backend> | coarse | tuned | autotuned"
                        + "".join(f" | {m}" for m in workload.modes_extra)
                        + ", optionally +variant, or a comma list; 'all' = baseline-gloo,"
                          "baseline-mpi (cuda: baseline-mpi_staged),coarse,tuned (default: tuned)")
    p.add_argument("--baseline-backend", default="gloo", help="backend of 'baseline' (default gloo)")
    p.add_argument("--table", help="tuning table (tuned, and coarse without --coarse-map); "
                                   "default: run `mcrdl tune --quick` on the workload's ops")
    p.add_argument("--tune-out", default=os.path.join("out", "workloads", f"{workload.name}-table.json"),
                   help="where the automatic quick tune writes its table")
    p.add_argument("--coarse-map", help="static map for coarse, e.g. all_to_all:mpi,all_reduce:gloo")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--rounds", type=int, default=1, help="repeat all modes this many times, interleaved")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--device", choices=tuple(BASELINES), default="cpu",
                   help="where the model and data live (cuda: the GPU of local rank modulo the GPUs "
                        "seen; ranks may share one, then without NCCL) (default cpu)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1)")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                   help=f"loss/parameter agreement tolerance across modes (default {DEFAULT_RTOL})")
    p.add_argument("--timeout", type=float, default=300,
                   help="group timeout (s): a stuck collective fails after this (default 300)")
    p.add_argument("--json", help="write the results (rank 0) as JSON")
    p.add_argument("--quiet", action="store_true", help="only the final table")
    workload.add_args(p)
    return p


def _digest(params: Sequence[torch.Tensor]) -> List[float]:
    """Three numbers that change with any parameter: sum, sum of squares, weighted sum."""
    s = sq = w = 0.0
    k = 0
    for p in params:
        d = p.detach().double().reshape(-1).cpu()  # (the same digest on every device)
        s += float(d.sum())
        sq += float((d * d).sum())
        idx = torch.arange(k, k + d.numel(), dtype=torch.float64)
        w += float((d * torch.sin(idx)).sum())
        k += d.numel()
    return [s, sq, w]


def _profile(prof: list, device: str) -> list:
    """[(op, bytes, backend, count)] of one step's calls (backend as selected now;
    a call noted by its size alone was on ``device`` tensors)."""
    rows: Dict[tuple, int] = {}
    for op, t, group, async_op in prof:
        text = mcrdl.explain(op, t, group=group, device=device, async_op=async_op)
        head, _, rest = text.partition(": ")
        nbytes = int(head.split(" of ")[1].split(" B")[0])
        backend = rest.split(" (")[0]
        key = (op, nbytes, backend)
        rows[key] = rows.get(key, 0) + 1
    return [[op, b, be, n] for (op, b, be), n in sorted(rows.items())]


def _human(n: int) -> str:
    for unit, div in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= div:
            return f"{n / div:.3g} {unit}B"
    return f"{n} B"


def profile_lines(profile: list) -> List[str]:
    """Readable per (op, backend): calls per step and the size range."""
    by: Dict[tuple, list] = {}
    for op, nbytes, backend, n in profile:
        e = by.setdefault((op, backend), [0, nbytes, nbytes])
        e[0] += n
        e[1], e[2] = min(e[1], nbytes), max(e[2], nbytes)
    out = []
    for (op, backend), (n, lo, hi) in by.items():
        size = _human(lo) if lo == hi else f"{_human(lo)}-{_human(hi)}"
        out.append(f"{op} x{n} ({size}) -> {backend}")
    return out


def run_mode(workload: Workload, args, label: str, kind: str, backend: Optional[str],
             variant: Optional[str], table: Optional[dict], coarse: Optional[dict],
             run_id: int) -> dict:
    """One run: init in the mode, build, warm up, time; returns rank 0's record."""
    kwargs = init_kwargs(kind, backend, workload.ops, table, coarse)
    mcrdl.init_process_group(timeout=args.timeout, **kwargs)
    try:
        workload.device = rank_device(args.device)
        if kind == "baseline" and backend not in mcrdl.live_backends(args.device):
            raise ValueError(f"{workload.name}: mode {label}: backend {backend!r} takes no {args.device} "
                             f"tensors here (live for {args.device}: {', '.join(mcrdl.live_backends(args.device))})")
        workload.build(args, kind, variant, run_id)
        losses, step_s, comm_s, prof = [], [], [], []
        for i in range(args.warmup):
            losses.append(workload.step(i))
        tuned = mcrdl.autotune_report()
        exploring = None if tuned is None else sum(r["winner"] is None for r in tuned["buckets"])
        timer.take(0, 0)
        mcrdl.barrier()
        for i in range(args.warmup, args.warmup + args.steps):
            timer.profiling = i == args.warmup
            t0 = time.perf_counter()
            losses.append(workload.step(i))
            t1 = time.perf_counter()
            step_s.append(t1 - t0)
            comm_s.append(timer.take(t0, t1))
            if timer.profiling:
                timer.profiling = False
                prof, timer.profile = timer.profile, []
        profile = _profile(prof, args.device)
        mine = {"losses": losses, "step_s": step_s, "comm_s": comm_s,
                "digest": _digest(workload.parameters())}
        if tuned is not None:  # what autotune tried, and what was still exploring after the warm-up
            mine["autotune"] = {**mcrdl.autotune_report(), "exploring_after_warmup": exploring}
        workload.teardown()
        ranks = gather_json(mine)
    finally:
        mcrdl.destroy_process_group()
    if ranks is None:
        return {}
    n = len(step_s)
    slowest = [max(r["step_s"][j] for r in ranks) for j in range(n)]
    return {"mode": label, "kind": kind, "backend": backend, "variant": variant,
            "init": {k: v for k, v in kwargs.items() if k != "tuning_table"},
            "losses": [r["losses"] for r in ranks], "digest": [r["digest"] for r in ranks],
            "step_s": slowest, "rank_step_s": [r["step_s"] for r in ranks],
            "rank_comm_s": [r["comm_s"] for r in ranks], "profile": profile,
            **({"autotune": [r["autotune"] for r in ranks]} if "autotune" in ranks[0] else {})}


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    return math.isfinite(a) and math.isfinite(b) and abs(a - b) <= atol + rtol * abs(b)


def compare(runs: List[dict], rtol: float, atol: float = DEFAULT_ATOL,
            lossy: Sequence[str] = ()) -> dict:
    """Every run's losses and parameter digest against the first run's."""
    ref = runs[0]
    out = {"reference": ref["mode"], "rtol": rtol, "atol": atol, "modes": {}}
    ok_all = True
    for r in runs:
        max_abs = max_rel = 0.0
        ok = True
        pairs = [(a, b) for la, lb in zip(r["losses"], ref["losses"]) for a, b in zip(la, lb)]
        pairs += [(a, b) for da, db in zip(r["digest"], ref["digest"]) for a, b in zip(da, db)]
        for a, b in pairs:
            d = abs(a - b)
            max_abs = max(max_abs, d)
            max_rel = max(max_rel, d / abs(b) if b else (0.0 if d == 0 else math.inf))
            ok = ok and _close(a, b, rtol, atol)
        exact = max_abs == 0.0
        is_lossy = r.get("variant") in lossy
        entry = out["modes"].setdefault(r["mode"], {"max_abs": 0.0, "max_rel": 0.0, "ok": True,
                                                    "exact": True, "lossy": is_lossy})
        entry["max_abs"] = max(entry["max_abs"], max_abs)
        entry["max_rel"] = max(entry["max_rel"], max_rel)
        entry["ok"] = entry["ok"] and ok
        entry["exact"] = entry["exact"] and exact
        if not is_lossy:
            ok_all = ok_all and ok
    out["ok"] = ok_all
    return out


def summarise(runs: List[dict], samples: int) -> Dict[str, dict]:
    """Per mode, over its runs (rounds): median step, samples/s, comm share."""
    by: Dict[str, List[dict]] = {}
    for r in runs:
        by.setdefault(r["mode"], []).append(r)
    out = {}
    for mode, rs in by.items():
        steps = [s for r in rs for s in r["step_s"]]
        med = statistics.median(steps) if steps else float("nan")
        q = statistics.quantiles(steps, n=4, method="inclusive") if len(steps) > 1 else [med, med, med]
        shares = []
        for r in rs:
            for st, cs in zip(r["rank_step_s"], r["rank_comm_s"]):
                if sum(st) > 0:
                    shares.append(sum(cs) / sum(st))
        comm_known = not (rs[0]["kind"] == "torch")
        out[mode] = {"step_ms": med * 1e3, "step_ms_mean": statistics.fmean(steps) * 1e3 if steps else None,
                     "step_ms_p25": q[0] * 1e3, "step_ms_p75": q[2] * 1e3, "timed_steps": len(steps),
                     "samples_per_s": samples / med if med > 0 else None,
                     "comm_share": statistics.fmean(shares) if shares and comm_known else None,
                     "final_loss": rs[0]["losses"][0][-1] if rs[0]["losses"][0] else None,
                     "profile": rs[0]["profile"], "init": rs[0]["init"]}
    return out


def print_report(workload: Workload, doc: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if os.isatty(1) else 150)
    summ, agree = doc["summary"], doc["agreement"]
    cfg = ", ".join(f"{k}={v}" for k, v in doc["config"].items())
    t = Table(title=f"{workload.name}: {doc['world_size']} ranks, {doc['steps']} timed steps x "
                    f"{doc['rounds']} rounds ({cfg})")
    for col in ("mode", f"{workload.sample_unit}/s", "step ms (p25-p75)", "comm share", "final loss (rank 0)",
                f"vs {agree['reference']}"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode, s in summ.items():
        a = agree["modes"][mode]
        verdict = ("identical" if a["exact"] else f"max rel {a['max_rel']:.1e}") + \
            ("" if a["ok"] else (" (lossy)" if a["lossy"] else " MISMATCH"))
        t.add_row(mode, f"{s['samples_per_s']:.1f}",
                  f"{s['step_ms']:.2f} ({s['step_ms_p25']:.1f}-{s['step_ms_p75']:.1f})",
                  "—" if s["comm_share"] is None else f"{100 * s['comm_share']:.0f}%",
                  f"{s['final_loss']:.6f}", verdict)
    console.print(t)
    if any(s["profile"] for s in summ.values()):
        console.print("communication per step (first timed step, rank 0; op, lookup bytes, count) "
                      "and the backend each mode selects:")
        for mode, s in summ.items():
            if s["profile"]:
                console.print(f"  {mode:>16}: " + "; ".join(profile_lines(s["profile"])))
    console.print("losses and parameters " + (
        "agree across modes" if agree["ok"] else "DO NOT AGREE across modes") +
        f" (reference {agree['reference']}, rtol {agree['rtol']:g})")


def main(workload: Workload, argv: Optional[Sequence[str]] = None) -> int:
    """Run ``workload`` as its command line says. An exception on any rank
    aborts the whole MPI job (its peers would otherwise wait in a collective
    until the group timeout)."""
    try:
        return _main(workload, argv)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException:
        _abort_job()
        raise


def _abort_job() -> None:
    import traceback

    from mcrdl.rank_env import mpi_launched

    if not mpi_launched():
        return
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
        traceback.print_exc()
        sys.stderr.flush()
        MPI.COMM_WORLD.Abort(1)


def _main(workload: Workload, argv: Optional[Sequence[str]] = None) -> int:
    args = parser(workload).parse_args(argv)
    torch.set_num_threads(args.threads)
    modes = parse_modes(args.mode, workload, args.baseline_backend, args.device)
    kinds = {k for _, k, _, _ in modes}
    table = coarse = None
    if "coarse" in kinds and args.coarse_map:
        from mcrdl.selector import parse_op_backends
        coarse = parse_op_backends(args.coarse_map)
    path = None
    if "tuned" in kinds or ("coarse" in kinds and coarse is None):
        path = args.table
        if path is None:
            path = args.tune_out
            _quick_tune(workload.ops, path, args.device)
    mcrdl.init_process_group()
    try:
        world = mcrdl.get_world_size()
        table = _share_table(path) if path else None
    finally:
        mcrdl.destroy_process_group()
    runs = []
    run_id = 0
    for rnd in range(args.rounds):
        for label, kind, backend, variant in modes:
            if kind == "coarse" and coarse is None:
                coarse = coarse_map_from_table(table, workload.ops, world, args.device)
            rec = run_mode(workload, args, label, kind, backend, variant, table, coarse, run_id)
            run_id += 1
            if rec:
                rec["round"] = rnd
                runs.append(rec)
                if not args.quiet:
                    s = statistics.median(rec["step_s"]) if rec["step_s"] else float("nan")
                    print(f"[{workload.name}] round {rnd} {label:>18}: step {s * 1e3:8.2f} ms, "
                          f"loss {rec['losses'][0][-1]:.6f}", flush=True)
    if not runs:  # not rank 0
        return 0
    world = len(runs[0]["losses"])
    samples = workload.samples_per_step(args, world)
    agreement = compare(runs, args.rtol, lossy=workload.lossy_variants)
    doc = {"format": FORMAT, "workload": workload.name, "world_size": world,
           "config": workload.config(args), "samples_per_step": samples,
           "sample_unit": workload.sample_unit, "steps": args.steps, "warmup": args.warmup,
           "rounds": args.rounds, "seed": args.seed, "threads": args.threads, "device": args.device,
           "modes": [m[0] for m in modes], "coarse_map": coarse,
           "table": args.table or (args.tune_out if table is not None else None),
           "command": " ".join([os.path.basename(sys.argv[0]), *(argv if argv is not None else sys.argv[1:])]),
           "host": platform.node(), "cpus": os.cpu_count(), "torch": torch.__version__,
           "summary": summarise(runs, samples), "agreement": agreement, "runs": runs}
    print_report(workload, doc)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
    return 0 if agreement["ok"] else 3

