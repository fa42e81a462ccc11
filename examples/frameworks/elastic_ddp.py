"""DDP that survives a lost rank: a checkpoint (torch.distributed.checkpoint)
after every step, and a resume from the last one when torchrun's elastic
agent restarts the job.

    torchrun --nproc-per-node=2 --max-restarts=1 examples/frameworks/elastic_ddp.py \\
        --backend mcrdl --ckpt /tmp/ckpt --kill-at 3

``--kill-at S``: in the first attempt, rank 1 SIGKILLs itself in the middle of
step S (after its forward pass), as a crashed node would. torchrun tears the
job down and starts it again; every rank loads the last checkpoint and goes on.
Only torch's public API; the backend is the one word passed to
init_process_group. Rank 0 prints ``LOSS step value`` per step and one final
``RESULT {...}`` line with the losses of this attempt's steps.
"""
import argparse
import json
import os
import signal

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

WIDTH, BATCH = 32, 8


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="mcrdl", help="torch.distributed backend (gloo | mcrdl)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ckpt", required=True, help="checkpoint directory (one subdirectory per step)")
    p.add_argument("--kill-at", type=int, default=-1, help="first attempt: rank 1 dies in this step")
    args = p.parse_args()

    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(1234)
    model = DDP(nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    done = sorted(int(d) for d in os.listdir(args.ckpt) if d.isdigit()) if os.path.isdir(args.ckpt) else []
    start = 0
    if done:  # every rank reads the same, last complete checkpoint
        model_state, optim_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optim_state}
        dcp.load(state, checkpoint_id=os.path.join(args.ckpt, str(done[-1])))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = done[-1] + 1
        if rank == 0:
            print(f"attempt {attempt}: resumed after step {done[-1]}", flush=True)

    target = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(7))
    losses = {}
    for step in range(start, args.steps):
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1000 * step + rank))
        loss = nn.functional.mse_loss(model(x), x @ target)
        if attempt == 0 and step == args.kill_at and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        reduced = loss.detach().clone()
        dist.all_reduce(reduced)
        losses[step] = reduced.item() / world
        model_state, optim_state = get_state_dict(model, optimizer)
        path = os.path.join(args.ckpt, f"{step}.partial")
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
        dist.barrier()
        if rank == 0:  # complete on every rank: now it may be resumed from
            os.rename(path, os.path.join(args.ckpt, str(step)))
            print(f"LOSS {step} {losses[step]!r}", flush=True)
    if rank == 0:
        print("RESULT " + json.dumps({"backend": args.backend, "world": world, "attempt": attempt,
                                      "losses": losses}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
