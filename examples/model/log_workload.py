"""Run a repo workload's training steps and nothing else, for comparing the
logger's records with ``mcrdl model`` (docs/results/model_validation.md):

    MCRDL_COMMS_LOG=1 MCRDL_COMMS_LOG_DIR=out/log-megatron \\
        mcrdl run -n 2 examples/model/log_workload.py megatron --steps 4 \\
        --table docs/results/tuning-2ranks.json
    mcrdl model examples/model/workload_megatron.json --compare-log out/log-megatron \\
        --log-iterations 4 --bench docs/results/tune-sweep-2ranks.json --table docs/results/tuning-2ranks.json

With ``--calibrate K`` it logs K steps after the warm-up to
``$MCRDL_COMMS_LOG_DIR/calibration`` first, then the ``--steps`` measured
ones: the model calibrated from the job's own earlier calls
(``mcrdl model --calibrate-log LOG/calibration --compare-log LOG``).

The first argument names the workload (megatron, moe, ddp, dlrm); the rest are
that workload's options (``examples/workloads/<name>.py --help``). Unlike the
workload runner (src/mcrdl/tools/workloads/common.py), this initialises once, builds
the model, runs ``--warmup`` steps, drops their records (first-call costs are
not the steady state the model predicts) and runs exactly ``--steps`` steps,
so the export at ``destroy_process_group`` holds the logged steps'
collectives only: no table broadcast, barrier or result gather. With
``--table`` the selector uses that tuning table (the workloads' ``tuned``
mode), else mcrdl's defaults.
"""
import importlib
import json
import os
import sys

import torch

import mcrdl
from mcrdl.features.logger import comms_reset, export_comms
from mcrdl.tools.workloads.common import init_kwargs, parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        print("usage: log_workload.py {megatron,moe,ddp,dlrm} [workload options]", file=sys.stderr)
        return 2
    workload = importlib.import_module(f"mcrdl.tools.workloads.{argv[0]}").WORKLOAD
    p = parser(workload)
    p.add_argument("--calibrate", type=int, default=0, metavar="K",
                   help="log K steps before the measured ones to MCRDL_COMMS_LOG_DIR/calibration "
                        "(mcrdl model --calibrate-log)")
    args = p.parse_args(argv[1:])
    if args.calibrate < 0:
        p.error(f"--calibrate must be >= 0, got {args.calibrate}")
    if args.calibrate and not (os.environ.get("MCRDL_COMMS_LOG") == "1" and os.environ.get("MCRDL_COMMS_LOG_DIR")):
        p.error("--calibrate needs MCRDL_COMMS_LOG=1 and MCRDL_COMMS_LOG_DIR")
    torch.set_num_threads(args.threads)
    table = None
    if args.table:
        with open(args.table, encoding="utf-8") as f:
            table = json.load(f)
    kind = "tuned" if table is not None else "default"
    mcrdl.init_process_group(timeout=args.timeout, **init_kwargs(kind, None, workload.ops, table, None))
    try:
        workload.build(args, kind, None, 0)
        first = args.warmup + args.calibrate
        for i in range(first + args.steps):
            if i == args.warmup:
                comms_reset()
            if args.calibrate and i == first:  # each rank its records only: no pause before the next step
                export_comms(os.path.join(os.environ["MCRDL_COMMS_LOG_DIR"], "calibration"), records_only=True)
                comms_reset()
            loss = workload.step(i)
        if mcrdl.get_rank() == 0:
            print(f"[{workload.name}] {args.steps} steps logged, last loss {loss:.6f}", flush=True)
        workload.teardown()
    finally:
        mcrdl.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
