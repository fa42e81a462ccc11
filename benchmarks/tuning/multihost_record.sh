#!/usr/bin/env bash
# Record the multi-host figures in out/record/multihost/ (docs/results/multihost.md cites them): the same tune + bench
# sweep on 2 ranks on one host, on 2 namespace hosts (veth + bridge, TCP), and on
# 2 namespace hosts limited to 1 Gbit/s each (tc tbf). Needs root (network
# namespaces, tests/multihost/netns.py). Run from anywhere: bash benchmarks/tuning/multihost_record.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
BIN=.venv/bin
OUT=out/record/multihost
mkdir -p "$OUT"
SIZES=4,256,4K,64K,1M,4M
BENCH_OPS=all_reduce,broadcast,all_gather,all_to_all,p2p
ROUNDS=9   # more than the default 5: the 2-core machine is shared and noisy
: > "$OUT/multihost-commands.txt"
run() { echo "+ $*" | tee -a "$OUT/multihost-commands.txt"; "$@"; }
NETNS=($BIN/python -m tests.multihost.netns run -n 2)

for setting in 1host 2hosts 2hosts-1gbit; do
  case $setting in
    1host)        launch=($BIN/mcrdl run -n 2 --) ;;
    2hosts)       launch=("${NETNS[@]}" --) ;;
    2hosts-1gbit) launch=("${NETNS[@]}" --rate 1gbit --) ;;
  esac
  { echo "# $(date -u +%FT%TZ) load average: $(cut -d' ' -f1-3 /proc/loadavg)"
    run "${launch[@]}" -m mcrdl.cli tune --sizes $SIZES --rounds $ROUNDS \
        --out $OUT/multihost-tuning-$setting.json --results $OUT/multihost-tune-$setting.json
    run "${launch[@]}" -m mcrdl.cli bench --ops $BENCH_OPS --sizes $SIZES --rounds $ROUNDS --variants mpi,gloo,mcrdl \
        --table $OUT/multihost-tuning-$setting.json --check --json $OUT/multihost-bench-$setting.json
  } 2>&1 | grep -v -e '━' -e 'hostname of the client socket' | tee $OUT/multihost-$setting.txt
done
run $BIN/python benchmarks/tuning/multihost_compare.py | tee $OUT/multihost-comparison.txt
