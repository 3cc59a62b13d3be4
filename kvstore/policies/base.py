"""What every eviction policy offers the store, and the snapshot format they share.

The store codes against `EvictionPolicy` only, so each tier's policy is chosen by name
(`make_policy`) and the trace bench replays exactly the code the daemon runs. A snapshot is a
msgpack map tagged with the policy's kind and a format version, so one policy's snapshot is
never read back into another.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

import msgpack
from kvstore_client.common.errors import InvalidArgument

SNAPSHOT_VERSION = 1


@runtime_checkable
class EvictionPolicy(Protocol):
    """The interface the store codes against (docs/internals.md)."""

    def insert(self, gkey: bytes, parent: bytes | None, size: int) -> None: ...
    def insert_many(self, items: Iterable[tuple[bytes, bytes | None, int]]) -> None: ...
    def touch(self, gkey: bytes) -> None: ...
    def touch_many(self, gkeys: Iterable[bytes]) -> None: ...
    def remove(self, gkey: bytes) -> None: ...
    def record_miss(self, gkey: bytes) -> None: ...
    def pick(self, can_evict: Callable[[bytes], bool]) -> bytes | None: ...
    def snapshot(self) -> bytes: ...
    def restore(self, blob: bytes) -> None: ...


def pack_snapshot(state: dict[str, Any], version: int = SNAPSHOT_VERSION) -> bytes:
    return msgpack.packb({"v": version, **state}, use_bin_type=True)


def unpack_snapshot(blob: bytes, kind: str, version: int = SNAPSHOT_VERSION) -> dict[str, Any]:
    try:
        state = msgpack.unpackb(blob, raw=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several unrelated types
        raise InvalidArgument(f"policy snapshot is not valid msgpack: {e}") from None
    if not isinstance(state, dict) or state.get("v") != version:
        raise InvalidArgument("policy snapshot has an unknown format version")
    if state.get("kind") != kind:
        raise InvalidArgument(f"policy snapshot is for {state.get('kind')!r}, not {kind!r}")
    return state


class OneByOne:
    """The store's batch calls as a loop, for policies with nothing to gain from a batch."""

    def insert_many(self, items: Iterable[tuple[bytes, bytes | None, int]]) -> None:
        """insert() for each (gkey, parent, size), in order (the store's batch call)."""
        for gkey, parent, size in items:
            self.insert(gkey, parent, size)

    def touch_many(self, gkeys: Iterable[bytes]) -> None:
        """touch() for each key, in order (the store's batch call)."""
        for gkey in gkeys:
            self.touch(gkey)
