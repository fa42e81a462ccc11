"""Median over pairs of the table lines (hotpath.py, layers.py) that
latency_vs_commit.sh keeps (KEEP='│'): one markdown row per op, each cell
"REV → this tree" for every ratio in the table's cell (hotpath: back to back,
barrier between), per size; then how many cells fell. ``--spread`` adds this
tree's lowest and highest ratio over the pairs to each cell.

    BENCH=percall/hotpath.py KEEP='│' bash benchmarks/percall/latency_vs_commit.sh REV 5 4,1K > out.txt
    python benchmarks/percall/pairs_median.py out.txt [--spread]
"""
from __future__ import annotations

import collections
import re
import statistics
import sys


def medians(path: str) -> dict:
    """{(op, cell index, tree label): [ratio per pair]}"""
    found, tree = collections.defaultdict(list), None
    with open(path) as f:
        for line in f:
            pair = re.match(r"== pair \d+: (.*)", line)
            if pair:
                tree = pair.group(1).strip()
            elif line.startswith("│"):
                op, *cells = [c.strip() for c in line.strip().strip("│").split("│")]
                ratios = [float(v) for c in cells for v in re.findall(r"(\d+(?:\.\d+)?)x", c)]
                for i, r in enumerate(ratios):
                    found[(op, i, tree)].append(r)
    return found


def main(path: str, spread: bool = False) -> None:
    found = medians(path)
    before, after = sorted({k[2] for k in found}, key=lambda t: t == "this tree")
    fell = rose = 0
    changes = []
    for op in dict.fromkeys(k[0] for k in found):
        cells = []
        for i in range(1 + max(k[1] for k in found if k[0] == op)):
            a, b = (statistics.median(found[(op, i, t)]) for t in (before, after))
            mine = found[(op, i, after)]
            cells.append(f"{a:.2f} → {b:.2f}" + (f" ({min(mine):.2f}–{max(mine):.2f})" if spread else ""))
            fell, rose = fell + (b < a), rose + (b > a)
            changes.append(b / a)
        print(f"| {op} | " + " | ".join(cells) + " |")
    print(f"\n{fell} cells fell, {rose} rose; median change {statistics.median(changes):.3f}x "
          f"({before} → {after}, medians over pairs)")


if __name__ == "__main__":
    main(sys.argv[1], "--spread" in sys.argv[2:])
