"""Integrations of mcrdl with other frameworks (imported on demand, never by ``import mcrdl``).

* :mod:`mcrdl.integrations.torch_backend`: mcrdl as a ``torch.distributed``
  backend (``init_process_group("mcrdl")``), so torch collectives and DDP run
  through mcrdl's selector. See docs/torch_backend.md.
* :mod:`mcrdl.integrations.ddp_hook`: DDP communication hooks that send the
  gradient buckets through mcrdl (plain, fused, compressed). See docs/workloads.md.
"""
