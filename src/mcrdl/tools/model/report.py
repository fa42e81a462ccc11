"""``mcrdl model``: the readable report (rich), the PNGs and the JSON."""
from __future__ import annotations

import json
import os
from typing import Optional, Sequence

import numpy as np

from .compare import Row, compare, load_log
from .config import Config, load_config
from .cost import CostModel
from .estimate import Estimate, LayoutResult, default_cost, estimate, rank_layouts
from .traffic import DIM_NAMES, DIMS, comm_matrix, crosses_nodes, moe_dispatch, node_split


def fmt_bytes(n: float) -> str:
    n = float(n)
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B" if n == int(n) else f"{n:.1f} B"


def fmt_time(s: Optional[float]) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.3f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3f} ms"
    return f"{s * 1e6:.1f} us"


def fmt_count(c: float) -> str:
    return f"{c:.0f}" if abs(c - round(c)) < 1e-9 else f"{c:.2f}"


def fmt_pct(x: Optional[float]) -> str:
    return "-" if x is None else f"{x:+.1f}%"


# -- the report ------------------------------------------------------------------------------
def print_report(est: Estimate, cost: CostModel, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=None if os.isatty(1) else 160)
    cfg, m, lay = est.cfg, est.cfg.model, est.cfg.layout
    prm = est.params
    nodes = -(-cfg.world // cfg.cluster.ranks_per_node)
    console.print(f"[bold]{cfg.name}[/bold] ({cfg.source})")
    console.print(
        f"  model: l={m.layers} h={m.hidden} heads={m.heads} s={m.seq_length} V={m.vocab} "
        f"b={m.micro_batch} B_g={m.global_batch} B={m.bytes_per_element} bytes"
        + (f" (grads {m.grad_bytes})" if m.grad_bytes != m.bytes_per_element else "")
        + (f"; MoE: {m.moe.experts} experts, top-{m.moe.top_k}, capacity factor "
           f"{m.moe.capacity_factor}, every {m.moe.every} layer(s), {m.moe.dispatch} dispatch" if m.moe else ""))
    console.print(
        f"  parameters N = {prm['total']:,} ({prm['total'] / 1e9:.3f} B)"
        + (f", of which experts {prm['expert']:,}" if prm['expert'] else "")
        + f"; per rank (DP gradient) {prm['per_rank']:,.0f}")
    console.print(
        f"  layout: p={lay.pipeline} t={lay.tensor} d={lay.data}"
        + (f" e={lay.expert}" if m.moe else "") + f" ZeRO-{lay.zero}; world {cfg.world} on {nodes} "
        f"node(s) of {cfg.cluster.ranks_per_node}; order {'-'.join(lay.order)} (fastest first); "
        f"m = {cfg.micro_batches} micro-batches")
    console.print(f"  alpha-beta: {cost.source}" + (f"; choice: tuning table {cost.table.source}"
                                                    if cost.table is not None else "; choice: fastest fit"))
    for note in cost.notes + est.notes:
        console.print(f"  [yellow]note:[/yellow] {note}")
    if m.moe and lay.expert > 1:
        dsp = moe_dispatch(cfg)
        console.print(
            f"  MoE routing (uniform, top-{m.moe.top_k}): T = {dsp['tokens']} tokens/rank/micro-batch, "
            f"capacity C = {dsp['capacity']}, expected tokens per expert {dsp['tokens_per_expert']:.2f}"
            f" (dropped {dsp['dropped_fraction'] * 100:.2f}%), local fraction 1/e = {dsp['local_fraction']:.3f}, "
            f"{fmt_bytes(dsp['bytes_per_peer'])} to each expert-group peer")

    stage_note = (f" - stage {est.stage} of {lay.pipeline} (the critical stage)" if lay.pipeline > 1 else "")
    t = Table(title=f"traffic per rank per iteration{stage_note}")
    for col, just in (("dim", "left"), ("op", "left"), ("what", "left"), ("group", "right"),
                      ("message", "right"), ("count/iter", "right"), ("sent/iter", "right"),
                      ("backend", "left"), ("per call", "right"), ("per iter", "right"),
                      ("x-node", "right")):
        t.add_column(col, justify=just)
    xnode = {d: crosses_nodes(cfg, d) for d in {c.traffic.dim for c in est.calls}}
    for c in est.calls:
        x = c.traffic
        t.add_row(x.dim, x.op, x.what, str(x.group_size), fmt_bytes(x.message_bytes), fmt_count(x.count),
                  fmt_bytes(x.bytes_per_iteration), f"{c.choice.backend} ({c.choice.reason})",
                  fmt_time(c.choice.time_us * 1e-6), fmt_time(c.time_s), f"{xnode[x.dim] * 100:.0f}%")
    if not est.calls:
        t.add_row("-", "-", "no communication (one rank per group)", "", "", "", "", "", "", "", "")
    console.print(t)
    if lay.pipeline > 1:
        console.print("  exposed communication per stage: " +
                      ", ".join(f"{k}: {fmt_time(v)}" for k, v in enumerate(est.stage_comm_s)))

    f = Table(title="alpha-beta per op and backend: t(n, g) = (alpha_step L(g) + n W(g) / link) x "
                    "measured/fit at n (used ones in bold; declared values: used ones only)")
    for col in ("op", "backend", "g0", "alpha @g0", "n/(t-alpha) @g0 GB/s", "alpha/step", "link GB/s",
                "points", "rel rms", "measured/fit", "source"):
        f.add_column(col, justify="left" if col in ("op", "backend", "source") else "right")
    used = {(c.traffic.op, c.choice.backend) for c in est.calls}
    for (op, backend), fit in sorted(cost.fits.items()):
        if fit.points == 0 and (op, backend) not in used:
            continue
        style = "bold" if (op, backend) in used else None
        ratios = [r for _, r in fit.curve]
        f.add_row(op, backend, str(fit.group_size), f"{fit.alpha_us:.2f} us",
                  f"{1e-3 / fit.beta_us:.3f}" if fit.beta_us > 0 else "inf",
                  f"{fit.alpha_step_us:.2f} us", f"{fit.bandwidth_gbps:.3f}", str(fit.points),
                  f"{fit.rel_rms:.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-",
                  fit.source, style=style)
    for op, backend in sorted(used - set(cost.fits)):
        fit = cost.fit_for(op, backend)
        f.add_row(op, backend, str(fit.group_size), f"{fit.alpha_us:.2f} us", "", f"{fit.alpha_step_us:.2f} us",
                  f"{fit.bandwidth_gbps:.3f}", "-", "-", "-", fit.source, style="bold")
    console.print(f)

    b = Table(title="iteration time")
    b.add_column("component")
    b.add_column("time", justify="right")
    b.add_column("share", justify="right")
    parts = est.breakdown()
    total = est.iteration_s or est.exposed_comm_s
    for k, v in parts.items():
        label = k if not k.startswith("comm ") else f"comm {DIM_NAMES[k[5:]]}"
        b.add_row(label, fmt_time(v), f"{v / total * 100:.1f}%" if total else "-")
    if est.iteration_s is not None:
        b.add_row("[bold]iteration[/bold]", f"[bold]{fmt_time(est.iteration_s)}[/bold]", "100%")
    if not parts:
        b.add_row("nothing to estimate (no peak FLOP/s, no communication)", "-", "-")
    console.print(b)
    line = (f"  FLOPs/iteration {est.flops:.4g}; communication {fmt_time(est.comm_s)} "
            f"(exposed {fmt_time(est.exposed_comm_s)})")
    if est.iteration_s is not None:
        rate = est.flops / (est.compute_s * cfg.world) / 1e12
        line += (f"; comm share {est.comm_share * 100:.1f}%; bubble share (p-1)/(m+p-1) = "
                 f"{est.bubble_share * 100:.1f}%; {est.tokens_per_s:,.0f} tokens/s; "
                 f"{est.achieved_tflops:.2f} model TFLOP/s per device over the iteration "
                 f"(peak x utilisation = {rate:.2f})")
    console.print(line)


def print_matrix_summary(cfg: Config, matrix: dict, console) -> None:
    split = node_split(cfg, matrix["total"])
    sym = bool(np.allclose(matrix["total"], matrix["total"].T))
    console.print(f"  matrix: {fmt_bytes(split['total'])} sent per iteration by all ranks, "
                  f"{split['inter_fraction'] * 100:.1f}% between nodes; symmetric: {sym}; "
                  "per dimension: " + ", ".join(f"{d} {fmt_bytes(mat.sum())}" for d, mat in matrix["dims"].items()))


def print_sweep(results: Sequence[LayoutResult], world: int, console, top: int = 10,
                rejected: Sequence = ()) -> None:
    from rich.table import Table

    t = Table(title=f"layouts on {world} ranks, least exposed communication first; "
                    f"{len(results)} valid, {len(rejected)} rejected")
    for col in ("#", "p", "t", "d", "m", "comm", *DIMS, "iteration", "comm share"):
        t.add_column(col, justify="right")
    for i, r in enumerate(results[:top]):
        e = r.estimate
        t.add_row(str(i + 1), str(r.pipeline), str(r.tensor), str(r.data), str(e.cfg.micro_batches),
                  fmt_time(r.comm_s), *(fmt_time(e.comm_by_dim[d]) if d in e.comm_by_dim else "-" for d in DIMS),
                  fmt_time(r.iteration_s), f"{e.comm_share * 100:.1f}%" if e.comm_share is not None else "-")
    console.print(t)
    timed = [r for r in results if r.iteration_s is not None]
    if timed:
        i, best = min(enumerate(results), key=lambda ir: (ir[1].iteration_s is None,
                                                          ir[1].iteration_s or 0.0))
        console.print(f"  shortest predicted iteration: #{i + 1} p={best.pipeline} t={best.tensor} "
                      f"d={best.data} ({fmt_time(best.iteration_s)})")
    if rejected:
        console.print("  rejected: " + "; ".join(f"{p}x{tt}x{d}: {why}" for (p, tt, d), why in rejected[:6])
                      + (" ..." if len(rejected) > 6 else ""))


def print_compare(rows: Sequence[Row], iterations: int, console) -> None:
    from rich.table import Table

    t = Table(title=f"prediction vs logged run (per rank, {iterations} iteration(s); diff = (pred - meas) / meas; "
                    "time meas = comm (arrival-corrected) + wait (for later peers) = logged)")
    for col in ("dim", "op", "count pred", "count meas", "diff", "bytes pred", "bytes meas", "diff",
                "time pred", "comm meas", "diff", "wait", "logged", "diff logged", "backend pred",
                "backend meas"):
        t.add_column(col, justify="left" if col in ("dim", "op") or col.startswith("backend") else "right")
    for r in rows:
        nm = r.pred_count == 0  # not modelled
        pct = (lambda a, b: "not modelled") if nm else (lambda a, b: fmt_pct(Row.diff(a, b)))
        t.add_row(r.dim, r.op, fmt_count(r.pred_count), fmt_count(r.meas_count),
                  pct(r.pred_count, r.meas_count), fmt_bytes(r.pred_bytes),
                  fmt_bytes(r.meas_bytes), pct(r.pred_bytes, r.meas_bytes),
                  fmt_time(r.pred_s), fmt_time(r.meas_comm_s), pct(r.pred_s, r.meas_comm_s),
                  fmt_time(r.meas_s - r.meas_comm_s), fmt_time(r.meas_s), pct(r.pred_s, r.meas_s),
                  r.pred_backend, r.meas_backend)
    console.print(t)


# -- PNGs and JSON ---------------------------------------------------------------------------
def write_matrix_png(cfg: Config, matrix: dict, path: str) -> str:
    """Heatmap of bytes sent rank -> rank per iteration: total and one panel per dimension."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("all dimensions", matrix["total"])] + [(DIM_NAMES[d], mat) for d, mat in matrix["dims"].items()]
    cols = min(len(panels), 3)
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.8 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    n = cfg.world
    from matplotlib.colors import LogNorm

    for k, (ax, (name, mat)) in enumerate(zip(axes.flat, panels)):
        data = np.asarray(mat) / (1 << 20)
        norm = None
        if k == 0 and (data > 0).any():  # the total mixes dimensions orders of magnitude apart
            data = np.ma.masked_where(data <= 0, data)
            norm = LogNorm(vmin=float(data.min()), vmax=max(float(data.max()), float(data.min()) * 1.01))
            name += " (log scale)"
        im = ax.imshow(data, cmap="viridis", interpolation="nearest", norm=norm)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("to rank", fontsize=8)
        ax.set_ylabel("from rank", fontsize=8)
        step = max(1, n // 16)
        ax.set_xticks(range(0, n, step))
        ax.set_yticks(range(0, n, step))
        ax.tick_params(labelsize=6)
        fig.colorbar(im, ax=ax, fraction=0.046, label="MiB / iteration")
    fig.suptitle(f"{cfg.name}: bytes rank -> rank per iteration (p={cfg.layout.pipeline} "
                 f"t={cfg.layout.tensor} d={cfg.layout.data}, ranks numbered {'-'.join(cfg.layout.order)})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


#: One colour per part of the iteration, the same in both panels.
COLORS = {"compute": "#4c72b0", "bubble": "#c0c0c0", "tp": "#dd8452", "pp": "#55a868",
          "ep": "#c44e52", "dp": "#8172b3", "edp": "#937860"}


def write_breakdown_png(est: Estimate, path: str) -> str:
    """Left: the iteration as a stacked bar; right: communication time per (dim, op)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.4), gridspec_kw={"width_ratios": [1.3, 2]})
    parts = est.breakdown()
    bottom = 0.0
    for k, v in parts.items():
        a1.bar(0, v * 1e3, bottom=bottom, width=0.5, color=COLORS.get(k.replace("comm ", ""), "grey"),
               label=f"{k} ({fmt_time(v)})")
        bottom += v * 1e3
    a1.set_xlim(-0.4, 1.6)
    a1.set_xticks([0])
    a1.set_xticklabels(["iteration" if est.iteration_s is not None else "communication"])
    a1.set_ylabel("ms per iteration")
    if parts:
        a1.legend(fontsize=7, loc="center left", bbox_to_anchor=(0.42, 0.5), frameon=False)
    title = f"iteration {fmt_time(est.iteration_s)}" if est.iteration_s is not None else "no compute estimate"
    if est.comm_share is not None:
        title += f", comm share {est.comm_share * 100:.1f}%"
    a1.set_title(title, fontsize=9)
    labels = [f"{c.traffic.dim} {c.traffic.op}\n{c.choice.backend}" for c in est.calls]
    times = [c.time_s * 1e3 for c in est.calls]
    if labels:
        a2.barh(range(len(labels)), times, color=[COLORS[c.traffic.dim] for c in est.calls])
        a2.set_yticks(range(len(labels)))
        a2.set_yticklabels(labels, fontsize=7)
        a2.invert_yaxis()
    a2.set_xlabel("ms per iteration")
    a2.set_title("communication per dimension and op (critical stage)", fontsize=9)
    fig.suptitle(est.cfg.name, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def to_json(est: Estimate, cost: CostModel, matrix: dict) -> dict:
    cfg = est.cfg
    return {
        "format": "mcrdl-model/1", "name": cfg.name, "source": cfg.source,
        "layout": {"pipeline": cfg.layout.pipeline, "tensor": cfg.layout.tensor, "data": cfg.layout.data,
                   "expert": cfg.layout.expert, "zero": cfg.layout.zero, "micro_batches": cfg.micro_batches},
        "params": est.params, "flops_per_iteration": est.flops, "alpha_beta_source": cost.source,
        "fits": [{"op": f.op, "backend": f.backend, "group_size": f.group_size, "alpha_us": f.alpha_us,
                  "beta_us_per_byte": f.beta_us, "alpha_step_us": f.alpha_step_us,
                  "link_gbps": f.bandwidth_gbps, "points": f.points, "rel_rms": f.rel_rms,
                  "measured_over_fit": [list(p) for p in f.curve], "source": f.source}
                 for f in cost.fits.values()],
        "critical_stage": est.stage,
        "traffic": [{"dim": c.traffic.dim, "op": c.traffic.op, "what": c.traffic.what,
                     "group_size": c.traffic.group_size, "message_bytes": c.traffic.message_bytes,
                     "count": c.traffic.count, "bytes_per_iteration": c.traffic.bytes_per_iteration,
                     "backend": c.choice.backend, "reason": c.choice.reason,
                     "time_per_call_s": c.choice.time_us * 1e-6, "time_per_iteration_s": c.time_s}
                    for c in est.calls],
        "breakdown_s": est.breakdown(), "comm_s": est.comm_s, "exposed_comm_s": est.exposed_comm_s,
        "iteration_s": est.iteration_s, "comm_share": est.comm_share, "bubble_share": est.bubble_share,
        "stage_comm_s": est.stage_comm_s,
        "matrix": {"ranks": matrix["ranks"], "unit": "bytes per iteration", "rows_send_to_columns": True,
                   "ring": "bidirectional", "total": matrix["total"].tolist(),
                   "dims": {d: mat.tolist() for d, mat in matrix["dims"].items()}},
    }


# -- the command -------------------------------------------------------------------------------
def cli_main(args) -> int:
    """``mcrdl model CONFIG [--bench] [--calibrate-log] [--table] [--out] [--compare-log] [--sweep]``."""
    from rich.console import Console

    cfg = load_config(args.config)
    if args.bench:
        cost = CostModel.from_bench(args.bench)
        if cfg.alpha_beta:
            cost.add_declared(cfg.alpha_beta)
    else:
        cost = default_cost(cfg)
    if args.calibrate_log:
        cost.calibrate(load_log(args.calibrate_log), args.calibrate_log)
    if args.table:
        cost.load_table(args.table)
    est = estimate(cfg, cost, args.peak_tflops, args.utilization)
    console = Console(width=None if os.isatty(1) else 200)
    print_report(est, cost, console)
    matrix = comm_matrix(cfg)
    print_matrix_summary(cfg, matrix, console)
    doc = to_json(est, cost, matrix)
    if args.sweep:
        rejected: list = []
        results = rank_layouts(cfg, args.sweep, cost, args.peak_tflops, args.utilization, rejected)
        print_sweep(results, args.sweep, console, args.top, rejected)
        doc["sweep"] = [{"pipeline": r.pipeline, "tensor": r.tensor, "data": r.data,
                         "exposed_comm_s": r.comm_s, "iteration_s": r.iteration_s,
                         "comm_by_dim_s": r.estimate.comm_by_dim} for r in results]
    if args.compare_log:
        rows = compare(cfg, load_log(args.compare_log), cost, args.log_iterations)
        print_compare(rows, args.log_iterations, console)
        doc["compare"] = [{**r.__dict__, "diff_count_pct": Row.diff(r.pred_count, r.meas_count),
                           "diff_bytes_pct": Row.diff(r.pred_bytes, r.meas_bytes),
                           "diff_time_pct": Row.diff(r.pred_s, r.meas_comm_s),
                           "diff_logged_time_pct": Row.diff(r.pred_s, r.meas_s)} for r in rows]
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        paths = [write_matrix_png(cfg, matrix, os.path.join(args.out, "matrix.png")),
                 write_breakdown_png(est, os.path.join(args.out, "breakdown.png"))]
        jpath = os.path.join(args.out, "model.json")
        with open(jpath, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")
        paths.append(jpath)
        console.print("written: " + ", ".join(paths))
    return 0
