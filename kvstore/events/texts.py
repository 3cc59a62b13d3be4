"""What a router needs to index one daemon block: its event hashes, parent and token ids.

Routers hash a request's tokens themselves and index blocks by those hashes; the hashes a
stream announces only chain a block to its parent within the stream. So each block needs its
token ids, which the daemon never needed before, and hashes that chain the way its engine's
own events do:

- blocks stored through the SDK (reference keys, or any other scheme): the client sends token
  ids with Commit; the block's event hash is xxh3-64 of namespace id + key, its parent's the
  same of the parent key, so namespaces never share a hash.
- vLLM namespaces (`external:vllm-*`): vLLM's own block hashes, learned with the token ids from
  the engine's own events (kvstore/events/relay.py), so one chain runs through an engine's GPU
  blocks and kvstore's copies. A daemon block is one offload chunk: k engine blocks, k hashes.
- SGLang namespaces (`external:sglang-*`): a page's event hash is its key's first 8 bytes (as
  SGLang computes it); token ids and parent come from SGLang's own events.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from functools import partial
from itertools import repeat
from typing import Any, NamedTuple

import numpy as np
import xxhash

from . import wire

OWN, VLLM, SGLANG = "own", "vllm", "sglang"


def kind_of(hash_scheme: str) -> str:
    if hash_scheme.startswith("external:vllm-"):
        return VLLM
    if hash_scheme.startswith("external:sglang-"):
        return SGLANG
    return OWN


def own_hash(gkey: bytes) -> int:
    """Event hash of a block the daemon names itself (gkey = namespace id + key)."""
    return xxhash.xxh3_64_intdigest(gkey)


def sglang_hash(key: bytes) -> int:
    """SGLang's event hash of one of its pages (hash_str_to_int64, read unsigned)."""
    return int.from_bytes(key[:8], "big")


class BlockText(NamedTuple):
    """(A tuple: made once per stored block on the Commit path, where a dataclass's
    construction cost three times as much.)"""

    hashes: tuple[int, ...]     # one per engine block the daemon block covers
    parent: int | None          # the event hash of the block before the first one
    tokens: bytes               # the token ids as a msgpack array, len(hashes) * block_size
    block_size: int             # tokens per engine block
    lora: tuple[int | None, str | None] | None = None   # the engine's (lora_id, lora_name)

    def event(self, medium: str) -> bytes:
        return wire.stored(self.hashes, self.parent, self.tokens, self.block_size, medium,
                           self.lora)

    def pack(self) -> list[Any]:
        """The form kept in a block's SSD meta (key "e"); a LoRA block's adds its pair."""
        out = [list(self.hashes), self.parent, self.tokens, self.block_size]
        return out if self.lora is None else [*out, list(self.lora)]

    @staticmethod
    def unpack(obj: Any) -> BlockText | None:
        """A packed text, or None for anything that is not one (an old or damaged record)."""
        try:
            hashes, parent, tokens, bs, *rest = obj
            lora = check_lora(*rest[0]) if len(rest) == 1 else None
            if len(rest) > 1 or (rest and lora is None):
                return None
            t = BlockText(tuple(int(h) for h in hashes), None if parent is None else int(parent),
                          bytes(tokens), int(bs), lora)
        except (TypeError, ValueError):
            return None
        return t if t.valid() else None

    def valid(self) -> bool:
        return (self.block_size > 0 and len(self.hashes) > 0
                and wire.array_length(self.tokens) == self.block_size * len(self.hashes))


MAX_LORA_NAME = 256


def check_lora(lora_id: Any, lora_name: Any) -> tuple[int | None, str | None] | None:
    """An engine event's (lora_id, lora_name) as announcements carry it: None for a base-model
    block (both None) and for values no engine sends (then the block is not named at all:
    ValueError)."""
    if lora_id is None and lora_name is None:
        return None
    if lora_id is not None and (not isinstance(lora_id, int) or isinstance(lora_id, bool)
                                or not 0 <= lora_id < 1 << 63):
        raise ValueError("lora_id must be a non-negative integer or nil")
    if lora_name is not None and (not isinstance(lora_name, str)
                                  or len(lora_name) > MAX_LORA_NAME):
        raise ValueError(f"lora_name must be a string of at most {MAX_LORA_NAME} characters")
    return (lora_id, lora_name)


def check_tokens(token_ids: Any) -> list[int]:
    """Token ids as a list of ints, each an unsigned 32-bit value (ValueError otherwise)."""
    tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
    try:
        array("I", tokens)          # range-checked in C (unsigned int: 4 bytes here)
    except (OverflowError, TypeError):
        raise ValueError("token ids must be unsigned 32-bit integers") from None
    return tokens


def tokens_u32(token_ids: Any) -> bytes:
    """Token ids as Commit carries them (little-endian uint32 each), from a sequence of ints
    (ValueError for one that is not an unsigned 32-bit value)."""
    if isinstance(token_ids, (bytes, bytearray, memoryview)):
        return bytes(token_ids)
    a = np.asarray(token_ids)
    if a.size and (a.dtype.kind not in "iu" or a.min() < 0 or a.max() > 0xFFFFFFFF):
        raise ValueError("token ids must be unsigned 32-bit integers")
    return a.astype("<u4").tobytes()


# msgpack's forms of an unsigned int, by class (below 0x80, 0x100, 0x10000, else): width in
# bytes, and its tag placed where it lands in the 8 big-endian bytes of a uint64 whose low 4
# bytes hold the value (the value's bytes it covers are zeros in that class).
_WIDTH = np.array([1, 2, 3, 5], dtype=np.int64)
_TAG = np.array([0, 0xCC << 8, 0xCD << 16, 0xCE << 32], dtype=np.uint64)
_KEEP = np.arange(8) >= (8 - _WIDTH)[:, None]     # by class: which of the 8 bytes are its form


def _pack_ints(raw: bytes) -> tuple[bytes, np.ndarray, np.ndarray]:
    """Token ids (little-endian uint32) as msgpack ints back to back, each in its smallest
    form (as vLLM's encoder writes them), with each int's start and end in the bytes: each
    int with its tag as one big-endian uint64, cut to its form's bytes by one mask (a few
    whole-array steps for any commit)."""
    t = np.frombuffer(raw, dtype="<u4")
    cls = (t >= 0x80).view(np.int8) + (t >= 0x100).view(np.int8) + (t >= 0x10000).view(np.int8)
    words = (t.astype(np.uint64) | np.take(_TAG, cls)).astype(">u8")
    data = words.view(np.uint8).reshape(t.size, 8)[np.take(_KEEP, cls, axis=0)].tobytes()
    width = np.take(_WIDTH, cls)
    ends = np.cumsum(width)
    return data, ends - width, ends


def _pack_narrow(t: np.ndarray, block_tokens: int) -> tuple[bytes, list[int]] | None:
    """_pack_blocks for token ids below 0x10000 (None otherwise): each int's form right-aligned
    in 3 bytes built column by column (tag 0xCD, then 0xCC or its high byte, then its low
    byte), cut by a mask of the same contiguous shape. About half the general path's time:
    no uint64 words, and numpy's masked select is much cheaper on 3 contiguous columns than
    on 8 (or on a strided view of them)."""
    if t.size and int(t.max()) >= 0x10000:
        return None
    c1 = t >= 0x80
    c2 = t >= 0x100
    tb = t.view(np.uint8)                   # little-endian: byte 0 of each is its low byte
    forms = np.empty((t.size, 3), np.uint8)
    forms[:, 0] = 0xCD
    forms[:, 1] = np.where(c2, tb[1::4], np.uint8(0xCC))
    forms[:, 2] = tb[0::4]
    keep = np.empty((t.size, 3), bool)
    keep[:, 0] = c2
    keep[:, 1] = c1
    keep[:, 2] = True
    per = (c1.view(np.int8) + c2.view(np.int8)).reshape(-1, block_tokens).sum(
        axis=1, dtype=np.int64)
    per += block_tokens
    offsets = np.zeros(per.size + 1, np.int64)
    np.cumsum(per, out=offsets[1:])
    return forms[keep].tobytes(), offsets.tolist()


def _pack_blocks(raw: bytes, block_tokens: int) -> tuple[bytes, list[int]]:
    """Token ids (little-endian uint32, block_tokens a block) as msgpack ints back to back,
    and where each block's ints start (one more offset at the end: the length)."""
    t = np.frombuffer(raw, dtype="<u4")
    got = _pack_narrow(t, block_tokens)
    if got is not None:
        return got
    data, starts, _ = _pack_ints(raw)
    offsets = starts[::block_tokens].tolist()
    offsets.append(len(data))
    return data, offsets


def pack_token_blocks(raw: bytes, block_tokens: int) -> list[bytes]:
    """Each block's token ids (raw: little-endian uint32, block_tokens a block) as the msgpack
    array vLLM's encoder writes: every int in its smallest form. Done for a whole commit at
    once with numpy; packing per block cost a microsecond or more a block on the Commit path."""
    if not raw:
        return []
    data, off = _pack_blocks(raw, block_tokens)
    head = wire.array_header(block_tokens)
    return [head + data[a:b] for a, b in zip(off[:-1], off[1:], strict=True)]


class Packed(NamedTuple):
    """A commit's blocks at once, as the publisher announces a chain of them: one event's
    worth of hashes and token bytes, with no object per block."""

    hashes: list[int]           # each block's event hash
    parent: int | None          # the event hash of the block before the first one
    data: bytes                 # every block's token ids as msgpack ints, back to back
    offsets: list[int]          # block i's ints are data[offsets[i]:offsets[i + 1]]
    block_size: int


def pack_commit(ns_id: bytes, keys: list[bytes], parent: bytes | None, raw_tokens: bytes,
                block_tokens: int) -> Packed:
    """SDK-stored blocks: keys[i] holds tokens [i*T, (i+1)*T) of `raw_tokens` (little-endian
    uint32), chained from parent. Hashing runs in C over the whole list."""
    hashes = list(map(xxhash.xxh3_64_intdigest, map(ns_id.__add__, keys)))
    prev = own_hash(ns_id + parent) if parent else None
    if not keys:
        return Packed(hashes, prev, b"", [0], block_tokens)
    data, offsets = _pack_blocks(raw_tokens, block_tokens)
    return Packed(hashes, prev, data, offsets, block_tokens)


def _split(p: Packed) -> list[BlockText]:
    T, data, off, hashes = p.block_size, p.data, p.offsets, p.hashes
    head = wire.array_header(T)
    prevs = [p.parent, *hashes[:-1]]
    return [BlockText((h,), prev, head + data[off[i]:off[i + 1]], T)
            for i, (h, prev) in enumerate(zip(hashes, prevs, strict=True))]


class LazyTexts(Sequence):
    """The texts of one commit's blocks, made when first read rather than on the Commit path:
    packing the token ids and hashing every key cost ~2 us a block in the request that
    stored them, and the publisher thread (or a demotion) can make them as well. The
    publisher reads the commit at once (`packed`); a text per block is made only for a
    reader of one block (a demotion's SSD meta, a stream starting over). Made all at once by
    whichever reads first; two racing readers make equal ones."""

    __slots__ = ("_args", "_packed", "_texts", "_n")

    def __init__(self, ns_id: bytes, keys: list[bytes], parent: bytes | None, raw_tokens: bytes,
                 block_tokens: int) -> None:
        self._args: tuple | None = (ns_id, list(keys), parent, raw_tokens, block_tokens)
        self._packed: Packed | None = None
        self._texts: list[BlockText] | None = None
        self._n = len(keys)

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        n = len(self)
        if isinstance(i, slice):
            return [LazyText(self.text, j) for j in range(*i.indices(n))]
        if not -n <= i < n:
            raise IndexError(i)
        return LazyText(self.text, i % n)

    def __iter__(self):
        return map(LazyText, repeat(self.text), range(len(self)))

    def keep(self, book: dict, ns_id: bytes, keys: list[bytes]) -> None:
        """book[ns_id + keys[i]] = the LazyText of block i, for every block (keys as made
        with): one pass in C, no Python call per block on the Commit path."""
        book.update(zip(map(ns_id.__add__, keys), map(LazyText, repeat(self.text),
                                                        range(len(keys))), strict=True))

    def packed(self) -> Packed:
        got = self._packed
        if got is None:
            args = self._args
            if args is None:        # made meanwhile by another reader (it sets _packed first)
                got = self._packed
            else:
                got = self._packed = pack_commit(*args)
                self._args = None
        return got  # type: ignore[return-value]

    def text(self, i: int) -> BlockText:
        texts = self._texts
        if texts is None:
            texts = self._texts = _split(self.packed())
        return texts[i]


class LazyText(partial):
    """One block's place in a LazyTexts (its bound `text` and the block's index), kept in the
    recorder's book until read. (A partial: made in C, so a commit's book entries cost no
    Python call per block.)"""

    __slots__ = ()

    def get(self) -> BlockText:
        return self()

    @property
    def owner(self) -> LazyTexts:
        return self.func.__self__  # type: ignore[attr-defined]

    @property
    def i(self) -> int:
        return self.args[0]


def resolve(text: BlockText | LazyText | None) -> BlockText | None:
    """A book entry as a text (a LazyText is made now)."""
    return text.get() if type(text) is LazyText else text
