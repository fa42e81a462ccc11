"""Launcher command lines and the CLI (run, info, explain) for real."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mcrdl import launcher

ROOT = Path(__file__).parents[1]


def mcrdl_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "mcrdl.cli", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def test_mpiexec_command_uses_the_wheels_mpiexec_and_this_python():
    cmd = launcher.build_command(4, ["train.py", "--lr", "1"], hosts="a,b")
    assert cmd[0].endswith("mpiexec") and cmd[1:3] == ["-n", "4"]
    assert cmd[3:5] == ["-hosts", "a,b"]
    assert cmd[5:] == [sys.executable, "train.py", "--lr", "1"]
    assert launcher.build_command(2, ["x.py"], hostfile="hf")[3:5] == ["-f", "hf"]
    assert launcher.build_command(2, ["-m", "pkg.mod"])[-3:] == [sys.executable, "-m", "pkg.mod"]


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


def test_run_propagates_failure_and_kills_on_timeout(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import sys; sys.exit(3)\n")
    assert mcrdl_cli("run", "-n", "2", str(bad)).returncode != 0
    slow = tmp_path / "slow.py"
    slow.write_text("import time; time.sleep(60)\n")
    proc = mcrdl_cli("run", "-n", "2", "--timeout", "2", str(slow))
    assert proc.returncode == 124 and "killed after" in proc.stderr


def test_torchrun_launch_without_mpi():
    proc = mcrdl_cli("run", "--launcher", "torchrun", "-n", "2", "examples/hello.py", timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "mpi   not live: the job was not started by an MPI launcher" in proc.stdout
    assert proc.stdout.count("gloo  all_reduce on cpu -> [3.0, 3.0, 3.0, 3.0]") == 2


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
