"""The compiled module (mcrdl/facts.py, csrc/): its tensor facts give the answers
of their plain-Python reference (tests/facts_reference.py) on the same tensors,
and the module builds into an empty cache, is reused, is refused by name when a
binding is missing, and falls back when there is no compiler."""
import os
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from mcrdl import facts, ops

import facts_reference as reference
from conftest import cached_files, check_built_once_and_reused, compiled_status

COMPILED = facts.load()
HAS_CXX = shutil.which("c++") is not None or shutil.which("g++") is not None


class Dispatching(torch.Tensor):
    """A subclass with its own dispatch (as DTensor and FakeTensor have)."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _tensors():
    base = torch.arange(24, dtype=torch.float32)
    grid = base.view(4, 6)
    return {
        "float32": base, "0-d": torch.tensor(3.0), "empty": torch.zeros(0), "empty 2-d": torch.zeros(0, 5),
        "bool": torch.zeros(5, dtype=torch.bool), "bfloat16": torch.zeros(7, dtype=torch.bfloat16),
        "int64 2-d": torch.zeros(3, 4, dtype=torch.int64), "slice": base[4:10], "strided": base[::2],
        "transposed": grid.t(), "row": grid[1], "column": grid[:, 1],
        "channels_last": torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "requires_grad": torch.zeros(4, requires_grad=True), "parameter": torch.nn.Parameter(torch.zeros(4)),
        "sparse": torch.zeros(4).to_sparse(), "meta": torch.empty(4, device="meta"),
        "dispatching subclass": torch.zeros(4).as_subclass(Dispatching),
        "numpy": np.zeros(4, dtype=np.float32), "int": 4, "None": None,
    }


TENSORS = _tensors()
CPU_ONLY = ("numpy", "int", "None")


@pytest.fixture(scope="module")
def compiled():
    if COMPILED is facts:
        if HAS_CXX and os.environ.get("MCRDL_NATIVE", "1") != "0":
            pytest.fail(f"a C++ compiler is here but the checks are not compiled: {facts.status()}")
        pytest.skip(facts.status())
    return COMPILED


@pytest.mark.parametrize("name", list(TENSORS))
def test_key(compiled, name):
    t = TENSORS[name]
    expected = reference.key(t)
    assert compiled.key(t) == expected
    if name in ("float32", "0-d", "empty", "empty 2-d", "bool", "bfloat16", "int64 2-d", "slice", "row",
                "requires_grad", "parameter"):
        assert expected == (t.nbytes, t.dtype), name
    else:
        assert expected is None, name


def test_pair(compiled):
    buf = torch.zeros(16)
    cases = {
        "disjoint": (buf[:8], buf[8:]), "overlapping": (buf[:9], buf[8:]), "same": (buf, buf),
        "separate": (torch.zeros(2, 3), torch.zeros(6, dtype=torch.int32)), "empty inside": (buf[4:4], buf),
        "one strided": (buf[::2], torch.zeros(8)), "one not a tensor": (buf, 3),
    }
    for name, (a, b) in cases.items():
        expected = reference.pair(a, b)
        assert compiled.pair(a, b) == expected, name
        if name in ("disjoint", "separate", "empty inside"):
            assert expected == (a.nbytes, a.dtype, tuple(a.shape), b.nbytes, b.dtype, tuple(b.shape)), name
        else:
            assert expected is None, name


def test_plan_key(compiled):
    """Every recipe on tensors and fixed arguments of every kind: the compiled
    plan_key and its reference agree."""
    from mcrdl.types import ReduceOp

    ops.driver()  # (sets the compiled module up)
    buf = torch.zeros(16)
    pairs = [(buf[:8], buf[8:]), (buf[:9], buf[8:]), (torch.zeros(4, dtype=torch.bool), torch.zeros(8, dtype=torch.bool))]
    singles = [TENSORS[n] for n in ("float32", "0-d", "empty", "bool", "strided", "requires_grad", "None")]
    fixed = [(ReduceOp.SUM,), (ReduceOp.MAX,), (ReduceOp.AVG,), ("sum",), (0,), (1, ReduceOp.SUM),
             (1, ReduceOp.MIN), (True,), (1.0, ReduceOp.SUM), (0, 7), (0, True), (None, 0), (2**40, 0)]
    answered = set()
    for recipe in range(7):
        for at in (0, 1):
            for tensors in [(t,) for t in singles] + [(t, u) for t in singles[:2] for u in singles[:2]] + pairs:
                for f in fixed:
                    try:
                        expected = reference.plan_key(recipe, at, tensors, f)
                    except IndexError:  # (Python indexes past the tuple; C answers None)
                        assert compiled.plan_key(recipe, at, tensors, f) is None
                        continue
                    assert compiled.plan_key(recipe, at, tensors, f) == expected, (recipe, at, tensors, f)
                    answered.add(recipe if expected is not None else -1)
    assert answered == {-1, *range(7)}  # every recipe keyed some call, and refused some
    t = TENSORS["float32"]
    assert reference.plan_key(reference.REDUCED, 0, (t,), (ReduceOp.SUM,)) == (t.nbytes, t.dtype)
    assert reference.plan_key(reference.REDUCED, 0, (TENSORS["bool"],), (ReduceOp.SUM,)) is None  # (mapped to uint8)
    assert reference.plan_key(reference.REDUCED, 0, (t,), (ReduceOp.AVG,)) == ((t.nbytes, t.dtype), ReduceOp.AVG)
    assert reference.plan_key(reference.REDUCED, 0, (t,), ("sum",)) is None  # (named, not a member: general)
    assert reference.plan_key(reference.ROOTED, 0, (t,), (True,)) is None  # (True is no rank)
    assert reference.plan_key(reference.P2P, 0, (t,), (1, 5)) == ((t.nbytes, t.dtype), 1, 5)


def test_span(compiled):
    buf = torch.zeros(12)
    parts = list(buf.chunk(3))
    other = torch.zeros(4)
    grad = torch.zeros(12, requires_grad=True)
    wide = torch.zeros(16)
    cases = {
        "chunks": (parts, 3, torch.float32, 16), "tuple": (tuple(parts), 3, torch.float32, 16),
        "reversed": (parts[::-1], 3, torch.float32, 16), "gap": (list(buf.chunk(4))[::2] + [other], 3,
                                                                  torch.float32, 16),
        "too few": (parts[:2], 3, torch.float32, 16), "wrong size": (parts, 3, torch.float32, 12),
        "wrong dtype": (parts, 3, torch.float64, 16), "generator": ((p for p in parts), 3, torch.float32, 16),
        "not a tensor": (parts[:2] + [1], 3, torch.float32, 16), "none": ([], 0, torch.float32, 16),
        "requires grad": (list(grad.chunk(3)), 3, torch.float32, 16),
        "one": ([other], 1, torch.float32, 16),
        # apart: the tensor the op's other side is (gather, scatter), which must not overlap
        "apart elsewhere": (parts, 3, torch.float32, 16, other),
        "apart just after": (list(wide[:12].chunk(3)), 3, torch.float32, 16, wide[12:]),
        "apart inside": (parts, 3, torch.float32, 16, parts[1]),
        "apart across the end": (list(wide[:12].chunk(3)), 3, torch.float32, 16, wide[11:13]),
        "apart not a tensor": (parts, 3, torch.float32, 16, 5),
        "apart just before": (list(wide[4:].chunk(3)), 3, torch.float32, 16, wide[:4]),
        "apart across the start": (list(wide[4:].chunk(3)), 3, torch.float32, 16, wide[3:5]),
        "apart not contiguous": (parts, 3, torch.float32, 16, other[::2]),
    }
    for name, args in cases.items():
        expected = reference.span(*args)
        assert compiled.span(*args) == expected, name
        if name in ("chunks", "tuple", "apart elsewhere"):
            assert expected == buf.data_ptr(), name
        elif name == "apart just after":
            assert expected == wide.data_ptr(), name
        elif name == "apart just before":
            assert expected == wide[4:].data_ptr(), name
        elif name == "one":
            assert expected == other.data_ptr()
        else:
            assert expected is None, name
    for module in (reference, compiled):
        for listed in (parts, (p for p in parts)):
            with pytest.raises(TypeError, match="dtype"):
                module.span(listed, 3, "float32", 16)
            with pytest.raises(TypeError, match="dtype"):
                module.span(listed, 3, "float32", 16, 5)


@pytest.mark.parametrize("name", [n for n in TENSORS if n not in CPU_ONLY])
def test_ranges(compiled, name):
    """Each tensor alone, read, written, and beside another it is or is not."""
    t, other = TENSORS[name], torch.zeros(3)
    for reads, writes in (((t,), ()), ((), [t]), ((t, other), (t,)), ([other], (t, other))):
        got = compiled.ranges(reads, writes)
        if name in ("sparse", "dispatching subclass"):
            assert got is None, name  # facts.ranges reads these
            continue
        expected = facts.ranges(reads, writes)
        assert got == expected, (name, reads, writes)
        assert len(got[2]) == len({id(x) for x in (*reads, *writes)})
    start, end = facts.extent(t) if name not in ("sparse", "dispatching subclass") else (0, 0)
    if name in ("float32", "slice", "row", "0-d", "bfloat16", "int64 2-d"):
        assert (start, end) == (t.data_ptr(), t.data_ptr() + t.nbytes), name
    elif name in ("strided", "column"):  # from the first element to just past the last
        assert (start, end) == (t.data_ptr(), t[-1].data_ptr() + t.element_size()), name
    elif name in ("empty", "empty 2-d"):
        assert (start, end) == (0, 0), name


def test_ranges_of_no_tensors_and_of_other_sequences(compiled):
    assert compiled.ranges((), []) == facts.ranges((), []) == (0, 0, [])
    t = torch.zeros(2)
    assert compiled.ranges((x for x in [t]), ()) is None  # not a list or tuple: facts.ranges reads it
    with pytest.raises(TypeError):
        compiled.ranges((t,))
    huge = torch.empty_strided((3,), (2**62,), device="meta")  # its span is past 2^64
    assert compiled.ranges((huge,), ()) is None
    assert facts.ranges((huge,), ())[2][0][2] == 2 * 2**62 * 4 + 4


STATUS = "from mcrdl import facts; print(facts.status())"


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler")
def test_builds_into_an_empty_cache_and_is_reused(tmp_path):
    check_built_once_and_reused("mcrdl.facts", tmp_path)


def test_without_a_compiler_the_python_checks_run(tmp_path):
    status = compiled_status("mcrdl.facts", tmp_path, CXX="/bin/false")
    assert status.startswith("build failed (") and status.endswith("pure Python"), status
    assert not cached_files(tmp_path)


def test_nested_and_storage_less_tensors_take_the_general_path(compiled):
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    for module in (reference, compiled):  # (compiled: a torch error must not abort the process)
        assert module.key(nested) is None and module.pair(nested, torch.zeros(4)) is None
        assert module.span([nested], 1, torch.float32, 8) is None
    seen = []

    def inside(x):  # vmap's batched tensors have no storage
        seen.append((reference.key(x), compiled.key(x), reference.pair(x, torch.zeros(2)),
                     compiled.pair(x, torch.zeros(2))))
        return x

    torch.func.vmap(inside)(torch.zeros(3, 4))
    assert seen == [(None, None, None, None)]


def test_ranks_waiting_on_a_failed_build_do_not_compile_again(tmp_path):
    """Two processes start at once with a compiler that fails after a while:
    one compiles, the other waits for it and then falls back without
    compiling again (each rank of a node would otherwise compile in turn)."""
    count = tmp_path / "invocations"
    compiler = tmp_path / "slow-failing-c++"
    compiler.write_text(f"#!/bin/sh\necho run >> {count}\nsleep 3\nexit 1\n")
    compiler.chmod(0o755)
    env = {**os.environ, "MCRDL_CACHE": str(tmp_path / "cache"), "CXX": str(compiler)}
    procs = [subprocess.Popen([sys.executable, "-c", STATUS], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    statuses = sorted(p.communicate(timeout=120)[0].strip() for p in procs)
    assert count.read_text().count("run") == 1, statuses
    assert all(s.startswith("build failed (") and s.endswith("pure Python") for s in statuses), statuses
    assert any("another process" in s for s in statuses), statuses


def test_beats_arrive_while_the_gil_is_held_and_stop_once_removed(compiled):
    """The watchdog's beats (csrc/beats.cpp's Beats): every interval on each added socket,
    also while this thread holds the GIL; none once the socket is removed or the
    beats stop; a bad interval names itself; in a forked child the methods do nothing."""
    import ctypes
    import socket
    import time

    for bad in ({"interval": 0}, {"interval": -1.5}):
        with pytest.raises(ValueError, match=f"interval must be > 0 seconds, got {bad['interval']}"):
            compiled.Beats(**bad)
    ours, theirs = socket.socketpair()
    theirs.settimeout(2)
    beats = compiled.Beats(0.05)
    beats.add(ours.fileno())
    beats.add(ours.fileno())  # (once only)
    ctypes.PyDLL(None).usleep(400_000)  # 0.4 s with the GIL held: about 8 beats go out meanwhile
    got = theirs.recv(4096)
    assert got.count(b"beat\n") >= 4 and got == b"beat\n" * got.count(b"beat\n"), got
    pid = os.fork()
    if pid == 0:  # the child's copy: no thread, and its calls change nothing
        beats.remove(ours.fileno())
        beats.stop()
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0
    assert theirs.recv(4096).startswith(b"beat\n")  # still beating for the parent
    beats.remove(ours.fileno())
    time.sleep(0.06)  # (a beat may have left just before the remove)
    theirs.setblocking(False)
    while True:
        try:
            theirs.recv(4096)
        except BlockingIOError:
            break
    time.sleep(0.2)
    with pytest.raises(BlockingIOError):
        theirs.recv(4096)
    beats.add(ours.fileno())
    beats.stop()
    time.sleep(0.2)
    with pytest.raises(BlockingIOError):
        theirs.recv(4096)
    ours.close()
    theirs.close()


def _locks():
    import threading
    return [pytest.param(threading.RLock, id="threading"),
            pytest.param(lambda: COMPILED.RLock(), id="compiled",
                         marks=pytest.mark.skipif(COMPILED is facts, reason=facts.status()))]


def test_divide_is_avgs_step_with_grad_off(compiled):
    """Divide(result, n), an async AVG's completion step (run by the compiled wait
    or called): result /= n in place, also on a parameter, its version bumped
    (autograd sees the change); the small-tensor loop gives div_'s quotients."""
    for t in (torch.arange(7, dtype=torch.float32), torch.arange(5000, dtype=torch.float64),
              torch.arange(9, dtype=torch.float16), torch.arange(24, dtype=torch.float32)[::3],
              torch.nn.Parameter(torch.arange(4, dtype=torch.float32))):
        expected, version = t.detach().clone().div_(3), t._version
        assert compiled.Divide(t, 3)() is None
        assert torch.equal(t.detach(), expected) and t._version > version, t
    with pytest.raises(ValueError, match="the divisor must be positive, got 0"):
        compiled.Divide(torch.ones(2), 0)
    with pytest.raises(TypeError):
        compiled.Divide([1.0], 2)


@pytest.mark.parametrize("make", _locks())
def test_engine_lock_behaves_as_threading_rlock(make):
    """csrc/engine.cpp's RLock (the engine's lock, which track() and finished() take without
    a call) does what threading.RLock does, side by side: reentrant, owned by one
    thread, a timeout and a non-blocking try, the same errors, and what
    threading.Condition needs (a wait gives back every hold and takes them again)."""
    import threading
    import time

    lock = make()
    assert lock.acquire() and lock.acquire(blocking=True) and lock._is_owned()
    lock.release()
    with lock:
        assert lock._is_owned()
    lock.release()
    assert not lock._is_owned()
    with pytest.raises(RuntimeError, match="cannot release un-acquired lock"):
        lock.release()
    with pytest.raises(ValueError, match="can't specify a timeout for a non-blocking call"):
        lock.acquire(False, 1)
    with pytest.raises(ValueError, match="timeout value must be positive"):
        lock.acquire(timeout=-2)
    with pytest.raises(ValueError, match="NaN"):
        lock.acquire(timeout=float("nan"))

    held, free, seen = threading.Event(), threading.Event(), {}

    def other():  # holds it until told; meanwhile its release from here must fail
        with lock:
            held.set()
            free.wait(10)
        lock.acquire()
        seen["released by another thread"] = None
        held.set()
    thread = threading.Thread(target=other)
    thread.start()
    assert held.wait(10)
    held.clear()
    assert not lock.acquire(False) and not lock._is_owned()
    start = time.monotonic()
    assert not lock.acquire(timeout=0.2)
    assert 0.15 < time.monotonic() - start < 5
    with pytest.raises(RuntimeError, match="cannot release un-acquired lock"):
        lock.release()
    free.set()
    assert held.wait(10)  # (the other thread took it again and keeps it)
    assert not lock.acquire(timeout=0.05)
    thread.join(10)

    lock = make()  # a Condition over it: wait() gives back both holds, then takes both again
    ready, box = threading.Condition(lock), []

    def waiter():
        with ready, lock:
            while not box:
                ready.wait(10)
            box.append(lock._is_owned())
        box.append(lock._is_owned())
    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.1)
    assert ready.acquire(timeout=10), "the waiter kept a hold of the lock while it waited"
    try:
        box.append("notified")
        ready.notify()
    finally:
        ready.release()
    thread.join(10)
    assert box == ["notified", True, False] and not thread.is_alive()


WAITS_WITHOUT_THE_GIL = """
import signal, sys, threading, time
from mcrdl import facts
lock = facts.load().RLock()
held, counted = threading.Event(), []
def holder():  # Python work under the lock: it needs the GIL while the main thread waits
    with lock:
        held.set()
        end = time.monotonic() + 0.3
        while time.monotonic() < end:
            counted.append(1)
threading.Thread(target=holder).start()
held.wait()
with lock:
    print("took it after", len(counted) > 1000)
def alarm(*_):
    raise TimeoutError("the handler ran")
signal.signal(signal.SIGALRM, alarm)
threading.Thread(target=lambda: (lock.acquire(), time.sleep(5)), daemon=True).start()
time.sleep(0.1)
signal.setitimer(signal.ITIMER_REAL, 0.2)
try:
    lock.acquire()
except TimeoutError as exc:
    print("interrupted:", exc)
"""


def test_engine_lock_waits_without_the_gil_and_for_signal_handlers(compiled):
    """A thread waiting for the compiled RLock lets the holder run Python (it would
    deadlock holding the GIL), and a signal handler that raises ends the wait
    with its error, as threading.RLock's does."""
    out = subprocess.run([sys.executable, "-c", WAITS_WITHOUT_THE_GIL], capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.splitlines() == ["took it after True", "interrupted: the handler ran"], out.stderr


def test_the_compiled_module_is_every_csrc_file_and_each_keys_its_build(monkeypatch):
    """csrc/module.cpp includes every other file of csrc/ (one translation unit,
    one file per concern), and editing any of them builds the module anew."""
    names = {n for n in os.listdir(facts.CSRC) if n.endswith(".cpp")} - {"module.cpp"}
    with open(facts.SOURCE) as f:
        included = re.findall(r'^#include "([^"]+)"$', f.read(), flags=re.M)
    assert sorted(included) == sorted(names) and len(included) == len(set(included))
    for name in names:
        with open(os.path.join(facts.CSRC, name)) as f:
            head = f.read(2000)
        assert "Mirrors:" in head and "Covered by:" in head, name  # (what it stands for, which tests)
    compiler = facts.cxx() or ["c++"]
    before = facts.build_target(compiler)
    real = facts.compiled.digest
    for name in names:
        monkeypatch.setattr(facts.compiled, "digest",
                            lambda path, edited=name: real(path) + ("+" if path.endswith(edited) else ""))
        assert facts.build_target(compiler) != before, name


def test_a_compiled_module_without_a_binding_is_refused_by_name(compiled):
    """Python and C are bound by name: a build that lacks a binding, or numbers
    the plan recipes otherwise, is an error naming it at load, not a silent
    pure-Python fallback; TorchMethod is made for a method by its name."""
    facts.check_bindings(compiled, "built")  # (the real module passes)
    lacking = types.SimpleNamespace(**{n: getattr(compiled, n) for n in facts.BINDINGS if n != "drive"})
    with pytest.raises(RuntimeError, match=r"built: the compiled module lacks drive \(csrc/ and facts.BINDINGS"):
        facts.check_bindings(lacking, "built")
    swapped = types.SimpleNamespace(**{n: getattr(compiled, n) for n in facts.BINDINGS})
    swapped.RECIPES = ("REDUCED", "KEY", *facts.RECIPES[2:])
    with pytest.raises(RuntimeError, match="the compiled recipes are"):
        facts.check_bindings(swapped, "built")
    assert "allreduce" in compiled.TORCH_METHODS and "wait" in compiled.TORCH_METHODS
    with pytest.raises(ValueError, match="no compiled form of method 'allgather_coalesced'"):
        compiled.TorchMethod(None, "allgather_coalesced", len, {}, object, len, {}, object)


def test_what_the_compiled_driver_reads_of_python_is_bound_by_name(compiled):
    """drive reads mcrdl.ops by name (setup) and Work by its slots' names
    (adopt_work): a name it needs that is gone, or a Work slot track() does not
    set, is an error naming it. Each case runs in a fresh process: setup and
    adopt_work replace what this process's runtime uses."""
    script = """
import sys, types
from mcrdl import facts, ops, work
m = facts.load()
lacking = types.ModuleType("ops")
lacking.__dict__.update({k: v for k, v in vars(ops).items() if k != "Plan"})
try:
    m.setup(lacking)
except AttributeError as e:
    print("setup:", e)
class Wider(work.Work):
    __slots__ = ("extra",)
Wider.__slots__ = work.Work.__slots__ + ("extra",)
try:
    m.adopt_work(Wider, work.RECEIVES)
except RuntimeError as e:
    print("adopt_work:", e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "setup: setup: mcrdl.ops has no Plan, which drive needs" in out.stdout, out.stdout + out.stderr
    assert "adopt_work: adopt_work: Work slot 'extra' is not one track() sets" in out.stdout, out.stdout + out.stderr
