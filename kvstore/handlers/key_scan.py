"""A large request that names one block twice, found in its raw bytes before protobuf parses it.

Why: a call naming a block twice is refused (kvstore/keychain.py), but only after protobuf has
built a bytes object for each of up to 65,536 keys and a set of them: 3-6 ms with the GIL held
for a 1 MiB request, during which every other tenant's handler threads wait. A hostile tenant
sending such requests in a loop bought that much of the daemon per request. Here numpy reads
the keys where they lie in the message (a run of records of one length: tag, length byte, key),
sorts a salted 64-bit mix of each with its place, and looks for equal neighbours: about 2.5 ms
for the largest request, wherever its repeats lie, most of it in numpy's sort, which runs
without the GIL. The first HEAD_KEYS keys are looked at one by one first: a request naming one
block throughout is refused at its second key, in microseconds.

The scan only ever proves a repeat, never passes a request: a message it cannot read as such a
run (keys of several lengths, fields in an unusual order, a hash collision between two
different keys) goes to protobuf and the ordinary checks, which refuse or serve it exactly as
before. A repeat it finds is verified byte for byte and named as the ordinary check names it
(the first key that repeats an earlier one, and that earlier key's place).
"""

from __future__ import annotations

import secrets

from kvstore_client.common.errors import InvalidArgument
from kvstore_client.common.limits import MAX_KEY_BYTES, MIN_KEY_BYTES

SCAN_FROM_BYTES = 32 << 10    # smaller requests: protobuf and a set cost less than the scan
MAX_FIELDS_BEFORE = 8         # fields read before the first key record, at most
HEAD_KEYS = 64                # keys looked at one by one before the sort (module docstring)
INDEX_BITS = 17              # a key's place in the sort key: MAX_KEYS (65,536) fits
INDEX_LIMIT = 1 << INDEX_BITS
# Salted per daemon run, so a client cannot choose keys whose mixes collide (a collision only
# sends the request to protobuf, but that is the cost the scan saves).
_SALT = secrets.randbits(64)
_MIX = secrets.randbits(64) | 1


def refuse_repeated_keys(raw: bytes, keys_field: int, field: str = "keys") -> None:
    """InvalidArgument if `raw` (a request whose keys are field number `keys_field`) is large
    and provably names one key twice; otherwise nothing (the ordinary checks decide)."""
    if len(raw) < SCAN_FROM_BYTES:
        return
    found = first_repeat(raw, keys_field)
    if found is not None:
        at, first = found
        raise InvalidArgument(f"{field}[{at}] repeats {field}[{first}]: a call names each "
                              "block once (a prefix chain cannot hold a key twice: each key "
                              "covers the blocks before it)")


def first_repeat(raw: bytes, keys_field: int) -> tuple[int, int] | None:
    """(i, j): keys[i] is the first key equal to an earlier one, keys[j]; None when there is
    none, or when the message is not one the scan reads (module docstring)."""
    tag = (keys_field << 3) | 2
    pos = _first_record(raw, tag)
    if pos is None or pos + 2 > len(raw):
        return None
    size = raw[pos + 1]
    if not MIN_KEY_BYTES <= size <= MAX_KEY_BYTES:
        return None
    stride = size + 2
    head = _first_repeat_in(raw, pos, tag, size, HEAD_KEYS)
    if head is not None:
        return head                         # exact: no earlier repeat lies past the head
    import numpy as np  # here, not at import: the daemon serves before it loads numpy

    index_mask = np.uint64(INDEX_LIMIT - 1)
    count = (len(raw) - pos) // stride
    recs = np.frombuffer(raw, np.uint8, count * stride, pos).reshape(count, stride)
    regular = (recs[:, 0] == tag) & (recs[:, 1] == size)
    run = count if regular.all() else int(np.argmin(regular))
    if run < 2 or run > index_mask + 1:
        return None
    keys = recs[:run, 2:]
    words = np.ascontiguousarray(keys[:, :16]).view(np.uint64)
    mix = (words[:, 0] ^ np.uint64(_SALT)) * np.uint64(_MIX) ^ words[:, 1]
    # Each key's mix in the high bits, its place in the low ones: one sort puts equal mixes
    # together, each group in the keys' order, so the first key of a group is where it first
    # appears and every other is a repeat.
    tagged = np.sort((mix & ~index_mask) | np.arange(run, dtype=np.uint64))
    high = tagged >> INDEX_BITS
    later = np.flatnonzero(high[1:] == high[:-1]) + 1
    if not len(later):
        return None                         # all distinct: the ordinary path serves it
    k = later[int(np.argmin(tagged[later] & index_mask))]
    at = int(tagged[k] & index_mask)
    first = int(tagged[np.searchsorted(high, high[k])] & index_mask)
    if not np.array_equal(keys[at], keys[first]):
        return None                         # a collision of the mix: protobuf decides
    return at, first


def _first_repeat_in(raw: bytes, pos: int, tag: int, size: int, count: int
                     ) -> tuple[int, int] | None:
    """The first repeat among the first `count` key records, by a dict: a request repeating
    one key throughout is answered in microseconds, without the sort. None also where the
    records stop being regular."""
    first: dict[bytes, int] = {}
    stride = size + 2
    for i in range(count):
        at = pos + i * stride
        if at + stride > len(raw) or raw[at] != tag or raw[at + 1] != size:
            return None
        j = first.setdefault(raw[at + 2:at + stride], i)
        if j != i:
            return i, j
    return None


def _first_record(raw: bytes, tag: int) -> int | None:
    """Offset of the first top-level field with `tag` (a one-byte tag), reading at most
    MAX_FIELDS_BEFORE fields before it; None if it is not found that way."""
    pos, n = 0, len(raw)
    for _ in range(MAX_FIELDS_BEFORE + 1):
        if pos >= n:
            return None
        if raw[pos] == tag:
            return pos
        key, pos = _varint(raw, pos)
        if key is None:
            return None
        wire = key & 7
        if wire == 0:
            _, pos = _varint(raw, pos)
            if pos is None:
                return None
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            length, pos = _varint(raw, pos)
            if length is None:
                return None
            pos += length
        else:
            return None
    return None


def _varint(raw: bytes, pos: int) -> tuple[int | None, int | None]:
    value = shift = 0
    while pos < len(raw) and shift < 64:
        b = raw[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if not b & 0x80:
            return value, pos
        shift += 7
    return None, None
