"""The reference for the compiled tensor facts (csrc/tensor_facts.cpp): what
``key``, ``pair``, ``span`` and ``plan_key`` must answer, written plainly in
Python; tests/test_facts.py holds the compiled ones to it on the same tensors.
The runtime never calls these: without the compiled module no call is planned
(ops.general runs them all)."""
from typing import Optional, Sequence

import torch

from mcrdl.facts import KEY, P2P, PAIRED, PAIRED_REDUCED, REDUCED, ROOTED, ROOTED_REDUCED  # noqa: F401
from mcrdl.types import ReduceOp

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


_SUM = ReduceOp.SUM


def plan_key(recipe: int, at: int, tensors: tuple, fixed: tuple):
    """What a call's plan is keyed on, by ``recipe``; None: the call takes the general path."""
    if recipe >= PAIRED:
        if recipe == P2P:
            if type(fixed[0]) is not int or type(fixed[1]) is not int:
                return None
            kind = key(tensors[at])
            return None if kind is None else (kind, fixed[0], fixed[1])
        if recipe == PAIRED_REDUCED and not _plannable(fixed[-1]):
            return None
        both = pair(tensors[1], tensors[0])
        if both is None or (recipe == PAIRED_REDUCED and both[1] is torch.bool):
            return None
        return _with_reduction(both, fixed[-1]) if recipe == PAIRED_REDUCED else both
    reduced, rooted = recipe in (REDUCED, ROOTED_REDUCED), recipe in (ROOTED, ROOTED_REDUCED)
    if (reduced and not _plannable(fixed[-1])) or (rooted and type(fixed[0]) is not int):
        return None
    kind = key(tensors[at])
    if kind is None or (reduced and kind[1] is torch.bool):
        return None
    found = (kind, fixed[0]) if rooted else kind
    return _with_reduction(found, fixed[-1]) if reduced else found


def _plannable(op) -> bool:
    """A member of ReduceOp (by identity: a torch ReduceOp or a name takes the general path)."""
    return any(op is r for r in ReduceOp)


def _with_reduction(found, op):
    """The key, with the reduction when it is not SUM (the starter is made for it)."""
    return found if op is _SUM else (found, op)


