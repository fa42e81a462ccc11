"""End-to-end workloads (mcrdl.tools.workloads, examples/workloads) and `mcrdl demo`.

Each workload runs a few training steps in every mode on 2 real ranks; the
losses and the final parameters must agree across modes (on 2 ranks every
reduction is one addition, so they are identical), DDP through the mcrdl
hooks must match plain DDP on torch's gloo group, and the tuned / coarse
modes must really mix libraries within one step (checked on the selection
profile each run records).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import run_job

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (conftest)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples" / "workloads"

#: A hand-written table that splits every op between the libraries by size, so
#: "tuned" mixes MPI and gloo inside one training step of each workload.
MIXED_TABLE = {
    "format": "mcrdl-tuning/1",
    "metadata": {"note": "tests/test_workloads.py: mixes backends by size"},
    "rules": {
        "all_reduce": {"2": [{"max_bytes": 100000, "backend": "gloo"},
                             {"max_bytes": 2000000, "backend": "mpi"},
                             {"max_bytes": None, "backend": "gloo"}]},
        "all_to_all": {"2": [{"max_bytes": 1024, "backend": "gloo"},
                             {"max_bytes": None, "backend": "mpi"}]},
        "all_gather": {"2": [{"max_bytes": 65536, "backend": "mpi"},
                             {"max_bytes": None, "backend": "gloo"}]},
        "reduce_scatter": {"2": [{"max_bytes": 65536, "backend": "gloo"},
                                 {"max_bytes": None, "backend": "mpi"}]},
    },
}

MODES = "baseline-gloo,baseline-mpi,coarse,tuned"


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    path = tmp_path_factory.mktemp("tables") / "mixed.json"
    path.write_text(json.dumps(MIXED_TABLE))
    return str(path)


def run_workload(tmp_path, name, *args, nprocs=2):
    out = tmp_path / f"{name}.json"
    log = run_job(nprocs, str(EXAMPLES / f"{name}.py"), "--steps", "2", "--warmup", "1",
                  "--json", str(out), *args)
    doc = json.loads(out.read_text())
    return doc, log


def backends_by_mode(doc):
    return {m: {be for _, _, be, _ in s["profile"]} for m, s in doc["summary"].items()}


def assert_identical(doc, lossy=()):
    agree = doc["agreement"]
    for mode, a in agree["modes"].items():
        if mode in lossy:
            continue
        assert a["exact"], f"{doc['workload']}: {mode} differs from {agree['reference']}: {a}"
    assert agree["ok"], agree
    # and training happened: finite losses, one per step per rank
    for run in doc["runs"]:
        assert len(run["losses"]) == doc["world_size"]
        assert all(len(l) == doc["warmup"] + doc["steps"] for l in run["losses"])


def test_moe_modes_agree_and_mix(tmp_path, table):
    doc, log = run_workload(tmp_path, "moe", "--mode", MODES, "--table", table,
                            "--coarse-map", "all_to_all:mpi,all_reduce:gloo")
    assert_identical(doc)
    used = backends_by_mode(doc)
    assert used["baseline-gloo"] == {"gloo"} and used["baseline-mpi"] == {"mpi"}
    assert used["coarse"] == {"mpi", "gloo"} and used["tuned"] == {"mpi", "gloo"}, used
    ops = {op for op, *_ in doc["summary"]["tuned"]["profile"]}
    assert ops == {"all_to_all_single", "all_reduce"}
    assert "agree across modes" in log
    s = doc["summary"]["tuned"]
    assert s["samples_per_s"] > 0 and 0 < s["comm_share"] < 1


def test_dlrm_modes_agree_and_mix(tmp_path, table):
    """7 tables on 2 ranks: uneven all-to-all splits."""
    doc, _ = run_workload(tmp_path, "dlrm", "--mode", MODES, "--table", table, "--tables", "7",
                          "--coarse-map", "all_to_all:mpi,all_reduce:gloo")
    assert_identical(doc)
    used = backends_by_mode(doc)
    assert used["coarse"] == {"mpi", "gloo"} and used["tuned"] == {"mpi", "gloo"}, used


def test_decode_runs_its_all_reduces_on_shm_where_the_table_says(tmp_path):
    """Tensor-parallel decoding with a table that gives shm the all-reduces up to
    4 KiB (its messages are 4 KiB: batch 4 x hidden 256): tuned runs them on shm,
    the baselines on their one library, and every mode's outputs are identical
    (a 2-rank sum is the same float on either library)."""
    path = tmp_path / "shm.json"
    path.write_text(json.dumps({"format": "mcrdl-tuning/1", "rules": {"all_reduce": {"2": [
        {"max_bytes": 4096, "backend": "shm"}, {"max_bytes": None, "backend": "mpi"}]}}}))
    doc, _ = run_workload(tmp_path, "decode", "--mode", "baseline-gloo,baseline-mpi,tuned", "--table", str(path))
    assert_identical(doc)
    used = backends_by_mode(doc)
    assert used["baseline-gloo"] == {"gloo"} and used["baseline-mpi"] == {"mpi"} and used["tuned"] == {"shm"}, used


@pytest.mark.parametrize("nprocs", [2, 4])
def test_data_parallel_reduces_its_gradient_buffer_in_buckets_on_each_library(tmp_path, nprocs):
    """Gradients in one flat buffer, averaged after backward in 1 MiB slices: a
    table that splits them by size between shm (the full slices) and MPI (the
    last, smaller one) mixes two libraries in one step, and every mode trains
    to the same losses (on 4 ranks within the tolerance: sums in other orders)."""
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"format": "mcrdl-tuning/1", "rules": {"all_reduce": {str(nprocs): [
        {"max_bytes": 1000000, "backend": "mpi"}, {"max_bytes": None, "backend": "shm"}]}}}))
    doc, _ = run_workload(tmp_path, "dp", "--mode", "baseline-gloo,baseline-mpi,tuned", "--table", str(path),
                          nprocs=nprocs)
    if nprocs == 2:
        assert_identical(doc)
    assert doc["agreement"]["ok"], doc["agreement"]
    used = backends_by_mode(doc)
    assert used["baseline-mpi"] == {"mpi"} and used["tuned"] == {"shm", "mpi"}, used
    sizes = sorted(b for _, b, _, _ in doc["summary"]["tuned"]["profile"])
    assert sizes[-1] == 1 << 20 and sizes[0] < 1 << 20, sizes


def test_megatron_tensor_parallel_modes_agree(tmp_path, table):
    doc, _ = run_workload(tmp_path, "megatron", "--mode", MODES, "--table", table)
    assert_identical(doc)
    ops = {op for op, *_ in doc["summary"]["tuned"]["profile"]}
    assert ops == {"all_reduce"}


def test_megatron_sequence_parallel_modes_agree_and_mix(tmp_path, table):
    doc, _ = run_workload(tmp_path, "megatron", "--sequence-parallel", "--mode", MODES,
                          "--table", table,
                          "--coarse-map", "all_gather:mpi,reduce_scatter:gloo,all_reduce:mpi")
    assert_identical(doc)
    ops = {op for op, *_ in doc["summary"]["tuned"]["profile"]}
    assert ops == {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"}
    used = backends_by_mode(doc)
    assert used["coarse"] == {"mpi", "gloo"} and used["tuned"] == {"mpi", "gloo"}, used


def test_ddp_hooks_match_plain_ddp(tmp_path, table):
    """Every mcrdl hook gives plain DDP's losses and parameters; fp16 is close."""
    modes = "torch,baseline-gloo,baseline-mpi,coarse,tuned,tuned+polled,tuned+fused,tuned+fp16"
    doc, _ = run_workload(tmp_path, "ddp", "--mode", modes, "--table", table)  # 1 + 4 MB buckets
    assert doc["agreement"]["reference"] == "torch"
    assert_identical(doc, lossy=("tuned+fp16",))
    fp16 = doc["agreement"]["modes"]["tuned+fp16"]
    assert fp16["lossy"] and fp16["max_rel"] < 1e-2, fp16
    used = backends_by_mode(doc)
    assert used["tuned"] == {"mpi", "gloo"}, used   # buckets on both sides of a threshold
    assert doc["summary"]["torch"]["comm_share"] is None
    assert doc["summary"]["tuned"]["comm_share"] > 0


def test_quick_tune_when_no_table_and_data_parallel_megatron(tmp_path):
    """tuned/coarse without --table run `mcrdl tune --quick` in the job first;
    megatron with --tp 1 on 2 ranks is pure data parallelism."""
    tune_out = tmp_path / "auto.json"
    doc, log = run_workload(tmp_path, "megatron", "--mode", "baseline-gloo,coarse,tuned", "--tp", "1",
                            "--tune-out", str(tune_out), "--layers", "1")
    assert tune_out.exists() and "tuning table written" in log
    assert doc["coarse_map"] and set(doc["coarse_map"]) == {"all_reduce", "all_gather", "reduce_scatter"}
    assert {op for op, *_ in doc["summary"]["tuned"]["profile"]} == {"all_reduce"}
    assert_identical(doc)


def test_demo_end_to_end(tmp_path, table):
    """`mcrdl demo` (outside a job) launches the job, prints the table, writes
    results.json and the chart; with a given table it skips the tune."""
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "mcrdl.cli", "demo", "--workloads", "moe,ddp", "--steps", "1",
           "--warmup", "1", "--rounds", "1", "--table", table, "--out", str(out), "--timeout", "300"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=330, cwd=tmp_path)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "vs gloo baseline" in log and "agree across modes: yes" in log
    doc = json.loads((out / "results.json").read_text())
    assert doc["format"] == "mcrdl-demo/1" and doc["agree"]
    modes = {(r["workload"], r["mode"]) for r in doc["rows"]}
    assert ("moe", "tuned") in modes and ("ddp", "torch") in modes and ("ddp", "tuned+fused") in modes
    gloo = [r for r in doc["rows"] if r["mode"] == "baseline-gloo"]
    assert all(abs(r["vs_gloo"] - 1) < 1e-9 for r in gloo)
    assert (out / "demo.png").stat().st_size > 10000


def test_demo_autotuned_mode_runs_without_the_quick_tune(tmp_path):
    """`mcrdl demo --modes ...,autotuned`: no mode needs a table, so no tune;
    every autotuned run records what it learned, finished within the warm-up
    (trial blocks of 10 ms, so that a trial ends within the warm-up: 40 steps, every
    live library explored, four here, with the rest of the suite on the cores)."""
    out = tmp_path / "demo"
    cmd = [sys.executable, "-m", "mcrdl.cli", "demo", "--workloads", "moe,dlrm", "--modes",
           "baseline-gloo,autotuned", "--steps", "2", "--warmup", "40", "--rounds", "1", "--out", str(out),
           "--timeout", "300"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=330, cwd=tmp_path,
                          env={**os.environ, "MCRDL_AUTOTUNE_BLOCK_MS": "10"})
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "quick tune" not in log and not (out / "table.json").exists()
    assert "agree across modes: yes" in log
    for name in ("moe", "dlrm"):
        doc = json.loads((out / f"{name}.json").read_text())
        assert_identical(doc)
        run = next(r for r in doc["runs"] if r["mode"] == "autotuned")
        for rank in run["autotune"]:
            assert rank["exploring_after_warmup"] == 0, rank
            assert {b["op"] for b in rank["buckets"]} >= {"all_reduce", "all_to_all"}, rank


# -- unit tests of the runner (no job) ------------------------------------------------------
def test_parse_modes_and_variants():
    from mcrdl.tools.workloads.common import parse_modes
    from mcrdl.tools.workloads.ddp import WORKLOAD as ddp
    from mcrdl.tools.workloads.moe import WORKLOAD as moe

    assert [m[0] for m in parse_modes("all", moe, "gloo")] == \
        ["baseline-gloo", "baseline-mpi", "coarse", "tuned"]
    assert parse_modes("baseline", moe, "mpi")[0][:3] == ("baseline-mpi", "baseline", "mpi")
    assert parse_modes("tuned+fused,torch", ddp, "gloo")[0] == ("tuned+fused", "tuned", None, "fused")
    with pytest.raises(ValueError, match="unknown variant"):
        parse_modes("tuned+fused", moe, "gloo")
    with pytest.raises(ValueError, match="unknown mode"):
        parse_modes("torch", moe, "gloo")
    assert parse_modes("autotuned", moe, "gloo") == [("autotuned", "autotuned", None, None)]
    # CUDA tensors: MPI is host-staged (no CUDA-aware MPI is assumed)
    assert [m[0] for m in parse_modes("all", moe, "gloo", "cuda")] == \
        ["baseline-gloo", "baseline-mpi_staged", "coarse", "tuned"]


def test_demo_device_and_modes(monkeypatch):
    """The demo runs on CUDA tensors where torch sees a GPU for every rank,
    with that device's baselines: NCCL only with a GPU per rank."""
    import torch

    from mcrdl.tools import demo
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert demo.default_device(2) == "cpu"
    assert demo.main_modes("cpu", 2) == ["baseline-gloo", "baseline-mpi", "coarse", "tuned"]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.distributed, "is_nccl_available", lambda: True)
    assert demo.default_device(2) == "cpu" and demo.default_device(1) == "cuda"
    assert demo.main_modes("cuda", 2) == ["baseline-gloo", "baseline-mpi_staged", "coarse", "tuned"]
    assert demo.main_modes("cuda", 1) == ["baseline-gloo", "baseline-mpi_staged", "baseline-nccl",
                                          "coarse", "tuned"]
    with pytest.raises(ValueError, match="unknown modes \\['baseline-mpi_staged'\\] for cpu tensors"):
        demo._modes("baseline-mpi_staged,tuned", "cpu")
    assert demo._modes("baseline-nccl,autotuned", "cuda") == ["baseline-nccl", "autotuned"]


def test_coarse_map_from_table_majority():
    from mcrdl.tools.workloads.common import coarse_map_from_table

    doc = {"metadata": {"sweep": {"sizes": [4, 256, 4096, 65536, 1 << 20]}},
           "rules": {"cpu": {"all_reduce": {"2": [{"max_bytes": 256, "backend": "mpi"},
                                                  {"max_bytes": None, "backend": "gloo"}]},
                             "all_to_all": {"2": [{"max_bytes": None, "backend": "mpi"}]}},
                     "cuda": {"all_to_all": {"2": [{"max_bytes": None, "backend": "nccl"}]}}}}
    assert coarse_map_from_table(doc, ["all_reduce", "all_to_all", "broadcast"], 2) == \
        {"all_reduce": "gloo", "all_to_all": "mpi"}
    assert coarse_map_from_table(doc, ["all_reduce", "all_to_all"], 2, "cuda") == {"all_to_all": "nccl"}
    # a tie goes to the backend of the largest size
    doc["metadata"]["sweep"]["sizes"] = [4, 1 << 20]
    assert coarse_map_from_table(doc, ["all_reduce"], 2) == {"all_reduce": "gloo"}


def test_comm_timer_union_and_compare():
    from mcrdl.tools.workloads.common import CommTimer, compare

    t = CommTimer()
    for a, b in ((1.0, 2.0), (1.5, 2.5), (3.0, 3.5), (0.0, 0.5), (9.0, 11.0)):
        t.add(a, b)
    assert t.take(0.25, 10.0) == pytest.approx(0.25 + 1.5 + 0.5 + 1.0)
    assert t.intervals == []
    runs = [{"mode": "a", "variant": None, "losses": [[1.0, 2.0]], "digest": [[3.0]]},
            {"mode": "b", "variant": None, "losses": [[1.0, 2.0 + 1e-9]], "digest": [[3.0]]},
            {"mode": "c", "variant": "fp16", "losses": [[1.0, 2.5]], "digest": [[3.0]]}]
    res = compare(runs, 1e-5, lossy=("fp16",))
    assert res["ok"] and res["modes"]["a"]["exact"] and not res["modes"]["b"]["exact"]
    assert res["modes"]["b"]["ok"] and not res["modes"]["c"]["ok"] and res["modes"]["c"]["lossy"]
    runs[1]["losses"][0][1] = 2.1
    assert not compare(runs, 1e-5, lossy=("fp16",))["ok"]
