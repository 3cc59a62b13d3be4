"""A tenant's budget of stream buffer bytes in the daemon's heap (limits.stream_bytes_per_tenant).

Put's messages from their arrival until their blocks are stored, and a block arriving in
pieces (kvstore/handlers/streams.py), and Get's reply batches (kvstore/getcopy.py, stream) are
charged here for as long as the client takes to send or read them, so a tenant's stalled
streams hold at most its budget, whatever its quota.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from kvstore_client.common.errors import ResourceExhausted


class StreamBudget:
    """Bytes of Put and Get stream buffers a tenant may have in the daemon's heap at once
    (limits.stream_bytes_per_tenant; 0: no cap): Put's block arriving in pieces, and Get's
    reply batches, the one being sent and the one read ahead.

    Why per tenant, not per call: a client that stops reading a Get (or stops sending the rest
    of a split block) keeps those buffers alive until the call's deadline, one set per call,
    and a tenant may have limits.tenant_calls calls at once; with blocks of tens of MiB that
    was GiBs of heap from one tenant, whatever its host quota. A charge always fits when the
    tenant holds nothing, so one call of a block larger than the budget still works, alone.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._used: dict[str | None, int] = {}
        self._cond = threading.Condition()

    def _fits(self, who: str | None, n: int, own: int = 0) -> bool:
        """Whether n more bytes fit; `own`: what the asking call holds already (a call never
        waits on itself: alone, it may pass the budget by what it holds at once)."""
        used = self._used.get(who, 0)
        return not self.limit or used <= own or used + n <= self.limit

    def try_take(self, who: str | None, n: int, own: int = 0) -> bool:
        """Charge n bytes to `who` if they fit now; False (nothing charged) if not. `own`: as
        take's."""
        if n <= 0:
            return True
        with self._cond:
            if not self._fits(who, n, own):
                return False
            self._used[who] = self._used.get(who, 0) + n
            return True

    def take(self, who: str | None, n: int, deadline: float, what: str,
             own: int | Callable[[], int] = 0,
             ended: Callable[[], bool] | None = None) -> None:
        """Charge n bytes, waiting for the tenant's other calls to give theirs back until
        `deadline` (time.monotonic()); then ResourceExhausted. Waiting holds only this call,
        one of the tenant's own limits.tenant_calls. `own`: the bytes the asking call holds
        (or how to read them), never waited for; `ended()` true (woken by `wake`): the call
        is over, ResourceExhausted at once."""
        if n <= 0:
            return
        with self._cond:
            while not self._fits(who, n, own() if callable(own) else own):
                left = deadline - time.monotonic()
                if left <= 0 or (ended is not None and ended()):
                    raise self.exhausted(who, n, what)
                self._cond.wait(left)
            self._used[who] = self._used.get(who, 0) + n

    def wake(self) -> None:
        """Let every waiting take look at its `ended` again."""
        with self._cond:
            self._cond.notify_all()

    def give(self, who: str | None, n: int) -> None:
        if n <= 0:
            return
        with self._cond:
            left = self._used.get(who, 0) - n
            if left > 0:
                self._used[who] = left
            else:
                self._used.pop(who, None)
            self._cond.notify_all()

    def pressed(self, who: str | None) -> bool:
        """Whether the tenant holds half its budget or more (a Put then stores what it has
        gathered at once rather than hold it while its other calls wait for room)."""
        return bool(self.limit) and self.used(who) * 2 >= self.limit

    def used(self, who: str | None) -> int:
        with self._cond:
            return self._used.get(who, 0)

    def exhausted(self, who: str | None, n: int, what: str) -> ResourceExhausted:
        tenant = f"tenant {who}" if who else "this daemon's clients"
        return ResourceExhausted(
            f"{what} needs {n} bytes of stream buffers, but {tenant} already has "
            f"{self.used(who)} bytes in flight in other Put and Get streams (limit "
            f"limits.stream_bytes_per_tenant = {self.limit}); retry once those calls end")


class Tab(NamedTuple):
    """One call's account with the StreamBudget: its tenant and deadline."""
    budget: StreamBudget
    who: str | None
    deadline: float

    def take(self, n: int, what: str, own: int | Callable[[], int] = 0,
             ended: Callable[[], bool] | None = None) -> None:
        self.budget.take(self.who, n, self.deadline, what, own, ended)

    def try_take(self, n: int, own: int = 0) -> bool:
        return self.budget.try_take(self.who, n, own)

    def give(self, n: int) -> None:
        self.budget.give(self.who, n)


ROOM_WAIT_S = 2.0        # how long a Put message waits for the tenant's budget to have room


class PutCharges:
    """A Put call's messages, charged to its tenant's stream budget from their arrival until
    the blocks they carry are stored.

    Why: a Put holds up to a group of messages (kvstore/put_groups.py), the one being parsed
    and the ones read ahead (PUT_READ_AHEAD), up to 4 MiB each; a tenant's Puts that stop
    sending held all that for each of its calls, uncounted. A message is charged as the
    reader receives it (waiting up to ROOM_WAIT_S for the tenant's other streams to give room
    back, which also stops reading ahead: a budget held by stalled streams is refused soon,
    not at the deadline), and given back once the group holding its
    blocks is stored (`stored`), or at once for a piece of a split block, whose bytes are
    copied out of the message (`copied`; the block is charged whole where it starts). A
    tenant at half its budget has each Put store what it gathered at once (`pressed`): many
    honest Puts at once then keep landing instead of holding groups while the others wait.
    """

    def __init__(self, tab: Tab) -> None:
        self.tab = tab
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}     # message number -> bytes charged
        self._closed = False
        self.extra = 0                      # the call's other charge: an open split block

    def own(self) -> int:
        with self._lock:
            return sum(self._held.values()) + self.extra

    def arriving(self, raws: Iterable[bytes]) -> Iterator[bytes]:
        """`raws`, each message charged before it is handed on (the reader thread's side)."""
        tab = self.tab
        for m, raw in enumerate(raws):
            n = len(raw)
            until = min(tab.deadline, time.monotonic() + ROOM_WAIT_S)
            tab.budget.take(tab.who, n, until, f"Put message {m}", self.own,
                            lambda: self._closed)
            with self._lock:
                late = self._closed         # the call ended while this one waited
                if not late:
                    self._held[m] = n
            if late:
                self.tab.give(n)
                return
            yield raw

    def copied(self, m: int) -> None:
        with self._lock:
            n = self._held.pop(m, 0)
        self.tab.give(n)

    def stored(self, upto: int) -> None:
        """Messages 0..upto carry no block that is not stored yet."""
        with self._lock:
            done = [m for m in self._held if m <= upto]
            n = sum(self._held.pop(m) for m in done)
        self.tab.give(n)

    def close(self) -> None:
        """Give back every charge; a reader still waiting for room stops (ended)."""
        with self._lock:
            self._closed = True
            n = sum(self._held.values())
            self._held.clear()
        self.tab.give(n)
        self.tab.budget.wake()
