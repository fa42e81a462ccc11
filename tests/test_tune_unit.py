"""Unit tests for mcrdl.tools.tune and the pure parts of mcrdl.tools.bench (no MPI, one process).

Results are synthetic ``bench.Result`` lists; only ``max_us`` (the slowest
rank's time) drives decisions.
"""
import csv
import json
import math
import os
import warnings

import pytest

import mcrdl
from mcrdl.tools import bench, tune
from mcrdl.tools.bench import Result
from mcrdl.tuning import FORMAT

KNOWN = ["mpi", "gloo", "nccl"]
BACKENDS = ["mpi", "gloo"]


def res(op, nbytes, variant, max_us, backend=None):
    return Result(op, nbytes, variant, backend or variant, iters=10, rounds=3,
                  avg_us=max_us * 0.9, min_us=max_us * 0.8, max_us=max_us,
                  round_max_us=[max_us] * 3)


def sweep(op, times):
    """times: {size: {variant: max_us}} -> results."""
    return [res(op, size, v, t) for size, by in times.items() for v, t in by.items()]


# -- decide: the winner of each size ------------------------------------------------------
def test_fastest_backend_wins_each_size():
    results = sweep("all_reduce", {4: {"mpi": 10, "gloo": 30},
                                   1024: {"mpi": 50, "gloo": 20}})
    rows = tune.decide(results, BACKENDS)["all_reduce"]
    assert [(s, b) for s, b, _ in rows] == [(4, "mpi"), (1024, "gloo")]
    assert rows[0][2] == pytest.approx(30 / 10 - 1)
    assert rows[1][2] == pytest.approx(50 / 20 - 1)


def test_sizes_are_walked_in_increasing_order():
    results = sweep("broadcast", {65536: {"mpi": 90, "gloo": 30}, 4: {"mpi": 1, "gloo": 9},
                                  256: {"mpi": 2, "gloo": 8}})
    rows = tune.decide(results, BACKENDS)["broadcast"]
    assert [s for s, _, _ in rows] == [4, 256, 65536]
    assert [b for _, b, _ in rows] == ["mpi", "mpi", "gloo"]


def test_each_op_decided_separately():
    results = (sweep("all_reduce", {4: {"mpi": 1, "gloo": 2}})
               + sweep("all_to_all", {4: {"mpi": 2, "gloo": 1}}))
    d = tune.decide(results, BACKENDS)
    assert set(d) == {"all_reduce", "all_to_all"}
    assert d["all_reduce"][0][1] == "mpi" and d["all_to_all"][0][1] == "gloo"


def test_only_the_given_backends_compete():
    """mcrdl (selection) and raw-* baselines are measurements, not candidates."""
    results = sweep("all_reduce", {4: {"mpi": 10, "gloo": 20, "mcrdl": 1, "raw-mpi": 2,
                                       "raw-gloo": 3}})
    rows = tune.decide(results, BACKENDS)["all_reduce"]
    assert rows == [(4, "mpi", pytest.approx(1.0))]
    rows = tune.decide(results, ["gloo"])["all_reduce"]
    assert rows == [(4, "gloo", 0.0)]  # alone: no runner-up, no advantage


def test_advantage_is_over_the_runner_up():
    results = sweep("all_reduce", {4: {"mpi": 10, "gloo": 40, "nccl": 15}})
    rows = tune.decide(results, ["mpi", "gloo", "nccl"])["all_reduce"]
    assert rows == [(4, "mpi", pytest.approx(0.5))]


def test_time_is_the_slowest_rank_max_us():
    """avg/min are ignored: the collective's time is the slowest rank's."""
    a = Result("all_reduce", 4, "mpi", "mpi", 1, 1, avg_us=1, min_us=1, max_us=100)
    b = Result("all_reduce", 4, "gloo", "gloo", 1, 1, avg_us=50, min_us=50, max_us=60)
    assert tune.decide([a, b], BACKENDS)["all_reduce"][0][1] == "gloo"


# -- hysteresis ------------------------------------------------------------------------------
def test_incumbent_keeps_a_size_within_margin():
    # gloo wins 4; at 64 mpi is 3% faster: not enough (margin 5%), gloo keeps it
    results = sweep("all_reduce", {4: {"mpi": 20, "gloo": 10},
                                   64: {"mpi": 100, "gloo": 103}})
    rows = tune.decide(results, BACKENDS, margin=0.05)["all_reduce"]
    assert [b for _, b, _ in rows] == ["gloo", "gloo"]
    assert rows[1][2] == pytest.approx(100 / 103 - 1)  # kept while slower: negative


def test_challenger_takes_over_beyond_margin():
    results = sweep("all_reduce", {4: {"mpi": 20, "gloo": 10},
                                   64: {"mpi": 100, "gloo": 110}})
    rows = tune.decide(results, BACKENDS, margin=0.05)["all_reduce"]
    assert [b for _, b, _ in rows] == ["gloo", "mpi"]
    assert rows[1][2] == pytest.approx(0.10)


@pytest.mark.parametrize("margin, winner", [(0.0, "mpi"), (0.05, "mpi"), (0.10, "gloo"),
                                            (0.5, "gloo")])
def test_margin_parameter_sets_the_threshold(margin, winner):
    # gloo incumbent; at 64 mpi is 8% faster
    results = sweep("all_reduce", {4: {"mpi": 20, "gloo": 10},
                                   64: {"mpi": 100, "gloo": 108}})
    assert tune.decide(results, BACKENDS, margin)["all_reduce"][1][1] == winner


def test_no_hysteresis_at_the_first_size():
    results = sweep("all_reduce", {4: {"mpi": 100, "gloo": 101}})
    assert tune.decide(results, BACKENDS, margin=0.5)["all_reduce"][0][1] == "mpi"
    results = sweep("all_reduce", {4: {"mpi": 101, "gloo": 100}})
    assert tune.decide(results, BACKENDS, margin=0.5)["all_reduce"][0][1] == "gloo"


def test_hysteresis_follows_the_kept_winner():
    """The incumbent is whoever was kept, so a slow drift does not flip either."""
    results = sweep("all_reduce", {4: {"mpi": 10, "gloo": 20},
                                   8: {"mpi": 103, "gloo": 100},
                                   16: {"mpi": 104, "gloo": 100},
                                   32: {"mpi": 120, "gloo": 100},
                                   64: {"mpi": 102, "gloo": 100}})
    rows = tune.decide(results, BACKENDS, margin=0.05)["all_reduce"]
    assert [b for _, b, _ in rows] == ["mpi", "mpi", "mpi", "gloo", "gloo"]


def test_incumbent_not_measured_at_a_size():
    results = (sweep("all_reduce", {4: {"mpi": 10, "gloo": 20}})
               + sweep("all_reduce", {8: {"gloo": 50, "nccl": 49}}))
    rows = tune.decide(results, ["mpi", "gloo", "nccl"], margin=0.05)["all_reduce"]
    assert [b for _, b, _ in rows] == ["mpi", "nccl"]


# -- ranges ----------------------------------------------------------------------------------
def test_adjacent_sizes_merge_and_last_range_is_open():
    rows = [(4, "mpi", 0.5), (64, "mpi", 0.2), (1024, "gloo", 0.3), (4096, "gloo", 0.1),
            (65536, "mpi", 0.4)]
    assert tune.ranges(rows) == [(64, "mpi", 0.2), (4096, "gloo", 0.1), (None, "mpi", 0.4)]


def test_single_winner_is_one_open_range_with_smallest_margin():
    rows = [(4, "mpi", 0.5), (64, "mpi", 0.7), (1024, "mpi", 0.25)]
    assert tune.ranges(rows) == [(None, "mpi", 0.25)]


def test_margin_of_a_range_can_be_negative_from_hysteresis():
    rows = [(4, "gloo", 1.0), (64, "gloo", -0.03)]
    assert tune.ranges(rows) == [(None, "gloo", -0.03)]


def test_ranges_of_nothing():
    assert tune.ranges([]) == []


def test_ranges_of_decide_end_to_end():
    results = sweep("all_gather", {4: {"mpi": 1, "gloo": 3}, 16: {"mpi": 2, "gloo": 3},
                                   256: {"mpi": 20, "gloo": 10}, 4096: {"mpi": 80, "gloo": 20}})
    rows = tune.decide(results, BACKENDS)["all_gather"]
    assert tune.ranges(rows) == [(16, "mpi", pytest.approx(0.5)),
                                 (None, "gloo", pytest.approx(1.0))]


# -- make_table ------------------------------------------------------------------------------
META = {"hosts": ["h1"], "world_size": 2, "versions": {"torch": "x"}, "date": "2024-01-01",
        "sweep": {"sizes": [4, 64]}}

TIMES = {
    "all_reduce": {4: {"mpi": 10, "gloo": 30}, 64: {"mpi": 11, "gloo": 30},
                   1024: {"mpi": 40, "gloo": 20}, 65536: {"mpi": 400, "gloo": 100},
                   1 << 20: {"mpi": 900, "gloo": 800}},
    "all_to_all": {8: {"mpi": 5, "gloo": 50}, 1024: {"mpi": 6, "gloo": 60}},
    "broadcast": {4: {"mpi": 30, "gloo": 10}, 64: {"mpi": 10, "gloo": 30},
                  4096: {"mpi": 60, "gloo": 20}},
}


def results_all():
    return [r for op, t in TIMES.items() for r in sweep(op, t)]


def test_make_table_document():
    doc = tune.make_table(results_all(), BACKENDS, 2, META, margin=0.05)
    assert doc["format"] == FORMAT == "mcrdl-tuning/2"
    assert list(doc["rules"]) == ["cpu"]  # the device measured
    assert list(tune.make_table(results_all(), BACKENDS, 2, META, device="cuda")["rules"]) == ["cuda"]
    doc = {**doc, "rules": doc["rules"]["cpu"]}
    for k, v in META.items():
        assert doc["metadata"][k] == v
    assert doc["metadata"]["decision"]["hysteresis"] == 0.05
    assert set(doc["rules"]) == set(TIMES)
    assert all(list(by) == ["2"] for by in doc["rules"].values())
    assert doc["rules"]["all_reduce"]["2"] == [
        {"max_bytes": 64, "backend": "mpi", "margin": round(30 / 11 - 1, 4)},
        {"max_bytes": None, "backend": "gloo", "margin": round(900 / 800 - 1, 4)}]
    assert doc["rules"]["all_to_all"]["2"] == [{"max_bytes": None, "backend": "mpi", "margin": 9.0}]
    assert [r["backend"] for r in doc["rules"]["broadcast"]["2"]] == ["gloo", "mpi", "gloo"]
    assert [r["max_bytes"] for r in doc["rules"]["broadcast"]["2"]] == [4, 64, None]
    json.dumps(doc)  # JSON-ready


def test_plots_shade_the_table_ranges(tmp_path):
    """The same results plotted with the table differ from the plain plot (the
    shaded ranges), for both all-to-all forms (one table entry)."""
    pytest.importorskip("matplotlib")
    from mcrdl.tools.plots import plot_ops

    results = results_all() + sweep("all_to_allv", TIMES["all_to_all"])
    table = tune.make_table(results, BACKENDS, 2, META)
    plain = plot_ops(results, str(tmp_path / "plain.png"))
    shaded = plot_ops(results, str(tmp_path / "plots" / "shaded.png"), table)
    assert shaded == str(tmp_path / "plots" / "shaded.png") and os.path.getsize(shaded) > 10_000
    assert open(plain, "rb").read() != open(shaded, "rb").read()


def test_make_table_group_size_key_is_the_world():
    doc = tune.make_table(results_all(), BACKENDS, 8, META)
    assert all(list(by) == ["8"] for by in doc["rules"]["cpu"].values())


def test_make_table_loads_and_lookups_match_decisions():
    results = results_all()
    doc = tune.make_table(results, BACKENDS, 2, META)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every named backend is known and live
        table = mcrdl.TuningTable.from_dict(json.loads(json.dumps(doc)), known=KNOWN)
    assert table.metadata["hosts"] == ["h1"]
    decisions = tune.decide(results, BACKENDS)
    for op, rows in decisions.items():
        for i, (size, winner, _) in enumerate(rows):
            assert table.lookup(op, 2, size) == winner, (op, size)
            # a size between two measured sizes belongs to the next measured one's range
            if i + 1 < len(rows):
                assert table.lookup(op, 2, size + 1) == rows[i + 1][1], (op, size + 1)
        assert table.lookup(op, 2, 0) == rows[0][1]
        assert table.lookup(op, 2, 1 << 40) == rows[-1][1]  # open-ended
        assert table.lookup(op, 4, rows[-1][0]) == rows[-1][1]  # larger groups use "2"


def test_make_table_with_hysteresis_loads():
    results = sweep("all_reduce", {4: {"mpi": 20, "gloo": 10}, 64: {"mpi": 100, "gloo": 103}})
    doc = tune.make_table(results, BACKENDS, 2, META)
    assert doc["rules"]["cpu"]["all_reduce"]["2"] == [
        {"max_bytes": None, "backend": "gloo", "margin": round(100 / 103 - 1, 4)}]
    mcrdl.TuningTable.from_dict(doc, known=KNOWN)


# -- measuring minority winners again -----------------------------------------------------
def test_contested_sizes_are_those_won_by_a_minority_backend():
    results = (sweep("reduce", {4: {"mpi": 1, "gloo": 9}, 1024: {"mpi": 2, "gloo": 9},
                                1 << 20: {"mpi": 9, "gloo": 2}, 1 << 24: {"mpi": 9, "gloo": 3}})
               + sweep("p2p", {4: {"mpi": 1, "gloo": 9}, 8192: {"mpi": 9, "gloo": 2},
                               65536: {"mpi": 2, "gloo": 9}})
               + sweep("all_reduce", {4: {"mpi": 1, "gloo": 9}, 64: {"mpi": 1, "gloo": 9}}))
    # reduce: two sizes each; the first-seen winner (mpi) counts as the majority
    assert tune.contested(results, BACKENDS) == {"reduce": [1 << 20, 1 << 24], "p2p": [8192]}


def test_contested_names_every_bench_op_of_the_class():
    results = (sweep("all_to_all", {4: {"mpi": 1, "gloo": 9}, 64: {"mpi": 1, "gloo": 9},
                                    1024: {"mpi": 9, "gloo": 1}})
               + sweep("all_to_allv", {4: {"mpi": 1, "gloo": 9}, 64: {"mpi": 1, "gloo": 9},
                                       1024: {"mpi": 9, "gloo": 1}}))
    assert tune.contested(results, BACKENDS) == {"all_to_all": [1024], "all_to_allv": [1024]}


def test_all_to_all_is_decided_for_one_backend():
    """gloo wins all_to_all's largest size: two backends in its rules would make
    every uneven call agree on its size first, so the table keeps the one whose
    times are closest to each size's best over all of them (mpi), and says by how
    much it loses where it does."""
    results = (sweep("all_to_all", {4: {"mpi": 1, "gloo": 9}, 64: {"mpi": 1, "gloo": 9},
                                    1024: {"mpi": 9, "gloo": 6}})
               + sweep("all_reduce", {4: {"mpi": 1, "gloo": 9}, 1024: {"mpi": 9, "gloo": 1}}))
    d = tune.decide(results, BACKENDS)
    assert [b for _, b, _ in d["all_to_all"]] == ["mpi", "mpi", "mpi"]
    assert d["all_to_all"][2][2] == pytest.approx(6 / 9 - 1)
    assert [b for _, b, _ in d["all_reduce"]] == ["mpi", "gloo"]  # (other ops: per size)
    assert tune.contested(results, BACKENDS)["all_to_all"] == [1024]  # (still measured again)


def test_each_backend_is_judged_by_its_better_pass():
    """A slow phase of mpi in the sweep left gloo the winner at 16 MiB; the
    second pass measures mpi at its usual speed, and the table follows."""
    first = sweep("reduce", {4: {"mpi": 1, "gloo": 9}, 1 << 24: {"mpi": 25000, "gloo": 15000}})
    again = sweep("reduce", {1 << 24: {"mpi": 8000, "gloo": 16000}})
    before = tune.decide(first, BACKENDS)
    merged = tune.best_of(first, again)
    assert [(r.bytes, r.variant, r.max_us) for r in merged] == [
        (4, "mpi", 1), (4, "gloo", 9), (1 << 24, "mpi", 8000), (1 << 24, "gloo", 15000)]
    after = tune.decide(merged, BACKENDS)
    assert [b for _, b, _ in after["reduce"]] == ["mpi", "mpi"]
    assert tune.changed(before, after) == [("reduce", 1 << 24, "gloo", "mpi")]


def test_a_minority_winner_confirmed_by_the_second_pass_stays():
    first = sweep("p2p", {4: {"mpi": 1, "gloo": 9}, 8192: {"mpi": 30, "gloo": 20}})
    again = sweep("p2p", {8192: {"mpi": 31, "gloo": 21}})
    after = tune.decide(tune.best_of(first, again), BACKENDS)
    assert [b for _, b, _ in after["p2p"]] == ["mpi", "gloo"]
    assert tune.changed(tune.decide(first, BACKENDS), after) == []


def test_make_table_records_what_was_measured_again():
    doc = tune.make_table(results_all(), BACKENDS, 2, META, remeasured={"broadcast": [4]})
    assert doc["metadata"]["decision"]["remeasured"] == {"broadcast": [4]}
    assert tune.make_table(results_all(), BACKENDS, 2, META)["metadata"]["decision"]["remeasured"] == {}


# -- crossovers and gains --------------------------------------------------------------------
def test_crossovers_lines():
    doc = tune.make_table(results_all(), BACKENDS, 2, META)
    lines = tune.crossovers(doc)
    assert len(lines) == len(TIMES)
    by_op = {line.split(" ")[0]: line for line in lines}
    assert set(by_op) == set(TIMES)
    for op, line in by_op.items():
        assert line.startswith(f"{op} [2 ranks, cpu]: ")
        rules = doc["rules"]["cpu"][op]["2"]
        pos = 0
        for r in rules:  # backends in range order, each with its upper bound and margin
            at = line.index(r["backend"], pos)
            assert at >= pos
            pos = at + len(r["backend"])
            if r["max_bytes"] is not None:
                assert bench.human(r["max_bytes"]) in line[pos:]
            assert f"{100 * r['margin']:.0f}%" in line[pos:]
    assert "1K" not in by_op["all_reduce"]  # ranges end at measured sizes: 64
    assert "64" in by_op["all_reduce"]


def test_crossovers_negative_margin_is_readable():
    results = sweep("all_reduce", {4: {"mpi": 20, "gloo": 10}, 64: {"mpi": 100, "gloo": 103}})
    line, = tune.crossovers(tune.make_table(results, BACKENDS, 2, META))
    assert "+-" not in line, line


def test_gains_geomean_and_max():
    results = sweep("all_reduce", {4: {"mpi": 10, "gloo": 20}, 1024: {"mpi": 40, "gloo": 20}})
    doc = tune.make_table(results, BACKENDS, 2, META)
    g = tune.gains(results, doc, BACKENDS)
    assert set(g) == {"all_reduce"}
    # table: mpi at 4, gloo at 1024 -> vs mpi: ratios 1, 2; vs gloo: 2, 1
    assert g["all_reduce"]["mpi"] == (pytest.approx(math.sqrt(2)), pytest.approx(2.0))
    assert g["all_reduce"]["gloo"] == (pytest.approx(math.sqrt(2)), pytest.approx(2.0))


def test_gains_one_backend_everywhere():
    results = sweep("all_to_all", {8: {"mpi": 5, "gloo": 50}, 1024: {"mpi": 6, "gloo": 12}})
    doc = tune.make_table(results, BACKENDS, 2, META)
    g = tune.gains(results, doc, BACKENDS)["all_to_all"]
    assert g["mpi"] == (pytest.approx(1.0), pytest.approx(1.0))
    assert g["gloo"] == (pytest.approx(math.sqrt(10 * 2)), pytest.approx(10.0))


def test_gains_use_the_sweeps_group_size_in_a_merged_table():
    """After --merge, the table may list other group sizes first."""
    results = sweep("all_to_all", {8: {"mpi": 5, "gloo": 50}, 1024: {"mpi": 6, "gloo": 12}})
    doc = tune.make_table(results, BACKENDS, 2, META)
    doc["rules"]["cpu"]["all_to_all"] = {"8": [{"max_bytes": None, "backend": "gloo"}],
                                         **doc["rules"]["cpu"]["all_to_all"]}
    assert tune.gains(results, doc, BACKENDS, "cpu", 2)["all_to_all"]["mpi"] == (pytest.approx(1.0),
                                                                                 pytest.approx(1.0))
    assert tune.gains(results, doc, BACKENDS)["all_to_all"]["mpi"][0] < 1  # (the first listed: gloo)


def test_gains_below_one_when_hysteresis_keeps_a_slower_backend():
    results = sweep("all_reduce", {4: {"mpi": 20, "gloo": 10}, 64: {"mpi": 100, "gloo": 103}})
    doc = tune.make_table(results, BACKENDS, 2, META)
    g = tune.gains(results, doc, BACKENDS)["all_reduce"]
    assert g["mpi"][0] == pytest.approx(math.sqrt(2 * 100 / 103))
    assert g["mpi"][1] == pytest.approx(2.0)
    assert g["gloo"] == (pytest.approx(1.0), pytest.approx(1.0))


# -- bench helpers ---------------------------------------------------------------------------
def test_selection_summary_counts_picks_within_5_percent_and_same_backend_noise():
    results = [res("all_reduce", 4, "mpi", 10), res("all_reduce", 4, "gloo", 50),
               res("all_reduce", 4, "mcrdl", 10.2, backend="mpi"),           # fastest, within 5%
               res("all_reduce", 64, "mpi", 10), res("all_reduce", 64, "gloo", 50),
               res("all_reduce", 64, "mcrdl", 12, backend="mpi"),            # fastest, 1.2x: noise
               res("p2p", 4, "mpi", 10), res("p2p", 4, "gloo", 9),
               res("p2p", 4, "mcrdl", 10, backend="mpi"),                    # not the fastest: 1.11x
               res("p2p", 64, "mpi", 10), res("p2p", 64, "gloo", 30),
               res("p2p", 64, "mcrdl", 8, backend="mpi"),                    # faster than itself
               res("p2p", 64, "raw-mpi", 1, backend="raw")]                  # raw variants never count
    assert bench.selection_summary(results) == (
        "selection over 4 points: picked the fastest forced backend at 3/4; within 5% of the fastest "
        "at 2/4; against the same backend forced (same calls: the run's noise) median 1.01x, "
        "over 5% slower at 1, over 5% faster at 1")
    assert bench.selection_summary([r for r in results if r.variant != "mcrdl"]) is None


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_busbw_factor(n):
    assert bench.busbw_factor("all_reduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bench.busbw_factor(op, n) == pytest.approx((n - 1) / n), op
    for op in ("broadcast", "reduce", "p2p"):
        assert bench.busbw_factor(op, n) == 1.0, op


def test_busbw_factor_known_values():
    assert bench.busbw_factor("all_reduce", 2) == 1.0
    assert bench.busbw_factor("all_reduce", 4) == 1.5
    assert bench.busbw_factor("all_gather", 2) == 0.5
    assert bench.busbw_factor("all_to_all", 4) == 0.75
    assert bench.busbw_factor("broadcast", 64) == 1.0


def test_default_sizes():
    sizes = bench.default_sizes()
    assert sizes[0] == 4 and sizes[-1] == 32 << 20
    assert len(sizes) == 24
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert bench.default_sizes(1024) == [4 << i for i in range(9)]
    assert bench.default_sizes(100) == [4, 8, 16, 32, 64]  # not past max_bytes
    assert bench.default_sizes(16, min_bytes=1) == [1, 2, 4, 8, 16]
    assert bench.default_sizes(3) == []


def test_bench_ops_are_the_selection_classes_without_barrier_and_all_to_allv():
    assert "barrier" not in bench.BENCH_OPS
    assert set(bench.BENCH_OPS) | {"barrier"} == set(mcrdl.tuning.SELECT_OPS) | {"all_to_allv"}
    assert mcrdl.tuning.OP_CLASS["all_to_allv"] == "all_to_all"


def test_both_all_to_all_forms_decide_one_rule_on_their_summed_times():
    """all_to_all and all_to_allv share the table's all_to_all rules: a
    backend far ahead in one form and a little behind in the other wins."""
    results = (sweep("all_to_all", {4: {"mpi": 10, "gloo": 12}, 1024: {"mpi": 10, "gloo": 30}})
               + sweep("all_to_allv", {4: {"mpi": 30, "gloo": 12}, 1024: {"mpi": 11, "gloo": 30}}))
    d = tune.per_size(results, BACKENDS)
    assert set(d) == {"all_to_all"}
    assert d["all_to_all"] == [(4, "gloo", pytest.approx(40 / 24 - 1)), (1024, "mpi", pytest.approx(60 / 21 - 1))]
    # (and the table's one backend for all of them: mpi, 1.67x the best at 4 B, 2.86x ahead at 1 KiB)
    assert tune.decide(results, BACKENDS)["all_to_all"] == [(4, "mpi", pytest.approx(24 / 40 - 1)),
                                                           (1024, "mpi", pytest.approx(60 / 21 - 1))]
    table = tune.make_table(results, BACKENDS, 2, META)
    assert set(table["rules"]["cpu"]) == {"all_to_all"}
    gains = tune.gains(results, table, BACKENDS)
    assert set(gains) == {"all_to_all", "all_to_allv"}
    # a backend measured in only one form at a size does not compete there
    one = sweep("all_to_all", {4: {"mpi": 10, "gloo": 1}}) + sweep("all_to_allv", {4: {"mpi": 10}})
    assert tune.decide(one, BACKENDS)["all_to_all"] == [(4, "mpi", 0.0)]


def test_human_sizes():
    assert [bench.human(s) for s in (4, 1000, 1024, 65536, 1 << 20, 3 << 30, 1536)] == \
        ["4", "1000", "1K", "64K", "1M", "3G", "1536"]


def test_json_and_csv_round_trip(tmp_path):
    results = results_all()
    meta = {**META, "world_size": 2}
    bench.write_json(tmp_path / "r.json", results, meta)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["format"] == bench.FORMAT == "mcrdl-bench/1"
    loaded, m = bench.load_json(tmp_path / "r.json")
    assert loaded == results and m == meta
    bench.write_csv(tmp_path / "r.csv", results)
    with open(tmp_path / "r.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert tuple(rows[0]) == bench.CSV_FIELDS
    assert len(rows) == len(results) + 1
    assert rows[1][:3] == [results[0].op, str(results[0].bytes), results[0].variant]


def test_load_json_rejects_other_formats(tmp_path):
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"format": "mcrdl-tuning/1", "rules": {}}))
    with pytest.raises(ValueError, match="not an mcrdl bench result"):
        bench.load_json(p)
