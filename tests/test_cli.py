"""Launcher command lines and the CLI (run, info, explain) for real."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FORKED, running
from mcrdl import launcher

ROOT = Path(__file__).parents[1]


def mcrdl_cli(*args, timeout=120, env=None):
    """``mcrdl ARGS``; forked from the fork server (it imports torch) unless it is `mcrdl run`."""
    forked = [FORKED] if args[0] != "run" else []
    return subprocess.run([sys.executable, *forked, "-m", "mcrdl.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})


def test_mpiexec_command_uses_the_wheels_mpiexec_and_this_python():
    cmd = launcher.build_command(4, ["train.py", "--lr", "1"], hosts="a:2,b")
    assert cmd[0].endswith("mpiexec") and cmd[1:3] == ["-n", "4"]
    assert cmd[3:6] == ["-genv", "MASTER_ADDR", "a"] and cmd[6:8] == ["-genv", "MASTER_PORT"]
    assert cmd[9:11] == ["-hosts", "a:2,b"]
    assert cmd[11:] == [sys.executable, "-m", "mcrdl.rank_env", sys.executable, "train.py", "--lr", "1"]
    assert launcher.build_command(2, ["-m", "pkg.mod"])[-3:] == [sys.executable, "-m", "pkg.mod"]


def test_rank_python_wraps_python_programs_only(monkeypatch):
    """MCRDL_RANK_PYTHON: ``x.py`` and ``-m mod`` run under it (split as a shell would),
    under every launcher; another program runs as it is."""
    monkeypatch.setenv("MCRDL_RANK_PYTHON", "nsys profile '/opt/my python'")
    wrapped = ["nsys", "profile", "/opt/my python"]
    assert launcher.build_command(2, ["x.py", "a"])[-5:] == [*wrapped, "x.py", "a"]
    assert launcher.build_command(2, ["-m", "pkg"], "srun")[-5:] == [*wrapped, "-m", "pkg"]
    assert launcher.build_command(2, ["x.py"], "torchrun")[-5:] == ["--no-python", *wrapped, "x.py"]
    assert launcher.build_command(2, ["true"])[-1] == shutil.which("true")


def test_open_mpis_mpiexec_gets_its_own_options(tmp_path):
    """Open MPI's mpiexec rejects Hydra's -genv/-hosts/-f (seen on a GPU machine
    with Debian's Open MPI 4.1.6): it gets -x NAME=value, --host, --hostfile,
    and --bind-to none unless asked to bind."""
    fake = tmp_path / "mpiexec"  # answers --version as Open MPI 4.1.6's does
    fake.write_text("#!/bin/sh\necho 'mpiexec (OpenRTE) 4.1.6'\necho 'Report bugs to http://www.open-mpi.org/'\n")
    fake.chmod(0o755)
    hostfile = tmp_path / "hf"
    hostfile.write_text("node7 slots=4\n")
    cmd = launcher.build_command(2, ["x.py"], hosts="a:2,b", hostfile=str(hostfile), mpiexec=str(fake),
                                 bind="core")
    assert cmd[1:4] == ["-n", "2", "-x"] and cmd[4] == "MASTER_ADDR=a" and cmd[5] == "-x"
    assert cmd[6].startswith("MASTER_PORT=")
    assert cmd[7:13] == ["--host", "a:2,b", "--hostfile", str(hostfile), "--bind-to", "core"]
    # Open MPI binds to cores unless told not to: with one core each, gloo's threads and CUDA
    # copies shared it with the rank's polling (gloo 64 KiB on CUDA tensors: 3.3 ms, on a GPU machine)
    assert launcher.build_command(2, ["x.py"], mpiexec=str(fake))[7:9] == ["--bind-to", "none"]
    own = launcher.build_command(2, ["x.py"], mpiexec=str(fake), extra=["--bind-to", "socket"])
    assert own.count("--bind-to") == 1 and own[7:9] == ["--bind-to", "socket"]  # the user's, not two
    assert launcher.mpiexec_family(launcher.find_mpiexec()) == "hydra"  # the mpich wheel's


def test_master_address_from_environment_hosts_or_hostfile(tmp_path, monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    hostfile = tmp_path / "hf"
    hostfile.write_text("# nodes\n\nnode7:4\nnode8:4\n")
    cmd = launcher.build_command(2, ["x.py"], hostfile=str(hostfile))
    assert cmd[9:11] == ["-f", str(hostfile)] and cmd[5] == "node7"
    addr, port = launcher.master_address()
    assert addr == "127.0.0.1" and 0 < int(port) < 65536
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29511")
    assert launcher.master_address(hosts="a,b") == ("10.1.2.3", "29511")


def test_rank_env_maps_each_launchers_variables_to_torchruns():
    from mcrdl.rank_env import torchrun_env

    hydra = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
    assert torchrun_env(hydra) == {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                                   "LOCAL_WORLD_SIZE": "2", "ROLE_RANK": "3", "ROLE_WORLD_SIZE": "4"}
    ompi = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8",
            "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}
    assert torchrun_env(ompi)["LOCAL_WORLD_SIZE"] == "4" and torchrun_env(ompi)["RANK"] == "5"
    slurm = {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
             "SLURM_TASKS_PER_NODE": "3(x2),1", "SLURM_JOB_ID": "12345"}
    env = torchrun_env(slurm)
    assert (env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"], env["MASTER_PORT"]) == ("1", "2", "32345")
    with pytest.raises(RuntimeError, match="no launcher variables found"):
        torchrun_env({"RANK": "0"})


def test_every_rank_of_mcrdl_run_has_torchruns_environment(tmp_path):
    script = tmp_path / "env.py"
    # one file per rank: mpiexec forwards the ranks' stdout in chunks that may interleave
    script.write_text("import os, json, sys\nenv = {k: os.environ.get(k) for k in ("
                      "'RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'MASTER_ADDR', "
                      "'MASTER_PORT', 'PMI_RANK')}\n"
                      "open(f\"{sys.argv[1]}/{env['RANK']}.json\", 'w').write(json.dumps(env))\n")
    proc = mcrdl_cli("run", "-n", "3", str(script), str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    envs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"]
    assert all(e["RANK"] == e["PMI_RANK"] == e["LOCAL_RANK"] for e in envs)
    assert {(e["WORLD_SIZE"], e["LOCAL_WORLD_SIZE"], e["MASTER_ADDR"]) for e in envs} == {("3", "3", "127.0.0.1")}
    assert len({e["MASTER_PORT"] for e in envs}) == 1


def test_srun_and_torchrun_commands():
    assert launcher.build_command(8, ["x.py"], "srun")[:3] == ["srun", "-n", "8"]
    cmd = launcher.build_command(2, ["x.py", "a"], "torchrun")
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=2"]
    assert cmd[-2:] == ["x.py", "a"]


def test_binding_command_lines():
    bound = lambda cmd: cmd[cmd.index("-bind-to") + 1] if "-bind-to" in cmd else None
    assert bound(launcher.build_command(2, ["x.py"])) is None  # default: the OS places ranks
    assert bound(launcher.build_command(8, ["x.py"], hosts="a,b", bind="core")) == "core"
    assert "--cpu-bind=cores" in launcher.build_command(2, ["x.py"], "srun", bind="core")
    assert "--cpu-bind=cores" not in launcher.build_command(2, ["x.py"], "srun")
    with pytest.raises(ValueError, match="torchrun cannot bind"):
        launcher.build_command(2, ["x.py"], "torchrun", bind="core")
    with pytest.raises(ValueError, match="unknown binding 'socket'"):
        launcher.build_command(2, ["x.py"], bind="socket")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_run_pins_each_rank_to_its_own_core(tmp_path):
    script = tmp_path / "where.py"
    script.write_text("import json, os, sys\n"
                      "rank = os.environ.get('PMI_RANK') or os.environ['OMPI_COMM_WORLD_RANK']\n"
                      "path = os.path.join(sys.argv[1], rank)\n"
                      "json.dump(sorted(os.sched_getaffinity(0)), open(path, 'w'))\n")

    def cpus(*bind):
        out = tmp_path / "_".join(bind or ("default",))
        out.mkdir()
        proc = mcrdl_cli("run", "-n", "2", *bind, str(script), str(out))
        assert proc.returncode == 0, proc.stderr
        return [json.loads((out / str(r)).read_text()) for r in range(2)]

    pinned = cpus("--bind", "core")
    assert all(len(c) == 1 for c in pinned) and pinned[0] != pinned[1], pinned
    version = subprocess.run([launcher.find_mpiexec(), "--version"], capture_output=True, text=True).stdout
    if "HYDRA" in version:  # MPICH's launcher places nothing itself (Open MPI's binds by default)
        assert all(len(c) > 1 for c in cpus())


@pytest.mark.parametrize("kwargs, message", [
    (dict(nprocs=0, argv=["x.py"]), "at least 1"),
    (dict(nprocs=2, argv=[]), "no program"),
    (dict(nprocs=2, argv=["x.py"], launcher="pbs"), "unknown launcher"),
    (dict(nprocs=2, argv=["no-such-program-xyz"]), "not found"),
    (dict(nprocs=2, argv=["x.py"], mpiexec="/no/such/mpiexec"), "not found"),
])
def test_bad_launch_arguments(kwargs, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        launcher.build_command(**kwargs)


def test_run_dry_run_and_exit_code():
    proc = mcrdl_cli("run", "-n", "3", "--dry-run", "--", "examples/hello.py")
    assert proc.returncode == 0 and " -n 3 " in proc.stdout
    proc = mcrdl_cli("run", "-n", "1", "--launcher", "pbs", "x.py")
    assert proc.returncode != 0


@pytest.mark.parametrize("argv", [["-m", "mcrdl.cli", "run", "-n", "2", "--dry-run", "x.py"],
                                  ["-m", "mcrdl.rank_env", sys.executable, "-c", "pass"]], ids=["run", "rank_env"])
def test_launching_loads_no_torch(argv):
    """`mcrdl run` and the wrapper it starts each rank in load neither torch nor a
    backend: only the ranks' own programs pay torch's import (a 2-rank job paid it
    five times when the package loaded its API at import)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *argv], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PMI_RANK": "0", "PMI_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": "29500"}, timeout=60)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = [line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line]
    assert "mcrdl" in loaded and not [m for m in loaded if m.split(".")[0] == "torch" or "backends" in m], loaded


def test_run_propagates_failure_and_kills_on_timeout(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys; sys.exit(3)\n")
    assert mcrdl_cli("run", "-n", "2", str(bad)).returncode != 0
    slow = tmp_path / "slow.py"
    slow.write_text("import time; time.sleep(60)\n")
    proc = mcrdl_cli("run", "-n", "2", "--timeout", "2", str(slow))
    assert proc.returncode == 124 and "killed after" in proc.stderr


def test_ranks_the_launcher_leaves_behind_do_not_outlive_mcrdl_run(tmp_path):
    """A launcher that exits before its ranks (mpiexec on Ctrl-C) orphans them, and
    ranks in sessions of their own (MPICH's proxy starts them so) are out of reach
    of the launch's process group: `mcrdl run` still ends them, and says so (a rank
    killed that way would otherwise end without a word)."""
    pidfile = tmp_path / "rank.pid"
    rank = (f"import os, time; open({str(pidfile)!r}, 'w').write(str(os.getpid())); "
            "time.sleep(600)")
    exits_at_once = (f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {rank!r}], "
                     f"start_new_session=True); time.sleep(1)")
    done = subprocess.run([sys.executable, "-c", "import sys; from mcrdl import launcher; "
                           f"sys.exit(launcher.run([sys.executable, '-c', {exits_at_once!r}]))"],
                          cwd=ROOT, timeout=60, capture_output=True, text=True)
    pid = int(pidfile.read_text())
    try:
        assert done.returncode == 0 and not running(pid), "the orphaned rank outlived mcrdl run"
        assert (f"mcrdl run: the launcher exited with 0 while 1 process(es) of its job still ran 1 s later "
                f"(pids {pid}); killing them") in done.stderr, done.stderr
    finally:
        if running(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("signum,mode,backend,how", [
    (signal.SIGINT, "default", "mpi", "mpiexec"),
    (signal.SIGTERM, "default", "gloo", "mpiexec"),
    (signal.SIGINT, "ignore", "gloo", "mpiexec"),
    (signal.SIGTERM, "ignore", "mpi", "mpiexec"),
    (signal.SIGTERM, "default", "gloo", "torchrun"),
], ids=["SIGINT-mpi", "SIGTERM-gloo", "SIGINT-ignored", "SIGTERM-ignored", "SIGTERM-torchrun"])
def test_stopping_mcrdl_run_ends_every_rank(tmp_path, signum, mode, backend, how):
    """Ctrl-C/SIGTERM to `mcrdl run` while rank 0 waits in a barrier and rank 1 sleeps:
    the job ends within the grace period (ranks that ignore the signal are killed),
    no rank survives, and the exit code is 128 + the signal."""
    grace = 3
    proc = subprocess.Popen([sys.executable, "-m", "mcrdl.cli", "run", "--launcher", how, "-n", "2",
                             "--stop-grace", str(grace), str(ROOT / "tests" / "jobs" / "stop_job.py"),
                             str(tmp_path), backend, mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    pidfiles = [tmp_path / f"rank{r}.pid" for r in (0, 1)]
    deadline = time.monotonic() + 120
    while not all(f.exists() and f.read_text() for f in pidfiles):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.1)
    pids = [int(f.read_text()) for f in pidfiles]
    time.sleep(1.5)  # rank 0 is in its barrier now
    sent = time.monotonic()
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=grace + 30)
    took = time.monotonic() - sent
    assert proc.returncode == 128 + signum, (out, err[-3000:])
    assert f"stopped by {signal.Signals(signum).name}" in err
    assert took < grace + 5, f"the job took {took:.1f} s to end"
    assert not [p for p in pids if running(p)], "a rank outlived mcrdl run"


def test_torchrun_launch_has_mpi_too():
    """The README's torchrun example: MPI is live beside gloo (started over torchrun's store)."""
    proc = mcrdl_cli("run", "--launcher", "torchrun", "-n", "2", "examples/hello.py", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for backend in ("mpi  ", "gloo "):
        assert proc.stdout.count(f"{backend} all_reduce on cpu -> [3.0, 3.0, 3.0, 3.0]") == 2, proc.stdout


def test_info_lists_backends():
    proc = mcrdl_cli("info")
    assert proc.returncode == 0, proc.stderr
    assert "mpi" in proc.stdout and "live" in proc.stdout
    assert "MPICH" in proc.stdout or "Open MPI" in proc.stdout  # the library mpi4py loaded


def test_explain_follows_precedence(tmp_path):
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"format": "mcrdl-tuning/1", "rules": {"all_reduce": {"2": [
        {"max_bytes": 1024, "backend": "mpi"}, {"max_bytes": None, "backend": "gloo"}]}}}))
    out = mcrdl_cli("explain", "all_reduce", "4M", "--group-size", "2", "--table", str(table)).stdout
    assert "gloo" in out and "tuning table" in out
    out = mcrdl_cli("explain", "all_reduce", "512", "--group-size", "2", "--table", str(table)).stdout
    assert ": mpi (tuning table" in out
    out = mcrdl_cli("explain", "all_reduce", "4M", "--table", str(table),
                    "--op-backends", "all_reduce:mpi").stdout
    assert ": mpi (static map" in out
    out = mcrdl_cli("explain", "all_reduce", "4M", "--backend", "gloo").stdout
    assert ": gloo (backend= given" in out
    proc = mcrdl_cli("explain", "all_reduce", "4M", "--table", str(tmp_path / "missing.json"))
    assert proc.returncode != 0 and "missing.json" in proc.stderr


def test_explain_selects_by_device(tmp_path):
    """One table, rules per device type: the device asked about picks the rules.
    With MCRDL_MPI_CUDA_AWARE=1 the MPI backend declares CUDA tensors (a
    capability: no GPU is touched by explain)."""
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"format": "mcrdl-tuning/2", "rules": {
        "cpu": {"all_reduce": {"2": [{"max_bytes": None, "backend": "gloo"}]}},
        "cuda": {"all_reduce": {"2": [{"max_bytes": 4096, "backend": "mpi"},
                                      {"max_bytes": None, "backend": "gloo"}]}}}}))
    env = {"MCRDL_MPI_CUDA_AWARE": "1"}
    ask = lambda *a: mcrdl_cli("explain", "all_reduce", *a, "--group-size", "2", "--table", str(table), env=env)
    out = ask("64", "--device", "cpu").stdout
    assert "on cpu, group size 2: gloo (tuning table" in out and "all_reduce on cpu" in out, out
    out = ask("64", "--device", "cuda").stdout
    assert "on cuda, group size 2: mpi (tuning table" in out and "all_reduce on cuda" in out, out
    out = ask("1M", "--device", "cuda").stdout  # gloo takes no CUDA tensors: the next choice, said so
    assert ": mpi (default backend (skipped gloo: backend 'gloo' does not take cuda tensors))" in out, out
    proc = mcrdl_cli("explain", "all_reduce", "64", "--device", "cuda")  # no backend takes CUDA tensors here
    if not __import__("torch").cuda.is_available():
        assert proc.returncode == 2 and "no live backend can run it" in proc.stderr, proc.stderr
        assert "'mpi' does not take cuda tensors" in proc.stderr, proc.stderr
    proc = mcrdl_cli("explain", "all_reduce", "64", "--device", "gpu")
    assert proc.returncode == 2 and "invalid choice: 'gpu'" in proc.stderr
