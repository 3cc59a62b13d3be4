"""Checks of what a call names: block keys and a parent key.

Why keys are checked at C speed first: a Lookup names up to thousands of keys and runs once per
engine request; the per-key loop only runs to say which key is wrong. In steps of
keychain.STEP keys, so that no one C call holds the GIL for long (kvstore/keychain.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore_client.common.errors import InvalidArgument
from kvstore_client.common.hashing import MAX_KEY_BYTES, MIN_KEY_BYTES

from .keychain import STEP, check_distinct

MAX_KEYS_PER_CALL = 1 << 16


def checked_keys(keys: Sequence[bytes], allow_empty: bool = False, chain: bool = False
                 ) -> list[bytes]:
    """Checked keys; `chain`: a prefix chain (or Locate's set), which names each block once
    (kvstore/keychain.py). Checked STEP keys at a time, for the GIL's sake (same module)."""
    if not allow_empty and len(keys) == 0:
        raise InvalidArgument("no keys given")
    if len(keys) > MAX_KEYS_PER_CALL:
        raise InvalidArgument(f"{len(keys)} keys in one call; the limit is {MAX_KEYS_PER_CALL}")
    out: list[bytes] = []
    for i in range(0, len(keys), STEP):
        part = keys[i:i + STEP]
        lens = list(map(len, part)) if set(map(type, part)) == {bytes} else None
        if lens and MIN_KEY_BYTES <= min(lens) and max(lens) <= MAX_KEY_BYTES:
            out += part                 # the common case, checked at C speed
            continue
        for j, k in enumerate(part):
            ok = isinstance(k, (bytes, bytearray))
            if not ok or not MIN_KEY_BYTES <= len(k) <= MAX_KEY_BYTES:
                n = len(k) if ok else type(k).__name__
                raise InvalidArgument(f"key {i + j} is {n} bytes; block keys are "
                                      f"{MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes")
            out.append(bytes(k))
    if chain:
        check_distinct(out)
    return out


def checked_parent(parent: bytes | None) -> bytes | None:
    if not parent:
        return None
    if not MIN_KEY_BYTES <= len(parent) <= MAX_KEY_BYTES:
        raise InvalidArgument(f"parent key is {len(parent)} bytes; block keys are "
                              f"{MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes")
    return bytes(parent)
