"""Iteration-time estimate and the layout sweep.

Iteration time (per DESIGN section 6, no overlap of compute and communication
except ``compute.dp_overlap`` of the data-parallel time)::

    compute  = FLOPs / (world x peak x utilisation)
    bubble   = compute x (p - 1) / m          (share (p-1)/(m+p-1) of compute + bubble)
    comm     = sum over the calls of the critical stage of count x t(op, backend, bytes, group)
    iteration = compute + bubble + comm_tp + comm_pp + comm_ep + (1 - dp_overlap)(comm_dp + comm_edp)

The critical stage is the pipeline stage with the most communication time.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .config import Config, ModelConfigError
from .cost import Choice, CostModel
from .traffic import DIMS, Traffic, all_stage_traffic, flops_per_iteration, param_count


@dataclass
class Call:
    """One traffic entry with its predicted backend and time."""
    traffic: Traffic
    choice: Choice

    @property
    def time_s(self) -> float:
        """Seconds per iteration for this entry (count x per-call time)."""
        return self.traffic.count * self.choice.time_us * 1e-6


@dataclass
class Estimate:
    cfg: Config
    stage: int  # critical stage
    calls: list  # Call, for the critical stage
    comm_by_dim: dict  # dim -> seconds per iteration (critical stage)
    stage_comm_s: list  # exposed comm per stage
    flops: float
    params: dict
    compute_s: Optional[float] = None
    bubble_s: Optional[float] = None
    notes: list = field(default_factory=list)

    @property
    def comm_s(self) -> float:
        """All communication of the critical stage (before overlap)."""
        return sum(self.comm_by_dim.values())

    @property
    def exposed_comm_s(self) -> float:
        ov = self.cfg.compute.dp_overlap
        return sum(v * ((1 - ov) if d in ("dp", "edp") else 1.0) for d, v in self.comm_by_dim.items())

    @property
    def iteration_s(self) -> Optional[float]:
        if self.compute_s is None:
            return None
        return self.compute_s + self.bubble_s + self.exposed_comm_s

    @property
    def comm_share(self) -> Optional[float]:
        it = self.iteration_s
        return self.exposed_comm_s / it if it else None

    @property
    def bubble_share(self) -> float:
        p, m = self.cfg.layout.pipeline, self.cfg.micro_batches
        return (p - 1) / (m + p - 1)

    @property
    def tokens_per_s(self) -> Optional[float]:
        it = self.iteration_s
        m = self.cfg.model
        return m.global_batch * m.seq_length / it if it else None

    @property
    def achieved_tflops(self) -> Optional[float]:
        """Model TFLOP/s per device at the estimated iteration time."""
        it = self.iteration_s
        return self.flops / it / self.cfg.world / 1e12 if it else None

    def breakdown(self) -> dict:
        """Seconds per iteration: compute, bubble, and exposed comm per dimension."""
        out = {}
        if self.compute_s is not None:
            out["compute"] = self.compute_s
            out["bubble"] = self.bubble_s
        ov = self.cfg.compute.dp_overlap
        for d in DIMS:
            if d in self.comm_by_dim:
                out[f"comm {d}"] = self.comm_by_dim[d] * ((1 - ov) if d in ("dp", "edp") else 1.0)
        return out


def estimate(cfg: Config, cost: Optional[CostModel] = None, peak_tflops: Optional[float] = None,
             utilization: Optional[float] = None) -> Estimate:
    """Predict communication and iteration time of one layout."""
    cost = cost or default_cost(cfg)
    per_stage = []
    for entries in all_stage_traffic(cfg):
        calls = [Call(x, cost.choose(x.op, x.message_bytes, x.group_size, x.select_group))
                 for x in entries]
        per_stage.append(calls)
    ov = cfg.compute.dp_overlap

    def by_dim(calls):
        out: dict[str, float] = {}
        for c in calls:
            out[c.traffic.dim] = out.get(c.traffic.dim, 0.0) + c.time_s
        return out

    exposed = [sum(v * ((1 - ov) if d in ("dp", "edp") else 1.0) for d, v in by_dim(cs).items())
               for cs in per_stage]
    stage = max(range(len(per_stage)), key=lambda k: (exposed[k], -k))
    flops = flops_per_iteration(cfg)
    peak = peak_tflops if peak_tflops is not None else cfg.compute.peak_tflops
    util = utilization if utilization is not None else cfg.compute.utilization
    est = Estimate(cfg, stage, per_stage[stage], by_dim(per_stage[stage]), exposed, flops,
                   param_count(cfg))
    if peak:
        est.compute_s = flops / (cfg.world * peak * 1e12 * util)
        est.bubble_s = est.compute_s * (cfg.layout.pipeline - 1) / cfg.micro_batches
    else:
        est.notes.append("no peak FLOP/s (compute.peak_tflops or --peak-tflops): "
                         "communication only, no iteration time")
    return est


def default_cost(cfg: Optional[Config] = None) -> CostModel:
    """Config-declared alpha-beta values if any, else the built-in defaults."""
    if cfg is not None and cfg.alpha_beta:
        cost = CostModel(source="alpha_beta declared in the config")
        cost.add_declared(cfg.alpha_beta)
        return cost
    return CostModel.defaults()


@dataclass
class LayoutResult:
    pipeline: int
    tensor: int
    data: int
    estimate: Estimate

    @property
    def comm_s(self) -> float:
        return self.estimate.exposed_comm_s

    @property
    def iteration_s(self) -> Optional[float]:
        return self.estimate.iteration_s


def rank_layouts(model: Config, world_size: int, fits: Optional[CostModel] = None,
                 peak_tflops: Optional[float] = None, utilization: Optional[float] = None,
                 rejected: Optional[list] = None, by: str = "comm") -> list[LayoutResult]:
    """Every (p, t, d) with p t d = ``world_size`` that validates for this model
    (same expert parallel size, ZeRO stage and node size), ranked by predicted
    exposed communication time, then iteration time (``by="iteration"``: the
    other way round). Layouts that do not validate are appended to
    ``rejected`` as ((p, t, d), reason) when given."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if by not in ("comm", "iteration"):
        raise ValueError(f"by must be 'comm' or 'iteration', got {by!r}")
    cost = fits or default_cost(model)
    out = []
    for p in range(1, world_size + 1):
        if world_size % p:
            continue
        for t in range(1, world_size // p + 1):
            if (world_size // p) % t:
                continue
            d = world_size // (p * t)
            try:
                cfg = model.with_layout(p, t, d)
            except ModelConfigError as exc:
                if rejected is not None:
                    rejected.append(((p, t, d), str(exc).split(": ", 1)[-1]))
                continue
            out.append(LayoutResult(p, t, d, estimate(cfg, cost, peak_tflops, utilization)))
    inf = float("inf")
    if by == "comm":
        out.sort(key=lambda r: (r.comm_s, r.iteration_s if r.iteration_s is not None else inf,
                                r.pipeline, r.tensor))
    else:
        out.sort(key=lambda r: (r.iteration_s if r.iteration_s is not None else inf, r.comm_s,
                                r.pipeline, r.tensor))
    return out
