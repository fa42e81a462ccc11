"""Building and loading mcrdl's compiled helpers (backends/mpi_native.c,
csrc/): each is compiled once per machine into a cache directory keyed by
everything the binary depends on, then loaded from there.

One process compiles while the others wait on a lock file (``flock``: the
kernel drops it when its holder dies, so it cannot go stale) and then load
its module, or fall back with it when its build failed (the next job tries
again). The module is written to a private file and renamed into place, so
no process ever loads a partial one. Callers fall back to pure Python when a
build fails.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.machinery
import importlib.util
import os
import subprocess
import tempfile
from typing import Iterable

from . import settings


def cache_dir() -> str:
    """``$MCRDL_CACHE``, else ``$XDG_CACHE_HOME/mcrdl`` or ``~/.cache/mcrdl``."""
    return settings.get("MCRDL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mcrdl")


def digest(path: str) -> str:
    """The sha256 of a file's bytes (a source a module includes, for its key)."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def target(kind: str, module: str, source: str, depends_on: Iterable[str]) -> str:
    """The cached module's path, keyed by ``source``'s bytes and ``depends_on``."""
    with open(source, "rb") as f:
        key = hashlib.sha256(f.read())
    for part in depends_on:
        key.update(part.encode())
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    return os.path.join(cache_dir(), kind, key.hexdigest()[:16], module + suffix)


def build(cmd: list[str], target: str, timeout: float) -> None:
    """Run ``cmd + ["-o", file]`` and move the file to ``target`` unless
    another process built it meanwhile; raises RuntimeError on failure."""
    folder = os.path.dirname(target)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:  # another process is building: wait for it
            fcntl.flock(lock, fcntl.LOCK_EX)
            waited = True
        if os.path.exists(target):
            return
        if waited:  # (not again: each waiting rank would compile in turn)
            raise RuntimeError("the build another process ran at the same time failed")
        fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
        os.close(fd)
        try:
            done = subprocess.run(cmd + ["-o", tmp], capture_output=True, text=True, timeout=timeout)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr.strip()}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def load(module: str, target: str):
    """Import the extension module at ``target`` (ImportError if it cannot)."""
    spec = importlib.util.spec_from_file_location(module, target)
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded
