"""Tensor-parallel decoding: the all-reduce-bound step DeepSpeed built its
shared-memory all-reduce for (CPU inference of a TP-sharded transformer).

Every rank holds ``1/t`` of each layer (``t`` = the world): attention heads and
MLP features column-parallel, the output projections row-parallel, so each
layer ends its attention and its MLP with an ``all_reduce`` of the partial
sums, ``batch x hidden`` floats: two all-reduces per layer per token, with
little compute between them (one token per sequence, a key/value cache of
``--context`` positions). A step decodes ``--tokens`` tokens greedily-free:
each token's output is the next token's input. No gradients, no optimizer;
the "loss" is the mean magnitude of the last token's output (the same in every mode).
Weights are made at full size from the seed and sliced, so the model is the
same for any ``t``.
"""
from __future__ import annotations

import math
import sys
from typing import Optional

import torch
import torch.nn.functional as F

import mcrdl

from .common import Workload, comm, generator, main as run_main


class Decode(Workload):
    name = "decode"
    ops = ("all_reduce",)
    sample_unit = "token"

    def add_args(self, p):
        g = p.add_argument_group("decode")
        g.add_argument("--batch", type=int, default=4, help="sequences decoded together")
        g.add_argument("--hidden", type=int, default=256)
        g.add_argument("--heads", type=int, default=4)
        g.add_argument("--ffn", type=int, default=512)
        g.add_argument("--layers", type=int, default=4)
        g.add_argument("--context", type=int, default=32, help="key/value cache positions per sequence")
        g.add_argument("--tokens", type=int, default=8, help="tokens decoded per step")

    def config(self, args):
        return {"batch": args.batch, "hidden": args.hidden, "heads": args.heads, "ffn": args.ffn,
                "layers": args.layers, "context": args.context, "tokens": args.tokens}

    def samples_per_step(self, args, world):
        return args.batch * args.tokens

    def build(self, args, mode, variant, run_id):
        self.args = a = args
        t, r = mcrdl.get_world_size(), mcrdl.get_rank()
        if a.heads % t or a.ffn % t or a.hidden % a.heads:
            raise ValueError("heads and ffn must divide by the world size, hidden by heads")
        self.hd, self.nl = a.hidden // a.heads, a.heads // t
        cols = slice(r * self.nl * self.hd, (r + 1) * self.nl * self.hd)
        fcols = slice(r * a.ffn // t, (r + 1) * a.ffn // t)
        g = generator(a.seed, 11)
        w = lambda o, i: (torch.randn(o, i, generator=g) / math.sqrt(i))
        self.layers = []
        for _ in range(a.layers):
            wq, wk, wv, wo = (w(a.hidden, a.hidden) for _ in range(4))
            w1, w2 = w(a.ffn, a.hidden), w(a.hidden, a.ffn)
            cache = [torch.randn(a.batch, a.heads, a.context, self.hd, generator=g) for _ in range(2)]
            self.layers.append({
                "qkv": torch.cat([wq[cols], wk[cols], wv[cols]]).contiguous().to(self.device),  # column
                "wo": wo[:, cols].contiguous().to(self.device),                                 # row
                "w1": w1[fcols].contiguous().to(self.device),                                   # column
                "w2": w2[:, fcols].contiguous().to(self.device),                                # row
                "k": cache[0][:, r * self.nl:(r + 1) * self.nl].contiguous().to(self.device),
                "v": cache[1][:, r * self.nl:(r + 1) * self.nl].contiguous().to(self.device)})
        self.params = [x for layer in self.layers for x in layer.values()]

    def _layer(self, x, p):
        a, b = self.args, x.shape[0]
        h = F.layer_norm(x, (a.hidden,))
        q, k, v = (h @ p["qkv"].t()).view(b, 3, self.nl, 1, self.hd).unbind(1)
        keys, values = torch.cat([p["k"], k], 2), torch.cat([p["v"], v], 2)  # the cache and this token
        att = F.scaled_dot_product_attention(q, keys, values).reshape(b, self.nl * self.hd)
        out = att @ p["wo"].t()
        comm.all_reduce(out)  # row-parallel partial sums
        x = x + out
        m = F.gelu(F.layer_norm(x, (a.hidden,)) @ p["w1"].t()) @ p["w2"].t()
        comm.all_reduce(m)
        return x + m

    @torch.no_grad()
    def step(self, i):
        a = self.args
        x = torch.randn(a.batch, a.hidden, generator=generator(a.seed, 12, i)).to(self.device)
        for _ in range(a.tokens):
            for p in self.layers:
                x = self._layer(x, p)
            x = F.layer_norm(x, (a.hidden,))
        return float(x.abs().mean())

    def parameters(self):
        return self.params


WORKLOAD = Decode()


def main(argv: Optional[list] = None) -> int:
    return run_main(WORKLOAD, argv)


if __name__ == "__main__":
    sys.exit(main())
