"""Prints, from rank 0, the libraries live for CPU tensors in this job (conftest.cpu_libraries)."""
import mcrdl

mcrdl.init_process_group()
if mcrdl.get_rank() == 0:
    print("live on cpu:", ",".join(mcrdl.live_backends("cpu")), flush=True)
mcrdl.destroy_process_group()
