"""The tools above the runtime: ``mcrdl bench`` (bench.py, plots.py), ``mcrdl tune``
(tune.py: the sweep that writes a tuning table, which mcrdl.tuning reads), ``mcrdl
demo`` (demo.py) and its DL workloads (workloads/), and ``mcrdl model`` (model/)."""
