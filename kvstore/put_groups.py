"""A Put stream's blocks stored a group of messages at a time.

Why: a Put message of big blocks carries one block (the receive limit is 4 MiB), and storing
each message on its own paid the store's per-call work (the lock, dedup and room-making, the
policy's insert, the counters) once a block. The messages of one stream are gathered until
they hold GROUP_BYTES of blocks, and each group is one Store.put: the same dedup before
copying, the same room-making, the same checksums of the bytes sent; only the per-call work is
paid a group at a time. Memory held per stream is bounded: a group, plus the last message.

What a group keeps from storing message by message: blocks of the messages received before a
bad one (or before the stream broke) are stored, since the handler flushes the group before it
reports the error, and a group never names a key twice (a key repeated across messages is
stored once and counted a duplicate, as before, instead of failing the group's key check).

Token ids (PutRequest.token_ids) travel with their blocks into the group's Store.put, which
keeps them for the blocks' KV events. A group holds blocks that all came with token ids or
none that did: a message that differs flushes the group first, so no block is announced with
another block's tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger("kvstore.server")

GROUP_BYTES = 8 << 20     # block bytes gathered before one Store.put of them


class PutGroups:
    """The blocks of one Put stream, stored a group at a time (module docstring).

    `start` names the namespace and the first block's parent (the stream's first message);
    `add` takes one message's blocks (and their token ids, or None), the prefix chain
    continuing from the previous ones;
    `flush` stores what is held (at the end of the stream, and, through `flush_before_error`,
    before an error is reported). `stored` and `duplicates` count what the store took.
    """

    def __init__(self, store: Any, group_bytes: int = GROUP_BYTES) -> None:
        self.store = store
        self.group_bytes = group_bytes
        self.ns_id = b""
        self.parent: bytes | None = None  # parent of the held group's first block
        self.stored = self.duplicates = 0
        self._keys: list[bytes] = []
        self._seen: set[bytes] = set()
        self._blocks: list[Any] = []
        self._tokens: list[bytes] | None = None   # the held blocks' token ids, if they came
        self._bytes = 0

    @property
    def empty(self) -> bool:
        """No block held: every block added so far is stored."""
        return not self._keys

    def start(self, ns_id: bytes, parent: bytes | None) -> None:
        self.ns_id, self.parent = ns_id, parent

    def add(self, keys: Sequence[bytes], blocks: Sequence[Any],
            token_ids: bytes | None = None) -> None:
        if self._keys and (not self._seen.isdisjoint(keys)
                           or (token_ids is None) != (self._tokens is None)):
            self.flush()
        if token_ids is not None:
            if self._tokens is None:
                self._tokens = []
            self._tokens.append(token_ids)
        self._keys += keys
        self._seen.update(keys)
        self._blocks += blocks
        self._bytes += sum(len(b) for b in blocks)
        if self._bytes >= self.group_bytes:
            self.flush()

    def flush(self) -> None:
        keys, blocks, tokens = self._keys, self._blocks, self._tokens
        if not keys:
            return
        self._keys, self._blocks, self._bytes, self._seen = [], [], 0, set()
        self._tokens = None
        parent, self.parent = self.parent, keys[-1]
        res = self.store.put(self.ns_id, keys, blocks, parent=parent,
                             token_ids=b"".join(tokens) if tokens is not None else None)
        self.stored += res.stored
        self.duplicates += res.duplicates

    def flush_before_error(self) -> None:
        """Store what was received before the stream failed; the stream's own error is what
        the client hears, so a failure here is only logged."""
        try:
            self.flush()
        except Exception as e:  # noqa: BLE001 - the stream's error is the answer
            log.info("Put: blocks received before the stream failed were not stored: %s", e)
