#!/usr/bin/env bash
# Re-run every recorded measurement in docs/results/ (2 local ranks, one after
# the other). Run on a quiet machine: `bash benchmarks/record_all.sh`.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
OUT=docs/results
mkdir -p "$OUT"
run() { echo "+ $*" | tee -a "$OUT/commands.txt"; "$@"; }
: > "$OUT/commands.txt"
run $BIN/mcrdl run -n 2 benchmarks/allreduce_latency.py --json $OUT/allreduce_latency.json | tee $OUT/allreduce_latency.txt
run $BIN/mcrdl run -n 2 benchmarks/hotpath.py --json $OUT/hotpath.json | tee $OUT/hotpath.txt
run $BIN/mcrdl run -n 2 benchmarks/layers.py --rounds 9 --json $OUT/layers.json | tee $OUT/layers.txt
run $BIN/mcrdl run -n 2 benchmarks/selection_overhead.py --json $OUT/selection_overhead.json | tee $OUT/selection_overhead.txt
run $BIN/mcrdl run -n 2 benchmarks/observer_cost.py --blocks 20 --record $OUT/observer_cost
run $BIN/mcrdl run -n 2 benchmarks/cold_calls.py --rounds 7 --calls 30 --json $OUT/cold_calls.json | tee $OUT/cold_calls.txt
run $BIN/mcrdl tune -n 2 --out $OUT/tuning-2ranks.json --results $OUT/tune-sweep-2ranks.json \
    --plot $OUT/tune-plots | tee $OUT/tune-2ranks.txt
run $BIN/mcrdl bench -n 2 --table $OUT/tuning-2ranks.json --check --step 2 --rounds 9 \
    --json $OUT/bench-2ranks.json --csv $OUT/bench-2ranks.csv --plot $OUT/bench-plots | tee $OUT/bench-2ranks.txt
run $BIN/mcrdl bench -n 2 --bind core --table $OUT/tuning-2ranks.json --check --step 2 --rounds 9 \
    --json $OUT/bench-2ranks-pinned.json --csv $OUT/bench-2ranks-pinned.csv | tee $OUT/bench-2ranks-pinned.txt
run $BIN/python benchmarks/binding.py --repeats 3 --json $OUT/binding.json | tee $OUT/binding.txt
if [ -f benchmarks/fusion.py ]; then
  run $BIN/mcrdl run -n 2 benchmarks/fusion.py --json $OUT/fusion.json | tee $OUT/fusion.txt
fi
if [ -f benchmarks/compression.py ]; then
  run $BIN/mcrdl run -n 2 benchmarks/compression.py --json $OUT/compression.json | tee $OUT/compression.txt
fi
run $BIN/mcrdl demo | tee $OUT/demo.txt
cp out/demo/demo.png $OUT/demo.png && cp out/demo/results.json $OUT/demo.json
run $BIN/python benchmarks/frameworks_steptime.py --rounds 3 | tee $OUT/frameworks.txt
# model_validation.py writes $OUT/model_validation.txt and .json itself; its summary goes to the terminal
run $BIN/python benchmarks/model_validation.py --runs 8 --steps 10 --warmup 2
run $BIN/python -m pytest -s -v -p no:cacheprovider tests/test_faults.py | tee $OUT/faults.txt
run $BIN/python -m pytest -q -p no:cacheprovider --hypothesis-show-statistics tests/test_fuzz.py | tee $OUT/fuzz.txt
run $BIN/python benchmarks/autotune.py --rounds 5 --steps 10 | tee $OUT/autotune.txt
run $BIN/python benchmarks/drift.py --out $OUT/drift.json | tee $OUT/drift.txt
