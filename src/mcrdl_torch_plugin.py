"""Makes ``torch.distributed.init_process_group("mcrdl")`` work with no mcrdl import.

torch loads the ``torch.backends`` entry points at ``import torch`` (its
out-of-tree backend mechanism; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns it
off). mcrdl's entry point is :func:`register`: it names the backend and
imports nothing of mcrdl; mcrdl itself loads when torch first creates a group
on "mcrdl". This module lives outside the ``mcrdl`` package so that
``import torch`` does not import mcrdl.
"""

BACKEND_NAME = "mcrdl"
DEVICES = ("cpu", "cuda")


def create_backend(dist_opts, backend_options=None):
    """The creator torch calls for each "mcrdl" group (see mcrdl.integrations.torch_backend)."""
    from mcrdl.integrations.torch_backend import _create_backend

    return _create_backend(dist_opts, backend_options)


def register(name: str = BACKEND_NAME) -> None:
    """Register "mcrdl" with torch.distributed unless that name is taken (never raises:
    a failure here would break ``import torch``)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and name.upper() not in getattr(dist.Backend, "_plugins", {}):
            dist.Backend.register_backend(name, create_backend, extended_api=True,
                                          devices=list(DEVICES))
    except Exception:  # noqa: BLE001 - torch must import whatever happens here
        pass
