#!/usr/bin/env bash
# A latency benchmark on this tree and on commit REV, alternated in pairs (REV
# checked out in a temporary worktree, run with this tree's .venv and this
# tree's benchmark script): tells a slow phase of the machine from a change in
# the code.
#   bash benchmarks/percall/latency_vs_commit.sh REV [PAIRS=3] [SIZES=4,1K]
#   BENCH=percall/hotpath.py NP=4 bash benchmarks/percall/latency_vs_commit.sh REV 2 4,4K
# ARGS: more arguments for the benchmark; KEEP: a regex of the output lines to keep
# (default: the lines of allreduce_latency.py's results).
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD rev=$1 pairs=${2:-3} sizes=${3:-4,1K} bench=${BENCH:-percall/allreduce_latency.py} np=${NP:-2}
old=$(mktemp -d)/tree
git worktree add -q --detach "$old" "$rev"
trap 'git worktree remove --force "$old"' EXIT
for i in $(seq "$pairs"); do
  for tree in "$old" "$root"; do
    if [ "$tree" = "$root" ]; then label="this tree"; else label=$rev; fi
    echo "== pair $i: $label"
    (cd "$tree" && PYTHONPATH="$tree/src" "$root/.venv/bin/python" -m mcrdl.cli run -n "$np" \
        "$root/benchmarks/$bench" --sizes "$sizes" --rounds 3 ${ARGS:-} 2>&1 | grep -E "${KEEP:-^\[}")
  done
done
