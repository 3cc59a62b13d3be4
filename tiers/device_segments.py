"""A device tier with one private segment per tenant: the shared slab plus a slab per tenant.

Why: a client that maps a device pool can read and write every byte of it, so a pool shared by
tenants lets any of them read or overwrite the others' blocks. A tenant with a `gpu_quota` gets
a slab of its own on each device (CUDA: a separate allocation with its own IPC handle; the CPU
device: a memfd, which has no name and reaches a client only as a file descriptor over the
handshake socket), handed only to that tenant. Its namespaces allocate and evict only there,
so the quota is enforced by construction, as for host pools (tiers/host_segments.py).

Why one offset space: the store addresses gpu copies by (device, offset) everywhere. Segment i
covers offsets [base_i, base_i + size_i) of the device, segment 0 being the shared slab at
base 0; only allocation needs to say which segment, and the server rebases a tenant's slot
offsets to its own slab before they leave the daemon. Everything here is written against the
device interface, so the CPU device runs every line of it.
"""

from __future__ import annotations

import bisect
import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from kvstore_client.common.errors import InvalidArgument
from kvstore_client.common.layout import KVLayout
from kvstore_client.common.transfer import Transfer

from .device import DeviceTier, Item

MakeSegment = Callable[[str, int, int], DeviceTier]   # (tenant, size, device) -> its slab


class SegmentedDevice(DeviceTier):
    """Drop-in for one device's DeviceTier over the shared slab plus one slab per tenant."""

    def __init__(self, shared: DeviceTier, quotas: dict[str, int], make: MakeSegment) -> None:
        self.shared = shared
        self.kind = shared.kind
        self.device = shared.device
        self._segments: list[DeviceTier] = []
        self._names: list[str] = []
        self._by_tenant: dict[str, int] = {}
        base = shared.capacity
        bases = [0]
        try:
            for tenant, size in sorted(quotas.items()):
                seg = make(tenant, size, shared.device)
                self._segments.append(seg)
                self._names.append(tenant)
                self._by_tenant[tenant] = len(self._segments)
                bases.append(base)
                base += seg.capacity
        except BaseException:
            for seg in self._segments:
                seg.close()
            raise
        self._bases = bases
        self.capacity = base

    # -- segments -----------------------------------------------------------------------------
    def segment_of_tenant(self, tenant: str | None) -> int:
        """The segment a tenant's blocks live in (0: the shared slab)."""
        return self._by_tenant.get(tenant, 0) if tenant else 0

    def segment_of(self, offset: int) -> int:
        return bisect.bisect_right(self._bases, offset) - 1

    def tier(self, seg: int) -> DeviceTier:
        return self.shared if seg == 0 else self._segments[seg - 1]

    def base(self, seg: int) -> int:
        return self._bases[seg]

    def tenant_of(self, seg: int) -> str | None:
        return None if seg == 0 else self._names[seg - 1]

    def capacity_of(self, seg: int) -> int:
        return self.tier(seg).capacity

    def used_of(self, seg: int) -> int:
        return self.tier(seg).used_bytes

    def _locate(self, offset: int) -> tuple[DeviceTier, int]:
        seg = self.segment_of(offset)
        return self.tier(seg), offset - self._bases[seg]

    def _split(self, items: Sequence[Item]) -> dict[int, list[Item]]:
        """Items per segment, device offsets made local to it (a range may not cross one)."""
        out: dict[int, list[Item]] = {}
        for g, h, n in items:
            seg = self.segment_of(g)
            local = g - self._bases[seg]
            if local + n > self.capacity_of(seg):
                raise InvalidArgument(f"device range [{g}, {g + n}) crosses a segment's end")
            out.setdefault(seg, []).append((local, h, n))
        return out

    # -- allocation (SlabAllocation's interface, plus the segment) ------------------------------
    @property
    def used_bytes(self) -> int:
        return self.shared.used_bytes + sum(s.used_bytes for s in self._segments)

    def alloc(self, nbytes: int, seg: int = 0) -> int:
        return self._bases[seg] + self.tier(seg).alloc(nbytes)

    def free(self, offset: int) -> None:
        tier, local = self._locate(offset)
        tier.free(local)

    def size_of(self, offset: int) -> int:
        tier, local = self._locate(offset)
        return tier.size_of(local)

    # -- the device interface -------------------------------------------------------------------
    def view(self, offset: int, nbytes: int) -> Any:
        tier, local = self._locate(offset)
        return tier.view(local, nbytes)

    def describe(self) -> dict:
        return self.shared.describe()

    def describe_segment(self, seg: int) -> dict:
        return self.tier(seg).describe()

    def _batch(self, items: Sequence[Item], call: Callable[[DeviceTier, list[Item]], Transfer]
               ) -> Transfer:
        parts = self._split(items)
        if len(parts) <= 1:
            seg, local = next(iter(parts.items()), (0, []))
            return call(self.tier(seg), local)
        # Batches mixing tenants are rare (flush across namespaces): run them one after another.
        total = 0
        for seg, local in parts.items():
            t = call(self.tier(seg), local)
            t.wait(30.0)
            total += t.nbytes
        return Transfer(None, method="segments", nbytes=total)

    def copy_to_host_batch(self, items: Sequence[Item], host: np.ndarray,
                           after: Any = None) -> Transfer:
        return self._batch(items, lambda t, it: t.copy_to_host_batch(it, host, after))

    def copy_from_host_batch(self, items: Sequence[Item], host: np.ndarray,
                             after: Any = None) -> Transfer:
        return self._batch(items, lambda t, it: t.copy_from_host_batch(it, host, after))

    def gather(self, items: Sequence[Item], dst: DeviceTier | None = None) -> Transfer:
        if dst is not None and dst is not self:
            raise InvalidArgument("a segmented device gathers only within itself")
        parts = self._split(items)
        seg, local = next(iter(parts.items()), (0, []))
        base = self._bases[seg]
        if len(parts) > 1 or any(self.segment_of(d) != seg for _, d, _ in items):
            raise InvalidArgument("a gather may not cross tenants' segments")
        return self.tier(seg).gather([(g, d - base, n) for g, d, n in local])

    def encode_batch(self, items: Sequence[tuple[int, int]], codec: str, layout: KVLayout,
                     after: Any = None) -> cf.Future[list[bytes]]:
        parts = self._split([(o, 0, n) for o, n in items])
        if len(parts) > 1:
            raise InvalidArgument("an encode batch may not cross tenants' segments")
        seg, local = next(iter(parts.items()), (0, []))
        return self.tier(seg).encode_batch([(o, n) for o, _, n in local], codec, layout, after)

    def _per_segment(self, items: Sequence[Item], fn: Callable[[DeviceTier, list[Item]],
                                                                  list[int]]) -> list[int]:
        out: list[int] = [0] * len(items)
        order: dict[int, list[int]] = {}
        for i, (g, _, _) in enumerate(items):
            order.setdefault(self.segment_of(g), []).append(i)
        for seg, local in self._split(items).items():
            out_idx = order[seg]
            for i, s in zip(out_idx, fn(self.tier(seg), local), strict=True):
                out[i] = s
        return out

    def checksums(self, items: Sequence[tuple[int, int]], timeout_s: float = 30.0) -> list[int]:
        return self._per_segment([(o, 0, n) for o, n in items],
                                 lambda t, it: t.checksums([(g, n) for g, _, n in it],
                                                           timeout_s))

    def copy_to_host_checked(self, items: Sequence[Item], host: np.ndarray,
                             timeout_s: float = 30.0) -> list[int]:
        return self._per_segment(items, lambda t, it: t.copy_to_host_checked(it, host,
                                                                             timeout_s))

    def copy_from_host_checked(self, items: Sequence[Item], host: np.ndarray,
                               timeout_s: float = 30.0) -> list[int]:
        return self._per_segment(items, lambda t, it: t.copy_from_host_checked(it, host,
                                                                               timeout_s))

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        for seg in self._segments:
            seg.close()
        self.shared.close()

    @property
    def closed(self) -> bool:
        return self.shared.closed
