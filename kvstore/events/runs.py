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

from collections.abc import Callable, Sequence

from . import wire
from .texts import BlockText, Packed

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
        # a stored run: its first parent, block size and adapter, the token ids of its
        # blocks (msgpack ints, array headers cut off), its last hash, and its one text
        # while it holds only one (that text's own event is sent as it is)
        self.parent: int | None = None
        self.block_size = 0
        self.lora: tuple[int | None, str | None] | None = None
        self.bodies: list[bytes] = []
        self.last: int | None = None
        self.single: BlockText | None = None

    def _open_stored(self, mask: int, medium: str, parent: int | None, block_size: int,
                     lora: tuple[int | None, str | None] | None) -> None:
        self.close()
        self.kind, self.mask, self.medium = "stored", mask, medium
        self.parent, self.block_size, self.lora = parent, block_size, lora
        self.hashes, self.bodies, self.single = [], [], None

    def stored(self, mask: int, medium: str, text: BlockText) -> None:
        if not (self.kind == "stored" and mask == self.mask and medium == self.medium
                and text.parent == self.last and text.block_size == self.block_size
                and text.lora == self.lora
                and len(self.hashes) + len(text.hashes) <= MAX_HASHES):
            self._open_stored(mask, medium, text.parent, text.block_size, text.lora)
            self.single = text
        else:
            self.single = None
        self.hashes.extend(text.hashes)
        self.bodies.append(_body(text.tokens))
        self.last = text.hashes[-1]

    def stored_chain(self, mask: int, medium: str, packed: Packed, a: int, b: int) -> None:
        """Blocks a..b-1 of a commit (texts.py): the same events as stored() of each block's
        text in turn, without making the texts."""
        hashes, off, data = packed.hashes, packed.offsets, packed.data
        while a < b:
            prev = packed.parent if a == 0 else hashes[a - 1]
            if not (self.kind == "stored" and mask == self.mask and medium == self.medium
                    and prev == self.last and packed.block_size == self.block_size
                    and self.lora is None and len(self.hashes) < MAX_HASHES):
                self._open_stored(mask, medium, prev, packed.block_size, None)
            self.single = None
            end = min(b, a + MAX_HASHES - len(self.hashes))
            self.hashes.extend(hashes[a:end])
            self.bodies.append(data[off[a]:off[end]])
            self.last = hashes[end - 1]
            a = end

    def removed(self, mask: int, medium: str, hashes: Sequence[int]) -> None:
        if not (self.kind == "removed" and mask == self.mask and medium == self.medium
                and len(self.hashes) + len(hashes) <= MAX_HASHES):
            self._open_removed(mask, medium)
        self.hashes.extend(hashes)

    def removed_each(self, mask: int, medium: str, hashes: list[int]) -> None:
        """removed() of each hash in turn (blocks of one hash each), at once."""
        i, n = 0, len(hashes)
        while i < n:
            if not (self.kind == "removed" and mask == self.mask and medium == self.medium
                    and len(self.hashes) < MAX_HASHES):
                self._open_removed(mask, medium)
            end = min(n, i + MAX_HASHES - len(self.hashes))
            self.hashes.extend(hashes[i:end])
            i = end

    def _open_removed(self, mask: int, medium: str) -> None:
        self.close()
        self.kind, self.mask, self.medium = "removed", mask, medium
        self.hashes = []

    def close(self) -> None:
        if self.kind == "stored":
            if self.single is not None:
                ev = self.single.event(self.medium)
            else:
                tokens = wire.array_header(len(self.hashes) * self.block_size) + b"".join(
                    self.bodies)
                ev = wire.stored(self.hashes, self.parent, tokens, self.block_size,
                                 self.medium, self.lora)
            self.emit(self.mask, ev)
        elif self.kind == "removed":
            self.emit(self.mask, wire.removed(self.hashes, self.medium))
        self.kind = ""
        self.bodies = []
        self.single = None
        self.last = None
