"""Helpers: launch real multi-rank jobs through `mcrdl run` (MPICH's mpiexec), their ranks
forked from fork servers that imported torch once (tests/forkserver.py)."""
import fcntl
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest

import forkserver

JOBS = Path(__file__).parent / "jobs"
#: a rank command's first word, before its script: the rank is forked from one of this
#: pytest process's fork servers, which have imported torch already (tests/forkserver.py)
FORKED = forkserver.__file__
# one compute thread per rank in every job the tests start, as torchrun sets: ranks
# share this machine's cores, and threads beyond them only queue
os.environ.setdefault("OMP_NUM_THREADS", "1")
# every rank imports mcrdl from the source tree (an editable install): with its bytecode
# kept in __pycache__ that import costs about 15 ms of CPU, compiled anew about 75 ms
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

#: the marker of each test module that is not a ``job`` module (``pytest -m unit`` etc.);
#: a job module may hold in-process tests too, a unit module launches nothing
KINDS = {"test_fuzz": "unit", "test_order_checks": "unit", "test_selector": "unit",
         "test_tune_unit": "unit", "test_tuning": "unit", "test_settings": "unit", "test_frameworks": "frameworks",
         "test_torch_suite": "frameworks", "test_compile": "frameworks", "test_cuda": "gpu"}


def pytest_sessionstart(session):
    """The fork servers of this pytest process (tests/forkserver.py; not in pytest-xdist's
    controller, which runs no test; not with ``TEST_FRESH_RANKS=1``, where every rank
    starts fresh). In a pytest-xdist worker the jobs' waits yield (``MCRDL_WAIT``
    unless set): another worker's job shares the cores, which ``auto`` does not see (it
    counts one job's ranks), and ranks that spin while they wait starve that job's."""
    controller = getattr(session.config.option, "numprocesses", None) and not hasattr(session.config,
                                                                                         "workerinput")
    if not controller and not os.environ.get("TEST_FRESH_RANKS"):
        os.environ["TEST_FORKSERVER"] = forkserver.start()
    if hasattr(session.config, "workerinput"):
        os.environ.setdefault("MCRDL_WAIT", "yield")
    else:
        session.config.shm_before = shm_left()


#: Shared-memory files that MPICH and DeepSpeed's shm op leave in /dev/shm when their
#: job ends abnormally (the fault tests kill ranks on purpose): a suite run left 95 of
#: MPICH's and DeepSpeed's two 66 MB buffers, 345 MB of memory. The session removes
#: those it made that no process maps any more (pytest_sessionfinish).
SHM_DIR, SHM_LEFT = "/dev/shm", ("mpich_shm_", "deepspeed_allreduce_buffer_")


def shm_left() -> set:
    try:
        return {name for name in os.listdir(SHM_DIR) if name.startswith(SHM_LEFT)}
    except OSError:
        return set()


def shm_mapped() -> set:
    """The names of the /dev/shm files some process maps now."""
    names = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                names.update(line.split(SHM_DIR + "/", 1)[1].split()[0] for line in f if SHM_DIR + "/" in line)
        except OSError:  # (the process ended meanwhile, or is not ours to read)
            pass
    return names


def pytest_sessionfinish(session):
    before = getattr(session.config, "shm_before", None)
    if before is None:
        return
    for name in shm_left() - before - shm_mapped():
        try:
            os.unlink(os.path.join(SHM_DIR, name))
        except OSError:
            pass


#: the files that take longest (the table at the end of a run), longest first: under
#: pytest-xdist (``--no-loadscope-reorder``) the other worker runs the short files
#: meanwhile, and no long file is left to run alone at the end
LONGEST_FIRST = ["test_frameworks", "test_bench", "test_faults", "test_collectives", "test_torch_backend",
                 "test_workloads", "test_multihost", "test_launchers", "test_observability", "test_cli",
                 "test_torch_suite", "test_autotune", "test_fuzz", "test_compile", "test_slurm",
                 "test_regressions"]


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(KINDS.get(item.module.__name__, "job"))
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.module.__name__, len(first)))  # (stable: in-file order kept)


#: test file -> [wall s, CPU s, tests]: what each file cost, printed at the end of the run
_COST: dict = {}
_CPU_AT_START = pytest.StashKey[float]()


def _cpu_seconds():
    """CPU seconds of this pytest process, of the processes it has waited for (its
    jobs' launchers wait for their ranks; a process nobody waited for is not counted)
    and of the ranks its fork servers forked."""
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime + forkserver.cpu_seconds()


def _hold_machine(item):
    """Under pytest-xdist, the run's machine lock (in the workers' shared base temp
    directory): shared by every test, exclusive for an ``alone`` one, which so
    starts once the other worker's test has ended, and keeps the other worker
    waiting until it ends. A turnstile before the lock keeps the other worker's
    next tests from passing an ``alone`` test that waits. The lock's descriptor, or
    None outside pytest-xdist."""
    if not hasattr(item.config, "workerinput"):
        return None
    run = Path(item.config.option.basetemp).parent
    turnstile = os.open(run / "machine.turnstile", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        machine = os.open(run / "machine.lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(machine, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
    finally:
        os.close(turnstile)
    return machine


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    machine = _hold_machine(item)
    item.stash[_CPU_AT_START] = _cpu_seconds()
    try:
        yield
    finally:
        if machine is not None:
            os.close(machine)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """The teardown report carries the test's CPU seconds (to pytest-xdist's controller too)."""
    report = (yield).get_result()
    if call.when == "teardown" and _CPU_AT_START in item.stash:
        report.user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_CPU_AT_START]))


def pytest_runtest_logreport(report):
    cost = _COST.setdefault(report.location[0], [0.0, 0.0, 0])
    cost[0] += report.duration
    if report.when == "teardown":
        cost[1] += dict(report.user_properties).get("cpu_s", 0.0)
        cost[2] += 1


def pytest_terminal_summary(terminalreporter):
    """Each test file's wall time and CPU time, slowest first: on this 2-core
    machine a file near 2 cores is CPU-bound, one well below waits. (Under
    pytest-xdist files run side by side: their times add up to more than the run's.)"""
    if not _COST:
        return
    terminalreporter.section("time per test file (CPU: pytest and the processes it waited for)")
    for path, (wall, cpu, tests) in sorted(_COST.items(), key=lambda kv: -kv[1][0]):
        terminalreporter.write_line(f"{wall:8.1f} s {cpu:8.1f} CPU s {cpu / max(wall, 1e-9):5.2f} cores "
                                    f"{tests:5d} tests  {path}")
    wall, cpu = sum(c[0] for c in _COST.values()), sum(c[1] for c in _COST.values())
    terminalreporter.write_line(f"{wall:8.1f} s {cpu:8.1f} CPU s {cpu / max(wall, 1e-9):5.2f} cores "
                                f"{sum(c[2] for c in _COST.values()):5d} tests  in all")


class JobOutput(str):
    """A job's combined output, with what its ranks filed through tests/jobs/verdicts.py:
    ``verdicts``, one dict per check (name, rank, ok; expected, got, where if it failed),
    and ``rc``, the job's exit status."""
    verdicts: list
    rc: int

    def part(self, name):
        """The job's output with only the verdicts of its part ``name`` (a job that ran
        several, tests/jobs/verdicts.py ``run_parts``) and those filed outside any part;
        an exit status other than 0 is a failed check of every part."""
        view = JobOutput(self)
        view.verdicts, view.rc = [v for v in self.verdicts if v.get("part", name) == name], self.rc
        if self.rc != 0:
            view.verdicts.append({"name": "exit status", "rank": "all", "ok": False, "expected": 0,
                                  "got": self.rc, "where": "the job's end"})
        return view

    def failures(self, judged=lambda name: True):
        """One line per failed check among ``judged`` names: name, rank, expected, got,
        where the job checked it (an ``uncaught`` check: the exception that ended a rank)."""
        return [f"check {v['name']!r} failed on rank {v['rank']} at {v['where']}: "
                f"expected {v['expected']}, got {v['got']}" for v in self.verdicts
                if not v["ok"] and judged(v["name"])]

    def require(self, names, ranks, judged=lambda name: True):
        """Fail the test unless each of ``names`` was checked on every rank of ``ranks``
        and no ``judged`` check failed; the message names each check and rank."""
        checked = {(v["name"], v["rank"]) for v in self.verdicts}
        bad = self.failures(judged) + [f"check {name!r} missing on rank {r}" for name in names for r in ranks
                                       if (name, r) not in checked]
        if bad:
            pytest.fail("\n".join(bad) + "\n--- job output (tail) ---\n" + self[-4000:], pytrace=False)


@pytest.fixture
def forked_ranks(monkeypatch):
    """Ranks that mcrdl launches itself (bench, tune, demo) forked from the fork servers:
    conftest's ``FORKED`` as ``MCRDL_RANK_PYTHON``."""
    monkeypatch.setenv("MCRDL_RANK_PYTHON", shlex.join([sys.executable, FORKED]))


def run_job(nprocs, script, *args, timeout=300, env=None, expect_rc=0, launcher="mpiexec"):
    """Run tests/jobs/<script> on ``nprocs`` ranks; return its :class:`JobOutput`.
    A failed check, or an exit status other than ``expect_rc``, fails the test
    naming the checks and ranks that failed."""
    out, rc = run_job_rc(nprocs, script, *args, timeout=timeout, env=env, launcher=launcher)
    failed = out.failures(lambda name: expect_rc == 0 or name != "uncaught")
    if expect_rc is not None and (rc != expect_rc or failed):
        pytest.fail(f"{script} on {nprocs} ranks exited {rc}" + "".join(f"\n{f}" for f in failed)
                    + f"\n--- job output (tail) ---\n{out[-6000:]}", pytrace=False)
    return out


def run_job_rc(nprocs, script, *args, timeout=300, env=None, launcher="mpiexec"):
    """:func:`run_job`'s output and the job's exit status (``launcher``: mcrdl run's).
    Its ranks are forked from the session's fork servers (tests/forkserver.py)."""
    cmd = [sys.executable, "-m", "mcrdl.cli", "run", "-n", str(nprocs), "--launcher", launcher,
           "--timeout", str(timeout), FORKED, str(JOBS / script), *map(str, args)]
    with tempfile.TemporaryDirectory(prefix="verdicts_") as verdicts:
        # (a rank killed by a fatal signal prints where each of its threads was)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1", **(env or {}),
                    "TEST_VERDICTS": verdicts}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout + 30)
        out = JobOutput(proc.stdout + proc.stderr)
        out.verdicts, out.rc = read_verdicts(verdicts), proc.returncode
    return out, proc.returncode


_LIBRARIES: list = []


def cpu_libraries() -> list:
    """The libraries live for CPU tensors in a 2-rank job on this machine, in
    registry order (tests/jobs/live_job.py)."""
    if not _LIBRARIES:
        out = run_job(2, "live_job.py", timeout=120)
        _LIBRARIES.extend(next(line for line in out.splitlines()
                               if line.startswith("live on cpu: ")).split(": ", 1)[1].split(","))
        assert {"mpi", "gloo"} <= set(_LIBRARIES), out
    return list(_LIBRARIES)


#: how long a command may run on after the line that says its work is done (run_or_dump)
HUNG_AFTER_S = 20


def run_or_dump(cmd, timeout, env=None, cwd=None, hung_after=None):
    """``subprocess.run(cmd)``: ``(exit status, stdout, stderr)``. Past ``timeout`` the
    command and every process below it (torchrun's workers run in sessions of their own)
    get SIGABRT, so Python's fault handler prints where each thread waited, and the test
    fails with that output's tail. Once a line of its output starts with ``hung_after``
    the command's work is done: it has :data:`HUNG_AFTER_S` more to end, and one that
    hangs on its way out (a reference run of another library) ends the same way, but
    with a warning that says so and the exit status None."""
    from mcrdl.launcher import processes_below

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env={**(env or os.environ), "PYTHONFAULTHANDLER": "1"})
    lines = {proc.stdout: [], proc.stderr: []}
    readers = [threading.Thread(target=lambda f=f: lines[f].extend(iter(f.readline, "")), daemon=True)
               for f in lines]
    for reader in readers:
        reader.start()
    deadline, done = time.monotonic() + timeout, None
    while proc.poll() is None and time.monotonic() < deadline:
        if done is None and hung_after is not None and any(l.startswith(hung_after) for l in lines[proc.stdout]):
            done = time.monotonic()
            deadline = min(deadline, done + HUNG_AFTER_S)
        time.sleep(0.1)
    ran_on = proc.poll() is None
    if ran_on:
        everyone = [proc.pid, *processes_below(proc.pid)]
        signal_all(everyone, signal.SIGABRT)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        signal_all(everyone, signal.SIGKILL)
        proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    out, err = "".join(lines[proc.stdout]), "".join(lines[proc.stderr])
    if not ran_on:
        return proc.returncode, out, err
    if done is not None:
        warnings.warn(f"{' '.join(map(str, cmd[:6]))} ... printed {hung_after!r}, then still ran "
                      f"{HUNG_AFTER_S} s later; where each process waited:\n{(out + err)[-3000:]}")
        return None, out, err
    pytest.fail(f"{' '.join(map(str, cmd[:6]))} ... still ran after {timeout} s; where each process "
                f"waited:\n{(out + err)[-12000:]}", pytrace=False)


def signal_all(pids, signum):
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def running(pid):
    """Is ``pid`` a live process (a zombie is not)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def read_verdicts(directory):
    """Every verdict filed under ``directory`` (tests/jobs/verdicts.py), rank by rank."""
    return [json.loads(line) for path in sorted(Path(directory).glob("rank*.jsonl"))
            for line in path.read_text().splitlines() if line]


def compiled_status(module, cache, cwd=None, **env):
    """``module.status()`` of a compiled helper (mcrdl.facts, mcrdl.backends.native),
    in a fresh process (working in ``cwd``) building into ``cache``."""
    proc = subprocess.run([sys.executable, "-c", f"from {module} import status; print(status())"],
                          capture_output=True, text=True, timeout=900, cwd=cwd,
                          env={**os.environ, "MCRDL_CACHE": str(cache), **env})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def cached_files(cache):
    """The files a build left in ``cache`` (its lock file aside)."""
    return [f for _, _, files in os.walk(cache) for f in files if f != ".lock"]


def check_built_once_and_reused(module, cache):
    """An empty ``cache`` gets one module and no temporary file; a second
    process, working in another directory, loads it without building again (a
    compiler named without its path once keyed the module by the working directory)."""
    first = compiled_status(module, cache)
    assert first.startswith(f"compiled ({cache}"), first
    built = cached_files(cache)
    assert len(built) == 1 and built[0].endswith(".so"), built
    path = first[len("compiled ("):-1]
    made = os.stat(path).st_mtime_ns
    assert compiled_status(module, cache, cwd=Path(cache).parent) == first and os.stat(path).st_mtime_ns == made
