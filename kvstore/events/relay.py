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
subscribes. A daemon restart starts with none (the engine's events while it was down are
lost): they are credited again as the engine sends them.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import zmq
from kvstore_client.common.engine_keys import fold_vllm_key as fold_key

from . import wire
from .stream import bind
from .texts import BlockText, check_lora, check_tokens

log = logging.getLogger("kvstore.events")

LOG_EVERY_S = 10.0
MAX_MESSAGES = 256          # engine messages handled per publisher tick, per relay


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
    """One engine's event source (used by the publisher thread only)."""

    def __init__(self, ctx: zmq.Context, name: str, source: str, cache: TokenCache,
                 hwm: int, key: str) -> None:
        self.name = name
        self.source = source
        self.cache = cache
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
                                         "int_hashes": 0, "gpu_record_dropped": 0}
        self._bad_logged = 0.0
        self._bad_unlogged = 0
        self._int_warned = False

    def pump(self) -> list[tuple[str, Any]]:
        """Read what the engine sent: [("forward", (ts, events, rank)) | ("restart", None)]
        in order, plus what it taught, returned as ("learned", [(key or None, hash)])."""
        out: list[tuple[str, Any]] = []
        learned: list[tuple[bytes | None, int]] = []
        for _ in range(MAX_MESSAGES):
            try:
                frames = self.sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) != 3 or len(frames[1]) != 8:
                self._bad(f"{len(frames)} frames")
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            try:
                ts, events, rank = wire.decode_batch(frames[2])
            except ValueError as e:
                self._bad(str(e))
                continue
            if self.last_seq is not None and seq <= self.last_seq:
                self.counters["restarts"] += 1
                log.info("events: engine %s restarted (its sequence went from %d to %d): its "
                         "stream starts over", self.name, self.last_seq, seq)
                self.gpu.clear()
                out.append(("restart", None))
            elif self.last_seq is not None and seq > self.last_seq + 1:
                self.counters["gaps"] += 1
            self.last_seq = seq
            fwd = self._translate(events, learned, out)
            self.counters["batches"] += 1
            if fwd:
                out.append(("forward", (ts, fwd, rank)))
        if learned:
            out.append(("learned", learned))
        return out

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
        self.sub.close(linger=0)
