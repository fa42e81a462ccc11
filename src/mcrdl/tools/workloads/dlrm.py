"""DLRM-style recommender: sharded embedding tables, data-parallel MLPs.

As in Facebook's DLRM with model-parallel embeddings:

* ``--tables`` embedding tables (``EmbeddingBag``, sum pooling of
  ``--bag`` indices per sample, sparse gradients, SGD); table ``t`` lives on
  rank ``t % world`` (uneven when the world does not divide the count);
* the bottom MLP (dense features -> embedding dim), the feature interaction
  (pairwise dot products) and the top MLP (-> click logit) are replicated and
  data parallel: each rank owns ``--batch`` samples of the global batch;
* per step, forward: every rank pools its tables for the *whole* global batch
  and one ``all_to_all_single`` sends each rank the pooled rows of its own
  samples (``batch x local tables x dim`` floats to each peer, uneven when
  tables are uneven); backward: the reverse ``all_to_all_single`` of the
  pooled gradients; then one fused SUM ``all_reduce`` of the dense (MLP)
  gradients (losses are scaled by 1/world).

Synthetic data from (seed, step), the same global batch on every rank (each
uses its slice): 13 dense features ~ N(0, 1), power-law indices, clicks drawn
from a fixed random logistic "truth" over both.
"""
from __future__ import annotations

import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import mcrdl

from .common import AllToAll, Workload, all_reduce_grads, generator, main as run_main


def mlp(sizes, last_act=False):
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2 or last_act:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class DLRM(Workload):
    name = "dlrm"
    ops = ("all_to_all", "all_reduce")
    sample_unit = "samples"

    def add_args(self, p):
        g = p.add_argument_group("dlrm")
        g.add_argument("--batch", type=int, default=256, help="samples per rank (default 256)")
        g.add_argument("--tables", type=int, default=8)
        g.add_argument("--rows", type=int, default=20000, help="rows per table")
        g.add_argument("--dim", type=int, default=32, help="embedding dimension")
        g.add_argument("--bag", type=int, default=4, help="indices pooled per table and sample")
        g.add_argument("--dense", type=int, default=13, help="dense features")
        g.add_argument("--bottom", default="64", help="bottom MLP hidden sizes (comma)")
        g.add_argument("--top", default="128,64", help="top MLP hidden sizes (comma)")
        g.add_argument("--lr", type=float, default=1e-3, help="Adam lr of the MLPs")
        g.add_argument("--emb-lr", type=float, default=0.05, help="SGD lr of the embeddings")

    def config(self, args):
        return {"batch": args.batch, "tables": args.tables, "rows": args.rows, "dim": args.dim,
                "bag": args.bag, "bottom": args.bottom, "top": args.top}

    def samples_per_step(self, args, world):
        return args.batch * world

    def build(self, args, mode, variant, run_id):
        self.args = a = args
        self.rank, self.world = mcrdl.get_rank(), mcrdl.get_world_size()
        W, T, D = self.world, a.tables, a.dim
        self.owner = [t % W for t in range(T)]
        self.mine = [t for t in range(T) if self.owner[t] == self.rank]
        self.count = [sum(1 for t in range(T) if self.owner[t] == r) for r in range(W)]
        torch.manual_seed(a.seed)
        embs = [nn.EmbeddingBag(a.rows, D, mode="sum", sparse=True) for _ in range(T)]
        for e in embs:
            nn.init.uniform_(e.weight, -0.05, 0.05)
        self.embs = nn.ModuleList(embs[t] for t in self.mine).to(self.device)  # same init as a 1-rank model
        hidden = [int(x) for x in a.bottom.split(",") if x]
        self.bottom = mlp([a.dense, *hidden, D], last_act=True).to(self.device)
        pairs = (T + 1) * T // 2
        top = [int(x) for x in a.top.split(",") if x]
        self.top = mlp([D + pairs, *top, 1]).to(self.device)
        self.dense_params = list(self.bottom.parameters()) + list(self.top.parameters())
        self.opt = torch.optim.Adam(self.dense_params, lr=a.lr)
        self.emb_opt = torch.optim.SGD(self.embs.parameters(), lr=a.emb_lr) if self.mine else None
        # the hidden "truth" the clicks come from
        g = generator(a.seed, 7)
        self.truth_dense = torch.randn(a.dense, generator=g)
        self.truth_rows = torch.randn(T, a.rows, generator=g) * 0.5
        # rows of the interaction matrix kept (i < j)
        self.iu = torch.triu_indices(T + 1, T + 1, offset=1, device=self.device)

    def batch(self, i):
        a = self.args
        Bg = a.batch * self.world
        g = generator(a.seed, 1_000_000 + i)  # the global batch: same on every rank
        dense = torch.randn(Bg, a.dense, generator=g)
        u = torch.rand(Bg, a.tables, a.bag, generator=g)
        idx = (u.pow(3) * a.rows).long().clamp_(max=a.rows - 1)  # power law: hot rows
        score = dense @ self.truth_dense * 0.5
        score = score + self.truth_rows.gather(1, idx.permute(1, 0, 2).reshape(a.tables, -1)) \
            .view(a.tables, Bg, a.bag).sum((0, 2)) / a.bag
        clicks = (torch.rand(Bg, generator=g) < torch.sigmoid(score)).float()
        lo, hi = self.rank * a.batch, (self.rank + 1) * a.batch
        return dense[lo:hi].to(self.device), idx.to(self.device), clicks[lo:hi].to(self.device)

    def step(self, i):
        a = self.args
        W, D, Bl = self.world, a.dim, a.batch
        dense, idx, clicks = self.batch(i)
        self.opt.zero_grad(set_to_none=True)
        if self.emb_opt is not None:
            self.emb_opt.zero_grad(set_to_none=True)
        # model parallel: pool my tables for the whole global batch ...
        if self.mine:
            pooled = torch.stack([e(idx[:, t, :]) for e, t in zip(self.embs, self.mine)], dim=1)
        else:
            pooled = torch.zeros(Bl * W, 0, D, device=self.device, requires_grad=True)
        send = pooled.reshape(Bl * W * len(self.mine), D)       # rows grouped by destination
        in_splits = [Bl * len(self.mine)] * W
        out_splits = [Bl * c for c in self.count]
        recv = AllToAll.apply(send, out_splits, in_splits)       # ... and swap to data parallel
        parts = recv.split(out_splits)
        emb = torch.cat([p.view(Bl, c, D) for p, c in zip(parts, self.count)], dim=1)  # [Bl, T, D]
        # data parallel: bottom MLP, interaction, top MLP
        x = self.bottom(dense)
        z = torch.cat([x[:, None, :], emb], dim=1)                       # [Bl, T+1, D]
        dots = torch.bmm(z, z.transpose(1, 2))[:, self.iu[0], self.iu[1]]
        logit = self.top(torch.cat([x, dots], dim=1)).squeeze(1)
        loss = F.binary_cross_entropy_with_logits(logit, clicks)
        (loss / W).backward()
        all_reduce_grads(self.dense_params)
        self.opt.step()
        if self.emb_opt is not None:
            self.emb_opt.step()
        return float(loss.detach())

    def parameters(self):
        return [*self.embs.parameters(), *self.dense_params]


WORKLOAD = DLRM()


def main(argv: Optional[list] = None) -> int:
    return run_main(WORKLOAD, argv)


if __name__ == "__main__":
    sys.exit(main())
