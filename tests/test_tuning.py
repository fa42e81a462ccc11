"""Unit tests for mcrdl.tuning.TuningTable (pure Python, no MPI, one process)."""
import copy
import json
import re
import warnings

import pytest

from mcrdl.tuning import FORMAT, FORMAT_V1, OP_CLASS, SELECT_OPS, TuningTable, TuningTableError

KNOWN = ["mpi", "nccl", "gloo"]

# all_reduce at group size 2: [0, 1024] mpi, (1024, 65536] gloo, (65536, inf) nccl
# all_reduce at group size 8: [0, 4096] mpi, beyond: gloo (last rule, explicit null)
# broadcast at group size 4 only: [0, 100] gloo, beyond: mpi (last rule has a number)
TABLE = {
    "format": FORMAT_V1,
    "metadata": {"hosts": ["node1", "node2"], "world_size": 8, "date": "2024-01-01"},
    "rules": {
        "all_reduce": {
            "2": [{"max_bytes": 1024, "backend": "mpi", "margin": 1.5, "note": "latency bound"},
                  {"max_bytes": 65536, "backend": "gloo"},
                  {"max_bytes": None, "backend": "nccl"}],
            "8": [{"max_bytes": 4096, "backend": "mpi", "margin": 2},
                  {"max_bytes": None, "backend": "gloo"}],
        },
        "broadcast": {
            "4": [{"max_bytes": 100, "backend": "gloo"},
                  {"max_bytes": 1000, "backend": "mpi"}],
        },
        "all_to_all": {
            "2": [{"max_bytes": None, "backend": "mpi"}],
            "4": [{"max_bytes": 512, "backend": "mpi"},
                  {"max_bytes": None, "backend": "nccl"}],
        },
    },
}


def table():
    return TuningTable.from_dict(copy.deepcopy(TABLE), KNOWN)


def write(tmp_path, text, name="table.json"):
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


def doc_with(op="all_reduce", gsize="2", rules=None, **top):
    d = {"format": FORMAT_V1, "rules": {op: {gsize: rules}}}
    d.update(top)
    return d


def expect_error(doc, key, known=KNOWN):
    """from_dict(doc) raises TuningTableError naming ``key``; returns the message."""
    with pytest.raises(TuningTableError) as info:
        TuningTable.from_dict(doc, known, source="t.json")
    msg = str(info.value)
    assert msg.startswith("t.json: "), msg
    assert f": {key}: " in msg, f"{key!r} not named in {msg!r}"
    return msg


# -- loading and lookup -------------------------------------------------------------------
def test_load_from_file(tmp_path):
    path = write(tmp_path, json.dumps(TABLE, indent=2))
    t = TuningTable.load(path, KNOWN)
    assert t.source == path
    assert t.metadata == TABLE["metadata"]
    assert t.lookup("all_reduce", 2, 10) == "mpi"
    assert t.lookup("all_reduce", 2, 10**9) == "nccl"


def test_from_dict_default_source_and_live_defaults_to_known():
    t = TuningTable.from_dict(copy.deepcopy(TABLE), KNOWN)
    assert t.source == "<table>"
    assert t.lookup("all_reduce", 2, 100_000) == "nccl"


@pytest.mark.parametrize("nbytes, expected", [
    (0, "mpi"), (1, "mpi"), (1023, "mpi"), (1024, "mpi"),           # max_bytes is inclusive
    (1025, "gloo"), (65535, "gloo"), (65536, "gloo"),
    (65537, "nccl"), (10**12, "nccl"),                              # null: open-ended
])
def test_lookup_thresholds_inclusive(nbytes, expected):
    assert table().lookup("all_reduce", 2, nbytes) == expected


@pytest.mark.parametrize("nbytes, expected", [
    (0, "gloo"), (100, "gloo"), (101, "mpi"), (1000, "mpi"),
    (1001, "mpi"), (10**9, "mpi"),                                  # beyond the last rule: last rule
])
def test_last_rule_covers_larger_sizes_without_null(nbytes, expected):
    assert table().lookup("broadcast", 4, nbytes) == expected


def test_zero_max_bytes_rule():
    t = TuningTable.from_dict(doc_with(rules=[{"max_bytes": 0, "backend": "gloo"},
                                              {"max_bytes": None, "backend": "mpi"}]), KNOWN)
    assert t.lookup("all_reduce", 2, 0) == "gloo"
    assert t.lookup("all_reduce", 2, 1) == "mpi"


def test_op_not_in_table_returns_none():
    t = table()
    assert t.lookup("gather", 2, 10) is None
    assert t.lookup("p2p", 2, 10) is None
    assert t.distinct_backends("gather", 2) == 0


@pytest.mark.parametrize("gsize, used", [
    (2, 2), (8, 8),                 # exact
    (3, 2), (7, 2), (9, 8), (1000, 8),   # largest listed size below
    (1, 2),                         # below every listed size: smallest listed
])
def test_group_size_fallback(gsize, used):
    t = table()
    # the rules at size 2 and size 8 differ at 2000 B and at 10 MB
    expect = {2: ["mpi", "gloo", "nccl"], 8: ["mpi", "mpi", "gloo"]}[used]
    assert [t.lookup("all_reduce", gsize, n) for n in (500, 2000, 10**7)] == expect


def test_group_size_fallback_single_listed_size():
    t = table()
    for g in (1, 2, 3, 4, 5, 64):
        assert t.lookup("broadcast", g, 50) == "gloo"
        assert t.lookup("broadcast", g, 500) == "mpi"


def test_distinct_backends():
    t = table()
    assert t.distinct_backends("all_reduce", 2) == 3
    assert t.distinct_backends("all_reduce", 8) == 2
    assert t.distinct_backends("all_reduce", 5) == 3     # falls back to size 2
    assert t.distinct_backends("all_to_all", 2) == 1
    assert t.distinct_backends("all_to_all", 4) == 2
    assert t.distinct_backends("all_to_all", 3) == 1     # falls back to size 2
    assert t.distinct_backends("all_to_all", 1) == 1     # smallest listed: 2
    assert t.distinct_backends("barrier", 2) == 0


def test_distinct_backends_counts_repeated_backend_once():
    t = TuningTable.from_dict(doc_with(rules=[{"max_bytes": 10, "backend": "mpi"},
                                              {"max_bytes": 20, "backend": "gloo"},
                                              {"max_bytes": None, "backend": "mpi"}]), KNOWN)
    assert t.distinct_backends("all_reduce", 2) == 2
    assert [t.lookup("all_reduce", 2, n) for n in (10, 11, 20, 21)] == ["mpi", "gloo", "gloo", "mpi"]


def test_empty_rules_object_is_valid():
    t = TuningTable.from_dict({"format": FORMAT_V1, "rules": {}}, KNOWN)
    assert t.lookup("all_reduce", 2, 1) is None
    assert t.metadata == {}


def test_every_api_op_maps_to_a_selection_class():
    assert set(OP_CLASS.values()) == set(SELECT_OPS)
    for op in ("send", "recv", "isend", "irecv", "batch_isend_irecv"):
        assert OP_CLASS[op] == "p2p"
    assert OP_CLASS["all_to_all_single"] == "all_to_all"
    assert OP_CLASS["all_gather_into_tensor"] == "all_gather"
    assert OP_CLASS["reduce_scatter_tensor"] == "reduce_scatter"


# -- validation -----------------------------------------------------------------------------
def test_malformed_json_names_file_line_col(tmp_path):
    text = json.dumps(TABLE, indent=2)
    path = write(tmp_path, text[: len(text) // 2])          # truncated file
    with pytest.raises(TuningTableError) as info:
        TuningTable.load(path, KNOWN)
    msg = str(info.value)
    assert re.match(re.escape(path) + r":\d+:\d+: malformed JSON", msg), msg


def test_malformed_json_position_is_exact(tmp_path):
    path = write(tmp_path, '{\n  "format": "mcrdl-tuning/1",\n  "rules": {,}\n}\n')
    with pytest.raises(TuningTableError, match=re.escape(f"{path}:3:13: malformed JSON")):
        TuningTable.load(path, KNOWN)


def test_empty_file(tmp_path):
    path = write(tmp_path, "")
    with pytest.raises(TuningTableError, match=re.escape(f"{path}:1:1: malformed JSON")):
        TuningTable.load(path, KNOWN)


def test_unreadable_path(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(TuningTableError) as info:
        TuningTable.load(missing, KNOWN)
    assert str(info.value).startswith(f"{missing}: cannot read tuning table")
    with pytest.raises(TuningTableError, match=re.escape(f"{tmp_path}: cannot read")):
        TuningTable.load(str(tmp_path), KNOWN)      # a directory


def test_errors_from_file_name_the_file(tmp_path):
    d = copy.deepcopy(TABLE)
    d["rules"]["all_reduce"]["2"][1]["max_bytes"] = 10
    path = write(tmp_path, json.dumps(d))
    with pytest.raises(TuningTableError, match=re.escape(f"{path}: rules.all_reduce.2[1].max_bytes: ")):
        TuningTable.load(path, KNOWN)


def test_top_level_not_object():
    expect_error([1, 2], "(top level)")


@pytest.mark.parametrize("fmt", ["mcrdl-tuning/3", "", 1, None])
def test_wrong_format(fmt):
    d = copy.deepcopy(TABLE)
    d["format"] = fmt
    expect_error(d, "format")


def test_missing_format():
    d = copy.deepcopy(TABLE)
    del d["format"]
    expect_error(d, "format")


def test_unknown_top_level_key():
    d = copy.deepcopy(TABLE)
    d["rule"] = {}
    msg = expect_error(d, "rule")
    assert "unknown key" in msg


def test_metadata_not_object():
    d = copy.deepcopy(TABLE)
    d["metadata"] = ["x"]
    expect_error(d, "metadata")


@pytest.mark.parametrize("rules", [None, [], "x"])
def test_rules_missing_or_not_object(rules):
    d = {"format": FORMAT_V1}
    if rules is not None:
        d["rules"] = rules
    expect_error(d, "rules")


@pytest.mark.parametrize("op", ["allreduce", "all_to_all_single", "send"])
def test_unknown_op(op):
    # API op names are not selection classes: the table uses the class names
    msg = expect_error(doc_with(op=op, rules=[{"max_bytes": None, "backend": "mpi"}]), f"rules.{op}")
    assert "unknown op" in msg


@pytest.mark.parametrize("by_size", [{}, [], "2"])
def test_op_entry_empty_or_not_object(by_size):
    expect_error({"format": FORMAT_V1, "rules": {"all_reduce": by_size}}, "rules.all_reduce")


@pytest.mark.parametrize("gsize", ["two", "0", "-2", "2.0", "", " 2"])
def test_group_size_key_not_positive_integer(gsize):
    msg = expect_error(doc_with(gsize=gsize, rules=[{"max_bytes": None, "backend": "mpi"}]),
                       f"rules.all_reduce.{gsize}")
    assert "positive integer" in msg


@pytest.mark.parametrize("rules", [[], None, {"max_bytes": None, "backend": "mpi"}])
def test_rule_list_empty_or_not_list(rules):
    expect_error(doc_with(rules=rules), "rules.all_reduce.2")


@pytest.mark.parametrize("rule", ["mpi", 3, None, ["mpi"]])
def test_rule_not_object(rule):
    expect_error(doc_with(rules=[{"max_bytes": 10, "backend": "mpi"}, rule]), "rules.all_reduce.2[1]")


def test_unknown_rule_key():
    msg = expect_error(doc_with(rules=[{"max_bytes": None, "backend": "mpi", "bakend": "gloo"}]),
                       "rules.all_reduce.2[0].bakend")
    assert "unknown key" in msg


@pytest.mark.parametrize("rule", [{"max_bytes": 10}, {"backend": "mpi"}, {}])
def test_missing_backend_or_max_bytes(rule):
    msg = expect_error(doc_with(rules=[{"max_bytes": 5, "backend": "mpi"}, rule]), "rules.all_reduce.2[1]")
    assert "max_bytes and backend" in msg


@pytest.mark.parametrize("mb", [-1, True, False, 1024.0, 1.5, "1024", [1], {"n": 1}])
def test_bad_max_bytes(mb):
    msg = expect_error(doc_with(rules=[{"max_bytes": 5, "backend": "mpi"},
                                       {"max_bytes": mb, "backend": "gloo"},
                                       {"max_bytes": None, "backend": "nccl"}]),
                       "rules.all_reduce.2[1].max_bytes")
    assert "non-negative integer or null" in msg


def test_unordered_max_bytes():
    msg = expect_error(doc_with(rules=[{"max_bytes": 1000, "backend": "mpi"},
                                       {"max_bytes": 10, "backend": "gloo"}]),
                       "rules.all_reduce.2[1].max_bytes")
    assert "ordered" in msg


def test_equal_max_bytes_overlap():
    msg = expect_error(doc_with(rules=[{"max_bytes": 10, "backend": "mpi"},
                                       {"max_bytes": 20, "backend": "gloo"},
                                       {"max_bytes": 20, "backend": "nccl"}]),
                       "rules.all_reduce.2[2].max_bytes")
    assert "overlap" in msg


def test_example_key_path_from_brief():
    d = copy.deepcopy(TABLE)
    d["rules"]["all_reduce"]["2"][1]["max_bytes"] = 1024     # equal to the previous rule's
    expect_error(d, "rules.all_reduce.2[1].max_bytes")


def test_null_max_bytes_not_on_last_rule():
    msg = expect_error(doc_with(rules=[{"max_bytes": 10, "backend": "mpi"},
                                       {"max_bytes": None, "backend": "gloo"},
                                       {"max_bytes": 100, "backend": "nccl"}]),
                       "rules.all_reduce.2[1].max_bytes")
    assert "last rule" in msg


@pytest.mark.parametrize("be", ["ucc", "MPI", "", None, 3, ["mpi"]])
def test_unknown_backend(be):
    msg = expect_error(doc_with(rules=[{"max_bytes": None, "backend": be}]), "rules.all_reduce.2[0].backend")
    assert "unknown backend" in msg


def test_backend_unknown_when_not_in_known_list():
    expect_error(doc_with(rules=[{"max_bytes": None, "backend": "nccl"}]),
                 "rules.all_reduce.2[0].backend", known=["mpi", "gloo"])


@pytest.mark.parametrize("margin", ["1.5", None, [1], {"x": 1}])
def test_non_numeric_margin(margin):
    msg = expect_error(doc_with(rules=[{"max_bytes": None, "backend": "mpi", "margin": margin}]),
                       "rules.all_reduce.2[0].margin")
    assert "number" in msg


@pytest.mark.parametrize("margin", [0, 3, 1.25])
def test_numeric_margin_and_note_accepted(margin):
    t = TuningTable.from_dict(doc_with(rules=[{"max_bytes": None, "backend": "mpi", "margin": margin,
                                               "note": "measured"}]), KNOWN)
    assert t.lookup("all_reduce", 2, 1) == "mpi"


def test_error_in_later_op_names_that_op():
    d = copy.deepcopy(TABLE)
    d["rules"]["all_to_all"]["4"][0]["backend"] = "ucx"
    expect_error(d, "rules.all_to_all.4[0].backend")


# -- known but not live ----------------------------------------------------------------------
def test_known_but_not_live_backend_warns_and_looks_up_none():
    with pytest.warns(UserWarning, match=r"\['nccl'\] are not live"):
        t = TuningTable.from_dict(copy.deepcopy(TABLE), KNOWN, live=["mpi", "gloo"])
    assert t.lookup("all_reduce", 2, 1024) == "mpi"
    assert t.lookup("all_reduce", 2, 2048) == "gloo"
    assert t.lookup("all_reduce", 2, 65537) is None          # nccl range: no decision
    assert t.lookup("all_to_all", 4, 512) == "mpi"
    assert t.lookup("all_to_all", 4, 513) is None


def test_known_but_not_live_warning_from_file_names_file(tmp_path):
    path = write(tmp_path, json.dumps(TABLE))
    with pytest.warns(UserWarning, match=re.escape(path)):
        t = TuningTable.load(path, KNOWN, live={"mpi": object(), "gloo": object()})  # a dict of live backends
    assert t.lookup("all_reduce", 8, 10**9) == "gloo"
    assert t.lookup("all_reduce", 2, 10**9) is None


def test_all_live_no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TuningTable.from_dict(copy.deepcopy(TABLE), KNOWN, live=KNOWN)


# -- round trip --------------------------------------------------------------------------------
def as_v2(doc, device="cpu"):
    """A version 1 document in the current format, its rules for ``device``."""
    return {**doc, "format": FORMAT, "rules": {device: doc["rules"]}}


def probe_points(t):
    out = {}
    for op in SELECT_OPS:
        for g in (1, 2, 3, 4, 8, 16):
            for n in (0, 1, 100, 101, 512, 513, 1000, 1001, 1024, 1025, 4096, 4097,
                      65536, 65537, 10**9):
                out[op, g, n] = t.lookup(op, g, n)
            out[op, g, "distinct"] = t.distinct_backends(op, g)
    return out


def test_round_trip_save_load(tmp_path):
    t = table()
    path = str(tmp_path / "out.json")
    t.save(path)
    u = TuningTable.load(path, KNOWN)
    assert u.to_dict() == t.to_dict()
    assert u.metadata == t.metadata
    assert probe_points(u) == probe_points(t)
    assert json.loads(open(path, encoding="utf-8").read()) == as_v2(TABLE)  # written in the current format


def test_round_trip_keeps_not_live_backends(tmp_path):
    with pytest.warns(UserWarning):
        t = TuningTable.from_dict(copy.deepcopy(TABLE), KNOWN, live=["mpi", "gloo"])
    path = str(tmp_path / "out.json")
    t.save(path)
    assert json.loads(open(path, encoding="utf-8").read()) == as_v2(TABLE)   # names kept, not nulled
    u = TuningTable.load(path, KNOWN)
    assert u.lookup("all_reduce", 2, 65537) == "nccl"


def test_round_trip_table_built_directly(tmp_path):
    rules = {"all_reduce": {2: [{"max_bytes": 10, "backend": "mpi"},
                                {"max_bytes": None, "backend": "gloo"}]},
             "p2p": {4: [{"max_bytes": None, "backend": "mpi"}]}}
    t = TuningTable({"cpu": rules}, {"who": "test"})
    d = t.to_dict()
    assert d == {"format": FORMAT, "metadata": {"who": "test"},
                 "rules": {"cpu": {"all_reduce": {"2": rules["all_reduce"][2]}, "p2p": {"4": rules["p2p"][4]}}}}
    path = str(tmp_path / "direct.json")
    t.save(path)
    u = TuningTable.load(path, KNOWN)
    assert u.to_dict() == d
    assert probe_points(u) == probe_points(t)


# -- regressions found in review ---------------------------------------------------------------
def test_non_utf8_file_is_a_tuning_table_error(tmp_path):
    p = tmp_path / "latin1.json"
    p.write_bytes(b'{"format": "mcrdl-tuning/1", "metadata": {"host": "n\xe9ud"}, "rules": {}}')
    with pytest.raises(TuningTableError, match=re.escape(str(p))):
        TuningTable.load(str(p), KNOWN)


def test_superscript_group_size_key_is_a_tuning_table_error():
    expect_error(doc_with(gsize="\u00b2", rules=[{"max_bytes": None, "backend": "mpi"}]),
                 "rules.all_reduce.\u00b2")


def test_duplicate_group_size_after_normalisation_rejected():
    d = {"format": FORMAT_V1, "rules": {"all_reduce": {
        "2": [{"max_bytes": None, "backend": "mpi"}],
        "02": [{"max_bytes": None, "backend": "gloo"}]}}}
    expect_error(d, "rules.all_reduce.02")


def test_bool_margin_rejected():
    expect_error(doc_with(rules=[{"max_bytes": None, "backend": "mpi", "margin": True}]),
                 "rules.all_reduce.2[0].margin")


# -- the example in docs/tuning-table.md ------------------------------------------------------
def test_docs_example_loads_and_matches_text():
    import pathlib

    doc = pathlib.Path(__file__).resolve().parents[1] / "docs" / "tuning-table.md"
    if not doc.exists():
        pytest.skip("docs/tuning-table.md not present")
    text = doc.read_text(encoding="utf-8")
    block = re.search(r"```json\n(.*?)```", text, re.S).group(1)
    known = KNOWN + ["mpi_staged"]
    t = TuningTable.from_dict(json.loads(block), known, source="example")
    assert t.devices() == ["cpu", "cuda"]
    assert [t.lookup("all_reduce", 8, n, "cuda") for n in (16384, 16385, 4194304, 4194305)] == \
        ["mpi_staged", "mpi", "mpi", "nccl"]
    assert [t.lookup("all_reduce", 8, n) for n in (20000, 65536, 65537)] == ["mpi", "mpi", "gloo"]
    assert t.lookup("all_reduce", 4, 65536, "cuda") == "mpi_staged"
    assert t.lookup("all_reduce", 4, 65537, "cuda") == "nccl"
    assert t.lookup("all_reduce", 32, 20000, "cuda") == "mpi"
    assert t.lookup("all_gather", 2, 10, "cuda") == "mpi_staged" and t.lookup("all_gather", 2, 10) is None
    with pytest.warns(UserWarning):
        u = TuningTable.from_dict(json.loads(block), known, ["mpi", "gloo"])
    assert u.lookup("all_reduce", 8, 20000, "cuda") == "mpi"
    assert t.distinct_backends("all_to_all", 16, "cuda") == 2
    assert u.distinct_backends("all_to_all", 16, "cuda") == 1  # mpi_staged and nccl not live: one "none"


# -- version 2: rules per device type ------------------------------------------------------------
def test_v2_rules_per_device():
    cuda = {"all_reduce": {"2": [{"max_bytes": 4096, "backend": "mpi"}, {"max_bytes": None, "backend": "nccl"}]}}
    doc = {"format": FORMAT, "rules": {"cpu": copy.deepcopy(TABLE["rules"]), "cuda": cuda}}
    t = TuningTable.from_dict(copy.deepcopy(doc), KNOWN)
    assert t.devices() == ["cpu", "cuda"]
    v1 = TuningTable.from_dict(copy.deepcopy(TABLE), KNOWN)
    assert probe_points(t) == probe_points(v1)  # the cpu rules answer exactly as the v1 file did
    assert [t.lookup("all_reduce", 2, n, "cuda") for n in (4, 4096, 4097)] == ["mpi", "mpi", "nccl"]
    assert [t.lookup("all_reduce", 2, n) for n in (4, 4096, 4097)] == ["mpi", "gloo", "gloo"]
    assert t.lookup("broadcast", 4, 8, "cuda") is None  # no cuda rules for broadcast
    assert t.distinct_backends("all_reduce", 2, "cuda") == 2
    assert t.rules_for("all_reduce", 8, "cuda") == cuda["all_reduce"]["2"]
    assert t.to_dict() == doc


def test_v1_loads_as_cpu_rules_only():
    t = TuningTable.from_dict(copy.deepcopy(TABLE), KNOWN)
    assert t.devices() == ["cpu"]
    assert t.lookup("all_reduce", 2, 4) == "mpi"
    assert t.lookup("all_reduce", 2, 4, "cuda") is None
    assert t.to_dict() == as_v2(TABLE)


def test_v2_table_without_rules_answers_nothing():
    t = TuningTable.from_dict({"format": FORMAT, "rules": {}}, KNOWN)
    assert t.devices() == [] and t.lookup("all_reduce", 2, 4) is None


@pytest.mark.parametrize("rules,key,words", [
    ({"gpu": {}}, "rules.gpu", "unknown device type (expected one of cpu, cuda)"),
    ({"all_reduce": {"2": []}}, "rules.all_reduce", "e.g. rules.cpu.all_reduce"),
    ({"cuda": []}, "rules.cuda", "expected an object mapping op names"),
    ({"cuda": {"all_reduce": {"2": [{"max_bytes": 1, "backend": "mpi"}, {"max_bytes": 1, "backend": "gloo"}]}}},
     "rules.cuda.all_reduce.2[1].max_bytes", "not above the previous rule's 1"),
    ({"cuda": {"all_reduce": {"2": [{"max_bytes": None, "backend": "bogus"}]}}},
     "rules.cuda.all_reduce.2[0].backend", "unknown backend 'bogus'"),
])
def test_v2_errors_name_the_device_level(rules, key, words):
    with pytest.raises(TuningTableError) as err:
        TuningTable.from_dict({"format": FORMAT, "rules": rules}, KNOWN, source="t.json")
    assert f"t.json: {key}: " in str(err.value) and words in str(err.value), str(err.value)


@pytest.mark.parametrize("op", ["all_to_all", "broadcast", "p2p"])
def test_a_rule_naming_a_backend_for_an_op_it_lacks_is_refused(op):
    """shm has only all_reduce: a table sending it anything else is an error at
    load, naming the rule (it would otherwise warn nothing and fall through)."""
    from mcrdl.backends import REGISTRY

    rules = {"cpu": {op: {"2": [{"max_bytes": 64, "backend": "shm"}, {"max_bytes": None, "backend": "mpi"}]}}}
    with pytest.raises(TuningTableError, match=rf"t.json: rules.cpu.{op}.2\[0\].backend: backend 'shm' has no "
                                               rf"{op} \(it has all_reduce\)"):
        TuningTable.from_dict({"format": FORMAT, "rules": rules}, REGISTRY, source="t.json")
    rules["cpu"]["all_reduce"] = rules["cpu"].pop(op)
    assert TuningTable.from_dict({"format": FORMAT, "rules": rules}, REGISTRY).lookup("all_reduce", 2, 8) == "shm"


def test_named_backends_both_formats():
    from mcrdl.tuning import named_backends

    assert named_backends(TABLE) == {"mpi", "gloo", "nccl"}
    assert named_backends(as_v2(TABLE, "cuda")) == {"mpi", "gloo", "nccl"}
    assert named_backends({"format": FORMAT, "rules": {"cpu": [1], "cuda": {"x": 3}}}) == set()
