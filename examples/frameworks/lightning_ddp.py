"""A small model trained with Lightning's DDP strategy on CPU, on any launcher.

    python examples/frameworks/lightning_ddp.py --backend mcrdl           # Lightning starts the ranks
    torchrun --nproc-per-node 2 examples/frameworks/lightning_ddp.py      # or torchrun does
    mcrdl run -n 2 examples/frameworks/lightning_ddp.py                   # or mpiexec

Only Lightning's and torch's public API; the backend is the one word passed to
``DDPStrategy(process_group_backend=...)``. Run as a plain script with ``--devices
2``, Lightning's own launcher starts the other rank (it runs this script again with
its environment). Rank 0 prints one final JSON line (``RESULT {...}``) with the
per-step losses and step times (forward, backward, all-reduce, optimizer step).
"""
import argparse
import json
import os
import time
import warnings

import torch
import torch.nn as nn

import lightning as L
from lightning.pytorch.strategies import DDPStrategy

WIDTH, BATCH = 48, 8


class Regression(L.LightningModule):
    def __init__(self, seed: int):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.LayerNorm(2 * WIDTH),
                                 nn.Linear(2 * WIDTH, 2 * WIDTH + 3), nn.GELU(), nn.Linear(2 * WIDTH + 3, WIDTH))
        self.target = torch.randn(WIDTH, WIDTH, generator=torch.Generator().manual_seed(seed))
        self.losses, self.times, self._t0 = [], [], 0.0

    def training_step(self, batch, _):
        loss = nn.functional.mse_loss(self.net(batch), torch.tanh(batch @ self.target))
        self.losses.append(loss.item())
        return loss

    def on_train_batch_start(self, *_):
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, *_):  # after backward (gradients all-reduced) and the optimizer step
        self.times.append(time.perf_counter() - self._t0)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="mcrdl", help="torch.distributed backend (gloo | mcrdl)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
                   help="ranks on this host (default: the launcher's LOCAL_WORLD_SIZE, else 2)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", ".*does not have many workers.*")  # a tiny in-memory data set

    L.seed_everything(args.seed, verbose=False)
    data = torch.randn(args.steps * BATCH * 8, WIDTH, generator=torch.Generator().manual_seed(args.seed))
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    model = Regression(args.seed)
    trainer = L.Trainer(accelerator="cpu", devices=args.devices,
                        strategy=DDPStrategy(process_group_backend=args.backend),
                        max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(model, loader)
    if trainer.global_rank == 0:
        print("RESULT " + json.dumps({"example": "lightning_ddp", "backend": args.backend,
                                      "world": trainer.world_size, "launcher": type(trainer.strategy.cluster_environment).__name__,
                                      "losses": model.losses, "step_times": model.times}), flush=True)


if __name__ == "__main__":
    main()
