"""Unit tests for mcrdl.selector (pure Python, fake backends, no MPI)."""
import pytest
import torch

import mcrdl
from mcrdl.backends.base import Backend
from mcrdl.selector import Selector, parse_op_backends
from mcrdl.tuning import FORMAT, OP_CLASS, TuningTable

KNOWN = ["mpi", "nccl", "gloo"]


class FakeMPI(Backend):
    name = "mpi"
    devices = frozenset({"cpu"})

    def unsupported(self, op, dtype, reduce_op, device):
        if dtype == torch.bfloat16:
            return f"MPI backend has no datatype for {dtype}"
        return None


class FakeGloo(Backend):
    name = "gloo"
    devices = frozenset({"cpu", "cuda"})


class FakeNCCL(Backend):
    name = "nccl"
    devices = frozenset({"cuda"})


def live(*names):
    classes = {"mpi": FakeMPI, "gloo": FakeGloo, "nccl": FakeNCCL}
    return {n: classes[n](ctx=None) for n in names}   # Backend.__init__(self, ctx)


ALL = ("mpi", "gloo", "nccl")

# all_reduce, size 2: <=1024 mpi, <=65536 gloo, beyond nccl
# all_to_all, size 2: always gloo (one backend); size 4: <=512 mpi, beyond gloo
# p2p, size 2: <=100 gloo, beyond mpi
TABLE = {
    "format": FORMAT,
    "rules": {"cpu": {
        "all_reduce": {"2": [{"max_bytes": 1024, "backend": "mpi"},
                             {"max_bytes": 65536, "backend": "gloo"},
                             {"max_bytes": None, "backend": "nccl"}]},
        "all_to_all": {"2": [{"max_bytes": None, "backend": "gloo"}],
                       "4": [{"max_bytes": 512, "backend": "mpi"},
                             {"max_bytes": None, "backend": "gloo"}]},
        "p2p": {"2": [{"max_bytes": 100, "backend": "gloo"},
                      {"max_bytes": None, "backend": "mpi"}]},
    }},
}
TABLE["rules"]["cuda"] = {"all_reduce": TABLE["rules"]["cpu"]["all_reduce"]}  # the same ranges for CUDA tensors


def tbl(live_names=KNOWN, doc=TABLE, source="<table>"):
    return TuningTable.from_dict(doc, KNOWN, live_names, source=source)


F32 = torch.float32
BF16 = torch.bfloat16


def sel(names=ALL, default="mpi", static=None, table=None):
    return Selector(live(*names), default, static, table)


def test_fake_backends_construct():
    b = live("mpi")["mpi"]
    assert isinstance(b, Backend) and b.ctx is None
    assert b.unsupported("all_reduce", BF16, None, "cpu") and b.unsupported("all_reduce", F32, None, "cpu") is None


# -- precedence -------------------------------------------------------------------------------
def test_default_when_nothing_else_decides():
    s = sel(default="gloo")
    assert s.choose("all_reduce", 10, 2, "cpu", F32) == "gloo"
    assert s.explain("all_reduce", 10, 2) == ("gloo", "default backend")


def test_table_beats_default():
    s = sel(default="gloo", table=tbl())
    assert s.choose("all_reduce", 1024, 2, "cpu", F32) == "mpi"
    assert s.choose("all_reduce", 1025, 2, "cpu", F32) == "gloo"
    assert s.choose("all_reduce", 10**6, 2, "cuda", F32) == "nccl"
    # op not in the table: default
    assert s.choose("broadcast", 10, 2, "cpu", F32) == "gloo"


def test_static_beats_table():
    s = sel(default="mpi", static={"all_reduce": "gloo"}, table=tbl())
    assert s.choose("all_reduce", 10, 2, "cpu", F32) == "gloo"     # table says mpi
    assert s.explain("all_reduce", 10, 2) == ("gloo", "static map: all_reduce -> gloo")


def test_explicit_beats_static_and_table():
    s = sel(default="mpi", static={"all_reduce": "gloo"}, table=tbl())
    assert s.choose("all_reduce", 10, 2, "cpu", F32, explicit="mpi") == "mpi"
    assert s.choose("all_reduce", 10**6, 2, "cuda", F32, explicit="gloo") == "gloo"
    assert s.explain("all_reduce", 10, 2, explicit="mpi") == ("mpi", "backend= given on the call")


def test_full_precedence_chain():
    s = sel(default="nccl", static={"broadcast": "gloo"}, table=tbl())
    # explicit
    assert s.choose("broadcast", 10, 2, "cuda", F32, explicit="nccl") == "nccl"
    # static (broadcast is not in the table)
    assert s.choose("broadcast", 10, 2, "cuda", F32) == "gloo"
    # table
    assert s.choose("all_reduce", 10**6, 2, "cuda", F32) == "nccl"
    assert s.choose("all_reduce", 2000, 2, "cuda", F32) == "gloo"
    # default
    assert s.choose("reduce", 10, 2, "cuda", F32) == "nccl"


# -- op names -> classes ----------------------------------------------------------------------
def test_static_key_api_name_applies_to_class():
    s = sel(static={"all_to_all_single": "gloo"})
    assert s.static == {"all_to_all": "gloo"}
    assert s.choose("all_to_all", 10, 2, "cpu", F32) == "gloo"
    assert s.choose("all_to_all_single", 10, 2, "cpu", F32) == "gloo"


@pytest.mark.parametrize("key", ["send", "recv", "isend", "irecv", "batch_isend_irecv", "p2p"])
def test_p2p_names_share_one_static_entry(key):
    s = sel(default="mpi", static={key: "gloo"})
    for op in ("send", "recv", "isend", "irecv", "batch_isend_irecv", "p2p"):
        assert s.choose(op, 10, 2, "cpu", F32) == "gloo", op


def test_send_and_recv_use_p2p_table_rules():
    s = sel(default="nccl", table=tbl())
    for op in ("send", "recv", "isend", "irecv"):
        assert s.choose(op, 100, 2, "cpu", F32) == "gloo"
        assert s.choose(op, 101, 2, "cpu", F32) == "mpi"
    assert "p2p" in s.explain("send", 101, 2)[1]


@pytest.mark.parametrize("api, cls", [("all_gather_into_tensor", "all_gather"),
                                      ("reduce_scatter_tensor", "reduce_scatter")])
def test_variant_names(api, cls):
    s = sel(static={cls: "gloo"})
    assert s.choose(api, 10, 2, "cpu", F32) == "gloo"


def test_same_backend_for_two_names_of_one_class_is_fine():
    s = sel(static={"send": "gloo", "recv": "gloo", "all_to_all": "mpi", "all_to_all_single": "mpi"})
    assert s.static == {"p2p": "gloo", "all_to_all": "mpi"}


def test_conflicting_static_entries_for_one_class_rejected():
    with pytest.raises(ValueError) as info:
        sel(static={"all_to_all": "mpi", "all_to_all_single": "gloo"})
    msg = str(info.value)
    assert "'all_to_all'" in msg and "'mpi'" in msg and "'gloo'" in msg
    with pytest.raises(ValueError, match="p2p"):
        sel(static={"send": "mpi", "recv": "gloo"})


def test_static_unknown_op_rejected():
    with pytest.raises(ValueError, match=r"unknown op 'allreduce'"):
        sel(static={"allreduce": "mpi"})


def test_static_backend_not_live_rejected():
    with pytest.raises(ValueError) as info:
        sel(names=("mpi", "gloo"), static={"all_reduce": "nccl"})
    msg = str(info.value)
    assert "'all_reduce'" in msg and "'nccl'" in msg and "not live" in msg
    with pytest.raises(ValueError, match="'ucc'"):
        sel(static={"all_reduce": "ucc"})


# -- capability ------------------------------------------------------------------------------
def test_explicit_backend_wrong_dtype_raises():
    s = sel()
    with pytest.raises(mcrdl.UnsupportedError) as info:
        s.choose("all_reduce", 10, 2, "cpu", BF16, explicit="mpi")
    msg = str(info.value)
    assert "all_reduce" in msg and "torch.bfloat16" in msg and "'mpi'" in msg
    # explain with explicit goes through the same check
    with pytest.raises(mcrdl.UnsupportedError):
        s.explain("all_reduce", 10, 2, "cpu", BF16, explicit="mpi")


def test_explicit_backend_wrong_device_raises():
    s = sel()
    with pytest.raises(mcrdl.UnsupportedError) as info:
        s.choose("broadcast", 10, 2, "cpu", F32, explicit="nccl")
    msg = str(info.value)
    assert "broadcast" in msg and "torch.float32" in msg and "'nccl'" in msg and "cpu" in msg


def test_explicit_backend_not_live_raises():
    s = sel(names=("mpi", "gloo"))
    with pytest.raises(mcrdl.UnsupportedError, match="'nccl' is not live"):
        s.choose("all_reduce", 10, 2, "cuda", F32, explicit="nccl")


def test_unsupported_error_is_comm_and_type_error():
    assert issubclass(mcrdl.UnsupportedError, mcrdl.CommError)
    assert issubclass(mcrdl.UnsupportedError, TypeError)


def test_static_choice_that_cannot_run_falls_through_to_table():
    s = sel(default="mpi", static={"all_reduce": "nccl"}, table=tbl())
    # cuda: nccl runs it
    assert s.choose("all_reduce", 10, 2, "cuda", F32) == "nccl"
    # cpu: nccl cannot; table says mpi for 10 B
    assert s.choose("all_reduce", 10, 2, "cpu", F32) == "mpi"
    name, why = s.explain("all_reduce", 10, 2, "cpu", F32)
    assert name == "mpi"
    assert why.startswith("tuning table <table>: all_reduce on cpu, group size 2, 10 B")
    assert "skipped nccl: backend 'nccl' does not take cpu tensors" in why


def test_table_choice_that_cannot_run_falls_through_to_default():
    s = sel(default="gloo", table=tbl())
    # 10 B -> table says mpi, but mpi refuses bfloat16
    assert s.choose("all_reduce", 10, 2, "cpu", BF16) == "gloo"
    name, why = s.explain("all_reduce", 10, 2, "cpu", BF16)
    assert name == "gloo"
    assert why.startswith("default backend")
    assert "skipped mpi: MPI backend has no datatype for torch.bfloat16" in why


def test_default_that_cannot_run_falls_through_to_first_capable_live():
    s = sel(names=("mpi", "nccl", "gloo"), default="mpi")
    assert s.choose("all_reduce", 10, 2, "cpu", BF16) == "gloo"          # mpi: dtype, nccl: device
    name, why = s.explain("all_reduce", 10, 2, "cpu", BF16)
    assert name == "gloo"
    assert why.startswith("first live backend able to run it")
    assert "skipped mpi" in why and "skipped nccl" in why
    assert s.choose("all_reduce", 10, 2, "cuda", F32) == "nccl"          # registry order: mpi, nccl


def test_no_capable_backend_raises_listing_each_once():
    s = sel(names=("mpi", "nccl"), default="mpi", static={"all_reduce": "mpi"})
    with pytest.raises(mcrdl.UnsupportedError) as info:
        s.choose("all_reduce", 10, 2, "cpu", BF16)
    msg = str(info.value)
    assert "all_reduce" in msg and "no live backend can run it" in msg
    assert msg.count("mpi: MPI backend has no datatype") == 1     # static, default, first-live: once
    assert msg.count("nccl: backend 'nccl' does not take cpu tensors") == 1


def test_non_live_table_range_falls_back_to_default():
    with pytest.warns(UserWarning):
        t = tbl(live_names=["mpi", "gloo"])
    s = sel(names=("mpi", "gloo"), default="gloo", table=t)
    assert s.choose("all_reduce", 10, 2, "cpu", F32) == "mpi"
    assert s.choose("all_reduce", 10**6, 2, "cpu", F32) == "gloo"      # nccl range
    assert s.explain("all_reduce", 10**6, 2) == ("gloo", "default backend")


def test_capability_cache_keys_on_dtype_and_device():
    s = sel()
    assert s.why_not("mpi", "all_reduce", "cpu", F32) is None
    assert "bfloat16" in s.why_not("mpi", "all_reduce", "cpu", BF16)
    assert "cuda" in s.why_not("mpi", "all_reduce", "cuda", F32)
    assert s.why_not("mpi", "all_reduce", "cpu", F32) is None


# -- explain reasons -------------------------------------------------------------------------
def test_explain_names_table_rule():
    s = sel(default="gloo", table=tbl(source="tables/h100.json"))
    assert s.explain("all_reduce", 2000, 2) == \
        ("gloo", "tuning table tables/h100.json: all_reduce on cpu, group size 2, 2000 B")
    # the reason names the class, not the API op name
    assert s.explain("all_to_all_single", 10, 4) == \
        ("mpi", "tuning table tables/h100.json: all_to_all on cpu, group size 4, 10 B")


def test_explain_matches_choose():
    s = sel(default="gloo", static={"broadcast": "mpi"}, table=tbl())
    for op in ("all_reduce", "broadcast", "reduce", "all_to_all", "send"):
        for n in (0, 100, 101, 512, 513, 1024, 1025, 10**6):
            for dev, dt in (("cpu", F32), ("cpu", BF16), ("cuda", F32)):
                assert s.explain(op, n, 4, dev, dt)[0] == s.choose(op, n, 4, dev, dt), (op, n, dev, dt)


# -- needs_agreement ---------------------------------------------------------------------------
def test_needs_agreement_all_to_all_multi_backend_table():
    s = sel(table=tbl())
    assert s.needs_agreement("all_to_all", 4, None)
    assert s.needs_agreement("all_to_all_single", 4, None)
    assert s.needs_agreement("all_to_all", 8, None)           # falls back to the size-4 rules


def test_needs_agreement_false_cases():
    t = tbl()
    assert not sel().needs_agreement("all_to_all", 4, None)                     # no table
    assert not sel(table=t).needs_agreement("all_to_all", 2, None)              # one backend at size 2
    assert not sel(table=t).needs_agreement("all_to_all", 3, None)              # size 3 -> size 2 rules
    assert not sel(table=t).needs_agreement("all_to_all", 4, "mpi")             # explicit
    assert not sel(table=t, static={"all_to_all_single": "gloo"}).needs_agreement("all_to_all", 4, None)
    assert not sel(table=t, static={"all_to_all": "gloo"}).needs_agreement("all_to_all_single", 4, None)


def test_needs_agreement_only_for_all_to_all():
    s = sel(table=tbl())
    assert not s.needs_agreement("all_reduce", 2, None)   # 3 backends at size 2, sizes rank-invariant


# -- parse_op_backends -------------------------------------------------------------------------
@pytest.mark.parametrize("spec, expected", [
    ("all_to_all:mpi,all_reduce:gloo", {"all_to_all": "mpi", "all_reduce": "gloo"}),
    (" all_to_all : mpi , all_reduce:gloo ", {"all_to_all": "mpi", "all_reduce": "gloo"}),
    ("send:gloo,", {"send": "gloo"}),
    (",,", {}),
    ("", {}),
])
def test_parse_op_backends_good(spec, expected):
    assert parse_op_backends(spec) == expected


@pytest.mark.parametrize("spec", ["all_to_all", "all_to_all=mpi", ":mpi", "all_to_all:", " : ",
                                  "all_reduce:gloo,broadcast"])
def test_parse_op_backends_bad(spec):
    with pytest.raises(ValueError, match="MCRDL_OP_BACKENDS: .* is not op:backend"):
        parse_op_backends(spec)


def test_parse_op_backends_feeds_selector():
    s = sel(static=parse_op_backends("all_to_all_single:gloo,send:mpi"))
    assert s.static == {"all_to_all": "gloo", "p2p": "mpi"}


def test_parse_op_backends_duplicate_op_rejected():
    with pytest.raises(ValueError):
        parse_op_backends("all_reduce:mpi,all_reduce:gloo")


def test_op_class_covers_selector_ops():
    s = sel()
    for op in OP_CLASS:
        assert s.choose(op, 10, 2, "cpu", F32) == "mpi"


def test_table_rules_are_per_device():
    """Each device type has its own rules; a device without rules for the op
    goes to the default, and a v1 table's rules are the cpu rules only."""
    doc = {"format": FORMAT, "rules": {
        "cpu": {"all_reduce": {"2": [{"max_bytes": None, "backend": "mpi"}]}},
        "cuda": {"all_reduce": {"2": [{"max_bytes": 4096, "backend": "gloo"}, {"max_bytes": None, "backend": "nccl"}]},
                 "all_to_all": {"2": [{"max_bytes": 64, "backend": "gloo"}, {"max_bytes": None, "backend": "nccl"}]}}}}
    s = sel(default="gloo", table=tbl(doc=doc))
    assert s.choose("all_reduce", 8192, 2, "cpu", F32) == "mpi"
    assert s.choose("all_reduce", 8192, 2, "cuda", F32) == "nccl"
    assert s.choose("all_reduce", 64, 2, "cuda", F32) == "gloo"
    assert s.choose("broadcast", 8192, 2, "cuda", F32) == "gloo"  # no cuda rule: the default
    assert s.explain("all_reduce", 8192, 2, "cuda")[1].startswith("tuning table <table>: all_reduce on cuda")
    # all-to-all agrees on its size only where that device's rules use more than one backend
    assert not s.needs_agreement("all_to_all_single", 2, None, "cpu")
    assert s.needs_agreement("all_to_all_single", 2, None, "cuda")
    v1 = {"format": "mcrdl-tuning/1", "rules": doc["rules"]["cuda"]}
    s = sel(default="mpi", table=tbl(doc=v1))
    assert s.choose("all_reduce", 8192, 2, "cpu", F32) == "mpi"  # its rule names nccl: no cpu tensors there
    assert s.explain("all_reduce", 64, 2, "cpu") == ("gloo", "tuning table <table>: all_reduce on cpu, group "
                                                             "size 2, 64 B")
    assert s.explain("all_reduce", 64, 2, "cuda") == ("gloo", "first live backend able to run it (skipped mpi: "
                                                              "backend 'mpi' does not take cuda tensors)")


def test_cuda_default_is_nccl_unless_a_default_was_named():
    """A CUDA-aware MPI takes CUDA tensors, but with no table and no named
    default, CUDA tensors go to NCCL (the runtime passes device_defaults)."""
    class AwareMPI(FakeMPI):
        devices = frozenset({"cpu", "cuda"})

    backends = {"mpi": AwareMPI(ctx=None), "nccl": FakeNCCL(ctx=None), "gloo": FakeGloo(ctx=None)}
    s = Selector(backends, "mpi", device_defaults={"cuda": "nccl"})
    assert s.choose("all_reduce", 64, 2, "cuda", F32) == "nccl"
    assert s.choose("all_reduce", 64, 2, "cpu", F32) == "mpi"
    assert s.explain("all_reduce", 64, 2, "cuda") == ("nccl", "default backend for cuda tensors")
    assert Selector(backends, "mpi").choose("all_reduce", 64, 2, "cuda", F32) == "mpi"  # a named default
    table = tbl(doc={"format": FORMAT, "rules": {"cuda": {"all_reduce": {"2": [{"max_bytes": None,
                                                                               "backend": "mpi"}]}}}})
    assert Selector(backends, "mpi", table=table, device_defaults={"cuda": "nccl"}).choose(
        "all_reduce", 64, 2, "cuda", F32) == "mpi"  # the table comes first


def test_a_barrier_runs_on_a_backend_of_any_device():
    """A barrier carries no tensor: backend="mpi_staged" (CUDA only) ran
    cuda_staged_job's barrier on a GPU machine only after this."""
    sel = Selector(live("mpi", "nccl"), "mpi")
    assert sel.choose("barrier", 0, 2, "cpu", torch.uint8, explicit="nccl") == "nccl"
    with pytest.raises(mcrdl.UnsupportedError, match="does not take cpu tensors"):
        sel.choose("all_reduce", 4, 2, "cpu", torch.float32, explicit="nccl")


def test_gloo_takes_cuda_collectives_but_not_cuda_p2p():
    """torch's gloo stages CUDA tensors for its collectives, but its sockets
    fail on device memory for send/recv (seen on a GPU): refused by name, in
    every p2p form, so the selector falls back instead of crashing the job."""
    from mcrdl.backends import REGISTRY
    from mcrdl.backends.torch_pg import GlooBackend
    gloo = GlooBackend.__new__(GlooBackend)
    for op in ("send", "recv", "isend", "irecv", "batch_isend_irecv", "p2p"):
        assert "cannot send or receive CUDA tensors" in gloo.unsupported(op, F32, None, "cuda")
        assert gloo.unsupported(op, F32, None, "cpu") is None
    for op in ("all_reduce", "reduce_scatter_tensor", "all_to_all_single", "gather"):
        assert gloo.unsupported(op, F32, None, "cuda") is None
    # without NCCL, CUDA tensors fall back to staged MPI before gloo (faster up to MiBs on a GPU)
    assert list(REGISTRY).index("mpi_staged") < list(REGISTRY).index("gloo")


def test_nccl_is_not_started_where_ranks_share_a_gpu(monkeypatch):
    """NCCL refuses two ranks on one GPU at its first op (torch: "Duplicate GPU
    detected"), and as the CUDA default it would take every op there. Ranks that
    share a GPU (same device UUID) leave it out, so CUDA tensors go to staged MPI
    or gloo; ranks that CUDA_VISIBLE_DEVICES gives one GPU each see different UUIDs."""
    from mcrdl.backends.base import Context
    from mcrdl.backends.torch_pg import NCCLBackend
    from mcrdl.runtime import shares_a_gpu
    assert shares_a_gpu(["GPU-a", "GPU-a"]) and shares_a_gpu(["GPU-a", "GPU-b", "GPU-a"])
    assert not shares_a_gpu(["GPU-a", "GPU-b"]) and not shares_a_gpu([None, None]) and not shares_a_gpu([])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    # each rank's GPU by mcrdl's convention (local rank modulo the GPUs seen); an all-zero
    # UUID (some ROCm devices) is unknown, or every rank would look like sharing one
    from types import SimpleNamespace

    from mcrdl.runtime import _gpu_id
    uuids = ["GPU-7f3a", "00000000-0000-0000-0000-000000000000"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(uuid=uuids[i]))
    assert [_gpu_id(r) for r in range(3)] == ["GPU-7f3a", None, "GPU-7f3a"]
    store = object()
    assert NCCLBackend.unavailable_reason(Context(0, 2, 10, store=store)) is None
    reason = NCCLBackend.unavailable_reason(Context(0, 2, 10, store=store, shared_gpu=True))
    assert reason == "ranks on this host share a GPU (NCCL needs one per rank)"
