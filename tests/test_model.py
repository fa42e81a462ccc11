"""Communication model (mcrdl.tools.model): formulas on hand-checkable layouts, the
alpha-beta fit, the matrix, validation, the layout sweep and the CLI. Pure
Python, no ranks started."""
import copy
import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from mcrdl.tools.model import (CostModel, ModelConfigError, comm_matrix, compare, config_from_dict,
                         coords, estimate, fit_alpha_beta, flops_per_iteration, group_of,
                         load_config, load_log, make_fit, moe_dispatch, param_count, rank_layouts,
                         rank_of, stage_traffic)
from mcrdl.tools.model.traffic import expected_capped

ROOT = Path(__file__).parents[1]
EXAMPLES = ROOT / "examples" / "model"

BASE = {
    "model": {"layers": 4, "hidden": 64, "heads": 8, "seq_length": 32, "vocab": 128,
              "micro_batch": 2, "global_batch": 16, "bytes_per_element": 2},
    "parallel": {"pipeline": 1, "tensor": 2, "data": 2},
    "cluster": {"world_size": 4, "ranks_per_node": 4},
    "compute": {"peak_tflops": 1.0, "utilization": 0.5},
}


def make(**sections):
    """BASE with sections updated key by key (None deletes a key)."""
    doc = copy.deepcopy(BASE)
    for sec, vals in sections.items():
        if not isinstance(vals, dict):
            doc[sec] = vals
            continue
        doc.setdefault(sec, {})
        for k, v in vals.items():
            if v is None:
                doc[sec].pop(k, None)
            else:
                doc[sec][k] = v
    return config_from_dict(doc)


def by(entries, dim, op=None):
    return [x for x in entries if x.dim == dim and (op is None or x.op == op)]


# -- parameters and FLOPs -------------------------------------------------------------------
def test_param_count_dense_by_hand():
    cfg = make()
    h, l, V, s = 64, 4, 128, 32
    assert param_count(cfg)["total"] == V * h + s * h + l * (12 * h * h + 13 * h) + 2 * h
    cfg = make(model={"position_embeddings": False})
    assert param_count(cfg)["total"] == V * h + l * (12 * h * h + 13 * h) + 2 * h
    # per rank as the DP gradient counts it: N / (p t)
    assert param_count(cfg)["per_rank"] == param_count(cfg)["total"] / 2


def test_param_count_moe_multiplies_the_mlp_by_experts():
    cfg = make(model={"moe": {"experts": 4, "top_k": 1, "every": 2}}, parallel={"expert": 2})
    h = 64
    mlp = 8 * h * h + 5 * h
    dense_layer = 12 * h * h + 13 * h
    moe_layer = dense_layer - mlp + 4 * mlp + 4 * h  # 4 expert MLPs and a router h x E
    pc = param_count(cfg)
    assert pc["total"] == 128 * h + 32 * h + 2 * dense_layer + 2 * moe_layer + 2 * h
    assert pc["expert"] == 2 * 4 * mlp
    assert pc["expert_per_rank"] == pc["expert"] / (2 * 1 * 2)  # / (e p t): experts per rank
    assert pc["dense_per_rank"] == pc["dense"] / 2


def test_flops_match_design_formula():
    cfg = load_config(str(EXAMPLES / "gpt3_1.3b_64gpu.json"))
    m = cfg.model
    B, s, l, h, V = m.global_batch, m.seq_length, m.layers, m.hidden, m.vocab
    want = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    assert flops_per_iteration(cfg) == pytest.approx(want, rel=1e-12)
    no_rc = make(compute={"recompute": False})
    m = no_rc.model
    B, s, l, h, V = m.global_batch, m.seq_length, m.layers, m.hidden, m.vocab
    assert flops_per_iteration(no_rc) == pytest.approx(72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h)))


# -- traffic -----------------------------------------------------------------------------
@pytest.mark.parametrize("t", [2, 4, 8])
def test_tp_bytes_per_layer_per_micro_batch(t):
    cfg = make(parallel={"tensor": t, "data": 1, "pipeline": 2}, cluster={"world_size": 2 * t})
    b, s, h, B = 2, 32, 64, 2
    m = cfg.micro_batches
    assert m == 16 // (2 * 1)
    (tp,) = by(stage_traffic(cfg, 0), "tp")
    assert tp.op == "all_reduce" and tp.group_size == t
    assert tp.message_bytes == b * s * h * B
    assert tp.count == 4 * (4 // 2) * m  # 2 fwd + 2 bwd per layer of the stage per micro-batch
    per_layer_mb = tp.bytes_per_iteration / ((4 // 2) * m)
    assert per_layer_mb == pytest.approx(8 * b * s * h * B * (t - 1) / t)


def test_pp_sends_each_way_per_micro_batch():
    cfg = make(parallel={"pipeline": 4, "tensor": 1, "data": 1}, cluster={"world_size": 4})
    act, m = 2 * 32 * 64 * 2, cfg.micro_batches
    first, mid, last = stage_traffic(cfg, 0), stage_traffic(cfg, 1), stage_traffic(cfg, 3)
    assert [(x.op, x.message_bytes, x.count, x.peer_step) for x in by(first, "pp")] == [("p2p", act, m, 1)]
    assert sorted(x.peer_step for x in by(mid, "pp")) == [-1, 1]
    assert sum(x.bytes_per_iteration for x in by(mid, "pp")) == 2 * m * act
    assert [(x.count, x.peer_step) for x in by(last, "pp")] == [(m, -1)]


def test_dp_gradient_all_reduce_and_zero_stages():
    cfg = make(parallel={"pipeline": 1, "tensor": 1, "data": 4}, model={"grad_bytes_per_element": 4})
    n_rank = param_count(cfg)["total"]  # p = t = 1
    (ar,) = by(stage_traffic(cfg, 0), "dp")
    assert (ar.op, ar.count, ar.message_bytes) == ("all_reduce", 1, n_rank * 4)
    assert ar.bytes_per_iteration == pytest.approx(2 * 3 / 4 * n_rank * 4)
    z1 = make(parallel={"pipeline": 1, "tensor": 1, "data": 4, "zero": 1})
    ops = {x.op: x for x in by(stage_traffic(z1, 0), "dp")}
    assert set(ops) == {"reduce_scatter", "all_gather"}
    assert ops["reduce_scatter"].count == ops["all_gather"].count == 1
    # same volume as the all-reduce when gradients and weights have the same width
    (ar2,) = by(stage_traffic(make(parallel={"pipeline": 1, "tensor": 1, "data": 4}), 0), "dp")
    assert sum(x.bytes_per_iteration for x in ops.values()) == pytest.approx(ar2.bytes_per_iteration)
    z2 = make(parallel={"pipeline": 1, "tensor": 1, "data": 4, "zero": 2})
    rs = by(stage_traffic(z2, 0), "dp", "reduce_scatter")[0]
    assert rs.count == z2.micro_batches  # reduced every micro-batch
    z3 = make(parallel={"pipeline": 1, "tensor": 1, "data": 4, "zero": 3})
    vol3 = sum(x.bytes_per_iteration for x in by(stage_traffic(z3, 0), "dp"))
    assert vol3 == pytest.approx(1.5 * ar2.bytes_per_iteration * z3.micro_batches)
    buck = make(parallel={"pipeline": 1, "tensor": 1, "data": 4, "dp_bucket_bytes": 100_000})
    bs = by(stage_traffic(buck, 0), "dp")
    assert sum(x.count * x.message_bytes for x in bs) == ar2.message_bytes
    assert max(x.message_bytes for x in bs) == 100_000


def test_moe_all_to_all_padded_is_exact_and_uniform_is_capped():
    moe = {"experts": 8, "top_k": 2, "capacity_factor": 1.25, "every": 2, "dispatch": "padded"}
    cfg = make(model={"moe": moe}, parallel={"tensor": 1, "data": 4, "expert": 4})
    T = 2 * 32
    C = math.ceil(1.25 * T * 2 / 8)
    d = moe_dispatch(cfg)
    assert d["capacity"] == C and d["local_fraction"] == 1 / 4
    (a2a,) = by(stage_traffic(cfg, 0), "ep")
    assert a2a.op == "all_to_all"  # padded: even blocks, no split sizes
    assert a2a.message_bytes == 4 * (8 // 4) * C * 64 * 2  # e peers x E/e experts x C x h x B
    assert a2a.bytes_per_iteration == pytest.approx(a2a.count * 3 / 4 * a2a.message_bytes)
    assert a2a.count == 4 * 2 * cfg.micro_batches  # 2 MoE layers, dispatch+combine, fwd+bwd
    uni = make(model={"moe": {**moe, "dispatch": "uniform"}}, parallel={"tensor": 1, "data": 4, "expert": 4})
    du = moe_dispatch(uni)
    assert [x.op for x in by(stage_traffic(uni, 0), "ep")] == ["all_to_allv"]  # routed: split sizes
    assert du["tokens_per_expert"] < T * 2 / 8 <= C  # capping only removes tokens
    assert du["tokens_per_expert"] > 0.95 * T * 2 / 8
    # expert gradients are all-reduced over the expert-data group (d / e = 1: none here)
    assert not by(stage_traffic(uni, 0), "edp")


def test_expected_capped_by_hand():
    # X ~ Bin(4, 1/2): P = 1,4,6,4,1 / 16; E[min(X, 2)] = (0 + 4 + 2*11) / 16
    assert expected_capped(4, 0.5, 2) == pytest.approx(26 / 16)
    assert expected_capped(100, 0.25, None) == 25
    assert expected_capped(100, 0.25, 100) == 25
    assert expected_capped(10, 1.0, 3) == 3


# -- placement and matrix --------------------------------------------------------------------
def test_megatron_rank_order():
    cfg = make(parallel={"pipeline": 2, "tensor": 2, "data": 2}, cluster={"world_size": 8})
    for r in range(8):
        c = coords(cfg, r)
        assert r == c["tensor"] + 2 * (c["data"] + 2 * c["pipeline"]) == rank_of(cfg, **c)
    assert group_of(cfg, "tp", 5) == [4, 5]
    assert group_of(cfg, "dp", 5) == [5, 7]
    assert group_of(cfg, "pp", 1) == [1, 5]
    other = make(parallel={"pipeline": 2, "tensor": 2, "data": 2, "order": ["data", "tensor", "pipeline"]},
                 cluster={"world_size": 8})
    assert group_of(other, "dp", 0) == [0, 1] and group_of(other, "tp", 0) == [0, 2]


@pytest.mark.parametrize("parallel, moe", [
    ({"pipeline": 2, "tensor": 2, "data": 2}, None),
    ({"pipeline": 2, "tensor": 1, "data": 4, "zero": 1}, None),
    ({"pipeline": 1, "tensor": 2, "data": 4, "expert": 2}, {"experts": 4, "top_k": 2, "every": 1}),
])
def test_matrix_shape_diagonal_symmetry_and_volume(parallel, moe):
    world = parallel["pipeline"] * parallel["tensor"] * parallel["data"]
    cfg = make(parallel=parallel, cluster={"world_size": world},
               model={"moe": moe} if moe else {})
    mat = comm_matrix(cfg)
    total = mat["total"]
    assert total.shape == (world, world)
    assert np.all(np.diag(total) == 0)
    assert np.allclose(total, total.T)
    for r in range(world):  # row sums = bytes the rank sends
        sent = sum(x.bytes_per_iteration for x in stage_traffic(cfg, coords(cfg, r)["pipeline"]))
        assert total[r].sum() == pytest.approx(sent)
    uni = comm_matrix(cfg, ring="unidirectional")["total"]
    assert uni.sum() == pytest.approx(total.sum()) and np.all(np.diag(uni) == 0)
    if moe:
        assert "ep" in mat["dims"] and np.allclose(mat["dims"]["ep"], mat["dims"]["ep"].T)


# -- alpha-beta ----------------------------------------------------------------------------
def test_fit_recovers_alpha_beta():
    sizes = [4, 1024, 65536, 1 << 20, 16 << 20]
    for alpha, beta in ((5.0, 2e-4), (300.0, 1e-3), (0.0, 1e-4)):
        a, b, rms = fit_alpha_beta(sizes, [alpha + beta * n for n in sizes])
        assert a == pytest.approx(alpha, abs=1e-6) and b == pytest.approx(beta, rel=1e-9) and rms < 1e-9
        a, b, _ = fit_alpha_beta(sizes, [alpha + beta * n for n in sizes], weighting="absolute")
        assert a == pytest.approx(alpha, abs=1e-3) and b == pytest.approx(beta, rel=1e-6)
    rng = np.random.default_rng(0)
    noisy = [(10 + 5e-4 * n) * (1 + 0.02 * rng.standard_normal()) for n in sizes]
    a, b, _ = fit_alpha_beta(sizes, noisy)
    assert a == pytest.approx(10, rel=0.1) and b == pytest.approx(5e-4, rel=0.1)


def test_fit_is_non_negative():
    a, b, _ = fit_alpha_beta([1000, 2000, 3000], [1.0, 3.0, 5.0])  # unconstrained alpha < 0
    assert a == 0 and b > 0
    a, b, _ = fit_alpha_beta([1000, 2000, 3000], [5.0, 4.0, 3.0])  # unconstrained beta < 0
    assert b == 0 and a > 0


def test_fit_scales_with_group_size():
    fit = make_fit("all_reduce", "mpi", [0, 1000], [10.0, 10.0 + 1000 * 1e-3], 2, "t")
    assert fit.time_us(0, 2) == pytest.approx(10.0)
    # ring: 2(g-1) alpha steps, 2(g-1)/g n beta: at g=8 alpha x 7, beta x 1.75
    assert fit.time_us(1000, 8) == pytest.approx(10.0 * 7 + 1.0 * 1.75)
    p2p = make_fit("p2p", "mpi", [0, 1000], [5.0, 6.0], 2, "t")
    assert p2p.time_us(1000, 2) == pytest.approx(6.0)


def test_fit_follows_the_measured_points():
    # a protocol switch between 1 KB and 64 KB that one line cannot follow
    sizes, times = [4, 1024, 65536, 1 << 20], [5.0, 6.0, 60.0, 400.0]
    fit = make_fit("all_reduce", "mpi", sizes, times, 2, "t")
    line = lambda n: (fit.alpha_step_us * 2 + fit.beta_step_us * n)  # L(2) = 2, W(2) = 1
    for n, t in zip(sizes, times):
        assert fit.time_us(n, 2) == pytest.approx(t)  # the measurements at g0
    r0, r1 = times[1] / line(1024), times[2] / line(65536)
    assert fit.correction(8192) == pytest.approx(r0 + (r1 - r0) * 0.5)  # halfway in log n
    assert fit.correction(1) == pytest.approx(times[0] / line(4))  # ends: nearest ratio
    assert fit.correction(1 << 30) == pytest.approx(times[3] / line(1 << 20))
    # other group sizes: alpha-beta scaled, times the same ratio
    ring8 = fit.alpha_step_us * 14 + fit.beta_step_us * 1.75 * 65536
    assert fit.time_us(65536, 8) == pytest.approx(ring8 * r1)
    assert fit.derive("p2p").correction(65536) == 1.0


def bench_doc(points, group=2):
    """A synthetic mcrdl-bench/1 document: points = {(op, backend): (alpha, beta)}."""
    results = []
    for (op, backend), (a, b) in points.items():
        for n in (4, 1024, 65536, 1 << 20, 4 << 20):
            results.append({"op": op, "bytes": n, "variant": backend, "backend": backend, "iters": 1,
                            "rounds": 1, "avg_us": a + b * n, "min_us": a + b * n, "max_us": a + b * n,
                            "check": "skipped"})
            results.append({"op": op, "bytes": n, "variant": "raw-" + backend, "backend": "raw",
                            "iters": 1, "rounds": 1, "avg_us": 1.0, "min_us": 1.0, "max_us": 1.0})
    return {"format": "mcrdl-bench/1", "metadata": {"world_size": group, "hosts": ["h"]}, "results": results}


def test_cost_model_from_bench_picks_fastest_and_follows_table(tmp_path):
    cost = CostModel.from_bench(bench_doc({("all_reduce", "mpi"): (5.0, 1e-3),
                                           ("all_reduce", "gloo"): (200.0, 1e-4)}))
    assert cost.fits[("all_reduce", "mpi")].alpha_us == pytest.approx(5.0)
    assert cost.choose("all_reduce", 1024, 2).backend == "mpi"
    assert cost.choose("all_reduce", 16 << 20, 2).backend == "gloo"  # past the crossover
    assert cost.choose("p2p", 1024, 2).fit.source.startswith("derived")
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"format": "mcrdl-tuning/1", "rules": {"all_reduce": {"2": [
        {"max_bytes": None, "backend": "mpi"}]}}}))
    cost.load_table(str(table))
    ch = cost.choose("all_reduce", 16 << 20, 2)
    assert (ch.backend, ch.reason) == ("mpi", "tuning table")
    with pytest.raises(ValueError, match="mcrdl-bench/1"):
        CostModel.from_bench({"format": "nope"})



def test_all_to_allv_uses_its_own_fit_else_all_to_alls(tmp_path):
    even = {("all_to_all", "mpi"): (5.0, 1e-3), ("all_to_all", "gloo"): (200.0, 1e-4)}
    cost = CostModel.from_bench(bench_doc(even))
    v = cost.choose("all_to_allv", 65536, 2)
    assert v.time_us == pytest.approx(cost.choose("all_to_all", 65536, 2).time_us)
    assert v.fit.op == "all_to_allv" and "no all_to_allv measured" in v.fit.source
    measured = CostModel.from_bench(bench_doc({**even, ("all_to_allv", "mpi"): (8.0, 2e-3)}))
    assert measured.choose("all_to_allv", 65536, 2).time_us == pytest.approx(8.0 + 2e-3 * 65536)
    # the table's all_to_all rules choose for both forms
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"format": "mcrdl-tuning/1", "rules": {"all_to_all": {"2": [
        {"max_bytes": None, "backend": "gloo"}]}}}))
    measured.load_table(str(table))
    ch = measured.choose("all_to_allv", 64, 2)
    assert (ch.backend, ch.reason) == ("gloo", "tuning table")


def test_cost_model_from_several_sweeps_takes_the_median_per_size(tmp_path):
    """One sweep taken in a slow phase (3x) does not move the calibration."""
    docs = [bench_doc({("all_reduce", "mpi"): ab}) for ab in ((5.0, 1e-3), (15.0, 3e-3), (5.2, 1.1e-3))]
    paths = []
    for i, d in enumerate(docs):
        paths.append(tmp_path / f"s{i}.json")
        paths[-1].write_text(json.dumps(d))
    one = CostModel.from_bench(docs[2])
    median = CostModel.from_bench([str(p) for p in paths])
    for n in (4, 1024, 1 << 20):
        fit, ref = median.fits[("all_reduce", "mpi")], one.fits[("all_reduce", "mpi")]
        assert fit.time_us(n, 2) == pytest.approx(ref.time_us(n, 2))
    assert "3 sweeps" in median.source and "median per size" in median.source
    other = bench_doc({("all_reduce", "mpi"): (5.0, 1e-3)}, group=4)
    with pytest.raises(ValueError, match="metadata.world_size: 4 differs"):
        CostModel.from_bench([docs[0], other])
    cold = {**docs[1], "metadata": {**docs[1]["metadata"], "mode": "cold"}}
    with pytest.raises(ValueError, match="metadata.mode: 'cold' differs"):
        CostModel.from_bench([docs[0], cold])
    gpu = {**docs[1], "metadata": {**docs[1]["metadata"], "device": "cuda"}}
    with pytest.raises(ValueError, match="metadata.device: 'cuda' differs from .*'cpu'"):
        CostModel.from_bench([docs[0], gpu])
    with pytest.raises(ValueError, match="no bench results given"):
        CostModel.from_bench([])


def test_table_rules_of_the_bench_device_decide(tmp_path):
    """A table with cpu and cuda rules: a CUDA sweep's model looks up the cuda rules."""
    table = tmp_path / "t.json"
    table.write_text(json.dumps({"format": "mcrdl-tuning/2", "rules": {
        "cpu": {"all_reduce": {"2": [{"max_bytes": None, "backend": "gloo"}]}},
        "cuda": {"all_reduce": {"2": [{"max_bytes": None, "backend": "mpi"}]}}}}))
    fits = {("all_reduce", "mpi"): (5.0, 1e-3), ("all_reduce", "gloo"): (50.0, 1e-3)}
    for device, want in (("cpu", "gloo"), ("cuda", "mpi")):
        doc = bench_doc(fits)
        doc["metadata"]["device"] = device
        model = CostModel.from_bench(doc)
        model.load_table(str(table))
        assert model.choose("all_reduce", 64, 2).backend == want, device

# -- validation ---------------------------------------------------------------------------
@pytest.mark.parametrize("sections, message", [
    ({"parallel": {"data": 4}}, r"parallel: pipeline x tensor x data = 1 x 2 x 4 = 8 does not equal cluster.world_size 4"),
    ({"parallel": {"tensor": 3, "data": None}, "cluster": {"world_size": 6}}, r"parallel.tensor: heads \(8\) must be divisible by tensor \(3\)"),
    ({"model": {"hidden_size": 64}}, r"model.hidden_size: unknown key"),
    ({"model": {"layers": -2}}, r"model.layers: must be >= 1, got -2"),
    ({"model": {"micro_batch": 0}}, r"model.micro_batch: must be >= 1"),
    ({"model": {"heads": True}}, r"model.heads: expected an integer"),
    ({"model": {"layers": 3}, "parallel": {"pipeline": 2, "tensor": 1}}, r"parallel.pipeline: layers \(3\) must be divisible by pipeline \(2\)"),
    ({"model": {"global_batch": 6}}, r"model.global_batch: global_batch \(6\) must be divisible by micro_batch x data = 2 x 2 = 4"),
    ({"model": {"vocab": None}}, r"model.vocab: required"),
    ({"parallel": {"pipeline": 2, "tensor": 1, "zero": 2}}, r"parallel.zero: ZeRO stage 2 cannot be combined"),
    ({"parallel": {"zero": 4}}, r"parallel.zero: ZeRO stage must be"),
    ({"parallel": {"expert": 2}}, r"parallel.expert: expert parallelism \(2\) needs model.moe"),
    ({"model": {"moe": {"experts": 6}}, "parallel": {"expert": 4, "tensor": 1, "data": 4}}, r"parallel.expert: experts \(6\) must be divisible by expert \(4\)"),
    ({"model": {"moe": {"experts": 8}}, "parallel": {"expert": 4}}, r"parallel.expert: expert \(4\) must divide data \(2\)"),
    ({"model": {"moe": {"experts": 8, "top_k": 9}}}, r"model.moe.top_k"),
    ({"model": {"moe": {"experts": 8, "routing": "x"}}}, r"model.moe.routing: unknown key"),
    ({"compute": {"utilization": 1.5}}, r"compute.utilization: must be in \(0.0, 1.0\]"),
    ({"parallel": {"order": ["tensor", "data"]}}, r"parallel.order"),
    ({"extra": 1}, r"extra: unknown key"),
    ({"alpha_beta": {"nccl": {"alpha_us": 5}}}, r"alpha_beta.nccl.bandwidth_gbps: required"),
])
def test_validation_names_the_field(sections, message):
    with pytest.raises(ModelConfigError, match=message):
        make(**sections)


def test_data_is_inferred_from_world_and_world_must_divide():
    cfg = make(parallel={"data": None, "tensor": 2}, cluster={"world_size": 8})
    assert cfg.layout.data == 4
    with pytest.raises(ModelConfigError, match=r"pipeline x tensor = 1 x 3 = 3 does not divide cluster.world_size 8"):
        make(parallel={"data": None, "tensor": 3}, cluster={"world_size": 8}, model={"heads": 3, "hidden": 63})


def test_load_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": {\n "layers": 4,,}}')
    with pytest.raises(ModelConfigError, match=r"bad.json:2:\d+: malformed JSON"):
        load_config(str(bad))
    with pytest.raises(ModelConfigError, match="cannot read"):
        load_config(str(tmp_path / "missing.json"))
    y = tmp_path / "m.yaml"
    y.write_text("model: {}\n")
    try:
        import yaml  # noqa: F401
    except ImportError:
        with pytest.raises(ModelConfigError, match="PyYAML"):
            load_config(str(y))
    else:
        with pytest.raises(ModelConfigError, match="model.layers: required"):
            load_config(str(y))


@pytest.mark.parametrize("name", ["gpt_small.json", "gpt_moe_small.json", "gpt3_1.3b_64gpu.json"])
def test_examples_load_and_estimate(name):
    cfg = load_config(str(EXAMPLES / name))
    est = estimate(cfg)
    assert est.iteration_s > est.exposed_comm_s > 0
    assert 0 < est.comm_share < 1


# -- sweep ---------------------------------------------------------------------------------
def test_sweep_returns_valid_layouts_sorted_by_comm():
    cfg = load_config(str(EXAMPLES / "gpt_small.json"))
    rejected = []
    res = rank_layouts(cfg, 8, CostModel.defaults(), rejected=rejected)
    assert res and all(r.pipeline * r.tensor * r.data == 8 for r in res)
    for r in res:
        cfg.with_layout(r.pipeline, r.tensor, r.data)  # validates
        assert 8 % r.tensor == 0 and cfg.model.heads % r.tensor == 0 and cfg.model.layers % r.pipeline == 0
    comms = [r.comm_s for r in res]
    assert comms == sorted(comms)
    seen = {(r.pipeline, r.tensor, r.data) for r in res} | {ptd for ptd, _ in rejected}
    assert len(seen) == sum(1 for p in range(1, 9) for t in range(1, 9) if 8 % (p * t) == 0)
    assert all("must" in why or "cannot" in why for _, why in rejected)
    its = [r.iteration_s for r in rank_layouts(cfg, 8, by="iteration")]
    assert its == sorted(its)


# -- CLI and comparison ----------------------------------------------------------------------
def mcrdl_model(*args):
    return subprocess.run([sys.executable, "-m", "mcrdl.cli", "model", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)


def model_in_process(capsys, *args):
    """The same command in this process (cheaper than a subprocess): (rc, stdout, stderr)."""
    from mcrdl.cli import main

    rc = main(["model", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_writes_pngs_and_json(tmp_path, capsys):
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(bench_doc({("all_reduce", "mpi"): (5.0, 2e-4),
                                           ("all_reduce", "gloo"): (200.0, 8e-4),
                                           ("all_to_all", "mpi"): (8.0, 3e-4)})))
    proc = mcrdl_model(str(EXAMPLES / "gpt_moe_small.json"), "--bench", str(bench), "--out",
                       str(tmp_path / "out"), "--sweep", "8")
    assert proc.returncode == 0, proc.stderr
    for f in ("matrix.png", "breakdown.png", "model.json"):
        assert (tmp_path / "out" / f).stat().st_size > 1000
    assert "iteration" in proc.stdout and "all_to_all" in proc.stdout and "layouts on 8 ranks" in proc.stdout
    doc = json.loads((tmp_path / "out" / "model.json").read_text())
    assert doc["format"] == "mcrdl-model/1" and len(doc["matrix"]["total"]) == 4
    rc, out, _ = model_in_process(capsys, str(EXAMPLES / "gpt_small.json"))
    assert rc == 0 and "built-in defaults" in out
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**BASE, "parallel": {"tensor": 3, "data": 1}, "cluster": {"world_size": 3}}))
    rc, _, err = model_in_process(capsys, str(bad))
    assert rc == 2 and "parallel.tensor: heads (8) must be divisible by tensor (3)" in err


def synthetic_log(cfg, directory, iterations=2, scale=1.0):
    """Logger records_rank*.json as a run matching the prediction would write,
    plus one unmodelled op per rank."""
    directory.mkdir()
    for r in range(cfg.world):
        recs, t = [], 0.0
        for x in stage_traffic(cfg, coords(cfg, r)["pipeline"]):
            g = group_of(cfg, x.dim, r)
            for _ in range(x.count * iterations):
                recs.append({"seq": len(recs), "op": x.op, "backend": "mpi", "group": "g", "ranks": g,
                             "nbytes": int(x.message_bytes), "async_op": False, "start": t,
                             "end": t + 1e-4 * scale, "root": -1, "counts": None})
                t += 1e-3
        recs.append({"seq": len(recs), "op": "barrier", "backend": "mpi", "group": "world",
                     "ranks": list(range(cfg.world)), "nbytes": 0, "async_op": False, "start": t,
                     "end": t + 1e-5, "root": -1, "counts": None})
        (directory / f"records_rank{r}.json").write_text(json.dumps(
            {"rank": r, "world_size": cfg.world, "wall_start": 0.0, "records": recs}))


def test_compare_with_logger_export(tmp_path, capsys):
    cfg = load_config(str(EXAMPLES / "gpt_small.json"))
    synthetic_log(cfg, tmp_path / "log", iterations=2)
    rows = {(r.dim, r.op): r for r in compare(cfg, load_log(str(tmp_path / "log")), iterations=2)}
    tp, dp = rows[("tp", "all_reduce")], rows[("dp", "all_reduce")]
    assert tp.pred_count == tp.meas_count == 2 * 64
    assert dp.pred_bytes == pytest.approx(dp.meas_bytes)
    assert tp.meas_s == pytest.approx(128 * 1e-4)
    assert rows[("other", "barrier")].pred_count == 0 and rows[("other", "barrier")].meas_count == 1
    with pytest.raises(ValueError, match="world size 4"):
        compare(load_config(str(EXAMPLES / "gpt3_1.3b_64gpu.json")), load_log(str(tmp_path / "log")))
    rc, out, err = model_in_process(capsys, str(EXAMPLES / "gpt_small.json"), "--compare-log",
                                    str(tmp_path / "log"), "--log-iterations", "2")
    assert rc == 0, err
    assert "prediction vs logged run" in out and "+0.0%" in out


def test_compare_corrects_for_arrival(tmp_path):
    """Rank 0 arrives 4 ms early at every tensor all-reduce: its logged time
    includes the wait, the arrival-corrected time is rank 1's."""
    cfg = make(parallel={"pipeline": 1, "tensor": 2, "data": 1}, cluster={"world_size": 2})
    d = tmp_path / "log"
    d.mkdir()
    for r, took in ((0, 5e-3), (1, 1e-3)):
        recs = [{"seq": k, "op": "all_reduce", "backend": "mpi", "group": "world", "ranks": [0, 1],
                 "nbytes": 8192, "async_op": False, "start": k * 0.1, "end": k * 0.1 + took,
                 "root": -1, "counts": None} for k in range(16)]
        (d / f"records_rank{r}.json").write_text(json.dumps({"rank": r, "world_size": 2, "records": recs}))
    tp = {(r.dim, r.op): r for r in compare(cfg, load_log(str(d)))}[("tp", "all_reduce")]
    assert tp.meas_count == 16
    assert tp.meas_s == pytest.approx(16 * 3e-3) and tp.meas_comm_s == pytest.approx(16 * 1e-3)
    # one rank's file alone: nothing to correct with
    alone = compare(cfg, load_log(str(d / "records_rank0.json")))
    assert alone[0].meas_comm_s == alone[0].meas_s == pytest.approx(16 * 5e-3)


def test_compare_classifies_pipeline_sends(tmp_path):
    cfg = make(parallel={"pipeline": 2, "tensor": 1, "data": 2}, cluster={"world_size": 4})
    d = tmp_path / "log"
    d.mkdir()
    act = 2 * 32 * 64 * 2
    for r in range(4):
        peer = (r + 2) % 4  # the other stage, same data index
        recs = [{"seq": 0, "op": "isend", "backend": "mpi", "group": "world", "ranks": [0, 1, 2, 3],
                 "nbytes": act, "async_op": True, "start": 0.0, "end": 1e-4, "root": peer, "counts": None},
                {"seq": 1, "op": "irecv", "backend": "mpi", "group": "world", "ranks": [0, 1, 2, 3],
                 "nbytes": act, "async_op": True, "start": 0.0, "end": 1e-4, "root": peer, "counts": None}]
        (d / f"records_rank{r}.json").write_text(json.dumps({"rank": r, "world_size": 4, "records": recs}))
    rows = {(r.dim, r.op): r for r in compare(cfg, load_log(str(d)))}
    assert rows[("pp", "p2p")].meas_count == 1  # sends only
    assert rows[("pp", "p2p")].pred_count == cfg.micro_batches


def _records_file(d, rank, world, recs):
    d.mkdir(exist_ok=True)
    full = [{"seq": k, "group": "world", "ranks": list(range(world)), "async_op": False, "root": -1,
             "counts": None, "backend": "mpi", **r} for k, r in enumerate(recs)]
    (d / f"records_rank{rank}.json").write_text(json.dumps({"rank": rank, "world_size": world, "records": full}))


def test_calibrate_from_the_jobs_calls_reproduces_them(tmp_path):
    """At a logged size the calibrated model costs what the calls cost in the
    job (their mean, arrival-corrected: rank 0 waits 4 ms for rank 1); other
    sizes keep the fit's shape; receives, barriers, empty and unfinished calls
    are not used; an all-to-all logged with split sizes or lists (counts:
    Alltoallv) calibrates all_to_allv, one without all_to_all."""
    d = tmp_path / "log"
    t_rank1 = [100e-6, 300e-6]  # 8 KiB all-reduces: rank 1 arrived last, so its times are the op's
    for rank, extra in ((0, 4e-3), (1, 0.0)):
        recs = [{"op": "all_reduce", "nbytes": 8192, "start": k, "end": k + t + extra}
                for k, t in enumerate(t_rank1)]
        recs += [{"op": "all_to_all_single", "nbytes": 4096, "start": 5, "end": 5 + 50e-6, "counts": [2048, 2048]},
                 {"op": "all_to_all", "nbytes": 4096, "start": 6, "end": 6 + 70e-6, "counts": [1024, 3072]},
                 {"op": "all_to_all_single", "nbytes": 4096, "start": 7, "end": 7 + 20e-6},
                 {"op": "irecv", "nbytes": 8192, "start": 8, "end": 9, "root": 1 - rank},
                 {"op": "barrier", "nbytes": 0, "start": 9, "end": 10},
                 {"op": "all_reduce", "nbytes": 0, "start": 10, "end": 11},
                 {"op": "all_reduce", "nbytes": 8192, "start": 12, "end": -1}]  # still in flight
        _records_file(d, rank, 2, recs)
    cost = CostModel.defaults()
    line = replace(cost.fit_for("all_reduce", "mpi"), curve=())
    cost.calibrate(load_log(str(d)), "the test's log")
    after = cost.fits[("all_reduce", "mpi")]
    assert after.time_us(8192, 2) == pytest.approx(200.0)  # mean of rank 1's 100 and 300 us
    ratio = 200.0 / line.time_us(8192, 2)
    assert after.time_us(1 << 20, 2) == pytest.approx(line.time_us(1 << 20, 2) * ratio)
    assert after.time_us(8192, 4) > after.time_us(8192, 2)  # alpha-beta carries it to larger groups
    assert cost.fits[("all_to_allv", "mpi")].time_us(4096, 2) == pytest.approx(60.0)  # 50 and 70
    assert cost.fits[("all_to_all", "mpi")].time_us(4096, 2) == pytest.approx(20.0)
    assert ("p2p", "mpi") not in cost.fits  # receives are not what the model counts
    assert "corrected by 10 call records in the test's log" in cost.source  # 5 per rank
    empty = tmp_path / "empty"
    _records_file(empty, 0, 2, [{"op": "barrier", "nbytes": 0, "start": 0, "end": 1},
                                {"op": "all_reduce", "nbytes": 0, "start": 1, "end": 2}])
    with pytest.raises(ValueError, match="no completed collective or send with data"):
        CostModel.defaults().calibrate(load_log(str(empty)), "empty")


def test_calibrate_pools_sizes_near_a_power_of_two_and_leaves_out_unknown_backends(tmp_path):
    """Uneven all-to-alls have a different size nearly every call: sizes within
    sqrt(2) of one power of two share a point at their mean size, with their
    total time over their total fitted time. A backend the model has no
    alpha-beta values for is left out with a note: its calls cannot give the
    other ops' costs."""
    d = tmp_path / "log"
    recs = [{"op": "all_reduce", "nbytes": n, "start": k, "end": k + t, "backend": "gloo"}
            for k, (n, t) in enumerate([(3000, 100e-6), (5000, 140e-6), (40000, 400e-6)])]
    recs.append({"op": "all_reduce", "nbytes": 4096, "start": 9, "end": 9.001, "backend": "ucc"})
    _records_file(d, 0, 2, recs)
    cost = CostModel.defaults()
    line = replace(cost.fit_for("all_reduce", "gloo"), curve=())
    cost.calibrate(load_log(str(d)), "one rank")
    fit = cost.fits[("all_reduce", "gloo")]
    assert [n for n, _ in fit.curve] == [4000, 40000]  # 3000 and 5000 round to 2^12
    r = 240.0 / (line.time_us(3000, 2) + line.time_us(5000, 2))
    assert fit.time_us(4000, 2) == pytest.approx(line.time_us(4000, 2) * r)
    assert fit.time_us(4000, 2) == pytest.approx(120.0)  # the mean call: alpha-beta is linear in n
    assert fit.time_us(40000, 2) == pytest.approx(400.0)
    assert "ucc" not in cost.backends and any("ucc" in n for n in cost.notes)


def test_cli_calibrate_log(tmp_path, capsys):
    cfg = load_config(str(EXAMPLES / "gpt_small.json"))
    synthetic_log(cfg, tmp_path / "log", iterations=2, scale=3.0)
    rc, out, err = model_in_process(capsys, str(EXAMPLES / "gpt_small.json"), "--calibrate-log",
                                    str(tmp_path / "log"), "--compare-log", str(tmp_path / "log"),
                                    "--log-iterations", "2")
    assert rc == 0, err
    assert "corrected by" in out
    cost = CostModel.defaults()
    cost.calibrate(load_log(str(tmp_path / "log")))
    for r in compare(cfg, load_log(str(tmp_path / "log")), cost, iterations=2):
        if r.dim != "other":  # every modelled op costs what the log says (3e-4 s per call)
            assert r.pred_s == pytest.approx(r.meas_comm_s), r
    rc, out, err = model_in_process(capsys, str(EXAMPLES / "gpt_small.json"), "--calibrate-log",
                                    str(tmp_path / "nowhere"))
    assert rc == 2 and "nowhere: no such file or directory" in err


# -- property test (bounded) -----------------------------------------------------------------
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(p=st.integers(-1, 4), t=st.integers(0, 8), d=st.integers(1, 4), heads=st.integers(1, 12),
       layers=st.integers(1, 8), gb=st.integers(1, 64), mb=st.integers(1, 4),
       world=st.one_of(st.none(), st.integers(1, 32)))
def test_validation_property(p, t, d, heads, layers, gb, mb, world):
    doc = copy.deepcopy(BASE)
    doc["model"].update(heads=heads, hidden=heads * 8, layers=layers, global_batch=gb, micro_batch=mb,
                        ffn_hidden=heads * 8 * 4 * 8)
    doc["parallel"] = {"pipeline": p, "tensor": t, "data": d}
    doc["cluster"] = {} if world is None else {"world_size": world}
    try:
        cfg = config_from_dict(doc)
    except ModelConfigError as exc:
        assert str(exc).startswith("<config>: ") and any(
            k in str(exc) for k in ("parallel", "model.", "cluster"))
        return
    assert p >= 1 and t >= 1 and heads % t == 0 and layers % p == 0 and gb % (mb * d) == 0
    assert cfg.world == p * t * d and (world is None or world == cfg.world)
    mat = comm_matrix(cfg)["total"]
    assert np.all(np.diag(mat) == 0) and np.allclose(mat, mat.T)
