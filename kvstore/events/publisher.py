"""The publisher thread: residency changes in, vLLM-format batches out, off the store lock.

Each tick it reads the engines' relays and the replay sockets, turns the queued residency
changes (recorder.py) into BlockStored / BlockRemoved events for every stream that publishes
the block's namespace, and sends them in batches, with heartbeats and its counters. Where a
block's token text comes from, and the blocks that wait for theirs, are pending.py's; the walk
of what the daemon holds is held.py's. The thread holds the store lock only to take a slice
of the index when a stream starts over, and to keep a text learned late (a vLLM block named by
its engine's events after it was stored) with its block.

A stream starts over (AllBlocksCleared, then every block held, parents first) when the daemon
starts, when the queue overflowed, and when its engine restarted. The walk of the index runs
in slices with the lock released between them while changes keep queuing: replaying every
change queued since the walk began after it gives the true state, since each change a slice
already saw is a repeat (Stored twice, or Removed of a block the router no longer has) and
each it missed comes after it. Nothing here ever waits on the lock without a deadline, so the
store's close (which holds it) can always stop this thread.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import Counter
from itertools import repeat, starmap
from operator import itemgetter
from typing import Any

import zmq
from xxhash import xxh3_64_intdigest

from . import wire
from .held import held_blocks
from .peers import Guard
from .pending import PendingTexts
from .recorder import CommitRun, Item, Recorder
from .relay import Relay, TokenCache
from .runs import EventRun
from .spans import chain_span, removal_span
from .stream import Stream
from .texts import OWN, SGLANG, VLLM, LazyText, own_hash, resolve, sglang_hash

log = logging.getLogger("kvstore.events")

DRAIN_MAX = 65536           # queued changes turned into events per tick
LOCK_WAIT_S = 0.2
# The first announcement waits this long after the streams are bound: routers subscribed to
# the daemon's previous run reconnect on their own (ZMQ retries every 0.1 s), and PUB sends
# nothing to a subscriber before its subscription arrives.
START_DELAY_S = 1.0
# A stream quiet this long sends an empty batch, so a consumer that missed batches (it
# reconnected late, or dropped them at its high-water mark) sees the gap in the numbers and
# asks the replay socket for them, instead of waiting for the next change.
HEARTBEAT_S = 5.0
# A consumer that subscribes is told what the daemon holds (BlockStored of every block, no
# AllBlocksCleared: the other subscribers of the stream just hear repeats). Routers fetch only
# the batches missed after the first they saw (vllm-router: none before it), so without this
# a router started after the daemon would never learn what the daemon already holds. At most
# once per stream this often, whatever the subscriptions.
REANNOUNCE_EVERY_S = 2.0
# After a tick that drained changes, the thread looks at the queue every interval_s for this
# long without being woken (the recorder sees `woken` still set and writes nothing to the
# pipe). Why: the wake-up is a syscall made under the store lock, and it hands the GIL to the
# publisher, so a store that wakes it waits for the GIL with the lock held; a daemon storing
# steadily now wakes it once per burst, not once per interval. The price: up to
# LINGER_S / interval_s empty ticks after each burst (tens of microseconds each).
LINGER_S = 0.5
_GKEY, _TIERS_OF, _ENTERED, _TEXT = (itemgetter(i) for i in (0, 1, 2, 4))     # of an Item
# The store's copy of this thread's counters (Stats, metrics) is brought up to date after a
# tick that drained changes and otherwise at most this often: rebuilding it cost ~50 us, and
# a lingering thread ticks every interval_ms while stores come, on the GIL they need.
COUNTERS_EVERY_S = 0.1


class Publisher:
    """The thread and what only it touches (the streams, the relays, the wake pipe); built and
    closed by Events (service.py). `cache` (the relays' engine blocks) and `pending_cap` are
    its PendingTexts'."""

    def __init__(self, state: Any, recorder: Recorder, streams: list[Stream],
                 relays: dict[int, Relay], cache: TokenCache, ctx: zmq.Context,
                 batch_events: int, interval_s: float, pending_cap: int,
                 guard: Guard | None = None) -> None:
        self.state = state     # the store's shared state (kvstore/state.py)
        self.guard = guard     # the bound sockets' connection caps (peers.py), for its count
        self.recorder = recorder
        self.streams = streams
        self.relays = relays
        self.ctx = ctx
        self.batch_events = batch_events
        self.interval_s = interval_s
        self.counters: Counter = Counter()
        self.vh: dict[bytes, tuple[int, ...]] = {}      # vLLM blocks announced -> their hashes
        # Where texts come from, and the blocks waiting for theirs (an engine's events late).
        self.pending = PendingTexts(state, recorder, cache, pending_cap, self.counters)
        self._poller = zmq.Poller()
        for r in relays.values():
            self._poller.register(r.sub, zmq.POLLIN)
        for s in streams:
            self._poller.register(s.pub, zmq.POLLIN)        # subscriptions
            if s.replay is not None:
                self._poller.register(s.replay, zmq.POLLIN)
        self._replay_polled = {id(s) for s in streams if s.replay is not None}
        # The recorder wakes this thread through a pipe when a change queues and it is
        # asleep (recorder.woken): an idle daemon's publisher costs no CPU (a wake-up every
        # tick cost ~0.1-0.3 ms of CPU each on a busy machine, cold caches and all).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, zmq.POLLIN)
        recorder.wake = self._wake
        self._reannounce: dict[int, float] = {}     # stream -> when it may announce again
        self._announced_at = [0.0] * len(streams)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._overflow_logged = 0.0
        self._ns_cache = recorder._ns           # read-only here: the recorder fills it
        self._started = False
        self._bound_at = time.monotonic()
        self._drained_at = 0.0          # when a tick last drained changes (LINGER_S)
        self._synced_at = 0.0           # when the store's counters were last brought up to date

    # -- lifecycle ----------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"w")
        except (BlockingIOError, OSError):
            pass                        # full: the thread has a wake-up to read already

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvstore-events",
                                            daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stop the thread, tell every stream the daemon holds nothing now (nothing can be
        loaded from a stopped daemon; its restart announces what it still holds), close."""
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(10.0)
        self.recorder.wake = _no_wake
        if self._wake_w >= 0:
            os.close(self._wake_r)
            os.close(self._wake_w)
            self._wake_r = self._wake_w = -1
        for s in self.streams:
            try:
                s.send([wire.CLEARED])
            except zmq.ZMQError:
                pass
            s.close(linger_s=1.0)
        for r in self.relays.values():
            r.close()
        self.ctx.term()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._tick()
            except Exception:  # noqa: BLE001 - the publisher must outlive any one bad event
                self.counters["events_publisher_errors"] += 1
                log.exception("events: publisher")
                self._stop.wait(self.interval_s)
        self._sync_counters()

    def _poll_replays(self) -> None:
        """Poll a replay socket only once its stream may serve the next request: a request
        left unread keeps it readable (level-triggered), and polling it meanwhile would make
        this thread spin until then (_timeout_s wakes it when the wait is over)."""
        now = time.monotonic()
        for s in self.streams:
            if s.replay is None:
                continue
            due = now >= s.replay_at
            if due != (id(s) in self._replay_polled):
                if due:
                    self._poller.register(s.replay, zmq.POLLIN)
                    self._replay_polled.add(id(s))
                else:
                    self._poller.unregister(s.replay)
                    self._replay_polled.discard(id(s))

    def _tick(self) -> None:
        self._poll_replays()
        ready = dict(self._poller.poll(math.ceil(self._timeout_s() * 1000)))
        if self._stop.is_set():
            return
        if self._wake_r in ready:
            _read_all(self._wake_r)
            # Changes are queuing: let them gather for interval_s (a store's blocks, the
            # stores after it) and send them at once, rather than wake per change.
            if self._stop.wait(self.interval_s):
                return
        now = time.monotonic()
        for i, st in enumerate(self.streams):
            # Only a stream whose socket polled readable has subscriptions to read: a read
            # of an empty one raises zmq.Again, ~80 us of GIL on every tick (the poll is
            # level-triggered, so one left unread shows again next tick). Replay requests
            # likewise.
            if st.pub in ready and st.subscribed():
                self._reannounce[i] = self._announced_at[i] + REANNOUNCE_EVERY_S
        if not self._started:
            if time.monotonic() < self._bound_at + START_DELAY_S:
                return
            self._started = True
            self._start_over(set(range(len(self.streams))))
        for i, relay in self.relays.items():
            for kind, arg in relay.pump():
                if kind == "forward":
                    ts, events, rank = arg
                    packed = [wire.pack(e) for e in events]
                    for j in range(0, len(packed), self.batch_events):
                        self.streams[i].send(packed[j:j + self.batch_events], ts, rank)
                elif kind == "restart":
                    self._start_over({i})
                else:
                    self._learned(arg)
        for s in self.streams:
            if s.replay is not None and s.replay in ready:     # (as subscriptions, above)
                s.serve_replay()
        if self.recorder.overflowed:
            self._overflow()
        due = {i for i, at in self._reannounce.items() if at <= now}
        if due and self._started:
            self._start_over(due, clear=False)
        drained = self._drain()
        self._keep_commits()
        self._linger(drained)
        self.pending.keep_joins(self._locked)
        now = time.monotonic()
        for st in self.streams:
            if now - st.sent_at >= HEARTBEAT_S:
                st.send([], empty_ok=True)
        if drained or now - self._synced_at >= COUNTERS_EVERY_S:
            self._synced_at = now
            self._sync_counters()

    def _linger(self, drained: int) -> None:
        """Keep looking at the queue on a timer while changes come (the recorder's `woken`
        stays set, so it does not wake this thread); LINGER_S after the last, go back to
        sleeping until woken."""
        now = time.monotonic()
        if drained:
            self._drained_at = now
            return
        rec = self.recorder
        if rec.woken and now - self._drained_at >= LINGER_S:
            rec.woken = False           # a change queued from now on wakes this thread
            if rec.queue or rec.overflowed:
                rec.woken = True        # one queued just before: the next tick takes it

    def _timeout_s(self) -> float:
        """How long the thread may sleep: until a timed duty (the first announcement, a
        heartbeat, a re-announcement) is due; no longer than a second. Changes, sockets and
        close wake it sooner (the wake pipe and the poller)."""
        now = time.monotonic()
        if not self._started:
            return max(0.0, self._bound_at + START_DELAY_S - now)
        if self.recorder.queue or self.recorder.overflowed or self.pending.joins:
            return 0.0                      # left from a tick that stopped at DRAIN_MAX
        due = now + (self.interval_s if self.recorder.woken else 1.0)     # lingering
        for st in self.streams:
            due = min(due, st.sent_at + HEARTBEAT_S)
        for at in self._reannounce.values():
            due = min(due, at)
        for st in self.streams:
            if st.replay is not None and id(st) not in self._replay_polled:
                due = min(due, st.replay_at)        # a request may be waiting (_poll_replays)
        return max(0.0, due - now)

    def _sync_counters(self) -> None:
        """Copy this thread's counters into the store's (Stats and the metrics show them);
        keys only this thread writes, so it needs no lock."""
        totals: Counter = Counter(self.counters)
        totals["events_overflows"] = self.recorder.overflows
        if self.guard is not None:
            totals["events_connections_shut"] = self.guard.shut_total
        for s in self.streams:
            totals.update({f"events_{k}": v for k, v in s.counters.items()})
        for r in self.relays.values():
            totals.update({f"events_relay_{k}": v for k, v in r.counters.items()})
        c = self.state.counters
        for k, v in totals.items():
            c[k] = v

    # -- the lock -----------------------------------------------------------------------------
    def _locked(self) -> bool:
        """Take the store lock, or False once the publisher is stopping (close holds it)."""
        lock = self.state.lock
        while not lock.acquire(timeout=LOCK_WAIT_S):
            if self._stop.is_set():
                return False
        return True

    def _keep_commits(self) -> None:
        """Make the book entries of the commits the recorder took (Recorder.flush), here
        rather than in the commit: the book is what a demotion, a start-over and a later
        change of those blocks read their texts from. A commit changed or read meanwhile was
        flushed by that reader already."""
        rec = self.recorder
        if not rec.unkept or not self._locked():
            return
        try:
            rec.flush()
        finally:
            self.state.lock.release()

    # -- starting over ------------------------------------------------------------------------
    def _overflow(self) -> None:
        if not self._locked():
            return
        try:
            self.recorder.queue.clear()
            self.recorder.taken = self.recorder.queued
            self.recorder.overflowed = False
        finally:
            self.state.lock.release()
        self.vh.clear()
        self.pending.clear()
        now = time.monotonic()
        if now - self._overflow_logged > 60:
            self._overflow_logged = now
            log.warning("events: the publisher fell %d residency changes behind (events."
                        "max_queue); every stream starts over with AllBlocksCleared and what "
                        "the daemon holds (counter events_overflows; logged once a minute)",
                        self.recorder.max_queue)
        self._start_over(set(range(len(self.streams))))

    def _start_over(self, which: set[int], clear: bool = True) -> None:
        """AllBlocksCleared on the streams `which` (unless `clear` is False: a re-announcement
        for a new subscriber), then every block they publish that the daemon holds, parents
        before children."""
        now = time.monotonic()
        for i in which:
            if clear:
                self.streams[i].send([wire.CLEARED])
            self._reannounce.pop(i, None)
            self._announced_at[i] = now
        want = 0
        for i in which:
            want |= 1 << i
        self._keep_commits()            # the walk reads texts from the book
        held = held_blocks(self.state, self.recorder, self.pending, self.vh, want,
                           self._locked)
        if held is None:
            return
        out: dict[int, list[bytes]] = {i: [] for i in which}
        for _, tiers, text, mask in held:
            for t in tiers:
                self._emit(out, mask, text.event(wire.MEDIUM[t]))
        for i in which:                 # a relayed engine's own GPU blocks (relay.py)
            relay = self.relays.get(i)
            if relay is not None:
                out[i] += [wire.pack(e) for e in relay.held_gpu()]
        self._send(out)
        self.counters["events_start_overs" if clear else "events_reannouncements"] += 1

    # -- changes ------------------------------------------------------------------------------
    def _drain(self) -> int:
        """Turn the queued changes into events; returns how many it took. A commit's blocks
        (a CommitRun, or consecutive changes whose texts are one LazyTexts, in order) and
        consecutive removals of SDK-stored blocks from one tier reach the run at once: the
        same events _apply makes of each change in turn, without Python work per block on the
        GIL the requests need."""
        q = self.recorder.queue
        if not q:
            return 0                    # a lingering tick: most find nothing (~30 us saved)
        out: dict[int, list[bytes]] = {i: [] for i in range(len(self.streams))}
        run = EventRun(lambda mask, ev: self._emit(out, mask, ev))
        ns_cache, ns = self._ns_cache, self.recorder.ns
        chain: list[Any] | None = None      # [LazyTexts, first, end, tier, mask]
        gone: list[bytes] = []              # SDK-stored blocks leaving `gone_at`
        gone_at: tuple[str, int] | None = None

        def flush() -> None:
            nonlocal chain, gone, gone_at
            if chain is not None:
                owner, first, end, tier, mask = chain
                run.stored_chain(mask, wire.MEDIUM[tier], owner.packed(), first, end)
                chain = None
            if gone_at is not None:
                run.removed_each(gone_at[1], wire.MEDIUM[gone_at[0]],
                                list(map(xxh3_64_intdigest, gone)))     # own_hash, in C
                gone, gone_at = [], None

        # Taken off the queue at once (popleft called in C; changes queued meanwhile stay for
        # the next tick), so that runs of alike changes can be measured in C (spans.py).
        n = min(len(q), DRAIN_MAX)
        items = list(starmap(q.popleft, repeat((), n)))
        gkeys = list(map(_GKEY, items))
        tiers_of = list(map(_TIERS_OF, items))
        texts = list(map(_TEXT, items))
        entered_of = list(map(_ENTERED, items))
        rec = self.recorder
        rec.taken += n                      # (a CommitRun adds the rest of its blocks below)
        j = 0
        while j < n:
            item = items[j]
            if type(item) is CommitRun:     # (the recorder queues only published ones)
                flush()
                got = ns_cache.get(item.gkey[:16])
                chain = [item.text, 0, item.n, item.tiers[0],
                         (got if got is not None else ns(item.gkey[:16]))[1]]
                rec.taken += item.n - 1
                j += 1
                continue
            g, tiers, entered, _, text = item
            if len(tiers) == 1:
                if type(text) is LazyText:          # a commit's block, entering a tier
                    owner, i = text.func.__self__, text.args[0]
                    k = chain_span(texts, tiers_of, j, n)
                    if (chain is not None and owner is chain[0] and i == chain[2]
                            and tiers[0] == chain[3]):
                        chain[2] = i + k
                        j += k
                        continue
                    got = ns_cache.get(g[:16])
                    kind, mask = got if got is not None else ns(g[:16])
                    if kind == OWN and mask:
                        flush()
                        chain = [owner, i, i + k, tiers[0], mask]
                        j += k
                        continue
                elif not entered:
                    got = ns_cache.get(g[:16])
                    kind, mask = got if got is not None else ns(g[:16])
                    if kind == OWN and mask:
                        at = (tiers[0], mask)
                        if at != gone_at:
                            flush()
                            gone_at = at
                        k = removal_span(gkeys, tiers_of, texts, entered_of, j, n) \
                            if text is None else 1
                        gone.extend(gkeys[j:j + k])
                        j += k
                        continue
            flush()
            self._apply(item, run)
            j += 1
        flush()
        run.close()
        self._send(out)
        return n

    def _apply(self, item: Item, run: EventRun) -> None:
        g, tiers, entered, gone, text = item
        got = self._ns_cache.get(g[:16])
        kind, mask = got if got is not None else self.recorder.ns(g[:16])
        if not mask:
            return
        if entered:
            text = self.pending.find(g, kind) if text is None else resolve(text)
            if text is None:
                if kind != OWN:
                    self.pending.pend(g, kind, tiers)
                return
            if kind == VLLM:
                self.vh[g] = text.hashes
            for t in tiers:
                run.stored(mask, wire.MEDIUM[t], text)
            return
        self.pending.unpend(g, tiers, gone)
        if kind == VLLM:
            hashes = self.vh.pop(g, None) if gone else self.vh.get(g)
            if hashes is None:
                return                  # never announced
        elif kind == SGLANG:
            hashes = (sglang_hash(g[16:]),)
        else:
            hashes = (own_hash(g),)
        for t in tiers:
            run.removed(mask, wire.MEDIUM[t], hashes)

    @staticmethod
    def _emit(out: dict[int, list[bytes]], mask: int, ev: bytes) -> None:
        if mask == 1 and len(out) == 1:
            out[0].append(ev)           # one stream (the common case)
            return
        for i, evs in out.items():
            if mask >> i & 1:
                evs.append(ev)

    def _send(self, out: dict[int, list[bytes]]) -> None:
        n = self.batch_events
        for i, evs in out.items():
            for j in range(0, len(evs), n):
                self.streams[i].send(evs[j:j + n])

    def _learned(self, learned: list[tuple[bytes | None, int]]) -> None:
        """An engine's events named blocks: announce those that waited for their text."""
        found = self.pending.learned(learned)
        if not found:
            return
        out: dict[int, list[bytes]] = {i: [] for i in range(len(self.streams))}
        for g, kind, mask, text, tiers in found:
            if kind == VLLM:
                self.vh[g] = text.hashes
            for t in sorted(tiers):
                self._emit(out, mask, text.event(wire.MEDIUM[t]))
        self._send(out)


def _read_all(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _no_wake() -> None:
    pass
