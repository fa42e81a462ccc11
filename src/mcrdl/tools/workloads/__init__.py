"""End-to-end training workloads on mcrdl (docs/workloads.md).

Each is a module with a ``WORKLOAD`` object and ``main(argv)``; the runnable
scripts are in ``examples/workloads/`` and ``python -m mcrdl.tools.workloads.<name>``:

* :mod:`.moe`: mixture of experts (expert parallel all-to-all + data parallel all-reduce)
* :mod:`.dlrm`: DLRM-style recommender (sharded embeddings, all-to-all of pooled embeddings)
* :mod:`.megatron`: tensor-parallel transformer layers (all-reduce, or reduce-scatter +
  all-gather with sequence parallelism), plus data parallelism when the world allows
* :mod:`.decode`: tensor-parallel decoding (two all-reduces of batch x hidden per layer per
  token, little compute between them: the case DeepSpeed's shared-memory all-reduce is for)
* :mod:`.dp`: data parallelism with the gradient all-reduce after backward (one flat
  gradient buffer averaged in buckets, blocking: DeepSpeed's engine without overlap)
* :mod:`.ddp`: unmodified ``torch.nn.parallel.DistributedDataParallel`` whose gradients
  go through mcrdl by a communication hook (:mod:`mcrdl.integrations.ddp_hook`)

:mod:`.common` runs them in modes (baseline, coarse, tuned), times them and
checks that every mode gives the same losses.
"""

NAMES = ("moe", "dlrm", "megatron", "decode", "dp", "ddp")
