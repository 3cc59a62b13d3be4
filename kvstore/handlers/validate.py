"""The checks every field a client controls passes before anything reaches the store.

Why the server validates even though the Store does too: the server is the trust boundary. It
checks lengths, counts, ranges and tier names before the store sees a request, so a malformed
request can never become a crash or an INTERNAL, and the messages can name the protocol field
("keys[3]", "ttl_s") rather than a Python argument.

Why requests are parsed here and not by grpcio: grpcio answers a request it cannot deserialize
with INTERNAL, which would make garbage from a client look like a daemon bug. Every handler
receives the undecoded bytes and parses them with `parse_request`, so a malformed message is an
INVALID_ARGUMENT naming the expected type (Put has its own parser: kvstore/put_wire.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from google.protobuf.message import Message
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client.common.errors import InvalidArgument, NotFound
from kvstore_client.common.layout import KVLayout, NamespaceSpec
from kvstore_client.common.limits import (
    MAX_CARRIED_RELEASES,
    MAX_KEY_BYTES,
    MAX_KEYS,
    MAX_REQUEST_BYTES,
    MIN_KEY_BYTES,
)

from ..keychain import STEP, check_distinct
from ..validate import MAX_KEYS_PER_CALL, CheckedKeys
from .key_scan import refuse_repeated_keys

NS_ID_BYTES = 16
MAX_LEASE_ID = 128
MAX_TEXT = 1024               # model, revision, tenant salt, extra entries
MAX_EXTRA = 64
TIERS = ("gpu", "host", "ssd", "remote")
SLOT_TIERS = ("host", "gpu")  # tiers that hand out slots under leases
if MAX_KEYS > MAX_KEYS_PER_CALL:   # check_keys' CheckedKeys must pass the store's own check
    raise ImportError("the request limit on keys is above the store's")


def parse_request(cls: type[Message], raw: bytes, distinct_keys: bool = False) -> Any:
    """A request message from its bytes, or InvalidArgument naming what was expected.

    `distinct_keys`: the request's `keys` may not repeat one, and a large request that does is
    refused from its raw bytes, before protobuf builds an object per key (key_scan.py)."""
    if len(raw) > MAX_REQUEST_BYTES:
        # Refused before protobuf parses millions of keys (early refusal: docs/security.md).
        raise InvalidArgument(f"request is {len(raw)} bytes; no valid {cls.DESCRIPTOR.full_name} "
                              f"is larger than {MAX_REQUEST_BYTES} bytes (at most {MAX_KEYS} "
                              "keys of at most 32 bytes): split the request")
    if distinct_keys:
        refuse_repeated_keys(raw, cls.DESCRIPTOR.fields_by_name["keys"].number)
    try:
        return cls.FromString(raw)
    except Exception as e:  # DecodeError, or invalid UTF-8 in a string field
        raise InvalidArgument(f"request is not a valid {cls.DESCRIPTOR.full_name} message: "
                              f"{e}") from None


def check_ns(ns_id: bytes, field: str = "namespace_id") -> bytes:
    if len(ns_id) != NS_ID_BYTES:
        what = "missing" if not ns_id else f"{len(ns_id)} bytes"
        raise InvalidArgument(f"{field} is {what}; it must be the {NS_ID_BYTES}-byte id "
                              "RegisterNamespace returned")
    return bytes(ns_id)


def check_key(key: bytes, field: str) -> bytes:
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise InvalidArgument(f"{field} is {len(key)} bytes; block keys are {MIN_KEY_BYTES}.."
                              f"{MAX_KEY_BYTES} bytes (see docs/hashing.md)")
    return bytes(key)


def check_keys(keys: Iterable[bytes], field: str = "keys", allow_empty: bool = False,
               distinct: bool = False) -> list[bytes]:
    """The keys as a list of bytes, each 16..32 bytes (and distinct if asked: then as
    CheckedKeys, which the store passes without checking them again).

    Counted before anything is copied, then converted and checked STEP keys at a time: one C
    call over 65,536 keys would hold the GIL for tens of milliseconds, every other call's
    wait (kvstore/keychain.py)."""
    if not hasattr(keys, "__len__"):
        keys = list(keys)                 # a generator (Put's blocks of one message)
    n = len(keys)
    if not n and not allow_empty:
        raise InvalidArgument(f"{field} is empty; pass at least one block key")
    if n > MAX_KEYS:
        raise InvalidArgument(f"{n} {field} in one request; the limit is {MAX_KEYS}, "
                              "split the request")
    out: list[bytes] = CheckedKeys() if distinct else []
    seen: set[bytes] = set()
    for i in range(0, n, STEP):
        part = list(keys[i:i + STEP])
        lens = set(map(len, part))
        if MIN_KEY_BYTES <= min(lens) and max(lens) <= MAX_KEY_BYTES \
                and set(map(type, part)) == {bytes}:
            out += part                   # the common case (protobuf hands over bytes)
        else:
            part = [check_key(k, f"{field}[{i + j}]") for j, k in enumerate(part)]
            out += part
        if distinct:                      # refused at the first step that repeats a key
            seen.update(part)
            if len(seen) != len(out):
                check_distinct(out, field)
    return out


def check_parent(parent: bytes, field: str = "parent") -> bytes | None:
    return check_key(parent, field) if parent else None


def check_lease_id(lease_id: str) -> str:
    if not lease_id:
        raise InvalidArgument("lease_id is empty; pass the id Reserve or Acquire returned")
    if len(lease_id) > MAX_LEASE_ID or not lease_id.isprintable():
        raise NotFound(f"unknown lease {lease_id[:40]!r}...: not an id this daemon hands out")
    return lease_id


def check_carried(lease_ids: Sequence[str]) -> list[str]:
    """The lease ids a call gives back in passing (release_leases), repeats dropped: each
    is ended under the store lock, so their number is what one call may cost there."""
    if len(lease_ids) > MAX_CARRIED_RELEASES:
        raise InvalidArgument(f"{len(lease_ids)} release_leases in one call; the limit is "
                              f"{MAX_CARRIED_RELEASES} (send the rest with Release)")
    return list(dict.fromkeys(check_lease_id(lease_id) for lease_id in lease_ids))


def check_ttl(ttl_s: float, max_ttl_s: float) -> float | None:
    if math.isnan(ttl_s) or math.isinf(ttl_s) or ttl_s < 0:
        raise InvalidArgument(f"ttl_s must be 0 (daemon default) or a positive number of "
                              f"seconds, got {ttl_s}")
    if ttl_s > max_ttl_s:
        raise InvalidArgument(f"ttl_s={ttl_s:g} is above the daemon's maximum lease of "
                              f"{max_ttl_s:g} s (leases.max_ttl_s); renew the lease instead")
    return ttl_s or None


def check_slot_tier(tier: str, gpu_enabled: bool) -> str:
    tier = tier or "host"
    if tier not in SLOT_TIERS:
        raise InvalidArgument(f"tier {tier[:40]!r} cannot hand out slots; use 'host' (or 'gpu' "
                              "where the gpu tier is enabled)")
    if tier == "gpu" and not gpu_enabled:
        raise InvalidArgument("the gpu tier is not enabled on this daemon (gpu.enabled=false); "
                              "use tier 'host'")
    return tier


def check_count(count: int) -> int:
    if count <= 0:
        raise InvalidArgument("count must be at least 1 block")
    if count > MAX_KEYS:
        raise InvalidArgument(f"count {count} is above the per-request limit {MAX_KEYS}; "
                              "reserve in smaller batches")
    return count


def _text(value: str, field: str) -> str:
    if len(value) > MAX_TEXT:
        raise InvalidArgument(f"{field} is {len(value)} characters; the limit is {MAX_TEXT}")
    return value


def spec_from_proto(msg: pb.NamespaceSpec, has_layout: bool) -> NamespaceSpec:
    """Proto NamespaceSpec -> layout.NamespaceSpec, applying the proto's documented defaults."""
    if not has_layout:
        raise InvalidArgument("spec.layout is missing: give num_layers, num_kv_heads, head_dim, "
                              "block_tokens and dtype")
    if len(msg.extra) > MAX_EXTRA:
        raise InvalidArgument(f"spec.extra has {len(msg.extra)} entries; the limit is {MAX_EXTRA}")
    extra = {_text(k, "spec.extra key"): _text(v, f"spec.extra[{k[:40]!r}]")
             for k, v in msg.extra.items()}
    lay = msg.layout
    layout = KVLayout(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                      head_dim=lay.head_dim, block_tokens=lay.block_tokens,
                      dtype=lay.dtype or "bfloat16",
                      engine_layout=_text(lay.engine_layout, "spec.layout.engine_layout"),
                      block_bytes_opaque=lay.block_bytes,
                      kv_axes=_text(lay.kv_axes, "spec.layout.kv_axes"))
    return NamespaceSpec(model=_text(msg.model, "spec.model"), layout=layout,
                         revision=_text(msg.revision, "spec.revision"),
                         shard_rank=msg.shard_rank, shard_size=msg.shard_size or 1,
                         hash_scheme=_text(msg.hash_scheme, "spec.hash_scheme")
                         or "kvstore-blake3-v1",
                         tenant_salt=_text(msg.tenant_salt, "spec.tenant_salt"),
                         codec=msg.codec or "lossless", extra=extra)
