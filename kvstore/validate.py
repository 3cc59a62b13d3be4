"""Checks of what a call names: block keys, a parent key, and what a Commit brings.

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


class CheckedKeys(list):
    """Keys the server checked already as `checked_keys(keys, chain=True)` checks them (bytes of
    16..32 bytes each, distinct, at most MAX_KEYS_PER_CALL): made only by the server's check of
    a request (kvstore/handlers/validate.py, check_keys with `distinct`), which the store's
    check then passes as they are. Why: each hot call's keys were checked twice, once at the
    trust boundary and again here, ~1.5 us of a lookup's ~12 us in the servicer. A slice or
    copy of them is a plain list, checked again."""


def checked_keys(keys: Sequence[bytes], allow_empty: bool = False, chain: bool = False
                 ) -> list[bytes]:
    """Checked keys; `chain`: a prefix chain (or Locate's set), which names each block once
    (kvstore/keychain.py). Checked STEP keys at a time, for the GIL's sake (same module).
    CheckedKeys, checked at the server, pass as they are."""
    if not allow_empty and len(keys) == 0:
        raise InvalidArgument("no keys given")
    if type(keys) is CheckedKeys:
        return keys
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


def check_checksums(checksums: Sequence[int] | None) -> None:
    """A checksum of 0 is refused: every host or gpu copy's checksum is checked on every read
    as it is, so a client may not mark a block "unknown"."""
    if checksums and 0 in checksums:
        i = list(checksums).index(0)
        raise InvalidArgument(f"checksums[{i}] is 0; send each block's xxh3-64")


def checked_token_ids(token_ids: bytes | Sequence[int] | None) -> bytes | None:
    """Token ids as Commit carries them (little-endian uint32 bytes); in-process callers may
    pass a sequence of ints."""
    if token_ids is None or isinstance(token_ids, bytes):
        return token_ids
    from .events.texts import tokens_u32
    try:
        return tokens_u32(token_ids)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def check_commit(lease, n_keys: int, first_slot: int, checksums: Sequence[int] | None,
                 token_ids: bytes | None, block_tokens: int) -> None:
    """What Commit asks of its lease: a write lease, slots for every key, a checksum per key
    where any come, and `block_tokens` token ids per key where any come."""
    if lease.kind != "write":
        raise InvalidArgument(f"lease {lease.id} is a read lease; commit takes the lease "
                              "Reserve returned")
    if first_slot and lease.tier != "host":
        raise InvalidArgument("first_slot is for host leases; commit a gpu lease from "
                              "its first slot")
    if first_slot + n_keys > len(lease.slots):
        raise InvalidArgument(f"{n_keys} keys from slot {first_slot} for a lease of "
                              f"{len(lease.slots)} slots")
    if checksums and len(checksums) != n_keys:
        raise InvalidArgument(f"{len(checksums)} checksums for {n_keys} keys")
    if token_ids and len(token_ids) != 4 * n_keys * block_tokens:
        got = (f"{len(token_ids) // 4} token ids" if len(token_ids) % 4 == 0 else
               f"{len(token_ids)} bytes of token ids (4 a token)")
        raise InvalidArgument(f"{got} for {n_keys} keys; send {block_tokens} per key (the "
                              "namespace's block_tokens, little-endian uint32) or none")
