"""Argument errors: calls before init, unknown backends, wrong sizes, bad split
sizes, wrong devices, unsupported dtype/op combinations. Each raises a clear
exception on the calling rank (type checked, message names the op and what
was wrong) before anything is sent.

In-process cases run in a 1-rank world (mpi and gloo live); ``refused()``
also spies on every live backend and fails if the refused call started any
backend operation. Cases that need two ranks run in tests/jobs/errors_job.py,
where each refused call is made on one rank only and a valid collective on
every live backend follows it on both ranks.
"""
import contextlib
import json

import numpy as np
import pytest
import torch

import mcrdl
import mcrdl.api
from mcrdl.backends.base import OPS

from conftest import run_job

NO_CUDA = not torch.cuda.is_available()


# -- helpers ------------------------------------------------------------------------------------
@contextlib.contextmanager
def refused(exc, *words):
    """The block raises ``exc`` whose message contains every one of ``words``,
    and no live backend had any operation started (control traffic included)."""
    started = []
    rt = mcrdl.api._runtime
    backends = list(rt.backends.values()) if rt is not None else []
    for b in backends:
        for name in OPS:
            real = getattr(b, name)

            def spy(*args, _b=b.name, _op=name, _real=real, **kwargs):
                started.append(f"{_b}.{_op}")
                return _real(*args, **kwargs)
            setattr(b, name, spy)
    try:
        with pytest.raises(exc) as info:
            yield info
    finally:
        for b in backends:
            for name in OPS:
                b.__dict__.pop(name, None)
    msg = str(info.value)
    missing = [w for w in words if w not in msg]
    assert not missing, f"{type(info.value).__name__} message {msg!r} does not name {missing}"
    assert not started, f"refused call started backend ops {started}: {msg!r}"


def cpu(n=4, dtype=torch.float32):
    return torch.ones(n, dtype=dtype)


def meta(n=4):
    return torch.empty(n, device="meta")


def valid_calls(mk):
    """One valid call per collective for a 1-rank world, tensors from ``mk(n)``."""
    return {
        "all_reduce": lambda **kw: mcrdl.all_reduce(mk(4), **kw),
        "broadcast": lambda **kw: mcrdl.broadcast(mk(4), src=0, **kw),
        "reduce": lambda **kw: mcrdl.reduce(mk(4), dst=0, **kw),
        "all_gather_into_tensor": lambda **kw: mcrdl.all_gather_into_tensor(mk(4), mk(4), **kw),
        "all_gather": lambda **kw: mcrdl.all_gather([mk(4)], mk(4), **kw),
        "reduce_scatter_tensor": lambda **kw: mcrdl.reduce_scatter_tensor(mk(4), mk(4), **kw),
        "reduce_scatter": lambda **kw: mcrdl.reduce_scatter(mk(4), [mk(4)], **kw),
        "gather": lambda **kw: mcrdl.gather(mk(4), [mk(4)], dst=0, **kw),
        "scatter": lambda **kw: mcrdl.scatter(mk(4), [mk(4)], src=0, **kw),
        "all_to_all_single": lambda **kw: mcrdl.all_to_all_single(mk(4), mk(4), **kw),
        "all_to_all": lambda **kw: mcrdl.all_to_all([mk(4)], [mk(4)], **kw),
    }


COLLECTIVES = list(valid_calls(cpu))
A2A_TABLE = {"format": "mcrdl-tuning/1", "metadata": {"note": "test_errors"},
             "rules": {"all_to_all": {"1": [{"max_bytes": 1000, "backend": "mpi"},
                                            {"max_bytes": None, "backend": "gloo"}]}}}


@pytest.fixture
def uninitialized():
    """No process group during the test (the module's world comes back after)."""
    was = mcrdl.is_initialized()
    mcrdl.destroy_process_group()
    yield
    mcrdl.destroy_process_group()
    if was:
        mcrdl.init_process_group(timeout=30)


@pytest.fixture(scope="module")
def world():
    """A 1-rank world with mpi and gloo live, for the whole module."""
    mcrdl.destroy_process_group()
    mcrdl.init_process_group(timeout=30)
    live = [n for n, s in mcrdl.available_backends().items() if s == "live"]
    assert {"mpi", "gloo"} <= set(live), mcrdl.available_backends()
    assert mcrdl.get_world_size() == 1
    yield
    mcrdl.destroy_process_group()


# -- lifecycle and init-time errors ---------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda: mcrdl.all_reduce(cpu()),
    lambda: mcrdl.barrier(),
    lambda: mcrdl.get_world_size(),
    lambda: mcrdl.new_group([0]),
    lambda: mcrdl.explain("all_reduce", 8),
], ids=["all_reduce", "barrier", "get_world_size", "new_group", "explain"])
def test_call_before_init_raises_runtime_error(uninitialized, call):
    with refused(RuntimeError, "not initialized", "init_process_group"):
        call()


def test_call_after_destroy_raises_runtime_error(uninitialized):
    mcrdl.init_process_group(timeout=30)
    mcrdl.destroy_process_group()
    with refused(RuntimeError, "init_process_group"):
        mcrdl.all_reduce(cpu())


def test_double_init_raises_and_keeps_the_first(uninitialized):
    mcrdl.init_process_group(timeout=30)
    with refused(RuntimeError, "already initialized", "destroy_process_group"):
        mcrdl.init_process_group(timeout=30)
    t = cpu()
    mcrdl.all_reduce(t)  # the first group still works
    assert torch.equal(t, cpu())


def test_unknown_backend_name_at_init(uninitialized):
    with refused(ValueError, "unknown backend", "'foo'", "mpi", "gloo"):
        mcrdl.init_process_group(backends=["foo"], timeout=30)
    assert not mcrdl.is_initialized()
    with refused(ValueError, "unknown backend", "'foo'"):  # (a string is names, not letters)
        mcrdl.init_process_group(backends="gloo, foo", timeout=30)
    mcrdl.init_process_group(backends="gloo", timeout=30)
    assert mcrdl.live_backends() == ["gloo"]


@pytest.mark.skipif(not NO_CUDA, reason="nccl is live on a CUDA machine")
def test_default_backend_not_live_at_init(uninitialized):
    with refused(ValueError, "default backend", "'nccl'", "not live", "no CUDA device"):
        mcrdl.init_process_group(default_backend="nccl", timeout=30)
    assert not mcrdl.is_initialized()


def test_launcher_and_mpi_library_that_disagree_on_the_world(uninitialized, monkeypatch):
    """A foreign launcher's size (here Open MPI's variable over MPICH) must not leave
    every rank running alone as rank 0 of a 1-rank world."""
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with refused(RuntimeError, "started 2 processes", "OMPI_COMM_WORLD_SIZE=2", "world of 1",
                 "different implementations", "--mpiexec"):
        mcrdl.init_process_group(timeout=30)
    assert not mcrdl.is_initialized()


def test_unknown_default_backend_at_init(uninitialized):
    with refused(ValueError, "default backend", "'foo'", "not a registered backend"):
        mcrdl.init_process_group(default_backend="foo", timeout=30)
    assert not mcrdl.is_initialized()


def test_missing_tuning_table_file_at_init(uninitialized):
    with refused(mcrdl.TuningTableError, "/nonexistent.json", "cannot read"):
        mcrdl.init_process_group(tuning_table="/nonexistent.json", timeout=30)
    assert not mcrdl.is_initialized()


def test_op_backends_unknown_op_at_init(uninitialized):
    with refused(ValueError, "op_backends", "'bogus'"):
        mcrdl.init_process_group(op_backends={"bogus": "mpi"}, timeout=30)
    assert not mcrdl.is_initialized()


def test_op_backends_unknown_backend_at_init(uninitialized):
    with refused(ValueError, "op_backends", "'all_reduce'", "'foo'", "not live"):
        mcrdl.init_process_group(op_backends={"all_reduce": "foo"}, timeout=30)
    assert not mcrdl.is_initialized()


def test_init_works_after_refused_inits(uninitialized):
    for bad in ({"backends": ["foo"]}, {"tuning_table": "/nonexistent.json"},
                {"op_backends": {"bogus": "mpi"}}):
        with pytest.raises(ValueError):  # TuningTableError is a ValueError
            mcrdl.init_process_group(timeout=30, **bad)
    mcrdl.init_process_group(timeout=30)
    t = cpu()
    mcrdl.all_reduce(t, backend="gloo")
    assert torch.equal(t, cpu())


# -- the valid calls the cases below break one thing of -------------------------------------------
@pytest.mark.parametrize("op", COLLECTIVES)
def test_baseline_valid_call_succeeds(world, op):
    for backend in ("mpi", "gloo"):
        assert valid_calls(cpu)[op](backend=backend) is None


# -- backends ---------------------------------------------------------------------------------
@pytest.mark.parametrize("op", COLLECTIVES)
def test_unknown_backend_per_call(world, op):
    with refused(mcrdl.UnsupportedError, op, "backend='foo'", "not live"):
        valid_calls(cpu)[op](backend="foo")


def test_unknown_backend_on_barrier(world):
    with refused(mcrdl.UnsupportedError, "barrier", "'foo'"):
        mcrdl.barrier(backend="foo")


@pytest.mark.parametrize("case", ["backend_foo", "meta_device"])
def test_empty_tensor_is_still_checked(world, case):
    kw = {"backend": "foo"} if case == "backend_foo" else {}
    t = torch.empty(0) if case == "backend_foo" else meta(0)
    with refused(mcrdl.UnsupportedError, "all_reduce", "foo" if case == "backend_foo" else "meta"):
        mcrdl.all_reduce(t, **kw)


@pytest.mark.skipif(not NO_CUDA, reason="nccl is live on a CUDA machine")
@pytest.mark.parametrize("op", ["all_reduce", "broadcast", "all_to_all_single"])
def test_forced_nccl_is_not_live_here(world, op):
    with refused(mcrdl.UnsupportedError, op, "backend='nccl'", "not live"):
        valid_calls(cpu)[op](backend="nccl")


@pytest.mark.parametrize("op", COLLECTIVES)
def test_meta_device_tensor_no_backend_takes(world, op):
    with refused(mcrdl.UnsupportedError, op, "meta", "no live backend"):
        valid_calls(meta)[op]()


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_meta_device_tensor_forced_backend(world, backend):
    with refused(mcrdl.UnsupportedError, "all_reduce", f"backend={backend!r}", "meta"):
        mcrdl.all_reduce(meta(), backend=backend)


def test_int16_on_gloo_is_unsupported(world):
    with refused(mcrdl.UnsupportedError, "all_reduce", "gloo", "torch.int16"):
        mcrdl.all_reduce(cpu(dtype=torch.int16), backend="gloo")


# -- argument types -----------------------------------------------------------------------------
@pytest.mark.parametrize("call,words", [
    (lambda: mcrdl.all_reduce([1.0]), ["all_reduce", "tensor", "list"]),
    (lambda: mcrdl.broadcast(np.ones(4), src=0), ["broadcast", "tensor", "ndarray"]),
    (lambda: mcrdl.all_gather_into_tensor(torch.empty(4), 3.0), ["all_gather_into_tensor", "input_tensor", "float"]),
    (lambda: mcrdl.all_gather([None], cpu()), ["all_gather", "tensor_list[0]", "NoneType"]),
    (lambda: mcrdl.reduce_scatter(torch.empty(4), ["x"]), ["reduce_scatter", "input_list[0]", "str"]),
    (lambda: mcrdl.scatter(torch.empty(4), [1], src=0), ["scatter", "scatter_list[0]", "int"]),
    (lambda: mcrdl.all_to_all_single(torch.empty(4), [1, 2, 3, 4]), ["all_to_all_single", "input", "list"]),
    (lambda: mcrdl.all_to_all([3], [cpu()]), ["all_to_all", "output_tensor_list[0]", "int"]),
], ids=["all_reduce", "broadcast", "all_gather_into_tensor", "all_gather", "reduce_scatter",
        "scatter", "all_to_all_single", "all_to_all_output"])
def test_non_tensor_argument(world, call, words):
    with refused(TypeError, *words):
        call()


@pytest.mark.parametrize("inputs,exc,word", [
    ([3], TypeError, "input_tensor_list[0]"),
    ([], ValueError, "input_tensor_list"),
], ids=["non_tensor_input", "empty_input_list"])
def test_all_to_all_bad_input_list(world, inputs, exc, word):
    with refused(exc, "all_to_all", word):
        mcrdl.all_to_all([torch.empty(4)], inputs)


@pytest.mark.parametrize("group", ["world", [0], 0], ids=["str", "list", "int"])
def test_group_of_wrong_type(world, group):
    with refused(TypeError, "group", "mcrdl.new_group", type(group).__name__):
        mcrdl.all_reduce(cpu(), group=group)


def test_group_of_wrong_type_names_the_op(world):
    with refused(TypeError, "all_reduce", "group"):
        mcrdl.all_reduce(cpu(), group="world")


@pytest.mark.parametrize("backend", ["mpi", "gloo"])
def test_group_from_a_destroyed_init_is_refused(uninitialized, backend):
    mcrdl.init_process_group(timeout=30)
    stale = mcrdl.new_group([0])
    mcrdl.destroy_process_group()
    mcrdl.init_process_group(timeout=30)
    with refused((ValueError, RuntimeError), "all_reduce", stale.name):
        mcrdl.all_reduce(cpu(), group=stale, backend=backend)


# -- dtypes and reduce ops ------------------------------------------------------------------------
@pytest.mark.parametrize("op", COLLECTIVES)
def test_unsupported_dtype_complex64(world, op):
    with refused(mcrdl.UnsupportedError, op, "unsupported dtype torch.complex64"):
        valid_calls(lambda n: torch.ones(n, dtype=torch.complex64))[op]()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.uint8])
@pytest.mark.parametrize("call,op", [
    (lambda t: mcrdl.all_reduce(t, op=mcrdl.ReduceOp.AVG), "all_reduce"),
    (lambda t: mcrdl.reduce(t, dst=0, op=mcrdl.ReduceOp.AVG), "reduce"),
    (lambda t: mcrdl.reduce_scatter_tensor(t.clone(), t, op="avg"), "reduce_scatter_tensor"),
    (lambda t: mcrdl.reduce_scatter(t.clone(), [t], op=mcrdl.ReduceOp.AVG), "reduce_scatter"),
], ids=["all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter"])
def test_avg_on_integer_tensor(world, call, op, dtype):
    with refused(mcrdl.UnsupportedError, op, "ReduceOp.AVG", str(dtype)):
        call(cpu(dtype=dtype))


@pytest.mark.parametrize("call,op", [
    (lambda t: mcrdl.all_reduce(t, op=mcrdl.ReduceOp.AVG), "all_reduce"),
    (lambda t: mcrdl.reduce(t, dst=0, op="AVG"), "reduce"),
    (lambda t: mcrdl.reduce_scatter_tensor(t.clone(), t, op=mcrdl.ReduceOp.AVG), "reduce_scatter_tensor"),
], ids=["all_reduce", "reduce", "reduce_scatter_tensor"])
def test_avg_on_bool_tensor(world, call, op):
    with refused(mcrdl.UnsupportedError, op, "ReduceOp.AVG", "torch.bool"):
        call(cpu(dtype=torch.bool))


@pytest.mark.parametrize("bad", ["median", "", None, 3])
def test_unknown_reduce_op(world, bad):
    with refused(ValueError, "unknown reduce op", repr(bad), "SUM"):
        mcrdl.all_reduce(cpu(), op=bad)


def test_unknown_reduce_op_names_the_op(world):
    with refused(ValueError, "all_reduce", "'median'"):
        mcrdl.all_reduce(cpu(), op="median")


# -- sizes, dtypes and devices of outputs -----------------------------------------------------------
@pytest.mark.parametrize("call,words", [
    (lambda: mcrdl.all_gather_into_tensor(torch.empty(3), cpu(2)),
     ["all_gather_into_tensor", "output_tensor has 3 elements", "expected 2 x 1 ranks = 2"]),
    (lambda: mcrdl.reduce_scatter_tensor(torch.empty(3), cpu(2)),
     ["reduce_scatter_tensor", "input has 2 elements", "expected 3 x 1 ranks = 3"]),
    (lambda: mcrdl.all_gather([torch.empty(2), torch.empty(2)], cpu(2)),
     ["all_gather", "tensor_list", "list of 1 tensors", "got 2"]),
    (lambda: mcrdl.all_gather(torch.empty(2), cpu(2)),
     ["all_gather", "tensor_list", "got Tensor"]),
    (lambda: mcrdl.all_gather([torch.empty(3)], cpu(2)),
     ["all_gather", "tensor_list[0] has 3 elements", "expected 2"]),
    (lambda: mcrdl.reduce_scatter(torch.empty(2), [cpu(2)] * 3),
     ["reduce_scatter", "input_list", "list of 1 tensors", "got 3"]),
    (lambda: mcrdl.reduce_scatter(torch.empty(2), [cpu(3)]),
     ["reduce_scatter", "input_list[0] has 3 elements", "expected 2"]),
    (lambda: mcrdl.gather(cpu(2), [torch.empty(3)], dst=0),
     ["gather", "gather_list[0] has 3 elements", "expected 2"]),
    (lambda: mcrdl.gather(cpu(2), None, dst=0), ["gather", "gather_list", "got NoneType"]),
    (lambda: mcrdl.scatter(torch.empty(2), [cpu(3)], src=0),
     ["scatter", "scatter_list[0] has 3 elements", "expected 2"]),
    (lambda: mcrdl.all_to_all([torch.empty(2)], [cpu(2), cpu(2)]),
     ["all_to_all", "input_tensor_list", "list of 1 tensors"]),
], ids=["all_gather_into_tensor", "reduce_scatter_tensor", "all_gather_len", "all_gather_not_list",
        "all_gather_numel", "reduce_scatter_len", "reduce_scatter_numel", "gather_numel",
        "gather_list_missing_on_root", "scatter_numel", "all_to_all_len"])
def test_wrong_output_size(world, call, words):
    with refused(ValueError, *words):
        call()


F32, F64 = torch.float32, torch.float64


@pytest.mark.parametrize("call,words", [
    (lambda: mcrdl.all_gather_into_tensor(torch.empty(4, dtype=F64), cpu()),
     ["all_gather_into_tensor", "output_tensor", "torch.float64", "expected torch.float32"]),
    (lambda: mcrdl.reduce_scatter_tensor(torch.empty(4), cpu(dtype=F64)),
     ["reduce_scatter_tensor", "input", "torch.float64", "expected torch.float32"]),
    (lambda: mcrdl.all_to_all_single(torch.empty(4, dtype=torch.int64), cpu()),
     ["all_to_all_single", "output", "torch.int64", "expected torch.float32"]),
    (lambda: mcrdl.all_gather([torch.empty(4, dtype=torch.int32)], cpu()),
     ["all_gather", "tensor_list[0]", "torch.int32", "expected torch.float32"]),
    (lambda: mcrdl.reduce_scatter(torch.empty(4), [cpu(dtype=torch.float16)]),
     ["reduce_scatter", "input_list[0]", "torch.float16", "expected torch.float32"]),
    (lambda: mcrdl.gather(cpu(), [torch.empty(4, dtype=F64)], dst=0),
     ["gather", "gather_list[0]", "torch.float64", "expected torch.float32"]),
    (lambda: mcrdl.scatter(torch.empty(4), [cpu(dtype=torch.int8)], src=0),
     ["scatter", "scatter_list[0]", "torch.int8", "expected torch.float32"]),
    (lambda: mcrdl.all_to_all([torch.empty(4)], [cpu(dtype=torch.int64)]),
     ["all_to_all", "output_tensor_list[0]", "torch.float32", "expected torch.int64"]),
], ids=["all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_gather",
        "reduce_scatter", "gather", "scatter", "all_to_all"])
def test_dtype_mismatch_between_input_and_output(world, call, words):
    with refused(TypeError, *words):
        call()


@pytest.mark.parametrize("call,words", [
    (lambda: mcrdl.all_gather_into_tensor(meta(), cpu()), ["all_gather_into_tensor", "output_tensor", "meta", "cpu"]),
    (lambda: mcrdl.reduce_scatter_tensor(cpu(), meta()), ["reduce_scatter_tensor", "input", "meta", "cpu"]),
    (lambda: mcrdl.all_to_all_single(meta(), cpu()), ["all_to_all_single", "output", "meta", "cpu"]),
    (lambda: mcrdl.all_gather([meta()], cpu()), ["all_gather", "tensor_list[0]", "meta", "cpu"]),
    (lambda: mcrdl.gather(cpu(), [meta()], dst=0), ["gather", "gather_list[0]", "meta", "cpu"]),
], ids=["all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single", "all_gather", "gather"])
def test_device_mismatch_between_input_and_output(world, call, words):
    with refused(ValueError, *words):
        call()


# -- all_to_all_single split sizes ------------------------------------------------------------------
@pytest.mark.parametrize("out_splits,in_splits,words", [
    (None, [2, 2], ["input_split_sizes", "1 non-negative ints", "[2, 2]"]),
    ([-4], None, ["output_split_sizes", "non-negative", "[-4]"]),
    ([4.0], None, ["output_split_sizes", "ints", "[4.0]"]),
    (None, [3], ["input_split_sizes sum to 3", "input has 4 rows"]),
    ([5], [4], ["output_split_sizes sum to 5", "output has 4 rows"]),
], ids=["wrong_length", "negative", "not_int", "input_sum", "output_sum"])
def test_all_to_all_single_bad_split_sizes(world, out_splits, in_splits, words):
    with refused(ValueError, "all_to_all_single", *words):
        mcrdl.all_to_all_single(torch.empty(4), cpu(), out_splits, in_splits)


def test_all_to_all_single_rows_differ(world):
    with refused(ValueError, "all_to_all_single", "input rows have 3 elements", "output rows have 2"):
        mcrdl.all_to_all_single(torch.empty(4, 2), torch.ones(4, 3))


# -- roots and peers -----------------------------------------------------------------------------
@pytest.mark.parametrize("call,words", [
    (lambda: mcrdl.broadcast(cpu(), src=1), ["broadcast", "src", "rank 1", "not in group world"]),
    (lambda: mcrdl.reduce(cpu(), dst=1), ["reduce", "dst", "rank 1", "not in group world"]),
    (lambda: mcrdl.gather(cpu(), [cpu()], dst=-1), ["gather", "dst", "rank -1", "not in group"]),
    (lambda: mcrdl.scatter(cpu(), [cpu()], src=7), ["scatter", "src", "rank 7", "not in group"]),
], ids=["broadcast", "reduce", "gather", "scatter"])
def test_root_outside_the_group(world, call, words):
    with refused(ValueError, *words):
        call()


@pytest.mark.parametrize("root", [True, "0", 0.0, None], ids=["bool", "str", "float", "None"])
def test_root_of_wrong_type(world, root):
    with refused(TypeError, "broadcast", "src", "int rank", repr(root)):
        mcrdl.broadcast(cpu(), src=root)


@pytest.mark.parametrize("fn,what", [(mcrdl.send, "dst"), (mcrdl.isend, "dst"),
                                     (mcrdl.recv, "src"), (mcrdl.irecv, "src")],
                         ids=["send", "isend", "recv", "irecv"])
def test_point_to_point_with_self(world, fn, what):
    with refused(ValueError, fn.__name__, f"{what}=0", "this rank itself"):
        fn(cpu(), 0)


@pytest.mark.parametrize("fn,what", [(mcrdl.send, "dst"), (mcrdl.irecv, "src")], ids=["send", "irecv"])
def test_point_to_point_peer_outside_the_world(world, fn, what):
    with refused(ValueError, fn.__name__, what, "rank 3", "not in group world"):
        fn(cpu(), 3)


@pytest.mark.parametrize("fn", [mcrdl.send, mcrdl.isend], ids=["send", "isend"])
def test_send_needs_a_destination(world, fn):
    with refused(ValueError, fn.__name__, "dst is required"):
        fn(cpu(), None)


def test_batch_isend_irecv_empty_list(world):
    with refused(ValueError, "batch_isend_irecv", "empty"):
        mcrdl.batch_isend_irecv([])


def test_batch_isend_irecv_item_not_a_p2pop(world):
    with refused(TypeError, "batch_isend_irecv", "item 0", "str", "P2POp"):
        mcrdl.batch_isend_irecv(["isend"])


@pytest.mark.parametrize("fn", [mcrdl.send, mcrdl.all_reduce, print], ids=["send", "all_reduce", "print"])
def test_batch_isend_irecv_wrong_op(world, fn):
    with refused(ValueError, "batch_isend_irecv", "item 0", "mcrdl.isend or mcrdl.irecv"):
        mcrdl.batch_isend_irecv([mcrdl.P2POp(fn, cpu(), 0)])


def test_batch_isend_irecv_bad_peer_names_the_op(world):
    with refused(ValueError, "isend", "dst=0", "this rank itself"):
        mcrdl.batch_isend_irecv([mcrdl.P2POp(mcrdl.isend, cpu(), 0)])


# -- groups ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("ranks,words", [
    ([], ["new_group", "ranks is empty"]),
    ([0, 3], ["new_group", "ranks [3]", "outside the world of 1"]),
    ([-1], ["new_group", "ranks [-1]", "outside the world of 1"]),
], ids=["empty", "too_large", "negative"])
def test_new_group_bad_ranks(world, ranks, words):
    with refused(ValueError, *words):
        mcrdl.new_group(ranks)


def test_get_global_rank_outside_group(world):
    with refused(ValueError, "group rank 3", "outside group world", "size 1"):
        mcrdl.get_global_rank(None, 3)


# -- explain ----------------------------------------------------------------------------------------
def test_explain_unknown_op(world):
    with refused(ValueError, "unknown op", "'all_reducee'", "all_reduce"):
        mcrdl.explain("all_reducee", 8)


def test_explain_unknown_backend(world):
    with refused(mcrdl.UnsupportedError, "all_reduce", "backend='foo'", "not live"):
        mcrdl.explain("all_reduce", 8, backend="foo")


def test_explain_meta_tensor(world):
    with refused(mcrdl.UnsupportedError, "all_reduce", "meta", "no live backend"):
        mcrdl.explain("all_reduce", meta())


# -- nothing is sent before an error, even with agreement or debug checks --------------------------
@pytest.mark.parametrize("init,call,words", [
    pytest.param({"debug": True}, lambda: mcrdl.all_reduce(cpu(), backend="foo"),
                 ["all_reduce", "'foo'"], id="debug_all_reduce_backend_foo"),
    pytest.param({"tuning_table": A2A_TABLE}, lambda: mcrdl.all_to_all_single(meta(), meta()),
                 ["all_to_all_single", "meta"], id="table_all_to_all_single_meta"),
    pytest.param({"debug": True}, lambda: mcrdl.all_to_all_single(torch.empty(4), cpu(), backend="foo"),
                 ["all_to_all_single", "'foo'"], id="debug_all_to_all_single_backend_foo"),
])
def test_refused_before_any_control_traffic(uninitialized, init, call, words):
    mcrdl.init_process_group(timeout=30, **init)
    with refused(mcrdl.UnsupportedError, *words):
        call()


# -- two ranks ----------------------------------------------------------------------------------------
def test_two_rank_errors_are_local_and_send_nothing():
    out = run_job(2, "errors_job.py", "local", timeout=120)
    out.require(["errors local finished"], range(2))
    assert out.count("errors local OK after 31 confirmations") == 2, out[-4000:]
    assert out.count(": refused ") == 31, out[-4000:]


def test_batch_isend_irecv_refused_before_any_isend_is_posted():
    out = run_job(2, "errors_job.py", "batch", timeout=120)
    out.require(["errors batch finished"], range(2))
    assert "leaked=True" not in out, out[-4000:]


def test_env_static_map_applies_unless_a_map_is_given(uninitialized, monkeypatch):
    monkeypatch.setenv("MCRDL_OP_BACKENDS", "all_reduce:gloo")
    mcrdl.init_process_group(timeout=30)
    assert ": gloo (static map" in mcrdl.explain("all_reduce", 4)
    mcrdl.destroy_process_group()
    mcrdl.init_process_group(timeout=30, op_backends={"all_reduce": "mpi"})
    assert ": mpi (static map" in mcrdl.explain("all_reduce", 4)
    mcrdl.destroy_process_group()
    monkeypatch.setenv("MCRDL_OP_BACKENDS", "all_reduce")
    with refused(ValueError, "MCRDL_OP_BACKENDS"):
        mcrdl.init_process_group(timeout=30)


@pytest.mark.parametrize("nprocs", [2, 4])
def test_both_builds_raise_the_same_errors(nprocs, tmp_path):
    """Every op x style with bad input, right after a valid call like it: the compiled
    build (its plan exists) and the pure-Python one (MCRDL_NATIVE=0, the general path)
    raise the same exception with the same message, on every rank."""
    for build, env in (("compiled", {}), ("python", {"MCRDL_NATIVE": "0"})):
        (tmp_path / build).mkdir()
        out = run_job(nprocs, "error_parity_job.py", tmp_path / build, timeout=180, env=env)
        out.require(["every bad call raised", "error parity finished"], range(nprocs))
    for r in range(nprocs):
        compiled, python = (json.loads((tmp_path / b / f"rank{r}.json").read_text()) for b in ("compiled", "python"))
        assert len(compiled) == len(python) == 32
        for c, p in zip(compiled, python):
            assert c == p, (r, c, p)
