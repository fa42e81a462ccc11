"""mcrdl.settings: every MCRDL_* variable declared once and read only there, the docs'
table generated from it, and a bad value named with what it accepts."""
import re
from pathlib import Path

import pytest

from mcrdl import backends, settings  # (each library's module declares its own settings)

SRC = Path(settings.__file__).parent
DOCS = Path(__file__).parents[1] / "docs" / "settings.md"
#: a read of an MCRDL_ variable: os.environ.get / os.getenv / os.environ[...] / "... in os.environ"
READ = re.compile(r"""(environ\s*(\.get\s*\(|\[)|getenv\s*\()\s*f?["']MCRDL_|["']MCRDL_\w*["']\s+(not\s+)?in\s+os\.environ""")


def test_no_module_but_settings_reads_an_mcrdl_variable():
    readers = [f"{path.relative_to(SRC)}:{n}" for path in SRC.rglob("*.py") if path.name != "settings.py"
               for n, line in enumerate(path.read_text().splitlines(), 1) if READ.search(line)]
    assert not readers, readers
    assert READ.search('x = os.environ.get("MCRDL_DEBUG", "0")') and READ.search("os.getenv('MCRDL_X')")


def test_every_variable_named_in_the_source_is_declared():
    named = {m for path in SRC.rglob("*.py") for m in re.findall(r"\bMCRDL_[A-Z0-9_]*[A-Z0-9]", path.read_text())}
    assert named - set(settings.SETTINGS) == set()
    assert set(settings.SETTINGS) - named == set()  # (named in settings.py itself at least)


def test_the_docs_page_is_generated_from_the_declarations():
    assert DOCS.read_text() == settings.page(), "regenerate it: mcrdl settings > docs/settings.md"
    assert len(re.findall(r"^\| `MCRDL_", DOCS.read_text(), re.M)) == len(settings.SETTINGS)


@pytest.mark.parametrize("name, text, value", [
    ("MCRDL_DEBUG", "1", True), ("MCRDL_DEBUG", "", False), ("MCRDL_FROZEN_S", "2.5", 2.5),
    ("MCRDL_AUTOTUNE_CALLS", "7", 7), ("MCRDL_FUSION_BUCKET_BYTES", "64K", 65536),
    ("MCRDL_WAIT", "spin", "spin"), ("MCRDL_MPI_CUDA_AWARE", "0", False)])
def test_values_parse_by_kind(monkeypatch, name, text, value):
    monkeypatch.setenv(name, text)
    assert settings.get(name) == value


@pytest.mark.parametrize("name, text, accepts", [
    ("MCRDL_WATCHDOG", "yes", "0 or 1"), ("MCRDL_HEARTBEAT_S", "-1", "seconds >= 0"),
    ("MCRDL_HEARTBEAT_S", "nan", "seconds >= 0"), ("MCRDL_FROZEN_S", "inf", "seconds >= 0"),
    ("MCRDL_AUTOTUNE_CALLS", "0", "an integer >= 1"), ("MCRDL_AUTOTUNE_DRIFT", "1", "0 (off) or a window"),
    ("MCRDL_FUSION_POOL_BYTES", "0", "a positive byte count"), ("MCRDL_FUSION_POOL_BYTES", "lots", "a positive")])
def test_a_bad_value_names_the_variable_and_what_it_accepts(monkeypatch, name, text, accepts):
    monkeypatch.setenv(name, text)
    with pytest.raises(ValueError, match=re.escape(f"{name}: expected {accepts}") + f".*got {text!r}"):
        settings.get(name)


def test_a_library_declares_its_own_settings_in_its_module():
    """A library is one module: its settings are declared there, not in settings.py."""
    own = {"MCRDL_MPI_CUDA_AWARE": "mpi.py", "MCRDL_MPI_RS_ALLTOALL": "mpi.py", "MCRDL_CCL_LIB": "ccl_lib.py",
           "MCRDL_CCL_LIBFABRIC": "ccl_lib.py"}
    for name, module in own.items():
        assert name in settings.SETTINGS and name in (SRC / "backends" / module).read_text()
        assert name not in (SRC / "settings.py").read_text()
    with pytest.raises(ValueError, match="MCRDL_DEBUG is declared twice"):
        settings.declare(settings.Setting("MCRDL_DEBUG", "flag", True, "another"))
    settings.declare(settings.SETTINGS["MCRDL_DEBUG"])  # (the same declaration again is fine)
    assert backends.REGISTRY


def test_unknown_names_are_refused():
    with pytest.raises(KeyError, match="MCRDL_NOPE is not an mcrdl setting"):
        settings.get("MCRDL_NOPE")
