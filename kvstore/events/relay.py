"""An engine's own KV events, relayed on its merged stream, and what they teach the daemon.

Why relay: both routers take one event source per worker (and DP rank). To credit an engine
with its own GPU blocks and with what the node's daemon holds, its router entry points at a
stream the daemon serves for it, carrying both. The relay subscribes to the engine's endpoint,
forwards its GPU events (renumbered in the stream's own sequence, hashes made unsigned 64-bit
as the routers want), and drops its other media: an engine's offloading tiers are what
kvstore announces itself (vLLM's own CPU-tier events name the same hashes and would remove
kvstore's copies from the router's index).

What it teaches (TokenCache): each engine block's hash, parent and token ids. Engine adapters
store blocks by hash alone (vLLM's offload keys, SGLang's page hashes), so this is where the
daemon learns the token ids routers index by (texts.py).

An engine whose sequence numbers go back restarted (its GPU cache is gone) and an engine's
AllBlocksCleared both wipe its stream at the router: the stream is then started over with
what the daemon holds.

What it keeps (`gpu`): the GPU blocks the engine holds, as the events it forwarded say, one
event a block. A start-over the daemon makes for its own reasons (its publisher fell behind,
its start) sends AllBlocksCleared on the merged stream too, which wiped the engine's GPU blocks
at the router although the engine still held them: they came back only as the engine stored
each again. The stream re-announces them after the daemon's blocks, and to a consumer that
subscribes. A daemon restart starts with none: they are credited again as the engine sends
them, unless the engine's replay socket is known (`source_replay`).

What it asks (replay.py): with `source_replay`, the engine's replay socket, for the batches
from 0 at the daemon's start (the engine's history, as much as its buffer still has) and from
the first missing number on a gap in the engine's numbers (its PUB socket or ours dropped
them). The live batches wait meanwhile, then those the replay brought too are skipped as
repeats. The engine's ROUTER drops what a long answer does not fit in the pipe to us; the
replay asks again from the first batch it lost, within its deadline (`replay_resumes`,
replay.py). A replay that cannot fill a gap (the engine's buffer no longer has the batches, no
whole answer within the deadline) leaves it: counted (`replay_missed`, in batches), logged,
and the relay goes on.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

import zmq
from kvstore_client.common.engine_keys import fold_vllm_key as fold_key

from . import wire
from .replay import Replay, ReplayResult
from .stream import bind
from .texts import BlockText, check_lora, check_tokens

log = logging.getLogger("kvstore.events")

LOG_EVERY_S = 10.0
MAX_MESSAGES = 256          # engine messages handled per publisher tick, per relay
REPLAY_RETRY_S = 10         # no replay request this long after one that failed


Lora = tuple[int | None, str | None] | None


class TokenCache:
    """The last `cap` engine blocks seen: hash -> (parent hash, token ids, block size, LoRA),
    and the daemon key a vLLM adapter stores each under -> hash. Shared by every relay."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.by_hash: OrderedDict[int, tuple[int | None, tuple[int, ...], int, Lora]] = \
            OrderedDict()
        self.by_key: OrderedDict[bytes, int] = OrderedDict()

    def learn(self, h: int, parent: int | None, tokens: tuple[int, ...], bs: int,
              key: bytes | None, lora: Lora = None) -> None:
        if self.cap <= 0:
            return
        self.by_hash[h] = (parent, tokens, bs, lora)
        self.by_hash.move_to_end(h)
        if len(self.by_hash) > self.cap:
            self.by_hash.popitem(last=False)
        if key is not None:
            self.by_key[key] = h
            self.by_key.move_to_end(key)
            if len(self.by_key) > self.cap:
                self.by_key.popitem(last=False)

    def text(self, last: int, block_tokens: int) -> BlockText | None:
        """The text of a daemon block of `block_tokens` tokens ending at engine block `last`
        (a vLLM offload chunk is block_tokens / engine block size engine blocks)."""
        got = self.by_hash.get(last)
        if got is None:
            return None
        bs, lora = got[2], got[3]
        if bs <= 0 or block_tokens % bs:
            return None
        hashes, parts = [last], [got[1]]
        for _ in range(block_tokens // bs - 1):
            prev = got[0]
            got = self.by_hash.get(prev) if prev is not None else None
            if got is None or got[2] != bs or got[3] != lora:
                return None
            hashes.append(prev)
            parts.append(got[1])
        hashes.reverse()
        parts.reverse()
        t = BlockText(tuple(hashes), got[0], wire.pack([x for p in parts for x in p]), bs,
                      lora)
        return t if t.valid() else None


def engine_binds(endpoint: str) -> bool:
    """Whether an engine given `endpoint` binds its PUB socket (else it connects to it): the
    rule of vLLM's and SGLang's publishers (a wildcard host or an ipc path binds)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def attach(sub: zmq.Socket, source: str, key: str) -> None:
    """Subscribe to an engine's events given its own --kv-events-config endpoint, verbatim:
    where the engine binds (a wildcard host), connect to it on this machine; where it connects
    (a concrete address, the form that keeps it on loopback), bind that address for it."""
    if engine_binds(source):
        if source.startswith("tcp://"):
            host, _, port = source[len("tcp://"):].rpartition(":")
            if "::" in host:
                sub.setsockopt(zmq.IPV6, 1)
                source = f"tcp://[::1]:{port}"
            else:
                source = f"tcp://127.0.0.1:{port}"
        sub.connect(source)         # connecting never fails on an engine not up yet
    else:
        bind(sub, source, key)


class Relay:
    """One engine's event source (used by the publisher thread only; a replay reads on its
    own thread, replay.py). `replay`: the engine's replay_endpoint, verbatim ("": none);
    `replay_bytes`: what a replay may hold, its answer and the live batches waiting for it,
    each. `wake` (set by the service) wakes the publisher thread; a replay's thread calls it
    when its answer is in."""

    def __init__(self, ctx: zmq.Context, name: str, source: str, cache: TokenCache,
                 hwm: int, key: str, replay: str = "", replay_bytes: int = 64 << 20) -> None:
        self.name = name
        self.source = source
        self.cache = cache
        self.ctx = ctx
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, hwm)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        try:
            attach(self.sub, source, key)
        except BaseException:
            self.sub.close(0)
            raise
        self.last_seq: int | None = None
        # hash -> the BlockStored event of that one block, in the order stored (module
        # docstring); at most the token cache's cap, the oldest forgotten first.
        self.gpu: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self.counters: dict[str, int] = {"batches": 0, "events": 0, "dropped_media": 0,
                                         "bad_messages": 0, "restarts": 0, "gaps": 0,
                                         "int_hashes": 0, "gpu_record_dropped": 0,
                                         "replays": 0, "replay_batches": 0,
                                         "replay_failures": 0, "replay_missed": 0,
                                         "replay_resumes": 0}
        self._bad_logged = 0.0
        self._bad_unlogged = 0
        self._int_warned = False
        self.replay_endpoint = replay
        self.replay_bytes = replay_bytes
        self.wake: Callable[[], None] = _no_wake    # the publisher's, once it exists
        self._replay: Replay | None = None
        self._replay_at = 0.0           # when the next replay may be asked
        self._asked_at: int | None = None   # the live batch whose gap the last replay was for
        self._held: deque[tuple[int, bytes]] = deque()  # live batches read, not yet handled
        self._held_bytes = 0
        self._backlog: deque[tuple[int, bytes]] = deque()  # a replay's, not yet handled
        self._backlog_next = 0          # ...the number it should bring next
        # seq -> hash of each batch the last replay brought, to skip when it comes live too
        # (the engine sent it before the replay was served and the SUB socket had it queued)
        self._repeats: dict[int, int] = {}
        self._repeats_top = -1
        self._warned_at = 0.0
        self._closing = False
        if replay:
            self._ask(0, None)          # the engine's history, from its buffer's start

    # -- reading ------------------------------------------------------------------------------
    def pump(self) -> list[tuple[str, Any]]:
        """Read what the engine sent: [("forward", (ts, events, rank)) | ("restart", None)]
        in order, plus what it taught, returned as ("learned", [(key or None, hash)]).

        At most MAX_MESSAGES batches are handled a call (a replay's answer may be thousands:
        the rest waits for the next tick, which `wake` brings at once). While a replay is
        under way the live batches read wait for it, replay_bytes of them at most: past that
        the replay is given up. While a finished replay's batches or waiting ones are handled,
        reading stops at replay_bytes held (the rest waits in ZMQ, up to its hwm)."""
        out: list[tuple[str, Any]] = []
        learned: list[tuple[bytes | None, int]] = []
        for _ in range(MAX_MESSAGES):
            if self._held_bytes > self.replay_bytes:
                break
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or len(frames[1]) != 8:
                self._bad(f"{len(frames)} frames")
                continue
            self._held.append((int.from_bytes(frames[1], "big", signed=True), frames[2]))
            self._held_bytes += len(frames[2])
        if self._replay is not None:
            res = self._replay.result
            if res is None:
                if self._held_bytes <= self.replay_bytes:
                    return out
                self._replay.cancel(0)
                res = ReplayResult(self._replay.start, why="the engine's live batches "
                                   "waiting for it outgrew events.replay_bytes")
            self._replay = None
            self._finished(res)
        budget = MAX_MESSAGES
        while self._backlog and budget > 0:
            seq, payload = self._backlog.popleft()
            self._replayed(seq, payload, out, learned)
            budget -= 1
        while not self._backlog and self._held and budget > 0:
            seq, payload = self._held[0]
            if not self._take(seq, payload, out, learned):
                break                   # a replay was asked: this batch and the rest wait
            self._held.popleft()
            self._held_bytes -= len(payload)
            budget -= 1
        if self._replay is None and (self._backlog or self._held):
            self.wake()                 # more to handle: the next tick, not in a second
        if learned:
            out.append(("learned", learned))
        return out

    def _take(self, seq: int, payload: bytes, out: list, learned: list) -> bool:
        """One live batch; False when it showed a gap and a replay was asked for the batches
        before it (it and those after it wait)."""
        may_ask = True
        if self.last_seq is not None and seq <= self.last_seq:
            brought = self._repeats.get(seq)
            if brought is not None and (brought == hash(payload) or seq == self._asked_at):
                return True             # a replay brought it already (that one is kept)
            # An engine whose replay differs from its live batches is not asked again for
            # this restart: each answer would bring the same difference, then a restart.
            may_ask = brought is None
            self.counters["restarts"] += 1
            log.info("events: engine %s restarted (its sequence went from %d to %d): its "
                     "stream starts over", self.name, self.last_seq, seq)
            self.gpu.clear()
            self._repeats.clear()
            self.last_seq = self._asked_at = None
            out.append(("restart", None))
        # with a replay socket the engine's stream is wanted from its start (seq 0)
        want = self.last_seq + 1 if self.last_seq is not None else \
            (0 if self.replay_endpoint else None)
        if want is not None and seq > want:
            if seq == self._asked_at:
                self._missed(want, seq, "the replay did not bring them")
            else:
                self.counters["gaps"] += 1
                if may_ask and self._ask(want, seq):
                    return False
                if self.replay_endpoint:
                    self._missed(want, seq, "not asked for: its replay socket failed less "
                                 f"than {REPLAY_RETRY_S} s ago" if may_ask else "not asked "
                                 "for: its replay and live batches of one number differ")
        if self._asked_at is not None and seq >= self._asked_at:
            self._asked_at = None
        if self._repeats and seq > self._repeats_top:
            self._repeats.clear()       # past what the last replay brought
        self._apply(seq, payload, out, learned)
        return True

    def _apply(self, seq: int, payload: bytes, out: list, learned: list) -> bool:
        try:
            ts, events, rank = wire.decode_batch(payload)
        except ValueError as e:
            self._bad(str(e))       # its number too may be garbage: not taken
            return False
        self.last_seq = seq
        fwd = self._translate(events, learned, out)
        self.counters["batches"] += 1
        if fwd:
            out.append(("forward", (ts, fwd, rank)))
        return True

    # -- replays ------------------------------------------------------------------------------
    def _ask(self, start: int, gap_at: int | None) -> bool:
        """Ask the engine's replay socket for its batches from `start` (one request at a
        time; none for REPLAY_RETRY_S after one that failed). `gap_at`: the live batch that
        showed the gap (None at the start)."""
        if not self.replay_endpoint or self._closing or self._replay is not None \
                or time.monotonic() < self._replay_at:
            return False
        self._asked_at = gap_at
        self.counters["replays"] += 1
        self._replay = Replay(self.ctx, self.replay_endpoint, start, self.replay_bytes,
                              lambda: self.wake())
        return True

    def _finished(self, res: ReplayResult) -> None:
        """Take a finished replay's answer: its batches are handled before the live ones that
        waited for it (_replayed)."""
        self._backlog = deque(res.batches)
        self._backlog_next = res.start
        self.counters["replay_resumes"] += max(res.rounds - 1, 0)   # asked again: drops
        if res.complete:
            return
        self.counters["replay_failures"] += 1
        if self.last_seq is None and not self._held and not res.answered:
            # the request at the start, unanswered: the engine is not up yet, and its first
            # batch is read live (a later gap asks again)
            log.info("events: engine %s: its replay socket %s answered nothing (%s): the "
                     "engine is read from its next batch", self.name, self.replay_endpoint,
                     res.why)
            return
        self._replay_at = time.monotonic() + REPLAY_RETRY_S
        self._warn("events: engine %s: its replay socket %s answered no whole replay from "
                   "%d (%s); the relay goes on with the %d batch(es) it got (and asks again "
                   "%d s from now at the earliest)", self.name, self.replay_endpoint,
                   res.start, res.why, len(res.batches), REPLAY_RETRY_S)

    def _replayed(self, seq: int, payload: bytes, out: list, learned: list) -> None:
        """Forward a batch a replay brought, unless the relay has it already (a gap's
        batches; at the start, the engine's history); remember it, to skip it as a repeat
        when it comes live too (the engine sent it before it served the replay, and the SUB
        socket had it queued)."""
        if self.last_seq is not None and seq <= self.last_seq:
            return
        want = self._backlog_next if self.last_seq is None else \
            max(self.last_seq + 1, self._backlog_next)
        if seq > want:
            self._missed(want, seq, "the engine's buffer no longer has them")
        self._backlog_next = seq + 1
        self._repeats[seq] = hash(payload)
        self._repeats_top = seq
        if self._apply(seq, payload, out, learned):
            self.counters["replay_batches"] += 1

    def _missed(self, want: int, seq: int, why: str) -> None:
        self.counters["replay_missed"] += seq - want
        self._warn("events: engine %s: its batches %d..%d are lost (%s): the router misses "
                   "their events until the engine stores or removes those blocks again",
                   self.name, want, seq - 1, why)

    def _warn(self, msg: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._warned_at >= LOG_EVERY_S:
            self._warned_at = now
            log.warning(msg + " (logged once per %d s)", *args, LOG_EVERY_S)

    def stop_replay(self) -> None:
        """No replay from now on; one under way is cancelled (its thread gone on return, so
        it calls `wake` no more)."""
        self._closing = True
        rep, self._replay = self._replay, None
        if rep is not None:
            rep.cancel()

    def _translate(self, events: list[dict[str, Any]], learned: list,
                   out: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        fwd: list[dict[str, Any]] = []
        for ev in events:
            kind = ev.get("type")
            medium = ev.get("medium")
            if kind == "AllBlocksCleared":
                if fwd:
                    out.append(("forward", (time.time(), fwd, None)))
                    fwd = []
                self.gpu.clear()
                out.append(("restart", None))
                continue
            if kind not in ("BlockStored", "BlockRemoved"):
                continue
            if medium not in (None, "GPU"):
                self.counters["dropped_media"] += 1
                continue
            raw = ev.get("block_hashes")
            if not isinstance(raw, list) or not all(isinstance(h, (int, bytes)) for h in raw):
                self._bad("block_hashes is not a list of ints or bytes")
                continue
            ev = dict(ev)
            ev["block_hashes"] = [wire.u64(h) for h in raw]
            if kind == "BlockStored":
                p = ev.get("parent_block_hash")
                ev["parent_block_hash"] = wire.u64(p) if isinstance(p, (int, bytes)) else None
                self._learn(raw, p, ev, learned)
                self._hold(ev)
            else:
                for h in ev["block_hashes"]:
                    self.gpu.pop(h, None)
            fwd.append(ev)
            self.counters["events"] += 1
        return fwd

    def _hold(self, ev: dict[str, Any]) -> None:
        """Record a forwarded BlockStored as one event a block (module docstring)."""
        hashes, tokens, bs = ev["block_hashes"], ev.get("token_ids"), ev.get("block_size")
        whole = isinstance(tokens, list) and isinstance(bs, int) and bs > 0 \
            and len(tokens) == bs * len(hashes)
        prev = ev["parent_block_hash"]
        for i, h in enumerate(hashes):
            one = dict(ev, block_hashes=[h], parent_block_hash=prev)
            if whole:
                one["token_ids"] = tokens[bs * i:bs * (i + 1)]
            elif len(hashes) > 1:
                return              # tokens that do not split by block: not re-announced
            self.gpu[h] = one
            self.gpu.move_to_end(h)
            prev = h
        while len(self.gpu) > max(self.cache.cap, 1):
            self.gpu.popitem(last=False)
            self.counters["gpu_record_dropped"] += 1

    def held_gpu(self) -> list[dict[str, Any]]:
        """The engine's GPU blocks as BlockStored events, in the order they were stored."""
        return list(self.gpu.values())

    def _learn(self, raw: list, parent: Any, ev: dict[str, Any], learned: list) -> None:
        tokens, bs = ev.get("token_ids"), ev.get("block_size")
        if (not isinstance(tokens, list) or not isinstance(bs, int) or bs <= 0
                or len(tokens) != bs * len(raw)):
            return
        group = ev.get("group_idx") or 0
        try:
            tokens = check_tokens(tokens)
            lora = check_lora(ev.get("lora_id"), ev.get("lora_name"))
        except (ValueError, TypeError):
            return
        prev = wire.u64(parent) if isinstance(parent, (int, bytes)) else None
        for i, h in enumerate(raw):
            hv = wire.u64(h)
            key = None
            if isinstance(h, bytes) and isinstance(group, int) and 0 <= group < 1 << 32:
                key = fold_key(h + group.to_bytes(4, "big"))
            elif isinstance(h, int) and not self._int_warned:
                self._int_warned = True
                self.counters["int_hashes"] += 1
                log.warning("events: engine %s publishes 64-bit block hashes; kvstore can name "
                            "the token ids of a vLLM engine's blocks only from its full hashes: "
                            "start it with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 (the relay "
                            "still hands routers 64-bit ones)", self.name)
            self.cache.learn(hv, prev, tuple(tokens[bs * i:bs * (i + 1)]), bs, key, lora)
            learned.append((key, hv))
            prev = hv

    def _bad(self, what: str) -> None:
        self.counters["bad_messages"] += 1
        self._bad_unlogged += 1
        now = time.monotonic()
        if now - self._bad_logged >= LOG_EVERY_S:
            log.warning("events: engine %s (%s): dropped %d malformed message(s) (last: %s)",
                        self.name, self.source, self._bad_unlogged, what)
            self._bad_logged, self._bad_unlogged = now, 0

    def close(self) -> None:
        self.stop_replay()
        self.sub.close(linger=0)


def _no_wake() -> None:
    pass
