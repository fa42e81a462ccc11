"""Communication logger: formulas on constructed records, and a real run."""
import math

import pytest

from conftest import run_job
from mcrdl.features.logger import (CommsLogger, Record, arrival_summary, arrival_times, busbw_factor,
                                  size_bin, stragglers)


def make(rank=0, world=4):
    lg = CommsLogger(rank, world, lambda data: [data])
    return lg


def add(lg, op, backend, nbytes, lat, ranks=(0, 1, 2, 3), root=-1, counts=None):
    lg.records.append(Record(len(lg.records), op, backend, "world", tuple(ranks), nbytes, False,
                             1.0, 1.0 + lat, root, counts))


def test_summary_bandwidth_uses_nccl_tests_factors():
    lg = make()
    for _ in range(4):
        add(lg, "all_reduce", "mpi", 1 << 20, 1e-3)
    add(lg, "all_gather_into_tensor", "gloo", 4 << 20, 2e-3)
    rows = {(r["op"], r["backend"]): r for r in lg.summary()}
    ar = rows[("all_reduce", "mpi")]
    assert ar["count"] == 4 and math.isclose(ar["total_s"], 4e-3)
    assert math.isclose(ar["algbw_gbps"], (1 << 20) / 1e-3 / 1e9)
    assert math.isclose(ar["busbw_gbps"], ar["algbw_gbps"] * 2 * 3 / 4)
    ag = rows[("all_gather_into_tensor", "gloo")]
    assert math.isclose(ag["busbw_gbps"], ag["algbw_gbps"] * 3 / 4)
    assert busbw_factor("broadcast", 4) == 1 and busbw_factor("p2p", 2) == 1


def test_trimmed_mean_drops_outliers():
    lg = make()
    for lat in [1e-3] * 18 + [1.0, 2.0]:
        add(lg, "all_reduce", "mpi", 4, lat)
    row = lg.summary()[0]
    assert math.isclose(row["trimmed_mean_s"], 1e-3)
    assert row["mean_s"] > 0.1


def test_histogram_bins_by_size():
    lg = make()
    add(lg, "all_reduce", "mpi", 512, 1e-3)
    add(lg, "all_reduce", "mpi", 2 << 20, 4e-3)
    add(lg, "all_reduce", "gloo", 2 << 20, 6e-3)
    h = lg.histogram()["all_reduce"]
    assert h["<=1K"]["count"] == 1 and h["1M-16M"]["count"] == 2
    assert math.isclose(h["1M-16M"]["total_s"], 10e-3)
    assert size_bin(1024) == "<=1K" and size_bin(1025) == "1K-64K" and size_bin(1 << 30) == ">16M"


def test_traffic_row_follows_known_algorithms():
    lg = make(rank=1)
    add(lg, "all_reduce", "mpi", 1000, 1e-3)                      # ring: 2*3/4*S to rank 2
    add(lg, "broadcast", "mpi", 100, 1e-3, root=0)                 # rank 1 is not the root
    add(lg, "reduce", "mpi", 100, 1e-3, root=3)                    # to root 3
    add(lg, "all_to_all_single", "mpi", 60, 1e-3, counts=[10, 20, 30, 0])
    add(lg, "all_to_all_single", "mpi", 400, 1e-3)                # no split sizes: S/n to each
    add(lg, "send", "mpi", 7, 1e-3, ranks=(0, 1, 2, 3), root=0)
    add(lg, "recv", "mpi", 9, 1e-3, ranks=(0, 1, 2, 3), root=0)
    rows = lg.traffic_row()
    assert rows["all_reduce"] == [0, 0, 1500, 0]
    assert rows["broadcast"] == [0, 0, 0, 0]
    assert rows["reduce"] == [0, 0, 0, 100]
    assert rows["all_to_all"] == [110, 0, 130, 100]   # not to itself
    assert rows["p2p"] == [7, 0, 0, 0]            # sends only


def test_stragglers_subtract_the_fastest_rank():
    s = stragglers([{"a/mpi": 1.0}, {"a/mpi": 1.5, "b/gloo": 2.0}])
    assert s["a/mpi"] == [0.0, 0.5] and s["b/gloo"] == [0.0, 2.0]


def test_arrival_times_take_the_last_arrivals_duration():
    """Per collective call, the minimum over the ranks' durations; the rest is
    waiting. Calls are matched per group by order; p2p and unfinished ops
    keep their own."""
    world = (0, 1, 2)
    durations = {0: (5e-3, 1e-3, 2e-3, 7e-3), 1: (1e-3, 4e-3, 3e-3, 7e-3), 2: (2e-3, None, None, None)}
    docs = []
    for rank, (w0, g1, p2p, w1) in durations.items():
        lg = make(rank=rank, world=3)
        add(lg, "all_reduce", "mpi", 64, w0, ranks=world)                     # world, call 0
        if g1 is not None:
            lg.records.append(Record(len(lg.records), "all_reduce", "mpi", "group1", (0, 1), 64,
                                     False, 1.0, 1.0 + g1))                     # group1, call 0
            add(lg, "send" if rank == 0 else "recv", "mpi", 8, p2p, ranks=world, root=1 - rank)
        add(lg, "all_reduce", "mpi", 64, 7e-3, ranks=world)                    # world, call 1
        if w1 is None:
            lg.records[-1].end = -1.0                                          # still in flight
        docs.append(lg.to_json())
    got = arrival_times(docs)
    assert got[0] == pytest.approx([1e-3, 1e-3, 2e-3, 7e-3])
    assert got[1] == pytest.approx([1e-3, 1e-3, 3e-3, 7e-3])
    assert got[2][0] == pytest.approx(1e-3) and math.isnan(got[2][1])
    s = arrival_summary(docs)
    assert s["all_reduce/mpi"]["time_s"] == pytest.approx([13e-3, 12e-3, 2e-3])
    assert s["all_reduce/mpi"]["comm_time_s"] == pytest.approx([9e-3, 9e-3, 1e-3])
    assert s["all_reduce/mpi"]["wait_time_s"] == pytest.approx([4e-3, 3e-3, 1e-3])
    assert s["send/mpi"]["wait_time_s"] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("nprocs", [2, 4])
def test_known_sequence_is_recorded_and_exported(tmp_path, nprocs):
    out = run_job(nprocs, "logger_job.py", tmp_path, timeout=180)
    out.require(["logger finished"], range(nprocs))
    assert "mcrdl communication summary" in out  # the at-destroy summary on rank 0
