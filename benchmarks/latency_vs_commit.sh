#!/usr/bin/env bash
# all_reduce latency of this tree and of commit REV, alternated in pairs (REV
# checked out in a temporary worktree, run with this tree's .venv): tells a slow
# phase of the machine from a regression in the code.
#   bash benchmarks/latency_vs_commit.sh REV [PAIRS=3] [SIZES=4,1K]
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD rev=$1 pairs=${2:-3} sizes=${3:-4,1K}
old=$(mktemp -d)/tree
git worktree add -q --detach "$old" "$rev"
trap 'git worktree remove --force "$old"' EXIT
for i in $(seq "$pairs"); do
  for tree in "$old" "$root"; do
    if [ "$tree" = "$root" ]; then label="this tree"; else label=$rev; fi
    echo "== pair $i: $label"
    (cd "$tree" && PYTHONPATH="$tree/src" "$root/.venv/bin/python" -m mcrdl.cli run -n 2 \
        benchmarks/allreduce_latency.py --sizes "$sizes" --rounds 3 | grep -E '^\[')
  done
done
