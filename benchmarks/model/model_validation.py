"""Issue 7: `mcrdl model` predictions vs logged runs of the repo's Megatron-TP
and MoE workloads on 2 local ranks, several runs each
(docs/results/model_validation.md):

    .venv/bin/python benchmarks/model/model_validation.py [--runs 8] [--steps 10] [--warmup 2] [--calibrate 10] [--bench FILE ...]

The model is calibrated from bench sweeps, or from the job's own calls
(issue 16, item 6), never from the steps it is compared with. Unless ``--bench`` names recorded ones, a cold sweep (``mcrdl bench
--cold``: compute, then the call, timed as the logger times it; docs/bench.md)
of all_reduce, all_to_all and all_to_allv on MPI is recorded right before each
run, to out/record/model_validation/model_cold-sweep-2ranks-K.json. Each run logs
``--steps`` steps after ``--warmup`` unlogged ones and ``--calibrate``
logged apart (examples/model/log_workload.py). Every run is compared with
``mcrdl model --compare-log`` under these calibrations: its own sweep (taken
a minute before, in the same phase of a machine whose speed drifts), the
median of every sweep per size (``--bench`` repeated), the back-to-back tune
sweep docs/results/tune-sweep-2ranks.json, and that sweep corrected by the
job's own calls (``--calibrate-log``): the run's calibration steps ("own
steps", logged just before the compared ones) or the previous run's compared
steps ("previous run"). Backends come from
docs/results/tuning-2ranks.json. During each sweep and logged run it also
measures the CPU time other processes took (all busy CPU time minus the
run's own): runs with others above 5 % of the CPUs are reported apart.
Writes out/record/model_validation/model_validation.txt (every comparison table) and
docs/results/model_validation.json
(per op, run and calibration: the prediction, the logged and
arrival-corrected time, the diffs, others' CPU share; per-workload totals).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.path.join(ROOT, ".venv", "bin")
RES = os.path.join(ROOT, "docs", "results")
TABLE = "docs/results/tuning-2ranks.json"
WARM = "docs/results/tune-sweep-2ranks.json"
RAW = os.path.join(ROOT, "out", "record", "model_validation")  # the raw data: cold sweeps, every table
COLD = "out/record/model_validation/model_cold-sweep-2ranks-{}.json"
SWEEP = ["bench", "-n", "2", "--cold", "--ops", "all_reduce,all_to_all,all_to_allv", "--variants", "mpi",
         "--max-bytes", "1M", "--json"]
CALIBRATIONS = {"own sweep": "the run's own cold sweep",
                "own steps": f"{WARM} corrected by the run's --calibrate steps before the measured ones",
                "previous run": f"{WARM} corrected by the previous run's measured steps (run 1: the last run)"}
QUIET = 0.05  # others' share of the CPUs below which a run counts as quiet


def busy_s() -> float:
    """CPU seconds spent busy by the whole machine so far."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def others_share(run) -> float:
    """Share of the CPUs that processes other than ``run()``'s took while it ran."""
    b0, c0, t0 = busy_s(), children_s(), time.monotonic()
    run()
    return max(busy_s() - b0 - (children_s() - c0), 0.0) / ((time.monotonic() - t0) * os.cpu_count())


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--calibrate", type=int, default=10, metavar="K",
                   help="steps logged before the measured ones, to calibrate from (0: none)")
    p.add_argument("--bench", action="append", help="recorded cold sweep(s) to calibrate from "
                   f"(default: record one before each run, {COLD.format('K')})")
    a = p.parse_args()
    if a.runs < 1:
        p.error("need --runs >= 1")
    cmd = (f"python benchmarks/model/model_validation.py --runs {a.runs} --steps {a.steps} --warmup {a.warmup}"
           f" --calibrate {a.calibrate}"
           + "".join(f" --bench {b}" for b in a.bench or ()))
    sweeps, sweep_others = list(a.bench or []), []
    logs = []
    os.makedirs(RAW, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        for i in range(1, a.runs + 1):  # record: a sweep, then the logged runs
            if not a.bench:
                out = COLD.format(i)
                share = others_share(lambda: subprocess.run([f"{BIN}/mcrdl", *SWEEP, out], cwd=ROOT,
                                                            check=True, capture_output=True))
                sweeps.append(out)
                sweep_others.append(share)
                print(f"$ mcrdl {' '.join(SWEEP)} {out}: other processes used {share * 100:.0f}% of the CPUs",
                      flush=True)
            for w in ("megatron", "moe"):
                log = os.path.join(work, f"{w}-{i}")
                env = {**os.environ, "MCRDL_COMMS_LOG": "1", "MCRDL_COMMS_LOG_DIR": log}
                others = others_share(lambda: subprocess.run(
                    [f"{BIN}/mcrdl", "run", "-n", "2", "examples/model/log_workload.py", w, "--steps",
                     str(a.steps), "--warmup", str(a.warmup), "--calibrate", str(a.calibrate), "--table", TABLE],
                    cwd=ROOT, env=env, check=True, capture_output=True))
                print(f"== run {i} {w}: other processes used {others * 100:.0f}% of the CPUs", flush=True)
                logs.append((i, w, log, others))
        bench = lambda files: [x for b in files for x in ("--bench", b)]
        calibrations = {"all sweeps": lambda i, w: bench(sweeps), "back-to-back": lambda i, w: bench([WARM])}
        if not a.bench:
            calibrations = {"own sweep": lambda i, w: bench([sweeps[i - 1]]), **calibrations}
        if a.calibrate:  # the job's own calls: its earlier steps, or the previous run's measured steps
            calibrations["own steps"] = lambda i, w: [*bench([WARM]), "--calibrate-log",
                                                      os.path.join(work, f"{w}-{i}", "calibration")]
        if a.runs > 1:
            calibrations["previous run"] = lambda i, w: [*bench([WARM]), "--calibrate-log",
                                                         os.path.join(work, f"{w}-{i - 1 or a.runs}")]
        ops: dict = {}
        text = []
        for i, w, log, others in logs:  # compare: every run against every calibration
            text.append(f"== run {i} {w}: other processes used {others * 100:.0f}% of the CPUs")
            for calib, args_of in calibrations.items():
                args = args_of(i, w)
                out = f"{log}-model-{calib.replace(' ', '-')}"
                rep = subprocess.run([f"{BIN}/mcrdl", "model", f"examples/model/workload_{w}.json",
                                      "--compare-log", log, "--log-iterations", str(a.steps),
                                      *args, "--table", TABLE,
                                      "--out", out], cwd=ROOT, check=True, capture_output=True,
                                     text=True).stdout
                text += [f"-- calibration ({calib}): {' '.join(args).replace(work, 'LOGS')}",
                         rep[rep.index("prediction vs logged run"):].split("\nwritten:")[0]]
                with open(os.path.join(out, "model.json")) as f:
                    for r in json.load(f)["compare"]:
                        o = ops.setdefault(f"{w} {r['dim']} {r['op']}", {"count": r["meas_count"], "runs": {}})
                        run = o["runs"].setdefault(i, {"others_cpu": others, "logged_s": r["meas_s"],
                                                       "comm_s": r["meas_comm_s"], "pred_s": {},
                                                       "diff_pct": {}, "diff_logged_pct": {}})
                        run["pred_s"][calib] = r["pred_s"]
                        run["diff_pct"][calib] = r["diff_time_pct"]
                        run["diff_logged_pct"][calib] = r["diff_logged_time_pct"]
    for o in ops.values():
        o["runs"] = list(o["runs"].values())
    totals = {}  # workload -> per run: predicted and measured communication time over all its ops
    for w in ("megatron", "moe"):
        mine = [o for k, o in ops.items() if k.startswith(w + " ")]
        runs = []
        for j in range(a.runs):
            comm = sum(o["runs"][j]["comm_s"] for o in mine)
            pred = {c: sum(o["runs"][j]["pred_s"][c] for o in mine) for c in calibrations}
            runs.append({"others_cpu": mine[0]["runs"][j]["others_cpu"], "comm_s": comm, "pred_s": pred,
                         "diff_pct": {c: (pred[c] - comm) / comm * 100 for c in calibrations}})
        totals[w] = {"runs": runs}
    with open(os.path.join(RAW, "model_validation.txt"), "w") as f:
        f.write("\n".join(text) + "\n")
    with open(os.path.join(RES, "model_validation.json"), "w") as f:
        json.dump({"command": cmd, "calibrations": {c: CALIBRATIONS.get(c) or " ".join(f(1, "W"))
                                                    for c, f in calibrations.items()},
                   "sweeps": sweeps, "sweeps_others_cpu": sweep_others, "quiet_below_others_cpu": QUIET,
                   "ops": ops, "totals": totals}, f, indent=1)
        f.write("\n")
    print(f"\n{cmd}\nper op over {a.steps} steps: comm = arrival-corrected; median [min, max] over the "
          f"quiet runs (others < {QUIET * 100:.0f}% of the CPUs), then over all runs")
    spread = lambda xs, f: f"{f(statistics.median(xs))} [{f(min(xs))}, {f(max(xs))}]"
    ms, pct = (lambda v: f"{v * 1e3:.3f} ms"), (lambda v: f"{v:+.1f}%")
    for k, o in [*ops.items(), *((f"{w} total", t) for w, t in totals.items())]:
        for name, runs in (("quiet", [r for r in o["runs"] if r["others_cpu"] < QUIET]), ("all", o["runs"])):
            if not runs:
                print(f"{k:24s} {name:5s} no runs")
                continue
            print(f"{k:24s} {name:5s} {len(runs)} runs: comm {spread([r['comm_s'] for r in runs], ms)}"
                  + (f", logged {ms(statistics.median(r['logged_s'] for r in runs))}" if "logged_s" in runs[0] else ""))
            for calib in calibrations:
                print(f"{'':30s} {calib:12s} pred {spread([r['pred_s'][calib] for r in runs], ms)}, "
                      f"diff {spread([r['diff_pct'][calib] for r in runs], pct)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
