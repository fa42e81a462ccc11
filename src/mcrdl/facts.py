"""The facts an op's plans are keyed on (ops.py), read from the tensors in one
call: :func:`plan_key` (from :func:`key`, :func:`pair`), :func:`span`; and
the memory an async op touches, checked against every op in flight
(work.py, program order): :func:`ranges`.

These are the pure-Python versions. :func:`load` returns the same functions
compiled from csrc/ against the installed torch (one call, no attribute
reads from Python: 60-240 ns each here, 5 to 20 per call), built once per
machine into mcrdl's cache (:mod:`mcrdl.compiled`), together with the
compiled driver of calls that run from a plan (``drive``, see ops.py);
without a C++ compiler, when the build fails, or with ``MCRDL_NATIVE=0``
these run instead, with the same results (tests/test_facts.py checks both on
the same tensors). The compiled module also holds ``Beats``, the watchdog's
heartbeat thread that never takes the GIL (watchdog.py falls back to its own
thread without it).
A tensor qualifies when it is a strided, contiguous CPU tensor, not nested,
with storage and no Python dispatch (wrapper subclasses take the general path).
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
from .types import ReduceOp

#: the compiled module's sources: csrc/module.cpp, which includes the others
CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
SOURCE = os.path.join(CSRC, "module.cpp")
MODULE = "mcrdl_facts"
BUILD_TIMEOUT_S = 600

_PLAIN = torch.Tensor.__torch_dispatch__  # subclasses that define their own dispatch to Python


def _usable(t) -> bool:
    return (isinstance(t, torch.Tensor) and type(t).__torch_dispatch__ is _PLAIN and t.layout is torch.strided
            and t.is_cpu and not t.is_nested and torch._C._has_storage(t) and t.is_contiguous())


def key(t) -> Optional[tuple]:
    """(nbytes, dtype) of a qualifying tensor, else None."""
    return (t.nbytes, t.dtype) if _usable(t) else None


def pair(a, b) -> Optional[tuple]:
    """(a's nbytes, dtype, shape, b's nbytes, dtype, shape) of two qualifying
    tensors that share no byte, else None."""
    if not (_usable(a) and _usable(b)):
        return None
    pa, pb, na, nb = a.data_ptr(), b.data_ptr(), a.nbytes, b.nbytes
    if pa < pb + nb and pb < pa + na:
        return None
    return na, a.dtype, tuple(a.shape), nb, b.dtype, tuple(b.shape)


def span(parts: Sequence, n: int, dtype: torch.dtype, nbytes: int, apart=None) -> Optional[int]:
    """The address of ``parts[0]`` when ``parts`` is a list or tuple of ``n``
    qualifying tensors of ``dtype`` and ``nbytes`` bytes each, none requiring
    grad, lying back to back in memory (``x.chunk(n)`` makes them) and sharing
    no byte with the qualifying tensor ``apart`` (when given); else None."""
    if type(dtype) is not torch.dtype:
        raise TypeError("span: dtype must be a torch.dtype")
    if type(parts) not in (list, tuple) or n < 1 or len(parts) != n:
        return None
    base = None
    for i, t in enumerate(parts):
        if not _usable(t) or t.dtype is not dtype or t.nbytes != nbytes or t.requires_grad:
            return None
        at = t.data_ptr()
        if base is None:
            base = at
        elif at != base + i * nbytes:
            return None
    if apart is not None:
        if not _usable(apart):
            return None
        at = apart.data_ptr()
        if at < base + n * nbytes and base < at + apart.nbytes:
            return None
    return base


#: What a plan is keyed on (an op's ``recipe``; csrc/tensor_facts.cpp numbers them alike).
#: KEY: ``key(tensors[at])``; REDUCED: that, for a SUM that is not of bools
#: (those are mapped: the general path); ROOTED: ``(key, fixed[0])`` for an int
#: root; ROOTED_REDUCED: both; PAIRED: ``pair(tensors[1], tensors[0])``;
#: PAIRED_REDUCED: that, for a SUM not of bools; P2P: ``(key, peer, tag)`` for int ones.
RECIPES = ("KEY", "REDUCED", "ROOTED", "ROOTED_REDUCED", "PAIRED", "PAIRED_REDUCED", "P2P")
KEY, REDUCED, ROOTED, ROOTED_REDUCED, PAIRED, PAIRED_REDUCED, P2P = range(len(RECIPES))
_SUM = ReduceOp.SUM


def plan_key(recipe: int, at: int, tensors: tuple, fixed: tuple):
    """What a call's plan is keyed on, by ``recipe``; None: the call takes the general path."""
    if recipe >= PAIRED:
        if recipe == P2P:
            if type(fixed[0]) is not int or type(fixed[1]) is not int:
                return None
            kind = key(tensors[at])
            return None if kind is None else (kind, fixed[0], fixed[1])
        if recipe == PAIRED_REDUCED and fixed[-1] is not _SUM:
            return None
        both = pair(tensors[1], tensors[0])
        return None if both is None or (recipe == PAIRED_REDUCED and both[1] is torch.bool) else both
    reduced, rooted = recipe in (REDUCED, ROOTED_REDUCED), recipe in (ROOTED, ROOTED_REDUCED)
    if (reduced and fixed[-1] is not _SUM) or (rooted and type(fixed[0]) is not int):
        return None
    kind = key(tensors[at])
    if kind is None or (reduced and kind[1] is torch.bool):
        return None
    return (kind, fixed[0]) if rooted else kind


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
    "key": "facts.key", "pair": "facts.pair", "plan_key": "facts.plan_key", "span": "facts.span",
    "ranges": "facts.ranges",
    "drive": "ops.run as api.run_op, the driver every API call goes through (calls from a plan)",
    "setup": "what drive reads, given by ops.driver",
    "finished": "work._finished, Work.wait's common case",
    "adopt": "MPI's compiled starters and Request type, which drive and finished use",
    "adopt_starter": "another backend's compiled starter, which drive starts (shm's)",
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
