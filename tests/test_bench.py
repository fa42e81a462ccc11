"""`mcrdl bench` and `mcrdl tune` for real: 2-rank (and one 3-rank) runs through the CLI.

Every sweep is tiny (two sizes, a handful of iterations): these tests check
what the commands produce, not how fast anything is.
"""
import csv
import datetime as dt
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import mpi4py
import pytest
import torch

from mcrdl.tools import bench, demo, tune
from mcrdl.backends import REGISTRY
from mcrdl.tuning import CLASS_METHODS, TuningTable

from conftest import JOBS, cpu_libraries, run_job

pytestmark = pytest.mark.usefixtures("forked_ranks")  # (conftest)

ROOT = Path(__file__).parents[1]
OPS = ["all_reduce", "all_to_all"]
#: the libraries live here (registry order) and the bench's variants: each, mcrdl, the raw baselines
LIVE = cpu_libraries()
VARIANTS = LIVE + ["mcrdl"] + [f"raw-{b}" for b in LIVE if REGISTRY[b].raw_ops]


def has(variant, op):
    """Does ``variant`` run bench op ``op`` (a narrow library has only some)?"""
    if variant.startswith("raw-"):
        return op in REGISTRY[variant[4:]].raw_ops
    return variant not in REGISTRY or CLASS_METHODS["all_to_all" if op == "all_to_allv" else op] <= REGISTRY[variant].ops


def cells(ops, sizes=2):
    """Results of a sweep of ``ops`` at ``sizes`` sizes: every variant that has the op."""
    return sum(sizes for op in ops for v in VARIANTS if has(v, op))
TINY = ["--ops", ",".join(OPS), "--sizes", "4,64K", "--iters", "5", "--large-iters", "2",
        "--rounds", "2", "--warmup", "1"]
KNOWN = list(REGISTRY)


def mcrdl_cli(*args, timeout=180):
    return subprocess.run([sys.executable, "-m", "mcrdl.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})


def ok(proc):
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return proc


# -- mcrdl bench -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("bench")
    paths = {"json": d / "r.json", "csv": d / "r.csv", "plot": d / "plots.png"}
    proc = mcrdl_cli("bench", "-n", "2", *TINY, "--check", "--json", paths["json"],
                     "--csv", paths["csv"], "--plot", paths["plot"])
    return proc, paths


@pytest.fixture(scope="module")
def bench_doc(bench_run):
    ok(bench_run[0])
    return json.loads(bench_run[1]["json"].read_text())


def test_bench_exits_zero_and_prints_tables(bench_run):
    proc = ok(bench_run[0])
    for op in OPS:
        assert f"{op}: latency in us" in proc.stdout, proc.stdout[-3000:]
    assert "CHECK FAILED" not in proc.stdout
    assert f"plot: {bench_run[1]['plot']}" in proc.stdout
    summary = bench.selection_summary(bench.load_json(bench_run[1]["json"])[0])
    assert summary.startswith("selection over ") and summary in proc.stdout


def test_bench_on_one_rank_leaves_p2p_out(tmp_path):
    """p2p needs a peer: by default one rank measures every other op (it stopped
    the whole sweep before); asked for, it gets an error naming why."""
    ok(mcrdl_cli("bench", "-n", "1", "--sizes", "4", "--iters", "2", "--rounds", "1", "--warmup", "1",
                 "--json", tmp_path / "one.json"))
    measured = {r["op"] for r in json.loads((tmp_path / "one.json").read_text())["results"]}
    assert measured == set(bench.BENCH_OPS) - {"p2p"}
    proc = mcrdl_cli("bench", "-n", "1", "--ops", "p2p", "--sizes", "4")
    assert proc.returncode != 0 and "p2p is a ping-pong between two ranks" in proc.stderr


def test_bench_json_metadata(bench_doc):
    assert bench_doc["format"] == "mcrdl-bench/1"
    meta = bench_doc["metadata"]
    assert meta["world_size"] == 2
    assert meta["hosts"] == [socket.gethostname()]
    assert len(meta["rank_cpus"]) == 2 and all(meta["rank_cpus"])  # each rank's CPUs, e.g. "0,1"
    v = meta["versions"]
    assert v["torch"] == torch.__version__ and v["mpi4py"] == mpi4py.__version__
    assert v["mpi"] and v["gloo"]
    assert dt.datetime.fromisoformat(meta["date"]).tzinfo is not None
    assert meta["mode"] == "back-to-back" and "cold_step" not in meta
    sweep = meta["sweep"]
    assert sweep["ops"] == OPS and sweep["sizes"] == [4, 65536]
    assert sweep["variants"] == VARIANTS
    assert (sweep["iters"], sweep["large_iters"], sweep["rounds"], sweep["warmup"]) == (5, 2, 2, 1)


def test_bench_every_op_and_size_has_every_variant(bench_doc):
    seen = {}
    for r in bench_doc["results"]:
        seen.setdefault((r["op"], r["bytes"]), []).append(r["variant"])
    # sizes are the op's buffer: all_to_all rounds 4 B up to one float per rank
    assert sorted(seen) == [("all_reduce", 4), ("all_reduce", 65536),
                            ("all_to_all", 8), ("all_to_all", 65536)]
    for key, variants in seen.items():
        want = [v for v in VARIANTS if has(v, key[0])]
        assert sorted(variants) == sorted(want), key


def test_bench_result_fields(bench_doc):
    fields = set(bench.Result.__dataclass_fields__)
    for r in bench_doc["results"]:
        where = (r["op"], r["bytes"], r["variant"])
        assert set(r) == fields, where
        assert r["check"] == "ok", where
        assert 0 < r["min_us"] <= r["avg_us"] * (1 + 1e-9), where
        assert r["avg_us"] <= r["max_us"] * (1 + 1e-9), where
        assert r["rounds"] == 2 and len(r["round_max_us"]) == 2, where
        assert r["iters"] == (5 if r["bytes"] < 8192 else 2), where
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / r["max_us"] / 1e3, rel=1e-9), where
        factor = bench.busbw_factor(r["op"], 2)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * factor, rel=1e-9), where
        expected_backend = "raw" if r["variant"].startswith("raw-") else r["variant"]
        if r["variant"] == "mcrdl":
            assert r["backend"] in LIVE, where  # what the selection picked
        else:
            assert r["backend"] == expected_backend, where
    # all_reduce busbw = 2(n-1)/n algbw = algbw at n = 2; all_to_all: half
    r = next(r for r in bench_doc["results"] if r["op"] == "all_to_all")
    assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] / 2)


def test_bench_loads_back(bench_run, bench_doc):
    results, meta = bench.load_json(bench_run[1]["json"])
    assert len(results) == len(bench_doc["results"]) == cells(OPS)
    assert meta == bench_doc["metadata"]


def test_bench_csv(bench_run, bench_doc):
    with open(bench_run[1]["csv"], newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == bench.CSV_FIELDS
    body = [dict(zip(rows[0], row)) for row in rows[1:]]
    assert len(body) == len(bench_doc["results"])
    for row, r in zip(body, bench_doc["results"]):
        assert (row["op"], int(row["bytes"]), row["variant"], row["backend"], row["check"]) == \
            (r["op"], r["bytes"], r["variant"], r["backend"], r["check"])
        assert float(row["max_us"]) == pytest.approx(r["max_us"])
        assert float(row["busbw_gbps"]) == pytest.approx(r["busbw_gbps"])


def test_bench_plots(bench_run):
    ok(bench_run[0])
    data = bench_run[1]["plot"].read_bytes()  # (one panel per op)
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_bench_all_ops_check_ok_on_3_ranks(tmp_path):
    """Every op, every variant, odd world and a size that does not split evenly."""
    out = tmp_path / "r.json"
    proc = ok(mcrdl_cli("bench", "-n", "3", "--sizes", "12,4K", "--iters", "2", "--large-iters",
                        "1", "--rounds", "1", "--warmup", "1", "--check", "--json", out))
    doc = json.loads(out.read_text())
    assert doc["metadata"]["world_size"] == 3
    results = doc["results"]
    assert {r["op"] for r in results} == set(bench.BENCH_OPS)
    assert len(results) == cells(bench.BENCH_OPS)
    bad = [(r["op"], r["bytes"], r["variant"]) for r in results if r["check"] != "ok"]
    assert not bad, bad
    for r in results:
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bench.busbw_factor(r["op"], 3))
    assert "CHECK FAILED" not in proc.stdout


# -- mcrdl tune ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tune_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("tune")
    paths = {"out": d / "table.json", "results": d / "sweep.json", "plot": d / "plots.png"}
    proc = mcrdl_cli("tune", "-n", "2", *TINY, "--out", paths["out"], "--results",
                     paths["results"], "--plot", paths["plot"])
    ok(proc)
    return proc, paths


def test_tune_writes_a_loadable_table(tune_run):
    proc, paths = tune_run
    table = TuningTable.load(str(paths["out"]), known=KNOWN, live=LIVE)
    meta = table.metadata
    assert meta["world_size"] == 2 and meta["hosts"] == [socket.gethostname()]
    assert meta["cpu_models"] == [bench.cpu_model()] and meta["cpu_models"][0] not in ("", "unknown"), meta
    assert {"torch", "mpi4py", "mpi", "gloo"} <= set(meta["versions"])
    dt.datetime.fromisoformat(meta["date"])
    assert meta["sweep"]["ops"] == OPS and meta["sweep"]["backends"] == LIVE
    doc = json.loads(paths["out"].read_text())
    assert list(doc["rules"]) == ["cpu"] and meta["device"] == "cpu"
    assert set(doc["rules"]["cpu"]) == set(OPS)
    for op in OPS:
        assert list(doc["rules"]["cpu"][op]) == ["2"]
        rules = doc["rules"]["cpu"][op]["2"]
        assert rules[-1]["max_bytes"] is None
        assert all(r["backend"] in LIVE and isinstance(r["margin"], (int, float)) for r in rules)
        assert table.lookup(op, 2, 1 << 30) == rules[-1]["backend"]
    assert f"tuning table written to {paths['out']}" in proc.stdout
    again = meta["decision"]["remeasured"]  # sizes won by a minority backend, measured twice
    assert set(again) <= set(OPS) and all(set(s) <= set(meta["sweep"]["sizes"]) for s in again.values())
    assert ("measured again (won by a minority backend)" in proc.stdout) == bool(again)


def test_tune_table_is_the_decision_on_its_results(tune_run):
    """The written table is exactly make_table() over the written measurements."""
    _, paths = tune_run
    results, meta = bench.load_json(paths["results"])
    assert {r.variant for r in results} == set(LIVE)
    assert {r.op for r in results} == set(OPS)
    doc = json.loads(paths["out"].read_text())
    margin = doc["metadata"]["decision"]["hysteresis"]
    assert margin == 0.05
    assert tune.make_table(results, LIVE, 2, meta, margin)["rules"] == doc["rules"]
    for op, rows in tune.decide(results, LIVE, margin).items():
        table = TuningTable.from_dict(doc, KNOWN)
        for size, winner, _ in rows:
            assert table.lookup(op, 2, size) == winner


def test_tune_prints_crossovers_and_speedups(tune_run):
    proc, paths = tune_run
    out = proc.stdout
    assert "crossovers:" in out and "expected speed-up" in out
    doc = json.loads(paths["out"].read_text())
    for line in tune.crossovers(doc):
        assert line in out
    after = out.split("expected speed-up", 1)[1]
    for op in OPS:
        line = next(l for l in after.splitlines() if l.strip().startswith(op))
        for b in LIVE:
            assert (f"vs {b}: " in line and "x / " in line) == has(b, op), line


def test_tune_plots_shade_the_table(tune_run):
    proc, paths = tune_run
    assert paths["plot"].read_bytes()[:4] == b"\x89PNG"
    assert f"plot: {paths['plot']}" in proc.stdout


def _table_sizes(doc):
    """all_reduce sizes with the backend the table names: every rule's bound,
    just above it, and far beyond the last."""
    table = TuningTable.from_dict(doc, KNOWN)
    sizes = {4, 65536, 1 << 20}
    for r in doc["rules"]["cpu"]["all_reduce"]["2"]:
        if r["max_bytes"] is not None:
            sizes |= {max(r["max_bytes"] // 4 * 4, 4), r["max_bytes"] // 4 * 4 + 4}
    return [f"{s}:{table.lookup('all_reduce', 2, s)}" for s in sorted(sizes)]


def test_tuned_table_drives_selection_in_a_job(tune_run):
    _, paths = tune_run
    doc = json.loads(paths["out"].read_text())
    pairs = _table_sizes(doc)
    out = run_job(2, "table_job.py", *pairs, timeout=120,
                  env={"MCRDL_TUNING_TABLE": str(paths["out"])})
    for pair in pairs:
        nbytes, backend = pair.split(":")
        assert out.count(f"{nbytes} B -> {backend} ok") == 2, out[-3000:]


def test_bench_with_the_tuned_table(tune_run, tmp_path):
    _, paths = tune_run
    out = tmp_path / "r.json"
    proc = ok(mcrdl_cli("bench", "-n", "2", *TINY, "--table", paths["out"], "--variants", "mcrdl",
                        "--check", "--json", out))
    assert "all_reduce: latency in us" in proc.stdout
    table = TuningTable.load(str(paths["out"]), KNOWN)
    results = json.loads(out.read_text())["results"]
    assert len(results) == len(OPS) * 2
    for r in results:
        assert r["variant"] == "mcrdl" and r["check"] == "ok"
        assert r["backend"] == table.lookup(r["op"], 2, r["bytes"]), r


# -- --check catches wrong results -----------------------------------------------------------
def test_check_marks_a_corrupting_backend_as_failed():
    out = run_job(2, "bench_corrupt_job.py", "api", timeout=120)
    lines = sorted(l for l in out.splitlines() if l.startswith("CHECK "))
    assert lines == sorted([
        "CHECK all_reduce 4 mpi ok", "CHECK all_reduce 4 gloo_corrupt FAIL",
        "CHECK all_reduce 4096 mpi ok", "CHECK all_reduce 4096 gloo_corrupt FAIL",
        "CHECK p2p 4 mpi ok", "CHECK p2p 4 gloo_corrupt FAIL",
        "CHECK p2p 4096 mpi ok", "CHECK p2p 4096 gloo_corrupt FAIL"]), out[-3000:]


def test_bench_cli_exits_nonzero_when_a_check_fails():
    """`mcrdl bench --check` inside a job where the corrupting backend is registered."""
    cmd = [sys.executable, "-m", "mcrdl.cli", "run", "-n", "2", "--timeout", "120",
           str(JOBS / "bench_corrupt_job.py"), "cli"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "CHECK FAILED: 2 results" in out, out[-3000:]
    assert "all_reduce 4 B on gloo_corrupt" in out and "all_reduce 4096 B on gloo_corrupt" in out
    assert "on mpi" not in out


@pytest.mark.alone
def test_tune_measures_a_minority_winner_again(tmp_path):
    """A backend slow only while the sweep measured one size lost that size to
    gloo (gloo_steady: 5 ms added to each call, so that load cannot decide the cells);
    the second pass measures it at its usual speed and the table keeps it."""
    table = tmp_path / "table.json"
    cmd = [sys.executable, "-m", "mcrdl.cli", "run", "-n", "2", "--timeout", "120",
           str(JOBS / "tune_slow_phase_job.py"), str(table)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "measured again (won by a minority backend): all_reduce 64K" in out, out[-3000:]
    assert "winners changed: all_reduce 64K gloo_steady -> mpi_slow_phase" in out, out[-3000:]
    doc = json.loads(table.read_text())
    assert doc["rules"]["cpu"]["all_reduce"]["2"] == [
        {"max_bytes": None, "backend": "mpi_slow_phase", "margin": doc["rules"]["cpu"]["all_reduce"]["2"][0]["margin"]}]
    assert doc["metadata"]["decision"]["remeasured"] == {"all_reduce": [65536]}


# -- cold mode -------------------------------------------------------------------------------
def test_bench_cold_mode_is_recorded_and_fitted(tmp_path):
    """(Launched with --bind core: the ranks' CPUs are recorded.)"""
    from mcrdl.tools.model import CostModel

    out = tmp_path / "cold.json"
    ok(mcrdl_cli("bench", "-n", "2", "--bind", "core", "--cold", "--variants", "mpi", "--ops", "all_reduce",
                 "--sizes", "4,64K", "--iters", "2", "--large-iters", "2", "--rounds", "1",
                 "--warmup", "1", "--check", "--json", out))
    results, meta = bench.load_json(out)
    assert meta["mode"] == "cold" and meta["cold_step"] == bench.COLD_STEP
    if len(os.sched_getaffinity(0)) >= 2:
        cpus = meta["rank_cpus"]
        assert len(set(cpus)) == 2 and all("," not in c for c in cpus), cpus
    assert [(r.bytes, r.check) for r in results] == [(4, "ok"), (65536, "ok")]
    # each call counts the last-arriving rank's time, the same on every rank
    assert all(r.avg_us == r.min_us == r.max_us > 0 for r in results)
    assert CostModel.from_bench(out).source.endswith(", cold calls)")


def test_tune_cold_mode_is_recorded(tmp_path):
    out, res = tmp_path / "t.json", tmp_path / "r.json"
    ok(mcrdl_cli("tune", "-n", "2", "--cold", "--backends", "mpi", "--ops", "all_reduce", "--out", out,
                 "--results", res, *SHORT, timeout=120))
    assert json.loads(out.read_text())["metadata"]["mode"] == "cold"
    assert bench.load_json(res)[1]["mode"] == "cold"


@pytest.mark.parametrize("mode", ["warm", "", None, 1, ["cold"]])
def test_bench_loader_refuses_an_unknown_mode(mode):
    doc = {"format": bench.FORMAT, "metadata": {"world_size": 2, "mode": mode}, "results": []}
    with pytest.raises(ValueError, match=r"<bench>: metadata\.mode: expected one of back-to-back, cold"):
        bench.from_doc(doc)


def test_bench_files_without_a_mode_are_back_to_back():
    doc = {"format": bench.FORMAT, "metadata": {"world_size": 2}, "results": []}
    assert bench.mode_of(bench.from_doc(doc)[1]) == "back-to-back"


# -- bad input -------------------------------------------------------------------------------
SHORT = ["--sizes", "4", "--iters", "1", "--large-iters", "1", "--rounds", "1", "--warmup", "1"]


@pytest.mark.parametrize("args, name", [
    (["--ops", "all_reduce,allreduce"], "allreduce"),
    (["--ops", "barrier"], "barrier"),
    (["--variants", "mpi,ucx"], "ucx"),
    (["--variants", "raw-nccl"], "raw-nccl"),   # nccl is registered but not live here
])
def test_bench_bad_input(args, name):
    proc = mcrdl_cli("bench", "-n", "2", *args, *SHORT, timeout=120)
    assert proc.returncode != 0
    assert f"'{name}'" in proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


def test_bench_missing_table_file_fails_fast_on_every_rank(tmp_path):
    # --timeout 2 bounds the hang (it is also the TCPStore timeout) so the failure is quick
    proc = mcrdl_cli("bench", "-n", "2", "--timeout", "2", "--table", tmp_path / "missing.json",
                     "--variants", "mcrdl", "--ops", "all_reduce", *SHORT, timeout=120)
    assert proc.returncode != 0
    assert proc.stderr.count("missing.json: cannot read tuning table") == 2, proc.stderr[-3000:]
    assert "timed out" not in proc.stderr, proc.stderr[-3000:]


def test_tune_unknown_backend(tmp_path):
    out = tmp_path / "t.json"
    proc = mcrdl_cli("tune", "-n", "2", "--backends", "mpi,ucx", "--ops", "all_reduce",
                     "--out", out, *SHORT, timeout=120)
    assert proc.returncode != 0 and "ucx" in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()


def test_tune_one_backend(tmp_path):
    out = tmp_path / "t.json"
    ok(mcrdl_cli("tune", "-n", "2", "--backends", "gloo", "--ops", "all_reduce", "--out", out,
                 *SHORT, timeout=120))
    doc = json.loads(out.read_text())
    assert doc["rules"] == {"cpu": {"all_reduce": {"2": [{"max_bytes": None, "backend": "gloo",
                                                           "margin": 0.0}]}}}
    assert doc["metadata"]["sweep"]["backends"] == ["gloo"]


def test_tune_merge_replaces_only_what_was_measured(tmp_path):
    """`--merge OLD`: the table written is OLD with the rules just measured
    (device, op, group size) in place of OLD's; the rest of OLD stays."""
    old = tmp_path / "old.json"
    cuda = {"all_reduce": {"2": [{"max_bytes": 4096, "backend": "mpi"}, {"max_bytes": None, "backend": "nccl"}]}}
    old.write_text(json.dumps({"format": "mcrdl-tuning/2", "metadata": {"note": "from the GPU run"},
                               "rules": {"cpu": {"broadcast": {"2": [{"max_bytes": None, "backend": "mpi"}]},
                                                 "all_reduce": {"2": [{"max_bytes": None, "backend": "mpi"}],
                                                                "8": [{"max_bytes": None, "backend": "mpi"}]}},
                                         "cuda": cuda}}))
    out = tmp_path / "t.json"
    ok(mcrdl_cli("tune", "-n", "2", "--device", "cpu", "--backends", "gloo", "--ops", "all_reduce",
                 "--merge", old, "--out", out, *SHORT, timeout=120))
    doc = json.loads(out.read_text())
    assert doc["rules"] == {"cpu": {"broadcast": {"2": [{"max_bytes": None, "backend": "mpi"}]},
                                    "all_reduce": {"2": [{"max_bytes": None, "backend": "gloo", "margin": 0.0}],
                                                   "8": [{"max_bytes": None, "backend": "mpi"}]}},
                            "cuda": cuda}
    assert doc["metadata"]["merged"] == {"table": str(old), "metadata": {"note": "from the GPU run"}}
    assert doc["metadata"]["device"] == "cpu"
    TuningTable.from_dict(doc, KNOWN)
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "mcrdl-tuning/2", "rules": {"tpu": {}}}')
    proc = mcrdl_cli("tune", "-n", "2", "--backends", "gloo", "--ops", "all_reduce", "--merge", bad,
                     "--out", tmp_path / "u.json", *SHORT, timeout=120)
    assert proc.returncode != 0 and "bad.json: rules.tpu: unknown device type" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "u.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_bench_and_tune_on_cuda_without_a_gpu_say_so():
    for cmd in ("bench", "tune"):
        proc = mcrdl_cli(cmd, "-n", "2", "--device", "cuda", "--ops", "all_reduce", *SHORT, timeout=120)
        assert proc.returncode == 2, proc.stderr[-3000:]
        assert proc.stderr.count("no live backend takes cuda tensors in this job (torch sees no CUDA device)") == 2, \
            proc.stderr[-3000:]  # each rank says so and exits, no hang


def test_tune_unknown_op(tmp_path):
    out = tmp_path / "t.json"
    proc = mcrdl_cli("tune", "-n", "2", "--ops", "all_reduce,allreduce", "--out", out, *SHORT,
                     timeout=120)
    assert proc.returncode != 0
    assert "allreduce" in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()


@pytest.mark.parametrize("backends", ["mcrdl", "raw-mpi", "mpi,nope"])
def test_tune_rejects_variants_that_are_not_backends(tmp_path, backends):
    """Only live backends compete in a table: a selection or raw variant is refused."""
    out = tmp_path / "t.json"
    proc = mcrdl_cli("tune", "-n", "2", "--backends", backends, "--ops", "all_reduce",
                     "--out", out, *SHORT, timeout=120)
    assert proc.returncode != 0
    assert "are not live backends for cpu tensors" in proc.stderr, proc.stderr[-3000:]
    assert not out.exists()


# -- benchmarks/percall/layers.py --------------------------------------------------------------------
def test_layers_benchmark_gives_equal_results_and_records_every_cell(tmp_path):
    """Each layer's outputs equal its reference's (mcrdl on gloo vs raw gloo,
    torch.distributed on "mcrdl" vs the API) before anything is timed."""
    out = tmp_path / "layers.json"
    ok(mcrdl_cli("run", "-n", "2", ROOT / "benchmarks" / "percall" / "layers.py", "--sizes", "4,1K", "--rounds", "1",
                 "--iters", "10", "--json", out, timeout=300))
    doc = json.loads(out.read_text())
    cells = {(r["layer"], r["op"], r["bytes"]) for r in doc["results"]}
    ops = ["all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
           "send/recv"]
    assert cells == {(layer, op, b) for layer in ("gloo", "torch") for op in ops for b in (4, 1024)}
    assert all(r["torch_alone_us"] > 0 for r in doc["results"] if r["layer"] == "torch")


# -- benchmarks/percall/hotpath.py -------------------------------------------------------------------
def test_hotpath_benchmark_measures_mpichs_floor_in_the_same_rounds(tmp_path):
    """Each collective's cells carry MPICH's own nonblocking floor, timed in C in
    the same rounds, and mcrdl's ratio over it; ops without one (send/recv) are
    judged against raw alone."""
    out = tmp_path / "hotpath.json"
    proc = mcrdl_cli("run", "-n", "2", ROOT / "benchmarks" / "percall" / "hotpath.py", "--ops",
                     "all_reduce,scatter,send/recv", "--sizes", "4,1K", "--rounds", "2", "--iters", "20",
                     "--json", out, timeout=300)
    ok(proc)
    doc = json.loads(out.read_text())
    assert sorted((r["op"], r["bytes"]) for r in doc["results"]) == sorted(
        (o, b) for o in ("all_reduce", "scatter", "send/recv") for b in (4, 1024))
    for r in doc["results"]:
        for style in ("back to back", "barrier between"):
            c = r[style]
            if r["op"] == "send/recv":
                assert c["floor_us"] is None and c["over_floor"] == pytest.approx(c["ratio"]), c
            else:
                assert c["floor_us"] >= 0 and 0 < c["over_floor"] <= max(c["ratios"]) + 1e-9, c
    assert "mcrdl / (raw mpi4py + MPICH's nonblocking floor)" in " ".join(proc.stdout.split())  # (titles wrap)


# -- benchmarks/percall/blocking_floor.py ------------------------------------------------------------
def test_blocking_floor_benchmark_builds_and_times_every_op_in_every_form(tmp_path):
    out = tmp_path / "floor.json"
    ok(mcrdl_cli("run", "-n", "2", ROOT / "benchmarks" / "percall" / "blocking_floor.py", "--sizes", "4,1K", "--rounds", "2",
                 "--json", out, timeout=300))
    doc = json.loads(out.read_text())
    ops = ["all_reduce", "broadcast", "reduce", "all_gather", "gather", "scatter", "all_to_all", "reduce_scatter"]
    assert sorted((r["op"], r["bytes"]) for r in doc["results"]) == sorted((o, b) for o in ops for b in (4, 1024))
    assert all(r["blocking_us"] > 0 and r[f"{f}_us"] > 0 and len(r[f"{f}_ratios"]) == 2
               for r in doc["results"] for f in ("test", "wait"))


# -- benchmarks/tuning/autotune.py ------------------------------------------------------------------
def test_autotune_benchmark_records_both_conditions(tmp_path):
    """Idle and one-core-busy demos, every workload; every autotuned run
    finished exploring within the warm-up and says what it learned (trial
    blocks of 10 ms: a trial is 8 blocks, 80 ms of calls, which 10 steps of
    dlrm did not always span in CI; 30 steps leave room)."""
    proc = subprocess.run([sys.executable, ROOT / "benchmarks" / "tuning" / "autotune.py", "--rounds", "1", "--steps", "1",
                           "--warmup", "30", "--out", tmp_path / "autotune", "--runs", tmp_path / "runs"],
                          capture_output=True, text=True, timeout=900,
                          env={**os.environ, "MCRDL_AUTOTUNE_BLOCK_MS": "10"})
    ok(proc)
    doc = json.loads((tmp_path / "autotune.json").read_text())
    assert set(doc["conditions"]) == {"idle", "one core busy"}
    for rows in doc["conditions"].values():
        assert {r["workload"] for r in rows} == set(demo.WORKLOADS)
        for r in rows:
            assert r["exploring_after_warmup"] == 0 and r["autotuned"] > 0 and r["tuned"] > 0, r
            assert all(b["winner"] in LIVE for b in r["buckets_learned"] if b["op"] != "barrier"), r
    for condition in ("idle", "loaded"):  # (--no-variants: ddp runs only the benchmark's modes)
        ddp = json.loads((tmp_path / "runs" / condition / "ddp.json").read_text())
        assert set(ddp["summary"]) == {"baseline-gloo", "baseline-mpi", "tuned", "autotuned"}, ddp["summary"].keys()


# -- benchmarks/tuning/autotune_trial.py ------------------------------------------------------------
def test_autotune_trial_benchmark_records_both_settings(tmp_path):
    """megatron-sp under load, trial off and on: every round's ratio to
    baseline-mpi, what gloo won and the trials, per setting."""
    proc = subprocess.run([sys.executable, ROOT / "benchmarks" / "tuning" / "autotune_trial.py", "--runs", "1", "--rounds", "1",
                           "--steps", "1", "--warmup", "3", "--out", tmp_path / "trial", "--tmp", tmp_path / "runs"],
                          capture_output=True, text=True, timeout=600)
    ok(proc)
    doc = json.loads((tmp_path / "trial.json").read_text())
    assert set(doc["summary"]) == set(doc["rounds"]) == {"trial off", "trial on"}
    for name, rounds in doc["rounds"].items():
        assert len(rounds) == 1 and rounds[0]["vs_mpi"] > 0 and rounds[0]["auto_step_ms"] > 0, rounds
        assert name == "trial on" or rounds[0]["trials"] == [], rounds  # off: no trial ever


# -- benchmarks/tuning/drift.py ---------------------------------------------------------------------
# its idle jobs must measure calls back to back (none made under another job's load)
@pytest.mark.alone
def test_drift_benchmark_records_every_job(tmp_path):
    """Idle and loaded jobs, drift check off and on: every job finishes with
    its step times, its winners, and (idle) its back-to-back call time."""
    out = tmp_path / "drift.json"
    proc = subprocess.run([sys.executable, ROOT / "benchmarks" / "tuning" / "drift.py", "--rounds", "1", "--steps", "90",
                           "--window", "8", "--calls", "200", "--out", out],
                          capture_output=True, text=True, timeout=600)
    ok(proc)
    runs = json.loads(out.read_text())["runs"]
    assert {(r["load"], r["drift"]) for r in runs} == {(False, 0), (False, 8), (True, 0), (True, 8)}
    for r in runs:
        assert r["before_ms"] > 0 and r["after_ms"] > 0 and (r["b2b_4B_us"] is None) == r["load"], r
        # (a bucket the check opened again late in the run may still be exploring)
        assert set(r["winners"].values()) <= ({*LIVE, None} if r["drift"] else set(LIVE)), r
        assert all(e["was"] in LIVE for e in r["reopened"]) and (r["drift"] or not r["reopened"]), r


# -- benchmarks/percall/pairs_median.py -------------------------------------------------------------
def test_pairs_median_reads_ratios_and_the_torch_layers_addition(tmp_path):
    """Medians over pairs of latency_vs_commit.sh's kept lines: ratios per cell, and
    (``--added``) torch's µs, the API's and the layer's addition per pair."""
    out = tmp_path / "ab.txt"
    out.write_text("\n".join([
        "== pair 1: abc1234", "│ all_reduce │ 3.00x (6.0 / 2.0; 2.0) │", "│ send/recv │ 6.00x (9.0 / 1.5; 2.5) │",
        "== pair 1: this tree", "│ all_reduce │ 2.50x (5.0 / 2.0; 2.0) │", "│ send/recv │ 5.00x (8.0 / 1.6; 2.4) │",
        "== pair 2: abc1234", "│ all_reduce │ 3.20x (6.4 / 2.0; 2.2) │", "│ send/recv │ 6.20x (9.3 / 1.5; 2.4) │",
        "== pair 2: this tree", "│ all_reduce │ 2.70x (5.4 / 2.0; 2.2) │", "│ send/recv │ 5.40x (8.6 / 1.6; 2.6) │",
    ]) + "\n")
    script = ROOT / "benchmarks" / "percall" / "pairs_median.py"
    ratios = subprocess.run([sys.executable, script, out], capture_output=True, text=True, timeout=60)
    ok(ratios)
    assert "| all_reduce | 3.10 → 2.60 |" in ratios.stdout and "2 cells fell, 0 rose" in ratios.stdout, ratios.stdout
    added = subprocess.run([sys.executable, script, out, "--added"], capture_output=True, text=True, timeout=60)
    ok(added)
    assert added.stdout.splitlines() == [
        "| all_reduce | 6.2 → **5.2** (API 2.0 → 2.0; added 2.1 → **1.1**) |",
        "| send/recv | 9.2 → **8.3** (API 1.5 → 1.6; added 5.2 → **4.2**) |"], added.stdout
