"""Host-side cost of each CUDA call the staged path makes (µs per call, one
process, 4-byte tensors, median of 2000): where mpi_staged's per-op time
goes beyond the copies themselves. ``python3 benchmarks/gpu/cuda_call_costs.py``"""
import statistics
import time

import torch

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
x = torch.ones(1, device=dev)
host = torch.ones(1).pin_memory()
side = torch.cuda.Stream(dev)
main = torch.cuda.current_stream(dev)
event = torch.cuda.Event()
event.record(main)
torch.cuda.synchronize()


def cost(call, n=2000):
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        samples.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(samples) * 1e6


def in_side():
    with torch.cuda.stream(side):
        pass


calls = {
    "torch.empty(pin_memory=True)": lambda: torch.empty(1, pin_memory=True),
    "torch.cuda.current_stream(dev)": lambda: torch.cuda.current_stream(dev),
    "torch.cuda.Event()": torch.cuda.Event,
    "Event().record(stream)": lambda: torch.cuda.Event().record(main),
    "event.query() (done)": event.query,
    "side.wait_event(event)": lambda: side.wait_event(event),
    "with torch.cuda.stream(side): pass": in_side,
    "host.copy_(x, non_blocking=True)": lambda: host.copy_(x, non_blocking=True),
    "x.copy_(host, non_blocking=True)": lambda: x.copy_(host, non_blocking=True),
    "x.record_stream(side)": lambda: x.record_stream(side),
    "main.synchronize() (idle)": main.synchronize,
}
for name, call in calls.items():
    print(f"{cost(call):7.2f} µs  {name}", flush=True)
