"""Where does the rendezvous store listen? Rank 0 reads the kernel's socket table
(/proc/net/tcp, tcp6) for the store's port and checks the listening address
(under torchrun: torchrun's store, on MASTER_PORT). Usage: store_job.py EXPECTED_ADDRESS"""
import os
import socket
import struct
import sys

import torch

import mcrdl
from common import check
from mcrdl.rank_env import mpi_launched

mcrdl.init_process_group(timeout=60)
rank, world = mcrdl.get_rank(), mcrdl.get_world_size()


def listening(port):
    """Local addresses of TCP sockets listening on ``port`` in this network namespace."""
    found = []
    for path, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = open(path).read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr_hex, port_hex = local.split(":")
            if state != "0A" or int(port_hex, 16) != port:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(addr_hex)
            raw = b"".join(struct.pack("<I", w) for w in struct.unpack(">" + "I" * (len(raw) // 4), raw))
            found.append(socket.inet_ntop(family, raw))
    return found


if rank == 0:
    rt = mcrdl.api.current_runtime()
    # under torchrun the store is torchrun's (MASTER_PORT), under MPI it is mcrdl's own
    port = rt.store.port if mpi_launched() else int(os.environ["MASTER_PORT"])
    addrs = listening(port)
    print(f"rank 0 on {socket.gethostname()}: store port {port} listens on {addrs}", flush=True)
    check(addrs == [sys.argv[1]], "store listens on", addrs, "expected", [sys.argv[1]])
t = torch.ones(4)
mcrdl.all_reduce(t, backend="gloo")  # the store did its job: gloo connected through it
check(torch.equal(t, torch.full((4,), float(world))), "gloo all_reduce", t)
mcrdl.destroy_process_group()
print(f"rank {rank}: OK store", flush=True)
