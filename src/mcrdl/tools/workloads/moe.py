"""Mixture of experts: transformer blocks whose MLPs are experts spread over ranks.

Expert parallelism as in GShard / DeepSpeed-MoE, at CPU scale:

* every rank holds the shared weights (embedding, attention, layer norms,
  gate, head: data parallel) and ``experts_per_rank`` experts of each MoE
  layer (expert ``e`` lives on rank ``e // experts_per_rank``);
* per MoE layer and step: top-k gating (softmax, renormalised top-k weights),
  a per-expert capacity ``ceil(capacity_factor * k * tokens / experts)``
  (assignments past it are dropped, first choices first), then
  - ``all_to_all_single`` of the per-expert counts (int64, ``experts`` per rank),
  - dispatch: ``all_to_all_single`` of the token rows, uneven splits,
  - the local experts run on what arrived,
  - combine: ``all_to_all_single`` back (splits swapped), weighted sum;
  backward repeats both row all-to-alls in reverse (autograd);
* after backward: one fused SUM ``all_reduce`` of the shared gradients (each
  rank's loss is scaled by 1/world, so the sum is the mean); expert gradients
  already carry every rank's tokens through the all-to-all backward.

Synthetic data: next-token prediction on sequences from a fixed random
"grammar" (token t+1 = a permutation of token t, or a random token with
probability 0.2), seeded by (seed, rank, step). A Switch-style load-balancing
loss (coefficient 0.01) is added.
"""
from __future__ import annotations

import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import mcrdl

from .common import AllToAll, Workload, all_reduce_grads, comm, generator, main as run_main


class Expert(nn.Module):
    def __init__(self, d: int, ffn: int):
        super().__init__()
        self.fc1 = nn.Linear(d, ffn)
        self.fc2 = nn.Linear(ffn, d)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MoELayer(nn.Module):
    """Top-k gated experts, ``experts_per_rank`` of them on this rank."""

    def __init__(self, d: int, ffn: int, world: int, rank: int, experts_per_rank: int, k: int,
                 capacity_factor: float):
        super().__init__()
        self.world, self.rank, self.el = world, rank, experts_per_rank
        self.E = world * experts_per_rank
        self.k, self.cf = k, capacity_factor
        self.gate = nn.Linear(d, self.E, bias=False)
        experts = [Expert(d, ffn) for _ in range(self.E)]  # all made: same init on every rank
        self.experts = nn.ModuleList(experts[rank * self.el:(rank + 1) * self.el])
        self.aux_loss = torch.zeros(())
        self.dropped = 0

    def forward(self, x):
        T, d = x.shape
        E, k, el, world = self.E, self.k, self.el, self.world
        probs = F.softmax(self.gate(x), dim=-1)
        topv, topi = probs.topk(k, dim=-1)
        topv = topv / topv.sum(-1, keepdim=True)
        # Switch/GShard load-balancing loss: E * sum_e(fraction routed to e * mean prob of e)
        frac = F.one_hot(topi[:, 0], E).float().mean(0)
        self.aux_loss = E * (frac * probs.mean(0)).sum()
        # assignments, first choices first; capacity per expert
        cap = math.ceil(self.cf * k * T / E)
        flat_e = topi.t().reshape(-1)
        flat_tok = torch.arange(T, device=x.device).repeat(k)
        flat_w = topv.t().reshape(-1)
        pos = F.one_hot(flat_e, E).cumsum(0).gather(1, flat_e[:, None]).squeeze(1) - 1
        keep = pos < cap
        self.dropped = int((~keep).sum())
        e_k, tok_k, w_k = flat_e[keep], flat_tok[keep], flat_w[keep]
        order = torch.argsort(e_k, stable=True)
        e_s, tok_s, w_s = e_k[order], tok_k[order], w_k[order]
        send_per_expert = torch.bincount(e_s, minlength=E)                     # [E]
        recv_per_expert = torch.empty_like(send_per_expert)                    # [world * el]
        comm.all_to_all_single(recv_per_expert, send_per_expert)
        in_splits = send_per_expert.view(world, el).sum(1).tolist()
        recv_mat = recv_per_expert.view(world, el)
        out_splits = recv_mat.sum(1).tolist()
        # dispatch
        recv = AllToAll.apply(x[tok_s], out_splits, in_splits)
        # local experts on the rows that arrived (grouped by source, then expert)
        local_e = torch.arange(el, device=x.device).repeat(world).repeat_interleave(recv_mat.reshape(-1))
        out = torch.zeros_like(recv)
        for j, expert in enumerate(self.experts):
            idx = (local_e == j).nonzero().squeeze(1)
            if idx.numel():
                out = out.index_copy(0, idx, expert(recv.index_select(0, idx)))
        # combine
        back = AllToAll.apply(out, in_splits, out_splits)
        y = torch.zeros_like(x).index_add(0, tok_s, back * w_s[:, None])
        return y


class Block(nn.Module):
    def __init__(self, d, heads, ffn, world, rank, el, k, cf):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.moe = MoELayer(d, ffn, world, rank, el, k, cf)
        self.heads = heads

    def forward(self, x):  # [B, S, d]
        B, S, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.view(B, S, h, d // h).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, d))
        x = x + self.moe(self.ln2(x).reshape(B * S, d)).view(B, S, d)
        return x


class MoEModel(nn.Module):
    def __init__(self, vocab, d, heads, ffn, layers, seq, world, rank, el, k, cf):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, ffn, world, rank, el, k, cf)
                                    for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        x = self.tok(tokens) + self.pos[: tokens.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln(x))

    def aux_loss(self):
        return sum(b.moe.aux_loss for b in self.blocks)


class MoE(Workload):
    name = "moe"
    ops = ("all_to_all", "all_reduce")
    sample_unit = "seq"

    def add_args(self, p):
        g = p.add_argument_group("moe")
        g.add_argument("--batch", type=int, default=8, help="sequences per rank (default 8)")
        g.add_argument("--seq", type=int, default=32)
        g.add_argument("--d-model", type=int, default=64)
        g.add_argument("--heads", type=int, default=4)
        g.add_argument("--ffn", type=int, default=256)
        g.add_argument("--layers", type=int, default=2)
        g.add_argument("--vocab", type=int, default=256)
        g.add_argument("--experts-per-rank", type=int, default=2)
        g.add_argument("--top-k", type=int, default=2)
        g.add_argument("--capacity-factor", type=float, default=1.25)
        g.add_argument("--lr", type=float, default=1e-3)

    def config(self, args):
        return {"batch": args.batch, "seq": args.seq, "d": args.d_model, "ffn": args.ffn,
                "layers": args.layers, "experts/rank": args.experts_per_rank, "k": args.top_k,
                "cf": args.capacity_factor}

    def samples_per_step(self, args, world):
        return args.batch * world

    def build(self, args, mode, variant, run_id):
        self.args = args
        self.rank, self.world = mcrdl.get_rank(), mcrdl.get_world_size()
        torch.manual_seed(args.seed)
        self.model = MoEModel(args.vocab, args.d_model, args.heads, args.ffn, args.layers,
                              args.seq, self.world, self.rank, args.experts_per_rank,
                              args.top_k, args.capacity_factor).to(self.device)
        self.shared = [p for n, p in self.model.named_parameters() if ".experts." not in n]
        self.opt = torch.optim.Adam(self.model.parameters(), lr=args.lr)
        g = generator(args.seed, 99)
        self.perm = torch.randperm(args.vocab, generator=g)

    def batch(self, i):
        a = self.args
        g = generator(a.seed, self.rank, i)
        toks = torch.empty(a.batch, a.seq + 1, dtype=torch.long)
        toks[:, 0] = torch.randint(a.vocab, (a.batch,), generator=g)
        noise = torch.rand(a.batch, a.seq, generator=g) < 0.2
        rand = torch.randint(a.vocab, (a.batch, a.seq), generator=g)
        for t in range(a.seq):
            toks[:, t + 1] = torch.where(noise[:, t], rand[:, t], self.perm[toks[:, t]])
        toks = toks.to(self.device)
        return toks[:, :-1], toks[:, 1:]

    def step(self, i):
        x, y = self.batch(i)
        self.opt.zero_grad(set_to_none=True)
        logits = self.model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        total = loss + 0.01 * self.model.aux_loss()
        (total / self.world).backward()
        all_reduce_grads(self.shared)
        self.opt.step()
        return float(loss.detach())

    def parameters(self):
        return list(self.model.parameters())


WORKLOAD = MoE()


def main(argv: Optional[list] = None) -> int:
    return run_main(WORKLOAD, argv)


if __name__ == "__main__":
    sys.exit(main())
