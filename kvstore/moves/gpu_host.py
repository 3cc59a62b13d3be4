"""gpu <-> host: blocks between a device's slab and host slots, and room on a device.

Written against the device contract (tiers/base.py, DeviceSlotTier) only, so the CPU device
runs every line of it and the CUDA device runs the same lines (docs/gpu.md, "The gpu tier in
the store"). Every copy comes back with the checksum of the bytes that landed, compared with
the block's (verify on settle): a copy that differs is never published.

Down (eviction from a device): victims are picked from the device's policy, leaves first.
Those without a host copy get host slots reserved under the lock (making host room may move
host victims on down to SSD), are copied device -> host without the lock (marked `moving`,
so no delete, eviction, lease or promotion touches them), and are published as host copies
under it; then their device slots are freed. Host eviction takes them further down later.

Up (Acquire on the gpu tier): the blocks of a host read lease get device slots reserved under
the lock (room made on the device first), are copied host -> device without it (the host
lease pins the host copies), and are published and pinned under it again.

For a promotion into host whose only copy is on a device, `fill_down` copies it into the
reserved host slot (promotion.py).

A tenant with a gpu_quota has a slab of its own on each device (kvstore/pools.py): its
namespaces allocate and make room only there, evicting only their own blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from kvstore_client.common.errors import DataLoss, InvalidArgument, ResourceExhausted

from tiers.host_segments import SegmentedHost

from ..index import Entry
from ..leases import Lease
from ..pools import TenantPools
from ..state import StoreState, aligned
from .common import Flight, copy_verified, pick_victims
from .host_room import HostRoom
from .promotion import Promotion

if TYPE_CHECKING:
    import numpy as np

    from tiers.base import Item

DEVICE_WAIT_S = 60.0        # a device copy that takes longer than this is an error
VICTIMS_PER_BATCH = 16
ALLOC_ROUNDS = 64           # evictions an allocation tries before it gives up


class GpuHost:
    def __init__(self, state: StoreState, pools: TenantPools, host_room: HostRoom) -> None:
        self.state = state
        self.pools = pools
        self.host_room = host_room

    def count(self, dev: int, key: str, n: int = 1) -> None:
        self.state.tier_counters["gpu"][key] += n
        self.state.device_counters[dev][key] += n

    # -- placement and room -------------------------------------------------------------------
    def pick_device(self, device: int | None, ns_id: bytes | None = None) -> int:
        """The device a request uses: the one asked for, else the one with the most free bytes
        (in the namespace's own segment, for a tenant with its own slabs)."""
        gpu = self.state.gpu
        if not gpu:
            raise InvalidArgument("the gpu tier is not enabled on this daemon")
        if device is not None and device >= 0:
            if device not in gpu:
                raise InvalidArgument(f"gpu device {device} is not one of this daemon's "
                                      f"devices {sorted(gpu)}")
            return device

        def free(d: int) -> int:
            cap, used = self.pools.gpu_room(d, self.pools.gpu_segment(d, ns_id) if ns_id else 0)
            return cap - used
        return max(gpu, key=free)

    def whose(self, dev: int, seg: int) -> str:
        tenant = self.pools.gpu_tenant_of(dev, seg)
        return f", tenant {tenant}'s gpu quota" if tenant else ""

    def make_room(self, dev: int, need: int, seg: int = 0) -> None:
        """Evict from device `dev` (segment `seg`) so `need` more bytes fit: past the high
        watermark, down to the low."""
        cap, used = self.pools.gpu_room(dev, seg)
        cfg = self.state.config.gpu
        high, low = cfg.high_watermark * cap, cfg.low_watermark * cap
        if used + need <= high:
            return
        target = max(0.0, min(low, high - need))
        self.evict(dev, int(used + need - target), seg=seg)

    def alloc(self, dev: int, nbytes: int, seg: int = 0) -> int:
        """A slot on `dev` (in segment `seg`), demoting victims (possibly releasing the lock)
        until one fits."""
        t = self.state.gpu[dev]

        def alloc() -> int:
            return t.alloc(nbytes, seg) if seg else t.alloc(nbytes)
        for _ in range(ALLOC_ROUNDS):
            try:
                return alloc()
            except ResourceExhausted:
                pass
            _, blocks = self.evict(dev, aligned(nbytes), seg=seg)
            if not blocks:
                break
        try:
            return alloc()
        except ResourceExhausted:
            cap, used = self.pools.gpu_room(dev, seg)
            tenant = self.pools.gpu_tenant_of(dev, seg)
            if tenant:
                raise ResourceExhausted(
                    f"tenant {tenant}'s gpu quota is full on device {dev}: {used} of {cap} "
                    f"bytes are leased or pinned and none of its blocks is evictable; release "
                    f"leases or raise tenants.{tenant}.gpu_quota") from None
            raise ResourceExhausted(
                f"gpu tier of device {dev} full: {used} of {cap} bytes are leased "
                "or pinned and nothing is evictable (or the host tier cannot take the victims); "
                "release leases or raise gpu.capacity / host.capacity"
            ) from None

    # -- down: eviction -------------------------------------------------------------------------
    def evict_all(self, nbytes: int | None, only: set[bytes] | None = None) -> tuple[int, int]:
        """Evict across every device (Evict RPC): `nbytes` in all, None for all evictable;
        with `only`, blocks of those namespaces alone (a tenant's Evict)."""
        freed = blocks = 0
        for dev in sorted(self.state.gpu):
            want = None if nbytes is None else nbytes - freed
            if want is not None and want <= 0:
                break
            f, b = self.evict(dev, want, only=only)
            freed, blocks = freed + f, blocks + b
        return freed, blocks

    def evict(self, dev: int, nbytes: int | None, seg: int | None = None,
              only: set[bytes] | None = None) -> tuple[int, int]:
        """Demote victims of `dev` until `nbytes` are freed (None: all evictable); with `seg`,
        only blocks in that segment of the device, with `only`, of those namespaces."""
        st = self.state
        index = st.index
        freed = blocks = 0
        policy = st.policy_of_device(dev)

        def can(g: bytes) -> bool:
            # Host is always below: any unpinned, unmoving block may go (prefix order is the
            # policy's: leaves first).
            e = index.get(g)
            return (e is not None and e.gpu is not None and e.gpu_dev == dev
                    and e.gpu_pins == 0 and e.moving is None
                    and (seg is None or self.pools.in_gpu_segment(dev, seg, e.gpu))
                    and (only is None or e.ns_id in only))
        while nbytes is None or freed < nbytes:
            batch = pick_victims(policy, can, index.get, lambda e: e.gpu is not None,
                                 VICTIMS_PER_BATCH,
                                 float("inf") if nbytes is None else nbytes - freed)
            if not batch:
                break
            try:
                f, b = self.demote(dev, batch)
            except ResourceExhausted:
                # Host cannot take the victims (leased or pinned full): they stay, and what was
                # freed so far counts; an allocation that still does not fit says so itself.
                st.counters["gpu_demotions_refused"] += 1
                break
            freed, blocks = freed + f, blocks + b
        return freed, blocks

    def demote(self, dev: int, batch: list[Entry]) -> tuple[int, int]:
        """Copy victims without a host copy to host (verified), then free their device slots.

        On an error every victim goes back as it was and the error propagates.
        """
        st = self.state
        t = st.gpu[dev]
        policy = st.policy_of_device(dev)
        flight = Flight(st, batch)
        todo = [e for e in batch if e.host is None]
        offs: list[int] = []
        try:
            for e in todo:
                self.host_room.make_room(aligned(e.size), e.ns_id)
                offs.append(self.host_room.alloc(e.size, e.ns_id))
            items = [(e.gpu, off, e.size) for e, off in zip(todo, offs, strict=True)]
            sums: list[int] = []
            if items:
                with st.unlocked():
                    sums = self.to_host_checked(t, items)
        except BaseException:
            for off in offs:
                st.host.free(off)
            for e in batch:
                policy.insert(e.gkey, e.parent_gkey, e.size)
            flight.land()
            raise
        try:
            host_off = {id(e): (off, s) for e, off, s in zip(todo, offs, sums, strict=True)}
            freed = blocks = 0
            for e in batch:
                flight.clear(e)
                got = host_off.get(id(e))
                if got is not None:
                    off, s = got
                    if not copy_verified(e, s):
                        st.host.free(off)
                        st.counters["corrupt_blocks"] += 1
                        self.drop_copy(e)
                        st.index.drop_if_gone(e)
                        continue
                    if e.host is None:
                        st.index.set_host(e, off)
                        st.policies["host"].insert(e.gkey, e.parent_gkey, e.size)
                        st.tier_counters["host"]["demotions_in"] += 1
                        st.counters["bytes_gpu_to_host"] += e.size
                        self.count(dev, "demotions")
                    else:                   # a commit stored a host copy meanwhile
                        st.host.free(off)
                if e.gpu_pins:              # defensive: pinned copies are never victims
                    policy.insert(e.gkey, e.parent_gkey, e.size)
                    continue
                t.free(e.gpu)
                st.index.clear_gpu(e)
                freed += aligned(e.size)
                blocks += 1
            self.count(dev, "evictions", blocks)
            return freed, blocks
        finally:
            flight.land()

    def drop_copy(self, e: Entry) -> None:
        """Forget a block's gpu copy (delete, corruption): free the slot, leave the policy."""
        if e.gpu is None:
            return
        st = self.state
        st.gpu[e.gpu_dev].free(e.gpu)
        st.policy_of_device(e.gpu_dev).remove(e.gkey)
        st.index.clear_gpu(e)

    # -- up: a host read lease's blocks onto a device ----------------------------------------
    def promote(self, ns_id: bytes, host_lease: Lease, device: int | None,
                reserved: list[tuple[Entry, int, int]]) -> list[Entry]:
        """Give each block of a host read lease a pinned gpu copy, in key order; stops at the
        first that cannot get one. Called without the lock; `reserved` collects the slots
        reserved and not yet published, for the caller to free on error."""
        st = self.state
        chain: list[tuple[Entry, int | None]] = []       # (entry, host offset to copy or None)
        with st.lock:
            st.check_open()
            for k in host_lease.keys:
                e = st.index.get(ns_id + k)
                if e is None:
                    break
                if e.gpu is not None and e.moving is None:
                    chain.append((e, None))
                    continue
                dev = self.pick_device(device, ns_id)
                seg = self.pools.gpu_segment(dev, ns_id)
                try:
                    self.make_room(dev, aligned(e.size), seg)
                    off = self.alloc(dev, e.size, seg)
                except ResourceExhausted:
                    if chain:
                        break           # a shorter prefix is still a hit
                    raise
                reserved.append((e, dev, off))
                chain.append((e, off))
            st.enter_busy()
        try:
            # Host copies stay put (the host lease pins them); the slots are ours alone.
            jobs = [(e, dev, off) for e, dev, off in reserved]
            sums = self._copy_up(jobs)
        finally:
            st.leave_busy()
        by_entry = {id(e): (dev, off, s) for (e, dev, off), s in zip(jobs, sums, strict=True)}
        out: list[Entry] = []
        with st.lock:
            st.check_open()
            for e, _ in chain:
                job = by_entry.get(id(e))
                if job is None:                     # already on gpu when planned
                    if e.gpu is None or e.moving is not None:
                        break
                    e.gpu_pins += 1
                    out.append(e)
                    self.count(e.gpu_dev, "read_hits")
                    continue
                dev, off, s = job
                reserved.remove((e, dev, off))
                if not copy_verified(e, s):
                    st.gpu[dev].free(off)
                    st.counters["corrupt_blocks"] += 1
                    break                            # never served; the host copy stays
                if e.gpu is not None:               # another acquire promoted it meanwhile
                    st.gpu[dev].free(off)
                    st.counters["promotion_duplicates"] += 1
                    if e.moving is not None:
                        break
                else:
                    st.index.set_gpu(e, off, dev)
                    st.policy_of_device(dev).insert(e.gkey, e.parent_gkey, e.size)
                    self.count(dev, "promotions")
                    st.counters["bytes_host_to_gpu"] += e.size
                e.gpu_pins += 1
                out.append(e)
            for e, dev, off in list(reserved):       # past the cut: give the slots back
                st.gpu[dev].free(off)
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
            got = self._host_checked(items, self.state.gpu[dev].copy_from_host_checked)
            sums.update(zip(idx, got, strict=True))
        return [sums[i] for i in range(len(jobs))]

    # -- a promotion into host from a device --------------------------------------------------
    def fill_down(self, p: Promotion) -> None:
        """Promotion phase 2 for a gpu-only block an acquire wants in host: copy it down into
        the reserved host slot and verify it (no lock; the block is marked moving)."""
        e = p.entry
        (got,) = self.to_host_checked(self.state.gpu[e.gpu_dev], [(e.gpu, p.offset, e.size)])
        p.source = "gpu"
        p.nbytes = e.size
        if got != p.checksum:   # a gpu copy's checksum is always known: compared, never taken
            p.error = DataLoss("the gpu copy does not match the block's checksum")

    # -- copies between a device and host slots ----------------------------------------------
    # A tenant with a host_quota keeps its host copies in its own host segment, a mapping of
    # its own: a device copies to and from one host array per call, so a batch is split by it.

    def to_host_checked(self, t: Any, items: Sequence[Item]) -> list[int]:
        """Device -> host slot copies (offsets in the host tier's offset space) and the xxh3
        of each host destination."""
        return self._host_checked(items, t.copy_to_host_checked)

    def _host_parts(self, items: Sequence[Item]) -> list[tuple[np.ndarray, list[int],
                                                               list[Item]]]:
        """(host array, item indexes, items with offsets into that array) per host segment."""
        host = self.state.host
        if not isinstance(host, SegmentedHost):
            return [(host.array, list(range(len(items))), list(items))]
        parts: dict[int, tuple[np.ndarray, list[int], list[Item]]] = {}
        for i, (g, h, n) in enumerate(items):
            arr, base = host.array_at(h)
            part = parts.setdefault(base, (arr, [], []))
            part[1].append(i)
            part[2].append((g, h - base, n))
        return list(parts.values())

    def _host_checked(self, items: Sequence[Item], copy: Callable) -> list[int]:
        """Run a checked device copy per host segment; the checksums in `items` order."""
        sums = [0] * len(items)
        for arr, idx, local in self._host_parts(items):
            for i, s in zip(idx, copy(local, arr, DEVICE_WAIT_S), strict=True):
                sums[i] = s
        return sums

