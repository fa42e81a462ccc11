#!/usr/bin/env bash
# Issue 7: `mcrdl model` predictions vs logged runs of the repo's Megatron-TP
# and MoE workloads on 2 local ranks, RUNS times each (docs/results/model_validation.md).
# Writes docs/results/model_validation.{txt,json}: every comparison table and,
# per op, the prediction and each run's logged and arrival-corrected time.
#   bash benchmarks/model_validation.sh [RUNS=5] [STEPS=10] [WARMUP=2]
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5} STEPS=${2:-10} WARMUP=${3:-2}
BIN=.venv/bin
RES=docs/results
BENCH=$RES/tune-sweep-2ranks.json TABLE=$RES/tuning-2ranks.json
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
: > "$RES/model_validation.txt"
for i in $(seq "$RUNS"); do
  for w in megatron moe; do
    d=$WORK/$w-$i
    echo "== run $i $w ($(cut -d' ' -f1-3 /proc/loadavg) load before)" | tee -a "$RES/model_validation.txt"
    MCRDL_COMMS_LOG=1 MCRDL_COMMS_LOG_DIR=$d/log $BIN/mcrdl run -n 2 examples/model/log_workload.py "$w" \
      --steps "$STEPS" --warmup "$WARMUP" --table "$TABLE" > "$d.out" 2>&1 || { cat "$d.out"; exit 1; }
    $BIN/mcrdl model "examples/model/workload_$w.json" --compare-log "$d/log" --log-iterations "$STEPS" \
      --bench "$BENCH" --table "$TABLE" --out "$d/model" | sed -n '/prediction vs logged run/,$p' \
      | tee -a "$RES/model_validation.txt"
  done
done
$BIN/python - "$WORK" "$RUNS" "$STEPS" "$WARMUP" "$RES/model_validation.json" <<'EOF'
import json, statistics, sys
work, runs, steps, warmup, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
ops = {}
for w in ("megatron", "moe"):
    for i in range(1, runs + 1):
        for r in json.load(open(f"{work}/{w}-{i}/model/model.json"))["compare"]:
            o = ops.setdefault(f"{w} {r['dim']} {r['op']}", {"pred_s": r["pred_s"], "count": r["meas_count"],
                                                            "logged_s": [], "comm_s": [], "diff_pct": []})
            o["logged_s"].append(r["meas_s"])
            o["comm_s"].append(r["meas_comm_s"])
            o["diff_pct"].append(r["diff_time_pct"])
cmd = f"bash benchmarks/model_validation.sh {runs} {steps} {warmup}"
json.dump({"command": cmd, "runs": runs, "steps": steps, "warmup": warmup, "ops": ops}, open(out, "w"), indent=1)
print(f"\n{cmd}: per op, {steps} steps; median [min, max] over {runs} runs")
print(f"{'op':28s} {'pred':>9s} {'comm meas':>9s} {'diff %':>22s} {'logged':>9s}")
for k, o in ops.items():
    d = o["diff_pct"]
    print(f"{k:28s} {o['pred_s'] * 1e3:7.3f}ms {statistics.median(o['comm_s']) * 1e3:7.3f}ms "
          f"{statistics.median(d):+7.1f} [{min(d):+6.1f}, {max(d):+6.1f}] {statistics.median(o['logged_s']) * 1e3:7.3f}ms")
EOF
