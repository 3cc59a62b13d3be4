"""The device interface: what the store needs from a tier in device memory, and how one is made.

Why an interface: the store's GPU-tier logic (placement, leases, eviction with demotion,
promotion, verification) must not depend on CUDA, or it could never run on a machine without
a GPU. Everything that only a device can do sits behind this small surface:

- allocate/free slots in one preallocated slab (`alloc`, `free`, `used_bytes`: the same
  `ExtentAllocator` as the host tier),
- a view of a slot (`view`),
- batched asynchronous copies device<->host with completion (`copy_to_host_batch`,
  `copy_from_host_batch` return a `Transfer`), and device<->device (`gather`),
- the checksum of slots, for verification after every move (`checksums`, and the checked
  copies `copy_to_host_checked` / `copy_from_host_checked` that move and hash in one call),
- export of the slab for clients (`describe`, opened by `kvstore_client.gpu.open_pool`),
- optional device-side encode before a copy to a keyed tier (`encode_batch`).

Two implementations: `tiers.gpu.GPUTier` (CUDA: cudaMalloc'd slab, IPC handle, streams) and
`tiers.device_cpu.CpuDeviceTier` (its "device memory" is a shared-memory slab of its own,
exported by name). `tiers.device_open` picks one per configured device (it imports both; this
module imports neither).
"""

from __future__ import annotations

import concurrent.futures as cf
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

import numpy as np
from kvstore_client.common.errors import InvalidArgument
from kvstore_client.common.layout import KVLayout
from kvstore_client.common.runs import coalesce_runs
from kvstore_client.common.transfer import Transfer

from .slab import SlabAllocation

PAGE = 4096
DEFAULT_WAIT_S = 30.0

Item = tuple[int, int, int]            # (device_offset, other_offset, nbytes)


class DeviceTier(SlabAllocation, ABC):
    """One slab of `capacity` bytes on one device, cut into 4 KiB-aligned slots.

    Not thread-safe for alloc/free (the store's lock covers them, as for the host tier); copies
    may run from any thread on slots the caller owns.
    """

    name = "gpu"
    kind = ""                   # "cuda" or "cpu"
    capacity: int
    device: int

    # -- access --------------------------------------------------------------------------------
    @abstractmethod
    def view(self, offset: int, nbytes: int) -> Any:
        """1-D uint8 view of slab bytes [offset, offset+nbytes) on the device, zero copy."""

    @abstractmethod
    def describe(self) -> dict:
        """What a client needs to open the slab: `kvstore_client.gpu.open_pool(describe())`."""

    # -- copies --------------------------------------------------------------------------------
    @abstractmethod
    def copy_to_host_batch(self, items: Sequence[Item], host: np.ndarray,
                           after: Any = None) -> Transfer:
        """Enqueue device -> host copies of (device_offset, host_offset, nbytes); no wait."""

    @abstractmethod
    def copy_from_host_batch(self, items: Sequence[Item], host: np.ndarray,
                             after: Any = None) -> Transfer:
        """Enqueue host -> device copies of (device_offset, host_offset, nbytes)."""

    @abstractmethod
    def gather(self, items: Sequence[Item], dst: DeviceTier | None = None) -> Transfer:
        """Device -> device: copy (src_offset, dst_offset, nbytes) from this slab into `dst`
        (default: this slab); ranges must not overlap."""

    @abstractmethod
    def encode_batch(self, items: Sequence[tuple[int, int]], codec: str, layout: KVLayout,
                     after: Any = None) -> cf.Future[list[bytes]]:
        """Encode blocks at (offset, nbytes) with `codec` for a keyed tier (ssd, remote), on the
        device where the codec allows; the Future yields one payload per item, in order."""

    def checksums(self, items: Sequence[tuple[int, int]],
                  timeout_s: float = DEFAULT_WAIT_S) -> list[int]:
        """xxh3-64 of each slot (offset, nbytes): how the store verifies a block after a move."""
        import xxhash

        total = sum(n for _, n in items)
        stage = np.empty(total, np.uint8)
        plan, pos = [], 0
        for off, n in items:
            plan.append((off, pos, n))
            pos += n
        self.copy_to_host_batch(plan, stage).wait(timeout_s)
        return [xxhash.xxh3_64_intdigest(stage[p:p + n]) for _, p, n in plan]

    def copy_to_host_checked(self, items: Sequence[Item], host: np.ndarray,
                             timeout_s: float = DEFAULT_WAIT_S) -> list[int]:
        """Device -> host copies, waited for, and the xxh3-64 of each destination: a move and
        its verification in one call, so a device can fuse them (the CPU device hashes each
        block while it is still in cache)."""
        import xxhash

        self.copy_to_host_batch(items, host).wait(timeout_s)
        return [xxhash.xxh3_64_intdigest(host[h:h + n]) for _, h, n in items]

    def copy_from_host_checked(self, items: Sequence[Item], host: np.ndarray,
                               timeout_s: float = DEFAULT_WAIT_S) -> list[int]:
        """Host -> device copies, waited for, and the xxh3-64 of each device destination."""
        self.copy_from_host_batch(items, host).wait(timeout_s)
        return self.checksums([(g, n) for g, _, n in items], timeout_s)

    def copy_to_host(self, offset: int, nbytes: int, host_view: np.ndarray,
                     timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Copy slab bytes into `host_view` (1-D uint8, >= nbytes) and wait for it."""
        self.copy_to_host_batch([(offset, 0, nbytes)], host_view).wait(timeout_s)

    def copy_from_host(self, offset: int, nbytes: int, host_view: np.ndarray,
                       timeout_s: float = DEFAULT_WAIT_S) -> None:
        """Copy `host_view[:nbytes]` into the slab at `offset` and wait for it."""
        self.copy_from_host_batch([(offset, 0, nbytes)], host_view).wait(timeout_s)

    # -- lifetime ------------------------------------------------------------------------------
    @abstractmethod
    def close(self) -> None:
        """Drain copies in flight, release the slab. Idempotent."""

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    def __enter__(self) -> DeviceTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- shared checks -------------------------------------------------------------------------
    def _check_range(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0 or offset + nbytes > self.capacity:
            raise InvalidArgument(f"{self.kind} device slab range [{offset}, {offset + nbytes}) "
                                  f"is outside the {self.capacity}-byte slab")

    def _plan(self, items: Sequence[Item], other_size: int, what: str
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Validated, coalesced (device, other, nbytes) runs of a batch."""
        arr = np.asarray(items, dtype=np.int64).reshape(-1, 3)
        g, h, n = arr[:, 0], arr[:, 1], arr[:, 2]
        if arr.size and ((g < 0).any() or (h < 0).any() or (n <= 0).any()
                         or (g + n > self.capacity).any() or (h + n > other_size).any()):
            raise InvalidArgument(f"a copy range lies outside the device slab or the {what}")
        return coalesce_runs(g, h, n)


def check_host(host: Any, to_host: bool) -> None:
    if not isinstance(host, np.ndarray) or host.dtype != np.uint8 or host.ndim != 1 \
            or not host.flags.c_contiguous:
        raise InvalidArgument("host buffer must be a 1-D contiguous uint8 numpy array")
    if to_host and not host.flags.writeable:
        raise InvalidArgument("host buffer for a device -> host copy must be writable")
