"""What watching a job costs: mcrdl's communication logger and flight recorder
per call and per training step, beside DeepSpeed's communication logger.

    mcrdl run -n 2 benchmarks/percall/observer_cost.py --blocks 20 --record docs/results/observer_cost

Per step, first (while the logger holds few records): DeepSpeed MoE
(examples/frameworks/deepspeed_moe.py's model, top-2) on the "mcrdl" backend,
blocks of steps in turn with nothing observing, mcrdl's logger, mcrdl's flight
recorder and DeepSpeed's comms logger (``prof_all``: it times each of
DeepSpeed's communication calls, after a device synchronize that is free on
CPU; on GPUs it waits for the device on every op), all in one job, so the
machine's drift hits every mode alike. The observers are switched by swapping
the runtime's observer; no profiler records. Then per call: a 4-byte
all_reduce on MPI with nothing observing, the logger, the flight recorder,
and both (interleaved rounds, medians of the slowest rank).
``--record PREFIX`` writes PREFIX.json and PREFIX.md.
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch
import torch.nn as nn

import deepspeed
import deepspeed.comm.comm as ds_comm

import mcrdl
from mcrdl import api
from mcrdl.features.flight_recorder import FlightRecorder
from mcrdl.features.logger import CommsLogger
from mcrdl.features.profiler import observers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "frameworks"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # benchmarks/: _record
from deepspeed_moe import HIDDEN, MICRO_BATCH, TOKENS, Net  # noqa: E402
from _record import environment, write_json  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
p.add_argument("--calls", type=int, default=4000, help="all_reduce calls per mode and round")
p.add_argument("--call-rounds", type=int, default=15)
p.add_argument("--steps", type=int, default=10, help="training steps per mode and block")
p.add_argument("--blocks", type=int, default=12, help="blocks of steps per mode")
p.add_argument("--record", help="write PREFIX.json and PREFIX.md")
args = p.parse_args()

deepspeed.init_distributed(dist_backend="mcrdl")
rt = api.current_runtime()
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
logger = CommsLogger(rank, world, lambda data: rt.control_allgather(rt.world, data))
recorder = FlightRecorder(rank, 2000, "/dev/null/never-dumped")
MODES = {"nothing": None, "mcrdl logger": logger, "mcrdl flight recorder": recorder,
         "logger + recorder": observers(logger, recorder)}


def watch(mode: str) -> None:
    rt.observer = MODES.get(mode)
    ds_comm.configure(enabled=mode == "DeepSpeed comms logger", prof_all=True)


def slowest(seconds: float) -> float:
    watch("nothing")
    t = torch.tensor([seconds], dtype=torch.float64)
    mcrdl.all_reduce(t, op=mcrdl.ReduceOp.MAX)
    return float(t)


# -- per step -----------------------------------------------------------------------------
torch.manual_seed(1234)
model = Net(world, ep_size=world, k=2)
engine, _, _, _ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
                                       config={"train_micro_batch_size_per_gpu": MICRO_BATCH,
                                               "gradient_accumulation_steps": 1, "steps_per_print": 10**6})
target = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(1))
STEP_MODES = ["nothing", "mcrdl logger", "mcrdl flight recorder", "DeepSpeed comms logger"]
per_step = {m: [] for m in STEP_MODES}
calls_per_step = {}
step = 0
for b in range(args.blocks + 1):  # block 0 warms up
    for mode in (STEP_MODES if b % 2 == 0 else STEP_MODES[::-1]):
        before = len(logger.records)
        watch(mode)
        mcrdl.barrier()
        for _ in range(args.steps):
            xb = torch.randn(MICRO_BATCH, TOKENS, HIDDEN, generator=torch.Generator().manual_seed(step * 7 + rank))
            t0 = time.perf_counter()
            out, l_aux = engine(xb)
            loss = nn.functional.mse_loss(out, torch.tanh(xb @ target)) + 0.01 * l_aux
            engine.backward(loss)
            engine.step()
            seconds = time.perf_counter() - t0
            step += 1
            if b:
                per_step[mode].append(seconds)
        if mode == "mcrdl logger":
            calls_per_step[mode] = (len(logger.records) - before) / args.steps
        slowest(0.0)  # (keeps the ranks in step between blocks)
watch("nothing")
ds_comm.configure(enabled=False)
# each rank's step times, the slowest rank's per step
for mode in STEP_MODES:
    per_step[mode] = [slowest(s) * 1e3 for s in per_step[mode]]

# -- per call -----------------------------------------------------------------------------
per_call = {m: [] for m in MODES}
x = torch.ones(1)
for r in range(args.call_rounds):
    for mode in (list(MODES) if r % 2 == 0 else list(MODES)[::-1]):
        watch(mode)
        mcrdl.barrier()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            mcrdl.all_reduce(x)
        per_call[mode].append(slowest((time.perf_counter() - t0) / args.calls) * 1e6)


if rank == 0:
    env = environment(deepspeed=deepspeed.__version__)
    base_call = statistics.median(per_call["nothing"])
    base_step = statistics.median(per_step["nothing"])
    doc = {"command": "mcrdl run -n 2 benchmarks/percall/observer_cost.py " + " ".join(sys.argv[1:]),
           "environment": env, "world": world, "calls": args.calls, "call_rounds": args.call_rounds,
           "steps": args.steps, "blocks": args.blocks,
           "per_call_us": {m: {"median": statistics.median(v), "rounds": v} for m, v in per_call.items()},
           "per_step_ms": {m: {"median": statistics.median(v), "steps": v} for m, v in per_step.items()},
           "mcrdl_calls_per_step": calls_per_step.get("mcrdl logger")}
    lines = [f"4 B all_reduce on MPI, {world} ranks, median of {args.call_rounds} rounds x {args.calls} calls:"]
    for m, v in per_call.items():
        med = statistics.median(v)
        lines.append(f"  {m:<24} {med:6.2f} us/call  ({med - base_call:+.2f} us)")
    lines.append(f"DeepSpeed MoE top-2 step on \"mcrdl\", {world} ranks, {args.blocks} blocks x {args.steps} steps per "
                 f"mode, median of the slowest rank ({doc['mcrdl_calls_per_step']:.0f} mcrdl ops per step):")
    for m, v in per_step.items():
        med = statistics.median(v)
        lines.append(f"  {m:<24} {med:7.3f} ms/step  ({(med / base_step - 1) * 100:+.1f} %)")
    text = "\n".join(lines)
    print(text, flush=True)
    if args.record:
        from rich.console import Console
        write_json(args.record + ".json", doc, Console())
        with open(args.record + ".md", "w") as f:
            f.write(f"# What watching a job costs\n\n{__doc__.strip()}\n\n"
                    f"Ran {env['date']} on {env['hostname']} ({env['cpus']} CPUs, load average at the end "
                    f"{', '.join(f'{x:.2f}' for x in env['loadavg_at_end'])}), torch {env['versions']['torch']}, "
                    f"DeepSpeed {deepspeed.__version__}.\n\n```\n{doc['command']}\n```\n\n```\n{text}\n```\n")
torch.distributed.destroy_process_group()
