"""The gpu tier as a tier: blocks in device slabs, written, leased, demoted and promoted.

Why a module of its own: the store (kvstore/store.py) and the host/SSD mechanics
(kvstore/movement.py) stay as they were apart from a few dispatch lines; everything the gpu
tier adds lives here, written against the device interface (tiers/device.py) only, so the CPU
device runs every line of it and the CUDA device runs the same lines.

How a block moves (docs/gpu.md, "The gpu tier in the store"):
- Reserve(tier="gpu") hands out device slots under a write lease, making room first (gpu
  watermarks, per device); Commit hashes the slots (verification: the checksum the block keeps
  on every tier) and publishes them as the blocks' gpu copies (dedup per tier).
- Eviction from a device demotes: victims without a host copy are copied device -> host into
  slots reserved beforehand, verified against their checksum, and published as host copies;
  host eviction then takes them on to SSD as before. The copy runs without the store lock:
  victims are marked `moving`, so no delete, eviction, lease or promotion touches them.
- Acquire(tier="gpu") pins the prefix's gpu copies; for the rest it runs the host acquire
  (which promotes from SSD/remote, and copies gpu-only blocks to host), copies those host
  copies into device slots reserved beforehand (without the lock), verifies them, publishes
  them and pins them, then lets the host lease go.
- Leases on gpu slots behave as on host: a write lease's slots are freed when it ends
  uncommitted, a read lease pins the gpu copy (`gpu_pins`), and a pinned copy is never a
  victim. A client that dies lets its leases expire.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from kvstore_client.common.errors import DataLoss, InvalidArgument, ResourceExhausted
from kvstore_client.common.lazy import lazy_module

from tiers.host_segments import SegmentedHost

from .index import Entry
from .leases import Lease, Slot
from .movement import LOSSY, Promotion, _aligned, _meta, encode_block

if TYPE_CHECKING:
    import numpy as np

    from tiers import device_segments as _segs
    from tiers.device import DeviceTier, Item
else:   # numpy and the device tiers' modules load with the first device tier, not at start
    np = lazy_module("numpy", globals(), "np")
    _segs = lazy_module("tiers.device_segments", globals(), "_segs")

DEVICE_WAIT_S = 60.0        # a device copy that takes longer than this is an error
VICTIMS_PER_BATCH = 16


class DeviceMovement:
    """Mixin of Store: the gpu tier. Uses the store's attributes (gpu, host, ssd, index,
    policies, leases, counters, tier_counters, config, _lock, _idle, _busy) and its movement
    mixin's host methods. Every method expects the store lock held unless its docstring says
    not; those that say so may release it mid-way."""

    gpu: dict[int, DeviceTier]
    device_counters: dict[int, Counter]

    # ----------------------------------------------------------------- setup and reporting

    def _gpu_policy(self, dev: int):
        return self.policies[f"gpu{dev}"]

    def _pick_device(self, device: int | None, need: int, ns_id: bytes | None = None) -> int:
        """The device a request uses: the one asked for, else the one with the most free bytes
        (in the namespace's own segment, for a tenant with its own slabs)."""
        if not self.gpu:
            raise InvalidArgument("the gpu tier is not enabled on this daemon")
        if device is not None and device >= 0:
            if device not in self.gpu:
                raise InvalidArgument(f"gpu device {device} is not one of this daemon's "
                                      f"devices {sorted(self.gpu)}")
            return device
        def free(d: int) -> int:
            cap, used = self._gpu_room_of(d, self._gpu_seg(d, ns_id) if ns_id else 0)
            return cap - used
        return max(self.gpu, key=free)

    def gpu_stats(self) -> tuple[dict, dict]:
        """(aggregate "gpu" tier figures, per-device figures) for Stats (locked)."""
        per = {}
        for dev, t in self.gpu.items():
            per[str(dev)] = {"kind": t.kind, "capacity_bytes": t.capacity,
                             "used_bytes": t.used_bytes,
                             "blocks": len(self._gpu_policy(dev)),
                             **self.device_counters[dev]}
        agg = {"capacity_bytes": sum(t.capacity for t in self.gpu.values()),
               "used_bytes": sum(t.used_bytes for t in self.gpu.values()),
               "blocks": sum(len(self._gpu_policy(d)) for d in self.gpu),
               **self.tier_counters["gpu"]}
        return agg, per

    # ----------------------------------------------------------------- tenants' segments
    # A tenant with a gpu_quota has a slab of its own on each device (tiers/device_segments.py):
    # its namespaces allocate and make room only there, evicting only their own blocks.

    def _gpu_seg(self, dev: int, ns_id: bytes) -> int:
        """The segment of device `dev` this namespace's blocks live in (0: the shared slab)."""
        t = self.gpu[dev]
        return t.segment_of_tenant(self.owner(ns_id)) if isinstance(t, _segs.SegmentedDevice) else 0

    def _gpu_room_of(self, dev: int, seg: int) -> tuple[int, int]:
        """(capacity, used bytes) of a segment of a device (the whole slab when unsegmented)."""
        t = self.gpu[dev]
        if isinstance(t, _segs.SegmentedDevice):
            return t.capacity_of(seg), t.used_of(seg)
        return t.capacity, t.used_bytes

    def _in_seg(self, dev: int, seg: int, offset: int) -> bool:
        t = self.gpu[dev]
        return not isinstance(t, _segs.SegmentedDevice) or t.segment_of(offset) == seg

    def gpu_segments_of(self, tenant: str | None) -> list[tuple[int, int, dict]]:
        """(device, base offset, describe()) of a tenant's own slabs, one per device; [] for a
        tenant without a gpu_quota (or without the gpu tier)."""
        out = []
        for dev, t in sorted(self.gpu.items()):
            if isinstance(t, _segs.SegmentedDevice):
                seg = t.segment_of_tenant(tenant)
                if seg:
                    out.append((dev, t.base(seg), t.describe_segment(seg)))
        return out

    def gpu_segment_fds(self, tenant: str | None) -> list[tuple[int, int, int]]:
        """(device, fd, size) of a tenant's own CPU-device slabs (memfds), for the handshake."""
        out = []
        for dev, t in sorted(self.gpu.items()):
            if isinstance(t, _segs.SegmentedDevice):
                seg = t.segment_of_tenant(tenant)
                fd = getattr(t.tier(seg), "fd", None) if seg else None
                if fd is not None:
                    out.append((dev, fd, t.capacity_of(seg)))
        return out

    # A tenant with a host_quota keeps its host copies in its own host segment, a mapping of
    # its own: a device copies to and from one host array per call, so a batch is split by it.

    def _host_parts(self, items: Sequence[Item]) -> list[tuple[np.ndarray, list[int],
                                                               list[Item]]]:
        """(host array, item indexes, items with offsets into that array) per host segment."""
        if not isinstance(self.host, SegmentedHost):
            return [(self.host.array, list(range(len(items))), list(items))]
        parts: dict[int, tuple[np.ndarray, list[int], list[Item]]] = {}
        for i, (g, h, n) in enumerate(items):
            arr, base = self.host.array_at(h)
            part = parts.setdefault(base, (arr, [], []))
            part[1].append(i)
            part[2].append((g, h - base, n))
        return list(parts.values())

    def _to_host_checked(self, t: DeviceTier, items: Sequence[Item]) -> list[int]:
        """Device -> host copies (host offsets in the host tier's offset space) and the xxh3
        of each host destination."""
        return self._host_checked(items, t.copy_to_host_checked)

    def _from_host_checked(self, t: DeviceTier, items: Sequence[Item]) -> list[int]:
        """Host -> device copies and the xxh3 of each device destination."""
        return self._host_checked(items, t.copy_from_host_checked)

    def _host_checked(self, items: Sequence[Item], copy: Callable) -> list[int]:
        """Run a checked device copy per host segment; the checksums in `items` order."""
        sums = [0] * len(items)
        for arr, idx, local in self._host_parts(items):
            for i, s in zip(idx, copy(local, arr, DEVICE_WAIT_S), strict=True):
                sums[i] = s
        return sums

    def _count(self, dev: int, key: str, n: int = 1) -> None:
        self.tier_counters["gpu"][key] += n
        self.device_counters[dev][key] += n

    # ----------------------------------------------------------------- write path

    def _gpu_reserve(self, ns_id: bytes, n: int, ttl_s: float | None,
                     device: int | None = None) -> Lease:
        with self._lock:
            self._check_open()
            self._reap_locked()
            info = self._ns(ns_id)
            size = info.block_bytes
            dev = self._pick_device(device, n * _aligned(size), ns_id)
            t = self.gpu[dev]
            seg = self._gpu_seg(dev, ns_id)
            cap = self._gpu_room_of(dev, seg)[0]
            if n * _aligned(size) > cap * self.config.gpu.high_watermark:
                raise ResourceExhausted(
                    f"{n} blocks of {size} bytes do not fit the gpu tier of device {dev} "
                    f"({cap} bytes{self._whose(dev, seg)}); reserve in smaller batches")
            ttl = self.leases.ttl(ttl_s)
            self._gpu_room(dev, n * _aligned(size), seg)
            offsets: list[int] = []
            try:
                for _ in range(n):
                    offsets.append(self._alloc_gpu(dev, size, seg))
            except BaseException:
                for off in offsets:
                    t.free(off)
                raise
            return self.leases.new("write", bytes(ns_id), "gpu",
                                   [Slot(o, size, dev) for o in offsets], ttl)

    def _gpu_commit(self, lease_id: str, keys: list[bytes], parent: bytes | None,
                    checksums: Sequence[int] | None, texts: list | None = None):
        """Commit for a gpu write lease: hash the slots without the lock, then publish.
        `texts`: the blocks' KV-event texts (kvstore/events/), kept as they are published."""
        from .store import CommitResult

        with self._lock:
            self._check_open()
            lease = self.leases.get(lease_id)
            self._check_commit(lease, lease_id, keys, checksums)
            slots = lease.slots[:len(keys)]
            self._busy += 1                 # close() must not free the slabs under the hash
        try:
            # Hashing runs without the lock: the slots belong to this write lease alone, and a
            # lease that expires meanwhile fails the lookup below.
            hashed = self._slot_checksums(slots)
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()
        with self._lock:
            self._check_open()
            lease = self.leases.get(lease_id)
            for i, got in enumerate(hashed):
                if checksums and got != checksums[i]:
                    self.leases.pop(lease_id)
                    self._end_lease(lease)
                    self.counters["commit_checksum_mismatch"] += 1
                    raise DataLoss(f"block {i}'s bytes in the gpu slot do not match the checksum "
                                   "sent with Commit (torn or overlapping write); nothing from "
                                   "this lease was stored")
            self.leases.pop(lease_id)
            stored = dups = 0
            if texts:
                self.events.recorder.remember(lease.ns_id, keys, texts)
            for i, (k, slot) in enumerate(zip(keys, lease.slots, strict=False)):
                prev = parent if i == 0 else keys[i - 1]
                if self._publish_gpu(lease.ns_id, k, prev, slot, hashed[i]):
                    stored += 1
                    self._count(slot.device, "stored")
                    self.device_counters[slot.device]["bytes_in"] += slot.length
                else:
                    dups += 1
                    self.gpu[slot.device].free(slot.offset)
            for slot in lease.slots[len(keys):]:
                self.gpu[slot.device].free(slot.offset)
            self.counters["bytes_client_to_gpu"] += sum(s.length for s in slots[:stored])
            return CommitResult(stored, dups)

    @staticmethod
    def _check_commit(lease: Lease, lease_id: str, keys: list[bytes],
                      checksums: Sequence[int] | None) -> None:
        if lease.kind != "write":
            raise InvalidArgument(f"lease {lease_id} is a read lease; commit takes the lease "
                                  "Reserve returned")
        if len(keys) > len(lease.slots):
            raise InvalidArgument(f"{len(keys)} keys for a lease of {len(lease.slots)} slots")
        if checksums and len(checksums) != len(keys):
            raise InvalidArgument(f"{len(checksums)} checksums for {len(keys)} keys")

    def _slot_checksums(self, slots: Sequence[Slot]) -> list[int]:
        """xxh3 of gpu slots, batched per device (no lock needed: the slots are the caller's)."""
        out: dict[int, int] = {}
        by_dev: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            by_dev.setdefault(s.device, []).append(i)
        for dev, idx in by_dev.items():
            sums = self.gpu[dev].checksums([(slots[i].offset, slots[i].length) for i in idx],
                                           DEVICE_WAIT_S)
            out.update(zip(idx, sums, strict=True))
        return [out[i] for i in range(len(slots))]

    def _publish_gpu(self, ns_id: bytes, key: bytes, parent: bytes | None, slot: Slot,
                     checksum: int) -> bool:
        """Make a filled gpu slot the block's gpu copy; False when it is a duplicate."""
        g = ns_id + key
        e = self.index.get(g)
        if e is not None and e.gpu is not None:
            self._gpu_policy(e.gpu_dev).touch(g)
            self.counters["duplicate_blocks"] += 1
            return False
        if e is not None and e.host is not None and e.checksum and e.checksum != checksum:
            # Same key, other bytes than the host copy (engines differ in low bits): one block
            # never holds two versions; the host copy stays and is promoted on Acquire(gpu).
            self.counters["duplicate_blocks_differing"] += 1
            return False
        if e is None:
            e = Entry(ns_id, key, parent, slot.length, checksum)
            self.index.add(e)
        else:
            e.checksum = checksum       # no other raw copy: this one defines the bytes
            self.index.set_parent(e, parent)
        self.index.set_gpu(e, slot.offset, slot.device)
        self._gpu_policy(slot.device).insert(g, e.parent_gkey, slot.length)
        return True

    # ----------------------------------------------------------------- leases

    def _gpu_end_lease(self, lease: Lease) -> None:
        if lease.kind == "write":
            for s in lease.slots:
                self.gpu[s.device].free(s.offset)
            return
        for k in lease.keys:
            e = self.index.get(lease.ns_id + k)
            if e is not None and e.gpu_pins > 0:
                e.gpu_pins -= 1

    # ----------------------------------------------------------------- room and eviction

    def _whose(self, dev: int, seg: int) -> str:
        t = self.gpu[dev]
        return (f", tenant {t.tenant_of(seg)}'s gpu quota"
                if seg and isinstance(t, _segs.SegmentedDevice) else "")

    def _gpu_room(self, dev: int, need: int, seg: int = 0) -> None:
        """Evict from device `dev` (segment `seg`) so `need` more bytes fit: past high
        watermark, down to low."""
        cap, used = self._gpu_room_of(dev, seg)
        high, low = self.config.gpu.high_watermark * cap, self.config.gpu.low_watermark * cap
        if used + need <= high:
            return
        target = max(0.0, min(low, high - need))
        self._evict_gpu(dev, int(used + need - target), seg=seg)

    def _alloc_gpu(self, dev: int, nbytes: int, seg: int = 0) -> int:
        """A slot on `dev` (in segment `seg`), demoting victims (possibly releasing the lock)
        until one fits."""
        t = self.gpu[dev]

        def alloc() -> int:
            return t.alloc(nbytes, seg) if isinstance(t, _segs.SegmentedDevice) else t.alloc(nbytes)
        for _ in range(64):
            try:
                return alloc()
            except ResourceExhausted:
                pass
            _, blocks = self._evict_gpu(dev, _aligned(nbytes), seg=seg)
            if not blocks:
                break
        try:
            return alloc()
        except ResourceExhausted:
            cap, used = self._gpu_room_of(dev, seg)
            if seg and isinstance(t, _segs.SegmentedDevice):
                tenant = t.tenant_of(seg)
                raise ResourceExhausted(
                    f"tenant {tenant}'s gpu quota is full on device {dev}: {used} of {cap} "
                    f"bytes are leased or pinned and none of its blocks is evictable; release "
                    f"leases or raise tenants.{tenant}.gpu_quota") from None
            raise ResourceExhausted(
                f"gpu tier of device {dev} full: {used} of {cap} bytes are leased "
                "or pinned and nothing is evictable (or the host tier cannot take the victims); "
                "release leases or raise gpu.capacity / host.capacity"
            ) from None

    def evict_gpu(self, nbytes: int | None, only: set[bytes] | None = None) -> tuple[int, int]:
        """Evict across every device (Evict RPC): `nbytes` in all, None for all evictable;
        with `only`, blocks of those namespaces alone (a tenant's Evict)."""
        freed = blocks = 0
        for dev in sorted(self.gpu):
            want = None if nbytes is None else nbytes - freed
            if want is not None and want <= 0:
                break
            f, b = self._evict_gpu(dev, want, only=only)
            freed, blocks = freed + f, blocks + b
        return freed, blocks

    def _evict_gpu(self, dev: int, nbytes: int | None, seg: int | None = None,
                   only: set[bytes] | None = None) -> tuple[int, int]:
        """Demote victims of `dev` until `nbytes` are freed (None: all evictable); with `seg`,
        only blocks in that segment of the device, with `only`, of those namespaces."""
        freed = blocks = 0
        policy = self._gpu_policy(dev)

        def can(g: bytes) -> bool:
            # Host is always below: any unpinned, unmoving block may go (prefix order is the
            # policy's: leaves first).
            e = self.index.get(g)
            return (e is not None and e.gpu is not None and e.gpu_dev == dev
                    and e.gpu_pins == 0 and e.moving is None
                    and (seg is None or self._in_seg(dev, seg, e.gpu))
                    and (only is None or e.ns_id in only))
        while nbytes is None or freed < nbytes:
            batch: list[Entry] = []
            planned = freed
            while len(batch) < VICTIMS_PER_BATCH and (nbytes is None or planned < nbytes):
                g = policy.pick(can)
                if g is None:
                    break
                policy.remove(g)
                e = self.index.get(g)
                if e is None or e.gpu is None:
                    continue
                batch.append(e)
                planned += _aligned(e.size)
            if not batch:
                break
            try:
                f, b = self._demote_gpu(dev, batch)
            except ResourceExhausted:
                # Host cannot take the victims (leased or pinned full): they stay, and what was
                # freed so far counts; an allocation that still does not fit says so itself.
                self.counters["gpu_demotions_refused"] += 1
                break
            freed, blocks = freed + f, blocks + b
        return freed, blocks

    def _demote_gpu(self, dev: int, batch: list[Entry]) -> tuple[int, int]:
        """Copy victims without a host copy to host (verified), then free their gpu slots.

        Host slots are reserved under the lock (making host room may demote host victims to
        SSD); the copy and its verification run without it, the victims marked `moving`. On
        an error every victim goes back as it was and the error propagates.
        """
        t = self.gpu[dev]
        policy = self._gpu_policy(dev)
        flight = threading.Event()
        for e in batch:
            e.moving = flight
        self._busy += 1
        todo = [e for e in batch if e.host is None]
        offs: list[int] = []
        try:
            for e in todo:
                self.movement._host_room(_aligned(e.size), e.ns_id)
                offs.append(self.movement._alloc_host(e.size, e.ns_id))
            items = [(e.gpu, off, e.size) for e, off in zip(todo, offs, strict=True)]
            sums: list[int] = []
            if items:
                with self.movement._unlocked():
                    sums = self._to_host_checked(t, items)
        except BaseException:
            for off in offs:
                self.host.free(off)
            for e in batch:
                e.moving = None
                policy.insert(e.gkey, e.parent_gkey, e.size)
            self._busy -= 1
            flight.set()
            self._idle.notify_all()
            raise
        try:
            host_off = {id(e): (off, s) for e, off, s in zip(todo, offs, sums, strict=True)}
            freed = blocks = 0
            for e in batch:
                e.moving = None
                got = host_off.get(id(e))
                if got is not None:
                    off, s = got
                    if s != e.checksum:     # (0 too: every gpu copy's checksum is known)
                        self.host.free(off)
                        self.counters["corrupt_blocks"] += 1
                        self._drop_gpu_copy(e)
                        self.index.drop_if_gone(e)
                        continue
                    if e.host is None:
                        self.index.set_host(e, off)
                        self.policies["host"].insert(e.gkey, e.parent_gkey, e.size)
                        self.tier_counters["host"]["demotions_in"] += 1
                        self.counters["bytes_gpu_to_host"] += e.size
                        self._count(dev, "demotions")
                    else:                   # a commit stored a host copy meanwhile
                        self.host.free(off)
                if e.gpu_pins:              # defensive: pinned copies are never victims
                    policy.insert(e.gkey, e.parent_gkey, e.size)
                    continue
                t.free(e.gpu)
                self.index.clear_gpu(e)
                freed += _aligned(e.size)
                blocks += 1
            self._count(dev, "evictions", blocks)
            return freed, blocks
        finally:
            self._busy -= 1
            flight.set()
            self._idle.notify_all()

    def _drop_gpu_copy(self, e: Entry) -> None:
        """Forget a block's gpu copy (delete, corruption): free the slot, leave the policy."""
        if e.gpu is None:
            return
        self.gpu[e.gpu_dev].free(e.gpu)
        self._gpu_policy(e.gpu_dev).remove(e.gkey)
        self.index.clear_gpu(e)

    # ----------------------------------------------------------------- read path

    def _gpu_acquire(self, ns_id: bytes, keys: list[bytes], ttl: float,
                     device: int | None = None) -> Lease:
        """Pin the longest cached prefix as gpu copies, promoting from host (and below)."""
        pinned: list[Entry] = []
        host_lease: Lease | None = None
        reserved: list[tuple[Entry, int, int]] = []     # (entry, device, offset)
        try:
            with self._lock:
                self._check_open()
                self._reap_locked()
                self._ns(ns_id)
                for k in keys:
                    e = self.index.get(ns_id + k)
                    if e is None or e.gpu is None or e.moving is not None:
                        break
                    e.gpu_pins += 1
                    pinned.append(e)
                    self._gpu_policy(e.gpu_dev).touch(e.gkey)
                    self._count(e.gpu_dev, "read_hits")
            rest = keys[len(pinned):self._gpu_fit(ns_id, device, len(keys))]
            if rest:
                want = self.movement._remote_wanted(ns_id, rest)
                try:
                    host_lease = self._acquire_from(ns_id, rest, "host", ttl,
                                                    self.movement._fetch_remote(want))
                except ResourceExhausted:
                    if not pinned:
                        raise
                    rest = []           # host cannot stage more: the gpu prefix is the hit
                if host_lease is not None:
                    pinned += self._promote_to_gpu(ns_id, host_lease, device, reserved)
            with self._lock:
                self._check_open()
                self.counters["acquired_blocks"] += len(pinned)
                lease = self.leases.new("read", bytes(ns_id), "gpu",
                                        [Slot(e.gpu, e.size, e.gpu_dev) for e in pinned], ttl,
                                        keys=[e.key for e in pinned],
                                        checksums=[e.checksum for e in pinned])
                pinned = []
                return lease
        finally:
            with self._lock:
                for e in pinned:
                    if e.gpu_pins > 0:
                        e.gpu_pins -= 1
                for _, dev, off in reserved:
                    self.gpu[dev].free(off)
            if host_lease is not None:
                self.release(host_lease.id, missing_ok=True)

    def _gpu_fit(self, ns_id: bytes, device: int | None, n: int) -> int:
        """How many blocks of this namespace one acquire may hold on a device (below its high
        watermark): a longer prefix could never be promoted whole, so it is cut up front."""
        with self._lock:
            size = _aligned(self._ns(ns_id).block_bytes)
            dev = self._pick_device(device, size, ns_id)
            cap = self._gpu_room_of(dev, self._gpu_seg(dev, ns_id))[0]
            return min(n, max(1, int(cap * self.config.gpu.high_watermark) // size))

    def _promote_to_gpu(self, ns_id: bytes, host_lease: Lease, device: int | None,
                        reserved: list[tuple[Entry, int, int]]) -> list[Entry]:
        """Give each block of a host read lease a pinned gpu copy, in key order; stops at the
        first that cannot get one. Called without the lock; `reserved` collects the slots
        reserved and not yet published, for the caller to free on error."""
        chain: list[tuple[Entry, int | None]] = []       # (entry, host offset to copy or None)
        with self._lock:
            self._check_open()
            for k in host_lease.keys:
                e = self.index.get(ns_id + k)
                if e is None:
                    break
                if e.gpu is not None and e.moving is None:
                    chain.append((e, None))
                    continue
                dev = self._pick_device(device, _aligned(e.size), ns_id)
                seg = self._gpu_seg(dev, ns_id)
                try:
                    self._gpu_room(dev, _aligned(e.size), seg)
                    off = self._alloc_gpu(dev, e.size, seg)
                except ResourceExhausted:
                    if chain:
                        break           # a shorter prefix is still a hit
                    raise
                reserved.append((e, dev, off))
                chain.append((e, off))
            self._busy += 1
        try:
            # Host copies stay put (the host lease pins them); the slots are ours alone.
            jobs = [(e, dev, off) for e, dev, off in reserved]
            sums = self._copy_up(jobs)
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()
        by_entry = {id(e): (dev, off, s) for (e, dev, off), s in zip(jobs, sums, strict=True)}
        out: list[Entry] = []
        with self._lock:
            self._check_open()
            for e, _ in chain:
                job = by_entry.get(id(e))
                if job is None:                     # already on gpu when planned
                    if e.gpu is None or e.moving is not None:
                        break
                    e.gpu_pins += 1
                    out.append(e)
                    self._count(e.gpu_dev, "read_hits")
                    continue
                dev, off, s = job
                reserved.remove((e, dev, off))
                if s != e.checksum:                  # (0 too: kvstore/verify.py)
                    self.gpu[dev].free(off)
                    self.counters["corrupt_blocks"] += 1
                    break                            # never served; the host copy stays
                if e.gpu is not None:               # another acquire promoted it meanwhile
                    self.gpu[dev].free(off)
                    self.counters["promotion_duplicates"] += 1
                    if e.moving is not None:
                        break
                else:
                    self.index.set_gpu(e, off, dev)
                    self._gpu_policy(dev).insert(e.gkey, e.parent_gkey, e.size)
                    self._count(dev, "promotions")
                    self.counters["bytes_host_to_gpu"] += e.size
                e.gpu_pins += 1
                out.append(e)
            for e, dev, off in list(reserved):       # past the cut: give the slots back
                self.gpu[dev].free(off)
                reserved.remove((e, dev, off))
        return out

    def _copy_up(self, jobs: list[tuple[Entry, int, int]]) -> list[int]:
        """Host copies -> reserved gpu slots, per device in one batch each; their checksums."""
        by_dev: dict[int, list[int]] = {}
        for i, (_, dev, _) in enumerate(jobs):
            by_dev.setdefault(dev, []).append(i)
        sums: dict[int, int] = {}
        for dev, idx in by_dev.items():
            items = [(jobs[i][2], jobs[i][0].host, jobs[i][0].size) for i in idx]
            got = self._from_host_checked(self.gpu[dev], items)
            sums.update(zip(idx, got, strict=True))
        return [sums[i] for i in range(len(jobs))]

    # ----------------------------------------------------------------- hooks for movement

    def _fill_from_gpu(self, p: Promotion) -> None:
        """Promotion phase 2 for a gpu-only block an acquire wants in host: copy it down into
        the reserved host slot and verify it (no lock; the block is marked moving)."""
        e = p.entry
        t = self.gpu[e.gpu_dev]
        (got,) = self._to_host_checked(t, [(e.gpu, p.offset, e.size)])
        p.source = "gpu"
        p.nbytes = e.size
        if got != p.checksum:   # a gpu copy's checksum is always known: compared, never taken
            p.error = DataLoss("the gpu copy does not match the block's checksum")

    def _flush_gpu_locked(self) -> int:
        """Flush: gpu-only blocks go to SSD, encoded on their device where the codec allows."""
        if self.ssd is None:
            return 0
        todo = [e for e in self.index.hot_entries()
                if e.gpu is not None and e.host is None and not e.ssd and e.moving is None]
        for dev in self.gpu:
            mine = [e for e in todo if e.gpu_dev == dev]
            for i in range(0, len(mine), VICTIMS_PER_BATCH):
                self._gpu_to_ssd(dev, mine[i:i + VICTIMS_PER_BATCH])
        return len(todo)

    def _gpu_to_ssd(self, dev: int, batch: list[Entry]) -> None:
        t = self.gpu[dev]
        values: list[bytes] = []
        from tiers import frame
        from tiers.codecs import NonFiniteBlock

        for e in batch:
            spec = self.namespaces[e.ns_id].spec
            try:
                payload = t.encode_batch([(e.gpu, e.size)], spec.codec,
                                         spec.layout).result(DEVICE_WAIT_S)[0]
                values.append(frame.frame(spec.codec, e.size, payload))
                self.counters[f"codec_blocks_{spec.codec}"] += 1
                self._count(dev, "device_encoded")
            except NonFiniteBlock:
                import numpy as np

                raw = np.empty(e.size, np.uint8)
                t.copy_to_host(e.gpu, e.size, raw, DEVICE_WAIT_S)
                values.append(encode_block(raw, spec.layout, spec.codec, self.counters))
        self.movement._ssd_room(sum(len(v) for v in values))
        texts = self.events.book if self.events is not None else None
        self.ssd.put_many([(e.gkey, v, _meta(e, texts))
                           for e, v in zip(batch, values, strict=True)])
        for e, v in zip(batch, values, strict=True):
            self.index.set_ssd(e)
            self.policies["ssd"].insert(e.gkey, e.parent_gkey, e.size)
            self.tier_counters["ssd"]["demotions_in"] += 1
            self.counters["bytes_gpu_to_ssd"] += len(v)


__all__ = ["LOSSY", "DeviceMovement"]
