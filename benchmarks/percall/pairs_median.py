"""Median over pairs of the table lines (hotpath.py, layers.py) that
latency_vs_commit.sh keeps (KEEP='│'): one markdown row per op, each cell
"REV → this tree" for every ratio in the first table's cell (hotpath: back to
back, barrier between), per size; then how many cells fell. ``--spread`` adds this
tree's lowest and highest ratio over the pairs to each cell. ``--added``
(layers.py's torch table, cells "R (torch / API; torch alone)"): each cell as
the median µs of torch on "mcrdl", of the API, and what the torch layer adds
over torch alone plus the API (per pair, then the median).

    BENCH=percall/hotpath.py KEEP='│' bash benchmarks/percall/latency_vs_commit.sh REV 5 4,1K > out.txt
    python benchmarks/percall/pairs_median.py out.txt [--spread | --added]
"""
from __future__ import annotations

import collections
import re
import statistics
import sys


def medians(path: str, added: bool = False) -> dict:
    """{(op, cell index, tree label): [ratio per pair]} (``added``: [(torch, API, added) per pair])"""
    found, tree, seen = collections.defaultdict(list), None, set()
    with open(path) as f:
        for line in f:
            pair = re.match(r"== pair \d+: (.*)", line)
            if pair:
                tree, seen = pair.group(1).strip(), set()
            elif line.startswith("│"):
                op, *cells = [c.strip() for c in line.strip().strip("│").split("│")]
                if op in seen:  # (a later table of the same run: hotpath's over the floor)
                    continue
                seen.add(op)
                if added:
                    for i, c in enumerate(cells):
                        torch, api, alone = map(float, re.search(r"\(([\d.]+) / ([\d.]+); ([\d.]+)\)", c).groups())
                        found[(op, i, tree)].append((torch, api, torch - api - alone))
                    continue
                ratios = [float(v) for c in cells for v in re.findall(r"(\d+(?:\.\d+)?)x", c)]
                for i, r in enumerate(ratios):
                    found[(op, i, tree)].append(r)
    return found


def added_table(found: dict, before: str, after: str) -> None:
    """One row per op: torch µs, API µs and the layer's addition, before → after."""
    for op in dict.fromkeys(k[0] for k in found):
        cells = []
        for i in range(1 + max(k[1] for k in found if k[0] == op)):
            (ta, aa, xa), (tb, ab, xb) = ([statistics.median(v[j] for v in found[(op, i, t)]) for j in range(3)]
                                          for t in (before, after))
            cells.append(f"{ta:.1f} → **{tb:.1f}** (API {aa:.1f} → {ab:.1f}; added {xa:.1f} → **{xb:.1f}**)")
        print(f"| {op} | " + " | ".join(cells) + " |")


def main(path: str, spread: bool = False, added: bool = False) -> None:
    found = medians(path, added)
    before, after = sorted({k[2] for k in found}, key=lambda t: t == "this tree")
    if added:
        return added_table(found, before, after)
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
    main(sys.argv[1], "--spread" in sys.argv[2:], "--added" in sys.argv[2:])
