"""Data parallel: an unmodified ``DistributedDataParallel`` model, gradients through mcrdl.

The model is a plain ``torch.nn`` MLP classifier wrapped in
``torch.nn.parallel.DistributedDataParallel`` with its defaults except a
smaller ``bucket_cap_mb`` (``--bucket-mb``, default 2, so a few buckets
overlap the backward pass). torch's default process group (gloo, on mcrdl's
store) exists only because DDP needs one to construct (it broadcasts the
initial weights there). In the mcrdl modes a communication hook
(:mod:`mcrdl.integrations.ddp_hook`) sends every gradient bucket through
mcrdl's async all-reduce, so the mode's selection picks the library per
bucket size. Variants (after ``+`` in ``--mode``): ``polled`` (no futures
thread: futures completed at later hook calls), ``fused`` (buckets fused
across the step, mcrdl's tensor fusion), ``fp16`` / ``bf16`` (compressed
all-reduce: lossy, not held to the agreement check). Mode ``torch``: no hook,
DDP's own all-reduce on torch's gloo group (what PyTorch gives a CPU user
today; its communication is not visible to the timer).

The model and data are :class:`~.common.Classifier`'s.
"""
from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mcrdl

from .common import Classifier, main as run_main, timer


class DDP(Classifier):
    name = "ddp"
    variants = ("polled", "fused", "fp16", "bf16")
    lossy_variants = ("fp16", "bf16")
    modes_extra = ("torch",)
    bucket_help = "DDP bucket_cap_mb"

    def build(self, args, mode, variant, run_id):
        from mcrdl.integrations.ddp_hook import mcrdl_store, register

        self.world = mcrdl.get_world_size()
        # torch's default group: DDP needs one to construct (weights broadcast, checks)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"ddp/{run_id}/", mcrdl_store()),
                                rank=mcrdl.get_rank(), world_size=self.world,
                                timeout=timedelta(seconds=args.timeout))
        self.model = nn.parallel.DistributedDataParallel(self.make_net(args), bucket_cap_mb=args.bucket_mb)
        if mode != "torch":
            register(self.model, variant or "allreduce", wrap=self._timed(variant))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=args.lr, momentum=0.9)

    @staticmethod
    def _timed(variant):
        """Wrap a hook: the interval from the bucket's hook call to its future's
        completion counts as communication (profile notes the bytes sent)."""
        def wrap(hook):
            def timed(state, bucket):
                buf = bucket.buffer()
                if variant == "fused":
                    if bucket.is_last():
                        total = sum(b.numel() * b.element_size() for b, _ in state.pending)
                        timer.note("all_reduce", total + buf.numel() * buf.element_size(), async_op=True)
                elif variant in ("fp16", "bf16"):
                    timer.note("all_reduce", buf.numel() * 2, async_op=True)
                else:
                    timer.note("all_reduce", buf, async_op=True)  # (the hooks' calls are async)
                t0 = time.perf_counter()
                fut = hook(state, bucket)

                def done(f):
                    timer.add(t0, time.perf_counter())
                    return f.value()
                return fut.then(done)
            return timed
        return wrap

    def step(self, i):
        x, y = self.batch(i)
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def teardown(self):
        del self.model
        dist.destroy_process_group()


WORKLOAD = DDP()


def main(argv: Optional[list] = None) -> int:
    return run_main(WORKLOAD, argv)


if __name__ == "__main__":
    sys.exit(main())
