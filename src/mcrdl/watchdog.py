"""Dead peers named within milliseconds: one TCP connection per rank to rank 0.

Rank 0 runs a thread that every other rank connects to (the address is in the
rendezvous store). However a process dies (killed, crashed, ``os._exit``), the
kernel closes its sockets: rank 0 sees a dead rank's connection end at once and
tells every other rank, and every rank sees rank 0's death as the end of its own
connection. A rank that ends on purpose (``destroy_process_group``, or the exit
handler) says ``bye`` first, so leaving is not taken for dying.

Heartbeats (:mod:`mcrdl.health`) still explain timeouts and frozen peers; this
only reports processes that are gone. ``MCRDL_WATCHDOG=0`` turns it off.
"""
from __future__ import annotations

import os
import selectors
import socket
import threading
from typing import Callable


def watchdog_enabled() -> bool:
    raw = os.environ.get("MCRDL_WATCHDOG", "1")
    if raw not in ("0", "1"):
        raise ValueError(f"MCRDL_WATCHDOG must be 0 or 1, got {raw!r}")
    return raw == "1"


class Watchdog:
    """Calls ``on_death(rank)`` (from its own thread) once per peer that dies."""

    def __init__(self, store, rank: int, world_size: int, listen: Callable[[], socket.socket],
                 on_death: Callable[[int], None], timeout: float):
        self.rank = rank
        self.on_death = on_death
        self._stop = threading.Event()
        self._dead: set[int] = set()
        # a fresh key per init: the same store may serve several inits in turn
        generation = (store.add("watchdog/arrivals", 1) - 1) // world_size
        key = f"watchdog/{generation}"
        if rank == 0:
            self._listener = listen()
            host, port = self._listener.getsockname()[:2]
            store.set(key, f"{host} {port}")
            self._conns: dict[socket.socket, list] = {}  # -> [rank or None, leaving, pending bytes]
            self._wake_r, self._wake_w = socket.socketpair()  # stop() wakes the select
            target = self._serve
        else:
            host, port = store.get(key).decode().split()
            self._sock = socket.create_connection((host, int(port)), timeout=timeout)
            self._sock.settimeout(None)
            self._sock.sendall(f"{rank}\n".encode())
            target = self._listen_to_rank0
        self._thread = threading.Thread(target=target, daemon=True, name="mcrdl-watchdog")
        self._thread.start()

    def _died(self, rank: int) -> None:
        if rank not in self._dead and not self._stop.is_set():
            self._dead.add(rank)
            self.on_death(rank)

    # -- rank 0 ---------------------------------------------------------------------------
    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        while not self._stop.is_set():
            for key, _ in sel.select():
                sock = key.fileobj
                if sock is self._wake_r:
                    break
                if sock is self._listener:
                    conn, _ = self._listener.accept()
                    self._conns[conn] = [None, False, b""]
                    sel.register(conn, selectors.EVENT_READ)
                    continue
                try:
                    data = sock.recv(256)
                except OSError:
                    data = b""
                state = self._conns[sock]
                if data:
                    *lines, state[2] = (state[2] + data).split(b"\n")
                    for line in lines:
                        if line == b"bye":
                            state[1] = True
                        elif state[0] is None:
                            state[0] = int(line)
                    continue
                sel.unregister(sock)
                sock.close()
                del self._conns[sock]
                if state[0] is not None and not state[1]:
                    self._tell_all(f"dead {state[0]}\n".encode())
                    self._died(state[0])
        sel.close()

    def _tell_all(self, message: bytes) -> None:
        for conn in list(self._conns):
            try:
                conn.sendall(message)
            except OSError:
                pass  # that one is going too: its own end will be seen

    # -- every other rank ---------------------------------------------------------------------
    def _listen_to_rank0(self) -> None:
        pending, leaving = b"", False
        while True:
            try:
                data = self._sock.recv(256)
            except OSError:
                data = b""
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                if line == b"bye":
                    leaving = True
                elif line.startswith(b"dead "):
                    self._died(int(line[5:]))
        if not leaving:
            self._died(0)

    # -- leaving ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Leave on purpose: peers are told, not alarmed."""
        self._stop.set()
        if self.rank == 0:
            self._wake_w.send(b"x")
            self._thread.join(timeout=2)
            self._tell_all(b"bye\n")
            for sock in [*self._conns, self._listener, self._wake_r, self._wake_w]:
                sock.close()
            return
        try:
            self._sock.sendall(b"bye\n")
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=2)
        self._sock.close()


__all__ = ["Watchdog", "watchdog_enabled"]
