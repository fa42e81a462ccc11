"""mcrdl: one torch.distributed-shaped API over several communication libraries,
each operation routed to the best one for its op, group size and message size."""
from .api import (DTYPES, all_gather, all_gather_into_tensor, all_gather_single, all_reduce,
                  all_to_all, all_to_all_single, autotune_report, available_backends, barrier, batch_isend_irecv,
                  broadcast, destroy_process_group, dump_flight_recorder, explain, gather, get_backend_versions,
                  get_default_backend, get_global_rank, get_group_rank, get_local_rank,
                  get_local_size, get_rank, get_world_size, init_process_group, irecv,
                  is_initialized, isend, live_backends, monitored_barrier, new_group, recv,
                  reduce, reduce_scatter, reduce_scatter_single, reduce_scatter_tensor, scatter,
                  send, wait_policy)
from .backends import register_backend
from .features.compression import (BF16Compressor, Compressor, FP16Compressor, Int8Compressor,
                                   NoneCompressor, compressed_all_gather, compressed_all_reduce)
from .features.fusion import (all_gather_coalesced, all_reduce_coalesced, broadcast_coalesced,
                              set_bucket_bytes)
from .features.logger import comms_records, comms_summary, export_comms, print_comms_summary
from .runtime import Group
from .tuning import TuningTable, TuningTableError
from .types import CommError, CommTimeoutError, P2POp, PeerDiedError, ReduceOp, UnsupportedError
from .work import Work

__version__ = "0.1.0"

__all__ = [name for name in dir() if not name.startswith("_")]
