"""Work handles and the progress engine shared by every backend.

Each backend turns an operation into a :class:`Pending` (its own request
object). The engine wraps it in a :class:`Work`, keeps every outstanding work
of every backend in one list, and enforces two rules:

* **Progress** (hazard 1): a wait never blocks inside one library while a
  work of another library that needs the caller's progress (MPI) is
  outstanding; it polls all of them instead.
* **Program order** (hazard 3): an operation whose tensors overlap a tensor of
  an outstanding work (one of the two writing it) waits for that work first.
"""
from __future__ import annotations

import math
import os
import threading
import time
import warnings
from typing import Callable, Iterable, Optional, Sequence

import torch

from . import facts, settings
from .types import CommError, CommTimeoutError, PeerDiedError


class Pending:
    """A backend's in-flight request. Subclasses override ``test`` and may
    override ``block`` and ``prepare_poll``.

    ``progress_domain`` names the library whose progress engine must be driven
    by the caller (``"mpi"``); ``None`` means the library progresses by itself.
    """

    progress_domain: Optional[str] = None
    #: A ``block`` that reached its deadline leaves the request to be waited for again.
    resumable_block = True
    #: CUDA: the stream the op was submitted on, ordered after its results when it
    #: completes (they may still be landing then); its completion steps run on it.
    #: None: the results are in place when the host sees it complete.
    stream = None
    __slots__ = ()  # subclasses on the hot path declare theirs: no per-request __dict__

    def test(self) -> bool:
        """Return True once the request is complete; never blocks."""
        raise NotImplementedError

    def block(self, deadline: float) -> bool:
        """Wait until complete or ``deadline`` (monotonic s); True if complete."""
        return spin_until(self.test, deadline)

    def prepare_poll(self) -> None:
        """Called before this request is polled instead of blocked on."""

    def cancel(self) -> None:
        """Best effort: withdraw a request that missed its deadline."""

    def source(self) -> int:
        """Group rank a completed receive from any source got its message from."""
        raise NotImplementedError

    def native_future(self) -> Optional[torch.futures.Future]:
        """A future the library itself completes, if it has a trustworthy one."""
        return None


class Done(Pending):
    """A request that completed at submission (e.g. zero-byte messages, or
    an op a backend ran to completion on the fast path: :data:`DONE`)."""

    __slots__ = ()

    def test(self) -> bool:
        return True

    def block(self, deadline: float) -> bool:
        return True


DONE = Done()


class AfterAll(Pending):
    """Completes when every one of ``works`` has; raises the first failure.
    The works are the engine's own, so polling the engine drives them.
    CUDA: ``stream`` is the one current when they were combined (their
    submitting stream), made to wait for every work's results, so the
    combined work's completion steps and waiters are ordered after them."""

    def __init__(self, engine: "Engine", works: Sequence["Work"]):
        self.engine = engine
        self.works = works
        self.stream = None
        for w in works:  # another thread may finish w meanwhile: its pending is read once
            pending = w._pending
            stream = w._stream if pending is None else pending.stream
            if stream is not None:
                self.stream = current_stream(stream.device_index)
                break

    def block(self, deadline: float) -> bool:
        return spin_until(lambda: (self.engine.poll(), self.test())[1], deadline)

    def test(self) -> bool:  # called from Engine.poll: must not poll itself
        if not all(w._done for w in self.works):
            return False
        for w in self.works:
            if w._error is not None:
                raise w._error
        if self.stream is not None:
            for w in self.works:
                if w._stream is not None and w._stream != self.stream:
                    self.stream.wait_stream(w._stream)
        return True


_STREAMS: dict = {}


def current_stream(index: int) -> "torch.cuda.Stream":
    """The calling thread's current CUDA stream on device ``index``: what
    ``torch.cuda.current_stream(index)`` returns, asked the way it asks
    (``torch._C._cuda_getCurrentStream``, 0.19 µs against its 1.73 µs on an
    H100, docs/results/gpu.md) and kept, so asking again returns the same
    object. For CUDA tensors only: CUDA is initialised by then."""
    key = torch._C._cuda_getCurrentStream(index)
    stream = _STREAMS.get(key)
    if stream is None:  # (id, device index, device type): a Stream is those three, nothing more
        if len(_STREAMS) >= 1024:  # (external streams come and go)
            _STREAMS.clear()
        stream = _STREAMS[key] = torch.cuda.Stream(stream_id=key[0], device_index=key[1], device_type=key[2])
    return stream


def on_stream(stream, fn: Callable, *args):
    """``fn(*args)`` with the CUDA ``stream`` current for its device. On the
    thread's current device the stream is swapped in and out directly (what
    ``torch.cuda.stream`` does, without its per-call device and availability
    checks); a stream of another device goes through torch's context managers,
    which restore the thread's device without making a context on GPU 0 for a
    thread that never used it."""
    index = stream.device_index
    current = current_stream(index)
    if current == stream:  # as for a blocking op waited for where it was started
        return fn(*args)
    if torch._C._cuda_getDevice() != index:
        with torch.cuda.device(stream.device), torch.cuda.stream(stream):
            return fn(*args)
    set_stream = torch._C._cuda_setStream
    set_stream(stream_id=stream.stream_id, device_index=index, device_type=stream.device_type)
    try:
        return fn(*args)
    finally:
        set_stream(stream_id=current.stream_id, device_index=index, device_type=current.device_type)


def order_current_after(stream) -> None:
    """Make the calling thread's current stream (of ``stream``'s device) wait
    for the work queued on ``stream`` so far (torch's ``Work.wait()`` contract)."""
    current = current_stream(stream.device_index)
    if current != stream:
        current.wait_stream(stream)


def run_post(post: Sequence[Callable[[], None]]) -> None:
    """Completion steps (copy-back, unpacking, AVG divide): not autograd ops,
    so they also work on leaf tensors that require grad (parameters)."""
    if post:
        enabled = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)  # torch.no_grad() costs ~1 us per use
        try:
            for fn in post:
                fn()
        finally:
            torch._C._set_grad_enabled(enabled)


#: Seconds a work not tied to a group may take, and init_process_group's default timeout
#: (torch.distributed's default).
DEFAULT_TIMEOUT = 1800.0

#: Buffers of requests still pending at shutdown: kept alive past MPI_Finalize,
#: which may still deliver into them.
_LEAKED: list = []

#: How long destroying the process group waits for the futures thread's callbacks.
FUTURES_JOIN_S = 10.0
#: How long the futures thread waits for another work before it ends.
FUTURES_LINGER_S = 1.0
#: Longest a wait blocks inside one library before it looks whether the
#: watchdog found a member of the op's group dead.
WATCH_S = 0.1
#: How long work outstanding when a peer died may still complete before it fails.
DEATH_GRACE_S = 0.3
#: Tests of one MPI request per turn of a wait for it, under the engine lock,
#: with the spin policy (with yield, a turn is one test: the peer may need the core).
TEST_BURST = 16


#: MCRDL_WAIT's choices: how a wait uses the CPU while the library works.
WAIT_POLICIES = ("auto", "spin", "yield")
#: How long a wait under the spin policy polls before it yields (a long wait).
SPIN_S = 1e-3
_busy_s = 0.0  # set by set_wait_policy: 0 polls FIRST_POLLS times, then yields
#: Polls a wait makes before it looks at the clock (and, under the yield policy,
#: gives up the CPU): a Python poll takes ~1 µs, 10x a poll in mpi_native.c
#: (its FIRST_POLLS is 200), so 20 here busy about as long.
FIRST_POLLS = 20
_burst = 1  # set by set_wait_policy: tests per turn of a wait for one MPI request


def wait_policy_from_env() -> str:
    """``MCRDL_WAIT`` (default auto), checked."""
    policy = settings.get("MCRDL_WAIT")
    if policy not in WAIT_POLICIES:
        raise ValueError(f"MCRDL_WAIT={policy!r}: expected one of {', '.join(WAIT_POLICIES)}")
    return policy


def set_wait_policy(policy: str, local_ranks: int, local_cpus: Optional[int] = None) -> str:
    """Make every wait ``spin`` (busy-poll for :data:`SPIN_S`, then yield: no
    scheduler latency when each rank has a core) or ``yield`` (yield the CPU
    after the first polls: ranks sharing cores let the peer run); ``auto``:
    spin when this host's ``local_ranks`` fit in ``local_cpus``, the CPUs its
    ranks may run on together (default: this process's). Returns the policy in force."""
    global _busy_s, _burst
    if policy == "auto":
        cpus = local_cpus if local_cpus is not None else len(os.sched_getaffinity(0))
        policy = "spin" if local_ranks <= cpus else "yield"
    _busy_s = SPIN_S if policy == "spin" else 0.0
    _burst = TEST_BURST if policy == "spin" else 1
    return policy


def busy_seconds() -> float:
    """How long a wait polls before yielding (0: only the first polls)."""
    return _busy_s


def spin_until(test: Callable[[], bool], deadline: float) -> bool:
    """Poll ``test`` until it succeeds (True) or ``deadline`` passes (False).

    Busy for the first polls (microsecond latency; under the spin policy for
    :data:`SPIN_S`), then yielding the CPU (a descheduled peer gets to run).
    Under the yield policy (ranks share cores), after 5 ms it sleeps between
    polls instead (with a sleep between polls, Open MPI's nonblocking
    collectives, which move only inside their test calls, crawl: a 64 MiB
    reduce took 7.6 s against 85 ms raw, docs/results/openmpi.md); under spin
    it never sleeps. mpi_native.c's wait follows the same schedule."""
    spins = 0
    start = None
    while not test():
        spins += 1
        if spins < FIRST_POLLS:
            continue
        now = time.monotonic()
        if now > deadline:
            return False
        if start is None:
            start = now
        waited = now - start
        if waited < _busy_s:
            continue
        if _busy_s or waited < 0.005:
            os.sched_yield()
        else:
            time.sleep(5e-5 if waited < 0.1 else 1e-3)
    return True


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device:
        return False
    (s1, e1), (s2, e2) = facts.extent(a), facts.extent(b)
    return s1 < e2 and s2 < e1


def _conflict(new: list, old: list) -> bool:
    """Do two ops' ranges overlap with at least one of the two writing?"""
    return any(d1 == d2 and s1 < e2 and s2 < e1 and (w1 or w2)
               for d1, s1, e1, w1 in new for d2, s2, e2, w2 in old)


#: Ops whose Work keeps its Pending after completion (``source_rank``).
RECEIVES = frozenset({"recv", "irecv"})


def _finished(work: "Work", burst: int, turns: int) -> bool:
    """csrc/engine.cpp's ``finished`` where compiled (its fast case of :meth:`Work.wait`);
    here nothing is: the Python wait does it all."""
    return False


class Work:
    """Handle of an operation on any backend (``torch.distributed.Work``-like)."""

    # (csrc/engine.cpp's track() makes async works from a plan and sets every slot, as
    # __init__ does; finished() completes them as _finish does: a new slot goes there too,
    # or adopt_work refuses this class, naming it)
    __slots__ = ("op", "backend", "group", "peer", "_engine", "_pending", "_post", "_reads", "_writes",
                 "_deadline", "_done", "_error", "_result", "_future", "_settled", "_spans", "_stream")

    def __init__(self, engine: "Engine", op: str, backend: str, pending: Pending,
                 reads: Sequence[torch.Tensor] = (), writes: Sequence[torch.Tensor] = (),
                 post: Sequence[Callable[[], None]] = (), group=None,
                 result: Sequence[torch.Tensor] = ()):
        self.op = op
        self.backend = backend
        self.group = group  # its deadline is the group's timeout after submission
        self.peer = -1  # a receive's named source (group rank; -1: any, its pending names the sender)
        self._engine = engine
        self._pending = pending
        self._post = post
        self._reads = reads
        self._writes = writes
        self._deadline = time.monotonic() + (DEFAULT_TIMEOUT if group is None else group.timeout)
        self._done = False
        self._error: Optional[BaseException] = None
        self._result = list(result)
        self._future: Optional[torch.futures.Future] = None
        self._settled = False  # the future was given its value
        self._spans: Optional[tuple] = None  # facts.ranges(reads, writes), computed once when needed
        self._stream = None  # CUDA: the stream its results are ordered on (Pending.stream), once done

    def __repr__(self) -> str:
        state = "failed" if self._error else ("done" if self._done else "pending")
        return f"<mcrdl.Work {self.op} on {self.backend}: {state}>"

    def is_completed(self) -> bool:
        """True once the operation finished (drives progress of all backends)."""
        if not self._done:
            self._engine.poll()
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self) -> Optional[BaseException]:
        return self._error

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until done, progressing every backend; raise on failure.

        Without ``timeout`` the group's deadline applies (its timeout counted
        from submission) and a work that misses it is failed for good (its
        peers are presumed dead or stuck); the error says which peers are
        missing. With ``timeout`` a :class:`CommTimeoutError` is raised but the
        work stays outstanding: it can be waited for again. CUDA tensors: the
        caller's current stream is ordered after the results, as with torch."""
        if not self._done and timeout is None:
            try:  # (an MPI request the compiled path completes, when it is done by now)
                if _finished(self, _burst, FIRST_POLLS):
                    return True
            except Exception as exc:  # the library failed
                self._engine._retire(self, exc)
        if not self._done:
            if timeout is None:
                self._engine.wait(self, self._deadline)
            else:
                seconds = _seconds(timeout)
                if not self._engine.wait(self, time.monotonic() + seconds, abandon=False):
                    raise CommTimeoutError(f"{self.op} on backend '{self.backend}' did not complete "
                                           f"within {seconds:.3g} s (still outstanding: wait again)")
        if self._error is not None:
            raise self._engine.explain(self)
        if self._stream is not None:
            order_current_after(self._stream)
        return True

    def result(self) -> list[torch.Tensor]:
        """The output tensors (after :meth:`wait`)."""
        return self._result

    def source_rank(self) -> int:
        """Global rank the message came from (a completed receive; with ``src=None``
        the one that matched)."""
        if not self._done or self._error is not None or self.op not in RECEIVES:
            raise RuntimeError(f"source_rank: only a receive that completed has a source ({self!r})")
        return self.group.ranks[self.peer if self.peer >= 0 else self._pending.source()]

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` completed with :meth:`result` when done.

        The engine's futures thread polls every backend until the work
        completes, so the future completes even when nobody else drives
        progress (as DDP communication hooks require); it never blocks inside
        one library. Callbacks (``then``) run on the thread that completes the
        work, usually that one, as torch's run on its backends' threads: while
        one runs, no other future completes, so a callback must not wait for
        another mcrdl future (``Work.wait()`` is fine: it drives progress)."""
        with self._engine._lock:
            if self._future is not None:
                return self._future
            fut = self._future = torch.futures.Future()
            done = self._done
        if done:
            self._settle_future()
        else:
            self._engine.watch(self)
        return fut

    def _settle_future(self) -> None:
        """Complete the future (never under the engine lock: callbacks may issue ops)."""
        with self._engine._lock:
            fut = self._future
            if fut is None or self._settled or not self._done:
                return
            self._settled = True  # exactly one thread settles it
        if self._error is not None:
            fut.set_exception(self._engine.explain(self))
        else:
            fut.set_result(self._result)

    def _finish(self, error: Optional[BaseException] = None) -> None:
        """Mark done: run completion steps; the caller settles the future.
        ``error``: what the library raised (or a CommError of mcrdl's own)."""
        in_library = error is not None and not isinstance(error, CommError)
        stream = self._stream = self._pending.stream
        if error is None:
            try:
                if stream is None or not self._post:
                    run_post(self._post)
                else:  # after the results on the stream they land on, whichever thread this is
                    on_stream(stream, run_post, self._post)
            except Exception as exc:  # surfaced on wait()
                error = exc
        if error is not None and not isinstance(error, CommError):
            wrapped = CommError(f"{self.op} on backend '{self.backend}' failed: {error}")
            wrapped.__cause__ = error
            wrapped.in_library = in_library  # the library failed: a peer may be gone
            error = wrapped
        self._error = error
        self._done = True
        if self.op not in RECEIVES:  # a receive's pending still names its sender
            self._pending = None
        self._post = ()


def _seconds(timeout) -> float:
    """Seconds from a number or a timedelta."""
    if hasattr(timeout, "total_seconds"):
        return timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise ValueError(f"timeout must be a number of seconds or a timedelta, got {timeout!r}")
    return float(timeout)


class Engine:
    """Tracks outstanding work of all backends and drives their progress.

    Requests are tested under one lock, so the futures thread and the
    caller never test the same MPI request at once; futures are completed
    outside it, since their callbacks may issue new operations."""

    # (csrc/engine.cpp reads outstanding, lost, _lock and _domains at their slots' offsets)
    __slots__ = ("outstanding", "_lock", "_abandoned", "on_failure", "_watched", "_watcher", "_arrived",
                 "_signalled", "_fresh", "_closing", "lost", "_ranges", "_domains")

    def __init__(self) -> None:
        compiled = facts.load()
        self.outstanding: list[Work] = []
        # (csrc/engine.cpp's track() and finished() take only its own RLock: without it they leave the work to Python)
        self._lock = threading.RLock() if compiled is facts else compiled.RLock()
        self._abandoned: list = []  # (pending, buffers) of requests that missed a deadline
        #: Told once of each work that timed out or that its library failed,
        #: before the error reaches the user; returns a sentence on the state
        #: of the work's peers, added to the error.
        self.on_failure: Optional[Callable[[Work], str]] = None
        #: Works whose futures the futures thread completes, each with whether its
        #: library signals completion itself (then the thread sleeps until it does).
        self._watched: list[tuple[Work, bool]] = []
        self._watcher: Optional[threading.Thread] = None  # the futures thread, while it runs
        self._arrived = threading.Condition(self._lock)  # a work to watch, or shutdown
        self._signalled = threading.Event()  # a library's own future fired
        self._fresh = False  # a work arrived since the futures thread's spin began
        self._closing = False
        self.lost: dict[int, tuple] = {}  # global rank -> (how it died, when): the watchdog's
        self._ranges = compiled.ranges  # compiled: None for what only facts.ranges reads
        global _finished
        _finished = getattr(compiled, "finished", _finished)
        if compiled is not facts:
            compiled.adopt_work(Work, RECEIVES)
            facts.provided("threading.RLock as the engine's lock", "RLock (csrc/engine.cpp)")
            facts.provided("work._finished (Work.wait's common case)", "finished (csrc/engine.cpp)")
            facts.provided("facts.ranges (async ops' memory)", "ranges (csrc/tensor_facts.cpp)")
        self._domains: frozenset = frozenset()  # progress domains of every work ever tracked

    # -- futures ---------------------------------------------------------------
    def watch(self, work: Work) -> None:
        """Have the futures thread complete ``work`` and settle its future;
        the thread starts if none runs (one per engine: a thread costs ~170 µs
        to start here, more than most ops)."""
        pending = work._pending
        native = pending.native_future() if pending is not None else None
        if native is not None:  # the library signals completion: the thread may sleep until then
            native.then(lambda _: self._signalled.set())
        with self._lock:
            self._watched.append((work, native is not None))
            self._fresh = True
            if self._watcher is not None:
                self._arrived.notify()
                return
            thread = threading.Thread(target=self._watch, daemon=True, name="mcrdl-futures")
            thread.start()  # (under the lock: shutdown never joins one not yet started)
            self._watcher = thread

    def _watch(self) -> None:
        """The futures thread: turns of :meth:`_watch_turn` on the wait
        policy's schedule (anew for each work that arrives) while works are
        watched, then :data:`FUTURES_LINGER_S` for more before it ends."""
        try:
            while True:
                with self._lock:
                    if not self._watched and not self._closing:
                        self._arrived.wait(FUTURES_LINGER_S)
                    if not self._watched:
                        return
                    self._fresh = False
                spin_until(self._watch_turn, math.inf)
        finally:  # (also if a turn raised: the next watch() starts a thread)
            with self._lock:
                if self._watcher is threading.current_thread():
                    self._watcher = None

    def _watch_turn(self) -> bool:
        """Drive progress once (after sleeping until a library's own future
        fires, up to 1 ms, when every watched work has one and none needs the
        caller's progress), fail watched works past their deadline, settle the
        futures of those done. True: nothing left, or a new work arrived."""
        with self._lock:
            watched = self._watched
        if all(native for w, native in watched if not w._done) and not self.needs_progress():
            self._signalled.wait(0.001)
            self._signalled.clear()
        self.poll()
        now = time.monotonic()
        for work, _ in watched:
            try:
                if not work._done and now > work._deadline:
                    self._abandon(work)
                if work._done:
                    work._settle_future()
            except Exception as exc:  # the failure hook raised, or the user completed the future
                with self._lock:
                    fut, settled = work._future, work._settled
                    work._settled = True  # the thread does not try again
                if not settled and not fut.done():
                    fut.set_exception(exc)
        with self._lock:
            self._watched = [e for e in self._watched if not e[0]._settled]
            return not self._watched or self._fresh

    def explain(self, work: Work) -> BaseException:
        """``work``'s error, with (once) what ``on_failure`` says of its peers."""
        error = work._error
        if (self.on_failure is not None and not getattr(error, "explained", False)
                and (isinstance(error, CommTimeoutError) or getattr(error, "in_library", False))):
            error.explained = True
            note = self.on_failure(work)
            if note:
                error.args = (f"{error.args[0]}; {note}", *error.args[1:])
        return error

    def shutdown(self) -> None:
        """Fail what is still outstanding and release abandoned requests;
        buffers of requests that cannot be withdrawn are kept alive."""
        with self._lock:
            works, self.outstanding = self.outstanding, []
            for work in works:
                if not work._done:  # (abandoned ones were withdrawn once already: not again)
                    work._pending.cancel()
                    self._abandoned.append((work._pending, work._reads, work._writes, work._result))
                    work._finish(CommError(f"{work.op} on backend '{work.backend}': the process "
                                           "group was destroyed before it completed"))
        deadline = time.monotonic() + 0.5
        while self._abandoned and time.monotonic() < deadline:
            with self._lock:  # (the futures thread may be polling them too)
                self._test_abandoned()
        _LEAKED.extend(self._abandoned)
        self._abandoned = []
        for work in works:
            work._settle_future()
        self._join_watcher()

    def _join_watcher(self) -> None:
        """Stop the futures thread, waiting for the callbacks it runs. One
        still inside ``Future.set_result`` when the interpreter finalizes
        cannot take the GIL back and aborts the process."""
        with self._lock:
            self._closing = True
            self._arrived.notify()
            thread = self._watcher
        if thread is None or thread is threading.current_thread():
            return
        thread.join(FUTURES_JOIN_S)
        if thread.is_alive():
            warnings.warn(f"mcrdl: future callbacks still running {FUTURES_JOIN_S:.0f} s after "
                          "the process group was destroyed; the process may abort at exit",
                          RuntimeWarning, stacklevel=2)

    # -- dead peers ----------------------------------------------------------------
    def note_death(self, rank: int, how: str) -> None:
        """The watchdog saw global rank ``rank`` die: new work on its groups fails
        at once; outstanding work still running :data:`DEATH_GRACE_S` later fails
        then (:meth:`fail_for_death`; a rank that exits without leaving cleanly
        may have done its part of an op its peers are still completing)."""
        self.lost = {**self.lost, rank: (how, time.monotonic())}  # replaced, never mutated

    def fail_for_death(self, rank: int) -> None:
        """Fail the outstanding work of every group ``rank`` belongs to."""
        with self._lock:
            hit = [w for w in self.outstanding if w.group is None or rank in w.group.ranks]
        for work in hit:
            self._withdraw(work, self._died_error(work.op, work.backend, work.group))

    def deaths(self, group, before: float = float("inf")) -> list[str]:
        """How the members of ``group`` the watchdog found dead (before ``before``) died."""
        return [how for r, (how, when) in self.lost.items()
                if when <= before and (group is None or r in group.ranks)]

    def _died_error(self, op: str, backend: str, group,
                    before: float = float("inf")) -> Optional[PeerDiedError]:
        """The error of an op on ``group`` if a member died (before ``before``)."""
        dead = self.deaths(group, before)
        if not dead:
            return None
        return PeerDiedError(f"{op} on backend '{backend}' failed: " + "; ".join(dead))

    def _block_watched(self, pending: Pending, deadline: float, op: str, backend: str,
                       group) -> bool:
        """``pending.block(deadline)`` in slices of :data:`WATCH_S` (a completed
        op returns within the first), raising :class:`PeerDiedError` between
        slices: a dead or frozen peer fails the op, in every library. MPI
        needs it too: under a launcher other than MPI's, nobody ends an MPI job
        whose rank died, and no launcher ends one whose rank froze. Not sliced:
        requests a timed-out wait would fail (gloo send/recv, whose peer's
        death the library sees itself)."""
        if not pending.resumable_block:
            return pending.block(deadline)
        while True:
            step = min(deadline, time.monotonic() + WATCH_S)
            if pending.block(step):
                return True
            if step >= deadline:
                return False
            if self.lost:
                error = self._died_error(op, backend, group, time.monotonic() - DEATH_GRACE_S)
                if error is not None:
                    raise error

    # -- submission -------------------------------------------------------------
    def order_before(self, reads: Iterable[torch.Tensor], writes: Iterable[torch.Tensor],
                     op: str) -> Optional[tuple]:
        """Wait for outstanding works that conflict with a new op's tensors.
        Returns the op's :func:`facts.ranges` (None when nothing was
        outstanding), which :meth:`run` can keep for the op's Work."""
        if not self.outstanding:
            return None
        ranges = self._ranges
        checked = ranges(reads, writes) or facts.ranges(reads, writes)
        low, high, new = checked
        for work in list(self.outstanding):
            if work._done:
                continue
            spans = work._spans
            if spans is None:
                spans = work._spans = ranges(work._reads, work._writes) or facts.ranges(work._reads, work._writes)
            if low < spans[1] and spans[0] < high and _conflict(new, spans[2]):
                try:
                    work.wait()
                except CommError as exc:
                    raise CommError(f"{op} cannot start: an earlier {work.op} on "
                                    f"'{work.backend}' touching the same tensor failed: {exc}") from exc
        return checked

    def drain(self) -> None:
        """Wait for every outstanding work (a barrier orders after them)."""
        for work in list(self.outstanding):
            work.wait()

    def run(self, op: str, backend: str, pending: Pending, reads, writes, post, group,
            result, async_op: bool, spans: Optional[tuple] = None) -> Optional[Work]:
        """Track a started operation: return its Work (``async_op``) or wait for it.

        A blocking op that may block in its own library (nothing outstanding
        that needs another library's progress) is waited for without creating
        a Work or taking a lock: nobody else can see its request. ``spans``:
        the op's ranges, if :meth:`order_before` just computed them."""
        if not async_op and (not self.outstanding or self._blocking_is_safe(pending)):
            self.block(op, backend, pending, group, reads, writes, post, result)
            return None
        if self.lost:
            self._refuse_if_died(op, backend, pending, group, reads, writes, result)
        work = Work(self, op, backend, pending, reads, writes, post, group, result)
        work._spans = spans
        domain = pending.progress_domain
        with self._lock:
            if domain is not None and domain not in self._domains:
                self._domains = self._domains | {domain}  # replaced, never mutated
            self.outstanding.append(work)
        if async_op:
            return work
        work.wait()
        return None

    def block(self, op: str, backend: str, pending: Pending, group, reads: Sequence[torch.Tensor],
              writes: Sequence[torch.Tensor] = (), post: Sequence[Callable[[], None]] = (),
              result: Sequence[torch.Tensor] = ()) -> None:
        """Wait for a blocking op inside its own library (the caller checked
        that nothing outstanding needs another library's progress), then run
        ``post``. ``reads``/``writes``: what it touches, kept alive if it is abandoned."""
        if self.lost and pending is not DONE:  # (DONE: it ran to completion in its start)
            self._refuse_if_died(op, backend, pending, group, reads, writes, result)
        try:
            if self._block_watched(pending, time.monotonic() + group.timeout, op, backend, group):
                if post:
                    run_post(post)
                return
        except PeerDiedError:
            self._drop(pending, (reads, writes, result))
            raise
        except Exception as exc:
            work = Work(self, op, backend, pending, reads, writes, post, group, result)
            work._finish(exc)
            raise self.explain(work) from exc
        work = Work(self, op, backend, pending, reads, writes, post, group, result)
        self._abandon(work)
        raise self.explain(work)

    def _refuse_if_died(self, op, backend, pending, group, reads, writes, result) -> None:
        """Raise :class:`PeerDiedError` for a just-started op on a group with a
        dead member; its request is withdrawn and its buffers kept alive."""
        error = self._died_error(op, backend, group)
        if error is not None:
            self._drop(pending, (reads, writes, result))
            raise error

    def _drop(self, pending: Pending, buffers: tuple) -> None:
        """Withdraw a request nobody will wait for, where the library allows;
        it is polled until gone, its ``buffers`` kept alive meanwhile."""
        pending.cancel()
        with self._lock:
            self._abandoned.append((pending, *buffers))

    # -- progress ---------------------------------------------------------------
    def poll(self) -> None:
        """Test every outstanding work once; finish those that completed."""
        if not self.outstanding and not self._abandoned:
            return
        finished = []
        with self._lock:
            for work in list(self.outstanding):
                if work._done:
                    continue
                try:
                    done = work._pending.test()
                except Exception as exc:  # the library reported failure
                    work._finish(exc)
                    finished.append(work)
                    continue
                if done:
                    work._finish()
                    finished.append(work)
            # rebuilt, not replaced by a snapshot: posts may have added works
            self.outstanding = [w for w in self.outstanding if not w._done]
            if self._abandoned:
                self._test_abandoned()
        for work in finished:
            if work._future is not None:
                work._settle_future()

    def _test_abandoned(self) -> None:
        still = []
        for entry in self._abandoned:
            try:
                if not entry[0].test():
                    still.append(entry)
            except Exception:  # the library gave up on it: buffers are free
                pass
        self._abandoned = still

    def needs_progress(self) -> bool:
        """Is any outstanding work in a library that progresses only when polled?"""
        return any(w._pending is not None and w._pending.progress_domain is not None
                   for w in self.outstanding)

    def _blocking_is_safe(self, pending: Pending) -> bool:
        """May we block inside ``pending``'s library without starving another?"""
        mine, domains = pending.progress_domain, self._domains
        if not domains or (len(domains) == 1 and mine in domains):  # no other domain was ever outstanding
            return True
        for work in self.outstanding:
            p = work._pending
            if p is not None and p.progress_domain is not None and p.progress_domain != mine:
                return False
        return True

    def _test_one(self, work: Work) -> bool:
        """Test ``work`` under the lock, up to :data:`TEST_BURST` times with
        the spin policy (a turn of Python per test costs more than MPI's
        progress in it: async all_reduce 16 KiB, 1.51x -> 1.34x raw)."""
        with self._lock:
            if work._done:
                return True
            test = work._pending.test
            if not test():  # (most are done at the first test: no loop for them)
                for _ in range(_burst - 1):
                    if test():
                        break
                else:
                    return False
            try:
                self.outstanding.remove(work)
            except ValueError:  # (already dropped)
                pass
            work._finish()
        if work._future is not None:  # (set under the lock before _done, or it settles itself)
            work._settle_future()
        return True

    def wait(self, work: Work, deadline: float, abandon: bool = True) -> bool:
        """Wait for ``work`` until ``deadline`` (monotonic s), progressing every
        backend; True once it is done (possibly failed).

        It blocks inside the work's own library only for the group deadline
        (``abandon``) and when no other library needs the caller's progress;
        otherwise it polls everything. At the deadline ``abandon`` fails the
        work for good; else False is returned and the work stays outstanding."""
        pending = work._pending
        if pending is None:
            return True
        try:
            if abandon and self._blocking_is_safe(pending):
                if pending.progress_domain is None:  # self-progressing library
                    done = self._block_watched(pending, deadline, work.op, work.backend, work.group)
                    if done:
                        self._retire(work)
                else:  # (one test before building the poll loop: in a batch most are done by their turn)
                    done = self._test_one(work) or spin_until(lambda: self._test_one(work), deadline)
            else:
                pending.prepare_poll()
                done = spin_until(lambda: (self.poll(), work._done)[1], deadline)
        except Exception as exc:
            self._retire(work, exc)
            return True
        if not done and abandon:
            self._abandon(work)
            return True
        return done

    def _retire(self, work: Work, error: Optional[BaseException] = None) -> None:
        with self._lock:
            if work._done:
                return
            if work in self.outstanding:
                self.outstanding.remove(work)
            work._finish(error)
        if work._future is not None:
            work._settle_future()

    def _abandon(self, work: Work) -> None:
        """Fail a work that missed its group deadline."""
        timeout = DEFAULT_TIMEOUT if work.group is None else work.group.timeout
        self._withdraw(work, CommTimeoutError(
            f"{work.op} on backend '{work.backend}' did not complete within the group's "
            f"timeout of {timeout:.3g} s"))

    def _withdraw(self, work: Work, error: BaseException) -> None:
        """Fail ``work`` for good with ``error``; its request is dropped (:meth:`_drop`)."""
        with self._lock:
            if work._done:
                return
            self._drop(work._pending, (work._reads, work._writes, work._result))
        self._retire(work, error)
