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

The model and data are :class:`~.common.Classifier`'s (as :mod:`.ddp`'s).
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F

import mcrdl

from .common import Classifier, comm, main as run_main


class DataParallel(Classifier):
    name = "dp"
    batch_default, hidden_default, bucket_default = 2, "512,512,512", 1.0
    bucket_help = "MiB of the gradient buffer per all-reduce (default 1)"

    def build(self, args, mode, variant, run_id):
        params = list(self.make_net(args).parameters())
        self.grads = torch.zeros(sum(p.numel() for p in params), device=self.device)
        at = 0
        for p in reversed(params):  # (backward fills the buffer from its start)
            p.grad = self.grads[at:at + p.numel()].view_as(p)
            at += p.numel()
        per = max(1, int(args.bucket_mb * 2 ** 20) // self.grads.element_size())
        self.buckets = list(self.grads.split(per))
        self.opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)

    def step(self, i):
        x, y = self.batch(i)
        self.grads.zero_()
        loss = F.cross_entropy(self.net(x), y)
        loss.backward()
        for bucket in self.buckets:
            comm.all_reduce(bucket, op=mcrdl.ReduceOp.AVG)
        self.opt.step()
        return float(loss.detach())


WORKLOAD = DataParallel()


def main(argv: Optional[list] = None) -> int:
    return run_main(WORKLOAD, argv)


if __name__ == "__main__":
    sys.exit(main())
