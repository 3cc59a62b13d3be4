"""A tenant's budget of stream buffer bytes in the daemon's heap (limits.stream_bytes_per_tenant).

Put's block arriving in pieces (kvstore/handlers/streams.py) and Get's reply batches
(kvstore/getcopy.py, stream) are charged here for as long as the client takes to send or read
them, so a tenant's stalled streams hold at most its budget, whatever its quota.
"""

from __future__ import annotations

import threading
import time
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

    def _fits(self, who: str | None, n: int) -> bool:
        used = self._used.get(who, 0)
        return not self.limit or not used or used + n <= self.limit

    def try_take(self, who: str | None, n: int) -> bool:
        """Charge n bytes to `who` if they fit now; False (nothing charged) if not."""
        if n <= 0:
            return True
        with self._cond:
            if not self._fits(who, n):
                return False
            self._used[who] = self._used.get(who, 0) + n
            return True

    def take(self, who: str | None, n: int, deadline: float, what: str) -> None:
        """Charge n bytes, waiting for the tenant's other calls to give theirs back until
        `deadline` (time.monotonic()); then ResourceExhausted. Waiting holds only this call,
        one of the tenant's own limits.tenant_calls."""
        if n <= 0:
            return
        with self._cond:
            while not self._fits(who, n):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self.exhausted(who, n, what)
                self._cond.wait(left)
            self._used[who] = self._used.get(who, 0) + n

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

    def take(self, n: int, what: str) -> None:
        self.budget.take(self.who, n, self.deadline, what)

    def try_take(self, n: int) -> bool:
        return self.budget.try_take(self.who, n)

    def give(self, n: int) -> None:
        self.budget.give(self.who, n)
