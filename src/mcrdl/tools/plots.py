"""PNG plots of bench/tune results (matplotlib, headless): one figure per sweep."""
from __future__ import annotations

import math
import os
from typing import Optional, Sequence

from .bench import Result, human
from ..tuning import OP_CLASS


def plot_ops(results: Sequence[Result], path: str, table: Optional[dict] = None,
             title: str = "", device: str = "cpu") -> str:
    """One PNG at ``path``: a log-log latency-vs-size panel per op; with
    ``table`` (a tuning-table document), the ranges of its ``device`` rules
    shaded in each panel. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_op: dict[str, dict[str, list[Result]]] = {}
    for r in results:
        by_op.setdefault(r.op, {}).setdefault(r.variant, []).append(r)
    table_rules = {} if table is None else table["rules"].get(device, {})
    columns = min(3, len(by_op)) or 1
    rows = math.ceil(len(by_op) / columns) or 1
    fig, axes = plt.subplots(rows, columns, figsize=(6 * columns, 4 * rows), squeeze=False)
    colors: dict[str, str] = {}
    for ax, (op, by_variant) in zip(axes.flat, by_op.items()):
        for variant, rs in sorted(by_variant.items()):
            rs = sorted(rs, key=lambda r: r.bytes)
            style = "-" if not variant.startswith("raw-") else ":"
            width = 2.5 if variant == "mcrdl" else 1.5
            line, = ax.plot([r.bytes for r in rs], [r.max_us for r in rs], style, marker="o", markersize=3,
                            linewidth=width, label=variant, color=colors.get(variant))
            colors[variant] = line.get_color()
        sizes = sorted({r.bytes for rs in by_variant.values() for r in rs})
        if OP_CLASS[op] in table_rules:
            rules = next(iter(table_rules[OP_CLASS[op]].values()))
            low = sizes[0] / 1.5
            for rule in rules:
                high = rule["max_bytes"] * 1.41 if rule["max_bytes"] is not None else sizes[-1] * 1.5
                ax.axvspan(low, high, color=colors.get(rule["backend"], "grey"), alpha=0.12)
                ax.text((low * high) ** 0.5, 0.97, rule["backend"], transform=ax.get_xaxis_transform(),
                        ha="center", va="top", fontsize=8)
                low = high
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(sizes[::max(1, len(sizes) // 6)])
        ax.set_xticklabels([human(t) for t in sizes[::max(1, len(sizes) // 6)]], fontsize=8)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("latency (us, slowest rank)")
        ax.set_title(op)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(by_op):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 0.98) if title else None)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
