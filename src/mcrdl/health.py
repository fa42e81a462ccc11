"""Which peer is missing: heartbeats and arrival counts in the rendezvous store.

Every rank stamps ``hb/<rank>`` with its wall-clock time from a daemon thread
every ``interval`` seconds (``MCRDL_HEARTBEAT_S``, default 1; 0 turns it off).
In debug mode a rank also counts, per group, the collectives it has entered.
When an operation fails or misses its deadline, :meth:`Health.describe` says
which peers stopped beating (dead or frozen) or, in debug mode, which did not
arrive at the collective.
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence

#: A peer whose last heartbeat is older than this many intervals is reported silent.
STALE_INTERVALS = 3.0


class Health:
    """Heartbeat publisher and missing-peer diagnosis for one rank.

    It talks to the store through its own connection with a short timeout, so
    a diagnosis never waits long on a store whose host has died."""

    def __init__(self, store, rank: int, interval: float, store_host_rank: Optional[int]):
        self.rank = rank
        self.interval = interval
        self.store_host_rank = store_host_rank  # rank whose process serves the store, if any
        self.store = store.clone()
        self.store.set_timeout(timedelta(seconds=max(2.0, 2 * interval)))
        self._lock = threading.Lock()
        self._silent: dict[int, float] = {}  # peers found silent: rank -> heartbeat age (s)
        self._all_alive_at = -float("inf")  # when every peer checked was last found alive
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._run, daemon=True, name="mcrdl-heartbeat")
        self._thread.start()

    def _beat(self) -> None:
        self.store.set(f"hb/{self.rank}", repr(time.time()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat()
            except Exception:  # the store is gone (its host died): diagnosis reports it
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def arrive(self, group_name: str) -> None:
        """Debug mode: count one more collective entered on ``group_name``."""
        self.store.add(f"arrive/{group_name}/{self.rank}", 1)

    def _find_silent(self, peers: Sequence[int], settle: bool,
                     heard: Callable[[], bool]) -> dict[int, float]:
        """Peers whose heartbeat stopped. A library can report a peer's death
        before its heartbeat is stale: with ``settle`` this watches for
        ``STALE_INTERVALS + 1`` intervals, or until ``heard()`` (the watchdog
        named a death), and later checks within that window reuse what it found."""
        with self._lock:
            known = {r: age for r, age in self._silent.items() if r in peers}
            window = (STALE_INTERVALS + 1) * self.interval
            if known or time.monotonic() - self._all_alive_at < window:
                return known
            settle = time.monotonic() + (window if settle else 0.0)
            while True:
                now = time.time()
                stamps = self.store.multi_get([f"hb/{r}" for r in peers])
                silent = {r: now - float(s) for r, s in zip(peers, stamps)
                          if now - float(s) > STALE_INTERVALS * self.interval}
                if silent or time.monotonic() >= settle or heard():
                    break
                time.sleep(self.interval)
            self._silent.update(silent)
            if not silent:
                self._all_alive_at = time.monotonic()
            return silent

    def describe(self, ranks: Sequence[int], group_name: str, debug: bool, settle: bool,
                 heard: Callable[[], bool] = lambda: False, point_to_point: bool = False) -> str:
        """One sentence on the other ``ranks`` (global ranks) of a failed op:
        which are silent (dead or frozen), which did not arrive (debug), or
        that all are alive. ``settle``: the failure came from the library right
        away (not a timeout), so wait until a peer that just died shows silent
        or ``heard()``. ``point_to_point``: the op was a send or receive (no
        collective order to blame)."""
        peers = [r for r in ranks if r != self.rank]
        if not peers:
            return ""
        try:
            silent = self._find_silent(peers, settle, heard)
            behind = {}
            if debug:
                counts = [self.store.add(f"arrive/{group_name}/{r}", 0) for r in ranks]
                mine = counts[list(ranks).index(self.rank)]
                behind = {r: c for r, c in zip(ranks, counts) if c < mine}
        except Exception as exc:
            host = (f"rank {self.store_host_rank}, which serves it, is probably dead"
                    if self.store_host_rank is not None else "its host is probably down")
            return f"the rendezvous store is unreachable: {host} ({type(exc).__name__}: {exc})"
        notes = []
        if silent:
            notes.append("not responding (dead or frozen): " + ", ".join(
                f"rank {r} (no heartbeat for {age:.1f} s)" for r, age in silent.items()))
        if behind:
            notes.append(f"did not arrive at collective #{mine} on group {group_name}: " + ", ".join(
                f"rank {r} (entered {c})" for r, c in behind.items()))
        if notes:
            return "; ".join(notes)
        alive = ", ".join(map(str, peers))
        if point_to_point:
            return f"ranks {alive} are alive, so a peer is stuck or " + (
                "the library refused the message (its error says which)" if settle
                else "has not posted the matching send or receive")
        return (f"ranks {alive} are alive, so a peer is stuck or issued collectives in a different order"
                + ("" if debug else " (MCRDL_DEBUG=1 names the rank that did not arrive)"))
