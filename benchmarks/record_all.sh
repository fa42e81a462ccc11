#!/usr/bin/env bash
# Re-run every recorded measurement in docs/results/ (2 local ranks, one after
# the other), group by group as benchmarks/README.md lists them. Run on a quiet
# machine: `bash benchmarks/record_all.sh`. (Not here: the multi-host sweep, which
# needs root, `bash benchmarks/tuning/multihost_record.sh`; the GPU session,
# `bash benchmarks/gpu/session.sh`; Open MPI, docs/results/openmpi.md.)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
OUT=docs/results   # the pages and the machine-readable files they cite
LOG=out/record     # what each command prints, for updating its page (not kept in git)
mkdir -p "$OUT" "$LOG"
run() { echo "+ $*" | tee -a "$LOG/commands.txt"; "$@"; }
: > "$LOG/commands.txt"

# percall: what one call costs against the raw libraries
run $BIN/mcrdl run -n 2 benchmarks/percall/allreduce_latency.py --json $OUT/allreduce_latency.json | tee $LOG/allreduce_latency.txt
run $BIN/mcrdl run -n 2 benchmarks/percall/hotpath.py --json $OUT/hotpath.json | tee $LOG/hotpath.txt
run $BIN/mcrdl run -n 2 benchmarks/percall/async_inflight.py --sizes 4,1K,16K,256K \
    --json $OUT/async_inflight.json | tee $LOG/async_inflight.txt
run $BIN/mcrdl run -n 2 benchmarks/percall/drivers.py --json $OUT/drivers.json | tee $LOG/drivers.txt
run $BIN/mcrdl run -n 2 benchmarks/percall/blocking_floor.py --sizes 4,1K,16K,256K --rounds 5 \
    --json $OUT/blocking_floor.json | tee $LOG/blocking_floor.txt
run $BIN/mcrdl run -n 2 benchmarks/percall/layers.py --rounds 9 --json $OUT/layers.json | tee $LOG/layers.txt
run $BIN/mcrdl run -n 2 benchmarks/percall/selection_overhead.py --json $OUT/selection_overhead.json | tee $LOG/selection_overhead.txt
run $BIN/mcrdl run -n 2 benchmarks/percall/observer_cost.py --blocks 20 --record $OUT/observer_cost
run $BIN/mcrdl run -n 2 benchmarks/percall/cold_calls.py --rounds 7 --calls 30 --json $OUT/cold_calls.json | tee $LOG/cold_calls.txt
run $BIN/python benchmarks/percall/binding.py --repeats 3 --json $OUT/binding.json | tee $LOG/binding.txt

# tuning: the offline sweep, the table it picks, autotune in the job
run $BIN/mcrdl tune -n 2 --out $OUT/tuning-2ranks.json --results $OUT/tune-sweep-2ranks.json \
    --plot $OUT/tune-2ranks.png | tee $LOG/tune-2ranks.txt
run $BIN/mcrdl bench -n 2 --table $OUT/tuning-2ranks.json --check --step 2 --rounds 9 \
    --json $OUT/bench-2ranks.json --plot $OUT/bench-2ranks.png | tee $LOG/bench-2ranks.txt
run $BIN/mcrdl bench -n 2 --bind core --table $OUT/tuning-2ranks.json --check --step 2 --rounds 9 \
    --json $OUT/bench-2ranks-pinned.json | tee $LOG/bench-2ranks-pinned.txt
run $BIN/python benchmarks/tuning/autotune.py --rounds 5 --steps 10 | tee $LOG/autotune.txt
run $BIN/python benchmarks/tuning/autotune_trial.py --runs 8 --rounds 4 --warmup 30 | tee $LOG/autotune_trial.txt
run $BIN/python benchmarks/tuning/drift.py --out $OUT/drift.json | tee $LOG/drift.txt

# features: what fusion and compression gain or cost
run $BIN/mcrdl run -n 2 benchmarks/features/fusion.py --json $OUT/fusion.json | tee $LOG/fusion.txt
run $BIN/mcrdl run -n 2 benchmarks/features/compression.py --json $OUT/compression.json | tee $LOG/compression.txt

# workloads: end to end, the demo's workloads and real frameworks
run $BIN/mcrdl demo | tee $LOG/demo.txt
cp out/demo/demo.png $OUT/demo.png
run $BIN/python benchmarks/workloads/frameworks_steptime.py --rounds 3 | tee $LOG/frameworks.txt

# model: `mcrdl model` against logged runs (writes $OUT/model_validation.* itself)
run $BIN/python benchmarks/model/model_validation.py --runs 8 --steps 10 --warmup 2 --calibrate 10

# faults: lost ranks, endings, soak
run $BIN/python -m pytest -s -v -p no:cacheprovider tests/test_faults.py | tee $LOG/faults.txt
run $BIN/python benchmarks/faults/faults_frameworks.py
run $BIN/python benchmarks/faults/gloo_exit_abort.py --runs 20 | tee $LOG/gloo_exit_abort.txt
run $BIN/python benchmarks/faults/soak.py --jobs 512 --load 1
run $BIN/python -m pytest -q -p no:cacheprovider --hypothesis-show-statistics tests/test_fuzz.py | tee $LOG/fuzz.txt
