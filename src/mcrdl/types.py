"""Public value types and errors shared by the API, selector and backends."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

import torch


class ReduceOp(enum.Enum):
    """Reduction operators, as in ``torch.distributed.ReduceOp``."""

    SUM = "sum"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"
    AVG = "avg"

    @classmethod
    def coerce(cls, op: Any) -> "ReduceOp":
        """Accept an mcrdl ReduceOp, a torch ``ReduceOp`` or its name."""
        if isinstance(op, cls):
            return op
        name = getattr(op, "name", None) or str(op).rsplit(".", 1)[-1]
        try:
            return cls[name.upper()]
        except KeyError:
            raise ValueError(f"unknown reduce op {op!r}; expected one of {[m.name for m in cls]}") from None


ReduceOp.__hash__ = object.__hash__  # members are singletons: identity hash, no Python call


class CommError(RuntimeError):
    """A communication operation failed; the message names op and backend."""


class CommTimeoutError(CommError, TimeoutError):
    """A communication operation did not complete before its deadline."""


class PeerDiedError(CommError):
    """A member of the op's group died (the watchdog saw its process end)."""


class UnsupportedError(CommError, TypeError):
    """A backend cannot run this op/dtype/device combination correctly."""


@dataclass
class P2POp:
    """One point-to-point operation for :func:`mcrdl.batch_isend_irecv`."""

    op: Any  # mcrdl.isend or mcrdl.irecv
    tensor: torch.Tensor
    peer: int
    group: Optional[Any] = None
    tag: int = 0
    backend: Optional[str] = None
