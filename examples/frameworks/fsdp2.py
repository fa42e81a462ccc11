"""FSDP2 (``fully_shard``) over a 1-D CPU device mesh, a few training steps.

    mcrdl run -n 2 examples/frameworks/fsdp2.py --backend mcrdl

Only torch's public API; the backend is the one word passed to
init_process_group. Every block and the root are sharded, so each step
all-gathers parameters and reduce-scatters gradients. Rank 0 prints one final
JSON line (``RESULT {...}``) with the per-step losses and step times.
"""
import argparse
import json
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

WIDTH, BLOCKS, BATCH = 32, 3, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH + 1)
        self.down = nn.Linear(2 * WIDTH + 1, WIDTH)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="mcrdl", help="torch.distributed backend (gloo | mcrdl)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234)
    args = p.parse_args()

    dist.init_process_group(backend=args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Sequential(*(Block() for _ in range(BLOCKS)), nn.Linear(WIDTH, WIDTH))
    for block in model[:BLOCKS]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    target = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(args.seed))
    losses, times = [], []
    for step in range(args.steps):
        x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(1000 * step + rank))
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), torch.tanh(x @ target))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if rank == 0:
        print("RESULT " + json.dumps({"example": "fsdp2", "backend": dist.get_backend(), "world": world,
                                      "losses": losses, "step_times": times}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
