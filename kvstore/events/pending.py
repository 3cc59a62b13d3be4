"""Finding the token text of a block the publisher announces, and the blocks that wait for it.

Why a module of its own: the publisher thread's loop (publisher.py) only needs "this block's
text, or not yet"; where a text comes from is a separate question with state of its own. A
block's text is in the recorder's book (SDK-stored blocks, and any with a host or gpu copy
whose text is known), in its SSD meta record, or, for a vLLM or SGLang namespace, in the
engine's own events, which may arrive after the block entered a tier (the engine publishes
late, or its connection came up after the store). Such a block waits here, by tier, found
again by key (vLLM) or event hash (SGLang) when the relay learns it; the oldest waiting are
dropped past a cap (counted), since an engine may never name them. A text joined from the
engine's events is kept with its block afterwards (the book, or the SSD meta), so a later
start-over or a restart finds it without the engine.

Used by the publisher thread only, which owns all of it; the store lock is taken only to
keep joined texts with their blocks, through the publisher's deadline-bounded `locked`.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack
from kvstore_client.common.errors import KVStoreError

from .texts import OWN, VLLM, BlockText, resolve, sglang_hash

if TYPE_CHECKING:                   # (relay.py imports pyzmq; this module does not need it)
    from .recorder import Recorder
    from .relay import TokenCache

MIN_CAP = 1024              # blocks waiting for their text at least, whatever is configured


class PendingTexts:
    """Texts of blocks the publisher announces (`find`), and the blocks waiting for one."""

    def __init__(self, state: Any, recorder: Recorder, cache: TokenCache, cap: int,
                 counters: Counter) -> None:
        self.state = state          # the store's shared state (kvstore/state.py)
        self.recorder = recorder
        self.cache = cache          # the engines' blocks the relays learned (relay.py)
        self.cap = max(cap, MIN_CAP)
        self.counters = counters    # the publisher's (events_pending_dropped)
        # Blocks that entered a tier before their text was known: gkey -> tiers, oldest first.
        self.blocks: OrderedDict[bytes, set[str]] = OrderedDict()
        # Where an engine's event finds them: vLLM key, or SGLang event hash -> gkeys.
        self._by: dict[bytes | int, list[bytes]] = {}
        # Texts learned from the engines' events, to keep with their blocks (keep_joins).
        self.joins: list[tuple[bytes, BlockText]] = []

    def find(self, g: bytes, kind: str) -> BlockText | None:
        """A block's text: from the book, the engines' events, or its SSD meta."""
        text = resolve(self.recorder.book.get(g))
        if text is not None:
            return text
        if kind != OWN:
            text = self.join(g, kind)
            if text is not None:
                self.joins.append((g, text))
                return text
        return ssd_text(self.state.ssd, g)

    def join(self, g: bytes, kind: str) -> BlockText | None:
        """A vLLM or SGLang block's text from the engine blocks the relays learned, or None
        while any of them is unknown."""
        info = self.state.namespaces.get(g[:16])
        if info is None:
            return None
        key = g[16:]
        last = self.cache.by_key.get(key) if kind == VLLM else sglang_hash(key)
        if last is None:
            return None
        return self.cache.text(last, info.spec.layout.block_tokens)

    def keep_joins(self, locked: Callable[[], bool]) -> None:
        """Keep texts learned late with their blocks: in the book for a block with a host or
        gpu copy (its demotion writes the text into its SSD meta), else in its SSD meta.
        `locked()` takes the store lock, or is False when the publisher is stopping."""
        if not self.joins:
            return
        joins, self.joins = self.joins, []
        to_meta = []
        if not locked():
            return
        try:
            self.recorder.flush()
            book, index = self.recorder.book, self.state.index
            for g, text in joins:
                e = index.peek(g)
                if e is None:
                    continue
                if e.host is not None or e.gpu is not None:
                    book.setdefault(g, text)
                elif e.ssd:
                    to_meta.append((g, text))
        finally:
            self.state.lock.release()
        ssd = self.state.ssd
        for g, text in to_meta:
            try:
                meta = ssd.get_meta(g)
                m = msgpack.unpackb(meta, raw=False) if meta else None
                if isinstance(m, dict) and "e" not in m:
                    m["e"] = text.pack()
                    ssd.set_meta(g, msgpack.packb(m, use_bin_type=True))
            except (KVStoreError, ValueError, msgpack.UnpackException):
                continue                # evicted meanwhile: nothing to keep

    # -- blocks waiting for their engine's events --------------------------------------------
    def pend(self, g: bytes, kind: str, tiers: tuple[str, ...]) -> None:
        """Block g entered `tiers` with no text known: wait for its engine's events."""
        p = self.blocks.get(g)
        if p is None:
            if len(self.blocks) >= self.cap:
                old, _ = self.blocks.popitem(last=False)
                self._unindex(old)
                self.counters["events_pending_dropped"] += 1
            p = self.blocks[g] = set()
            by = g[16:] if kind == VLLM else sglang_hash(g[16:])
            self._by.setdefault(by, []).append(g)
        p.update(tiers)

    def unpend(self, g: bytes, tiers: tuple[str, ...], gone: bool) -> None:
        """Block g left `tiers` (`gone`: every published one): it waits for less, or not."""
        p = self.blocks.get(g)
        if p is None:
            return
        p.difference_update(tiers)
        if gone or not p:
            del self.blocks[g]
            self._unindex(g)

    def _unindex(self, g: bytes) -> None:
        for by in (g[16:], sglang_hash(g[16:])):
            lst = self._by.get(by)
            if lst and g in lst:
                lst.remove(g)
                if not lst:
                    del self._by[by]

    def learned(self, learned: list[tuple[bytes | None, int]]
                ) -> list[tuple[bytes, str, int, BlockText, set[str]]]:
        """An engine's events named blocks (key or None, event hash): the waiting blocks whose
        text is now whole, as (gkey, kind, stream mask, text, tiers), in the order found; they
        wait no more."""
        if not self._by:
            return []
        out = []
        for key, h in learned:
            found = list(self._by.get(h, ()))
            if key is not None:
                found += self._by.get(key, ())
            for g in found:
                if g not in self.blocks:
                    continue
                kind, mask = self.recorder.ns(g[:16])
                text = self.join(g, kind)
                if text is None:
                    continue            # the chunk's other blocks are not known yet
                tiers = self.blocks.pop(g)
                self._unindex(g)
                self.joins.append((g, text))
                out.append((g, kind, mask, text, tiers))
        return out

    def clear(self) -> None:
        """Forget every waiting block (a start-over finds them again)."""
        self.blocks.clear()
        self._by.clear()


def ssd_text(ssd: Any, g: bytes) -> BlockText | None:
    """A block's text from its SSD meta record; None without one (or without the tier)."""
    if ssd is None:
        return None
    try:
        meta = ssd.get_meta(g)
        if not meta:
            return None
        m = msgpack.unpackb(meta, raw=False)
    except Exception:  # noqa: BLE001 - a damaged or vanished record is just no text
        return None
    return BlockText.unpack(m.get("e")) if isinstance(m, dict) else None
