"""Writers waiting for host room: handed a slot by the landing that frees it.

Why: a writer short of host room waits for a demotion in flight to land (host_room.py). With
one condition for every waiter, each landing woke them all; each took the store lock, tried
for a slot, and most went back to sleep, because a landing frees the room between the
watermarks (a few writers' worth) while all 16 of bench/tail.py's writers wait. Those
fruitless wake-ups were a third of all takes of the store lock, each one more wait for every
load and lookup behind it.

Here each waiter has its own condition, and the landing (under the lock) does for each waiter
what it would have done on waking, oldest first: a waiter none of whose flights has landed
sleeps on; one that gets the slots it asks for is handed them and woken; one that does not,
and would wait again (room is still coming, as much as it lacks), keeps what it got and is
kept waiting for the flights in flight now; any other is woken to go on as before (evict
itself, or give up). A Reserve short of room asks for every slot it still lacks at once: served
a slot at a time, each of its slots went to the back of the queue, and every Reserve took as
long as the slowest.

A waiter left short while an evictor's run goes on (`running`) sleeps on too, though no batch
is in flight at that instant: the evictor picks its next batch in the same hold, so a waiter
woken then only found that batch in flight and slept again (one more take of the store lock
each time). It is looked at again at each landing, and woken at the run's end if no batch is
in flight then (to evict for itself, or give up). Its deadline holds throughout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..state import StoreState


@dataclass(eq=False)
class RoomWant:
    """One waiter: `count` slots of `nbytes` (each leaving `share` bytes free) in the shared
    segment; a Reserve of n slots asks for all it still lacks, and is served as one."""
    nbytes: int
    share: int
    promotion: bool
    count: int = 1
    pending: list[threading.Event] = field(default_factory=list)
    offs: list[int] = field(default_factory=list)   # the slots landings took for it
    woken: bool = False
    cond: threading.Condition | None = None


class RoomWaits:
    def __init__(self, state: StoreState) -> None:
        self.state = state
        self.wants: list[RoomWant] = []      # in the order they began waiting

    def wait(self, want: RoomWant, pending: list[threading.Event], left: Callable[[], float]
             ) -> bool:
        """Sleep until a landing hands `want` its slots (`want.offs`: all it asked for, or
        fewer where no more room is coming) or wakes it (locked; the lock is released
        meanwhile). False when `left()` ran out first (any slot it was handed goes back)."""
        want.pending, want.woken, want.offs = pending, False, []
        if want.cond is None:
            want.cond = threading.Condition(self.state.lock)
        self.wants.append(want)
        try:
            while not want.woken:
                t = left()
                if t <= 0:
                    self._give_back(want)
                    return False
                want.cond.wait(t)
            return True
        except BaseException:
            self._give_back(want)           # handed slots it will not use
            raise
        finally:
            if not want.woken:
                self.wants.remove(want)

    def _give_back(self, want: RoomWant) -> None:
        for off in want.offs:
            self.state.host.free(off)
        want.offs = []

    def serve(self, take: Callable[[RoomWant], int | None],
              keeps_waiting: Callable[[RoomWant], bool],
              flights: set[threading.Event], running: bool) -> None:
        """A flight has landed, or an evictor's run ended (locked): each waiter that one of its
        flights' landing would have woken, or left waiting for the run, in the order they
        began waiting, is handed the slots it asked for (`take`, one at a time), or kept
        waiting for the rest from the flights now in flight (`keeps_waiting`: it would wait
        again) or, with none in flight, for the batches of the evictor's run going on
        (`running`), or woken with what it got."""
        if not self.wants:
            return
        for w in list(self.wants):
            if w.pending and not any(ev.is_set() for ev in w.pending):
                continue
            while len(w.offs) < w.count:
                off = take(w)
                if off is None:
                    break
                w.offs.append(off)
            if len(w.offs) < w.count and not w.promotion:
                if flights and keeps_waiting(w):
                    w.pending = list(flights)
                    continue
                if running:
                    w.pending = []          # looked at again at each landing and the run's end
                    continue
            w.woken = True
            self.wants.remove(w)
            w.cond.notify()
