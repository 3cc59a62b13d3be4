"""The two kinds of tier the store moves blocks between, as the moves (kvstore/moves/) use them.

Slot tiers hold raw blocks in one preallocated slab cut into page-aligned slots, addressed by
offset: host memory (`tiers.host.HostTier`, and `tiers.host_segments.SegmentedHost` with
tenants' own pools) and device memory (`tiers.device.DeviceTier`: CUDA, or the CPU device).
Clients map the slab and copy into and out of slots themselves; the store only allocates, frees
and, for a device, copies between device and host with a checksum of what landed.

Keyed tiers hold framed, encoded blocks (tiers/frame.py) by global key: the local SSD
(`tiers.ssd.SSDTier`) and the shared network tier (`tiers.remote.RemoteTier`, Redis/Valkey).
Nothing maps them; every byte goes through these calls, which are safe from any thread, so the
moves call them without the store lock.

These are structural contracts (Protocols, checked with isinstance where it matters): the tier
classes do not inherit from them, and each names exactly what some move needs, no more
(tests/test_tier_contracts.py checks every tier class satisfies its contract).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

Item = tuple[int, int, int]        # (device offset, host offset, nbytes) of one device copy


@runtime_checkable
class SlotTier(Protocol):
    """A slab of `capacity` bytes cut into page-aligned slots (host, or one device)."""

    name: str
    capacity: int

    @property
    def used_bytes(self) -> int: ...

    def alloc(self, nbytes: int) -> int:
        """Offset of a slot of at least `nbytes`; ResourceExhausted when none fits."""

    def free(self, offset: int) -> None: ...

    def view(self, offset: int, nbytes: int) -> Any:
        """The slot's bytes, zero copy (host: a 1-D uint8 numpy array)."""

    def describe(self) -> dict:
        """What a client needs to map the slab."""

    def close(self) -> None: ...


@runtime_checkable
class DeviceSlotTier(SlotTier, Protocol):
    """A slot tier in device memory: the moves copy its slots to and from host slots, and
    every copy comes back with the checksum of the bytes that landed (verify on settle)."""

    kind: str

    def checksums(self, items: Sequence[tuple[int, int]], timeout_s: float = ...
                  ) -> list[int]: ...

    def copy_to_host_checked(self, items: Sequence[Item], host: Any,
                             timeout_s: float = ...) -> list[int]: ...

    def copy_from_host_checked(self, items: Sequence[Item], host: Any,
                               timeout_s: float = ...) -> list[int]: ...


@runtime_checkable
class KeyedTier(Protocol):
    """Framed blocks by global key (SSD, remote); every call is safe without the store lock."""

    name: str

    @property
    def used_bytes(self) -> int: ...

    def delete_many(self, gkeys: Iterable[bytes]) -> int: ...

    def close(self) -> None: ...


@runtime_checkable
class DiskTier(KeyedTier, Protocol):
    """The local SSD tier: written straight from host slots, read by promotions in runs of
    adjacent extents, persistent across restarts."""

    capacity: int

    def put_filled(self, items: list[tuple[bytes, int, bytes]],
                   fill: Callable[[int, memoryview], bool]) -> list[bool]:
        """(key, value length, meta) per item; fill(i, dst) writes value i (False: skip)."""

    def visit_many(self, gkeys: list[bytes], fn: Callable[[int, memoryview], object]
                   ) -> list[Any]:
        """fn(i, verified value) per stored key; per key True, False (missing) or DataLoss."""

    def get(self, gkey: bytes) -> bytes | None: ...

    def delete_sized(self, gkeys: Iterable[bytes]) -> int:
        """Delete the keys in one commit; the stored bytes freed."""

    def contains(self, gkey: bytes) -> bool: ...

    def put_state(self, name: str, blob: bytes) -> None: ...

    def sync(self) -> None: ...


@runtime_checkable
class NetworkTier(KeyedTier, Protocol):
    """The shared remote tier: batched round trips, and a node may be down (a write that does
    not land leaves the block where it was)."""

    def put_many(self, items: Sequence[tuple[bytes, Any]]) -> int:
        """Write (key, framed value) pairs; the bytes that landed."""

    def get_many(self, gkeys: Sequence[bytes], deadline_s: float | None = None,
                 unframed: bool = False) -> list[Any]: ...

    def exists_many(self, gkeys: Sequence[bytes], deadline_s: float | None = None
                    ) -> list[bool]: ...


__all__ = ["DeviceSlotTier", "DiskTier", "Item", "KeyedTier", "NetworkTier", "SlotTier"]
