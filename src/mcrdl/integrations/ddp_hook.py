"""DDP communication hooks that send gradient buckets through mcrdl.

An unmodified ``torch.nn.parallel.DistributedDataParallel`` model keeps its
bucketing, overlap and bookkeeping; only the all-reduce of each gradient
bucket goes through mcrdl, so mcrdl's selection (static map, tuning table)
picks the library per bucket size::

    import torch.distributed as dist
    mcrdl.init_process_group(tuning_table="table.json")
    # DDP needs torch's default group to construct (it broadcasts the initial
    # weights there); build it on mcrdl's store:
    dist.init_process_group("gloo", store=dist.PrefixStore("ddp/", mcrdl_store()),
                            rank=mcrdl.get_rank(), world_size=mcrdl.get_world_size())
    model = DistributedDataParallel(net)
    register(model, "allreduce")          # or "polled", "fused", "fp16", "bf16", "int8"

Hooks (``hook(state, bucket) -> torch.futures.Future[Tensor]``):

* :func:`mcrdl_allreduce_hook` — like torch's ``allreduce_hook`` (and DDP's
  built-in all-reduce): divide the bucket by the group size, then an async
  ``mcrdl.all_reduce`` (SUM); its ``Work.get_future()`` completes on mcrdl's
  futures thread, so the all-reduce overlaps the rest of the backward pass. Same
  result as DDP's built-in all-reduce (bit for bit on 2 ranks).
* :func:`mcrdl_polled_allreduce_hook` — the same all-reduces without the futures
  thread: each hook call completes the futures of earlier buckets whose
  all-reduce finished, and the last bucket's call waits for all of them (on
  the caller's thread, which keeps every library progressing). Less overlap
  than :func:`mcrdl_allreduce_hook` (MPI progresses only at hook calls), and
  no thread competing for the GIL and the cores. With a thread per future it
  was the faster of the two on this 2-core host; with one futures thread they
  are within noise (the A/B: `git show 8d9f88a:docs/results/ddp_futures_vs_2e90c62.txt`). Same result.
* :func:`mcrdl_fused_allreduce_hook` — fusion *across* buckets (tensor fusion,
  ``mcrdl.features.fusion.all_reduce_coalesced``): buckets are held until the
  last one is ready, then all go out in as few fused all-reduces as the fusion
  bucket cap allows (default 25 MB). Fewer, larger messages, no overlap: wins
  where the per-call latency is high (gloo, ~0.5 ms per call here). Same
  result as :func:`mcrdl_allreduce_hook`.
* :func:`mcrdl_compress_hook` — compressed all-reduce
  (``mcrdl.features.compression.compressed_all_reduce``, AVG) with the
  state's compressor (fp16, bf16, int8): half (or about a quarter) the bytes,
  lossy (bounds in that module). Synchronous: the returned future is done.

``state`` is an :class:`MCRDLHookState` (or None for the defaults: world
group, selected backend, fp16 compression).
"""

from typing import Optional

import torch

import mcrdl
from mcrdl.types import ReduceOp

__all__ = ["MCRDLHookState", "mcrdl_allreduce_hook", "mcrdl_polled_allreduce_hook",
           "mcrdl_fused_allreduce_hook",
           "mcrdl_compress_hook", "register", "mcrdl_store", "HOOKS"]


class MCRDLHookState:
    """What the hooks need: ``group`` (mcrdl group; None = world), ``backend``
    (force one; None = mcrdl's selection), ``compressor`` (compress hook;
    default fp16), ``bucket_bytes`` (fused hook's fusion cap; None = the
    fusion module's)."""

    def __init__(self, group=None, backend: Optional[str] = None, compressor=None,
                 bucket_bytes=None):
        self.group = group
        self.backend = backend
        self.compressor = compressor
        self.bucket_bytes = bucket_bytes
        self.pending: list = []  # fused hook: (buffer, future) of held buckets


def _state(state) -> MCRDLHookState:
    return state if isinstance(state, MCRDLHookState) else MCRDLHookState()


def mcrdl_allreduce_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over the group with an async mcrdl all-reduce."""
    st = _state(state)
    buf = bucket.buffer()
    buf.div_(mcrdl.get_world_size(st.group))
    work = mcrdl.all_reduce(buf, group=st.group, async_op=True, backend=st.backend)
    return work.get_future().then(lambda fut: fut.value()[0])


def mcrdl_polled_allreduce_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """Like :func:`mcrdl_allreduce_hook` without the futures thread: the returned
    futures are completed by the caller's thread, at later buckets' hook calls
    (those already done) and, at the last bucket, after waiting for all."""
    st = state
    if not isinstance(st, MCRDLHookState):
        raise ValueError("mcrdl_polled_allreduce_hook needs an MCRDLHookState (it holds buckets)")
    buf = bucket.buffer()
    buf.div_(mcrdl.get_world_size(st.group))
    fut: torch.futures.Future = torch.futures.Future()
    try:
        work = mcrdl.all_reduce(buf, group=st.group, async_op=True, backend=st.backend)
    except Exception as exc:
        fut.set_exception(exc)
        return fut
    st.pending.append((work, buf, fut))
    last = bucket.is_last()
    keep = []
    for w, b, f in st.pending:
        try:
            if last:
                w.wait()
            elif not w.is_completed():
                keep.append((w, b, f))
                continue
        except Exception as exc:
            f.set_exception(exc)
            continue
        f.set_result(b)
    st.pending = keep
    return fut


def mcrdl_fused_allreduce_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """Hold buckets until the last one, then all-reduce them fused."""
    from mcrdl.features.fusion import all_reduce_coalesced

    st = _state(state) if state is not None else None
    if st is None:
        raise ValueError("mcrdl_fused_allreduce_hook needs an MCRDLHookState (it holds buckets)")
    buf = bucket.buffer()
    buf.div_(mcrdl.get_world_size(st.group))
    fut: torch.futures.Future = torch.futures.Future()
    st.pending.append((buf, fut))
    if bucket.is_last():
        held, st.pending = st.pending, []
        try:
            work = all_reduce_coalesced([b for b, _ in held], group=st.group, async_op=True,
                                        backend=st.backend, bucket_bytes=st.bucket_bytes)
        except Exception as exc:  # fail every held bucket, not just the last
            for _, f in held:
                f.set_exception(exc)
            return fut

        def settle(done):
            try:
                done.value()
            except Exception as exc:
                for _, f in held:
                    f.set_exception(exc)
                return None
            for b, f in held:
                f.set_result(b)
            return None

        work.get_future().then(settle)
    return fut


def mcrdl_compress_hook(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket with a compressed all-reduce (default fp16)."""
    from mcrdl.features.compression import FP16Compressor, compressed_all_reduce

    st = _state(state)
    if st.compressor is None:
        st.compressor = FP16Compressor()
    buf = bucket.buffer()
    compressed_all_reduce(buf, st.compressor, op=ReduceOp.AVG, group=st.group,
                          backend=st.backend, key=("ddp-bucket", bucket.index()))
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(buf)
    return fut


def _compressor(name: str):
    from mcrdl.features import compression as c

    return {"fp16": c.FP16Compressor, "bf16": c.BF16Compressor, "int8": c.Int8Compressor}[name]()


#: Hook names accepted by :func:`register`.
HOOKS = ("allreduce", "polled", "fused", "fp16", "bf16", "int8")


def register(model, hook: str = "allreduce", group=None, backend: Optional[str] = None,
             bucket_bytes=None, wrap=None) -> MCRDLHookState:
    """Register an mcrdl hook on a DDP ``model``; returns its state.
    ``wrap(fn) -> fn`` may wrap the hook (e.g. to time it)."""
    if hook not in HOOKS:
        raise ValueError(f"unknown mcrdl DDP hook {hook!r} (expected one of {', '.join(HOOKS)})")
    state = MCRDLHookState(group, backend, None, bucket_bytes)
    if hook == "allreduce":
        fn = mcrdl_allreduce_hook
    elif hook == "polled":
        fn = mcrdl_polled_allreduce_hook
    elif hook == "fused":
        fn = mcrdl_fused_allreduce_hook
    else:
        state.compressor = _compressor(hook)
        fn = mcrdl_compress_hook
    model.register_comm_hook(state, wrap(fn) if wrap else fn)
    return state


def mcrdl_store():
    """mcrdl's key-value store (a ``torch.distributed.Store``), to build torch's
    default process group on (DDP needs one to construct)."""
    from mcrdl import api

    store = api.current_runtime().store
    if store is None:
        raise RuntimeError("mcrdl has no store in this job (no torch backend was started)")
    return store
