"""A library is one module: outside ``mcrdl/backends/`` no code names one.

What the runtime once knew by name (which library needs a store or an MPI
launcher, the CUDA default, the control collectives' library, the bench's
harness, the raw baselines) is each backend's declaration now (``needs``,
``default_for``, ``ops``, ``devices``, ``raw_ops``). The places below still
name libraries, each for the reason given; a new one fails this test.
"""
import ast
import io
import re
import tokenize
from collections import Counter
from pathlib import Path

from mcrdl.backends import REGISTRY

SRC = Path(__file__).parents[1] / "src" / "mcrdl"
#: every registered library's name
NAMES = set(REGISTRY)

#: (file, library) -> how many string literals there name it, and why they may
STILL_NAMED = {
    ("features/flight_recorder.py", "gloo"): (1, "torch's flight-recorder format names torch's libraries"),
    ("features/flight_recorder.py", "nccl"): (1, "torch's flight-recorder format names torch's libraries"),
    ("integrations/torch_backend.py", "gloo"): (1, "names torch reserves for its own backends"),
    ("integrations/torch_backend.py", "nccl"): (1, "names torch reserves for its own backends"),
    ("integrations/torch_backend.py", "mpi"): (1, "names torch reserves for its own backends"),
    ("tools/workloads/ddp.py", "gloo"): (1, "torch's DDP is built on a torch gloo group of its own"),
    ("tools/model/cost.py", "mpi"): (3, "the model's fits measured on this machine's libraries (data)"),
    ("tools/model/cost.py", "gloo"): (3, "the model's fits measured on this machine's libraries (data)"),
    ("tools/model/cost.py", "nccl"): (1, "the model's fits measured on this machine's libraries (data)"),
    ("tools/workloads/common.py", "gloo"): (3, "the demo's single-library baselines (a PyTorch user's default)"),
    ("tools/workloads/common.py", "mpi"): (1, "the demo's single-library baselines"),
    ("tools/workloads/common.py", "mpi_staged"): (1, "the demo's single-library baselines (CUDA)"),
}


def named_libraries(path: Path) -> list:
    """The library names string literals in ``path`` spell out exactly (docstrings
    and messages that mention one in passing are not names)."""
    quoted = re.compile(r"""['"](%s)['"]""" % "|".join(sorted(NAMES, key=len, reverse=True)))
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type != tokenize.STRING:
            continue
        if re.match(r"^[rbuRBU]*['\"]", tok.string):
            value = ast.literal_eval(tok.string)
            if value in NAMES:
                found.append(value)
        else:  # an f-string: the literals in its fields
            found += quoted.findall(tok.string)
    return found


def test_no_code_outside_backends_names_a_library():
    seen = Counter()
    for path in SRC.rglob("*.py"):
        if "backends" not in path.relative_to(SRC).parts:
            for name in named_libraries(path):
                seen[str(path.relative_to(SRC)), name] += 1
    allowed = {key: count for key, (count, _) in STILL_NAMED.items()}
    assert dict(seen) == allowed, {k: (seen.get(k, 0), allowed.get(k, 0)) for k in set(seen) | set(allowed)
                                   if seen.get(k, 0) != allowed.get(k, 0)}


def test_the_compiled_driver_names_no_library():
    """csrc/ (the compiled driver, engine and torch method) takes any backend's
    starter and request type by registration (adopt_starter), never by name."""
    quoted = re.compile(r'"(%s)[".]' % "|".join(sorted(NAMES, key=len, reverse=True)))
    named = {p.name: quoted.findall(p.read_text()) for p in (SRC / "csrc").glob("*.cpp")}
    assert named and not any(named.values()), named


def test_the_scan_sees_names_in_literals_and_fstrings(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('a = "mpi"\nb = f"{\'shm\' if x else y}"\n"""a docstring naming "gloo" in passing"""\n')
    assert named_libraries(probe) == ["mpi", "shm"]


def test_the_runtime_reads_declarations():
    """What the runtime needs of a library is declared on its class."""
    assert "launcher" in REGISTRY["mpi"].needs and "store" in REGISTRY["gloo"].needs
    assert REGISTRY["nccl"].default_for == {"cuda"}
    narrow = [n for n, cls in REGISTRY.items() if cls.ops != frozenset(REGISTRY["mpi"].ops)]
    assert "shm" in narrow and all(not REGISTRY[n].default_for for n in narrow)


def test_the_runtime_imports_no_tool():
    """The tools (bench, tune, demo, workloads, model, plots) sit above the runtime:
    nothing outside ``mcrdl/tools/`` imports them but the CLI that runs them."""
    tools = re.compile(r"^\s*(from\s+(\.+tools|mcrdl\.tools)\b|import\s+mcrdl\.tools\b|from\s+\.+\s+import\s+.*\btools\b)",
                       re.M)
    importing = sorted(str(p.relative_to(SRC)) for p in SRC.rglob("*.py")
                       if "tools" not in p.relative_to(SRC).parts and tools.search(p.read_text()))
    assert importing == ["cli.py"], importing
