"""Deterministic inputs and local references shared by the test jobs."""
import time

import torch

import verdicts

FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
DTYPES = FLOATS + (torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool)


def value(rank, numel, dtype, for_product=False, salt=0):
    """Small integers (exact in every dtype and in their sums/products)."""
    base = torch.arange(numel, dtype=torch.int64) + rank + salt
    v = base % 2 + 1 if for_product else base % 5 + 1
    if dtype == torch.bool:
        return (base % 2 == 0)
    return v.to(dtype)


def reduced(ranks, numel, dtype, op, salt=0):
    """Reference result of reducing value(r, ...) over ``ranks`` with ``op``."""
    vals = [value(r, numel, dtype, op == "product", salt).to(torch.float64) for r in ranks]
    stack = torch.stack(vals) if vals else torch.zeros(0)
    if dtype == torch.bool:
        if op in ("sum", "max"):
            return stack.amax(0).bool() if numel else torch.zeros(0, dtype=torch.bool)
        return stack.amin(0).bool() if numel else torch.zeros(0, dtype=torch.bool)
    out = {"sum": lambda: stack.sum(0), "product": lambda: stack.prod(0),
           "min": lambda: stack.amin(0) if numel else stack.sum(0),
           "max": lambda: stack.amax(0) if numel else stack.sum(0),
           "avg": lambda: stack.sum(0) / len(ranks)}[op]()
    return out.to(dtype)


def check(cond, *msg):
    """Stop the job unless ``cond``: a failed verdict named by ``msg``'s first part
    (its tag), the rest as what was got."""
    if not cond:
        name, got = (str(msg[0]), " ".join(map(str, msg[1:]))) if msg else ("check", None)
        verdicts.record(name, False, "true", got)
        raise verdicts.CheckFailed(" ".join(map(str, msg)))


class Lands:
    """Stands for a CUDA event (no GPU here): complete after ``polls``
    queries; ``fails``: its query raises, as a CUDA error would."""
    not_yet = 0  # queries answered "not complete" (deferred starts)

    def __init__(self, polls, fails=False):
        self.left, self.fails = polls, fails

    def query(self):
        if self.fails:
            raise RuntimeError("the copy to the host failed")
        self.left -= 1
        Lands.not_yet += self.left >= 0
        return self.left < 0


class LandsAt:
    """Stands for a CUDA event that completes at monotonic time ``at``."""

    def __init__(self, at):
        self.at = at

    def query(self):
        return time.monotonic() >= self.at
