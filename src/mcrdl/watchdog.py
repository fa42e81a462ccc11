"""Dead peers named within milliseconds: one TCP connection per rank to rank 0.

Rank 0 runs a thread that every other rank connects to (the address is in the
rendezvous store). However a process dies (killed, crashed, ``os._exit``), the
kernel closes its sockets: rank 0 sees a dead rank's connection end at once and
tells every other rank, and every rank sees rank 0's death as the end of its own
connection. A rank that ends on purpose (``destroy_process_group``, or the exit
handler) says ``bye`` first, so leaving is not taken for dying; one that ends on an
uncaught exception does not, so its peers stop waiting for it.

Only the job's ranks are heard. Rank 0 greets each connection with a fresh
nonce; a rank answers with its rank, a nonce of its own and an HMAC of both
under the job's secret, and rank 0 proves itself with an HMAC of the rank's
nonce. A connection that fails this, claims a rank already connected, sends a
line longer than :data:`LINE_MAX` or stays silent for :data:`HANDSHAKE_S` is
dropped and counted (:attr:`Watchdog.rejected`); only an admitted rank's
connection ending without ``bye`` is a death. At most :data:`MAX_PENDING`
connections wait for their handshake at once, the oldest going first.

Frozen peers (SIGSTOP, a node stuck in I/O or swapping) are found on the same
connections: every :func:`beat_interval` each end sends ``beat`` from a thread
of the compiled helpers that never takes the GIL (``Beats`` in csrc/beats.cpp; without
them, from this thread), so a rank busy in a long compute step, Python loop,
checkpoint write or a call that holds the GIL still beats. A rank not heard from
for ``MCRDL_FROZEN_S`` seconds (default 15; 0: never) is reported frozen, by rank
0 to everyone, or by a rank of rank 0; each end reads what has arrived before it
judges, so its own thread being held up does not make a peer look silent.

Heartbeats in the store (:mod:`mcrdl.health`) still explain timeouts.
``MCRDL_WATCHDOG=0`` turns the watchdog off.
"""
from __future__ import annotations

import hmac
import secrets
import select
import selectors
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Optional

LINE_MAX = 256  # bytes: every line of the protocol is shorter
HANDSHAKE_S = 30.0  # a connection not admitted by then is dropped
MAX_PENDING = 64  # connections waiting for their handshake at once
DRAIN_PASSES = 64  # reads of what has arrived before rank 0 judges (bounded: a peer may flood)
def beat_interval(frozen_s: float) -> float:
    """How often each end of a connection says it is alive."""
    return min(1.0, frozen_s / 5) if frozen_s else 1.0


def _gil_free_beats(interval: float):
    """csrc/beats.cpp's ``Beats`` (a thread that never takes the GIL), or None without the
    compiled helpers (this module's thread beats then)."""
    from . import facts

    compiled = facts.load()
    if compiled is facts:
        return None
    facts.provided("the watchdog's heartbeat thread", "Beats (csrc/beats.cpp)")
    return compiled.Beats(interval)


def _no_delay(sock: socket.socket) -> socket.socket:
    """Lines go out as written: with Nagle's algorithm a ``bye`` could wait behind an
    unacknowledged ``beat`` and be dropped by the reset a close sends."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _part(sock: socket.socket) -> None:
    """Close a connection so that what was sent on it arrives: end the sending side
    (a FIN after the data) and read what the peer sent meanwhile, since closing
    with unread data resets the connection."""
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.setblocking(False)
        while sock.recv(LINE_MAX):
            pass
    except OSError:  # nothing more to read now, or the peer is gone
        pass
    sock.close()


def _frozen(rank: int, seconds: float) -> str:
    return f"rank {rank} is frozen (nothing heard from it for {seconds:.1f} s)"


def _mac(secret: bytes, *parts: str) -> str:
    return hmac.new(secret, "|".join(parts).encode(), "sha256").hexdigest()


def _read_line(sock: socket.socket, pending: bytes) -> tuple[bytes, bytes]:
    """One line from ``sock`` (after what ``pending`` holds) and the bytes after it."""
    while b"\n" not in pending:
        if len(pending) > LINE_MAX:
            raise ConnectionError("a line longer than the protocol allows")
        data = sock.recv(LINE_MAX)
        if not data:
            raise ConnectionError("the connection closed during the handshake")
        pending += data
    line, rest = pending.split(b"\n", 1)
    return line, rest


@dataclass
class _Peer:
    """Rank 0's view of one connection."""
    nonce: str
    since: float
    rank: Optional[int] = None  # set once admitted
    heard: float = 0.0  # when the peer last sent anything
    leaving: bool = False
    pending: bytes = b""


class Watchdog:
    """Calls ``on_death(rank, how)`` (from its own thread) once per peer that dies
    or freezes, ``how`` saying which.

    ``secret`` is the job's key (sent over MPI by the runtime when MPI is live);
    ``None`` sends a fresh one with rank 0's address through the store."""

    def __init__(self, store, rank: int, world_size: int, listen: Callable[[], socket.socket],
                 on_death: Callable[[int, str], None], timeout: float,
                 secret: Optional[bytes] = None, frozen_s: float = 0.0):
        self.rank = rank
        self.frozen_s = frozen_s
        self._beat_s = beat_interval(frozen_s)
        self.world_size = world_size
        self.on_death = on_death
        self.rejected = 0  # connections dropped as not the job's ranks (rank 0)
        #: called (from this thread) with the asking rank when another rank asks every rank
        #: to dump its flight recorder (:meth:`ask_all_to_dump`)
        self.on_dump: Optional[Callable[[int], None]] = None
        self._stop = threading.Event()
        self._dead: set[int] = set()
        self._beats = _gil_free_beats(self._beat_s)
        # a fresh key per init: the same store may serve several inits in turn
        generation = (store.add("watchdog/arrivals", 1) - 1) // world_size
        key = f"watchdog/{generation}"
        if rank == 0:
            in_store = secret is None
            self._secret = secrets.token_bytes(32) if in_store else secret
            self._listener = listen()
            host, port = self._listener.getsockname()[:2]
            store.set(key, f"{host} {port}" + (f" {self._secret.hex()}" if in_store else ""))
            self._peers: dict[socket.socket, _Peer] = {}
            self._admitted: set[int] = set()
            self._wake_r, self._wake_w = socket.socketpair()  # stop() wakes the select
            target = self._serve
        else:
            host, port, *shared = store.get(key).decode().split()
            self._secret = bytes.fromhex(shared[0]) if secret is None else secret
            self._sock = _no_delay(socket.create_connection((host, int(port)), timeout=timeout))
            self._pending = self._handshake(f"{host}:{port}")
            self._sock.settimeout(self._beat_s)
            if self._beats is not None:
                self._beats.add(self._sock.fileno())
            target = self._listen_to_rank0
        self._thread = threading.Thread(target=target, daemon=True, name="mcrdl-watchdog")
        self._thread.start()

    def _died(self, rank: int, how: str = "") -> None:
        if rank not in self._dead and not self._stop.is_set():
            self._dead.add(rank)
            self.on_death(rank, how or f"rank {rank} died (its process ended)")

    def ask_all_to_dump(self) -> None:
        """Every other rank dumps its flight recorder (rank 0 passes the word on)."""
        try:
            if self.rank == 0:
                self._tell_all(b"dump 0\n")
            else:
                self._sock.sendall(b"dump\n")
        except OSError:
            pass  # rank 0 is gone: the others learn that on their own

    def _dump(self, asker: int) -> None:
        if self.on_dump is not None and not self._stop.is_set():
            self.on_dump(asker)

    # -- rank 0 ---------------------------------------------------------------------------
    def _serve(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        beaten = 0.0
        while not self._stop.is_set():
            ready = sel.select(timeout=self._beat_s)
            # then what arrived while this thread waited for the GIL, up to a last look that
            # found nothing: silence is judged up to then, never on what was not read yet
            for _pass in range(DRAIN_PASSES):
                for key, _events in ready:
                    if key.fileobj is self._listener:
                        self._accept(sel)
                    elif key.fileobj in self._peers:
                        self._read(sel, key.fileobj)
                now = time.monotonic()
                ready = sel.select(timeout=0)
                if not ready or self._stop.is_set():
                    break
            for sock, peer in list(self._peers.items()):
                if peer.rank is None and now - peer.since > HANDSHAKE_S:
                    self._reject(sel, sock, "no handshake in time")
                elif (self.frozen_s and peer.rank is not None and not peer.leaving
                      and peer.rank not in self._dead and now - peer.heard > self.frozen_s):
                    self._tell_all(f"frozen {peer.rank} {now - peer.heard:.1f}\n".encode())
                    self._died(peer.rank, _frozen(peer.rank, now - peer.heard))
            if self._beats is None and now - beaten >= self._beat_s:
                self._tell_all(b"beat\n")
                beaten = now
        sel.close()

    def _accept(self, sel: selectors.BaseSelector) -> None:
        try:
            conn, _ = self._listener.accept()
            _no_delay(conn)
        except OSError:
            return
        waiting = [s for s, p in self._peers.items() if p.rank is None]
        if len(waiting) >= MAX_PENDING:
            self._reject(sel, min(waiting, key=lambda s: self._peers[s].since), "too many connections")
        nonce = secrets.token_hex(16)
        try:
            conn.sendall(f"{nonce}\n".encode())
        except OSError:
            conn.close()
            return
        self._peers[conn] = _Peer(nonce, time.monotonic())
        sel.register(conn, selectors.EVENT_READ)

    def _read(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        peer = self._peers[sock]
        try:
            data = sock.recv(LINE_MAX)
        except OSError:
            data = b""
        peer.heard = time.monotonic()
        if not data:
            self._close(sel, sock)
            if peer.rank is not None and not peer.leaving:
                self._tell_all(f"dead {peer.rank}\n".encode())
                self._died(peer.rank)
            return
        *lines, peer.pending = (peer.pending + data).split(b"\n")
        if len(peer.pending) > LINE_MAX:
            return self._reject(sel, sock, "a line too long")
        for line in lines:
            if peer.rank is None:
                why = self._admit(sock, peer, line)
                if why:
                    return self._reject(sel, sock, why)
            elif line == b"bye":
                peer.leaving = True
            elif line == b"dump":
                self._tell_all(f"dump {peer.rank}\n".encode())
                self._dump(peer.rank)
            elif line != b"beat":  # an admitted rank sends nothing else
                self.rejected += 1

    def _admit(self, sock: socket.socket, peer: _Peer, line: bytes) -> Optional[str]:
        """Checks a hello ``RANK NONCE MAC``; admits the peer and answers, or says why not."""
        try:
            rank_text, nonce, mac = line.decode("ascii").split(" ")
            rank = int(rank_text)
        except (UnicodeDecodeError, ValueError):
            return "not a hello"
        if not 0 < rank < self.world_size:
            return f"rank {rank_text!r} is not in the job"
        if not hmac.compare_digest(mac, _mac(self._secret, "rank", str(rank), peer.nonce)):
            return f"a hello for rank {rank} without the job's secret"
        if rank in self._admitted:
            return f"rank {rank} is connected already"
        try:
            sock.sendall(f"{_mac(self._secret, 'rank0', nonce)}\n".encode())
        except OSError:
            return "gone during the handshake"
        peer.rank, peer.heard = rank, time.monotonic()
        self._admitted.add(rank)
        if self._beats is not None:
            self._beats.add(sock.fileno())
        return None

    def _reject(self, sel: selectors.BaseSelector, sock: socket.socket, why: str) -> None:
        self.rejected += 1
        if self.rejected == 1:
            print(f"mcrdl: rank 0's watchdog dropped a connection that is not one of the job's "
                  f"ranks ({why}); further ones are counted, not printed", file=sys.stderr, flush=True)
        self._close(sel, sock)

    def _close(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        if self._beats is not None:
            self._beats.remove(sock.fileno())  # (before the descriptor can be reused)
        sel.unregister(sock)
        sock.close()
        del self._peers[sock]

    def _tell_all(self, message: bytes) -> None:
        for conn, peer in list(self._peers.items()):
            if peer.rank is None:
                continue
            try:
                conn.sendall(message)
            except OSError:
                pass  # that one is going too: its own end will be seen

    # -- every other rank ---------------------------------------------------------------------
    def _handshake(self, where: str) -> bytes:
        """Answers rank 0's nonce and checks its proof; returns what arrived after it."""
        try:
            nonce, rest = _read_line(self._sock, b"")
            mine = secrets.token_hex(16)
            mac = _mac(self._secret, "rank", str(self.rank), nonce.decode("ascii"))
            self._sock.sendall(f"{self.rank} {mine} {mac}\n".encode())
            proof, rest = _read_line(self._sock, rest)
        except (OSError, UnicodeDecodeError) as exc:
            self._sock.close()
            raise RuntimeError(f"mcrdl: rank {self.rank}: the watchdog at {where} did not admit "
                               f"this rank ({exc})") from exc
        if not hmac.compare_digest(proof, _mac(self._secret, "rank0", mine).encode()):
            self._sock.close()
            raise RuntimeError(f"mcrdl: rank {self.rank}: the watchdog at {where} is not this "
                               "job's rank 0 (it does not know the job's secret)")
        return rest

    def _listen_to_rank0(self) -> None:
        pending, leaving = self._pending, False
        heard = beaten = time.monotonic()
        while True:
            *lines, pending = pending.split(b"\n")
            for line in lines:
                words = line.split()
                if line == b"bye":
                    leaving = True
                elif len(words) >= 2 and words[0] == b"dead" and words[1].isdigit():
                    self._died(int(words[1]))
                elif len(words) == 2 and words[0] == b"dump" and words[1].isdigit():
                    if int(words[1]) != self.rank:  # (rank 0 tells the asker too)
                        self._dump(int(words[1]))
                elif (len(words) == 3 and words[0] == b"frozen" and words[1].isdigit()
                      and words[2].replace(b".", b"", 1).isdigit()):
                    self._died(int(words[1]), _frozen(int(words[1]), float(words[2])))
            now = time.monotonic()
            if self._beats is None and now - beaten >= self._beat_s:
                try:
                    self._sock.sendall(b"beat\n")
                except OSError:
                    pass  # rank 0 gone or stuck: its silence is seen below
                beaten = now
            try:
                data = self._sock.recv(LINE_MAX)
            except socket.timeout:  # nothing for a beat interval, or this thread waited for the GIL
                now = time.monotonic()  # (silence is judged up to a last look that found nothing)
                try:
                    if select.select([self._sock], [], [], 0)[0]:
                        continue
                except (OSError, ValueError):  # closed: this rank is leaving (stop)
                    break
                if self.frozen_s and now - heard > self.frozen_s and not leaving:
                    self._died(0, _frozen(0, now - heard))
                continue
            except OSError:
                data = b""
            if not data:
                break
            heard = time.monotonic()
            pending += data
        if not leaving:
            self._died(0)

    # -- leaving ------------------------------------------------------------------------------
    def stop(self, leaving: bool = True) -> None:
        """Leave on purpose: peers are told, not alarmed (``leaving=False``: a rank
        ending on an error goes without ``bye``, so its peers hear of a death)."""
        self._stop.set()
        if self._beats is not None:
            self._beats.stop()  # (no socket is written by it after this)
        if self.rank == 0:
            self._wake_w.send(b"x")
            self._thread.join(timeout=2)
            if leaving:
                self._tell_all(b"bye\n")
            for sock in list(self._peers):
                _part(sock)
            for sock in (self._listener, self._wake_r, self._wake_w):
                sock.close()
            return
        try:
            if leaving:
                self._sock.sendall(b"bye\n")
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._thread.join(timeout=2)
        _part(self._sock)


__all__ = ["Watchdog", "beat_interval"]
