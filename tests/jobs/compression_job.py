"""Compressed all-reduce / all-gather within the documented error bounds (checked
against exact references computed locally from every rank's deterministic input),
error feedback, refusals. Usage: compression_job.py"""
import torch

import mcrdl
from mcrdl.backends import OPS  # the libraries that have every op
import verdicts
from common import check
from mcrdl.features.compression import (BF16Compressor, FP16Compressor, Int8Compressor, NoneCompressor,
                                       compressed_all_gather, compressed_all_reduce)

mcrdl.init_process_group(timeout=120)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()
live = mcrdl.live_backends("cpu", ops=OPS)
count = 0
F64 = torch.float64
UNIT = {torch.float32: 2.0 ** -24, torch.float64: 2.0 ** -53, torch.float16: 2.0 ** -11,
        torch.bfloat16: 2.0 ** -8}
SLACK = 2.0 ** -20  # documented float32-arithmetic term of the int8 bound


def inp(r, numel, dtype=torch.float32, salt=0):
    """Rank r's deterministic input: normal values with magnitudes 1e-2..1e2 by chunk."""
    g = torch.Generator().manual_seed(1000 * r + 17 * salt + numel)
    x = torch.randn(numel, generator=g, dtype=F64)
    mag = 10.0 ** ((torch.arange(numel) // 37 % 5) - 2).to(F64)
    return (x * mag).to(dtype)


def int8_scales(x, chunk):
    """Documented scale: max|x_chunk| / 127 as float32, expanded to elements."""
    x = x.to(F64).reshape(-1)
    n = x.numel()
    s = torch.stack([x[i:i + chunk].abs().max() for i in range(0, n, chunk)]) / 127
    return s.to(torch.float32).to(F64).repeat_interleave(chunk)[:n]


def bound_sum(comp, xs, avg, out_dtype):
    """Documented per-element bound of |result - exact| for an all-reduce of xs."""
    n = len(xs)
    xs = [x.to(F64).reshape(-1) for x in xs]
    abs_sum = sum(x.abs() for x in xs)
    exact = sum(xs)
    if isinstance(comp, (FP16Compressor, BF16Compressor)):
        u = comp.unit_roundoff
        b = n * u / (1 - n * u) * abs_sum + n * comp.underflow
    elif isinstance(comp, Int8Compressor):
        ss = [int8_scales(x, comp.chunk_size) for x in xs]
        b = sum(s / 2 for s in ss) + n * SLACK * sum(s + x.abs() for s, x in zip(ss, xs))
    else:
        b = torch.zeros_like(exact)
    result = exact / n if avg else exact
    if avg:
        b = b / n
    # rounding of the final division / cast into the output dtype
    return b + UNIT[out_dtype] * (result.abs() + b), result


def bound_one(comp, x):
    """Per-element bound of |decompress(compress(x)) - x| (one rank)."""
    x = x.to(F64).reshape(-1)
    if isinstance(comp, (FP16Compressor, BF16Compressor)):
        return comp.unit_roundoff * x.abs() + comp.underflow
    if isinstance(comp, Int8Compressor):
        s = int8_scales(x, comp.chunk_size)
        return s / 2 + SLACK * (s + x.abs())
    return torch.zeros_like(x)


COMPRESSORS = [NoneCompressor(), FP16Compressor(), BF16Compressor(), Int8Compressor(),
               Int8Compressor(chunk_size=64), Int8Compressor(chunk_size=1)]
SIZES = (1, 100, 1000, 4097)
worst = {}

for backend in live + [None]:
    for comp in COMPRESSORS:
        cases = [(numel, torch.float32) for numel in SIZES]
        cases += [(1000, dt) for dt in (torch.float64, torch.float16, torch.bfloat16)]
        for numel, dtype in cases:
            for avg in (False, True):
                op = mcrdl.ReduceOp.AVG if avg else mcrdl.ReduceOp.SUM
                tag = f"[{backend} {comp!r} {dtype} numel={numel} avg={avg}]"
                t = inp(rank, numel, dtype)
                compressed_all_reduce(t, comp, op=op, backend=backend)
                xs = [inp(r, numel, dtype) for r in range(world)]
                b, exact = bound_sum(comp, xs, avg, dtype)
                err = (t.to(F64) - exact).abs()
                if isinstance(comp, NoneCompressor):
                    ref = inp(rank, numel, dtype)
                    mcrdl.all_reduce(ref, op=op, backend=backend)
                    check(torch.equal(t, ref), tag, "none compressor differs from all_reduce")
                else:
                    check(bool((err <= b).all()), tag, "error above the documented bound:",
                          "worst element", int((err - b).argmax()), float(err.max()), float(b.max()))
                    if numel > 1:  # it really is lossy (the bound is not vacuous)
                        check(float(err.max()) > 0, tag, "no error at all: not compressed?")
                    key = (type(comp).__name__, getattr(comp, "chunk_size", None))
                    worst[key] = max(worst.get(key, 0.0), float((err / b).max()))
                count += 1
            # all_gather, list and tensor output
            numel = 1000 if dtype != torch.float32 else numel
            x = inp(rank, numel, dtype, salt=5)
            outs = [torch.empty(numel, dtype=dtype) for _ in range(world)]
            compressed_all_gather(outs, x, comp, backend=backend)
            flat = torch.empty(world * numel, dtype=dtype)
            compressed_all_gather(flat, x, comp, backend=backend)
            for r in range(world):
                xr = inp(r, numel, dtype, salt=5)
                b = bound_one(comp, xr) + UNIT[dtype] * xr.to(F64).abs() * 2
                for o in (outs[r], flat[r * numel:(r + 1) * numel]):
                    err = (o.to(F64) - xr.to(F64)).abs()
                    check(bool((err <= b).all()), f"[{backend} {comp!r}] all_gather rank {r}",
                          float(err.max()), float(b.max()))
                count += 2
if rank == 0:
    print("worst error / bound:", {f"{k[0]}({k[1]})" if k[1] else k[0]: round(v, 3)
                                   for k, v in worst.items()})

# -- error feedback: the mean of T compressed all-reduces converges to the exact sum ----------
T, N = 40, 2000
for comp_cls, kwargs in ((Int8Compressor, {"chunk_size": 64}), (BF16Compressor, {})):
    x = inp(rank, N, salt=9)
    xs = [inp(r, N, salt=9) for r in range(world)]
    exact = sum(v.to(F64) for v in xs)
    errs = {}
    for ef in (False, True):
        comp = comp_cls(error_feedback=ef, **kwargs)
        acc = torch.zeros(N, dtype=F64)
        for step in range(T):
            t = x.clone()  # a new tensor each step: the explicit key keeps the residual
            compressed_all_reduce(t, comp, key="grad")
            acc += t.to(F64)
        errs[ef] = ((acc / T) - exact).abs()
        if ef:
            check(comp.residual("grad") is not None and comp.residual("grad").numel() == N, "residual")
    abs_sum = sum(v.to(F64).abs() for v in xs)
    if comp_cls is Int8Compressor:
        # documented: |mean - S| <= sum_r |e_r,T| / T (+ float32 noise), |e_r,T| <= ~ one call's bound
        one = bound_sum(comp_cls(**kwargs), xs, False, torch.float32)[0]
        ef_bound = 1.02 * one / T + 4 * world * SLACK * abs_sum
        check(float(errs[True].max()) * 5 < float(errs[False].max()), comp_cls.__name__,
              "EF does not reduce the accumulated error", float(errs[True].max()),
              float(errs[False].max()))
    else:
        # documented: the wire sum is rounded to bf16 again and that is not fed back:
        # |mean - S| <= γ_{n-1} (1+4u) sum_r |x_r| + 1.02 u sum_r |x_r| / T
        u = comp_cls.unit_roundoff
        gamma = (world - 1) * u / (1 - (world - 1) * u)
        ef_bound = gamma * (1 + 4 * u) * abs_sum + 1.02 * u * abs_sum / T + world * comp_cls.underflow
        check(float(errs[True].mean()) < float(errs[False].mean()), comp_cls.__name__,
              "EF does not reduce the mean error", float(errs[True].mean()), float(errs[False].mean()))
    check(bool((errs[True] <= ef_bound).all()), comp_cls.__name__, "EF mean error above bound",
          float(errs[True].max()), float(ef_bound.max()))
    if rank == 0:
        print(f"error feedback {comp_cls.__name__}: |mean of {T} - exact| max/mean "
              f"{float(errs[False].max()):.3e}/{float(errs[False].mean()):.3e} without, "
              f"{float(errs[True].max()):.3e}/{float(errs[True].mean()):.3e} with")
    count += 2
    if comp_cls is Int8Compressor:
        int8_noef = float(errs[False].max())

# default key: the same storage reduced every step
comp = Int8Compressor(chunk_size=64, error_feedback=True)
buf = torch.empty(N)
acc = torch.zeros(N, dtype=F64)
x = inp(rank, N, salt=9)
for step in range(T):
    buf.copy_(x)
    compressed_all_reduce(buf, comp)
    acc += buf.to(F64)
check(comp.residual(buf) is not None, "no residual under the storage key")
err = ((acc / T) - exact).abs()
check(float(err.max()) * 5 < int8_noef, "storage-key EF does not reduce the error", float(err.max()))
check(bool((err <= 1.02 * bound_sum(Int8Compressor(chunk_size=64), xs, False, torch.float32)[0] / T
            + 4 * world * SLACK * sum(v.to(F64).abs() for v in xs)).all()), "storage-key EF mean error")
try:
    comp.compress(torch.ones(5), key=None)  # other storage: fine
    comp.compress(torch.ones(5), key="k")
    comp.compress(torch.ones(6), key="k")
    raise AssertionError("residual size mismatch not refused")
except ValueError as exc:
    check("k" in str(exc) and "reset" in str(exc), "mismatch message", exc)
count += 3

# -- subgroup -----------------------------------------------------------------------------------
if world >= 4:
    sub = [1, 3]
    g = mcrdl.new_group(sub)
    for comp in (FP16Compressor(), Int8Compressor(chunk_size=64)):
        t = inp(rank, 500)
        compressed_all_reduce(t, comp, group=g)
        if rank in sub:
            b, exact = bound_sum(comp, [inp(r, 500) for r in sub], False, torch.float32)
            check(bool(((t.to(F64) - exact).abs() <= b).all()), "subgroup", comp)
        else:
            check(torch.equal(t, inp(rank, 500)), "non-member tensor changed")
        count += 1


# -- refusals ----------------------------------------------------------------------------------
def refuses(exc_type, words, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as exc:
        for w in words:
            check(w in str(exc), f"error {exc!r} does not mention {w!r}")
        return
    raise AssertionError(f"{fn.__name__} did not raise {exc_type.__name__}")


for comp in (FP16Compressor(), BF16Compressor(), Int8Compressor()):
    for dtype in (torch.int64, torch.int32, torch.bool):
        refuses(mcrdl.UnsupportedError, ["compressed_all_reduce", str(dtype), type(comp).__name__],
                compressed_all_reduce, torch.ones(4, dtype=dtype), comp)
        refuses(mcrdl.UnsupportedError, ["compressed_all_gather", str(dtype)],
                compressed_all_gather, [torch.ones(4, dtype=dtype)] * world, torch.ones(4, dtype=dtype), comp)
        count += 2
refuses(mcrdl.UnsupportedError, ["compressed_all_reduce", "MAX"], compressed_all_reduce,
        torch.ones(4), Int8Compressor(), op=mcrdl.ReduceOp.MAX)
refuses(TypeError, ["compressed_all_reduce", "compressor"], compressed_all_reduce, torch.ones(4), "int8")
refuses(ValueError, ["compressed_all_gather", "output"], compressed_all_gather,
        [torch.ones(4)], torch.ones(4), FP16Compressor())
# integers are fine without compression, and exact
t = torch.full((5,), rank + 1, dtype=torch.int64)
compressed_all_reduce(t, NoneCompressor())
check(torch.equal(t, torch.full((5,), world * (world + 1) // 2, dtype=torch.int64)), "none int64", t)
count += 4

mcrdl.destroy_process_group()
verdicts.finished("compression")
print(f"rank {rank}: OK {count} checks on {live + ['selected']}")
