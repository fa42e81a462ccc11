"""PNG plots of bench/tune results (matplotlib, headless)."""
from __future__ import annotations

import os
from typing import Optional, Sequence

from .bench import Result, human
from ..tuning import OP_CLASS


def plot_ops(results: Sequence[Result], outdir: str, table: Optional[dict] = None,
             title: str = "", device: str = "cpu") -> list[str]:
    """One log-log latency-vs-size PNG per op; with ``table`` (a tuning-table
    document), the ranges of its ``device`` rules shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(outdir, exist_ok=True)
    by_op: dict[str, dict[str, list[Result]]] = {}
    for r in results:
        by_op.setdefault(r.op, {}).setdefault(r.variant, []).append(r)
    table_rules = {} if table is None else table["rules"].get(device, {})
    colors = {}
    paths = []
    for op, by_variant in by_op.items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for variant, rs in by_variant.items():
            rs = sorted(rs, key=lambda r: r.bytes)
            style = "-" if not variant.startswith("raw-") else ":"
            width = 2.5 if variant == "mcrdl" else 1.5
            line, = ax.plot([r.bytes for r in rs], [r.max_us for r in rs], style, marker="o",
                            markersize=3, linewidth=width, label=variant)
            colors[variant] = line.get_color()
        if OP_CLASS[op] in table_rules:
            rules = next(iter(table_rules[OP_CLASS[op]].values()))
            sizes = sorted({r.bytes for rs in by_variant.values() for r in rs})
            low = sizes[0] / 1.5
            for rule in rules:
                high = rule["max_bytes"] * 1.41 if rule["max_bytes"] is not None else sizes[-1] * 1.5
                ax.axvspan(low, high, color=colors.get(rule["backend"], "grey"), alpha=0.12)
                ax.text((low * high) ** 0.5, 0.97, rule["backend"], transform=ax.get_xaxis_transform(),
                        ha="center", va="top", fontsize=8)
                low = high
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ticks = sorted({r.bytes for rs in by_variant.values() for r in rs})
        ax.set_xticks(ticks[::max(1, len(ticks) // 8)])
        ax.set_xticklabels([human(t) for t in ticks[::max(1, len(ticks) // 8)]])
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("latency (us, slowest rank)")
        ax.set_title(f"{op} {title}".strip())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        path = os.path.join(outdir, f"{op}.png")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
