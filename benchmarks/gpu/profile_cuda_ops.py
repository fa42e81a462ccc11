"""Where mcrdl's CUDA op path spends host time, one rank on one GPU: the
cost of each way to ask for the current stream (median µs), then cProfile of
mcrdl.all_reduce on 4 bytes over NCCL (blocking; async, ten in flight on one
tensor) and over mpi_staged (blocking).

    mcrdl run -n 1 python3 benchmarks/gpu/profile_cuda_ops.py"""
import cProfile
import io
import pstats
import statistics
import time

import torch

import mcrdl

mcrdl.init_process_group(timeout=120)
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
x = torch.ones(1, device=dev)
current = torch.cuda.current_stream()


def cost(call, n=3000) -> float:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e6


queries = {
    "torch.cuda.current_stream(dev)": lambda: torch.cuda.current_stream(dev),
    "torch.cuda.current_stream()": torch.cuda.current_stream,
    "torch.cuda.current_stream(0)": lambda: torch.cuda.current_stream(0),
    "torch._C._cuda_getCurrentStream(0)": lambda: torch._C._cuda_getCurrentStream(0),
    "torch.accelerator.current_stream(0)": lambda: torch.accelerator.current_stream(0),
    "x.device": lambda: x.device,
    "x.is_cuda": lambda: x.is_cuda,
    "x.get_device()": x.get_device,
    "stream == stream": lambda: current == current,
    "torch.cuda.current_device()": torch.cuda.current_device,
}
for name, call in queries.items():
    print(f"{cost(call):7.2f} µs  {name}", flush=True)


def profile(title: str, call, reps: int) -> None:
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(reps):
        call()
    prof.disable()
    torch.cuda.synchronize()
    report = io.StringIO()
    pstats.Stats(prof, stream=report).sort_stats("tottime").print_stats(28)
    print(f"==== {title}: {(time.perf_counter() - start) / reps * 1e6:.1f} µs per call under cProfile")
    print(report.getvalue()[-6000:], flush=True)


def ten_async() -> None:
    for work in [mcrdl.all_reduce(x, backend="nccl", async_op=True) for _ in range(10)]:
        work.wait()


profile("nccl sync", lambda: mcrdl.all_reduce(x, backend="nccl"), 3000)
profile("nccl async x10", ten_async, 300)
profile("mpi_staged sync", lambda: mcrdl.all_reduce(x, backend="mpi_staged"), 1000)
mcrdl.destroy_process_group()
