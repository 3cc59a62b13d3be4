"""PutRequest parsed by hand: the block data stays a view of the received message.

Why by hand: upb copies a bytes field on every access, and a Put carries megabytes of block
data that should be copied once, into the slab. Why strict: this parser runs before anything
else looks at a message, so it refuses as it reads (the block past MAX_KEYS, a block of the
wrong size, a field this protocol does not have, a field given twice) and a hostile message
costs no more than its first bad field; skipping unknown fields a Python step each cost ~10 s
of daemon time for a 16 MiB message of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvstore_client.common.errors import InvalidArgument
from kvstore_client.common.limits import MAX_KEYS


def _wire_fields(buf: memoryview, what: str, known: dict[int, int]
                 ) -> Iterator[tuple[int, memoryview]]:
    """(field number, value) of a protobuf message whose fields are all length-delimited;
    values as memoryviews. A field outside `known` (number -> how many times it may appear,
    0: any) ends the parse at once."""
    i, n = 0, len(buf)
    seen: dict[int, int] = {}

    def varint() -> int:
        nonlocal i
        shift = result = 0
        while True:
            if i >= n or shift > 63:
                raise InvalidArgument(f"request is not a valid {what} message: bad varint")
            b = buf[i]
            i += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7

    while i < n:
        tag = varint()
        field, wt = tag >> 3, tag & 7
        most = known.get(field)
        if most is None:
            raise InvalidArgument(f"request is not a valid {what} message: field {field} is not "
                                  "part of the protocol this daemon speaks")
        if wt != 2:
            raise InvalidArgument(f"request is not a valid {what} message: field {field} has "
                                  f"wire type {wt}")
        if most:
            seen[field] = seen.get(field, 0) + 1
            if seen[field] > most:
                raise InvalidArgument(f"request is not a valid {what} message: field {field} "
                                      "appears more than once")
        size = varint()
        if i + size > n:
            raise InvalidArgument(f"request is not a valid {what} message: truncated")
        yield field, buf[i:i + size]
        i += size


# namespace_id, parent, token_ids once; blocks any number of times
_PUT_FIELDS = {1: 1, 2: 1, 3: 0, 4: 1}
_BLOCK_FIELDS = {1: 1, 2: 1}          # key, data


@dataclass
class PutMessage:
    """One parsed PutRequest: its blocks whole, or a piece of a block split across messages."""
    ns: bytes = b""
    parent: bytes = b""
    blocks: list[tuple[bytes, memoryview]] = field(default_factory=list)
    # The message's one block, shorter than block_bytes: a split block's first piece (with its
    # key) or a later piece (key b""), continued by the next message.
    piece: tuple[bytes, memoryview] | None = None
    # The token ids of the message's blocks (little-endian uint32, block_tokens a block), or
    # b"": their length is checked by the caller, which knows the namespace's block_tokens.
    token_ids: bytes = b""


def parse_put(raw: bytes, block_bytes: int | None = None,
               sizer: Callable[[bytes], int | None] | None = None, where: str = "message 0",
               need: int = 0) -> PutMessage:
    """PutRequest -> PutMessage, block data not copied.

    Refuses as it reads, not after: the block past MAX_KEYS, or a block whose data is not
    `block_bytes` long (`sizer(namespace_id)` gives it once the namespace field is read), ends
    the parse there, so a message of a million blocks costs no more than the first bad one.
    A shorter block passes only as a message's one block (a piece of a split block); `need`:
    bytes the split block the previous message began still lacks (0: none).
    """
    out = PutMessage()
    what = "kvstore.v1.PutRequest"
    short: tuple[int, int] | None = None        # (index, length) of a shorter block
    for field_no, v in _wire_fields(memoryview(raw), what, _PUT_FIELDS):
        if field_no == 1:
            out.ns = bytes(v)
            if sizer is not None and block_bytes is None:
                block_bytes = sizer(out.ns)
        elif field_no == 2:
            out.parent = bytes(v)
        elif field_no == 4:
            out.token_ids = bytes(v)
        else:
            i = len(out.blocks)
            if i >= MAX_KEYS:
                raise InvalidArgument(f"{where} carries more than {MAX_KEYS} blocks (refused "
                                      f"at block {MAX_KEYS}); send at most {MAX_KEYS} per "
                                      "message")
            if short is not None:               # a shorter block that is not alone
                raise _wrong_size(where, short[0], short[1], block_bytes)
            key, data = b"", memoryview(b"")
            for f2, v2 in _wire_fields(v, "kvstore.v1.Block", _BLOCK_FIELDS):
                if f2 == 1:
                    key = bytes(v2)
                else:
                    data = v2
            want = need if (i == 0 and need) else block_bytes
            if want is not None and len(data) != want:
                if len(data) > want or not len(data) or (i == 0 and need and key):
                    raise _wrong_size(where, i, len(data), block_bytes, need if i == 0 else 0)
                short = (i, len(data))
            out.blocks.append((key, data))
    if need and (not out.blocks or out.blocks[0][0]):
        raise InvalidArgument(f"{where} must continue the split block of the previous "
                              f"message ({need} more bytes, in one Block without a key)")
    if short is not None or (need and out.blocks):
        if len(out.blocks) > 1:             # a piece must come alone
            if short is not None and short[0]:
                raise _wrong_size(where, short[0], short[1], block_bytes)
            raise _wrong_size(where, 0, len(out.blocks[0][1]), block_bytes, need)
        out.piece = out.blocks.pop()
    return out


def _wrong_size(where: str, i: int, n: int, block_bytes: int | None, need: int = 0
                ) -> InvalidArgument:
    if need:
        return InvalidArgument(f"{where} blocks[{i}].data is {n} bytes; the split block it "
                               f"continues needs {need} more, alone in its message")
    return InvalidArgument(f"{where} blocks[{i}].data is {n} bytes; this namespace's blocks "
                           f"are {block_bytes} bytes (a block too big for one message is sent "
                           "alone, split across messages)")


def check_token_ids(where: str, token_ids: bytes, blocks: int, block_tokens: int) -> None:
    """A message's token ids fit its blocks: none, or block_tokens little-endian uint32 a
    block (PutRequest.token_ids)."""
    if token_ids and len(token_ids) != 4 * blocks * block_tokens:
        got = (f"{len(token_ids) // 4} token ids" if len(token_ids) % 4 == 0 else
               f"{len(token_ids)} bytes of token ids (4 a token)")
        raise InvalidArgument(f"{where} token_ids: {got} for {blocks} blocks; send "
                              f"{block_tokens} per block (the namespace's block_tokens, "
                              "little-endian uint32) or none")
