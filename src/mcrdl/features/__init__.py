"""Features built on the public mcrdl API (backends never see them).

* :mod:`mcrdl.features.fusion`: tensor fusion (coalesced all-reduce, broadcast,
  all-gather over flat buckets).
* :mod:`mcrdl.features.compression`: compressed all-reduce / all-gather (fp16,
  bf16, per-chunk int8, optional error feedback).

See docs/features.md.
"""
from .compression import (BF16Compressor, Compressor, FP16Compressor, Int8Compressor,
                          NoneCompressor, all_reduce_wire_bytes, compressed_all_gather,
                          compressed_all_reduce)
from .fusion import (DEFAULT_BUCKET_BYTES, BufferPool, all_gather_coalesced, all_reduce_coalesced,
                     broadcast_coalesced, fusion_buffer_pool, get_bucket_bytes, set_bucket_bytes)

__all__ = ["all_reduce_coalesced", "broadcast_coalesced", "all_gather_coalesced",
           "get_bucket_bytes", "set_bucket_bytes", "fusion_buffer_pool", "BufferPool",
           "DEFAULT_BUCKET_BYTES",
           "Compressor", "NoneCompressor", "FP16Compressor", "BF16Compressor", "Int8Compressor",
           "compressed_all_reduce", "compressed_all_gather", "all_reduce_wire_bytes"]
