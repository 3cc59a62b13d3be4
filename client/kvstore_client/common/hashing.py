"""The reference prefix hasher (spec: docs/hashing.md).

A block key must name the whole prefix, not just the block's tokens, or two prompts that share
block i but differ before it would share KV that is not interchangeable. So each key covers its
parent's key. The encoding is fixed byte for byte so other languages produce the same keys; it
never uses Python's `hash`, which is salted per process.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

import blake3

from .errors import InvalidArgument
from .lazy import lazy_module

if TYPE_CHECKING:
    import numpy as np
else:   # the daemon imports the key limits below before it is ready; numpy can wait
    np = lazy_module("numpy", globals(), "np")

DOMAIN = b"kvstore-prefix-v1\x00"
DEFAULT_KEY_BYTES = 16
MIN_KEY_BYTES, MAX_KEY_BYTES = 16, 32

ExtraKey = bytes | str


def _extra_bytes(extra: Sequence[ExtraKey]) -> bytes:
    parts = [len(extra).to_bytes(4, "little")]
    for e in extra:
        b = e.encode("utf-8") if isinstance(e, str) else bytes(e)
        parts.append(len(b).to_bytes(4, "little"))
        parts.append(b)
    return b"".join(parts)


# Engines hand token ids as Python lists. array("I") encodes one with the range and type checks
# in C, at ~10 ns a token where numpy's conversion of a list costs ~40: a third of the hashing
# of a 1k-token prompt. Only where "I" is the wire's 4-byte little-endian unsigned int.
_LIST_AS_U32 = array.array("I").itemsize == 4 and sys.byteorder == "little"


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    if _LIST_AS_U32 and type(tokens) is list:
        try:
            return array.array("I", tokens).tobytes()
        except (OverflowError, TypeError):
            pass        # numpy's path below says what is wrong with them
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidArgument(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise InvalidArgument(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 2**32):
        raise InvalidArgument("token ids must lie in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def chain_key(parent: bytes | None, tokens: Sequence[int] | np.ndarray,
              extra_keys: Sequence[ExtraKey] = (), key_bytes: int = DEFAULT_KEY_BYTES) -> bytes:
    """Key of one block given its parent's key (None for the first block)."""
    parent = parent or b""
    if len(parent) > 255:
        raise InvalidArgument("parent key longer than 255 bytes")
    tb = _token_bytes(tokens)
    msg = b"".join((DOMAIN, bytes([len(parent)]), parent,
                    (len(tb) // 4).to_bytes(4, "little"), tb, _extra_bytes(extra_keys)))
    return blake3.blake3(msg).digest(key_bytes)


def block_keys(token_ids: Sequence[int] | np.ndarray, block_tokens: int, *,
               parent: bytes | None = None, extra_keys: Sequence[ExtraKey] = (),
               block_extra_keys: Sequence[Sequence[ExtraKey]] | None = None,
               key_bytes: int = DEFAULT_KEY_BYTES) -> list[bytes]:
    """Keys of every *full* block of `token_ids`; a trailing partial block gets no key.

    `extra_keys` apply to every block (e.g. a LoRA name); `block_extra_keys[i]` are appended for
    block i only (e.g. hashes of images whose tokens fall in that block).
    """
    if isinstance(block_tokens, bool) or not isinstance(block_tokens, int) or block_tokens <= 0:
        raise InvalidArgument(f"block_tokens must be a positive integer, got {block_tokens!r}")
    if not MIN_KEY_BYTES <= key_bytes <= MAX_KEY_BYTES:
        raise InvalidArgument(f"key_bytes must be in [{MIN_KEY_BYTES}, {MAX_KEY_BYTES}]")
    if type(token_ids) is not list:     # a list goes to _token_bytes as it is (fast path)
        token_ids = np.asarray(token_ids)
    n = len(token_ids) // block_tokens
    if block_extra_keys is not None and len(block_extra_keys) < n:
        raise InvalidArgument(
            f"block_extra_keys has {len(block_extra_keys)} entries for {n} full blocks")
    if parent is not None and len(parent) > 255:
        raise InvalidArgument("parent key longer than 255 bytes")
    # One pass over the tokens (checked and encoded once), then one short message per block:
    # the per-block Python work is a join and a blake3 call, ~1 us that dominates small blocks
    # (docs/sdk.md gives the rates).
    tb = _token_bytes(token_ids[:n * block_tokens])
    head = block_tokens.to_bytes(4, "little")
    common = _extra_bytes(extra_keys)
    step = 4 * block_tokens
    b3 = blake3.blake3
    keys: list[bytes] = []
    prev = parent or b""
    start = DOMAIN + _LEN_BYTE[len(prev)]
    chained = DOMAIN + _LEN_BYTE[key_bytes]     # every later block's parent is a key
    for i in range(n):
        if block_extra_keys is None:
            tail = common
        else:
            tail = _extra_bytes([*extra_keys, *block_extra_keys[i]])
        prev = b3(b"".join((start, prev, head, tb[i * step:(i + 1) * step], tail))
                  ).digest(key_bytes)
        start = chained
        keys.append(prev)
    return keys


_LEN_BYTE = [bytes((i,)) for i in range(256)]
