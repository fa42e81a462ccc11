"""In-situ autotune: real jobs, every result checked, every rank's picks compared."""
import json
import re
import subprocess
import sys

import pytest

from conftest import run_job, run_job_rc
from mcrdl.autotune import TRIAL_STALL_GAP, Autotuner, Bucket, bucket, bucket_bounds, period_of
from mcrdl.backends import OPS, REGISTRY
from mcrdl.tuning import TuningTable


TWO_RANKS = ["ops", "one_sided", "disagree", "slow_rank", "uneven", "reused"]
FOUR_RANKS = ["subgroups", "ops"]


@pytest.fixture(scope="module")
def two_ranks():
    """One job runs every 2-rank case in turn, each on a runtime of its own."""
    return run_job_rc(2, "autotune_job.py", ",".join(TWO_RANKS), timeout=400)[0]


@pytest.fixture(scope="module")
def four_ranks():
    return run_job_rc(4, "autotune_job.py", ",".join(FOUR_RANKS), timeout=400)[0]


@pytest.mark.parametrize("case", TWO_RANKS)
def test_autotune_two_ranks(case, two_ranks):
    """one_sided hangs and disagree and reused deadlock without their fixes
    (plans kept while exploring; winners agreed on by the group; state per
    group object, not per name)."""
    two_ranks.part(case).require([f"{case} finished"], range(2))


def test_drift_check_opens_a_bucket_again_at_one_call_on_every_rank():
    """Rank 1 turns 20 ms late: the group re-explores from one call on both
    ranks, with rank 0 on the general path where rank 1 is on the fast path
    (hangs if the fast path's calls are not counted)."""
    out = run_job(2, "autotune_job.py", "drift", timeout=180, env={"MCRDL_AUTOTUNE_DRIFT": "10"})
    out.require(["drift finished"], range(2))


@pytest.fixture(scope="module")
def trials_of_30_ms():
    """Both step-cost cases with trials over 30 ms blocks (quicker than the default), one job."""
    return run_job_rc(2, "autotune_job.py", "step_cost_gloo,step_cost_mpi", timeout=300,
                      env={"MCRDL_AUTOTUNE_BLOCK_MS": "30"})[0]


@pytest.mark.parametrize("costly,block_ms", [("gloo", "30"), ("mpi", "30"), ("gloo", "0")])
def test_trial_over_blocks_refuses_a_backend_that_slows_the_work_around_it(request, costly, block_ms):
    """gloo wins per call, but calls on ``costly`` slow what the job does after
    them: the trial keeps mpi when gloo is costly, gloo otherwise; with no
    trial (0 ms) the per-call winner stays. The ranks' blocks must be agreed."""
    case = f"step_cost_{costly}"
    if block_ms == "30":
        out = request.getfixturevalue("trials_of_30_ms").part(case)
    else:
        out = run_job(2, "autotune_job.py", case, timeout=180, env={"MCRDL_AUTOTUNE_BLOCK_MS": block_ms})
    out.require([f"{case} finished"], range(2))


def test_debug_mode_names_a_drifted_schedule():
    out = run_job(2, "autotune_job.py", "debug_divergence", timeout=120, env={"MCRDL_DEBUG": "1"})
    out.require(["debug_divergence finished"], range(2))


@pytest.mark.parametrize("case", FOUR_RANKS)
def test_autotune_four_ranks(case, four_ranks):
    four_ranks.part(case).require([f"{case} finished"], range(4))


def test_saved_table_loads_and_selects_what_was_learned(tmp_path):
    path = tmp_path / "learned.json"
    out = run_job(2, "autotune_job.py", "ops", timeout=240,
                  env={"MCRDL_AUTOTUNE_SAVE": str(path), "MCRDL_COMMS_LOG": "1"})
    out.require(["ops finished"], range(2))
    assert "autotune: backends tried" in out  # the logger's summary shows what was tried
    table = TuningTable.load(str(path), REGISTRY)
    rows = table.metadata["buckets"]
    assert table.metadata["learned"].startswith("in-situ autotune")
    assert {r["op"] for r in rows} >= {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter",
                                       "gather", "scatter", "all_to_all"}
    for r in rows:  # every live library that has the op, timed
        assert r["winner"] in r["us"] and {"mpi", "gloo"} <= set(r["us"]) <= set(REGISTRY), r
        for nbytes in (r["min_bytes"], r["max_bytes"]):
            assert table.lookup(r["op"], 2, nbytes) == r["winner"], (r, nbytes)
    # next run: the saved table selects, and explain says what was measured
    row = next(r for r in rows if r["op"] == "all_reduce" and r["min_bytes"] == 1024)
    out = subprocess.run([sys.executable, "-m", "mcrdl.cli", "explain", "all_reduce", "1500", "--group-size",
                          "2", "--table", str(path)], capture_output=True, text=True, timeout=120).stdout
    measured = ", ".join(rf"{name} (-|[\d.]+ us)" for name in row["us"])
    assert re.search(rf"all_reduce of 1500 B on cpu, group size 2: {row['winner']} \(tuning table .*learned "
                     rf"in-situ by group world: {measured}", out), out


def test_torch_backend_ops_under_autotune():
    out = run_job(2, "torch_backend_ops_job.py", "mpi", timeout=300, env={"MCRDL_AUTOTUNE": "1"})
    out.require(["torch backend ops finished"], range(2))


@pytest.mark.parametrize("drift", ["0", "4"])
def test_stress_with_autotune(drift):
    """The randomized mixing program (sync/async, overlapping buffers, explicit
    and selected backends, a table that seeds exploration) with autotune on,
    and with a drift check every 4 calls of each bucket."""
    out = run_job(4, "stress_job.py", 5, 400, timeout=300,
                  env={"MCRDL_AUTOTUNE": "1", "MCRDL_AUTOTUNE_DRIFT": drift})
    out.require(["stress finished"], range(4))


def test_settings_are_checked_before_anything_starts(monkeypatch):
    monkeypatch.setenv("MCRDL_AUTOTUNE", "yes")
    with pytest.raises(ValueError, match="MCRDL_AUTOTUNE: expected 0 or 1, got 'yes'"):
        Autotuner.settings(None)
    monkeypatch.setenv("MCRDL_AUTOTUNE", "1")
    monkeypatch.setenv("MCRDL_AUTOTUNE_CALLS", "0")
    with pytest.raises(ValueError, match="MCRDL_AUTOTUNE_CALLS"):
        Autotuner.settings(None)
    monkeypatch.setenv("MCRDL_AUTOTUNE_CALLS", "5")
    monkeypatch.setenv("MCRDL_AUTOTUNE_SAVE", "/tmp/x.json")
    assert Autotuner.settings(None) == {"calls": 5, "save": "/tmp/x.json", "drift": 0, "block_ms": 100.0}
    for bad in ("-1", "x", "inf", "nan"):
        monkeypatch.setenv("MCRDL_AUTOTUNE_BLOCK_MS", bad)
        with pytest.raises(ValueError, match="MCRDL_AUTOTUNE_BLOCK_MS: expected milliseconds >= 0"):
            Autotuner.settings(None)
    monkeypatch.setenv("MCRDL_AUTOTUNE_BLOCK_MS", "2.5")
    assert Autotuner.settings(None)["block_ms"] == 2.5
    for bad in ("1", "-3", "x"):
        monkeypatch.setenv("MCRDL_AUTOTUNE_DRIFT", bad)
        with pytest.raises(ValueError, match="MCRDL_AUTOTUNE_DRIFT: expected 0 .off. or a window"):
            Autotuner.settings(None)
    monkeypatch.setenv("MCRDL_AUTOTUNE_DRIFT", "100")
    assert Autotuner.settings(None)["drift"] == 100
    assert Autotuner.settings(False) is None


def test_buckets_are_powers_of_two():
    assert [bucket(n) for n in (0, 1, 2, 3, 4, 1023, 1024, 2047, 2048)] == [0, 1, 2, 2, 3, 10, 11, 11, 12]
    assert bucket_bounds(0) == (0, 0) and bucket_bounds(11) == (1024, 2047)
    assert all(bucket(lo) == bucket(hi) == b for b in range(1, 40) for lo, hi in [bucket_bounds(b)])


class _Sel:
    table, default, static = None, "mpi", {}


def test_saved_rules_keep_the_seed_table_outside_the_learned_buckets():
    seed = TuningTable.from_dict({"format": "mcrdl-tuning/1", "rules": {
        "all_reduce": {"2": [{"max_bytes": 65535, "backend": "mpi"}, {"max_bytes": None, "backend": "gloo"}]},
        "broadcast": {"2": [{"max_bytes": None, "backend": "gloo"}]}}}, REGISTRY)

    class Seeded(_Sel):
        table = seed

    tuner = Autotuner(Seeded())
    buckets = {}
    tuner.groups = [("world", 2, buckets)]
    k = Bucket(("mpi", "gloo"))
    k.winner, k.agreed, k.how = "gloo", {"mpi": 2.0, "gloo": 1.0}, "measured fastest"
    buckets[("all_reduce", "cpu", 11)] = k  # 1024-2047 B learned: gloo
    doc = tuner.table(2)
    assert doc["rules"]["cpu"]["all_reduce"]["2"] == [{"max_bytes": 1023, "backend": "mpi"},
                                               {"max_bytes": 2047, "backend": "gloo"},
                                               {"max_bytes": 65535, "backend": "mpi"},
                                               {"max_bytes": None, "backend": "gloo"}]
    assert doc["rules"]["cpu"]["broadcast"] == {"2": [{"max_bytes": None, "backend": "gloo"}]}  # not learned: kept
    table = TuningTable.from_dict(json.loads(json.dumps(doc)), REGISTRY)
    assert table.learned("all_reduce", 2, 1500).startswith("learned in-situ by group world: mpi 2.0 us")
    assert table.learned("all_reduce", 2, 4000) is None


def test_saved_rules_are_per_device():
    """Buckets learned on CUDA tensors become the table's cuda rules; the seed's
    cpu rules stay as they were."""
    seed = TuningTable.from_dict({"format": "mcrdl-tuning/2", "rules": {
        "cpu": {"all_reduce": {"2": [{"max_bytes": None, "backend": "gloo"}]}}}}, REGISTRY)

    class Seeded(_Sel):
        table = seed

    tuner = Autotuner(Seeded())
    buckets = {}
    tuner.groups = [("world", 2, buckets)]
    k = Bucket(("nccl", "mpi_staged"))
    k.winner, k.agreed, k.how = "mpi_staged", {"nccl": 9.0, "mpi_staged": 4.0}, "measured fastest"
    buckets[("all_reduce", "cuda", 3)] = k  # 4-7 B
    doc = tuner.table(2)
    assert doc["rules"]["cpu"] == {"all_reduce": {"2": [{"max_bytes": None, "backend": "gloo"}]}}
    # no cuda seed: the one learned bucket covers every size
    assert doc["rules"]["cuda"] == {"all_reduce": {"2": [{"max_bytes": None, "backend": "mpi_staged"}]}}
    table = TuningTable.from_dict(json.loads(json.dumps(doc)), REGISTRY)
    assert table.lookup("all_reduce", 2, 5, "cuda") == "mpi_staged" and table.lookup("all_reduce", 2, 5) == "gloo"
    assert table.learned("all_reduce", 2, 5, "cuda").startswith("learned in-situ by group world: nccl 9.0 us")
    assert table.learned("all_reduce", 2, 5) is None


def test_saved_rules_merge_buckets_and_cover_every_size():
    tuner = Autotuner(_Sel())
    buckets = {}
    tuner.groups = [("world", 2, buckets)]
    winners = {3: "gloo", 11: "mpi", 12: "mpi", 20: "gloo"}
    for b, w in winners.items():
        k = Bucket(("mpi", "gloo"))
        k.winner, k.agreed, k.how = w, {"mpi": 1.0, "gloo": 2.0}, "measured fastest"
        buckets[("all_reduce", "cpu", b)] = k
    doc = tuner.table(2)
    assert doc["rules"] == {"cpu": {"all_reduce": {"2": [{"max_bytes": 7, "backend": "gloo"},
                                                         {"max_bytes": 4095, "backend": "mpi"},
                                                         {"max_bytes": None, "backend": "gloo"}]}}}
    table = TuningTable.from_dict(json.loads(json.dumps(doc)), REGISTRY)
    assert table.lookup("all_reduce", 2, 1500) == "mpi" and table.lookup("all_reduce", 2, 1 << 30) == "gloo"


def test_drift_check_needs_slow_windows_in_a_row_against_the_lowest_median():
    class OneMember:  # the group's maximum is this member's own flag
        def control_max(self, g, value):
            return value

    class Group:
        plans = {"plan": object()}

    with pytest.raises(ValueError, match="drift 0 .off. or >= 2"):
        Autotuner(_Sel(), drift=1)
    tuner = Autotuner(_Sel(), drift=10)
    b = Bucket(("mpi", "gloo"))
    b.winner = "mpi"

    def window(us):  # 10 calls of the bucket: 9 timed, then the check
        for _ in range(10):
            if tuner._count(OneMember(), Group, b):
                tuner.record(b, "mpi", us * 1e-6)

    for us in (100, 60, 130, 50, 110):  # 130: slow once (2x 60), then 50 lowers the baseline
        window(us)
        assert b.winner == "mpi", (us, b.base, b.slow)
    window(120)  # the second slow window in a row against 50 us
    assert b.winner is None and b.candidates[0] == "mpi" and Group.plans == {}
    assert b.reopened[0]["base_us"] == 50.0 and b.reopened[0]["now_us"] == 120.0


def _fake_group(monkeypatch, block_ms=10, other_sees_no_harm=False):
    """A tuner (mpi and gloo live), one group of 2 and a fake clock
    (``clock[0]``, seconds). ``other_sees_no_harm``: the agreement includes a
    second member whose trial found no harm."""
    import types

    import mcrdl.autotune as at

    clock = [0.0]
    monkeypatch.setattr(at, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))

    class Sel(_Sel):
        device_defaults = {}
        live = {name: types.SimpleNamespace(devices=("cpu",), ops=frozenset(OPS)) for name in ("mpi", "gloo")}

    class Members:
        def control_max(self, g, value):
            if isinstance(value, list):
                return value
            return max(value, 0) if other_sees_no_harm else value  # (the trial's verdict, negated)

    class Group:
        name, size, declined = "world", 2, ()

        def __init__(self):
            self.tuned, self.plans, self.trying, self.tuned_calls = {}, {}, None, 0

    return Autotuner(Sel(), block_ms=block_ms), Members(), Group(), clock


def _trial_setup(monkeypatch, other_sees_no_harm=False):
    """Two buckets of one group (all_reduce, broadcast of 64 B) on a fake
    clock: gloo wins every timed call; each call advances the clock by its
    ``cost[op][backend]``. Returns the tuner, group, ``call(op)`` and the
    backends each op ran on."""
    tuner, rt, g, clock = _fake_group(monkeypatch, 10, other_sees_no_harm)
    # all_reduce on gloo slows the job after it; broadcast on gloo is cheaper than on mpi
    cost = {"all_reduce": {"mpi": 1e-3, "gloo": 3e-3}, "broadcast": {"mpi": 1e-3, "gloo": 0.5e-3}}
    ran = {"all_reduce": [], "broadcast": []}

    def call(op):
        name, timed = tuner.pick(rt, g, op, 64, "cpu", lambda n: True)
        ran[op].append(name)
        if timed is not None:
            tuner.record(timed, name, 1e-6 if name == "gloo" else 1e-5)  # gloo faster per call
        clock[0] += cost[op][name]  # the job's time after this call (its own work included)

    for _ in range(9):  # explore both: 2 backends x (1 + 3) rounds, then the agreement
        call("all_reduce")
        call("broadcast")
    return tuner, g, call, ran


#: A trial's backends in order, blocks of 4 calls (S C C S C S S C)
TRIAL_RAN = ["mpi"] * 4 + ["gloo"] * 8 + ["mpi"] * 4 + ["gloo"] * 4 + ["mpi"] * 8 + ["gloo"] * 4


def test_trial_runs_blocks_in_order_one_bucket_per_group_at_a_time(monkeypatch):
    """Exploration picks gloo per call for two buckets; their trials run one
    after the other (blocks of the agreed size in the order S C C S C S S C),
    and each verdict follows the blocks' times: all_reduce's gloo blocks longer
    in total → refused; broadcast's shorter → kept."""
    tuner, g, call, ran = _trial_setup(monkeypatch)
    ar, bc = g.tuned[("all_reduce", "cpu", bucket(64))], g.tuned[("broadcast", "cpu", bucket(64))]
    # pace while exploring: 2.75 ms between calls of each bucket, so blocks of ceil(10 / 2.75) = 4
    assert (ar.trial, ar.block, ar.trial_from) == ("gloo", 4, 9) and g.trying is ar
    assert (bc.trial, bc.trial_from) == ("gloo", None) and "waits" in tuner.describe(g, "broadcast", 64)
    for _ in range(8 * 4):
        call("all_reduce")
        call("broadcast")
    assert ran["all_reduce"][9:] == TRIAL_RAN
    assert ran["broadcast"][9:] == ["mpi"] * 32  # waited on its seed
    call("all_reduce")  # the verdict: gloo's blocks took longer
    assert ar.winner == "mpi" and ar.blocks["refused"] and ran["all_reduce"][-1] == "mpi" and g.trying is None
    assert ar.blocks["ms"] == {"mpi": [8.0] * 4, "gloo": [16.0] * 4}  # 4 calls x (1 + 1) ms, (3 + 1) ms
    for _ in range(8 * 4 + 1):  # the broadcast's trial begins at its next call
        call("broadcast")
    assert ran["broadcast"][41:73] == TRIAL_RAN
    assert bc.winner == "gloo" and not bc.blocks["refused"] and bc.trial is None
    assert bc.blocks["ms"] == {"mpi": [4.0] * 4, "gloo": [2.0] * 4}
    assert "no longer" in bc.how and "took longer" in ar.how


def test_trial_is_refused_only_if_slower_on_every_member(monkeypatch):
    tuner, g, call, ran = _trial_setup(monkeypatch, other_sees_no_harm=True)
    ar = g.tuned[("all_reduce", "cpu", bucket(64))]
    for _ in range(8 * 4 + 1):
        call("all_reduce")
        call("broadcast")
    assert ar.winner == "gloo" and not ar.blocks["refused"], ar.how  # slower here only


def test_a_stalled_trial_is_abandoned_for_the_next_one(monkeypatch):
    """The bucket on trial is not called again: once the group made a whole
    trial's worth of gaps of 64 calls (8 blocks x 4 x 64) since its last
    call, it keeps its seed and the waiting bucket's trial begins."""
    tuner, g, call, ran = _trial_setup(monkeypatch)
    ar, bc = g.tuned[("all_reduce", "cpu", bucket(64))], g.tuned[("broadcast", "cpu", bucket(64))]
    call("all_reduce")  # ar's trial makes one call (2 group calls after its start), then none
    stall = 8 * 4 * TRIAL_STALL_GAP
    for _ in range(stall):
        call("broadcast")
    assert g.trying is ar and ran["broadcast"][9:] == ["mpi"] * stall
    call("broadcast")
    assert g.trying is bc and bc.trial_from == 9 + stall
    assert ar.winner == "mpi" and ar.blocks["stalled_after"] == 1 and "stalled" in ar.how
    for _ in range(8 * 4):
        call("broadcast")
    assert ran["broadcast"][9 + stall:9 + stall + 32] == TRIAL_RAN and bc.winner == "gloo"


def test_a_trial_called_rarely_is_not_taken_for_stalled(monkeypatch):
    """The bucket on trial is called once per 100 calls of another: its trial
    runs to its verdict (counting the other bucket's calls alone, a trial's
    worth of them, 32, would have abandoned it)."""
    tuner, g, call, ran = _trial_setup(monkeypatch)
    ar = g.tuned[("all_reduce", "cpu", bucket(64))]
    for _ in range(8 * 4 + 1):
        call("all_reduce")
        for _ in range(100):
            call("broadcast")
    assert ran["all_reduce"][9:41] == TRIAL_RAN and ar.blocks.get("stalled_after") is None, ar.blocks
    assert ar.winner == "mpi" and ar.blocks["refused"] and ar.blocks["period"] == 1, ar.blocks


def test_trial_judges_per_period_of_the_jobs_calls_where_blocks_cut_steps_unevenly(monkeypatch):
    """A step: all_reduce, 10 ms of compute, all_reduce, all_reduce,
    broadcast. gloo wins all_reduce per call but costs 1 ms more per call
    than mpi. Blocks of 4 calls cut steps of 3 so that mpi's blocks hold the
    compute 7 times and gloo's 4: in total gloo's blocks are shorter, yet per
    step (the group's calls repeat every 3 all-reduces) gloo is 3 ms slower:
    refused. While the trial runs no fast-path plan is made for the group."""
    tuner, rt, g, clock = _fake_group(monkeypatch, block_ms=20)
    cost = {"mpi": 1e-3, "gloo": 2e-3}

    def call(op, after=0.0):
        name, timed = tuner.pick(rt, g, op, 64, "cpu", lambda n: True)
        if timed is not None:  # gloo faster per call for all_reduce, slower for broadcast
            tuner.record(timed, name, 1e-6 if (name == "gloo") == (op == "all_reduce") else 1e-5)
        clock[0] += (cost[name] if op == "all_reduce" else 1e-3) + after

    ar = None
    for step in range(20):
        call("all_reduce", after=10e-3)
        call("all_reduce")
        call("all_reduce")
        call("broadcast")
        ar = g.tuned[("all_reduce", "cpu", bucket(64))]
        if step == 3:  # all_reduce agreed at its 9th call: on trial; broadcast still exploring
            assert (ar.trial, ar.block, g.trying) == ("gloo", 4, ar)
        if step == 10:  # broadcast frozen (mpi), but planned on the general path during the trial
            assert tuner.frozen(g, "broadcast", 64, "cpu", "mpi") is None
            assert tuner.frozen(g, "broadcast", 64, "cpu", "gloo", ignore_trial=True) == "mpi"  # (explain's)
    assert ar.winner == "mpi" and ar.blocks["refused"] and g.trying is None, ar.blocks
    assert tuner.frozen(g, "broadcast", 64, "cpu", "mpi") == "mpi"
    assert ar.blocks["period"] == 3 and ar.blocks["per_period_ms"] == {"mpi": 14.0, "gloo": 17.0}, ar.blocks
    assert sum(ar.blocks["ms"]["gloo"]) < sum(ar.blocks["ms"]["mpi"]), ar.blocks  # the totals would keep gloo
    assert "per period of the job's calls (3 calls" in ar.how
    # cost: gloo's 16 calls, 16 / 3 steps, at 3 ms a step more; broadcast's 3 timed gloo calls 9 us slower
    assert tuner.excess_s == pytest.approx(3e-3 * 16 / 3 + 3 * 9e-6), tuner.excess_s


def test_period_of_finds_the_shortest_period_seen_twice_despite_irregular_calls():
    assert period_of([1, 1, 2, 1, 1, 2, 1]) == 3
    assert period_of([2] * 9) == 1
    assert period_of([1, 2, 3, 1, 2]) is None and period_of([]) is None  # (seen once)
    assert period_of([1, 2] * 6 + [1, 3] + [1, 2] * 6) == 2  # (a barrier between two steps)
    assert period_of([1, 2] * 4 + [2, 1] + [1, 2] * 4) is None  # (a call more and one fewer, apart: 4 misses)
    assert period_of([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]) is None
    assert period_of([2, 2, 2, 2, 2, 2, 2, 3] * 4) == 8
    steps = [1, 1, 2] * 22  # a logging call in two steps, 21 calls apart: still 3
    steps[10] += 1
    steps[31] += 1
    assert period_of(steps) == 3
    assert period_of([1] * 100 + [5] + [1] * 100) == 1
