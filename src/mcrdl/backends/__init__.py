"""Backend registry: one module per library, registered here by name.

Adding a backend = writing a :class:`~mcrdl.backends.base.Backend` subclass in
its own module and calling :func:`register_backend` (see docs/backends.md).
"""
from __future__ import annotations

from .base import OPS, Backend, BackendUnavailable, Context
from .ccl import CclBackend
from .mpi import MPIBackend
from .mpi_staged import StagedMPIBackend
from .shm import ShmBackend
from .torch_pg import GlooBackend, NCCLBackend

#: Registered backends in preference order (first capable one is the fallback).
REGISTRY: dict[str, type[Backend]] = {}


def register_backend(cls: type[Backend]) -> type[Backend]:
    """Register a backend class under ``cls.name`` (usable as a decorator)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    REGISTRY[cls.name] = cls
    return cls


# CUDA without NCCL: staged before gloo; the narrower ccl and shm after gloo (never the
# fallback while mpi or gloo is live, and ccl loads nothing until a group's first ccl op)
for _cls in (MPIBackend, NCCLBackend, StagedMPIBackend, GlooBackend, CclBackend, ShmBackend):
    register_backend(_cls)

__all__ = ["OPS", "REGISTRY", "Backend", "BackendUnavailable", "Context", "register_backend"]
