"""Tensor fusion and compression: real 2- and 4-rank jobs, plus local unit tests
(bucket plan, buffer pool, compressor round trips) that need no MPI."""
import threading

import pytest
import torch

from conftest import run_job
from mcrdl import UnsupportedError
from mcrdl.features import fusion
from mcrdl.features.compression import (BF16Compressor, FP16Compressor, Int8Compressor,
                                        NoneCompressor, _pack_payload, _unpack_payload,
                                        all_reduce_wire_bytes)
from mcrdl.features.fusion import (BufferPool, get_bucket_bytes, parse_bytes, plan_buckets,
                                   set_bucket_bytes)

F64 = torch.float64
SLACK = 2.0 ** -20


# -- multi-rank jobs --------------------------------------------------------------------------
@pytest.mark.parametrize("nprocs", [2, 4])
def test_fusion_job(nprocs):
    out = run_job(nprocs, "fusion_job.py", timeout=300)
    out.require(["fusion finished"], range(nprocs))


@pytest.mark.parametrize("nprocs", [2, 4])
def test_compression_job(nprocs):
    out = run_job(nprocs, "compression_job.py", timeout=300)
    out.require(["compression finished"], range(nprocs))
    assert "error feedback Int8Compressor" in out


# -- bucket plan -------------------------------------------------------------------------------
def test_plan_groups_by_dtype_in_order_and_caps_buckets():
    ts = [torch.ones(10), torch.ones(10, dtype=torch.float16), torch.ones(20), torch.ones(0),
          torch.ones(1000), torch.ones(5, dtype=torch.float16), torch.ones(16)]
    plan = plan_buckets(ts, 128)  # 128 B = 32 float32
    assert [(b.dtype, b.index) for b in plan] == [
        (torch.float32, [0, 2]),          # 40 + 80 B
        (torch.float16, [1, 5]),          # 20 + 10 B
        (torch.float32, [4]),             # 4000 B > cap: alone, direct
        (torch.float32, [6]),             # 120 + 64 > 128: new bucket
    ]
    assert plan[2].direct and plan[3].direct and not plan[0].direct
    assert all(b.nbytes <= 128 or b.direct for b in plan)
    assert all(3 not in b.index for b in plan)  # zero-element tensors are skipped


def test_plan_factor_counts_gathered_bytes():
    ts = [torch.ones(8), torch.ones(8)]  # 32 B each
    assert [b.index for b in plan_buckets(ts, 128)] == [[0, 1]]
    assert [b.index for b in plan_buckets(ts, 128, factor=4)] == [[0], [1]]  # 128 B each gathered


def test_plan_is_a_pure_function_of_shapes():
    a = [torch.randn(n) for n in (3, 300, 7, 70000, 1)]
    b = [torch.zeros(n) for n in (3, 300, 7, 70000, 1)]
    assert [x.index for x in plan_buckets(a, 4096)] == [x.index for x in plan_buckets(b, 4096)]


def test_bucket_bytes_setting(monkeypatch):
    assert parse_bytes("25M") == 25 << 20 and parse_bytes("64K") == 65536
    assert parse_bytes("4096") == 4096 and parse_bytes("1.5KiB") == 1536
    with pytest.raises(ValueError, match="byte count"):
        parse_bytes("lots")
    monkeypatch.delenv("MCRDL_FUSION_BUCKET_BYTES", raising=False)
    set_bucket_bytes(None)
    assert get_bucket_bytes() == 25 * 1024 * 1024
    monkeypatch.setenv("MCRDL_FUSION_BUCKET_BYTES", "1M")
    assert get_bucket_bytes() == 1 << 20
    set_bucket_bytes("4K")
    try:
        assert get_bucket_bytes() == 4096
        with pytest.raises(ValueError):
            set_bucket_bytes(0)
    finally:
        set_bucket_bytes(None)
    monkeypatch.setenv("MCRDL_FUSION_BUCKET_BYTES", "-3")
    with pytest.raises(ValueError, match="MCRDL_FUSION_BUCKET_BYTES"):
        get_bucket_bytes()


# -- buffer pool -------------------------------------------------------------------------------
def test_pool_reuses_released_buffers_only():
    pool = BufferPool(max_bytes=1 << 20)
    a = pool.acquire(torch.float32, torch.device("cpu"), 100)
    b = pool.acquire(torch.float32, torch.device("cpu"), 100)  # a is lent: never shared
    assert a is not b and a.data_ptr() != b.data_ptr()
    pool.release(a)
    c = pool.acquire(torch.float32, torch.device("cpu"), 100)
    assert c is a
    d = pool.acquire(torch.float16, torch.device("cpu"), 100)  # other key: new
    assert d is not b
    assert pool.stats()["hits"] == 1 and pool.stats()["misses"] == 3
    assert {id(x) for x in pool.lent()} == {id(b), id(c), id(d)}
    pool.release(a)
    pool.release(a)  # twice: ignored
    assert pool.stats()["free_buffers"] == 1


def test_pool_is_bounded_lru():
    pool = BufferPool(max_bytes=1000)
    bufs = [pool.acquire(torch.uint8, torch.device("cpu"), 400) for _ in range(3)]
    for b in bufs:
        pool.release(b)
    assert pool.stats()["free_bytes"] == 800
    assert [id(b) for b in pool.cached()] == [id(bufs[1]), id(bufs[2])]  # oldest evicted
    big = pool.acquire(torch.uint8, torch.device("cpu"), 2000)
    pool.release(big)  # larger than the bound: not kept
    assert all(b is not big for b in pool.cached())
    pool.clear()
    assert pool.stats()["free_buffers"] == 0


def test_pool_threaded_release():
    pool = BufferPool(max_bytes=1 << 24)
    lent = [pool.acquire(torch.float32, torch.device("cpu"), 64) for _ in range(200)]
    threads = [threading.Thread(target=lambda part=lent[i::4]: [pool.release(b) for b in part])
               for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert pool.stats()["free_buffers"] == 200 and not pool.lent()


def test_module_pool_accessor():
    assert fusion.fusion_buffer_pool() is fusion._POOL


# -- compressors, locally -----------------------------------------------------------------------
def _x(numel, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + numel)
    x = torch.randn(numel, generator=g, dtype=F64)
    mag = 10.0 ** ((torch.arange(numel) // 13 % 7) - 3).to(F64)
    return (x * mag).to(dtype)


def _scales(x, chunk):
    x = x.to(F64).reshape(-1)
    s = torch.stack([x[i:i + chunk].abs().max() for i in range(0, x.numel(), chunk)]) / 127
    return s.to(torch.float32).to(F64).repeat_interleave(chunk)[:x.numel()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel", [1, 2, 255, 256, 257, 5000])
@pytest.mark.parametrize("comp", [FP16Compressor(), BF16Compressor(), Int8Compressor(),
                                  Int8Compressor(chunk_size=7), NoneCompressor()], ids=repr)
def test_round_trip_within_bound(comp, numel, dtype):
    x = _x(numel, dtype)
    payload, ctx = comp.compress(x)
    y = comp.decompress(payload, ctx)
    assert y.shape == x.shape and y.dtype == x.dtype
    xd = x.to(F64)
    err = (y.to(F64) - xd).abs()
    out_round = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}.get(dtype, 0.0) * xd.abs() * 2
    if isinstance(comp, (FP16Compressor, BF16Compressor)):
        bound = comp.unit_roundoff * xd.abs() + comp.underflow + out_round
    elif isinstance(comp, Int8Compressor):
        s = _scales(x, comp.chunk_size)
        bound = s / 2 + SLACK * (s + xd.abs()) + out_round
        assert payload[0].dtype == torch.int8 and payload[1].dtype == torch.float32
        assert payload[1].numel() == -(-numel // comp.chunk_size)
        assert int(payload[0].abs().max()) <= 127
    else:
        bound = torch.zeros_like(xd)
    assert bool((err <= bound).all()), (float(err.max()), float(bound.max()))
    # the payload size is what payload_nbytes says (packed for the wire)
    wire = _pack_payload(payload) if len(payload) > 1 else payload[0]
    assert wire.numel() * wire.element_size() == comp.payload_nbytes(numel, dtype)


def test_compress_does_not_alias_or_modify_input():
    x = _x(100, torch.float16)
    keep = x.clone()
    for comp in (FP16Compressor(), BF16Compressor(), Int8Compressor(), FP16Compressor(error_feedback=True)):
        payload, _ = comp.compress(x, key="a")
        payload[0].zero_()
        assert torch.equal(x, keep), comp


def test_int8_edge_cases():
    comp = Int8Compressor(chunk_size=4)
    z = torch.zeros(10)
    p, ctx = comp.compress(z)
    assert torch.equal(comp.decompress(p, ctx), z) and torch.equal(p[1], torch.zeros(3))
    e = torch.empty(0)
    p, ctx = comp.compress(e)
    assert comp.decompress(p, ctx).numel() == 0
    x = torch.tensor([[1.0, -2.0, 3.0], [127.0, 0.5, -0.25]]).t()  # non-contiguous
    p, ctx = comp.compress(x)
    y = comp.decompress(p, ctx)
    assert y.shape == x.shape and torch.allclose(y, x, atol=float(_scales(x.reshape(-1), 4).max()) / 2)
    with pytest.raises(ValueError, match="chunk_size"):
        Int8Compressor(chunk_size=0)
    with pytest.raises(UnsupportedError, match="torch.int64"):
        comp.compress(torch.ones(3, dtype=torch.int64))
    with pytest.raises(UnsupportedError, match="torch.bool"):
        FP16Compressor().compress(torch.ones(3, dtype=torch.bool))
    with pytest.raises(UnsupportedError, match="torch.int32"):
        Int8Compressor(error_feedback=True).compress(torch.ones(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="lossy"):
        NoneCompressor(error_feedback=True)


def test_decompress_sum_and_summable_payloads():
    xs = [_x(300, seed=s) for s in range(3)]
    comp = Int8Compressor(chunk_size=32)
    parts = [comp.compress(x) for x in xs]
    total = comp.decompress_sum([p for p, _ in parts], parts[0][1])
    ref = sum(comp.decompress(p, c).to(F64) for p, c in parts)
    assert torch.allclose(total.to(F64), ref, rtol=1e-6, atol=1e-6)
    # fp16: the elementwise sum of payloads decompresses to ~ the sum of inputs
    f = FP16Compressor()
    ps = [f.compress(x)[0][0] for x in xs]
    s = f.decompress([ps[0] + ps[1] + ps[2]], f.compress(xs[0])[1]).to(F64)
    exact = sum(x.to(F64) for x in xs)
    gamma = 3 * 2.0 ** -11 / (1 - 3 * 2.0 ** -11)
    assert bool(((s - exact).abs() <= gamma * sum(x.to(F64).abs() for x in xs) + 3 * 2.0 ** -25).all())


def test_error_feedback_telescopes():
    """sum_t decompress(compress(x)) = T x - e_T: the accumulated error stays one residual."""
    x = _x(1000)
    comp = Int8Compressor(chunk_size=64, error_feedback=True)
    plain = Int8Compressor(chunk_size=64)
    T = 30
    acc = torch.zeros(1000, dtype=F64)
    for _ in range(T):
        p, c = comp.compress(x.clone(), key="g")
        acc += comp.decompress(p, c).to(F64)
    res = comp.residual("g").to(F64)
    assert torch.allclose(acc + res, T * x.to(F64), rtol=0, atol=1e-3)
    ef_err = ((acc / T) - x.to(F64)).abs().max()
    p, c = plain.compress(x)
    plain_err = (plain.decompress(p, c).to(F64) - x.to(F64)).abs().max()
    assert ef_err * 10 < plain_err
    # default key: the tensor's storage; reset drops it
    t = x.clone()
    comp.compress(t)
    assert comp.residual(t) is not None
    comp.reset(t)
    assert comp.residual(t) is None and comp.residual("g") is not None
    comp.reset()
    assert comp.residual("g") is None
    comp.compress(torch.ones(4), key="k")
    with pytest.raises(ValueError, match="reset"):
        comp.compress(torch.ones(5), key="k")


def test_pack_unpack_alignment():
    q = torch.arange(13, dtype=torch.int8)
    s = torch.tensor([1.5, -2.0], dtype=torch.float32)
    buf = _pack_payload([q, s])
    assert buf.numel() == 16 + 8
    two = torch.cat([buf, buf])
    for r in range(2):
        q2, s2 = _unpack_payload(two[r * 24:(r + 1) * 24], [q, s])
        assert torch.equal(q2, q) and torch.equal(s2, s)


def test_wire_bytes_model():
    n = 1 << 20
    none = all_reduce_wire_bytes(NoneCompressor(), n, torch.float32, 2)
    assert none["sent_bytes"] == 4 * n and none["ratio"] == 1.0
    fp16 = all_reduce_wire_bytes(FP16Compressor(), n, torch.float32, 4)
    assert fp16["ratio"] == 0.5 and fp16["collective"] == "all_reduce"
    i8 = all_reduce_wire_bytes(Int8Compressor(chunk_size=256), n, torch.float32, 2)
    assert i8["payload_bytes"] == n + 4 * (n // 256)
    assert i8["sent_bytes"] == i8["payload_bytes"] and abs(i8["ratio"] - (n + n / 64) / (4 * n)) < 1e-12
    # all-gather based: no saving from 8 ranks on (vs a float32 ring all-reduce)
    assert all_reduce_wire_bytes(Int8Compressor(), n, torch.float32, 8)["ratio"] > 1.0
    assert all_reduce_wire_bytes(Int8Compressor(), n, torch.float32, 6)["ratio"] < 1.0
