"""DeepSpeed MoE (expert parallel over all ranks) trained with deepspeed.initialize on CPU.

    DS_ACCELERATOR=cpu mcrdl run -n 2 examples/frameworks/deepspeed_moe.py --backend mcrdl [--k 2]

Only DeepSpeed's and torch's public API; the backend is the one word passed to
deepspeed.init_distributed. Rank 0 prints one final JSON line (``RESULT {...}``)
with the per-step losses and step times.
"""
import argparse
import json
import os
import random
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np
import torch
import torch.nn as nn

import deepspeed
from deepspeed.moe.layer import MoE

HIDDEN, TOKENS, MICRO_BATCH = 16, 8, 4


class Net(nn.Module):
    """Linear -> MoE (one expert MLP per rank, or more) -> Linear."""

    def __init__(self, num_experts, ep_size, k):
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.ReLU(), nn.Linear(2 * HIDDEN, HIDDEN))
        self.moe = MoE(HIDDEN, expert, num_experts=num_experts, ep_size=ep_size, k=k, min_capacity=2)
        self.out = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h, l_aux, _ = self.moe(torch.relu(self.inp(x)))
        return self.out(h), l_aux


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="mcrdl", help="torch.distributed backend (gloo | mcrdl)")
    p.add_argument("--k", type=int, choices=(1, 2), default=1, help="top-k gating")
    p.add_argument("--experts-per-rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher (unused)")
    args = p.parse_args()

    deepspeed.init_distributed(dist_backend=args.backend)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    model = Net(args.experts_per_rank * world, ep_size=world, k=args.k)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "steps_per_print": 10**6}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    target = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(args.seed))
    losses, times = [], []
    for step in range(args.steps):
        x = torch.randn(MICRO_BATCH, TOKENS, HIDDEN,
                        generator=torch.Generator().manual_seed(1000 * step + rank))
        t0 = time.perf_counter()
        out, l_aux = engine(x)
        loss = nn.functional.mse_loss(out, torch.tanh(x @ target)) + 0.01 * l_aux
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if rank == 0:
        print("RESULT " + json.dumps({"example": f"deepspeed_moe_top{args.k}", "backend": torch.distributed.get_backend(),
                                      "world": world, "losses": losses, "step_times": times}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
