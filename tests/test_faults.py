"""Dead and stuck peers (hazard 6): every surviving rank ends with an error
naming the op, the backend and, where it can be known, the missing peer,
within the timeout; no job hangs.

A killed rank is tested over gloo with ranks started directly (as a launcher
that keeps survivors alive would): under mpiexec, MPICH ends the whole job as
soon as a rank dies (it has no fault tolerance), which is tested too.
"""
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import FORKED, JOBS
from mcrdl.launcher import free_port
from mcrdl.work import DONE, Engine

TIMEOUT = 4.0  # group timeout inside the jobs (s)
HEARTBEAT = 0.25
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "FAULT_TIMEOUT": str(TIMEOUT),
       "MCRDL_HEARTBEAT_S": str(HEARTBEAT)}
# Slack over the timeout: the heartbeat settle window plus a loaded 2-core machine.
SLACK = 4.0
OPS = ("all_reduce", "broadcast", "recv")
KILL_SLACK = 1.0  # a loaded 2-core machine, over the watchdog's second


def _reports(report_dir: Path) -> dict:
    return {int(f.stem[4:]): [json.loads(line) for line in f.read_text().splitlines()]
            for f in report_dir.glob("rank*.jsonl")}


def _check(reports: dict, survivors, backend: str, peer_note, limit: float = TIMEOUT + SLACK) -> None:
    """Every survivor's errors name op, backend and (one of) ``peer_note`` within ``limit`` s."""
    notes = (peer_note,) if isinstance(peer_note, str) else peer_note
    assert sorted(reports) == sorted(survivors), reports
    times = [t for errors in reports.values() for t, _ in errors]
    print(f"errors on ranks {sorted(reports)}: {len(times)}, longest time to error {max(times):.2f} s")
    for rank, errors in reports.items():
        assert errors, f"rank {rank} saw no error"
        for seconds, message in errors:
            assert seconds <= limit, (rank, seconds, message)
            assert any(op in message for op in OPS), message
            names = ("mpi", "gloo") if backend == "mixed" else (backend,)
            assert any(f"backend '{b}'" in message for b in names), message
            assert any(note in message for note in notes), message


def _spawn(n: int, args, report_dir: Path, timeout: float = 60, frozen: int = -1) -> None:
    """Ranks as separate processes with torchrun's environment, and no agent
    that kills the survivors when one dies. Rank ``frozen`` (stopped by
    SIGSTOP) is killed once the others have reported, as a launcher would."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, FORKED, str(JOBS / "faults_job.py"), *args, str(report_dir)],
                              env={**ENV, "RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(n),
                                   "LOCAL_WORLD_SIZE": str(n), "MASTER_ADDR": "127.0.0.1",
                                   "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(n)]
    deadline = time.monotonic() + timeout
    try:
        if frozen >= 0:
            while (len(list(report_dir.glob("done*"))) < n - 1 and time.monotonic() < deadline
                   and all(p.poll() is None for r, p in enumerate(procs) if r != frozen)):
                time.sleep(0.1)
            procs[frozen].kill()
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        out = "".join(p.communicate()[0] for p in procs)
        pytest.fail(f"job hung:\n{out[-4000:]}")


def _mpiexec(n: int, args, report_dir: Path, extra=()) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "mcrdl.cli", "run", "-n", str(n), "--timeout", "90", *extra, FORKED,
           str(JOBS / "faults_job.py"), *args, str(report_dir)]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120)


@pytest.mark.parametrize("nprocs,when,victim", [
    (2, "collective", 1), (2, "async", 1), (2, "between", 1), (2, "collective", 0), (2, "p2p", 1),
    (4, "collective", 2), (4, "async", 1), (4, "between", 3), (4, "async", 0)])
def test_killed_rank_is_named_by_every_survivor(tmp_path, nprocs, when, victim):
    """The watchdog names the dead rank within a second of its death (0.5 s into
    the step), long before the timeout; a library that sees the broken connection
    first gets the heartbeats' verdict (for rank 0, the store's host, its store)."""
    _spawn(nprocs, ["gloo", when, "kill", str(victim)], tmp_path)
    notes = (f"rank {victim} died (its process ended)",
             "rank 0, which serves it, is probably dead" if victim == 0
             else f"not responding (dead or frozen): rank {victim} ")
    _check(_reports(tmp_path), [r for r in range(nprocs) if r != victim], "gloo", notes,
           limit=0.5 + 1.0 + KILL_SLACK)


def test_without_the_watchdog_a_killed_rank_is_named_at_the_timeout(tmp_path, monkeypatch):
    """MCRDL_WATCHDOG=0: a dead rank that is not a survivor's gloo neighbour is
    noticed only when the survivor's op times out (the reason for the watchdog)."""
    monkeypatch.setitem(ENV, "MCRDL_WATCHDOG", "0")
    _spawn(4, ["gloo", "collective", "kill", "2"], tmp_path)
    reports = _reports(tmp_path)
    _check(reports, [0, 1, 3], "gloo", "not responding (dead or frozen): rank 2 ")
    assert max(t for errs in reports.values() for t, _ in errs) >= TIMEOUT * 0.9


def test_without_the_watchdog_a_dead_store_host_is_named_by_every_survivor(tmp_path, monkeypatch):
    """MCRDL_WATCHDOG=0, rank 0 (which serves the store) killed: the survivors
    learn it only from the lost store, and every one of them knows whose it was."""
    monkeypatch.setitem(ENV, "MCRDL_WATCHDOG", "0")
    _spawn(3, ["gloo", "collective", "kill", "0"], tmp_path)
    _check(_reports(tmp_path), [1, 2], "gloo", "rank 0, which serves it, is probably dead")


@pytest.mark.parametrize("nprocs,victim", [(3, 1), (2, 0)])
def test_frozen_rank_is_named_by_every_survivor_long_before_the_timeout(tmp_path, monkeypatch,
                                                                        nprocs, victim):
    """SIGSTOP (a node stuck in I/O or swapping): the rank's heartbeats stop
    with it, and with MCRDL_FROZEN_S=2 every survivor names it about 2 s
    after, with a group timeout of 60 s. Rank 0 frozen freezes the store too:
    the others find it from its silence on their own connection."""
    monkeypatch.setitem(ENV, "MCRDL_FROZEN_S", "2")
    monkeypatch.setitem(ENV, "FAULT_TIMEOUT", "60")
    _spawn(nprocs, ["gloo", "collective", "freeze", str(victim)], tmp_path, frozen=victim)
    _check(_reports(tmp_path), [r for r in range(nprocs) if r != victim], "gloo",
           f"rank {victim} is frozen (nothing heard from it for ", limit=0.5 + 2 + 1 + KILL_SLACK + 1)


def test_frozen_rank_under_mcrdl_run_ends_the_whole_job(tmp_path, monkeypatch):
    """mcrdl run (MPI and gloo live): the survivors name the frozen rank, abort
    the MPI job, and Hydra kills every process, the stopped one too."""
    monkeypatch.setitem(ENV, "MCRDL_FROZEN_S", "2")
    monkeypatch.setitem(ENV, "FAULT_TIMEOUT", "60")
    proc = _mpiexec(3, ["mixed", "collective", "freeze", "1"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode not in (0, 124), out[-3000:]
    assert "rank 0: rank 1 is frozen" in out and "rank 2: rank 1 is frozen" in out, out[-3000:]
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout
    assert not left, f"processes left: {left}"


@pytest.mark.parametrize("launcher", ["mpiexec", "torchrun"])
def test_a_busy_rank_is_not_taken_for_frozen(tmp_path, launcher):
    """MCRDL_FROZEN_S=1: rank 1 spends 2 s in a pure-Python loop, 2 s in
    torch.save of 400 MB, 2 s asleep and 2 s in a call that holds the GIL (libc's
    sleep through ctypes.PyDLL) while rank 0 waits in an all_reduce; then rank 0
    holds its GIL for 2 s while rank 1 waits. The beats come from a thread that
    never takes the GIL (csrc/beats.cpp's Beats), and each end reads what has arrived
    before it judges, so nobody is called frozen, under MPI's launcher and torchrun."""
    script = tmp_path / "busy.py"
    script.write_text(
        "import ctypes, sys, time, torch, mcrdl\n"
        "mcrdl.init_process_group(timeout=60)\n"
        "hold_gil = ctypes.PyDLL(None).sleep  # (PyDLL: called with the GIL held)\n"
        "x = torch.ones(4)\n"
        "if mcrdl.get_rank() == 1:\n"
        "    end = time.monotonic() + 2\n"
        "    while time.monotonic() < end:\n"
        "        sum(i * i for i in range(10000))\n"
        "    end = time.monotonic() + 2\n"
        "    while time.monotonic() < end:\n"
        f"        torch.save(torch.ones(100_000_000), {str(tmp_path / 'ckpt.pt')!r})\n"
        "    time.sleep(2)\n"
        "    hold_gil(2)\n"
        "mcrdl.all_reduce(x, backend='gloo')\n"
        "if mcrdl.get_rank() == 0:\n"
        "    hold_gil(2)\n"
        "mcrdl.all_reduce(x, backend='gloo')\n"
        "assert torch.equal(x, torch.full((4,), 4.0)), x\n"
        "sys.stdout.write(f'rank {mcrdl.get_rank()} ok\\n')\n")  # one write: ranks share the pipe
    proc = subprocess.run([sys.executable, "-m", "mcrdl.cli", "run", "--launcher", launcher, "-n", "2",
                           "--timeout", "90", FORKED, str(script)], capture_output=True, text=True,
                          env={**ENV, "MCRDL_FROZEN_S": "1"}, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "is frozen" not in out and "Warning" not in out, out[-3000:]
    assert "rank 0 ok" in out and "rank 1 ok" in out, out[-3000:]


@pytest.mark.parametrize("launch", ["env", "mpiexec"])
def test_strangers_at_the_watchdog_neither_end_nor_blind_the_job(tmp_path, monkeypatch, launch):
    """False death claims, garbage, 200 connections, a replayed hello and
    goodbye, a second claim of a connected rank: the job's step still runs,
    nobody is called dead, the connections are counted, and a real death
    afterwards is still named within the watchdog's second.
    Under mpiexec the job's key came over MPI, under torchrun's environment
    through the store. The fault step runs on gloo under both (with survivors
    inside an MPI op, MPICH, which has no fault tolerance, may end the job before
    the watchdog speaks), and under mpiexec the victim exits rather than dies by
    a signal: Hydra kills the survivors within milliseconds of a rank killed by
    a signal, even with -disable-auto-cleanup (CI once saw it win that race; a
    killed rank under mpiexec is test_killed_rank_under_mpiexec_ends_the_job's)."""
    monkeypatch.setitem(ENV, "FAULT_STRANGERS", "1")
    if launch == "env":
        _spawn(3, ["gloo", "collective", "kill", "2"], tmp_path)
        _check(_reports(tmp_path), [0, 1], "gloo", "rank 2 died (its process ended)", limit=0.5 + 1.0 + KILL_SLACK)
    else:  # (what the watchdog prints at once: CI once saw a survivor end silently within a second of a peer's exit)
        proc = _mpiexec(3, ["gloo", "collective", "exit", "2"], tmp_path,
                        extra=["--extra=-disable-auto-cleanup"])
        out = proc.stdout + proc.stderr
        assert "rank 0: rank 2 died (its process ended)\n" in out, out[-3000:]
        assert "rank 1: rank 2 died (its process ended)\n" in out, out[-3000:]
        assert "rank 1 died" not in out and "rank 0 died" not in out, out[-3000:]
    assert int((tmp_path / "rejected").read_text()) >= 10


@pytest.mark.parametrize("backend", ["mpi", "mixed"])
def test_killed_rank_under_mpiexec_ends_the_job(tmp_path, backend):
    start = time.monotonic()
    proc = _mpiexec(2, [backend, "collective", "kill", "1"], tmp_path)
    assert proc.returncode not in (0, 124), proc.stdout + proc.stderr
    assert "signal 9" in proc.stdout + proc.stderr  # Hydra names the killed process
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("nprocs,backend,when,debug", [
    (2, "mpi", "collective", False), (2, "gloo", "async", False), (2, "mixed", "async", True),
    (4, "mpi", "between", True), (4, "mixed", "collective", False), (4, "gloo", "collective", True)])
def test_stuck_rank_times_out_everywhere_and_the_job_ends(tmp_path, monkeypatch, nprocs, backend,
                                                         when, debug):
    victim = nprocs - 1
    monkeypatch.setitem(ENV, "MCRDL_DEBUG", "1" if debug else "0")
    proc = _mpiexec(nprocs, [backend, when, "stall", str(victim)], tmp_path)
    out = proc.stdout + proc.stderr
    # Survivors exit with their errors; MPI_Finalize would wait for the stuck
    # rank forever, so mcrdl aborts the MPI job instead (not 124: not killed
    # by `mcrdl run --timeout`).
    assert proc.returncode not in (0, 124), out
    note = ("did not arrive at collective" if debug else "are alive, so a peer is stuck")
    reports = _reports(tmp_path)
    _check(reports, [r for r in range(nprocs) if r != victim], backend, note)
    if debug:
        assert all(f"rank {victim} (entered" in msg for errs in reports.values() for _, msg in errs)
    assert all(t >= TIMEOUT * 0.9 for errs in reports.values() for t, _ in errs)


def test_a_rank_that_leaves_cleanly_is_not_reported_dead(tmp_path):
    """Rank 1 destroys its process group and exits while rank 0 still runs: its
    goodbye reaches the watchdog, so nobody calls it dead; rank 2, which ends
    later without one (os._exit, as a crash; a rank killed by a signal has
    Hydra kill the job within milliseconds, before rank 0 can say so), is."""
    script = tmp_path / "leave.py"
    script.write_text(
        "import os, sys, time, torch, mcrdl\n"
        "mcrdl.init_process_group()\n"
        "rank = mcrdl.get_rank()\n"
        "mcrdl.all_reduce(torch.ones(4), backend='gloo')\n"
        "if rank == 1:\n"
        "    mcrdl.destroy_process_group(); sys.exit(0)\n"
        "if rank == 2:\n"
        "    time.sleep(1.0); os._exit(1)\n"
        "time.sleep(2.0)\n")
    proc = subprocess.run([sys.executable, "-m", "mcrdl.cli", "run", "-n", "3", "--timeout", "60",
                           "--extra=-disable-auto-cleanup", FORKED, str(script)],
                          capture_output=True, text=True, env=ENV, timeout=90)
    out = proc.stdout + proc.stderr
    assert "rank 0: rank 2 died (its process ended)\n" in out, out[-3000:]
    assert "rank 1 died" not in out, out[-3000:]


def test_small_soak_every_ending_is_clean(tmp_path):
    """benchmarks/faults/soak.py in small: 2 ranks, mcrdl's API and torch's
    init_process_group("mcrdl") with DDP, mixed MPI + gloo work, ending by
    destroy, exit handler, exception and SIGTERM, with async work completed or
    outstanding: each exits with its ending's code, no abort, no rank left. (Its ranks
    start fresh: with forked ones, MPICH's launcher, ending the job on one rank's
    MPI_Abort, can kill the other rank's stub before it passes on its rank's exit
    code, and the job then exits by signal 9, not with the ending's code.)"""
    out = tmp_path / "soak"
    proc = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "faults" / "soak.py"),
                           "--jobs", "16", "--ranks", "2", "--load", "0", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    doc = json.loads(Path(f"{out}.json").read_text())
    bad = [r for r in doc["results"] if not r["clean"]]
    assert doc["jobs"] == 16 and not bad, (proc.stdout[-2000:], bad)


def test_an_op_done_in_its_start_is_not_failed_for_a_death_noted_meanwhile():
    """A blocking op that ran to completion inside its start (a gloo send/recv,
    a compiled MPI call) still runs its completion steps (the logger's) when
    the watchdog noted a death while it waited: it completed, so it did not fail."""
    engine, ran = Engine(), []
    engine.note_death(2, "rank 2 died (its process ended)")
    group = SimpleNamespace(ranks=[0, 1, 2], timeout=5.0)
    engine.block("recv", "gloo", DONE, group, (), (torch.zeros(1),), post=[lambda: ran.append("post")])
    assert ran == ["post"]


def _admitted_as_rank_1(store):
    """A connection that rank 0's watchdog (its address in ``store``) admitted as rank 1,
    the handshake made by hand."""
    from mcrdl import watchdog

    host, port, secret = store.get("watchdog/0").decode().split()
    peer = socket.create_connection((host, int(port)), timeout=10)
    nonce = peer.recv(64).decode().strip()
    mine = "ab" * 16
    peer.sendall(f"1 {mine} {watchdog._mac(bytes.fromhex(secret), 'rank', '1', nonce)}\n".encode())
    assert peer.recv(65).decode().strip() == watchdog._mac(bytes.fromhex(secret), "rank0", mine)
    return peer


def test_a_leaving_rank_0s_bye_arrives_behind_an_unacknowledged_beat():
    """CI saw rank 1 take rank 0's leaving for a death (then abort the job at exit):
    rank 0 wrote ``bye`` while a beat it had sent was not yet acknowledged, so
    Nagle's algorithm held the bye back, and a beat from rank 1 lay unread, so
    closing reset the connection and dropped the held bye. Rank 0's watchdog
    leaves here in exactly that state; its peer must read the bye."""
    from mcrdl import watchdog

    store = torch.distributed.HashStore()
    wd = watchdog.Watchdog(store, 0, 2, lambda: socket.create_server(("127.0.0.1", 0)),
                           lambda rank, how: None, timeout=10)
    peer = _admitted_as_rank_1(store)
    tell = wd._tell_all
    for _ in range(10):  # beats both ways: the peer now delays its acknowledgements
        tell(b"beat\n")
        peer.recv(256)
        time.sleep(0.002)
        peer.sendall(b"beat\n")
    time.sleep(0.05)

    def tell_last(message):
        if message == b"bye\n":
            peer.sendall(b"beat\n")  # arrives after the serve thread stopped: never read
            time.sleep(0.05)
            tell(b"beat\n")  # rank 0's last beat, not yet acknowledged
        tell(message)
    wd._tell_all = tell_last
    wd.stop()
    got = b""
    try:
        while data := peer.recv(256):
            got += data
    except ConnectionResetError:
        pass
    peer.close()
    assert got.endswith(b"bye\n"), got


def test_rank_0_reads_what_arrived_while_it_waited_for_the_gil_before_it_judges():
    """Rank 0's watchdog thread, waiting for the GIL (held here for 2.5 s by a C call)
    after a wait that found nothing, must read the beats that arrived meanwhile before
    it judges: judged on what it last read, a peer beating all along is called frozen.
    The peer's beats come from another process, 1 s into the hold (after the wait), every 0.1 s."""
    import ctypes

    from mcrdl import watchdog

    deaths = []
    store = torch.distributed.HashStore()
    wd = watchdog.Watchdog(store, 0, 2, lambda: socket.create_server(("127.0.0.1", 0)),
                           lambda rank, how: deaths.append(how), timeout=10, frozen_s=1.5)
    peer = _admitted_as_rank_1(store)
    beater = subprocess.Popen([sys.executable, "-c", (
        "import os, sys, time\n"
        "time.sleep(1.0)\n"
        "for _ in range(35):\n"
        "    os.write(int(sys.argv[1]), b'beat\\n')\n"
        "    time.sleep(0.1)\n"), str(peer.fileno())], pass_fds=[peer.fileno()])
    try:
        ctypes.PyDLL(None).usleep(2_500_000)  # the GIL held: no thread of this process runs Python
        time.sleep(0.3)
        assert deaths == [], deaths
    finally:
        beater.kill()
        beater.wait()
        wd.stop()
        peer.close()
