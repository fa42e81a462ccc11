"""Data parallel with the gradient all-reduce after backward: the step of
DeepSpeed's engine without overlap (ZeRO stage 0) and of Megatron-core's DDP
with ``overlap_grad_reduce`` off.

Every parameter's ``.grad`` is a view of one flat buffer (in backward order,
as Megatron's grad buffer); after backward the buffer is averaged over the
world in slices of ``--bucket-mb`` (blocking all-reduces, one per slice), then
SGD with momentum steps. With a small batch per rank (fine-tuning, or a model
that leaves little memory for activations) this step is bound by those
all-reduces: ``4 N`` bytes of them against ``6 N`` FLOPs per sample of
forward and backward, for ``N`` parameters.

Synthetic classification as in :mod:`.ddp` (inputs ~ N(0, 1), labels from a
fixed random teacher), seeded by (seed, rank, step).
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import mcrdl

from .common import Workload, comm, generator, main as run_main


class DataParallel(Workload):
    name = "dp"
    ops = ("all_reduce",)
    sample_unit = "samples"

    def add_args(self, p):
        g = p.add_argument_group("dp")
        g.add_argument("--batch", type=int, default=2, help="samples per rank (default 2)")
        g.add_argument("--inputs", type=int, default=256)
        g.add_argument("--hidden", default="512,512,512", help="hidden sizes (comma)")
        g.add_argument("--classes", type=int, default=10)
        g.add_argument("--bucket-mb", type=float, default=1.0,
                       help="MiB of the gradient buffer per all-reduce (default 1)")
        g.add_argument("--lr", type=float, default=0.05)

    def config(self, args):
        return {"batch": args.batch, "mlp": f"{args.inputs}-{args.hidden.replace(',', '-')}-{args.classes}",
                "bucket_mb": args.bucket_mb}

    def samples_per_step(self, args, world):
        return args.batch * world

    def build(self, args, mode, variant, run_id):
        self.args = a = args
        self.rank = mcrdl.get_rank()
        torch.manual_seed(a.seed)
        sizes = [a.inputs, *(int(x) for x in a.hidden.split(",") if x), a.classes]
        layers = []
        for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:])):
            layers.append(nn.Linear(m, n))
            if i < len(sizes) - 2:
                layers.append(nn.GELU())
        self.net = nn.Sequential(*layers).to(self.device)
        params = list(self.net.parameters())
        self.grads = torch.zeros(sum(p.numel() for p in params), device=self.device)
        at = 0
        for p in reversed(params):  # (backward fills the buffer from its start)
            p.grad = self.grads[at:at + p.numel()].view_as(p)
            at += p.numel()
        per = max(1, int(a.bucket_mb * 2 ** 20) // self.grads.element_size())
        self.buckets = list(self.grads.split(per))
        self.opt = torch.optim.SGD(params, lr=a.lr, momentum=0.9)
        self.teacher = torch.randn(a.inputs, a.classes, generator=generator(a.seed, 3)).to(self.device)

    def step(self, i):
        a = self.args
        g = generator(a.seed, self.rank, i)
        x = torch.randn(a.batch, a.inputs, generator=g).to(self.device)
        y = (x @ self.teacher).argmax(1)
        self.grads.zero_()
        loss = F.cross_entropy(self.net(x), y)
        loss.backward()
        for bucket in self.buckets:
            comm.all_reduce(bucket, op=mcrdl.ReduceOp.AVG)
        self.opt.step()
        return float(loss.detach())

    def parameters(self):
        return list(self.net.parameters())


WORKLOAD = DataParallel()


def main(argv: Optional[list] = None) -> int:
    return run_main(WORKLOAD, argv)


if __name__ == "__main__":
    sys.exit(main())
