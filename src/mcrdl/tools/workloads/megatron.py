"""Megatron-style tensor-parallel transformer layers (+ data parallelism).

Per layer (Megatron-LM, Shoeybi et al. 2019; sequence parallelism from
Korthikanti et al. 2022), with ``t`` = ``--tp`` ranks per tensor-parallel
group:

* attention: Q, K, V are column-parallel (each rank holds ``heads / t``
  heads), the output projection is row-parallel (each rank holds the matching
  input columns) and produces a partial sum;
* MLP: ``fc1`` column-parallel (``ffn / t`` features per rank), GELU,
  ``fc2`` row-parallel;
* without sequence parallelism (default): the partial sums are combined by an
  ``all_reduce`` after each row-parallel layer (2 per layer forward), and the
  input of each column-parallel block goes through an identity whose backward
  is an ``all_reduce`` (2 per layer backward): 4 all-reduces of
  ``seq x batch x hidden`` floats per layer per step;
* with ``--sequence-parallel``: layer norms, dropout-free residuals and
  biases run on ``seq / t`` of the sequence; each ``all_reduce`` becomes a
  ``reduce_scatter_tensor`` (after a row-parallel layer) or an
  ``all_gather_into_tensor`` (before a column-parallel one), forward and
  backward, and the gradients of the replicated weights (layer norms, row
  biases) are all-reduced over the group once per step;
* data parallelism over the remaining ``world / t`` ranks: one fused SUM
  ``all_reduce`` of every gradient over the data-parallel group per step.

Weights are made at full size from the seed on every rank and sliced, so the
model is the same for any ``t``. Synthetic regression: input ``x ~ N(0, 1)``
of shape ``[seq, batch, hidden]``, target ``tanh(x A)`` for a fixed random
``A``, mean squared error of the final layer norm's output (per data-parallel
rank, seeded by (seed, data-parallel rank, step)). With sequence parallelism
each rank's loss is its sequence shard's share (they sum to the full loss).
"""
from __future__ import annotations

import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import mcrdl

from .common import Workload, all_reduce_grads, comm, generator, main as run_main


# -- tensor-parallel autograd collectives (Megatron's f, g and their SP forms) --------------
class CopyToTP(torch.autograd.Function):
    """Forward identity, backward all-reduce (Megatron's ``f``)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        comm.all_reduce(g, group=ctx.group)
        return g, None


class ReduceFromTP(torch.autograd.Function):
    """Forward all-reduce, backward identity (Megatron's ``g``)."""

    @staticmethod
    def forward(ctx, x, group):
        out = x.contiguous().clone()
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None


class GatherSeq(torch.autograd.Function):
    """Forward all-gather along dim 0 (sequence), backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, t):
        ctx.group, ctx.t = group, t
        out = x.new_empty((x.shape[0] * t,) + tuple(x.shape[1:]))
        comm.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((g.shape[0] // ctx.t,) + tuple(g.shape[1:]))
        comm.reduce_scatter_tensor(out, g.contiguous(), group=ctx.group)
        return out, None, None


class ScatterReduceSeq(torch.autograd.Function):
    """Forward reduce-scatter along dim 0 (sequence), backward all-gather."""

    @staticmethod
    def forward(ctx, x, group, t):
        ctx.group, ctx.t = group, t
        out = x.new_empty((x.shape[0] // t,) + tuple(x.shape[1:]))
        comm.reduce_scatter_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out = g.new_empty((g.shape[0] * ctx.t,) + tuple(g.shape[1:]))
        comm.all_gather_into_tensor(out, g.contiguous(), group=ctx.group)
        return out, None, None


def _linear_init(out_f: int, in_f: int):
    """Full-size weight and bias, as nn.Linear initialises them."""
    lin = nn.Linear(in_f, out_f)
    return lin.weight.detach().clone(), lin.bias.detach().clone()


class TPLayer(nn.Module):
    def __init__(self, h, heads, ffn, t, r, group, sp):
        super().__init__()
        self.h, self.heads, self.t, self.group, self.sp = h, heads, t, group, sp
        self.hl, self.nl, self.fl = h // t, heads // t, ffn // t
        cols = slice(r * self.hl, (r + 1) * self.hl)
        fcols = slice(r * self.fl, (r + 1) * self.fl)
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        wq, bq = _linear_init(h, h)
        wk, bk = _linear_init(h, h)
        wv, bv = _linear_init(h, h)
        wo, bo = _linear_init(h, h)
        w1, b1 = _linear_init(ffn, h)
        w2, b2 = _linear_init(h, ffn)
        P = lambda x: nn.Parameter(x.contiguous())
        self.wq, self.bq = P(wq[cols]), P(bq[cols])      # column parallel
        self.wk, self.bk = P(wk[cols]), P(bk[cols])
        self.wv, self.bv = P(wv[cols]), P(bv[cols])
        self.wo, self.bo = P(wo[:, cols]), P(bo)          # row parallel (+ replicated bias)
        self.w1, self.b1 = P(w1[fcols]), P(b1[fcols])    # column parallel
        self.w2, self.b2 = P(w2[:, fcols]), P(b2)         # row parallel (+ replicated bias)

    def replicated(self):
        """Parameters every rank of the TP group holds whole."""
        return [*self.ln1.parameters(), *self.ln2.parameters(), self.bo, self.b2]

    def _enter(self, x):  # into a column-parallel block
        if self.t == 1:
            return x
        return GatherSeq.apply(x, self.group, self.t) if self.sp else CopyToTP.apply(x, self.group)

    def _leave(self, x):  # out of a row-parallel block
        if self.t == 1:
            return x
        return ScatterReduceSeq.apply(x, self.group, self.t) if self.sp else \
            ReduceFromTP.apply(x, self.group)

    def forward(self, x):  # [s(/t), b, h]
        a = self._enter(self.ln1(x))
        s, b, _ = a.shape
        hd = self.h // self.heads
        q, k, v = (F.linear(a, w, bias).view(s, b, self.nl, hd).permute(1, 2, 0, 3)
                   for w, bias in ((self.wq, self.bq), (self.wk, self.bk), (self.wv, self.bv)))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)   # [b, nl, s, hd]
        att = att.permute(2, 0, 1, 3).reshape(s, b, self.hl)
        x = x + self._leave(F.linear(att, self.wo)) + self.bo
        m = self._enter(self.ln2(x))
        m = F.gelu(F.linear(m, self.w1, self.b1))
        x = x + self._leave(F.linear(m, self.w2)) + self.b2
        return x


class Megatron(Workload):
    name = "megatron"
    ops = ("all_reduce", "all_gather", "reduce_scatter")
    sample_unit = "seq"

    def add_args(self, p):
        g = p.add_argument_group("megatron")
        g.add_argument("--tp", type=int, help="tensor-parallel size (default 2 when the world is even, else 1)")
        g.add_argument("--sequence-parallel", action="store_true",
                       help="reduce-scatter + all-gather instead of all-reduce")
        g.add_argument("--batch", type=int, default=4, help="sequences per data-parallel rank")
        g.add_argument("--seq", type=int, default=64)
        g.add_argument("--hidden", type=int, default=128)
        g.add_argument("--heads", type=int, default=4)
        g.add_argument("--ffn", type=int, default=512)
        g.add_argument("--layers", type=int, default=2)
        g.add_argument("--lr", type=float, default=1e-3)

    def _tp(self, args, world):
        t = args.tp or (2 if world % 2 == 0 else 1)
        if world % t:
            raise ValueError(f"--tp {t} does not divide the world size {world}")
        return t

    def config(self, args):
        return {"tp": args.tp or "auto", "sp": args.sequence_parallel, "batch": args.batch,
                "seq": args.seq, "hidden": args.hidden, "heads": args.heads, "ffn": args.ffn,
                "layers": args.layers}

    def samples_per_step(self, args, world):
        return args.batch * (world // self._tp(args, world))

    def build(self, args, mode, variant, run_id):
        self.args = a = args
        rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
        t = self.t = self._tp(args, world)
        self.dp = world // t
        if a.heads % t or a.ffn % t or a.hidden % a.heads or (a.sequence_parallel and a.seq % t):
            raise ValueError("heads, ffn (and seq with --sequence-parallel) must divide by --tp; "
                             "hidden by heads")
        self.tp_rank, self.dp_rank = rank % t, rank // t
        # groups: every rank makes every group, in the same order
        self.tp_group = self.dp_group = None
        if 1 < t < world:
            for d in range(self.dp):
                g = mcrdl.new_group([d * t + i for i in range(t)])
                if d == self.dp_rank:
                    self.tp_group = g
        if 1 < self.dp < world:
            for i in range(t):
                g = mcrdl.new_group([d * t + i for d in range(self.dp)])
                if i == self.tp_rank:
                    self.dp_group = g
        self.sp = a.sequence_parallel and t > 1
        torch.manual_seed(a.seed)
        self.layers = nn.ModuleList(TPLayer(a.hidden, a.heads, a.ffn, t, self.tp_rank,
                                            self.tp_group, self.sp) for _ in range(a.layers)).to(self.device)
        self.ln_f = nn.LayerNorm(a.hidden).to(self.device)
        self.params = [*self.layers.parameters(), *self.ln_f.parameters()]
        self.replicated = [p for layer in self.layers for p in layer.replicated()] + \
            list(self.ln_f.parameters())
        self.opt = torch.optim.Adam(self.params, lr=a.lr)
        self.A = (torch.randn(a.hidden, a.hidden, generator=generator(a.seed, 5)) / math.sqrt(a.hidden)).to(self.device)

    def batch(self, i):
        a = self.args
        g = generator(a.seed, self.dp_rank, i)
        x = torch.randn(a.seq, a.batch, a.hidden, generator=g).to(self.device)
        y = torch.tanh(x @ self.A)
        if self.sp:
            n = a.seq // self.t
            sl = slice(self.tp_rank * n, (self.tp_rank + 1) * n)
            x, y = x[sl], y[sl]
        return x, y

    def step(self, i):
        a = self.args
        x, y = self.batch(i)
        self.opt.zero_grad(set_to_none=True)
        for layer in self.layers:
            x = layer(x)
        out = self.ln_f(x)
        # full-sequence mean; a sequence shard contributes its share
        loss = F.mse_loss(out, y, reduction="sum") / (a.seq * a.batch * a.hidden)
        (loss / self.dp).backward()
        if self.sp:  # replicated weights saw only this rank's sequence shard
            all_reduce_grads(self.replicated, group=self.tp_group)
        if self.dp > 1:
            all_reduce_grads(self.params, group=self.dp_group)
        self.opt.step()
        return float(loss.detach())

    def parameters(self):
        return self.params


WORKLOAD = Megatron()


def main(argv: Optional[list] = None) -> int:
    return run_main(WORKLOAD, argv)


if __name__ == "__main__":
    sys.exit(main())
