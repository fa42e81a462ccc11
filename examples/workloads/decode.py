"""The decode workload (docs/workloads.md):

    mcrdl run -n 2 examples/workloads/decode.py --mode tuned --table T.json
    mcrdl run -n 2 examples/workloads/decode.py --mode baseline-gloo,baseline-mpi,coarse,tuned --rounds 2

Options: --help. The model, the data and the modes are in src/mcrdl/tools/workloads/decode.py.
"""
import sys

from mcrdl.tools.workloads.decode import main

sys.exit(main())
