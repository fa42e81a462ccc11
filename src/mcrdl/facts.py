"""The compiled module of mcrdl's hot path, and what it is keyed on.

:func:`load` returns the module built from csrc/ against the installed torch,
once per machine into mcrdl's cache (:mod:`mcrdl.compiled`): the compiled
driver of calls that run from a plan (``drive``, see ops.py) and the facts it
keys plans on, read from a call's tensors (``plan_key``, from ``key`` and
``pair``; ``span``: csrc/tensor_facts.cpp, held by tests/test_facts.py to the
plain Python of tests/facts_reference.py); the engine's lock, Work tracking
and wait (csrc/engine.cpp); ``TorchMethod`` (csrc/torch_method.cpp); and
``Beats``, the watchdog's heartbeat thread that never takes the GIL. Without a
C++ compiler, when the build fails, or with ``MCRDL_NATIVE=0``, :func:`load`
returns this module: then no call is planned (ops.general runs every call),
and :func:`ranges` here gives the memory an async op touches, checked against
every op in flight (work.py, program order).
A tensor qualifies for a plan when it is a strided, contiguous CPU tensor, not
nested, with storage and no Python dispatch (wrapper subclasses take the
general path).
"""
from __future__ import annotations

import functools
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from types import ModuleType
from typing import Optional, Sequence

import torch

from . import compiled, settings

#: the compiled module's sources: csrc/module.cpp, which includes the others
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCE = os.path.join(CSRC, "module.cpp")
MODULE = "mcrdl_facts"
BUILD_TIMEOUT_S = 600

#: What a plan is keyed on (an op's ``recipe``; csrc/tensor_facts.cpp numbers them alike).
#: KEY: ``key(tensors[at])``; REDUCED: that, for a SUM that is not of bools
#: (those are mapped: the general path); ROOTED: ``(key, fixed[0])`` for an int
#: root; ROOTED_REDUCED: both; PAIRED: ``pair(tensors[1], tensors[0])``;
#: PAIRED_REDUCED: that, for a SUM not of bools; P2P: ``(key, peer, tag)`` for int ones.
RECIPES = ("KEY", "REDUCED", "ROOTED", "ROOTED_REDUCED", "PAIRED", "PAIRED_REDUCED", "P2P")
KEY, REDUCED, ROOTED, ROOTED_REDUCED, PAIRED, PAIRED_REDUCED, P2P = range(len(RECIPES))

def extent(t: torch.Tensor) -> tuple[int, int]:
    """Byte range [start, end) of memory a tensor may touch."""
    if t.is_contiguous():
        nbytes = t.nbytes
        start = t.data_ptr() if nbytes else 0
        return (start, start + nbytes)
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    reach = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    return (start, start + reach * t.element_size())


def ranges(reads: Sequence[torch.Tensor], writes: Sequence[torch.Tensor]) -> tuple:
    """``(low, high, ranges)``: (device, start, end, written) for every tensor
    an op touches (a tensor it writes is not listed again as read), and the
    lowest start and highest end over them, which rule most ops out at once.
    (The compiled one returns None for what is not a strided tensor with
    storage and no Python dispatch: this one runs then.)"""
    spans = [(t.device, *extent(t), True) for t in writes]
    spans += [(t.device, *extent(t), False) for t in reads if not any(t is w for w in writes)]
    if not spans:
        return (0, 0, spans)
    return (min(r[1] for r in spans), max(r[2] for r in spans), spans)


def load() -> ModuleType:
    """The compiled functions, or this module (the reason is in :func:`status`)."""
    return _load()[0]


def status() -> str:
    """One line: are the fast paths' tensor checks compiled, and if not, why."""
    return _load()[1]


def cxx() -> Optional[list[str]]:
    """The C++ compiler: $CXX, Python's build configuration's, else c++ or g++ on PATH;
    its program as a full path (the cache key must not depend on the working directory)."""
    for candidate in (os.environ.get("CXX"), sysconfig.get_config_var("CXX")):
        words = shlex.split(candidate or "")
        found = words and shutil.which(words[0])
        if found:
            return [found, *words[1:]]
    found = shutil.which("c++") or shutil.which("g++")
    return [found] if found else None


def build_target(compiler: list[str]) -> str:
    """The cached module's path: keyed by every file of csrc/ (module.cpp as the source,
    the files it includes by their digests), the compiler, torch and Python."""
    parts = sorted(os.path.join(CSRC, name) for name in os.listdir(CSRC)
                   if name.endswith(".cpp") and os.path.join(CSRC, name) != SOURCE)
    return compiled.target("facts", MODULE, SOURCE, (os.path.realpath(compiler[0]), torch.__version__,
                                                     os.path.dirname(torch.__file__), sys.version,
                                                     *map(compiled.digest, parts)))


@functools.cache  # (module, status line), once per process
def _load() -> tuple:
    here = sys.modules[__name__]
    if not settings.get("MCRDL_NATIVE"):
        return here, "off (MCRDL_NATIVE=0): pure Python"
    compiler = cxx()
    if compiler is None:
        return here, "no C++ compiler (set CXX): pure Python"
    root = os.path.dirname(torch.__file__)
    target = build_target(compiler)
    if not os.path.exists(target):
        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        cmd = [*compiler, "-O2", "-shared", "-fPIC", "-std=c++20", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               "-I" + sysconfig.get_paths()["include"], "-I" + os.path.join(root, "include"),
               "-I" + os.path.join(root, "include", "torch", "csrc", "api", "include"), SOURCE,
               "-L" + os.path.join(root, "lib"), "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
               "-Wl,-rpath," + os.path.join(root, "lib")]
        try:
            compiled.build(cmd, target, BUILD_TIMEOUT_S)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            return here, f"build failed ({str(exc).splitlines()[0][:200]}): pure Python"
    try:
        module = compiled.load(MODULE, target)
    except ImportError as exc:
        return here, f"cannot load {target} ({exc}): pure Python"
    check_bindings(module, target)
    return module, f"compiled ({target})"


#: What the compiled module provides, by name, and the Python each stands in for:
#: a build that lacks one, or numbers the recipes otherwise, is refused at load (an
#: error naming it, never a silent pure-Python fallback). ``mcrdl info`` prints them.
BINDINGS = {
    "key": "a tensor's (nbytes, dtype) for a plan", "pair": "two tensors' facts for a plan",
    "plan_key": "what a call's plan is keyed on", "span": "the address of a list's blocks back to back",
    "ranges": "facts.ranges",
    "drive": "api.run_op, the driver every API call goes through (the calls that run from a plan)",
    "setup": "what drive reads of mcrdl.ops, by name (ops.driver)",
    "finished": "work._finished, Work.wait's common case",
    "adopt_work": "what track and finished read of work.py (Work's slots, checked by name)",
    "adopt_starter": "a backend's compiled starter, which drive starts, and its request type, which finished completes",
    "RLock": "threading.RLock as the engine's lock",
    "Beats": "the watchdog's heartbeat thread (watchdog.py)",
    "TorchMethod": "ProcessGroupMCRDL's common methods and MCRDLTorchWork.wait (TORCH_METHODS)",
    "RECIPES": "the recipe names of this module, in its numbering",
    "TORCH_METHODS": "the torch methods TorchMethod serves, by name",
}
#: What this process runs compiled in place of its Python (python name -> compiled part),
#: recorded where each is put in place; ``mcrdl info`` lists them.
IN_PLACE: dict = {}


def check_bindings(module: ModuleType, where: str) -> None:
    """Refuse a compiled module that lacks a binding of :data:`BINDINGS` or numbers
    the recipes otherwise than :data:`RECIPES` (a RuntimeError naming which)."""
    missing = [name for name in BINDINGS if not hasattr(module, name)]
    if missing:
        raise RuntimeError(f"{where}: the compiled module lacks {', '.join(missing)} (csrc/ and facts.BINDINGS "
                           "disagree: rebuild, or edit both)")
    if tuple(module.RECIPES) != RECIPES:
        raise RuntimeError(f"{where}: the compiled recipes are {module.RECIPES}, facts.py's {RECIPES}")


def provided(python: str, native: str) -> None:
    """Note that ``native`` now runs in place of ``python`` (:data:`IN_PLACE`)."""
    IN_PLACE[python] = native
