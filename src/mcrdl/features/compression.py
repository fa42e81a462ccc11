"""Gradient compression for all-reduce and all-gather, on top of the public API.

A :class:`Compressor` turns a tensor into a *payload* (a list of tensors that
goes on the wire) and a *ctx* (local metadata: shape, dtype, ...), and back::

    payload, ctx = comp.compress(tensor, key=None)
    tensor_hat = comp.decompress(payload, ctx)

``compressed_all_reduce`` (SUM or AVG, in place) runs one collective:

* **summable** payloads (``NoneCompressor``, ``FP16Compressor``,
  ``BF16Compressor``) are all-reduced (SUM) as they are, in the payload dtype,
  and decompressed once (AVG divides afterwards, in the input's precision);
* other payloads (``Int8Compressor``: int8 values and float32 scales cannot be
  summed on the wire) are packed into one byte buffer, all-gathered, and every
  rank dequantizes and sums all ranks' payloads locally.

``compressed_all_gather`` all-gathers the payload and decompresses each rank's.

Wire bytes per rank for an all-reduce of ``N`` elements of ``b`` bytes on ``n``
ranks (what a ring algorithm sends; :func:`all_reduce_wire_bytes`):

==================  ==========================================  =====================
compressor          payload per rank (P)                         bytes sent per rank
==================  ==========================================  =====================
none                N*b                                          2(n-1)/n * P
fp16 / bf16         2N                                           2(n-1)/n * P
int8 (chunk c)      N + 4*ceil(N/c), padded to 8 B                (n-1) * P
==================  ==========================================  =====================

So int8 (all-gather based) beats an uncompressed float32 ring all-reduce
only while ``(n-1)(N + 4N/c) < 2(n-1)/n * 4N``, i.e. for ``n < 8 / (1 + 4/c)``
ranks (about 7 with the default chunk of 256); fp16/bf16 always halve it.

Error bounds (per element, ``x_r`` = rank r's input, ``S = sum_r x_r``,
``n`` = group size; ``Ŝ`` the result). Assumes no overflow (fp16 saturates at
65504: scale inputs whose sum can exceed it, or use bf16):

* **fp16 / bf16**: casting rounds each input with relative error at most
  ``u`` (``u = 2^-11`` fp16, ``2^-8`` bf16, round to nearest); the wire sum
  of n rounded terms (any order, any accumulation precision >= the payload's)
  adds at most ``n-1`` more roundings, so
  ``|Ŝ - S| <= γ_n * sum_r |x_r| + n * η`` with ``γ_n = n*u / (1 - n*u)`` and
  ``η`` the underflow term (``2^-25`` fp16 subnormals, ``2^-134`` bf16).
  AVG: that bound / n, plus ``ε_out * |S/n|`` (``ε_out`` = unit roundoff of
  the output dtype: ``2^-24`` float32).
* **int8** (chunk of ``c`` elements, scale ``s = max|x_chunk| / 127`` stored as
  float32): each element's dequantized value is within ``s/2`` of the input
  (round to nearest integer level), so
  ``|Ŝ - S| <= sum_r s_r/2 + n * 2^-20 * sum_r (s_r + |x_r|)`` per chunk; the
  second term covers float32 arithmetic (division, dequantization, local sum)
  and is ~1e-6 relative. AVG: that bound / n plus ``ε_out * |S/n|``. Holds for
  scales that are float32 normal numbers (``max|x_chunk| > ~1.5e-36``).
* **none**: exact as ``mcrdl.all_reduce`` (it is ``mcrdl.all_reduce``).

Outputs are cast back to the input's dtype (for fp16/bf16 inputs that cast adds
``ε_out * |Ŝ|``).

**Error feedback** (``error_feedback=True``, any lossy compressor): the
residual ``e = x' - decompress(compress(x'))`` of the compensated input
``x' = x + e_prev`` is kept per *key* and added to the next call's input with
the same key, so the error does not accumulate: after ``T`` calls the sum of
the results differs from the sum of the exact results by ``sum_r e_{r,T}``
only (bounded by one call's error), i.e. the running mean converges to the
exact value at rate ``1/T``. This holds fully for int8 (summed locally in
float32). For fp16/bf16 only the cast error is fed back: the sum on the wire
is rounded to the payload dtype again (``<= γ_{n-1} * sum_r |x_r|``) and that
rounding is not, so the mean converges to within it (in tests: bf16 mean
error 2.3e-2 with vs 5.6e-2 without, 2 ranks, 40 calls). The key is ``key=`` when given (use it when the
tensor is a fresh object each step, e.g. a new gradient), else the tensor's
storage identity ``(data_ptr, shape, dtype, device)`` (right when the same
buffer is reduced every step). Residuals are stored in float32 (float64 for
float64 inputs), one per key; :meth:`Compressor.reset` drops them. A key reused
with a different element count raises ``ValueError``.

Lossy compressors refuse integer and bool tensors (``UnsupportedError``);
``compressed_all_reduce`` takes only ``ReduceOp.SUM`` and ``ReduceOp.AVG``.
Both functions are synchronous and return None.
"""
from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union

import torch

from .. import api
from ..runtime import Group
from ..types import ReduceOp, UnsupportedError

__all__ = ["Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Int8Compressor",
           "compressed_all_reduce", "compressed_all_gather", "all_reduce_wire_bytes"]

_ALIGN = 8  # payload segments start at multiples of 8 bytes on the wire


class Ctx:
    """What decompression needs besides the payload (never sent)."""

    __slots__ = ("shape", "dtype", "device", "numel", "extra")

    def __init__(self, tensor: torch.Tensor, extra: Any = None):
        self.shape, self.dtype, self.device = tensor.shape, tensor.dtype, tensor.device
        self.numel = tensor.numel()
        self.extra = extra

    def __repr__(self) -> str:
        return f"Ctx({tuple(self.shape)}, {self.dtype}, {self.device})"


def _work_dtype(dtype: torch.dtype) -> torch.dtype:
    """Precision for residuals and local arithmetic."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Compressor:
    """Interface: ``compress(tensor, key=None) -> (payload, ctx)`` and
    ``decompress(payload, ctx) -> tensor`` (input's shape and dtype).

    Subclasses implement :meth:`encode` / :meth:`decode` (no error feedback)
    and :meth:`payload_nbytes`; the base class adds error feedback.

    * ``lossy``: refuses integer/bool inputs.
    * ``summable``: the payload is one tensor whose elementwise SUM across
      ranks decompresses to the sum of the inputs (up to the documented
      error); otherwise all-reduce all-gathers payloads and sums locally.
    """

    name = "compressor"
    lossy = True
    summable = False

    def __init__(self, error_feedback: bool = False):
        if error_feedback and not self.lossy:
            raise ValueError(f"{type(self).__name__}: error feedback needs a lossy compressor")
        self.error_feedback = bool(error_feedback)
        self._residuals: dict = {}

    def __repr__(self) -> str:
        ef = ", error_feedback=True" if self.error_feedback else ""
        return f"{type(self).__name__}({self._args()}{ef})"

    def _args(self) -> str:
        return ""

    # -- to implement ------------------------------------------------------------
    def encode(self, tensor: torch.Tensor):
        """``(payload, ctx)`` for ``tensor`` (no error feedback)."""
        raise NotImplementedError

    def decode(self, payload: Sequence[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        """The tensor a payload stands for, in the working precision (float32,
        float64 for float64 inputs), shaped as the input."""
        raise NotImplementedError

    def payload_nbytes(self, numel: int, dtype: torch.dtype) -> int:
        """Bytes of one rank's payload for ``numel`` elements of ``dtype``."""
        raise NotImplementedError

    # -- the interface -------------------------------------------------------------
    def compress(self, tensor: torch.Tensor, key=None):
        """``(payload, ctx)``: ``payload`` is a list of contiguous tensors to
        send; with error feedback the residual stored under ``key`` (see the
        module docstring) is added first and the new residual stored."""
        if self.lossy and not tensor.dtype.is_floating_point:
            raise UnsupportedError(f"{type(self).__name__}.compress: {tensor.dtype} input refused "
                                   "(lossy compressors take floating point only)")
        if not self.error_feedback:
            return self.encode(tensor)
        k = self._key(tensor, key)
        wd = _work_dtype(tensor.dtype)
        x = tensor.to(wd)
        res = self._residuals.get(k)
        if res is not None:
            if res.numel() != tensor.numel() or res.device != tensor.device:
                raise ValueError(f"{type(self).__name__}: the error-feedback residual under key "
                                 f"{key if key is not None else 'of this storage'!r} has "
                                 f"{res.numel()} elements on {res.device}, the tensor has "
                                 f"{tensor.numel()} on {tensor.device}; use one key per tensor "
                                 "or reset(key)")
            x = x + res.view(x.shape)  # new tensor: never the caller's
        payload, ctx = self.encode(x)
        ctx.dtype = tensor.dtype  # decompress to the caller's dtype
        self._residuals[k] = (x - self.decode(payload, ctx).to(wd)).reshape(-1)
        return payload, ctx

    def decompress(self, payload: Sequence[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        return self.decode(payload, ctx).to(ctx.dtype)

    def decompress_sum(self, payloads: Sequence[Sequence[torch.Tensor]], ctx: Ctx) -> torch.Tensor:
        """Sum of the decompressed payloads of every rank (working precision)."""
        out = None
        for p in payloads:
            d = self.decode(p, ctx)
            out = d.clone() if out is None else out.add_(d)
        return out

    # -- error-feedback state --------------------------------------------------------
    @staticmethod
    def _key(tensor: torch.Tensor, key):
        if key is not None:
            return ("key", key)
        return ("storage", tensor.data_ptr(), tuple(tensor.shape), tensor.dtype, str(tensor.device))

    def residual(self, tensor_or_key) -> Optional[torch.Tensor]:
        """The stored residual (flat) for a tensor's storage or an explicit key."""
        k = self._key(tensor_or_key, None) if isinstance(tensor_or_key, torch.Tensor) \
            else ("key", tensor_or_key)
        return self._residuals.get(k)

    def reset(self, key=None) -> None:
        """Drop the residual of ``key`` (a key or a tensor), or all of them."""
        if key is None:
            self._residuals.clear()
        else:
            k = self._key(key, None) if isinstance(key, torch.Tensor) else ("key", key)
            self._residuals.pop(k, None)


class NoneCompressor(Compressor):
    """No compression: the payload is the tensor itself (lossless, any dtype)."""

    name = "none"
    lossy = False
    summable = True

    def encode(self, tensor):
        return [tensor.contiguous().view(-1)], Ctx(tensor)

    def decode(self, payload, ctx):
        return payload[0].view(ctx.shape)

    def decompress(self, payload, ctx):
        return payload[0].view(ctx.shape)

    def payload_nbytes(self, numel, dtype):
        return numel * _itemsize(dtype)


class _CastCompressor(Compressor):
    wire: torch.dtype
    summable = True

    def encode(self, tensor):
        if not tensor.dtype.is_floating_point:
            raise UnsupportedError(f"{type(self).__name__}.compress: {tensor.dtype} input refused "
                                   "(lossy compressors take floating point only)")
        flat = tensor.reshape(-1)
        p = flat.to(self.wire)
        if p.numel() and p.data_ptr() == tensor.data_ptr():  # already the wire dtype: no alias
            p = p.clone()
        return [p], Ctx(tensor)

    def decode(self, payload, ctx):
        return payload[0].to(_work_dtype(ctx.dtype)).view(ctx.shape)

    def payload_nbytes(self, numel, dtype):
        return numel * 2


class FP16Compressor(_CastCompressor):
    """Cast to float16 (relative error 2^-11; saturates above 65504)."""

    name = "fp16"
    wire = torch.float16
    unit_roundoff = 2.0 ** -11
    underflow = 2.0 ** -25


class BF16Compressor(_CastCompressor):
    """Cast to bfloat16 (relative error 2^-8; float32's range)."""

    name = "bf16"
    wire = torch.bfloat16
    unit_roundoff = 2.0 ** -8
    underflow = 2.0 ** -134


class Int8Compressor(Compressor):
    """Per-chunk int8 quantization: ``q = round(x / s)``, ``s = max|x_chunk| / 127``.

    Payload: ``[q (int8, N), scales (float32, ceil(N / chunk_size))]``. Each
    element is within ``s/2`` of the input (see the module docstring)."""

    name = "int8"
    summable = False

    def __init__(self, chunk_size: int = 256, error_feedback: bool = False):
        if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
            raise ValueError(f"Int8Compressor: chunk_size must be a positive int, got {chunk_size!r}")
        super().__init__(error_feedback)
        self.chunk_size = chunk_size

    def _args(self) -> str:
        return f"chunk_size={self.chunk_size}"

    def scales(self, tensor: torch.Tensor) -> torch.Tensor:
        """The float32 per-chunk scales ``max|x_chunk| / 127`` of ``tensor``."""
        w = tensor.reshape(-1).to(_work_dtype(tensor.dtype))
        c, n = self.chunk_size, w.numel()
        full = n // c * c
        amax = w.new_empty(-(-n // c))
        if full:
            torch.amax(w[:full].view(-1, c).abs(), dim=1, out=amax[:full // c])
        if full < n:
            amax[-1] = w[full:].abs().max()
        return (amax / 127).to(torch.float32)

    def encode(self, tensor):
        if not tensor.dtype.is_floating_point:
            raise UnsupportedError(f"Int8Compressor.compress: {tensor.dtype} input refused "
                                   "(lossy compressors take floating point only)")
        wd = _work_dtype(tensor.dtype)
        w = tensor.reshape(-1).to(wd)
        scales = self.scales(w)
        c, n = self.chunk_size, w.numel()
        full = n // c * c
        safe = torch.where(scales > 0, scales, torch.ones_like(scales)).to(wd)
        q = torch.empty(n, dtype=torch.int8, device=tensor.device)
        if full:
            y = w[:full].view(-1, c) / safe[:full // c, None]
            q[:full] = y.round_().clamp_(-127, 127).view(-1)
        if full < n:
            q[full:] = (w[full:] / safe[-1]).round_().clamp_(-127, 127)
        return [q, scales], Ctx(tensor, wd)

    def _dequant_into(self, out: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> None:
        """``out += q * s`` chunk-wise (out: flat, working precision)."""
        c, n = self.chunk_size, q.numel()
        full = n // c * c
        s = scales.to(out.dtype)
        if full:
            out[:full].view(-1, c).addcmul_(q[:full].view(-1, c).to(out.dtype), s[:full // c, None])
        if full < n:
            out[full:].add_(q[full:].to(out.dtype) * s[-1])

    def decode(self, payload, ctx):
        q, scales = payload
        out = torch.zeros(ctx.numel, dtype=_work_dtype(ctx.dtype), device=q.device)
        self._dequant_into(out, q, scales)
        return out.view(ctx.shape)

    def decompress_sum(self, payloads, ctx):
        out = torch.zeros(ctx.numel, dtype=_work_dtype(ctx.dtype), device=ctx.device)
        for q, scales in payloads:
            self._dequant_into(out, q, scales)
        return out.view(ctx.shape)

    def payload_nbytes(self, numel, dtype):
        return _packed_nbytes([numel, 4 * -(-numel // self.chunk_size)])


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _packed_nbytes(sizes: Sequence[int]) -> int:
    total = 0
    for s in sizes:
        total += -(-s // _ALIGN) * _ALIGN
    return total


def all_reduce_wire_bytes(compressor: Compressor, numel: int, dtype: torch.dtype,
                          world_size: int) -> dict:
    """Bytes one rank sends for an all-reduce of ``numel`` x ``dtype``, by the
    textbook model (ring all-reduce: 2(n-1)/n x payload; all-gather: (n-1) x
    payload), compressed and uncompressed."""
    n = world_size
    raw = numel * _itemsize(dtype)
    payload = compressor.payload_nbytes(numel, dtype)
    sent = payload * 2 * (n - 1) / n if compressor.summable else payload * (n - 1)
    raw_sent = raw * 2 * (n - 1) / n
    return {"payload_bytes": payload, "sent_bytes": sent, "uncompressed_payload_bytes": raw,
            "uncompressed_sent_bytes": raw_sent, "ratio": (sent / raw_sent) if raw_sent else 1.0,
            "collective": "all_reduce" if compressor.summable else "all_gather_into_tensor"}


# -- packing several payload tensors into one byte buffer ----------------------------------------
def _pack_payload(payload: Sequence[torch.Tensor]) -> torch.Tensor:
    sizes = [p.numel() * p.element_size() for p in payload]
    buf = torch.zeros(_packed_nbytes(sizes), dtype=torch.uint8, device=payload[0].device)
    off = 0
    for p, s in zip(payload, sizes):
        buf[off:off + s] = p.contiguous().view(-1).view(torch.uint8)
        off += -(-s // _ALIGN) * _ALIGN
    return buf


def _unpack_payload(buf: torch.Tensor, like: Sequence[torch.Tensor]) -> list:
    out, off = [], 0
    for p in like:
        s = p.numel() * p.element_size()
        out.append(buf[off:off + s].view(p.dtype))
        off += -(-s // _ALIGN) * _ALIGN
    return out


# -- the collectives ------------------------------------------------------------------------------
def _validate(fn: str, tensor, compressor, what: str = "tensor") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{fn}: {what} must be a torch.Tensor, got {type(tensor).__name__}")
    if not isinstance(compressor, Compressor):
        raise TypeError(f"{fn}: compressor must be an mcrdl Compressor, got {type(compressor).__name__}")
    if tensor.dtype not in api.DTYPES:
        raise UnsupportedError(f"{fn}: {what} has unsupported dtype {tensor.dtype}")
    if compressor.lossy and not tensor.dtype.is_floating_point:
        raise UnsupportedError(f"{fn}: {what} has dtype {tensor.dtype}: {type(compressor).__name__} "
                               "is lossy and refuses integer and bool tensors (use NoneCompressor "
                               "or the uncompressed op)")


def compressed_all_reduce(tensor: torch.Tensor, compressor: Compressor, op=ReduceOp.SUM,
                          group: Optional[Group] = None, backend: Optional[str] = None,
                          key=None) -> None:
    """All-reduce ``tensor`` in place (SUM or AVG) with ``compressor``'s payload
    on the wire. ``key`` names the error-feedback residual (module docstring)."""
    fn = "compressed_all_reduce"
    _validate(fn, tensor, compressor)
    try:
        rop = ReduceOp.coerce(op)
    except ValueError as exc:
        raise ValueError(f"{fn}: {exc}") from None
    if rop not in (ReduceOp.SUM, ReduceOp.AVG):
        raise UnsupportedError(f"{fn}: only ReduceOp.SUM and ReduceOp.AVG can be compressed, "
                               f"got {rop.name}")
    if rop is ReduceOp.AVG and not tensor.dtype.is_floating_point:
        raise UnsupportedError(f"{fn}: ReduceOp.AVG on {tensor.dtype} is refused (an integer "
                               "mean is not exact)")
    if api.get_rank(group) < 0:
        return None
    if type(compressor) is NoneCompressor:
        api.all_reduce(tensor, rop, group, backend=backend)
        return None
    if tensor.numel() == 0:
        return None
    n = api.get_world_size(group)
    api.wait_for_conflicts(fn, (tensor,), (tensor,))
    payload, ctx = compressor.compress(tensor, key)
    if compressor.summable:
        if len(payload) != 1:
            raise TypeError(f"{fn}: {type(compressor).__name__} is summable but its payload has "
                            f"{len(payload)} tensors (expected 1)")
        api.all_reduce(payload[0], ReduceOp.SUM, group, backend=backend)
        out = compressor.decode(payload, ctx)
    else:
        buf = _pack_payload(payload)
        gathered = buf.new_empty(n * buf.numel())
        api.all_gather_into_tensor(gathered, buf, group, backend=backend)
        p = buf.numel()
        out = compressor.decompress_sum(
            [_unpack_payload(gathered[r * p:(r + 1) * p], payload) for r in range(n)], ctx)
    if rop is ReduceOp.AVG:
        out = out / n
    tensor.copy_(out.view(tensor.shape))
    return None


def compressed_all_gather(output: Union[torch.Tensor, List[torch.Tensor]], tensor: torch.Tensor,
                          compressor: Compressor, group: Optional[Group] = None,
                          backend: Optional[str] = None, key=None) -> None:
    """All-gather ``tensor`` compressed: ``output`` is a list of ``world_size``
    tensors (like ``all_gather``) or one tensor of ``world_size x`` the
    elements (like ``all_gather_into_tensor``, rank blocks along dim 0)."""
    fn = "compressed_all_gather"
    _validate(fn, tensor, compressor)
    if api.get_rank(group) < 0:
        return None
    n = api.get_world_size(group)
    if isinstance(output, torch.Tensor):
        if output.dtype != tensor.dtype or output.device != tensor.device:
            raise ValueError(f"{fn}: output is {output.dtype} on {output.device}, expected "
                             f"{tensor.dtype} on {tensor.device}")
        if output.numel() != n * tensor.numel():
            raise ValueError(f"{fn}: output has {output.numel()} elements, expected "
                             f"{tensor.numel()} x {n} ranks = {n * tensor.numel()}")
        outs = list(output.view(-1).chunk(n)) if output.is_contiguous() else None
    elif isinstance(output, (list, tuple)):
        if len(output) != n:
            raise ValueError(f"{fn}: output list must have {n} tensors (one per rank), "
                             f"got {len(output)}")
        for r, o in enumerate(output):
            if not isinstance(o, torch.Tensor):
                raise TypeError(f"{fn}: output[{r}] must be a torch.Tensor, got {type(o).__name__}")
            if o.dtype != tensor.dtype or o.device != tensor.device or o.numel() != tensor.numel():
                raise ValueError(f"{fn}: output[{r}] is {o.numel()} x {o.dtype} on {o.device}, "
                                 f"expected {tensor.numel()} x {tensor.dtype} on {tensor.device}")
        outs = list(output)
    else:
        raise TypeError(f"{fn}: output must be a tensor or a list of tensors, "
                        f"got {type(output).__name__}")
    if tensor.numel() == 0:
        return None
    api.wait_for_conflicts(fn, (tensor,), tuple(outs) if outs is not None else (output,))
    payload, ctx = compressor.compress(tensor, key)
    if len(payload) == 1:
        buf = payload[0].view(-1)
        gathered = buf.new_empty(n * buf.numel())
        api.all_gather_into_tensor(gathered, buf, group, backend=backend)
        p = buf.numel()
        parts = [[gathered[r * p:(r + 1) * p]] for r in range(n)]
    else:
        buf = _pack_payload(payload)
        gathered = buf.new_empty(n * buf.numel())
        api.all_gather_into_tensor(gathered, buf, group, backend=backend)
        p = buf.numel()
        parts = [_unpack_payload(gathered[r * p:(r + 1) * p], payload) for r in range(n)]
    if outs is None:  # non-contiguous output tensor
        full = torch.cat([compressor.decompress(parts[r], ctx).reshape(-1) for r in range(n)])
        output.copy_(full.view(output.shape))
        return None
    for r in range(n):
        outs[r].copy_(compressor.decompress(parts[r], ctx).view(outs[r].shape))
    return None
