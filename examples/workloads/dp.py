"""The dp workload (docs/workloads.md):

    mcrdl run -n 2 examples/workloads/dp.py --mode tuned --table T.json
    mcrdl run -n 2 examples/workloads/dp.py --mode baseline-gloo,baseline-mpi,coarse,tuned --rounds 2

Options: --help. The model, the data and the modes are in src/mcrdl/tools/workloads/dp.py.
"""
import sys

from mcrdl.tools.workloads.dp import main

sys.exit(main())
