"""Consecutive residency changes merged into one event, as an engine announces them.

Why: a store of N chained blocks is N changes, and one event per change made the publisher
encode N events (a few microseconds each, on the GIL the store's requests need) and the
routers decode N. vLLM itself announces a request's new blocks as one BlockStored whose
hashes run in chain order, each block's parent the hash before it: a router applies that
exactly as the N events it stands for. So stored blocks merge while each one's parent is the
last hash so far and medium, block size, adapter and the streams they go to agree; removals
merge while medium and streams agree. Any other change closes the run first, so the order of
events is what the changes' order was.
"""

from __future__ import annotations

from collections.abc import Callable

from . import wire
from .texts import BlockText

MAX_HASHES = 1024           # blocks per merged event at most (a bound on one event's size)


def _body(packed: bytes) -> bytes:
    """A msgpack array's elements, its header cut off (texts.py packs token ids as arrays)."""
    b = packed[0]
    return packed[1:] if b & 0xF0 == 0x90 else packed[3:] if b == 0xDC else packed[5:]


class EventRun:
    """The event being built; `emit(mask, event)` takes each one closed."""

    def __init__(self, emit: Callable[[int, bytes], None]) -> None:
        self.emit = emit
        self.kind = ""          # "stored", "removed" or "" (nothing open)
        self.mask = 0
        self.medium = ""
        self.hashes: list[int] = []
        self.texts: list[BlockText] = []

    def stored(self, mask: int, medium: str, text: BlockText) -> None:
        if self.kind == "stored" and mask == self.mask and medium == self.medium:
            last = self.texts[-1]
            if (text.parent == last.hashes[-1] and text.block_size == last.block_size
                    and text.lora == last.lora
                    and len(self.hashes) + len(text.hashes) <= MAX_HASHES):
                self.hashes.extend(text.hashes)
                self.texts.append(text)
                return
        self.close()
        self.kind, self.mask, self.medium = "stored", mask, medium
        self.hashes = list(text.hashes)
        self.texts = [text]

    def removed(self, mask: int, medium: str, hashes: tuple[int, ...]) -> None:
        if not (self.kind == "removed" and mask == self.mask and medium == self.medium
                and len(self.hashes) + len(hashes) <= MAX_HASHES):
            self.close()
            self.kind, self.mask, self.medium = "removed", mask, medium
            self.hashes = []
        self.hashes.extend(hashes)

    def close(self) -> None:
        if self.kind == "stored":
            texts = self.texts
            if len(texts) == 1:
                ev = texts[0].event(self.medium)
            else:
                first = texts[0]
                tokens = wire.array_header(len(self.hashes) * first.block_size) + b"".join(
                    _body(t.tokens) for t in texts)
                ev = wire.stored(self.hashes, first.parent, tokens, first.block_size,
                                 self.medium, first.lora)
            self.emit(self.mask, ev)
        elif self.kind == "removed":
            self.emit(self.mask, wire.removed(self.hashes, self.medium))
        self.kind = ""
        self.texts = []
