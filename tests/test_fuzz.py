"""Fuzzing the parsers of files and arguments a user hands to mcrdl (issue 8).

Parsers: tuning tables (``TuningTable.load`` / ``from_dict``), model
descriptions (``load_config`` / ``config_from_dict``), bench results
(``bench.load_json``, ``CostModel.from_bench``), logger exports
(``model.load_log``, then ``compare``) and the bench/tune size and count
arguments.

Property, for every parser and any input: it returns a valid object, or it
raises its own error (a ``ValueError``; argparse's usage error for the CLI)
whose message starts with the file (``<table>`` etc. for a dict) and, for a
mutation of a valid document, names the key path at fault. Never a raw
KeyError/TypeError/AttributeError/IndexError/RecursionError/OverflowError or
JSONDecodeError, never a silent default for an invalid value, never an unknown
key accepted. Inputs: valid documents (examples, recorded results) with one
mutation (key dropped, unknown key, value of another JSON type, edge value:
NaN/inf/huge/negative numbers, huge strings, deep nesting), random JSON,
random bytes, truncated text, non-UTF-8 bytes. Deterministic
(``derandomize=True``) and bounded (``max_examples`` below).
"""
import argparse
import contextlib
import copy
import io
import json
import math
import os
import tempfile
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Callable, Optional

import pytest
from hypothesis import assume, given, settings, strategies as st

from mcrdl import cli
from mcrdl.tools import bench
from mcrdl.tools.model import CostModel, ModelConfigError, compare, config_from_dict, load_config, load_log
from mcrdl.tools.model.config import Config
from mcrdl.backends import REGISTRY
from mcrdl.tuning import SELECT_OPS, TuningTable, TuningTableError

ROOT = Path(__file__).parents[1]
KNOWN = tuple(REGISTRY)
INT64_MAX = 2 ** 63 - 1
# MCRDL_FUZZ_SCALE=20 fuzzes 20 times longer (still deterministic).
SCALE = float(os.environ.get("MCRDL_FUZZ_SCALE", "1"))
FUZZ = settings(max_examples=int(500 * SCALE), derandomize=True, deadline=None, database=None)
FUZZ_SMALL = settings(max_examples=int(200 * SCALE), derandomize=True, deadline=None, database=None)

# Exceptions that must never come out of a parser. JSONDecodeError and
# UnicodeDecodeError are ValueErrors, so they are checked by type, not caught.
RAW = (json.JSONDecodeError, UnicodeDecodeError)


@pytest.fixture(scope="module")
def workdir():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


# -- documents and mutations ------------------------------------------------------------------
def walk(node, path=()):
    """Every (path, value) of a JSON document, the root included."""
    yield path, node
    if isinstance(node, dict):
        for k, v in node.items():
            yield from walk(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from walk(v, path + (i,))


def dotted(path) -> str:
    """("rules", "all_reduce", "2", 0, "max_bytes") -> rules.all_reduce.2[0].max_bytes"""
    out = ""
    for k in path:
        out += f"[{k}]" if isinstance(k, int) else (f".{k}" if out else str(k))
    return out


def named(path) -> str:
    """The key path an error must name: list indices at the end are the
    list's business (``parallel.order[1]`` -> ``parallel.order``)."""
    path = list(path)
    while path and isinstance(path[-1], int):
        path.pop()
    return dotted(path)


def put(doc, path, value):
    """doc with the value at path replaced (the root when path is empty)."""
    if not path:
        return value
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    return doc


def drop(doc, path):
    node = doc
    for k in path[:-1]:
        node = node[k]
    del node[path[-1]]
    return doc


def kind(v) -> str:
    """JSON type, ints and floats together (a number field takes both)."""
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}[type(v)]


def nested(depth: int, leaf=1):
    for i in range(depth):
        leaf = [leaf] if i % 2 else {"k": leaf}
    return leaf


EDGE = [None, True, False, 0, -1, 1, 0.5, -0.0, 2 ** 31, INT64_MAX, INT64_MAX + 1, 2 ** 64, 10 ** 30,
        -10 ** 30, 10 ** 400, -10 ** 400, 1e308, 5e-324, math.nan, math.inf, -math.inf, "", "x" * 5000,
        "\u00e9\u2603", [], {}, [None], {"": None}, nested(60)]
NUMBERS = [0, -1, 1, 3, 0.5, -0.0, 2 ** 31, INT64_MAX, INT64_MAX + 1, 10 ** 30, -10 ** 30, 10 ** 400, 1e308,
           1e154, 1e-154, 1e-300, 5e-324, math.nan, math.inf, -math.inf]
OTHER_TYPE = {"bool": [True, False], "string": ["", "x", "mpi", "1", "x" * 5000],
              "number": [0, -1, 7, 0.5, -2.5, INT64_MAX + 1, 10 ** 400, math.nan, math.inf],
              "array": [[], [1], [[]], ["mpi"]], "object": [{}, {"k": 1}, {"max_bytes": None}]}
json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.sampled_from(EDGE[:24]),
                        st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
json_value = st.recursive(json_scalar, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=10), kids, max_size=4)), max_leaves=16)


@dataclass
class Format:
    """One parser: valid seed documents, how to load a file or a dict, the
    error it raises, what a loaded object must satisfy, and the schema facts
    the mutations need."""
    name: str
    seeds: list
    load_file: Callable[[str], Any]
    load_doc: Optional[Callable[[Any], Any]]
    doc_source: str
    error: type
    check: Callable[[Any], None]
    free: Callable[[tuple], bool]  # no validation at or below this path (metadata)
    open_keys: Callable[[tuple], bool]  # this object's keys are the user's (names)
    required: Callable[[tuple], bool]  # removing this key must fail


def loaded_or_error(fmt: Format, call: Callable[[], Any], source: str):
    """Run a parser: its object (checked), or its error (checked). Any other
    exception fails the test."""
    try:
        obj = call()
    except fmt.error as exc:
        msg = str(exc)
        assert not isinstance(exc, RAW), f"raw {type(exc).__name__}: {msg}"
        assert msg.startswith(f"{source}:"), f"error does not name {source}: {msg[:300]}"
        assert len(msg) < 500, f"error message of {len(msg)} characters: {msg[:300]}"
        return exc
    fmt.check(obj)
    return obj


def run_doc(fmt: Format, doc, where: str, path_hint: Optional[str] = None, must_fail=False,
            workdir: Optional[Path] = None):
    """Load ``doc`` as a dict (when the parser takes one) and as a JSON file;
    both must agree on success vs error."""
    outcomes = []
    if fmt.load_doc is not None:
        outcomes.append((fmt.doc_source, loaded_or_error(fmt, lambda: fmt.load_doc(copy.deepcopy(doc)),
                                                         fmt.doc_source)))
    if workdir is not None:
        path = workdir / f"{fmt.name}.json"
        path.write_text(json.dumps(doc), encoding="utf-8")
        outcomes.append((str(path), loaded_or_error(fmt, lambda: fmt.load_file(str(path)), str(path))))
    for source, out in outcomes:
        if must_fail:
            assert isinstance(out, Exception), f"{where}: accepted"
        if isinstance(out, Exception) and path_hint is not None:
            assert path_hint in str(out), f"{where}: error does not name {path_hint}: {out}"
    assert len({isinstance(o, Exception) for _, o in outcomes}) <= 1, f"{where}: dict and file disagree"


def mutate_and_load(fmt: Format, data, workdir: Path):
    """One seed, one mutation; where the mutation makes the document invalid
    (unknown key, another type, a required key dropped) it must be refused,
    naming the key."""
    doc = copy.deepcopy(data.draw(st.sampled_from(fmt.seeds), label="seed"))
    nodes = [(p, v) for p, v in walk(doc) if not (p and fmt.free(p))]
    how = data.draw(st.sampled_from(["unknown key", "drop", "other type", "edge", "random", "deep", "numbers",
                                     "extreme"]), label="how")
    if how == "unknown key":
        objs = [p for p, v in nodes if isinstance(v, dict)]
        path = data.draw(st.sampled_from(objs), label="object")
        value = data.draw(json_value, label="value")
        put(doc, path + ("zz_unknown",), value)
        strict = not fmt.open_keys(path)
        run_doc(fmt, doc, f"unknown key at {dotted(path + ('zz_unknown',))}",
                named(path + ("zz_unknown",)) if strict else None, must_fail=strict, workdir=workdir)
        return
    if how == "numbers":  # several at once: a fit needs two bad points, a product two big factors
        for path, v in nodes:
            if kind(v) == "number" and data.draw(st.integers(0, 3), label="change") == 0:
                put(doc, path, data.draw(st.sampled_from(NUMBERS), label="number"))
        run_doc(fmt, doc, "numbers replaced", workdir=workdir)
        return
    if how == "extreme":  # one field everywhere: valid-looking (>= 0, finite) but of any magnitude
        name = data.draw(st.sampled_from(sorted({p[-1] for p, v in nodes if p and isinstance(p[-1], str)
                                                  and kind(v) == "number"})), label="field")
        for path, v in nodes:
            if path and path[-1] == name and kind(v) == "number":
                put(doc, path, data.draw(st.integers(0, INT64_MAX) if isinstance(v, int) else
                                         st.floats(0, allow_infinity=False), label="number"))
        run_doc(fmt, doc, f"every {name} replaced", workdir=workdir)
        return
    keyed = [p for p, _ in nodes if p and not isinstance(p[-1], int)]
    if how == "drop":
        path = data.draw(st.sampled_from(keyed), label="key")
        drop(doc, path)
        req = fmt.required(path)
        run_doc(fmt, doc, f"{dotted(path)} dropped", named(path[:-1]) if req else None, must_fail=req,
                workdir=workdir)
        return
    path = data.draw(st.sampled_from([p for p, _ in nodes]), label="path")
    old = dict(nodes)[path] if path else doc
    if how == "other type" and old is not None:
        new = data.draw(st.sampled_from([v for k, vs in OTHER_TYPE.items() if k != kind(old) for v in vs]),
                        label="value")
        run_doc(fmt, put(doc, path, new), f"{dotted(path)} = {str(new)[:40]}", named(path),
                must_fail=True, workdir=workdir)
        return
    new = {"edge": st.sampled_from(EDGE), "deep": st.integers(1, 80).map(nested)}.get(how, json_value)
    doc = put(doc, path, data.draw(new, label="value"))
    run_doc(fmt, doc, f"{dotted(path)} replaced", workdir=workdir)


def garbage_file(fmt: Format, data, workdir: Path):
    """Bytes that are not a valid document: truncated, random, non-UTF-8, deep."""
    text = json.dumps(data.draw(st.sampled_from(fmt.seeds), label="seed"), indent=1).encode()
    how = data.draw(st.sampled_from(["truncate", "bytes", "non-utf8", "deep", "splice"]), label="how")
    if how == "truncate":
        blob = text[:data.draw(st.integers(0, len(text) - 1), label="cut")]
    elif how == "bytes":
        blob = data.draw(st.binary(max_size=200), label="bytes")
    elif how == "non-utf8":
        at = data.draw(st.integers(0, len(text)), label="at")
        bad = data.draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80abc"]), label="bad")
        blob = text[:at] + bad + text[at:]
    elif how == "deep":
        depth = data.draw(st.sampled_from([1_000, 100_000]), label="depth")
        blob = data.draw(st.sampled_from([b"[" * depth, b'{"a":' * depth, b"[" * depth + b"]" * depth]))
    else:
        at = data.draw(st.integers(0, len(text)), label="at")
        piece = data.draw(st.sampled_from([b"NaN", b"1" * 5000, b"\x00", b",", b"}", b"1e999"]), label="piece")
        blob = text[:at] + piece + text[at:]
    path = workdir / f"{fmt.name}.bin"
    path.write_bytes(blob)
    out = loaded_or_error(fmt, lambda: fmt.load_file(str(path)), str(path))
    try:
        blob.decode()
    except UnicodeDecodeError:
        assert "not UTF-8 text" in str(out), out


# -- tuning tables ------------------------------------------------------------------------------
def check_table(table: TuningTable):
    assert set(table.rules) <= {"cpu", "cuda"}
    for device, op, by_size in ((d, op, by) for d, by_op in table.rules.items() for op, by in by_op.items()):
        assert op in SELECT_OPS and by_size
        for g, rules in by_size.items():
            assert type(g) is int and 0 < g <= INT64_MAX
            assert rules
            prev = -1
            for i, r in enumerate(rules):
                assert set(r) <= {"max_bytes", "backend", "margin", "note"}
                mb = r["max_bytes"]
                assert (mb is None and i == len(rules) - 1) or (type(mb) is int and prev < mb <= INT64_MAX)
                prev = mb if mb is not None else prev
                assert r["backend"] in KNOWN
                if "margin" in r:
                    assert type(r["margin"]) in (int, float) and math.isfinite(r["margin"])
                if "note" in r:
                    assert isinstance(r["note"], str)
            for n in (0, 1, 4096, INT64_MAX):
                assert table.lookup(op, g, n, device) in KNOWN
    assert isinstance(table.metadata, dict)
    TuningTable.from_dict(copy.deepcopy(table.to_dict()), KNOWN)


DOCS_TABLE = {"format": "mcrdl-tuning/1", "metadata": {"hosts": ["node01"], "world_size": 16},
              "rules": {"all_reduce": {"2": [{"max_bytes": 65536, "backend": "mpi", "note": "latency bound"},
                                              {"max_bytes": None, "backend": "nccl"}],
                                        "8": [{"max_bytes": 16384, "backend": "mpi"},
                                              {"max_bytes": 4194304, "backend": "gloo", "margin": 1.15},
                                              {"max_bytes": None, "backend": "nccl"}]},
                        "p2p": {"2": [{"max_bytes": 8192, "backend": "mpi"},
                                      {"max_bytes": None, "backend": "gloo"}]}}}

TABLE = Format(
    "table",
    [json.loads((ROOT / "examples/tables/example.json").read_text()),
     json.loads((ROOT / "docs/results/tuning-2ranks.json").read_text()), DOCS_TABLE],
    lambda p: TuningTable.load(p, KNOWN), lambda d: TuningTable.from_dict(d, KNOWN), "<table>",
    TuningTableError, check_table,
    free=lambda p: p[0] == "metadata" and len(p) > 1,
    open_keys=lambda p: p == ("metadata",),
    required=lambda p: p in (("format",), ("rules",)) or (len(p) in (5, 6) and p[-1] in ("max_bytes", "backend")))


# -- model descriptions -------------------------------------------------------------------------
def check_config(cfg: Config):
    for part in (cfg.model, cfg.layout, cfg.cluster, cfg.compute, cfg.model.moe):
        for f in fields(part) if part is not None else ():
            v = getattr(part, f.name)
            if isinstance(v, bool) or v is None or isinstance(v, (str, tuple)):
                continue
            if isinstance(v, int):
                assert 0 <= v <= INT64_MAX, (f.name, v)
            elif isinstance(v, float):
                assert math.isfinite(v), (f.name, v)
    assert isinstance(cfg.name, str)
    assert sorted(cfg.layout.order) == ["data", "pipeline", "tensor"]
    for ab in cfg.alpha_beta.values():
        assert math.isfinite(ab.alpha_us) and ab.alpha_us >= 0
        assert math.isfinite(ab.bandwidth_gbps) and ab.bandwidth_gbps > 0
    assert cfg.layout.world == cfg.cluster.world_size


def _config_seeds():
    seeds = [json.loads(p.read_text()) for p in sorted((ROOT / "examples/model").glob("*.json"))]
    seeds[0] = {**seeds[0], "alpha_beta": {"nccl": {"alpha_us": 10, "bandwidth_gbps": 100.5}}}
    return seeds


_MODEL_REQUIRED = {"layers", "hidden", "heads", "seq_length", "vocab", "micro_batch", "global_batch"}
CONFIG = Format(
    "config", _config_seeds(), load_config, config_from_dict, "<config>", ModelConfigError, check_config,
    free=lambda p: False,
    open_keys=lambda p: p == ("alpha_beta",),
    required=lambda p: (p == ("model",) or (len(p) == 2 and p[0] == "model" and p[1] in _MODEL_REQUIRED)
                        or p == ("model", "moe", "experts") or (len(p) == 3 and p[0] == "alpha_beta")))


# -- bench results ------------------------------------------------------------------------------
def check_bench(out):
    results, fitted = out
    for r in results:
        assert isinstance(r, bench.Result)
        assert r.op in bench.BENCH_OPS and isinstance(r.variant, str) and isinstance(r.backend, str)
        assert type(r.bytes) is int and 0 <= r.bytes <= INT64_MAX
        assert type(r.iters) is int and type(r.rounds) is int and r.iters >= 1 and r.rounds >= 1
        for v in (r.avg_us, r.min_us, r.max_us, r.algbw_gbps, r.busbw_gbps, *r.round_max_us):
            assert type(v) in (int, float) and math.isfinite(v) and v >= 0
        assert r.check in ("ok", "FAIL", "skipped")
    for fit in fitted.fits.values():
        for v in (fit.alpha_step_us, fit.beta_step_us, fit.rel_rms):
            assert math.isfinite(v) and v >= 0, fit


def _bench_seed(name):
    doc = json.loads((ROOT / "docs/results" / name).read_text())
    doc["results"] = [r for r in doc["results"] if r["op"] in ("all_reduce", "all_to_all")
                      and r["bytes"] in (4, 1024, 65536)]
    return doc


_RESULT_REQUIRED = {"op", "bytes", "variant", "backend", "iters", "rounds", "avg_us", "min_us", "max_us"}
BENCH = Format(
    "bench", [_bench_seed("bench-2ranks.json"), _bench_seed("tune-sweep-2ranks.json")],
    lambda p: (bench.load_json(p)[0], CostModel.from_bench(p)),
    lambda d: (bench.from_doc(d)[0], CostModel.from_bench(d)), "<bench>", ValueError, check_bench,
    free=lambda p: p[0] == "metadata" and len(p) > 1 and p[1] not in ("world_size", "hosts"),
    open_keys=lambda p: p == ("metadata",),
    required=lambda p: (p in (("format",), ("results",), ("metadata",), ("metadata", "world_size"))
                        or (len(p) == 3 and p[0] == "results" and p[2] in _RESULT_REQUIRED)))


# -- logger exports -----------------------------------------------------------------------------
LOG_CFG = {"model": {"layers": 2, "hidden": 64, "heads": 4, "seq_length": 16, "vocab": 128,
                     "micro_batch": 2, "global_batch": 8},
           "parallel": {"pipeline": 1, "tensor": 1, "data": 2}, "cluster": {"world_size": 2}}


def _log_seed(rank: int):
    recs = [{"seq": 0, "op": "all_reduce", "backend": "mpi", "group": "world", "ranks": [0, 1],
             "nbytes": 4096, "async_op": False, "start": 0.5, "end": 0.75, "root": -1, "counts": None},
            {"seq": 1, "op": "all_to_all_single", "backend": "gloo", "group": "g1", "ranks": [0, 1],
             "nbytes": 64, "async_op": True, "start": 1.0, "end": -1.0, "root": -1, "counts": [32, 32]},
            {"seq": 2, "op": "isend", "backend": "mpi", "group": "world", "ranks": [0, 1],
             "nbytes": 8, "async_op": True, "start": 2.0, "end": 2.5, "root": 1 - rank, "counts": None}]
    return {"rank": rank, "world_size": 2, "wall_start": 1700000000.0, "records": recs}


def check_log(docs):
    rows = compare_or_error(docs)
    for r in rows:
        for v in (r.meas_count, r.meas_bytes, r.meas_s):
            assert math.isfinite(v)


def compare_or_error(docs):
    try:
        return compare(config_from_dict(LOG_CFG), docs)
    except ValueError as exc:
        assert not isinstance(exc, RAW)
        assert str(exc).startswith("the log has"), exc
        return []


_RECORD_REQUIRED = {"seq", "op", "backend", "group", "ranks", "nbytes", "async_op", "start"}
LOG = Format(
    "records_rank0", [_log_seed(0), _log_seed(1)], load_log, None, "", ValueError, check_log,
    free=lambda p: False, open_keys=lambda p: False,
    required=lambda p: (p in (("rank",), ("world_size",), ("records",))
                        or (len(p) == 3 and p[0] == "records" and p[2] in _RECORD_REQUIRED)))

FORMATS = [TABLE, CONFIG, BENCH, LOG]


def test_seeds_are_valid(workdir):
    for fmt in FORMATS:
        for doc in fmt.seeds:
            path = workdir / f"{fmt.name}.json"
            path.write_text(json.dumps(doc))
            fmt.check(fmt.load_file(str(path)))
            if fmt.load_doc:
                fmt.check(fmt.load_doc(copy.deepcopy(doc)))


# -- the fuzzers --------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@FUZZ
@given(data=st.data())
def test_mutated_documents(fmt, data, workdir):
    mutate_and_load(fmt, data, workdir)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@FUZZ_SMALL
@given(data=st.data())
def test_garbage_files(fmt, data, workdir):
    garbage_file(fmt, data, workdir)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@FUZZ_SMALL
@given(doc=json_value)
def test_random_documents(fmt, doc, workdir):
    run_doc(fmt, doc, "random document", workdir=workdir)


# -- bench/tune arguments -----------------------------------------------------------------------
size_text = st.one_of(
    st.text(max_size=12),
    st.text(alphabet="0123456789.kKmMgGbB eE+-_,", max_size=10),
    st.sampled_from(["inf", "nan", "-4", "1e400", "0.5", "1.1M", "4:64M", "", "b", "9" * 5000,
                     "9223372036854775808", "8G", "1.5k"]))


@FUZZ
@given(text=size_text)
def test_size_argument(text):
    try:
        n = cli._size(text)
    except argparse.ArgumentTypeError as exc:
        assert repr(text)[:12] in str(exc) and len(str(exc)) < 300, exc
        return
    assert type(n) is int and 0 <= n <= INT64_MAX


COUNT_OPTIONS = {"--iters": 1, "--large-iters": 1, "--rounds": 1, "--step": 1, "--warmup": 0, "-n": 1}


@FUZZ
@given(command=st.sampled_from(["bench", "tune"]),
       option=st.sampled_from(["--sizes", "--max-bytes", *COUNT_OPTIONS]),
       text=st.one_of(size_text, st.integers(-3, 3).map(str)))
def test_sweep_arguments(command, option, text):
    """Each option either parses to a usable value or is refused by argparse
    naming the option; the sizes list is parsed up front, not mid-run."""
    assume(text != "--")  # argparse (3.11) itself turns "--opt=--" into [] without calling the type
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = cli.parser().parse_args([command, f"{option}={text}"])
    except SystemExit as exc:
        assert exc.code == 2
        err = err.getvalue()
        assert f"argument {option}" in err or "argument -n/--nprocs" in err, err
        return
    if option == "--sizes":
        assert all(type(s) is int and 0 <= s <= INT64_MAX for s in args.sizes)
    elif option == "--max-bytes":
        assert type(args.max_bytes) is int and 4 <= args.max_bytes <= INT64_MAX
    else:
        value = getattr(args, "nprocs" if option == "-n" else option[2:].replace("-", "_"))
        assert type(value) is int and value >= COUNT_OPTIONS[option]



# -- regressions: the smallest inputs the fuzzers found, one case each ---------------------------
# The comment says what happened before; each now raises the parser's error naming file and key.
PARSERS = {"table": lambda p: TuningTable.load(p, KNOWN), "config": load_config,
           "bench": bench.load_json, "fit": CostModel.from_bench,
           "log": lambda p: compare(config_from_dict(LOG_CFG), load_log(p)),
           "model --table": lambda p: CostModel.defaults().load_table(p)}


@pytest.mark.parametrize("parser, content, message", [
    ("table", b"[" * 100_000, "JSON nested too deeply"),  # RecursionError
    ("config", b'{"model": ' * 100_000, "JSON nested too deeply"),  # RecursionError
    ("fit", b"[" * 100_000, "JSON nested too deeply"),  # RecursionError
    ("log", b"[" * 100_000, "JSON nested too deeply"),  # RecursionError
    ("model --table", b"[" * 100_000, "JSON nested too deeply"),  # RecursionError
    ("bench", b"1" * 5000, "a JSON number has more than 4300 digits"),  # ValueError naming no file
    ("config", b"\x80", "byte 0: not UTF-8 text"),  # UnicodeDecodeError
    ("bench", b"\x80", "byte 0: not UTF-8 text"),  # UnicodeDecodeError
    ("log", b"\x80", "byte 0: not UTF-8 text"),  # UnicodeDecodeError
    ("bench", b"", ":1:1: malformed JSON"),  # JSONDecodeError naming no file
    ("bench", b"0", "(top level): expected a JSON object, got int"),  # AttributeError: no .get
    ("bench", b"null", "(top level): expected a JSON object, got NoneType"),  # AttributeError: no .get
])
def test_regression_files(parser, content, message, workdir):
    path = workdir / "regression.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as info:
        PARSERS[parser](str(path))
    assert not isinstance(info.value, RAW)
    assert str(info.value).startswith(str(path)) and message in str(info.value), info.value


def _with(doc, edit):
    doc = copy.deepcopy(doc)
    edit(doc)
    return doc


def _bench_doc(**result):
    """Two forced-backend results (a fit needs two sizes); ``result`` updates
    the second (None drops a key)."""
    rs = [{"op": "all_reduce", "bytes": n, "variant": "mpi", "backend": "mpi", "iters": 1, "rounds": 1,
           "avg_us": t, "min_us": t, "max_us": t} for n, t in ((4, 5.0), (4096, 9.0))]
    rs[1] = {k: v for k, v in {**rs[1], **result}.items() if v is not None}
    return {"format": "mcrdl-bench/1", "metadata": {"world_size": 2, "hosts": ["h"]}, "results": rs}


TABLE_DOC = TABLE.seeds[0]
CONFIG_DOC = json.loads((ROOT / "examples/model/gpt_small.json").read_text())
LOG_DOC = _log_seed(0)


def _rule(**kw):
    return _with(TABLE_DOC, lambda d: d["rules"]["cpu"]["all_reduce"]["2"][0].update(kw))


def _section(name, **kw):
    return _with(CONFIG_DOC, lambda d: d[name].update(kw))


def _record(**kw):
    return _with(LOG_DOC, lambda d: d["records"][0].update(kw))


def _log(**kw):
    return _with(LOG_DOC, lambda d: d.update(kw))


@pytest.mark.parametrize("parser, doc, message", [
    # tuning tables
    ("table", _rule(note=5), "rules.cpu.all_reduce.2[0].note: expected a string"),  # accepted
    ("table", _rule(margin=math.nan), "rules.cpu.all_reduce.2[0].margin: expected a finite number"),  # accepted
    ("table", _rule(margin=10 ** 400), "rules.cpu.all_reduce.2[0].margin: expected a finite number"),  # accepted
    ("table", _rule(max_bytes=2 ** 63), "rules.cpu.all_reduce.2[0].max_bytes: expected a non-negative"),  # accepted
    ("table", _with(TABLE_DOC, lambda d: d["rules"]["cpu"]["all_to_all"].update({"1" * 5000: []})),
     "rules.cpu.all_to_all.111"),  # ValueError: Exceeds the limit (4300 digits), naming no file
    ("table", _with(TABLE_DOC, lambda d: d.update(format="x" * 5000)),
     "format: expected 'mcrdl-tuning/2' (or 'mcrdl-tuning/1'), got 'xxx"),  # a 5000-character message
    # model descriptions
    ("config", _with(CONFIG_DOC, lambda d: d.update(comment=True)), "comment: expected a string"),  # accepted
    ("config", _section("compute", peak_tflops=10 ** 400),
     "compute.peak_tflops: expected a finite number"),  # OverflowError: int too large to convert to float
    ("config", _section("parallel", order=["tensor", 1, "pipeline"]),
     "parallel.order: expected a permutation"),  # TypeError: '<' between int and str
    ("config", _section("model", vocab=2 ** 63), "model.vocab: must be <= 9223372036854775807"),  # accepted
    ("config", _section("model", layers="x" * 5000),
     "model.layers: expected an integer, got 'xxx"),  # a 5000-character message
    # bench results (bench.load_json took every field as it came: Result(**r)) and their fit
    ("fit", _bench_doc(variant=True), "results[1].variant: expected a variant name"),  # AttributeError
    ("fit", _bench_doc(op=[]), "results[1].op: expected one of all_reduce"),  # TypeError: unhashable
    ("fit", _bench_doc(max_us="9"), "results[1].max_us: expected a finite number >= 0"),  # skipped, a note
    ("bench", _bench_doc(round_max_us=True), "results[1].round_max_us: expected a list"),  # accepted
    ("bench", _bench_doc(check=True), "results[1].check: expected 'ok', 'FAIL' or 'skipped'"),  # accepted
    ("bench", _bench_doc(iters=True), "results[1].iters: expected an integer >= 1"),  # accepted
    ("bench", _bench_doc(speed=1), "results[1].speed: unknown key"),  # TypeError: unexpected keyword
    ("bench", _bench_doc(max_us=None), "results[1].max_us: required"),  # TypeError: missing argument
    ("fit", _with(_bench_doc(), lambda d: d.update(results=True)), "results: expected a list"),  # TypeError
    ("fit", _with(_bench_doc(), lambda d: d.update(metadata=True)),
     "metadata: expected an object"),  # AttributeError
    ("fit", _with(_bench_doc(), lambda d: d["metadata"].update(hosts=[True])),
     "metadata.hosts: expected a list of host names"),  # TypeError in str.join
    ("fit", _with(_bench_doc(), lambda d: d["metadata"].update(hosts=False)),
     "metadata.hosts: expected a list of host names"),  # accepted
    ("fit", _with(_bench_doc(), lambda d: d.update(extra=1)), "extra: unknown key"),  # accepted
    ("fit", _bench_doc(max_us=5e-324), "all_reduce on mpi: times from 4.94066e-324 to 5 us"),  # NaN fit
    ("fit", _with(_bench_doc(max_us=1e200), lambda d: d["results"][0].update(max_us=1e200)),
     "all_reduce on mpi: times from 1e+200 to 1e+200 us"),  # ZeroDivisionError
    ("fit", _bench_doc(max_us=1e308), "all_reduce on mpi: times from 5 to 1e+308 us"),  # OverflowError
    # logger exports: load_log, then compare (where the old errors came from)
    ("log", _with(LOG_DOC, lambda d: d["records"][0].pop("start")), "records[0].start: required"),  # KeyError
    ("log", _record(start={"k": 1}), "records[0].start: expected a finite number"),  # TypeError
    ("log", _record(ranks=[[0]]), "records[0].ranks: expected a list of ranks"),  # TypeError: unhashable
    ("log", _record(backend=True), "records[0].backend: expected a backend name"),  # TypeError in str.join
    ("log", _record(op=[]), "records[0].op: expected an op name"),  # TypeError: unhashable
    ("log", _record(group=1), "records[0].group: expected a group name"),  # accepted
    ("log", _log(records=[True]), "records[0]: expected an object"),  # AttributeError
    ("log", _log(rank=""), "rank: expected an integer from 0 to 1"),  # ValueError: int('')
    ("log", _log(rank=[]), "rank: expected an integer from 0 to 1"),  # TypeError: int([])
    ("log", _log(world_size={}), "world_size: expected an integer >= 1"),  # TypeError: unhashable
    ("log", _log(wall_start="x"), "wall_start: expected a finite number"),  # accepted
])
def test_regression_documents(parser, doc, message, workdir):
    path = workdir / "regression.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError) as info:
        PARSERS[parser](str(path))
    msg = str(info.value)
    assert not isinstance(info.value, RAW)
    assert msg.startswith(f"{path}: ") and message in msg and len(msg) < 300, msg


def test_regression_duplicate_rank_in_log(workdir):
    """Two files of one rank were both counted (the averages silently off)."""
    d = workdir / "log"
    d.mkdir(exist_ok=True)
    for r in (0, 1):
        (d / f"records_rank{r}.json").write_text(json.dumps(LOG_DOC))
    with pytest.raises(ValueError, match=r"records_rank1.json: rank: rank 0 is also in .*records_rank0.json"):
        load_log(str(d))


@pytest.mark.parametrize("text", ["inf", "1e400", "nan", "", "x", "4:64M", "-4", "0.3k", "9" * 5000])
def test_regression_size(text):
    """inf, 1e400: OverflowError; nan, "", x, 4:64M, 9...9: a ValueError naming no
    option; -4: accepted; 0.3k: truncated to 307."""
    with pytest.raises(argparse.ArgumentTypeError, match="invalid size"):
        cli._size(text)


@pytest.mark.parametrize("argv, message", [
    (["bench", "--iters=0"], "argument --iters: expected an integer >= 1, got '0'"),  # the default instead
    (["tune", "--rounds=-1"], "argument --rounds: expected an integer >= 1"),  # StatisticsError mid-run
    (["bench", "--max-bytes=0"], "argument --max-bytes: invalid size '0'"),  # the default instead
    (["bench", "--max-bytes=2"], "argument --max-bytes: invalid size '2': expected a whole number of "
                                 "bytes >= 4"),  # an empty sweep
    (["bench", "--step=0"], "argument --step: expected an integer >= 1"),  # accepted
    (["tune", "-n=0"], "argument -n/--nprocs: expected an integer >= 1"),  # accepted
    (["bench", "--warmup=-1"], "argument --warmup: expected an integer >= 0"),  # accepted
    (["bench", "--sizes=4,64K,x"], "argument --sizes: invalid size 'x'"),  # ValueError once the ranks ran
    (["explain", "all_reduce", "inf"], "argument nbytes: invalid size 'inf'"),  # OverflowError
])
def test_regression_arguments(argv, message):
    err = io.StringIO()
    with pytest.raises(SystemExit), contextlib.redirect_stderr(err):
        cli.parser().parse_args(argv)
    assert message in err.getvalue(), err.getvalue()
