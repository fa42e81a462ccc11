"""The job's rendezvous store: which address rank 0 binds, and who serves it.

Under an MPI launcher rank 0 serves a ``TCPStore`` on a free port of one address
(:func:`store_address`) and tells everyone over MPI; under torchrun-style variables
rank 0 serves it at ``MASTER_ADDR:MASTER_PORT`` unless torchrun's agent does. Only
the chosen address is bound, never every interface.
"""
from __future__ import annotations

import os
import secrets
import socket
import time
from datetime import timedelta
from typing import Callable, Optional

from . import settings
from .types import CommTimeoutError


def iface_address(name: str) -> Optional[str]:
    """IPv4 address of network interface ``name`` (Linux), or None."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            req = struct.pack("256s", name.encode()[:15])
            return socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])  # SIOCGIFADDR
    except (OSError, ImportError):
        return None


def is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr == "::1"


def store_address(single_host: bool) -> str:
    """The address rank 0's rendezvous store listens on (and the others connect to).

    ``MCRDL_MASTER_ADDR`` if set; else loopback when every rank is on this host;
    else the address of the first interface in ``GLOO_SOCKET_IFNAME`` (the network
    the user chose for gloo); else this host's name's address unless it is a
    loopback one (Debian maps the hostname to 127.0.1.1); else the source address of
    the default route. Only that address is bound, never every interface."""
    explicit = settings.get("MCRDL_MASTER_ADDR")
    if explicit:
        return explicit
    if single_host:
        return "127.0.0.1"
    for name in filter(None, os.environ.get("GLOO_SOCKET_IFNAME", "").split(",")):
        addr = iface_address(name)
        if addr:
            return addr
        raise RuntimeError(f"GLOO_SOCKET_IFNAME names {name!r}, which has no IPv4 address here; "
                           "set MCRDL_MASTER_ADDR")
    try:
        addr = socket.gethostbyname(socket.gethostname())
        if not is_loopback(addr):
            return addr
    except OSError:
        pass
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
            addr = s.getsockname()[0]
        if not is_loopback(addr):
            return addr
    except OSError:
        pass
    raise RuntimeError("cannot tell which address the other hosts reach this one on: set "
                       "MCRDL_MASTER_ADDR (or GLOO_SOCKET_IFNAME)")


def serve_store(sock: socket.socket, world_size: int, timeout: timedelta, **kw):
    """The rendezvous store's server on the listening ``sock``, which it takes over."""
    import torch.distributed as dist

    host, port = sock.getsockname()[:2]
    try:
        store = dist.TCPStore(host, port, world_size, True, timeout=timeout,
                              master_listen_fd=sock.fileno(), **kw)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns (and closes) the socket now
    return store


def listen(host: str, port: int = 0) -> socket.socket:
    """A listening TCP socket on ``host`` (an address or a name) only, on
    ``port`` (0: a free one)."""
    errors = []
    for family, kind, proto, _, sockaddr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            if port:  # a fixed port may still hold a previous job's connections in TIME_WAIT
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(128)
            return sock
        except OSError as exc:
            sock.close()
            errors.append(f"{sockaddr[0]}: {exc.strerror or exc}")
    raise RuntimeError(f"cannot listen on {host!r} ({'; '.join(errors) or 'no address'}): "
                       "MCRDL_MASTER_ADDR must be an address of rank 0's host")


def make_store(rank: int, world_size: int, local_size: int, timeout: float, mpi_comm):
    """The job's store and the rank whose process serves it (None: torchrun's agent):
    under MPI, rank 0 serves one on a free port of :func:`store_address` and tells
    everyone over MPI; else rank 0 serves it at MASTER_ADDR:MASTER_PORT unless
    torchrun's agent does."""
    import torch.distributed as dist

    td = timedelta(seconds=timeout)
    store_host = None
    if mpi_comm is not None:
        # Rank 0 binds a free port on one address (loopback for a single-host job,
        # see store_address) and tells everyone over MPI; an error there is
        # raised on every rank instead of stranding the others in bcast.
        msg = None
        if rank == 0:
            try:
                single_host = local_size == world_size
                sock = listen(store_address(single_host))
                host = sock.getsockname()[0]  # the address bound, also when named
                if is_loopback(host) and not single_host:
                    sock.close()
                    raise RuntimeError(f"the store address resolves to {host} on rank 0, which "
                                       "other hosts cannot reach: set MCRDL_MASTER_ADDR to an "
                                       "address of rank 0's host")
                store = serve_store(sock, world_size, td, wait_for_workers=False)
                msg = (host, store.port)
            except Exception as exc:  # noqa: BLE001 - reported on every rank
                msg = f"{type(exc).__name__}: {exc}"
        msg = mpi_comm.bcast(msg, root=0)
        if isinstance(msg, str):
            raise RuntimeError(f"mcrdl: rank 0 could not start the rendezvous store: {msg}")
        host, port = msg
        if rank != 0:
            store = dist.TCPStore(host, port, world_size, False, timeout=td)
        mpi_comm.Barrier()  # everyone connected before rank 0 may leave
        return store, 0
    env = os.environ
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        raise RuntimeError("mcrdl: RANK/WORLD_SIZE are set but MASTER_ADDR/MASTER_PORT are "
                           "not: launch with torchrun, `mcrdl run` or mpiexec")
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        store_host = 0  # known on every rank: Health names it when the store goes
    if rank == 0 and store_host == 0:
        # mcrdl serves the store: on MASTER_ADDR only (torch's TCPStore alone
        # would listen on every interface)
        store = serve_store(listen(host, port), world_size, td)
    else:
        store = dist.TCPStore(host, port, world_size, False, timeout=td)
    return fresh_keys(store, rank, world_size, timeout), store_host


def fresh_keys(store, rank: int, size: int, timeout: float, late: Optional[Callable[[list], str]] = None):
    """``store`` under a prefix that this start's ``size`` ranks share and no earlier
    start on the same store used. A store can outlive a start (torchrun's agent keeps
    its store across restarts), where a key a dead rank left (its gloo address, its
    group check-in) would be read as this start's; and torchrun's restart count is
    each node's own (a node whose ranks were healthy restarts without counting), so it
    cannot tell starts apart. Rank 0 opens a new generation (a counter in the store);
    every other rank offers a random token under the generation it reads until rank 0
    echoes it back, which only a live rank 0 of this start does. Past ``timeout`` a
    :class:`CommTimeoutError` says ``late(ranks missing)``."""
    import torch.distributed as dist

    if late is None:
        def late(missing):
            return f"mcrdl: ranks {missing} did not join the rendezvous within {timeout:g} s"

    deadline = time.monotonic() + timeout
    if rank == 0:
        generation = store.add("mcrdl/generation", 1)
        for peer in range(1, size):
            hello = f"mcrdl/{generation}/hello/{peer}"
            try:
                store.wait([hello], timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except RuntimeError:  # the store's timeout (DistStoreError)
                missing = [r for r in range(peer, size) if not store.check([f"mcrdl/{generation}/hello/{r}"])]
                raise CommTimeoutError(late(missing)) from None
            store.set(f"mcrdl/{generation}/welcome/{peer}", store.get(hello))
        return dist.PrefixStore(f"mcrdl/{generation}/", store)
    token, offered = secrets.token_hex(8), 0
    while time.monotonic() < deadline:
        generation = store.add("mcrdl/generation", 0)
        if generation != offered:  # new to this rank: offer the token there
            offered = generation
            store.set(f"mcrdl/{generation}/hello/{rank}", token)
        if offered:
            welcome = f"mcrdl/{offered}/welcome/{rank}"
            try:
                store.wait([welcome], timedelta(seconds=0.02))
            except RuntimeError:  # not answered yet: a later generation may be open by now
                continue
            if store.get(welcome).decode() == token:
                return dist.PrefixStore(f"mcrdl/{offered}/", store)
        time.sleep(0.002)  # no generation yet, or an earlier start's answer
    raise CommTimeoutError(late([0]))
