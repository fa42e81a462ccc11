"""Features built on the public mcrdl API (backends never see them).

* :mod:`mcrdl.features.fusion`: tensor fusion (coalesced all-reduce, broadcast,
  all-gather over flat buckets).
* :mod:`mcrdl.features.compression`: compressed all-reduce / all-gather (fp16,
  bf16, per-chunk int8, optional error feedback).
* :mod:`mcrdl.features.logger`: the communication logger and its views.

See docs/features.md and docs/logger.md; the public names are re-exported by
``mcrdl``.
"""
