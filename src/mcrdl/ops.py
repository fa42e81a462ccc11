"""Every operation described once (:class:`Op`), and the paths that run them.

An :class:`Op` says what an operation is: the backend method that runs it,
its tensors (which it reads, which it writes, which one a caller may pass as
a list of per-rank blocks), its root or peer, whether it reduces, the size
the selector keys on, and the checks that name bad input. The API hands each
call to the driver :func:`driver` returns, which serves it in one of two ways:

- **from a plan** (the fast path, compiled: csrc/driver.cpp's ``drive``, the
  one implementation of it): on a group of this runtime, with debug mode off
  and no outstanding work the call must order after (async ops: ordered
  against it there), the facts an op reads from its tensors key a
  :class:`Plan` the group keeps, made once by :func:`plan` from the general
  path's checks: backend chosen, the backend's starter set up. A repeated
  call starts and waits (or returns its Work), nothing else. A call right
  after compute pays for every line it runs in cache misses
  (docs/results/cold_calls.md), so this path matters more in a training step
  than back to back.
- **the general path** (:func:`general`) otherwise, and for every call
  without the compiled module (no compiler, ``MCRDL_NATIVE=0``): check, order
  after conflicting outstanding work, make contiguous, private or flat
  copies, map the reduction, select (debug fingerprint, size agreement,
  autotune), start, and wait or return a Work.
"""
from __future__ import annotations

import json
import sys
import time
from typing import Callable, NamedTuple, Optional, Sequence

import torch
from torch.autograd import profiler as _torch_profiler

from . import facts as _facts
from .backends.base import ANY_SOURCE
from .facts import KEY, P2P, PAIRED, PAIRED_REDUCED, REDUCED, ROOTED, ROOTED_REDUCED
from .runtime import Group, Runtime
from .types import CommError, ReduceOp, UnsupportedError
from .work import DONE, AfterAll, Done, Engine, Work, _overlap, current_stream  # (DONE, Engine: read by drive's setup)

#: Dtypes the API accepts (per backend limits are checked by the selector).
DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8,
                    torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool})
MAX_TAG = 2**31 - 1  # a C int (MPI's own bound, MPI_TAG_UB, may be lower)
#: Largest list (bytes) whose view drive remembers between calls: a view made per call
#: cost gather and all_gather 1.1-1.6x raw MPI at 64-256 KiB per rank
#: (docs/results/hotpath.md). The memo keeps at most this much memory alive per list
#: op and group after the caller let go of it.
SPAN_MEMO_BYTES = 1 << 20
#: A single tensor's (nbytes, dtype) for a list op's plan: the compiled module's, once :func:`driver` ran.
_key: Optional[Callable] = None


class Op(NamedTuple):
    """One operation. Its backend method is called as ``method(h, *tensors,
    *fixed)``: ``tensors`` in ``names``' order (None where a rank has none),
    ``fixed`` the root or peer as a group rank (first), then the tag or the
    reduction (last)."""
    name: str
    method: str
    names: tuple  # each tensor argument's name, as errors give it
    reads: tuple  # indices of the tensors it reads ...
    writes: tuple  # ... and writes
    size: Callable  # (tensors, group size) -> the bytes the selector keys on
    recipe: int  # what its plans are keyed on (facts.plan_key), read from tensor ``at``
    check: Optional[Callable] = None  # (op, group, tensors) -> raises naming shapes that do not fit
    root: str = ""  # fixed[0] is a global rank, named so: "src", "dst"
    reduces: bool = False  # fixed[-1] is a reduction
    listed: int = -1  # the tensor a caller passes as a list of per-rank blocks (all_gather's tensor_list)
    at_root: bool = False  # ... on the root rank only (gather, scatter)
    block: int = 0  # the tensor whose shape every rank passes alike (debug mode compares it)
    collective: bool = True  # False: point to point (the peer passes its own size)
    split: bool = False  # split sizes per call (all_to_all_single)
    at: int = 0


# -- checks -----------------------------------------------------------------------------
def check(op: str, t, what: str = "tensor") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {what} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise UnsupportedError(f"{op}: {what} has unsupported dtype {t.dtype} "
                               f"(supported: {', '.join(sorted(str(d) for d in DTYPES))})")
    return t


def same_kind(op: str, ref: torch.Tensor, t: torch.Tensor, what: str) -> None:
    if t.dtype != ref.dtype:
        raise TypeError(f"{op}: {what} has dtype {t.dtype}, expected {ref.dtype}")
    if t.device != ref.device:
        raise ValueError(f"{op}: {what} is on {t.device}, expected {ref.device}")


def check_list(op: str, lst, what: str, ref: torch.Tensor, size: int) -> None:
    if not isinstance(lst, (list, tuple)) or len(lst) != size:
        raise ValueError(f"{op}: {what} must be a list of {size} tensors (one per rank), "
                         f"got {type(lst).__name__ if not isinstance(lst, (list, tuple)) else len(lst)}")
    for i, t in enumerate(lst):
        check(op, t, f"{what}[{i}]")
        same_kind(op, ref, t, f"{what}[{i}]")
        if t.numel() != ref.numel():
            raise ValueError(f"{op}: {what}[{i}] has {t.numel()} elements, expected {ref.numel()}")


def _holds_blocks(op: str, g: Group, block: torch.Tensor, whole: torch.Tensor, what: str) -> None:
    """``whole`` (named ``what``) is one ``block`` per rank of ``g``, of the same kind."""
    same_kind(op, block, whole, what)
    if whole.numel() != block.numel() * g.size:
        raise ValueError(f"{op}: {what} has {whole.numel()} elements, expected "
                         f"{block.numel()} x {g.size} ranks = {block.numel() * g.size}")


def _root(op: str, g: Group, global_rank: int, what: str) -> int:
    if not isinstance(global_rank, int) or isinstance(global_rank, bool):
        raise TypeError(f"{op}: {what} must be an int rank, got {global_rank!r}")
    try:
        return g.group_rank(global_rank)
    except ValueError as exc:
        raise ValueError(f"{op}: {what}: {exc}") from None


def _peer(op: str, o: Op, g: Group, peer, tag) -> int:
    """A send's or receive's peer as a group rank (None: any, for a receive)."""
    if peer is None:
        if o.root == "dst":
            raise ValueError(f"{op}: dst is required")
        gpeer = ANY_SOURCE
    else:
        gpeer = _root(op, g, peer, o.root)
    if gpeer == g.rank:
        raise ValueError(f"{op}: {o.root}={peer} is this rank itself")
    if not isinstance(tag, int) or isinstance(tag, bool) or not 0 <= tag <= MAX_TAG:
        raise ValueError(f"{op}: tag must be an int from 0 to {MAX_TAG}, got {tag!r}")
    return gpeer


def _row(t: torch.Tensor) -> int:
    """Elements per dim-0 row."""
    n = 1
    for s in t.shape[1:]:
        n *= s
    return n


def _row_elements(op: str, input: torch.Tensor, output: torch.Tensor) -> int:
    """Elements per dim-0 row, the same in ``input`` and ``output``."""
    row = _row(input)
    if row != _row(output):
        raise ValueError(f"{op}: input rows have {row} elements but output rows have {_row(output)}")
    return row


def _splits(op: str, what: str, t: torch.Tensor, splits, size: int) -> list[int]:
    """Rows per peer along dim 0 (even when ``splits`` is None or empty)."""
    rows = t.shape[0] if t.dim() else t.numel()
    if not splits:
        if rows % size:
            raise ValueError(f"{op}: {what} has {rows} rows, not divisible by the group size "
                             f"{size}; pass {what}_split_sizes")
        return [rows // size] * size
    if len(splits) != size or any(not isinstance(s, int) or s < 0 for s in splits):
        raise ValueError(f"{op}: {what}_split_sizes must be {size} non-negative ints, got {list(splits)}")
    if sum(splits) != rows:
        raise ValueError(f"{op}: {what}_split_sizes sum to {sum(splits)} but {what} has {rows} rows")
    return list(splits)


def _even_rows(op: str, g: Group, output: torch.Tensor, input: torch.Tensor) -> None:
    """Without split sizes every rank sends and receives the same rows."""
    in_rows, out_rows = _splits(op, "input", input, None, g.size), _splits(op, "output", output, None, g.size)
    if in_rows != out_rows:
        raise ValueError(f"{op}: without split sizes input and output need the same rows, got "
                         f"{sum(in_rows)} and {sum(out_rows)}")


def _a2a_check(op: str, g: Group, ts: tuple) -> None:
    same_kind(op, ts[1], ts[0], "output")
    _row_elements(op, ts[1], ts[0])


# -- the descriptions ---------------------------------------------------------------------
def _nbytes(at: int, per_rank: bool = False):
    """The selector's size: tensor ``at``'s bytes (times the group size: a per-rank block)."""
    return (lambda ts, n: ts[at].nbytes * n) if per_rank else (lambda ts, n: ts[at].nbytes)


ALL_REDUCE = Op("all_reduce", "all_reduce", ("tensor",), (0,), (0,), _nbytes(0), REDUCED, reduces=True)
BROADCAST = Op("broadcast", "broadcast", ("tensor",), (0,), (0,), _nbytes(0), ROOTED, root="src")
REDUCE = Op("reduce", "reduce", ("tensor",), (0,), (0,), _nbytes(0), ROOTED_REDUCED, root="dst",
            reduces=True)
ALL_GATHER_INTO_TENSOR = Op(
    "all_gather_into_tensor", "all_gather_into_tensor", ("output_tensor", "input_tensor"), (1,), (0,),
    _nbytes(0), PAIRED, lambda op, g, ts: _holds_blocks(op, g, ts[1], ts[0], "output_tensor"), block=1)
REDUCE_SCATTER_TENSOR = Op(
    "reduce_scatter_tensor", "reduce_scatter_tensor", ("output", "input"), (1,), (0,), _nbytes(1),
    PAIRED_REDUCED, lambda op, g, ts: _holds_blocks(op, g, ts[0], ts[1], "input"), reduces=True)
ALL_GATHER = ALL_GATHER_INTO_TENSOR._replace(name="all_gather", names=("tensor_list", "tensor"), listed=0,
                                             recipe=KEY, at=1)
REDUCE_SCATTER = REDUCE_SCATTER_TENSOR._replace(name="reduce_scatter", names=("output", "input_list"),
                                                listed=1, recipe=REDUCED)
GATHER = Op("gather", "gather", ("gather_list", "tensor"), (1,), (0,), _nbytes(1, True), ROOTED, root="dst",
            listed=0, at_root=True, block=1, at=1)
SCATTER = Op("scatter", "scatter", ("tensor", "scatter_list"), (1,), (0,), _nbytes(0, True), ROOTED,
             root="src", listed=1, at_root=True)
ALL_TO_ALL_SINGLE = Op("all_to_all_single", "all_to_all_single", ("output", "input"), (1,), (0,), _nbytes(1),
                       PAIRED, _a2a_check, block=1, split=True)
SEND = Op("send", "send", ("tensor",), (0,), (), _nbytes(0), P2P, root="dst", collective=False)
RECV = Op("recv", "recv", ("tensor",), (), (0,), _nbytes(0), P2P, root="src", collective=False)
ISEND, IRECV = SEND._replace(name="isend"), RECV._replace(name="irecv")


# -- the driver ----------------------------------------------------------------------------
class Plan(NamedTuple):
    """How calls like one call run (csrc/driver.cpp reads it by these names): the
    backend chosen, its started-call function ``start(*tensors, *fixed)``, the
    bytes the selector keyed on, the root or peer (group rank; -1: none),
    ``extra``: a list op's single tensor's (nbytes, dtype), all_to_all_single's
    elements per row, else None; ``divide``: what the result tensor is divided
    by once the op is done (AVG: the group size, on the rank holding the
    result), else 0."""
    backend: str
    start: Callable
    nbytes: int
    peer: int
    extra: object
    divide: int = 0


def driver() -> Callable:
    """The driver the API calls (``api.run_op``): csrc/driver.cpp's ``drive``,
    which runs calls from their plans and hands every other call to
    :func:`general`; :func:`general` itself without the compiled module (no
    compiler, or ``MCRDL_NATIVE=0``)."""
    global _key
    compiled = _facts.load()
    if compiled is _facts:
        return general
    compiled.setup(sys.modules[__name__])
    _key = compiled.key
    _facts.provided("ops.general as api.run_op, for the calls that have a plan", "drive (csrc/driver.cpp)")
    return compiled.drive


def plan(rt: Runtime, g: Group, op: Op, key: tuple, tensors: tuple, fixed: tuple, backend, async_op: bool,
         even: bool) -> Optional[Plan]:
    """The :class:`Plan` ``drive`` keeps in ``g.plans`` under ``key`` for calls
    like this one, made from the general path's checks (``even``: no split
    sizes); None when such calls take the general path: ``g`` is not this
    runtime's or this rank is not in it, the call must agree on sizes first,
    or autotune explores the op's bucket (no plan is kept)."""
    if g.owner is not rt or g.rank < 0:
        return None
    name, i, extra = op.name, op.listed, None
    if i >= 0:  # a list: viewed per call by drive, the single tensor checked here
        single = tensors[1 - i]
        check(name, single, op.names[1 - i])
        root = _root(name, g, fixed[0], op.root) if op.root else -1
        whole = None if op.at_root else single.new_empty(single.numel() * g.size)
        tensors, extra = ((whole, single) if i == 0 else (single, whole)), _key(single)
        if op.check is not None:
            op.check(name, g, tensors)
    else:
        for t, what in zip(tensors, op.names):
            check(name, t, what)
        if op.check is not None:
            op.check(name, g, tensors)
        if not op.collective:
            root = _peer(name, op, g, *fixed)
        else:
            root = _root(name, g, fixed[0], op.root) if op.root else -1
    if op.split:
        extra = _row(tensors[1])
        if even:
            _even_rows(name, g, *tensors)
        elif rt.selector.needs_agreement(name, g.size, backend) or (rt.autotune is not None
                                                                    and rt.autotune.explores(name, backend)):
            return None  # ranks must agree on the size first
    bfixed = (root, *fixed[1:]) if op.root else fixed
    nbytes = op.size(tensors, g.size)
    dtype, rop = tensors[op.block].dtype, fixed[-1] if op.reduces else None
    divide = 0
    if rop is ReduceOp.AVG:  # a sum, then the rank holding the result divides (as _reduction)
        if not dtype.is_floating_point:
            return None  # (the general path names the error)
        rop, bfixed = ReduceOp.SUM, (*bfixed[:-1], ReduceOp.SUM)
        if not op.root or root == g.rank:
            divide = g.size
    chosen = rt.selector.choose(name, nbytes, g.size, "cpu", dtype, rop, backend,
                                g.declined_async if async_op and backend is None else g.declined)
    timeout, tuner, timed = 0.0 if async_op else g.timeout, rt.autotune, False
    if tuner is not None and backend is None and op.collective:
        won = tuner.frozen(g, name, nbytes, "cpu", chosen)
        if won is None:
            return None
        timed = won == chosen or rt.selector.why_not(won, name, "cpu", dtype, rop, g.declined) is None
        chosen = won if timed else chosen  # (the winner cannot run this dtype or reduction)
    start = rt.backends[chosen].starter(op.method, g.handles[chosen], timeout, tensors, *bfixed)
    if tuner is not None and backend is None and op.collective:
        start = tuner.watched(rt, g, name, nbytes, start, timed=timed and not async_op)
    if len(g.plans) >= 4096:
        g.plans.clear()
    made = g.plans[key] = Plan(chosen, start, nbytes, root, extra, divide)
    return made


def could_not_start(op: Op, backend: str, exc: BaseException) -> CommError:
    """The error of a call whose start raised ``exc``."""
    error = CommError(f"{op.name} on backend '{backend}' could not start: {exc}")
    error.__cause__ = exc
    return error


def blocked(rt: Runtime, g: Group, op: Op, backend: str, pending, reads: tuple, writes: tuple, post: tuple) -> None:
    """Wait for a blocking call started from its plan that its start did not finish."""
    rt.engine.block(op.name, backend, pending, g, reads, writes, post)


# -- the general path ------------------------------------------------------------------------
def group_of(rt: Optional[Runtime], group: Optional[Group], op: str = "mcrdl") -> Group:
    """``group`` (None: the world) after checking it belongs to ``rt``."""
    if rt is None:
        raise RuntimeError("mcrdl is not initialized: call mcrdl.init_process_group() first")
    if group is None:
        return rt.world
    if not isinstance(group, Group):
        raise TypeError(f"{op}: group must be an mcrdl Group from mcrdl.new_group(), "
                        f"got {type(group).__name__}")
    if group.owner is not rt:
        raise ValueError(f"{op}: {group!r} belongs to a process group that was destroyed")
    return group


def wait_for_conflicts(rt: Runtime, op: str, reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> None:
    """Program order (hazard 3): wait for outstanding work that writes what
    ``op`` reads, or touches what it writes, before anything reads them
    (staging copies included)."""
    if rt.engine.outstanding:
        rt.engine.order_before(reads, writes, op)


def general(rt: Optional[Runtime], op: Op, group, async_op: bool, backend, tensors: tuple, fixed: tuple = (),
            splits=None, prepare: bool = False):
    """The general path of one call (see the module's docstring). ``prepare``:
    check the call, ask the selector, and return a function ``start(async_op)``
    that runs it (batch_isend_irecv checks every item before it starts any)."""
    name, i = op.name, op.listed
    g = group_of(rt, group, name)
    for j, (t, what) in enumerate(zip(tensors, op.names)):
        if j != i:
            check(name, t, what)
    if i < 0 and op.check is not None:
        op.check(name, g, tensors)
    if i >= 0 and not op.at_root:  # (checked before membership, as torch does)
        check_list(name, tensors[i], op.names[i], tensors[1 - i], g.size)
    if g.rank < 0:
        return None
    if not op.collective:
        peer = _peer(name, op, g, *fixed)
    else:
        peer = _root(name, g, fixed[0], op.root) if op.root else -1
    ref = tensors[op.block]
    if prepare:
        rt.selector.choose(name, ref.nbytes, g.size, ref.device.type, ref.dtype, None, backend, g.declined)
    parts = None  # the caller's list of blocks
    if i >= 0:
        parts = tensors[i]
        if op.at_root and g.rank != peer:
            if parts:
                raise ValueError(f"{name}: {op.names[i]} must be None or empty on non-"
                                 f"{'destination' if op.root == 'dst' else 'source'} rank {rt.rank}")
            parts = None
        elif op.at_root:
            check_list(name, parts, op.names[i], tensors[1 - i], g.size)
    reads, writes = _touched(tensors, op.reads, i, parts), _touched(tensors, op.writes, i, parts)
    if op.split:
        even = splits is None
        in_rows = _splits(name, "input", tensors[1], None if even else splits[1], g.size)
        out_rows = _splits(name, "output", tensors[0], None if even else splits[0], g.size)
        row = _row_elements(name, tensors[1], tensors[0])
        if even:
            _even_rows(name, g, *tensors)

    def start(async_op: bool):
        wait_for_conflicts(rt, name, reads, writes)
        post: list = []
        ts = list(tensors)
        if i >= 0:  # the list travels as one flat buffer, concatenated or unpacked afterwards
            single = tensors[1 - i]
            if parts is None:
                ts[i] = None
            elif i in op.reads:
                ts[i] = torch.cat([t.reshape(-1) for t in parts])
            else:
                ts[i] = single.new_empty(g.size * single.numel())
                post.append(_unpack(ts[i], parts))
            ts[1 - i] = _contiguous(single, 1 - i in op.writes, post).view(-1)
        else:
            for j in op.writes:
                ts[j] = _contiguous(ts[j], True, post)
            for j in op.reads:
                if j not in op.writes:
                    ts[j] = _contiguous(ts[j], False, post)
                    for w in op.writes:  # (no library takes aliased send and receive buffers)
                        if _overlap(ts[j], ts[w]):
                            ts[j] = ts[j].clone()
        bfixed, rop = fixed, None
        if op.reduces:
            ts[:], rop = _reduction(name, ts, fixed[-1], g, post, ts[op.writes[0]],
                                    peer == g.rank if op.root else True)
            bfixed = (*fixed[:-1], rop)
        if op.root:
            bfixed = (peer, *bfixed[1:])
        counts = None
        if op.split:
            in_counts, out_counts = [r * row for r in in_rows], [r * row for r in out_rows]
            bfixed, counts = ((None, None), None) if even else ((out_counts, in_counts), in_counts)
        method = op.method
        return submit(rt, name, g, op.size(ts, g.size), ref, backend, async_op,
                      lambda b, h: getattr(b, method)(h, *ts, *bfixed), reads=reads, writes=writes,
                      post=post, result=list(writes if op.writes else reads), reduce_op=rop,
                      collective=op.collective,
                      invariant=_invariant(op, tensors, fixed, splits) if rt.debug or op.split else None,
                      agree=op.split and not even, skip_empty=op.collective and not op.split, peer=peer,
                      counts=counts)
    return start if prepare else start(async_op)


def _touched(tensors: tuple, at: tuple, listed: int, parts) -> tuple:
    """The tensors at ``at`` that an op touches, the list's blocks in the list's place."""
    out = []
    for j in at:
        if j == listed:
            out.extend(parts or ())
        else:
            out.append(tensors[j])
    return tuple(out)


def _invariant(op: Op, tensors: tuple, fixed: tuple, splits):
    """What every rank passes alike, compared in debug mode."""
    if op.split:
        return {"row": list(tensors[1].shape[1:]), "split sizes": "none" if splits is None else "given"}
    shape = list(tensors[op.block].shape)
    return [shape, fixed[0]] if op.root else shape


def _contiguous(t: torch.Tensor, written: bool, post: list) -> torch.Tensor:
    """A contiguous stand-in for ``t``; results are copied back when written."""
    if t is None or t.is_contiguous():
        return t
    c = t.contiguous()
    if written:
        post.append(lambda: t.copy_(c))
    return c


def _unpack(flat: torch.Tensor, outs: Sequence[torch.Tensor]) -> Callable[[], None]:
    def copy_out() -> None:
        offset = 0
        for t in outs:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view(t.shape))
            offset += n
    return copy_out


def _reduction(op: str, tensors: list, reduce_op, g: Group, post: list, out: torch.Tensor,
               holds_result: bool = True):
    """Map a reduction to what every backend can do exactly.

    bool -> uint8 with SUM/MAX as logical or, PRODUCT/MIN as logical and;
    AVG -> SUM, then the rank holding the result (``out``) divides (floating
    point only). Returns (tensors, op)."""
    dtype = out.dtype
    if reduce_op is ReduceOp.SUM and dtype is not torch.bool:
        return tensors, reduce_op  # the common case, kept cheap
    try:
        rop = ReduceOp.coerce(reduce_op)
    except ValueError as exc:
        raise ValueError(f"{op}: {exc}") from None
    if dtype == torch.bool:
        if rop is ReduceOp.AVG:
            raise UnsupportedError(f"{op}: ReduceOp.AVG is undefined for torch.bool")
        rop = ReduceOp.MAX if rop in (ReduceOp.SUM, ReduceOp.MAX) else ReduceOp.MIN
        return [None if t is None else t.view(torch.uint8) for t in tensors], rop
    if rop is ReduceOp.AVG:
        if not dtype.is_floating_point:
            raise UnsupportedError(f"{op}: ReduceOp.AVG on {dtype} is refused (an integer mean "
                                   "is not exact); use SUM and divide")
        if holds_result:
            n = g.size
            post.insert(0, lambda: out.div_(n))
        return tensors, ReduceOp.SUM
    return tensors, rop


def fingerprint(rt: Runtime, g: Group, op: str, backend: Optional[str], **fields) -> None:
    """Debug mode: all ranks compare what they are about to issue (and count
    their arrival, so a timeout can name the rank that did not come)."""
    g.seq += 1
    if rt.health is not None:
        rt.health.arrive(g.name)
    mine = {"seq": g.seq, "op": op, "backend": backend, **fields}
    try:
        blobs = rt.control_allgather(g, json.dumps(mine, sort_keys=True, default=str).encode())
    except CommError as exc:  # name the user's op, not the control message
        where = f"{op} on backend '{backend}'" if backend else op
        exc.args = (f"{where}: debug-mode order check failed: {exc.args[0]}", *exc.args[1:])
        raise
    prints = [json.loads(b) for b in blobs]
    keys = sorted({k for p in prints for k in p})
    differ = [k for k in keys if len({json.dumps(p.get(k), sort_keys=True) for p in prints}) > 1]
    if differ:
        detail = "; ".join(f"rank {g.ranks[i]}: " + ", ".join(f"{k}={p.get(k)}" for k in differ)
                           for i, p in enumerate(prints))
        raise CommError(f"collective mismatch on group {g.name} at collective #{g.seq}: fields "
                        f"{differ} differ across ranks ({detail})")


def submit(rt: Runtime, op: str, g: Group, nbytes: int, ref: torch.Tensor, explicit: Optional[str],
           async_op: bool, start: Callable, reads=(), writes=(), post=(), result=(),
           reduce_op=None, collective: bool = True, invariant=None, agree: bool = False,
           skip_empty: bool = True, peer: int = -1, counts=None):
    """Select, check order, start and track one operation.

    The local choice comes first: it refuses what no backend can run before
    any message (agreement, fingerprint) is sent. ``agree``: the size differs
    per rank (all-to-all), so ranks agree on its maximum when that matters.
    ``skip_empty``: a zero-byte op (same on every rank) sends nothing.
    ``peer`` (root or p2p peer, group rank) and ``counts`` (all-to-all element
    counts per peer) only feed the communication logger."""
    sel = rt.selector
    device = "cpu" if ref.is_cpu else ref.device.type
    declined = g.declined_async if async_op and explicit is None else g.declined
    name = sel.choose(op, nbytes, g.size, device, ref.dtype, reduce_op, explicit, declined)
    tuner = rt.autotune if rt.autotune is not None and rt.autotune.explores(op, explicit) else None
    if agree and (tuner is not None or sel.needs_agreement(op, g.size, explicit, device)):
        if rt.debug:
            fingerprint(rt, g, op, None, dtype=str(ref.dtype), device=device, shape=invariant, explicit=explicit)
        nbytes = rt.control_max(g, nbytes)
        name = sel.choose(op, nbytes, g.size, device, ref.dtype, reduce_op, explicit, declined)
    elif rt.debug and collective:
        fingerprint(rt, g, op, name, dtype=str(ref.dtype), device=device, shape=invariant,
                    explicit=explicit, **({} if tuner is None else
                                          {"autotune": tuner.peek(g, op, nbytes, device)}))
    if nbytes == 0 and skip_empty:
        return _skip(rt, op, async_op, result)
    timing = None  # the autotune bucket this call is timed for
    if tuner is not None:
        picked, timing = tuner.pick(rt, g, op, nbytes, device,
                                    lambda n: sel.why_not(n, op, device, ref.dtype, reduce_op, g.declined) is None)
        name = picked or name
    engine = rt.engine
    observer = rt.traced if _torch_profiler._is_profiler_enabled else rt.observer
    if observer is not None:
        elem = ref.element_size()
        post = [observer.begin(op, name, g, nbytes, async_op, peer,
                               None if counts is None else [c * elem for c in counts], reads, writes), *post]
    if async_op:  # not timed: see mcrdl.autotune
        timing = None
    # CUDA: NCCL and staged MPI return once their results are stream-ordered,
    # so a timed call is timed from an idle stream to the results' arrival
    stream = None if timing is None or device == "cpu" else current_stream(ref.get_device())
    if stream is not None:
        stream.synchronize()
    began = 0.0 if timing is None else time.perf_counter()
    try:
        pending = start(rt.backends[name], g.handles[name])
    except Exception as exc:
        raise CommError(f"{op} on backend '{name}' could not start: {exc}") from exc
    work = engine.run(op, name, pending, reads, writes, post, g, result, async_op)
    if timing is not None:
        if stream is not None:
            stream.synchronize()
        tuner.record(timing, name, time.perf_counter() - began)
    if work is not None:
        work.peer = peer
    return work


def combine(rt: Runtime, op: str, g: Group, works: Sequence[Optional[Work]], post=(), result=(),
            async_op: bool = True, reads=(), writes=()) -> Optional[Work]:
    """One Work for several async works: it completes when all have, then runs ``post``."""
    works = [w for w in works if w is not None]
    backends = "+".join(dict.fromkeys(w.backend for w in works)) or "none"
    return rt.engine.run(op, backends, AfterAll(rt.engine, works), tuple(reads), tuple(writes),
                         post, g, result, async_op)


def _skip(rt: Runtime, op: str, async_op: bool, result=()) -> Optional[Work]:
    """Zero-byte collective: every rank agrees (sizes are rank-invariant) to do nothing."""
    if not async_op:
        return None
    work = Work(rt.engine, op, "none", Done(), result=result)
    work._finish()
    return work
