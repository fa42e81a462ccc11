"""Parameters, FLOPs, rank placement, per-op traffic and the rank-to-rank matrix.

Everything here is deterministic arithmetic on a :class:`~.config.Config`
(docs/model.md lists every formula). Notation: l layers, h hidden, f MLP
width (4h), s sequence, V vocabulary, b micro-batch, B_g global batch, B bytes
per element, p/t/d/e pipeline/tensor/data/expert parallel sizes,
m = B_g / (b d) micro-batches per iteration.

Traffic is counted per rank and per iteration, for the ranks of one pipeline
stage (ranks of one stage are alike; the first and last stage differ in
point-to-point sends, MoE layers may be spread unevenly over the stages).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np

from ...tuning import OP_CLASS
from .config import Config

#: Dimension labels, in report order.
DIMS = ("tp", "pp", "ep", "dp", "edp")
DIM_NAMES = {"tp": "tensor", "pp": "pipeline", "ep": "expert (all-to-all)",
             "dp": "data", "edp": "data (expert params)"}


# -- parameters and FLOPs ------------------------------------------------------------------
def mlp_params(h: int, f: int) -> int:
    """Two linear layers h->f->h with biases: 2hf + f + h."""
    return 2 * h * f + f + h


def layer_params(cfg: Config, i: int) -> int:
    """Parameters of layer i: attention 4h^2 + 4h, two layernorms 4h, the MLP
    2hf + f + h (12h^2 + 13h in all for f = 4h); an MoE layer has E expert MLPs
    and a router of h x E."""
    m = cfg.model
    h = m.hidden
    base = 4 * h * h + 4 * h + 4 * h
    if m.is_moe_layer(i):
        return base + m.moe.experts * mlp_params(h, m.expert_ffn) + h * m.moe.experts
    return base + mlp_params(h, m.ffn)


def embedding_params(cfg: Config) -> int:
    """Word embeddings V h (+ learned positions s h); tied with the output layer
    (untied: + V h for the output layer)."""
    m = cfg.model
    return (m.vocab * m.hidden * (1 if m.tied_embeddings else 2)
            + (m.seq_length * m.hidden if m.position_embeddings else 0))


def moe_layer_count(cfg: Config, first: int = 0, last: Optional[int] = None) -> int:
    m = cfg.model
    last = m.layers if last is None else last
    return sum(1 for i in range(first, last) if m.is_moe_layer(i))


def param_count(cfg: Config) -> dict:
    """N and its parts: total, expert (in expert MLPs), dense (the rest), and
    per rank as the data-parallel gradient counts them: dense N/(p t), expert
    N_expert/(e p t)."""
    m, lay = cfg.model, cfg.layout
    layers = sum(layer_params(cfg, i) for i in range(m.layers))
    total = embedding_params(cfg) + layers + 2 * m.hidden  # + final layernorm
    expert = (moe_layer_count(cfg) * m.moe.experts * mlp_params(m.hidden, m.expert_ffn)
              if m.moe else 0)
    dense = total - expert
    pt = lay.pipeline * lay.tensor
    return {"total": total, "dense": dense, "expert": expert,
            "dense_per_rank": dense / pt, "expert_per_rank": expert / (lay.expert * pt),
            "per_rank": dense / pt + expert / (lay.expert * pt)}


def flops_per_iteration(cfg: Config) -> float:
    """Model FLOPs of one iteration (2 per multiply-add).

    Forward per layer and sequence: 8 s h^2 (QKV, projection) + 4 s^2 h
    (scores, values) + 4 s h f (MLP; x top_k in an MoE layer, + 2 s h E for the
    router); logits 2 s h V. Layers cost 4x the forward with recomputation
    (forward, recomputed forward, backward = 2x), 3x without; the logits 3x.
    Dense, f = 4h, recomputation: 96 B_g s l h^2 (1 + s/(6h) + V/(16 l h))
    (DESIGN section 6)."""
    m = cfg.model
    s, h = m.seq_length, m.hidden
    fwd = 0.0
    for i in range(m.layers):
        attn = 8 * s * h * h + 4 * s * s * h
        if m.is_moe_layer(i):
            fwd += attn + 4 * s * h * m.expert_ffn * m.moe.top_k + 2 * s * h * m.moe.experts
        else:
            fwd += attn + 4 * s * h * m.ffn
    mult = 4 if cfg.compute.recompute else 3
    return m.global_batch * (mult * fwd + 3 * 2 * s * h * m.vocab)


# -- placement -------------------------------------------------------------------------------
def _sizes(cfg: Config) -> dict:
    lay = cfg.layout
    return {"tensor": lay.tensor, "data": lay.data, "pipeline": lay.pipeline}


def _strides(cfg: Config) -> dict:
    sizes, stride, out = _sizes(cfg), 1, {}
    for dim in cfg.layout.order:
        out[dim] = stride
        stride *= sizes[dim]
    return out


def rank_of(cfg: Config, tensor: int, data: int, pipeline: int) -> int:
    """Global rank of coordinates (default order: tensor fastest, then data, then pipeline)."""
    st = _strides(cfg)
    return tensor * st["tensor"] + data * st["data"] + pipeline * st["pipeline"]


def coords(cfg: Config, rank: int) -> dict:
    """{tensor, data, pipeline} coordinates of a global rank."""
    sizes, out = _sizes(cfg), {}
    for dim in cfg.layout.order:
        out[dim] = rank % sizes[dim]
        rank //= sizes[dim]
    return out


def node_of(cfg: Config, rank: int) -> int:
    return rank // cfg.cluster.ranks_per_node


def group_of(cfg: Config, dim: str, rank: int) -> list[int]:
    """The group of ``rank`` in a dimension, in ring order: tp (same data and
    stage), dp (same tensor and stage), ep (e consecutive data indices),
    edp (data indices equal modulo e), pp (the whole pipeline)."""
    c = coords(cfg, rank)
    lay = cfg.layout
    if dim == "tp":
        return [rank_of(cfg, i, c["data"], c["pipeline"]) for i in range(lay.tensor)]
    if dim == "dp":
        return [rank_of(cfg, c["tensor"], i, c["pipeline"]) for i in range(lay.data)]
    if dim == "ep":
        base = c["data"] - c["data"] % lay.expert
        return [rank_of(cfg, c["tensor"], base + i, c["pipeline"]) for i in range(lay.expert)]
    if dim == "edp":
        return [rank_of(cfg, c["tensor"], i, c["pipeline"])
                for i in range(c["data"] % lay.expert, lay.data, lay.expert)]
    if dim == "pp":
        return [rank_of(cfg, c["tensor"], c["data"], i) for i in range(lay.pipeline)]
    raise ValueError(f"unknown dimension {dim!r} (expected one of {', '.join(DIMS)})")


def groups(cfg: Config, dim: str) -> list[list[int]]:
    """Every group of a dimension (each once)."""
    seen, out = set(), []
    for r in range(cfg.world):
        g = group_of(cfg, dim, r)
        key = tuple(g)
        if key not in seen:
            seen.add(key)
            out.append(g)
    return out


def crosses_nodes(cfg: Config, dim: str) -> float:
    """Fraction of the dimension's groups whose ranks sit on more than one node."""
    gs = groups(cfg, dim)
    return sum(1 for g in gs if len({node_of(cfg, r) for r in g}) > 1) / len(gs) if gs else 0.0


# -- traffic ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traffic:
    """One kind of call made by every rank of a stage.

    ``message_bytes`` is the op's lookup size (docs/tuning-table.md: full
    buffer for all-gather/reduce-scatter, bytes sent incl. the own block for
    all-to-all, the message for p2p); ``sent_per_call`` the bytes one rank sends
    per call under the ring (all-reduce 2(g-1)/g S, all-gather and
    reduce-scatter (g-1)/g S), pairwise all-to-all ((g-1)/g S) or direct p2p
    (S) algorithm; ``count`` calls per iteration."""
    dim: str
    op: str
    what: str
    group_size: int
    message_bytes: float
    count: int
    sent_per_call: float
    select_group: int  # the group size the selector sees (p2p: the world)
    peer_step: int = 0  # pp: +1 sends to the next stage, -1 to the previous one

    @property
    def bytes_per_iteration(self) -> float:
        """Bytes one rank sends per iteration for this entry."""
        return self.count * self.sent_per_call


def sent_per_call(op: str, group: int, nbytes: float) -> float:
    """Bytes one rank sends for one call of ``op`` on a group (ring / pairwise)."""
    if group < 2:
        return 0.0
    op = OP_CLASS.get(op, op)
    if op == "all_reduce":
        return 2 * (group - 1) / group * nbytes
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (group - 1) / group * nbytes
    return float(nbytes)  # p2p


def _buckets(total: int, bucket: Optional[int]) -> list[tuple[int, int]]:
    """(message bytes, count) for ``total`` bytes in buckets of ``bucket``."""
    if total <= 0:
        return []
    if not bucket or total <= bucket:
        return [(total, 1)]
    full, rest = divmod(total, bucket)
    return [(bucket, full)] + ([(rest, 1)] if rest else [])


@lru_cache(maxsize=256)
def expected_capped(tokens: int, prob: float, cap: Optional[int]) -> float:
    """E[min(X, cap)] for X ~ Binomial(tokens, prob): the expected tokens one
    expert receives from one rank under uniform routing, capped by capacity."""
    mean = tokens * prob
    if cap is None or cap >= tokens:
        return mean
    if prob >= 1.0:
        return float(min(tokens, cap))
    if prob <= 0.0:
        return 0.0
    # E[min(X, C)] = C - sum_{x < C} (C - x) P(X = x); pmf in log space
    lq, lp = math.log1p(-prob), math.log(prob)
    lg = math.lgamma(tokens + 1)
    short = 0.0
    for x in range(int(cap)):
        lpmf = lg - math.lgamma(x + 1) - math.lgamma(tokens - x + 1) + x * lp + (tokens - x) * lq
        short += (cap - x) * math.exp(lpmf)
    return cap - short


def moe_dispatch(cfg: Config) -> dict:
    """Per MoE all-to-all (one of dispatch/combine, forward or backward) for one
    rank: tokens T = b s, capacity C, expected tokens per expert, bytes to each
    peer of the expert group and the local fraction 1/e.

    Routing assumption (uniform): each token's top_k copies go to top_k
    distinct experts chosen uniformly at random, so one expert receives
    X ~ Binomial(T, k/E) tokens from a rank, of which min(X, C) are kept. With
    tensor parallelism the dispatched tokens are split over the t ranks
    (DeepSpeed-MoE drops the t-fold duplicates)."""
    m, lay = cfg.model, cfg.layout
    moe = m.moe
    T = m.micro_batch * m.seq_length
    E, k, e, t = moe.experts, moe.top_k, lay.expert, lay.tensor
    cap = None
    if moe.capacity_factor is not None:
        cap = max(math.ceil(moe.capacity_factor * T * k / E), moe.min_capacity)
    if moe.dispatch == "padded":
        per_expert = float(cap)
    else:
        per_expert = expected_capped(T, k / E, cap)
    per_peer = (E // e) * per_expert * m.hidden * m.bytes_per_element / t
    return {"tokens": T, "capacity": cap, "tokens_per_expert": per_expert,
            "dropped_fraction": 1 - per_expert * E / (T * k) if T * k else 0.0,
            "bytes_per_peer": per_peer, "message_bytes": per_peer * e,
            "local_fraction": 1 / e}


def stage_traffic(cfg: Config, stage: int) -> list[Traffic]:
    """Every kind of call a rank of pipeline stage ``stage`` makes per iteration."""
    m, lay = cfg.model, cfg.layout
    p, t, d, e = lay.pipeline, lay.tensor, lay.data, lay.expert
    mb = cfg.micro_batches
    act = m.micro_batch * m.seq_length * m.hidden * m.bytes_per_element  # b s h B
    per_stage = m.layers // p
    first, last = stage * per_stage, (stage + 1) * per_stage
    out: list[Traffic] = []

    def add(dim, op, what, group, nbytes, count, select_group=None, step=0):
        if group >= 2 and count > 0 and nbytes > 0:
            out.append(Traffic(dim, op, what, group, nbytes, count, sent_per_call(op, group, nbytes),
                               select_group or group, step))

    # tensor: 2 all-reduces forward + 2 backward per layer per micro-batch
    add("tp", "all_reduce", "layer activations (2 fwd + 2 bwd per layer)", t, act,
        4 * per_stage * mb)
    # pipeline: activations to the next stage, gradients to the previous one
    if stage < p - 1:
        add("pp", "p2p", "activations to next stage (fwd)", 2, act, mb, cfg.world, +1)
    if stage > 0:
        add("pp", "p2p", "gradients to previous stage (bwd)", 2, act, mb, cfg.world, -1)
    # experts: dispatch + combine, forward and backward, per MoE layer
    if m.moe is not None and e > 1:
        n_moe = moe_layer_count(cfg, first, last)
        disp = moe_dispatch(cfg)
        # uniform routing sends what the gate chose: split sizes per peer (all_to_allv);
        # padded dispatch sends every capacity slot: even blocks (all_to_all)
        add("ep", "all_to_allv" if m.moe.dispatch == "uniform" else "all_to_all",
            "token dispatch + combine (fwd and bwd)", e, disp["message_bytes"], 4 * n_moe * mb)
        if m.moe.count_exchange:  # per-expert token counts (int64) before an uneven dispatch
            add("ep", "all_to_all", "per-expert token counts (fwd)", e, m.moe.experts * 8,
                n_moe * mb)
    # data: gradients (and ZeRO parameter gathers)
    params = param_count(cfg)
    for dim, group, n in (("dp", d, params["dense_per_rank"]),
                          ("edp", d // e, params["expert_per_rank"])):
        if group < 2 or n <= 0:
            continue
        grads = int(round(n * m.grad_bytes))
        weights = int(round(n * m.bytes_per_element))
        bucket = lay.dp_bucket_bytes
        if lay.zero == 0:
            for size, c in _buckets(grads, bucket):
                add(dim, "all_reduce", "gradient all-reduce (per step)", group, size, c)
        elif lay.zero in (1, 2):
            per = 1 if lay.zero == 1 else mb
            when = "per step" if lay.zero == 1 else "per micro-batch"
            for size, c in _buckets(grads, bucket):
                add(dim, "reduce_scatter", f"ZeRO-{lay.zero} gradient reduce-scatter ({when})",
                    group, size, c * per)
            for size, c in _buckets(weights, bucket):
                add(dim, "all_gather", f"ZeRO-{lay.zero} parameter all-gather (per step)", group, size, c)
        else:  # ZeRO-3: per layer, gathered for forward and backward of every micro-batch
            add(dim, "all_gather", "ZeRO-3 parameter all-gather (per layer, fwd + bwd)", group,
                weights / per_stage, 2 * per_stage * mb)
            add(dim, "reduce_scatter", "ZeRO-3 gradient reduce-scatter (per layer)", group,
                grads / per_stage, per_stage * mb)
    return out


def all_stage_traffic(cfg: Config) -> list[list[Traffic]]:
    return [stage_traffic(cfg, k) for k in range(cfg.layout.pipeline)]


# -- matrix ----------------------------------------------------------------------------------
def comm_matrix(cfg: Config, ring: str = "bidirectional") -> dict:
    """Bytes rank i sends to rank j in one iteration, per dimension and in total.

    Rings follow each group's order (ascending coordinate); ``bidirectional``
    splits a rank's ring volume evenly between its two ring neighbours (NCCL and
    most MPI libraries drive rings both ways) and makes the matrix symmetric;
    ``unidirectional`` sends it all to the next rank (the logger's convention).
    Pipeline stages send to the adjacent stage's rank with the same tensor and
    data coordinates; expert all-to-alls send the same bytes to every other
    member of the expert group (uniform routing)."""
    if ring not in ("bidirectional", "unidirectional"):
        raise ValueError(f"ring must be 'bidirectional' or 'unidirectional', got {ring!r}")
    n = cfg.world
    per_stage = all_stage_traffic(cfg)
    mats = {}
    for r in range(n):
        c = coords(cfg, r)
        for x in per_stage[c["pipeline"]]:
            mat = mats.setdefault(x.dim, np.zeros((n, n)))
            vol = x.bytes_per_iteration
            if x.dim == "pp":
                mat[r, rank_of(cfg, c["tensor"], c["data"], c["pipeline"] + x.peer_step)] += vol
                continue
            g = group_of(cfg, x.dim, r)
            i = g.index(r)
            if OP_CLASS.get(x.op, x.op) == "all_to_all":
                for j in g:
                    if j != r:
                        mat[r, j] += vol / (len(g) - 1)
            elif ring == "unidirectional" or len(g) == 2:
                mat[r, g[(i + 1) % len(g)]] += vol
            else:
                mat[r, g[(i + 1) % len(g)]] += vol / 2
                mat[r, g[(i - 1) % len(g)]] += vol / 2
    total = np.zeros((n, n))
    for mat in mats.values():
        total += mat
    return {"ranks": n, "dims": {k: mats[k] for k in DIMS if k in mats}, "total": total}


def node_split(cfg: Config, matrix: np.ndarray) -> dict:
    """Bytes within nodes and between nodes of a rank matrix."""
    node = np.arange(cfg.world) // cfg.cluster.ranks_per_node
    inter = node[:, None] != node[None, :]
    total = float(matrix.sum())
    cross = float(matrix[inter].sum())
    return {"total": total, "intra_node": total - cross, "inter_node": cross,
            "inter_fraction": cross / total if total else 0.0}
