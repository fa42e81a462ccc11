"""The ddp workload (docs/workloads.md):

    mcrdl run -n 2 examples/workloads/ddp.py --mode tuned --table T.json
    mcrdl run -n 2 examples/workloads/ddp.py --mode baseline-gloo,baseline-mpi,coarse,tuned --rounds 2

Options: --help. The model, the data and the modes are in src/mcrdl/tools/workloads/ddp.py.
"""
import sys

from mcrdl.tools.workloads.ddp import main

sys.exit(main())
