"""KV events of one daemon: its streams, the residency listener and the publisher thread.

Built by the store when [events] is on (pyzmq is imported only then): binds every stream (an
address in use is EventsAddressError, one line and exit 2 at the daemon's start), attaches
the listener to the index once the index is rebuilt, and starts the publisher with the
store's background work. docs/routing.md describes what goes out.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import msgpack
import zmq

from ..config import EventsConfig
from ..entry import NS_ID_BYTES
from ..index import BlockIndex
from .peers import Guard
from .pending import ssd_text
from .publisher import Publisher
from .recorder import Recorder
from .relay import Relay, TokenCache
from .stream import Stream
from .texts import BlockText, LazyTexts, resolve


class Events:
    def __init__(self, state: Any, cfg: EventsConfig, data_dir: Path) -> None:
        """`state`: the store's shared state (kvstore/state.py)."""
        self.cfg = cfg
        ctx = zmq.Context()
        seq_dir = data_dir / "events"
        streams: list[Stream] = []
        relays: dict[int, Relay] = {}
        cache = TokenCache(cfg.token_cache_blocks)
        # every bound socket's connections capped (peers.py); closed with the first stream
        self.guard = Guard(cfg.max_connections, cfg.max_connections_per_peer)
        try:
            if cfg.endpoint:
                streams.append(Stream(ctx, "node", "events.", cfg.endpoint,
                                      cfg.replay_endpoint, cfg.topic, cfg.dp_rank, cfg.hwm,
                                      cfg.buffer_steps, seq_dir, cfg.models,
                                      cfg.replay_bytes, self.guard))
            for i, eng in enumerate(cfg.engines):
                streams.append(Stream(ctx, eng.name, f"events.engines[{i}].", eng.endpoint,
                                      eng.replay_endpoint, cfg.topic, eng.dp_rank, cfg.hwm,
                                      cfg.buffer_steps, seq_dir, eng.models or cfg.models,
                                      cfg.replay_bytes, self.guard))
                if eng.source:
                    relays[len(streams) - 1] = Relay(ctx, eng.name, eng.source, cache,
                                                     cfg.hwm, f"events.engines[{i}].source",
                                                     eng.source_replay, cfg.replay_bytes)
        except BaseException:
            self.guard.close()
            for s in streams:
                s.close(linger_s=0)
            for r in relays.values():
                r.close()
            ctx.term()
            raise
        self.streams = streams
        self._ssd_text = lambda g: ssd_text(state.ssd, g)
        self.recorder = Recorder(state.namespaces, [s.models for s in streams], cfg.max_queue,
                                 self._ssd_text)
        self.publisher = Publisher(state, self.recorder, streams, relays, cache, ctx,
                                   cfg.batch_events, cfg.interval_ms / 1000.0,
                                   cfg.token_cache_blocks, self.guard)
        # A relay's replay that ends wakes the publisher to forward it (else it waits for the
        # next tick, up to a second), from the replay's thread: never once the publisher's
        # wake pipe is closed (its descriptor may name another file by then).
        self._wake_lock = threading.Lock()
        self._closed = False
        for r in relays.values():
            r.wake = self._wake_publisher

    @property
    def book(self) -> dict[bytes, BlockText]:
        """Texts of the published blocks with a host or gpu copy (read under the store lock
        when a block is written to SSD: its meta keeps the text)."""
        self.recorder.flush()
        return self.recorder.book

    @property
    def addresses(self) -> dict[str, tuple[str, str]]:
        """Stream name -> (address its PUB socket is bound to, its replay socket's or ""),
        port 0 resolved."""
        return {s.name: (s.address, s.replay_address if s.replay is not None else "")
                for s in self.streams}

    def attach(self, index: BlockIndex) -> None:
        index.listener = self.recorder

    def start(self) -> None:
        self.guard.start()
        self.publisher.start()

    def _wake_publisher(self) -> None:
        with self._wake_lock:
            if not self._closed:
                self.publisher._wake()

    def close(self) -> None:
        with self._wake_lock:
            self._closed = True
        self.publisher.close()

    def note(self, gkey: bytes, on_ssd: bool) -> bytes:
        """The block's text as the note its remote value carries (tiers/remote/envelope.py),
        b"" where none is known: from the book, else, for a block SSD holds, its SSD meta
        (locked). Why: Redis is the one tier that kept no text, so a block loaded back from
        it (by this node after its last local copy went, or by another node) was never
        announced."""
        text = resolve(self.book.get(gkey))
        if text is None and on_ssd:
            text = self._ssd_text(gkey)
        return b"" if text is None else msgpack.packb(text.pack())

    def learn_note(self, gkey: bytes, note: bytes) -> None:
        """A block loaded from Redis (locked, before its host copy is indexed): its text from
        the value's note, so the copy is announced as one promoted from SSD is."""
        book = self.recorder.book
        if not note or gkey in book or not self.recorder.wants_tokens(gkey[:NS_ID_BYTES]):
            return
        try:
            text = BlockText.unpack(msgpack.unpackb(note))
        except Exception:  # noqa: BLE001 - a note that is not a text: no announcement
            return
        if text is not None:
            book[gkey] = text

    def wants_tokens(self, ns_id: bytes) -> bool:
        return self.recorder.wants_tokens(ns_id)

    def texts(self, ns_id: bytes, keys: list[bytes], parent: bytes | None, token_ids: bytes,
              block_tokens: int) -> LazyTexts | None:
        """Texts of the blocks a commit carries token ids for (little-endian uint32, checked
        against the keys by the store), made when first read; None where no stream publishes
        the namespace."""
        if not self.recorder.wants_tokens(ns_id):
            return None
        return LazyTexts(ns_id, keys, parent, token_ids, block_tokens)
