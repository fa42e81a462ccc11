"""mcrdl: one torch.distributed-shaped API over several communication libraries,
each operation routed to the best one for its op, group size and message size.

The names below load on first use (PEP 562), so ``mcrdl run`` and the other tools
start without importing torch; ``import mcrdl`` then ``mcrdl.all_reduce`` works as usual.
"""
import importlib
import importlib.util

__version__ = "0.1.0"

_EXPORTS = {
    ".api": ("DTYPES", "all_gather", "all_gather_into_tensor", "all_gather_single", "all_reduce", "all_to_all",
             "all_to_all_single", "autotune_report", "available_backends", "barrier", "batch_isend_irecv",
             "broadcast", "destroy_process_group", "dump_flight_recorder", "explain", "gather",
             "get_backend_versions", "get_default_backend", "get_global_rank", "get_group_rank",
             "get_local_rank", "get_local_size", "get_rank", "get_world_size", "init_process_group", "irecv",
             "is_initialized", "isend", "live_backends", "monitored_barrier", "new_group", "recv", "reduce",
             "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor", "scatter", "send",
             "wait_policy"),
    ".backends": ("register_backend",),
    ".features.compression": ("BF16Compressor", "Compressor", "FP16Compressor", "Int8Compressor",
                              "NoneCompressor", "compressed_all_gather", "compressed_all_reduce"),
    ".features.fusion": ("all_gather_coalesced", "all_reduce_coalesced", "broadcast_coalesced",
                         "set_bucket_bytes"),
    ".features.logger": ("comms_records", "comms_summary", "export_comms", "print_comms_summary"),
    ".runtime": ("Group",),
    ".tuning": ("TuningTable", "TuningTableError"),
    ".types": ("CommError", "CommTimeoutError", "P2POp", "PeerDiedError", "ReduceOp", "UnsupportedError"),
    ".work": ("Work",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    """A public name from its module, or a submodule (``mcrdl.api``), loaded on first use."""
    if name in _HOME:
        value = getattr(importlib.import_module(_HOME[name], __name__), name)
    elif not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOME))
