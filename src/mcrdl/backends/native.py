"""The compiled MPI hot path (mpi_native.c): built once per machine with the
MPI compiler of the library mpi4py runs on, cached, loaded by the MPI backend
(see :mod:`mcrdl.compiled`).

``MCRDL_NATIVE=0`` turns it off; without a compiler, or when the built module
links a different MPI than mpi4py's, the pure-Python path runs instead (same
results; :func:`status` says which and why).
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import sysconfig
from typing import Optional

from .. import compiled, settings
from ..types import CommError
from ..work import DONE

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mpi_native.c")
MODULE = "mcrdl_mpi_native"
BUILD_TIMEOUT_S = 120


def mpicc() -> Optional[str]:
    """The MPI C compiler: $MPICC, the one beside this Python (the mpich
    wheel's), mpi4py's build configuration, else ``mpicc`` on PATH; a full path
    where it is found (the cache key must not depend on the working directory)."""
    import mpi4py

    beside = os.path.join(os.path.dirname(sys.executable), "mpicc")
    for candidate in (os.environ.get("MPICC"), beside if os.path.exists(beside) else None,
                      mpi4py.get_config().get("mpicc"), shutil.which("mpicc")):
        if candidate:
            return shutil.which(candidate) or candidate
    return None


def _target(cc: str, mpi_version: str) -> str:
    """Cached module path, keyed by everything the binary depends on."""
    import mpi4py

    return compiled.target("native", MODULE, SOURCE,
                           (os.path.realpath(cc), mpi_version, sys.version, mpi4py.__version__))


def build(cc: str, target: str) -> None:
    """Compile mpi_native.c into ``target``; raises on failure."""
    import mpi4py

    compiled.build([cc, "-O2", "-shared", "-fPIC", "-I" + sysconfig.get_paths()["include"],
                    "-I" + mpi4py.get_include(), SOURCE], target, BUILD_TIMEOUT_S)


def load():
    """The native module, or None (the reason is in :func:`status`)."""
    return _load()[0]


def status() -> str:
    """One line: is the compiled hot path in use, and if not, why."""
    return _load()[1]


@functools.cache  # (module, status line), once per process
def _load() -> tuple:
    if not settings.get("MCRDL_NATIVE"):
        return None, "off (MCRDL_NATIVE=0): pure-Python path"
    from .mpi import import_mpi

    mpi_version = import_mpi().Get_library_version()
    cc = mpicc()
    if cc is None:
        return None, "no MPI C compiler (set MPICC): pure-Python path"
    target = _target(cc, mpi_version)
    if not os.path.exists(target):
        try:
            build(cc, target)
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            return None, f"build failed ({str(exc).splitlines()[0]}): pure-Python path"
    try:
        module = compiled.load(MODULE, target)
    except ImportError as exc:
        return None, f"cannot load {target} ({exc}): pure-Python path"
    if module.library_version() != mpi_version:
        return None, f"{cc} builds for another MPI than mpi4py's: pure-Python path"
    module.setup(CommError, DONE)
    return module, f"compiled ({target})"
