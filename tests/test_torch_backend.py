"""mcrdl registered as a torch.distributed backend ("mcrdl"): torch collectives and
DDP through mcrdl's selector, against local references and against plain gloo."""
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import FORKED, JOBS, run_job
import mcrdl.integrations.torch_backend as tb
from mcrdl.launcher import free_port

ROOT = Path(__file__).parents[1]


def python(code, timeout=120, env=None):
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    return proc.stdout


def test_import_torch_registers_mcrdl_without_importing_it_and_register_is_idempotent():
    out = python(
        "import sys, torch.distributed as d\n"
        "import mcrdl_torch_plugin as p\n"
        "assert d.Backend._plugins['MCRDL'].creator_fn is p.create_backend\n"
        "assert 'mcrdl' not in sys.modules  # torch's autoload names the backend only\n"
        "assert d.Backend.MCRDL == 'mcrdl' and 'mcrdl' in d.Backend.backend_list\n"
        "assert d.Backend.backend_capability['mcrdl'] == ['cpu', 'cuda']\n"
        "import mcrdl, mcrdl.integrations.torch_backend as tb\n"
        "assert 'torch._dynamo' not in sys.modules  # its import costs each rank about 1 s\n"
        "assert tb.is_registered() and tb.register() == 'mcrdl' and tb.register() == 'mcrdl'\n"
        "try:\n    tb.register('gloo')\nexcept RuntimeError as e:\n    print('refused:', e)\n"
        "assert not mcrdl.is_initialized()\n")
    assert "refused: a different torch.distributed backend is already registered as 'gloo'" in out
    python("import torch.distributed as d\n"
           "assert 'MCRDL' not in d.Backend._plugins\n"
           "import mcrdl.integrations.torch_backend as tb\n"
           "assert not tb.is_registered() and tb.register() == 'mcrdl' and tb.is_registered()\n",
           env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"})


def test_reduce_ops_map_or_are_refused_by_name():
    R, M = dist.ReduceOp, tb.ReduceOp

    def mapped(reduce_op, what, dtype):
        opts = dist.AllreduceOptions()  # as torch passes them
        opts.reduceOp = reduce_op
        return tb._reduce_op(opts, what, dtype)

    assert tb._reduce_op(None, "allreduce", torch.float32) is M.SUM
    for torch_op, mine in ((R.SUM, M.SUM), (R.AVG, M.AVG), (R.PRODUCT, M.PRODUCT), (R.MIN, M.MIN),
                           (R.MAX, M.MAX)):
        assert mapped(torch_op, "allreduce", torch.float32) is mine
        assert mapped(dist.ReduceOp(torch_op), "allreduce", torch.float32) is mine
    assert mapped(R.BOR, "allreduce", torch.bool) is M.MAX
    assert mapped(R.BAND, "allreduce", torch.bool) is M.MIN
    for bad, dtype in ((R.BXOR, torch.int32), (R.BAND, torch.int64),
                       (dist._make_nccl_premul_sum(2.0), torch.float32)):
        with pytest.raises(tb.UnsupportedError, match=r"reduce_scatter: ReduceOp\.\w+ is not supported"):
            mapped(bad, "reduce_scatter", dtype)


def test_one_process_without_a_launcher():
    """init_process_group("mcrdl") on a HashStore: mcrdl starts as a 1-rank world."""
    out = python(
        "import torch, torch.distributed as dist, mcrdl\n"
        "import mcrdl.integrations.torch_backend as tb\n"
        "tb.register()\n"
        "dist.init_process_group('mcrdl', store=dist.HashStore(), rank=0, world_size=1)\n"
        "t = torch.ones(3); dist.all_reduce(t, op=dist.ReduceOp.AVG); assert t.tolist() == [1.0] * 3\n"
        "m = torch.nn.Linear(2, 1); ddp = torch.nn.parallel.DistributedDataParallel(m)\n"
        "ddp(torch.ones(4, 2)).sum().backward(); assert m.bias.grad.item() == 4.0\n"
        "assert mcrdl.get_world_size() == 1\n"
        "dist.destroy_process_group(); print('ONE OK')\n", timeout=180)
    assert "ONE OK" in out


@pytest.mark.parametrize("default_backend,layer,launcher", [
    ("mpi", "compiled", "mpiexec"), ("gloo", "compiled", "torchrun"), ("gloo", "python", "mpiexec")])
def test_torch_collectives_match_references(default_backend, layer, launcher):
    """Both forms of the torch layer: csrc/torch_method.cpp's TorchMethods (under mcrdl run's
    mpiexec and under torchrun), and the Python methods alone (MCRDL_NATIVE=0),
    which the compiled ones fall back to."""
    env = {"MCRDL_NATIVE": "0"} if layer == "python" else {}
    out = run_job(2, "torch_backend_ops_job.py", default_backend, timeout=300, env=env, launcher=launcher)
    out.require(["torch backend ops finished"], range(2))
    assert out.count(f"torch layer {layer}") == 2, out[-2000:]


@pytest.mark.parametrize("default_backend", ["mpi", "gloo"])
def test_ddp_through_mcrdl_matches_plain_gloo(default_backend):
    out = run_job(2, "torch_backend_ddp_job.py", default_backend, 6, timeout=300)
    out.require(["torch backend ddp finished"], range(2))
    assert out.count("max |loss diff| 0, max |param diff| 0") == 2  # bit-identical at 2 ranks
    assert out.count(f"all_reduce on {default_backend}") == 2


def test_static_map_routes_ddp_ops():
    """MCRDL_OP_BACKENDS reaches through torch: DDP's gradient all-reduces and its
    shape check (all_gather) on gloo, its parameter broadcast on the default (mpi)."""
    out = run_job(2, "torch_backend_ddp_job.py", "mpi", 3, timeout=300,
                  env={"MCRDL_OP_BACKENDS": "all_reduce:gloo,all_gather:gloo"})
    out.require(["torch backend ddp finished"], range(2))
    assert out.count("all_gather on gloo, all_reduce on gloo, broadcast on mpi") == 2, out[-3000:]


@pytest.mark.parametrize("nprocs", [2, 4])
def test_rank_agreement_and_sub_groups(nprocs):
    out = run_job(nprocs, "torch_backend_groups_job.py", timeout=240)
    out.require(["torch backend groups finished"], range(nprocs))


def test_plain_init_under_torchrun():
    proc = subprocess.run([sys.executable, "-m", "mcrdl.cli", "run", "--launcher", "torchrun",
                           "--extra=--standalone", "-n", "2", "--timeout", "180",
                           FORKED, str(JOBS / "torch_backend_env_job.py")], capture_output=True, text=True,
                          timeout=240, cwd=JOBS, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert out.count("TORCH BACKEND ENV OK") == 2


def test_plain_init_with_env_rendezvous_and_no_launcher():
    """RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT by hand: mcrdl joins torch's TCPStore."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, FORKED, str(JOBS / "torch_backend_env_job.py")], cwd=JOBS,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                   "RANK": str(r), "WORLD_SIZE": "2", "PYTHONUNBUFFERED": "1"})
             for r in range(2)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    assert sum(o.count("TORCH BACKEND ENV OK") for o in outs) == 2


def test_example_runs():
    proc = subprocess.run([sys.executable, "-m", "mcrdl.cli", "run", "-n", "2", "--timeout", "180",
                           FORKED, str(ROOT / "examples" / "torch_backend_ddp.py")], capture_output=True,
                          text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert proc.stdout.count("same as gloo: True") == 2, proc.stdout


@pytest.mark.parametrize("nprocs,init", [(2, "env://"), (4, "file://"), (3, "tcp://")])
def test_one_word_switch_under_mcrdl_run(nprocs, init, tmp_path):
    """MPI and gloo live; torch's rendezvous of any kind gives mcrdl its store."""
    arg = {"env://": "env://", "file://": f"file://{tmp_path}/store",
           "tcp://": f"tcp://127.0.0.1:{free_port()}"}[init]
    out = run_job(nprocs, "torch_backend_dropin_job.py", arg, timeout=240)
    out.require(["drop-in finished"], range(nprocs))
    assert out.count(f"DROP-IN OK ({init[:-3]}, live ['mpi', 'gloo'])") == nprocs, out[-3000:]


def test_one_word_switch_spawned_with_a_file_store(tmp_path):
    """Ranks spawned by hand (as PyTorch's own test suite does), FileStore rendezvous: MPI
    starts over that store (mcrdl.pmi), beside gloo."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "MPI_LOCAL"))}
    procs = [subprocess.Popen([sys.executable, FORKED, str(JOBS / "torch_backend_dropin_job.py"),
                               f"file://{tmp_path}/store"], cwd=JOBS, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True,
                              env={**env, "RANK": str(r), "WORLD_SIZE": "2", "PYTHONUNBUFFERED": "1"})
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    assert all("DROP-IN OK (file, live ['mpi', 'gloo'])" in o for o in outs), outs
