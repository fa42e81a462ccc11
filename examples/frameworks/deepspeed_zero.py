"""A small dense model trained under DeepSpeed ZeRO stage 1, 2 or 3 on CPU.

    DS_ACCELERATOR=cpu mcrdl run -n 2 examples/frameworks/deepspeed_zero.py --backend mcrdl --stage 3

Only DeepSpeed's and torch's public API; the backend is the one word passed to
deepspeed.init_distributed. Small buckets and no stage-3 persistence threshold,
so that gradients go in several reduce buckets and every stage-3 parameter is
partitioned and gathered. Rank 0 prints one final JSON line (``RESULT {...}``)
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

WIDTH, MICRO_BATCH = 48, 8


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="mcrdl", help="torch.distributed backend (gloo | mcrdl)")
    p.add_argument("--stage", type=int, choices=(1, 2, 3), default=2, help="ZeRO stage")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--local_rank", type=int, default=-1, help="set by the deepspeed launcher (unused)")
    args = p.parse_args()

    deepspeed.init_distributed(dist_backend=args.backend)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    model = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.LayerNorm(2 * WIDTH),
                          nn.Linear(2 * WIDTH, 2 * WIDTH + 3), nn.GELU(), nn.Linear(2 * WIDTH + 3, WIDTH))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
        "steps_per_print": 10**6, "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": args.stage, "reduce_bucket_size": 4096,
                              "allgather_bucket_size": 4096, "stage3_param_persistence_threshold": 0,
                              "stage3_prefetch_bucket_size": 4096, "stage3_max_live_parameters": 8192},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    target = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(args.seed))
    losses, times = [], []
    for step in range(args.steps):
        x = torch.randn(MICRO_BATCH, WIDTH, generator=torch.Generator().manual_seed(1000 * step + rank))
        t0 = time.perf_counter()
        loss = nn.functional.mse_loss(engine(x), torch.tanh(x @ target))
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    if rank == 0:
        print("RESULT " + json.dumps({"example": f"deepspeed_zero{args.stage}",
                                      "backend": torch.distributed.get_backend(), "world": world,
                                      "losses": losses, "step_times": times}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
