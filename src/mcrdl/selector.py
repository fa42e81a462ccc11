"""Which backend runs an operation.

Precedence: ``backend=`` on the call, the static per-op map, the tuning
table (its rules for the device type of the op's tensors), the default backend
(for CUDA tensors NCCL, unless a default was named). A choice that cannot run the op (device, dtype)
falls through to the next one, then to the first capable live backend in
registry order. Every input is the same on every rank of a group (the op's
size rule guarantees it, see ``docs/tuning-table.md``), so every rank picks
the same backend without talking to the others.
"""
from __future__ import annotations

from typing import Mapping, Optional

import torch

from .backends import Backend
from .tuning import CLASS_METHODS, OP_CLASS, SELECT_OPS, TuningTable
from .types import UnsupportedError


def parse_op_backends(spec: str) -> dict[str, str]:
    """Parse ``MCRDL_OP_BACKENDS`` (``all_to_all:mpi,all_reduce:gloo``)."""
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        op, sep, name = item.partition(":")
        if not sep or not op.strip() or not name.strip():
            raise ValueError(f"MCRDL_OP_BACKENDS: {item!r} is not op:backend")
        if op.strip() in out:
            raise ValueError(f"MCRDL_OP_BACKENDS: {op.strip()!r} is given twice")
        out[op.strip()] = name.strip()
    return out


class Selector:
    def __init__(self, live: Mapping[str, Backend], default: str,
                 op_backends: Optional[Mapping[str, str]] = None,
                 table: Optional[TuningTable] = None, device_defaults: Optional[Mapping[str, str]] = None):
        self.live = dict(live)
        self.default = default
        #: per device type, a default other than ``default`` (CUDA tensors: NCCL unless one was named)
        self.device_defaults = dict(device_defaults or {})
        self.table = table
        self.static: dict[str, str] = {}
        for op, name in (op_backends or {}).items():
            cls = OP_CLASS.get(op)
            if cls is None:
                raise ValueError(f"op_backends: unknown op {op!r} (expected one of {', '.join(SELECT_OPS)})")
            if name not in self.live:
                raise ValueError(f"op_backends[{op!r}]: backend {name!r} is not live in this job "
                                 f"(live: {', '.join(self.live)})")
            if self.static.get(cls, name) != name:
                raise ValueError(f"op_backends: {op!r} and another op of class {cls!r} name "
                                 f"different backends ({self.static[cls]!r}, {name!r})")
            self.static[cls] = name
        self._capable: dict[tuple, Optional[str]] = {}
        self._cache: dict[tuple, str] = {}  # full decisions, bounded

    def why_not(self, name: str, op: str, device: str, dtype: torch.dtype,
                reduce_op=None, declined: tuple = ()) -> Optional[str]:
        """Why backend ``name`` cannot run this op here, or None (cached).
        ``declined``: the ``(backend, why)`` pairs of backends that do not serve this call (its
        group's ``declined``, or ``declined_async`` for a selected async call)."""
        for n, why in declined:
            if n == name:
                return f"backend {name!r} does not serve this call: {why}"
        key = (name, op, device, dtype, reduce_op)
        try:
            return self._capable[key]
        except KeyError:
            pass
        backend = self.live.get(name)
        if backend is None:
            reason = f"backend {name!r} is not live in this job (live: {', '.join(self.live)})"
        elif device not in backend.devices and op != "barrier":  # a barrier carries no tensor
            reason = f"backend {name!r} does not take {device} tensors"
        elif not CLASS_METHODS[OP_CLASS[op]] <= backend.ops:
            reason = f"backend {name!r} has no {op} (it has {', '.join(sorted(backend.ops))})"
        else:
            reason = backend.unsupported(op, dtype, reduce_op, device)
        self._capable[key] = reason
        return reason

    def choose(self, op: str, nbytes: int, group_size: int, device: str, dtype: torch.dtype,
               reduce_op=None, explicit: Optional[str] = None, declined: tuple = ()) -> str:
        """The backend for one call (hot path: one dict lookup once seen)."""
        key = (op, nbytes, group_size, device, dtype, reduce_op, explicit, declined)
        try:
            return self._cache[key]
        except KeyError:
            pass
        except TypeError:  # an unhashable backend=
            raise TypeError(f"{op}: backend must be a backend name or None, got {explicit!r}") from None
        name = self._choose(op, nbytes, group_size, device, dtype, reduce_op, explicit, declined)
        if len(self._cache) >= 4096:
            self._cache.clear()
        self._cache[key] = name
        return name

    def _choose(self, op, nbytes, group_size, device, dtype, reduce_op, explicit, declined) -> str:
        cls = OP_CLASS[op]
        if explicit is not None:
            reason = self.why_not(explicit, op, device, dtype, reduce_op, declined)
            if reason is not None:
                raise UnsupportedError(f"{op}({dtype}, {device}) with backend={explicit!r}: {reason}")
            return explicit
        name = self.static.get(cls)
        if name is None and self.table is not None:
            name = self.table.lookup(cls, group_size, nbytes, device)
        if name is None:
            name = self.device_defaults.get(device, self.default)
        if self.why_not(name, op, device, dtype, reduce_op, declined) is None:
            return name
        return self.explain(op, nbytes, group_size, device, dtype, reduce_op, declined=declined)[0]

    def explain(self, op: str, nbytes: int, group_size: int, device: str = "cpu",
                dtype: torch.dtype = torch.float32, reduce_op=None,
                explicit: Optional[str] = None, declined: tuple = ()) -> tuple[str, str]:
        """(backend, reason): the choice and the rule that made it."""
        cls = OP_CLASS[op]
        if explicit is not None:
            return self.choose(op, nbytes, group_size, device, dtype, reduce_op, explicit, declined), \
                "backend= given on the call"
        candidates = []
        if cls in self.static:
            candidates.append((self.static[cls], f"static map: {cls} -> {self.static[cls]}"))
        if self.table is not None:
            name = self.table.lookup(cls, group_size, nbytes, device)
            if name is not None:
                learned = self.table.learned(cls, group_size, nbytes, device)
                candidates.append((name, f"tuning table {self.table.source}: {cls} on {device}, group size "
                                         f"{group_size}, {nbytes} B" + (f" ({learned})" if learned else "")))
        if device in self.device_defaults:
            candidates.append((self.device_defaults[device], f"default backend for {device} tensors"))
        candidates.append((self.default, "default backend"))
        candidates += [(n, "first live backend able to run it") for n in self.live]
        skipped, tried = [], set()
        for name, why in candidates:
            if name in tried:  # (the default is also a live backend: one reason each)
                continue
            tried.add(name)
            reason = self.why_not(name, op, device, dtype, reduce_op, declined)
            if reason is None:
                return name, why + "".join(f" (skipped {s})" for s in skipped)
            skipped.append(f"{name}: {reason}")
        raise UnsupportedError(f"{op} on {dtype} {device} tensors: no live backend can run it: "
                               + "; ".join(skipped))

    def needs_agreement(self, op: str, group_size: int, explicit: Optional[str], device: str = "cpu") -> bool:
        """Does the choice depend on a size that may differ across ranks?

        Only all-to-all with per-rank sizes, and only when the table (not an
        explicit/static choice) decides and uses more than one backend."""
        cls = OP_CLASS[op]
        return (cls == "all_to_all" and explicit is None and cls not in self.static and self.table is not None
                and self.table.distinct_backends(cls, group_size, device) > 1)
