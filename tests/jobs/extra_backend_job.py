"""A backend added by one module is selectable by backend=, static map and table."""
import runpy
import sys
from pathlib import Path

import torch

import mcrdl
import verdicts  # noqa: F401  (an exception that ends a rank is a failed check)
from mcrdl.backends.torch_pg import GlooBackend


@mcrdl.register_backend
class SecondGloo(GlooBackend):
    """A second, independent gloo instance (its own process groups)."""
    name = "gloo2"


table = {"format": "mcrdl-tuning/1", "rules": {"all_reduce": {"2": [
    {"max_bytes": 1024, "backend": "mpi"}, {"max_bytes": None, "backend": "gloo2"}]}}}
mcrdl.init_process_group(op_backends={"all_to_all": "gloo2"}, tuning_table=table)
assert mcrdl.available_backends()["gloo2"] == "live"
rank = mcrdl.get_rank()
t = torch.ones(1000)
w = mcrdl.all_reduce(t, async_op=True)
w.wait()
assert w.backend == "gloo2" and torch.all(t == 2), (w.backend, t)
inp = torch.arange(4.0)
out = torch.empty(4)
w = mcrdl.all_to_all_single(out, inp, async_op=True)
w.wait()
assert w.backend == "gloo2"
mcrdl.destroy_process_group()
print(f"rank {rank}: gloo2 selected by table and static map")
# the whole op matrix on the new backend
sys.argv = [str(Path(__file__).parent / "ops_job.py"), "gloo2"]
runpy.run_path(sys.argv[0], run_name="__main__")
