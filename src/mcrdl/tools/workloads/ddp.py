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

Synthetic classification: inputs ~ N(0, 1), labels from a fixed random
teacher (argmax of a linear map), seeded by (seed, rank, step); SGD with
momentum.
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

from .common import Workload, generator, main as run_main, timer


class DDP(Workload):
    name = "ddp"
    ops = ("all_reduce",)
    variants = ("polled", "fused", "fp16", "bf16")
    lossy_variants = ("fp16", "bf16")
    modes_extra = ("torch",)
    sample_unit = "samples"

    def add_args(self, p):
        g = p.add_argument_group("ddp")
        g.add_argument("--batch", type=int, default=32, help="samples per rank (default 32)")
        g.add_argument("--inputs", type=int, default=256)
        g.add_argument("--hidden", default="1024,1024", help="hidden sizes (comma)")
        g.add_argument("--classes", type=int, default=10)
        g.add_argument("--bucket-mb", type=float, default=2.0, help="DDP bucket_cap_mb")
        g.add_argument("--lr", type=float, default=0.05)

    def config(self, args):
        return {"batch": args.batch, "mlp": f"{args.inputs}-{args.hidden.replace(',', '-')}-{args.classes}",
                "bucket_mb": args.bucket_mb}

    def samples_per_step(self, args, world):
        return args.batch * world

    def build(self, args, mode, variant, run_id):
        from mcrdl.integrations.ddp_hook import mcrdl_store, register

        self.args = a = args
        self.rank, self.world = mcrdl.get_rank(), mcrdl.get_world_size()
        # torch's default group: DDP needs one to construct (weights broadcast, checks)
        dist.init_process_group("gloo", store=dist.PrefixStore(f"ddp/{run_id}/", mcrdl_store()),
                                rank=self.rank, world_size=self.world,
                                timeout=timedelta(seconds=a.timeout))
        torch.manual_seed(a.seed)
        sizes = [a.inputs, *(int(x) for x in a.hidden.split(",") if x), a.classes]
        layers = []
        for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(m, n))
            if i < len(sizes) - 2:
                layers.append(nn.GELU())
        self.net = nn.Sequential(*layers).to(self.device)
        self.model = nn.parallel.DistributedDataParallel(self.net, bucket_cap_mb=a.bucket_mb)
        if mode != "torch":
            register(self.model, variant or "allreduce", wrap=self._timed(variant))
        self.opt = torch.optim.SGD(self.model.parameters(), lr=a.lr, momentum=0.9)
        self.teacher = torch.randn(a.inputs, a.classes, generator=generator(a.seed, 3)).to(self.device)

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

    def batch(self, i):
        a = self.args
        g = generator(a.seed, self.rank, i)
        x = torch.randn(a.batch, a.inputs, generator=g).to(self.device)
        y = (x @ self.teacher).argmax(1)
        return x, y

    def step(self, i):
        x, y = self.batch(i)
        self.opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(x), y)
        loss.backward()
        self.opt.step()
        return float(loss.detach())

    def parameters(self):
        return list(self.net.parameters())

    def teardown(self):
        del self.model
        dist.destroy_process_group()


WORKLOAD = DDP()


def main(argv: Optional[list] = None) -> int:
    return run_main(WORKLOAD, argv)


if __name__ == "__main__":
    sys.exit(main())
