"""Tensor fusion: many small collectives as a few large ones.

``all_reduce_coalesced``, ``broadcast_coalesced`` and ``all_gather_coalesced``
take lists of tensors, pack them into flat buffers ("buckets") and run one
collective per bucket through the public mcrdl API, so the backend is selected
on the fused size. Results are written back in place into the original
tensors (non-contiguous ones too).

The bucket rule (the same on every rank, because it only depends on the
tensors' dtypes, devices and sizes, which a collective requires to match):

* tensors are grouped by ``(dtype, device)``, groups in order of first
  appearance, tensors in list order inside a group;
* a tensor is appended to the group's open bucket while the bucket stays
  ``<= bucket_bytes``; otherwise the bucket is issued and a new one opens;
* a tensor larger than ``bucket_bytes`` goes alone, without a copy (the op
  runs on the tensor itself); so does a bucket that ends up with one tensor;
* zero-element tensors are skipped;
* for ``all_gather_coalesced`` a tensor counts ``world_size x`` its bytes
  (the bucket is the gathered output).

``bucket_bytes`` defaults to 25 MiB (DDP's ``bucket_cap_mb``); set it per call,
module-wide with :func:`set_bucket_bytes`, or with the environment variable
``MCRDL_FUSION_BUCKET_BYTES`` (bytes, ``K``/``M``/``G`` suffixes allowed). It
must be the same on every rank.

Flat buffers come from a bounded pool (:func:`fusion_buffer_pool`), keyed by
``(dtype, device, numel)``: a buffer is lent to one call and returned only
after that call's results are unpacked, so an outstanding async call's buffer
is never reused. Free buffers are kept up to ``MCRDL_FUSION_POOL_BYTES``
(default 256 MiB), least recently used evicted first.

A blocking call keeps at most ``SYNC_WINDOW`` (2) buckets in flight, packing the
next while the previous run; an async call issues every bucket at once.

Sync calls return None; ``async_op=True`` returns one :class:`mcrdl.Work`
(made by ``mcrdl.api.combine``) that completes when every bucket is done and
unpacked; ``get_future()`` works on it and ``result()`` is the original tensors.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, List, Optional, Sequence

import torch

from .. import api, settings
from ..settings import parse_bytes
from ..runtime import Group
from ..types import ReduceOp, UnsupportedError
from ..work import Work, run_post

__all__ = ["all_reduce_coalesced", "broadcast_coalesced", "all_gather_coalesced",
           "get_bucket_bytes", "set_bucket_bytes", "fusion_buffer_pool", "BufferPool",
           "DEFAULT_BUCKET_BYTES"]

#: Default bucket cap: 25 MiB, as DDP's ``bucket_cap_mb=25``.
DEFAULT_BUCKET_BYTES = settings.SETTINGS["MCRDL_FUSION_BUCKET_BYTES"].default


_bucket_bytes: Optional[int] = None  # None: MCRDL_FUSION_BUCKET_BYTES or the default


def get_bucket_bytes() -> int:
    """The module-wide bucket cap in bytes."""
    return _bucket_bytes if _bucket_bytes is not None else settings.get("MCRDL_FUSION_BUCKET_BYTES")


def set_bucket_bytes(nbytes) -> None:
    """Set the module-wide bucket cap (int or ``"25M"``); None restores the
    environment/default value. Must be the same on every rank."""
    global _bucket_bytes
    if nbytes is None:
        _bucket_bytes = None
        return
    n = parse_bytes(nbytes, "set_bucket_bytes")
    if n <= 0:
        raise ValueError(f"set_bucket_bytes: bucket size must be positive, got {nbytes!r}")
    _bucket_bytes = n


# -- buffer pool ---------------------------------------------------------------------------
class BufferPool:
    """Flat buffers keyed by ``(dtype, device, numel)``.

    :meth:`acquire` lends a buffer (a cached free one if any, else a new one);
    :meth:`release` gives it back once nothing uses it any more. Lent buffers
    are never handed out again, so a buffer of an outstanding async call is
    never reused. Free buffers are bounded by ``max_bytes`` (LRU eviction).
    Thread-safe: buffers are released from completion callbacks, which may run
    on the futures thread."""

    def __init__(self, max_bytes: Optional[int] = None):
        self.max_bytes = settings.get("MCRDL_FUSION_POOL_BYTES") if max_bytes is None else int(max_bytes)
        self._lock = threading.Lock()
        self._free: dict[tuple, list] = {}
        self._lru: "OrderedDict[int, tuple]" = OrderedDict()  # id(buf) -> (key, buf)
        self._lent: dict[int, torch.Tensor] = {}
        self._free_bytes = 0
        self.hits = 0
        self.misses = 0

    def acquire(self, dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
        key = (dtype, device, numel)
        with self._lock:
            stack = self._free.get(key)
            if stack:
                buf = stack.pop()
                del self._lru[id(buf)]
                self._free_bytes -= buf.nbytes
                self.hits += 1
            else:
                buf = None
                self.misses += 1
        if buf is None:
            buf = torch.empty(numel, dtype=dtype, device=device)
        with self._lock:
            self._lent[id(buf)] = buf
        return buf

    def release(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._lent.pop(id(buf), None) is None:
                return  # not ours (or released twice)
            if buf.nbytes > self.max_bytes:
                return
            key = (buf.dtype, buf.device, buf.numel())
            self._free.setdefault(key, []).append(buf)
            self._lru[id(buf)] = (key, buf)
            self._free_bytes += buf.nbytes
            while self._free_bytes > self.max_bytes and self._lru:
                _, (k, old) = self._lru.popitem(last=False)
                self._free[k].remove(old)
                if not self._free[k]:
                    del self._free[k]
                self._free_bytes -= old.nbytes

    def lent(self) -> list:
        """Buffers currently lent to calls that have not finished."""
        with self._lock:
            return list(self._lent.values())

    def cached(self) -> list:
        """Free buffers, least recently used first."""
        with self._lock:
            return [b for _, b in self._lru.values()]

    def stats(self) -> dict:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "free_buffers": len(self._lru),
                    "free_bytes": self._free_bytes, "lent_buffers": len(self._lent),
                    "max_bytes": self.max_bytes}

    def clear(self) -> None:
        """Drop every free buffer (lent ones stay with their calls)."""
        with self._lock:
            self._free.clear()
            self._lru.clear()
            self._free_bytes = 0


_POOL = BufferPool()


def fusion_buffer_pool() -> BufferPool:
    """The pool the coalesced ops take their flat buffers from."""
    return _POOL


# -- planning ------------------------------------------------------------------------------
class Bucket:
    """One collective of a coalesced call: tensor indices, element count, and
    whether it runs directly on its only tensor (no packing)."""

    __slots__ = ("dtype", "device", "index", "numel", "nbytes")

    def __init__(self, dtype, device):
        self.dtype, self.device = dtype, device
        self.index: list[int] = []
        self.numel = 0
        self.nbytes = 0

    @property
    def direct(self) -> bool:
        return len(self.index) == 1

    def __repr__(self) -> str:
        return f"Bucket({self.dtype}, {self.device}, {len(self.index)} tensors, {self.nbytes} B)"


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int, factor: int = 1) -> list:
    """The buckets for ``tensors`` under the bucket rule (module docstring);
    ``factor`` multiplies each tensor's bytes (world size for all-gather)."""
    groups: dict[tuple, list] = {}
    order: list[Bucket] = []
    for i, t in enumerate(tensors):
        n = t.numel()
        if n == 0:
            continue
        key = (t.dtype, t.device)
        nbytes = n * t.element_size() * factor
        if nbytes > bucket_bytes:
            b = Bucket(*key)
            b.index.append(i)
            b.numel, b.nbytes = n, nbytes
            order.append(b)
            continue
        b = groups.get(key)
        if b is None or b.nbytes + nbytes > bucket_bytes:
            b = groups[key] = Bucket(*key)
            order.append(b)
        b.index.append(i)
        b.numel += n
        b.nbytes += nbytes
    return order


# -- helpers -------------------------------------------------------------------------------
def _check_tensors(fn: str, tensors, what: str) -> list:
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{fn}: {what} must be a list of torch.Tensor, got {type(tensors).__name__}")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {what}[{i}] must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in api.DTYPES:
            raise UnsupportedError(f"{fn}: {what}[{i}] has unsupported dtype {t.dtype} "
                                   f"(supported: {', '.join(sorted(map(str, api.DTYPES)))})")
    return list(tensors)


def _cap(fn: str, bucket_bytes) -> int:
    if bucket_bytes is None:
        return get_bucket_bytes()
    n = parse_bytes(bucket_bytes, f"{fn}: bucket_bytes")
    if n <= 0:
        raise ValueError(f"{fn}: bucket_bytes must be positive, got {bucket_bytes!r}")
    return n


def _precheck(fn: str, op: str, buckets, tensors, what: str, group, backend, rop=None) -> None:
    """Refuse, before anything is sent, what a later bucket could not run
    (so no rank is left with half the buckets issued)."""
    seen = set()
    for b in buckets:
        key = (b.dtype, b.device)
        if key in seen:
            continue
        seen.add(key)
        i = b.index[0]
        if rop is ReduceOp.AVG and not b.dtype.is_floating_point:
            raise UnsupportedError(f"{fn}: {what}[{i}] is {b.dtype}: ReduceOp.AVG needs floating "
                                   "point (an integer mean is not exact); use SUM and divide")
        try:
            api.explain(op, tensors[i], group=group, backend=backend)
        except UnsupportedError as exc:
            raise UnsupportedError(f"{fn}: {what}[{i}] ({b.dtype} on {b.device}): {exc}") from None


def _pack(flat: torch.Tensor, members: Sequence[torch.Tensor]) -> None:
    torch.cat([t.reshape(-1) for t in members], out=flat)


_foreach_copy = getattr(torch, "_foreach_copy_", None)


def _copy_out(flat: torch.Tensor, members: Sequence[torch.Tensor]) -> None:
    """Unpack ``flat`` into ``members`` (one fused kernel launch where torch has it)."""
    pieces = flat.split([t.numel() for t in members])
    srcs = [p.view(t.shape) for p, t in zip(pieces, members)]
    if _foreach_copy is not None:
        try:
            _foreach_copy(list(members), srcs)
            return
        except (RuntimeError, TypeError):  # an unsupported dtype/layout mix: copy one by one
            pass
    for t, src in zip(members, srcs):
        t.copy_(src)


def _each_async(async_op: bool, buckets: list) -> bool:
    """Are the buckets' ops started async? Not for a blocking call of one
    bucket: it runs as a blocking op (the API's fast path) and unpacks at once."""
    return async_op or len(buckets) > 1


def _finish(fn: str, works: list, post: list, result: list, async_op: bool, group,
            reads, writes, each_async: bool) -> Optional[Work]:
    """One Work for the buckets (``async_op``), or wait; a blocking bucket has
    completed already and only ``post`` is left to run."""
    if not each_async:
        run_post(post)
        return None
    return api.combine(fn, works, post, result, async_op, group, reads, writes)


#: Buckets a *blocking* coalesced call keeps in flight: the next bucket is packed
#: while the previous ones run, but the engine's outstanding list stays short
#: (ordering checks cost O(outstanding) per issued op).
SYNC_WINDOW = 2


class _Works(list):
    """The bucket works of one call; a blocking call waits for the oldest
    once more than SYNC_WINDOW are in flight."""

    def __init__(self, async_op: bool):
        super().__init__()
        self.window = None if async_op else SYNC_WINDOW
        self._next = 0

    def add(self, work) -> None:
        self.append(work)
        if self.window is not None:
            while len(self) - self._next > self.window:
                w = self[self._next]
                self._next += 1
                if w is not None:
                    w.wait()


def _release(bufs: list) -> Callable[[], None]:
    def release() -> None:
        for b in bufs:
            _POOL.release(b)
    return release


# -- the coalesced ops -----------------------------------------------------------------------
def all_reduce_coalesced(tensors: List[torch.Tensor], op=ReduceOp.SUM, group: Optional[Group] = None,
                         async_op: bool = False, backend: Optional[str] = None,
                         bucket_bytes=None) -> Optional[Work]:
    """``mcrdl.all_reduce`` of every tensor, in place, fused into buckets.

    Same result as one ``all_reduce`` per tensor (bit for bit: each element is
    reduced with the same elements of the other ranks). Sync returns None;
    ``async_op=True`` returns one Work for the whole call."""
    fn = "all_reduce_coalesced"
    tensors = _check_tensors(fn, tensors, "tensors")
    try:
        rop = ReduceOp.coerce(op)
    except ValueError as exc:
        raise ValueError(f"{fn}: {exc}") from None
    if rop is ReduceOp.AVG:
        for i, t in enumerate(tensors):
            if not t.dtype.is_floating_point:
                raise UnsupportedError(f"{fn}: tensors[{i}] is {t.dtype}: ReduceOp.AVG needs "
                                       "floating point (an integer mean is not exact)")
    cap = _cap(fn, bucket_bytes)
    if api.get_rank(group) < 0:
        return None
    buckets = plan_buckets(tensors, cap)
    _precheck(fn, "all_reduce", buckets, tensors, "tensors", group, backend, rop)
    api.wait_for_conflicts(fn, tensors, tensors)
    each = _each_async(async_op, buckets)
    works, post, bufs = _Works(async_op), [], []
    for b in buckets:
        if b.direct:
            works.add(api.all_reduce(tensors[b.index[0]], op, group, each, backend))
            continue
        members = [tensors[i] for i in b.index]
        flat = _POOL.acquire(b.dtype, b.device, b.numel)
        bufs.append(flat)
        _pack(flat, members)
        works.add(api.all_reduce(flat, op, group, each, backend))
        post.append(lambda flat=flat, members=members: _copy_out(flat, members))
    post.append(_release(bufs))
    return _finish(fn, works, post, tensors, async_op, group, tensors, tensors, each)


def broadcast_coalesced(tensors: List[torch.Tensor], src: int, group: Optional[Group] = None,
                        async_op: bool = False, backend: Optional[str] = None,
                        bucket_bytes=None) -> Optional[Work]:
    """``mcrdl.broadcast`` of every tensor from global rank ``src``, fused into
    buckets (only ``src`` packs; only the others unpack)."""
    fn = "broadcast_coalesced"
    tensors = _check_tensors(fn, tensors, "tensors")
    if not isinstance(src, int) or isinstance(src, bool):
        raise TypeError(f"{fn}: src must be an int rank, got {src!r}")
    cap = _cap(fn, bucket_bytes)
    if api.get_rank(group) < 0:
        return None
    try:
        api.get_group_rank(group, src)
    except ValueError as exc:
        raise ValueError(f"{fn}: src: {exc}") from None
    is_src = api.get_rank() == src
    buckets = plan_buckets(tensors, cap)
    _precheck(fn, "broadcast", buckets, tensors, "tensors", group, backend)
    api.wait_for_conflicts(fn, tensors, () if is_src else tensors)
    each = _each_async(async_op, buckets)
    works, post, bufs = _Works(async_op), [], []
    for b in buckets:
        if b.direct:
            works.add(api.broadcast(tensors[b.index[0]], src, group, each, backend))
            continue
        members = [tensors[i] for i in b.index]
        flat = _POOL.acquire(b.dtype, b.device, b.numel)
        bufs.append(flat)
        if is_src:
            _pack(flat, members)
        else:
            post.append(lambda flat=flat, members=members: _copy_out(flat, members))
        works.add(api.broadcast(flat, src, group, each, backend))
    post.append(_release(bufs))
    return _finish(fn, works, post, tensors, async_op, group, tensors, () if is_src else tensors, each)


def all_gather_coalesced(output_lists: List[List[torch.Tensor]], input_tensors: List[torch.Tensor],
                         group: Optional[Group] = None, async_op: bool = False,
                         backend: Optional[str] = None, bucket_bytes=None) -> Optional[Work]:
    """``mcrdl.all_gather(output_lists[i], input_tensors[i])`` for every ``i``,
    fused into buckets: ``output_lists[i][r]`` receives group rank ``r``'s
    ``input_tensors[i]``."""
    fn = "all_gather_coalesced"
    inputs = _check_tensors(fn, input_tensors, "input_tensors")
    if isinstance(output_lists, torch.Tensor) or not isinstance(output_lists, (list, tuple)):
        raise TypeError(f"{fn}: output_lists must be a list of lists of tensors, "
                        f"got {type(output_lists).__name__}")
    if len(output_lists) != len(inputs):
        raise ValueError(f"{fn}: output_lists has {len(output_lists)} lists but input_tensors "
                         f"has {len(inputs)} tensors")
    if api.get_rank(group) < 0:
        return None
    n = api.get_world_size(group)
    for i, (outs, inp) in enumerate(zip(output_lists, inputs)):
        if not isinstance(outs, (list, tuple)) or len(outs) != n:
            got = len(outs) if isinstance(outs, (list, tuple)) else type(outs).__name__
            raise ValueError(f"{fn}: output_lists[{i}] must be a list of {n} tensors "
                             f"(one per rank), got {got}")
        for r, o in enumerate(outs):
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"{fn}: output_lists[{i}][{r}] must be a torch.Tensor, "
                                f"got {type(o).__name__}")
            if o.dtype != inp.dtype or o.device != inp.device or o.numel() != inp.numel():
                raise ValueError(f"{fn}: output_lists[{i}][{r}] is {o.numel()} x {o.dtype} on "
                                 f"{o.device}, expected {inp.numel()} x {inp.dtype} on {inp.device} "
                                 f"like input_tensors[{i}]")
    cap = _cap(fn, bucket_bytes)
    outputs = [o for outs in output_lists for o in outs]
    buckets = plan_buckets(inputs, cap, factor=n)
    _precheck(fn, "all_gather_into_tensor", buckets, inputs, "input_tensors", group, backend)
    api.wait_for_conflicts(fn, inputs, outputs)
    each = _each_async(async_op, buckets)
    works, post, bufs = _Works(async_op), [], []
    for b in buckets:
        if b.direct:
            i = b.index[0]
            works.add(api.all_gather(list(output_lists[i]), inputs[i], group, each, backend))
            continue
        members = [inputs[i] for i in b.index]
        inbuf = _POOL.acquire(b.dtype, b.device, b.numel)
        outbuf = _POOL.acquire(b.dtype, b.device, n * b.numel)
        bufs += [inbuf, outbuf]
        _pack(inbuf, members)
        works.add(api.all_gather_into_tensor(outbuf, inbuf, group, each, backend))
        per_rank = [[output_lists[i][r] for i in b.index] for r in range(n)]
        post.append(lambda outbuf=outbuf, per_rank=per_rank, p=b.numel: [
            _copy_out(outbuf[r * p:(r + 1) * p], dsts) for r, dsts in enumerate(per_rank)])
    post.append(_release(bufs))
    return _finish(fn, works, post, outputs, async_op, group, inputs, outputs, each)
