"""tests/forkserver.py: a rank forked from the fork server sees what a fresh
process would (arguments, environment, working directory, descriptors, stdin),
ends as it would, follows its stub's signals and dies with it; a variable that
importing torch reads sends it to a fresh process instead."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import FORKED, running
from forkserver import SERVERS

pytestmark = pytest.mark.skipif(not os.environ.get("TEST_FORKSERVER"), reason="TEST_FRESH_RANKS is set")

SEEN = """
import json, os, sys
fds = [fd for fd in sorted(int(fd) for fd in os.listdir("/proc/self/fd")) if os.path.exists(f"/proc/self/fd/{fd}")]
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0], "x": os.environ.get("X"),
                  "stdin": sys.stdin.read(), "fds": fds, "umask": os.umask(0),
                  "torch_before": "torch" in sys.modules, "forked": os.getpid() != int(os.environ["STUB"])}))
sys.stderr.write("to stderr\\n")
sys.exit(3)
"""


def _stub(script, *args, env=None, **popen):
    """Start ``script`` through the stub; its environment names the stub's pid (``STUB``)."""
    wrapper = ("import os, sys; os.environ['STUB'] = str(os.getpid()); "
               f"sys.argv = [{FORKED!r}, *sys.argv[1:]]; exec(open({FORKED!r}).read())")
    return subprocess.Popen([sys.executable, "-c", wrapper, str(script), *args],
                            env={**os.environ, **(env or {})}, **popen)


def _wait_ready():
    deadline = time.monotonic() + 120
    while not all(os.path.exists(f"{os.environ['TEST_FORKSERVER']}.{i}.env") for i in range(SERVERS)):
        assert time.monotonic() < deadline, "the fork servers did not start"
        time.sleep(0.05)


def test_a_forked_rank_sees_what_a_fresh_one_would(tmp_path):
    _wait_ready()
    script = tmp_path / "seen.py"
    script.write_text(SEEN)
    extra = os.open(tmp_path / "extra", os.O_CREAT | os.O_RDONLY)  # an inherited descriptor, as PMI_FD is
    try:
        runs = {}
        for how, cmd in (("fresh", None), ("forked", True)):
            popen = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=tmp_path, pass_fds=(extra,))
            if cmd:
                proc = _stub(script, "a b", "c", env={"X": "y"}, **popen)
            else:
                proc = subprocess.Popen([sys.executable, "-c", "import os, sys; os.environ['STUB'] = "
                                         "str(os.getpid()); os.execv(sys.executable, [sys.executable, "
                                         "*sys.argv[1:]])", str(script), "a b", "c"],
                                        env={**os.environ, "X": "y"}, **popen)
            out, err = proc.communicate("some input", timeout=120)
            runs[how] = (proc.returncode, json.loads(out), err)
    finally:
        os.close(extra)
    (fresh_rc, fresh, fresh_err), (forked_rc, forked, forked_err) = runs["fresh"], runs["forked"]
    assert not fresh["forked"] and forked["forked"] and forked["torch_before"] and not fresh["torch_before"]
    for seen in (fresh, forked):
        del seen["forked"], seen["torch_before"]
    assert forked == fresh and extra in forked["fds"], (forked, fresh)
    assert forked_rc == fresh_rc == 3 and forked_err == fresh_err == "to stderr\n"


@pytest.mark.parametrize("code,rc,expected", [
    ("raise ValueError('boom')", 1, "ValueError: boom"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", -signal.SIGKILL, ""),
    ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", -signal.SIGSEGV, "Fatal Python error"),
])
def test_a_forked_rank_ends_its_stub_as_it_ended(tmp_path, code, rc, expected):
    _wait_ready()
    script = tmp_path / "end.py"
    script.write_text(code + "\n")
    proc = _stub(script, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                 env={"PYTHONFAULTHANDLER": "1"})
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == rc and expected in err, (proc.returncode, err)


def test_signals_reach_the_rank_and_a_killed_stub_takes_it_along(tmp_path):
    """SIGABRT to the stub: the rank's fault handler prints where it was, and the stub ends
    by SIGABRT. SIGKILL to the stub of a stopped rank: the server kills the rank."""
    _wait_ready()
    script = tmp_path / "wait.py"
    script.write_text("import os, sys, time\n"
                      "open(sys.argv[1], 'w').write(str(os.getpid()))\n"
                      "if sys.argv[2] == 'stop':\n"
                      "    os.kill(os.getpid(), 19)\n"  # SIGSTOP
                      "time.sleep(60)\n")
    for how in ("abort", "stop"):
        pidfile = tmp_path / how
        proc = _stub(script, pidfile, how, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                     env={"PYTHONFAULTHANDLER": "1"})
        deadline = time.monotonic() + 120
        while not (pidfile.exists() and pidfile.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        rank = int(pidfile.read_text())
        assert rank != proc.pid
        time.sleep(0.3)
        proc.send_signal(signal.SIGABRT if how == "abort" else signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
        if how == "abort":
            assert proc.returncode == -signal.SIGABRT and "wait.py" in err and " in stub" not in err, err
        deadline = time.monotonic() + 10
        while running(rank):
            assert time.monotonic() < deadline, f"rank {rank} outlived its stub ({how})"
            time.sleep(0.05)


def test_a_variable_torch_reads_at_import_means_a_fresh_process(tmp_path):
    _wait_ready()
    script = tmp_path / "where.py"
    script.write_text("import os, sys\nprint(os.getpid() != int(os.environ['STUB']), 'torch' in sys.modules)\n")
    for env, expected in (({}, "True True"), ({"TORCH_LOGS": "+dynamo"}, "False False"),
                          ({"OMP_NUM_THREADS": "2"}, "False False"), ({"TORCHELASTIC_RUN_ID": "x"}, "True True")):
        proc = _stub(script, env=env, stdout=subprocess.PIPE, text=True)
        assert proc.communicate(timeout=120)[0].strip() == expected, env


def test_the_ranks_of_a_job_hash_strings_differently(tmp_path):
    """Rank r is forked from server r % SERVERS: like fresh processes, a job's ranks do not
    share Python's hash seed, so a set of names iterated in one order on every rank
    (a collective order that only looks agreed) fails here as it would in a real job."""
    _wait_ready()
    script = tmp_path / "hash.py"
    script.write_text("import os\nprint(os.getpid() != int(os.environ['STUB']), hash('all_reduce'))\n")
    seen = []
    for rank in range(SERVERS):
        proc = _stub(script, env={"RANK": str(rank)}, stdout=subprocess.PIPE, text=True)
        forked, value = proc.communicate(timeout=120)[0].split()
        assert forked == "True"
        seen.append(value)
    assert len(set(seen)) == SERVERS, seen
