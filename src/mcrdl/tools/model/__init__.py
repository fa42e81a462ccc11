"""Communication model of Megatron-style (and MoE) training: traffic per
parallel dimension and op, the rank-to-rank matrix, alpha-beta times fitted from
``mcrdl bench`` results, iteration-time estimates and a layout sweep.

Pure Python (numpy; matplotlib for the PNGs). docs/model.md is the reference.

>>> from mcrdl.tools.model import load_config, estimate, rank_layouts, CostModel
>>> cfg = load_config("examples/model/gpt_small.json")
>>> est = estimate(cfg, CostModel.defaults())
>>> best = rank_layouts(cfg, 8)[0]          # (p, t, d) with the least comm time
"""
from .compare import Row, compare, load_log
from .config import (AlphaBeta, Cluster, Compute, Config, Layout, ModelConfigError, ModelSpec,
                     MoESpec, config_from_dict, load_config, validate)
from .cost import CostModel, Fit, fit_alpha_beta, make_fit, steps, volume
from .estimate import Estimate, LayoutResult, default_cost, estimate, rank_layouts
from .traffic import (Traffic, all_stage_traffic, comm_matrix, coords, flops_per_iteration,
                      group_of, moe_dispatch, node_split, param_count, rank_of, stage_traffic)

__all__ = [n for n in dir() if not n.startswith("_")]
