"""The gpu tier's calls: Reserve, Commit and Acquire on device slots, and their leases.

Why a collaborator of its own: everything the gpu tier adds to the store's API lives here,
written against the device contract (tiers/base.py) only, so the CPU device runs every line of
it and the CUDA device runs the same lines; the copies between a device and host are
kvstore/moves/gpu_host.py's (docs/gpu.md, "The gpu tier in the store").

- Reserve(tier="gpu") hands out device slots under a write lease, making room first (gpu
  watermarks, per device); Commit hashes the slots (the checksum the block keeps on every
  tier) without the lock and publishes them as the blocks' gpu copies (dedup per tier).
- Acquire(tier="gpu") pins the prefix's gpu copies; for the rest it runs the host acquire
  (which promotes from SSD/remote, and copies gpu-only blocks to host), then promotes those
  host copies onto a device (gpu_host.promote) and lets the host lease go.
- Leases on gpu slots behave as on host: a write lease's slots are freed when it ends
  uncommitted, a read lease pins the gpu copy (`gpu_pins`), and a pinned copy is never a
  victim. A client that dies lets its leases expire.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvstore_client.common.errors import DataLoss, InvalidArgument, ResourceExhausted

from .host_reads import HostReads
from .host_writes import CommitResult
from .index import Entry
from .leases import Lease, LeaseTable, Slot
from .moves.gpu_host import DEVICE_WAIT_S, GpuHost
from .pools import TenantPools
from .state import StoreState, aligned


class GpuSlots:
    def __init__(self, state: StoreState, pools: TenantPools, gpu_host: GpuHost,
                 host_reads: HostReads, leases: LeaseTable, reap: Callable[[], None],
                 release: Callable[..., None]) -> None:
        """`reap`: ends expired leases (locked); `release(lease_id, missing_ok=True)`: lets a
        lease go (the host lease an acquire stages through)."""
        self.state = state
        self.pools = pools
        self.gpu_host = gpu_host
        self.host_reads = host_reads
        self.leases = leases
        self.reap = reap
        self.release = release

    # -- write path -----------------------------------------------------------------------------
    def reserve(self, ns_id: bytes, n: int, ttl_s: float | None, device: int | None = None,
                ahead: bool = False) -> Lease:
        st = self.state
        mover = self.gpu_host
        with st.lock:
            st.check_open()
            self.reap()
            size = st.namespace(ns_id).block_bytes
            dev = mover.pick_device(device, ns_id)
            t = st.gpu[dev]
            seg = self.pools.gpu_segment(dev, ns_id)
            cap = self.pools.gpu_room(dev, seg)[0]
            if n * aligned(size) > cap * st.config.gpu.high_watermark:
                raise ResourceExhausted(
                    f"{n} blocks of {size} bytes do not fit the gpu tier of device {dev} "
                    f"({cap} bytes{mover.whose(dev, seg)}); reserve in smaller batches")
            ttl = self.leases.ttl(ttl_s)
            mover.make_room(dev, n * aligned(size), seg)
            offsets: list[int] = []
            try:
                for _ in range(n):
                    offsets.append(mover.alloc(dev, size, seg))
            except BaseException:
                for off in offsets:
                    t.free(off)
                raise
            return self.leases.new("write", bytes(ns_id), "gpu",
                                   [Slot(o, size, dev) for o in offsets], ttl)

    def commit(self, lease_id: str, keys: list[bytes], parent: bytes | None,
               checksums: Sequence[int] | None, first_slot: int = 0,
               texts: list | None = None,
               check: Callable[[Lease], None] | None = None) -> CommitResult:
        """Commit for a gpu write lease: hash the slots without the lock, then publish.
        `texts`: the blocks' KV-event texts (kvstore/events/), kept as they are published;
        `check`: the store's checks of the lease, run in the first hold of the lock."""
        st = self.state
        with st.lock:
            st.check_open()
            lease = self.leases.get(lease_id)
            if check is not None:
                check(lease)
            if len(keys) > len(lease.slots):
                raise InvalidArgument(f"{len(keys)} keys for a lease of {len(lease.slots)} "
                                      "slots")
            slots = lease.slots[:len(keys)]
            st.enter_busy()                 # close() must not free the slabs under the hash
        try:
            # Hashing runs without the lock: the slots belong to this write lease alone, and a
            # lease that expires meanwhile fails the lookup below.
            hashed = self._slot_checksums(slots)
        finally:
            st.leave_busy()
        with st.lock:
            st.check_open()
            lease = self.leases.get(lease_id)
            for i, got in enumerate(hashed):
                if checksums and got != checksums[i]:
                    self.leases.pop(lease_id)
                    self.end_lease(lease)
                    st.counters["commit_checksum_mismatch"] += 1
                    raise DataLoss(f"block {i}'s bytes in the gpu slot do not match the checksum "
                                   "sent with Commit (torn or overlapping write); nothing from "
                                   "this lease was stored")
            self.leases.pop(lease_id)
            stored = dups = 0
            if texts:
                st.events.recorder.remember(lease.ns_id, keys, texts)
            for i, (k, slot) in enumerate(zip(keys, lease.slots, strict=False)):
                prev = parent if i == 0 else keys[i - 1]
                if self._publish(lease.ns_id, k, prev, slot, hashed[i]):
                    stored += 1
                    self.gpu_host.count(slot.device, "stored")
                    st.device_counters[slot.device]["bytes_in"] += slot.length
                else:
                    dups += 1
                    st.gpu[slot.device].free(slot.offset)
            for slot in lease.slots[len(keys):]:
                st.gpu[slot.device].free(slot.offset)
            st.counters["bytes_client_to_gpu"] += sum(s.length for s in slots[:stored])
            return CommitResult(stored, dups)

    def _slot_checksums(self, slots: Sequence[Slot]) -> list[int]:
        """xxh3 of gpu slots, batched per device (no lock needed: the slots are the caller's)."""
        out: dict[int, int] = {}
        by_dev: dict[int, list[int]] = {}
        for i, s in enumerate(slots):
            by_dev.setdefault(s.device, []).append(i)
        for dev, idx in by_dev.items():
            sums = self.state.gpu[dev].checksums(
                [(slots[i].offset, slots[i].length) for i in idx], DEVICE_WAIT_S)
            out.update(zip(idx, sums, strict=True))
        return [out[i] for i in range(len(slots))]

    def _publish(self, ns_id: bytes, key: bytes, parent: bytes | None, slot: Slot,
                 checksum: int) -> bool:
        """Make a filled gpu slot the block's gpu copy; False when it is a duplicate."""
        st = self.state
        g = ns_id + key
        e = st.index.get(g)
        if e is not None and e.gpu is not None:
            st.policy_of_device(e.gpu_dev).touch(g)
            st.counters["duplicate_blocks"] += 1
            return False
        if e is not None and e.host is not None and e.checksum and e.checksum != checksum:
            # Same key, other bytes than the host copy (engines differ in low bits): one block
            # never holds two versions; the host copy stays and is promoted on Acquire(gpu).
            st.counters["duplicate_blocks_differing"] += 1
            return False
        if e is None:
            e = Entry(ns_id, key, parent, slot.length, checksum)
            st.index.add(e)
        else:
            e.checksum = checksum       # no other raw copy: this one defines the bytes
            st.index.set_parent(e, parent)
        st.index.set_gpu(e, slot.offset, slot.device)
        st.policy_of_device(slot.device).insert(g, e.parent_gkey, slot.length)
        return True

    # -- leases ---------------------------------------------------------------------------------
    def end_lease(self, lease: Lease) -> None:
        st = self.state
        if lease.kind == "write":
            for s in lease.slots:
                st.gpu[s.device].free(s.offset)
            return
        for k in lease.keys:
            e = st.index.get(lease.ns_id + k)
            if e is not None and e.gpu_pins > 0:
                e.gpu_pins -= 1

    # -- read path ------------------------------------------------------------------------------
    def acquire(self, ns_id: bytes, keys: list[bytes], ttl: float,
                device: int | None = None) -> Lease:
        """Pin the longest cached prefix as gpu copies, promoting from host (and below)."""
        st = self.state
        pinned: list[Entry] = []
        host_lease: Lease | None = None
        reserved: list[tuple[Entry, int, int]] = []     # (entry, device, offset)
        try:
            with st.lock:
                st.check_open()
                self.reap()
                st.namespace(ns_id)
                touched: dict[int, list[bytes]] = {}
                for k in keys:
                    e = st.index.get(ns_id + k)
                    if e is None or e.gpu is None or e.moving is not None:
                        break
                    e.gpu_pins += 1
                    pinned.append(e)
                    touched.setdefault(e.gpu_dev, []).append(e.gkey)
                for dev, gkeys in touched.items():    # per device, in the prefix's order
                    st.policy_of_device(dev).touch_many(gkeys)
                    self.gpu_host.count(dev, "read_hits", len(gkeys))
            rest = keys[len(pinned):self._fit(ns_id, device, len(keys))]
            if rest:
                try:
                    host_lease = self.host_reads.acquire(ns_id, rest, ttl)
                except ResourceExhausted:
                    if not pinned:
                        raise
                    rest = []           # host cannot stage more: the gpu prefix is the hit
                if host_lease is not None:
                    pinned += self.gpu_host.promote(ns_id, host_lease, device, reserved)
            with st.lock:
                st.check_open()
                st.counters["acquired_blocks"] += len(pinned)
                lease = self.leases.new("read", bytes(ns_id), "gpu",
                                        [Slot(e.gpu, e.size, e.gpu_dev) for e in pinned], ttl,
                                        keys=[e.key for e in pinned],
                                        checksums=[e.checksum for e in pinned])
                pinned = []
                return lease
        finally:
            with st.lock:
                for e in pinned:
                    if e.gpu_pins > 0:
                        e.gpu_pins -= 1
                for _, dev, off in reserved:
                    st.gpu[dev].free(off)
            if host_lease is not None:
                self.release(host_lease.id, missing_ok=True)

    def _fit(self, ns_id: bytes, device: int | None, n: int) -> int:
        """How many blocks of this namespace one acquire may hold on a device (below its high
        watermark): a longer prefix could never be promoted whole, so it is cut up front."""
        st = self.state
        with st.lock:
            size = aligned(st.namespace(ns_id).block_bytes)
            dev = self.gpu_host.pick_device(device, ns_id)
            cap = self.pools.gpu_room(dev, self.pools.gpu_segment(dev, ns_id))[0]
            return min(n, max(1, int(cap * st.config.gpu.high_watermark) // size))

    # -- reporting ------------------------------------------------------------------------------
    def stats(self) -> tuple[dict, dict]:
        """(aggregate "gpu" tier figures, per-device figures) for Stats (locked)."""
        st = self.state
        per = {}
        for dev, t in st.gpu.items():
            per[str(dev)] = {"kind": t.kind, "capacity_bytes": t.capacity,
                             "used_bytes": t.used_bytes,
                             "blocks": len(st.policy_of_device(dev)),
                             **st.device_counters[dev]}
        agg = {"capacity_bytes": sum(t.capacity for t in st.gpu.values()),
               "used_bytes": sum(t.used_bytes for t in st.gpu.values()),
               "blocks": sum(len(st.policy_of_device(d)) for d in st.gpu),
               **st.tier_counters["gpu"]}
        return agg, per

    def info(self, own: list | None = None) -> list[dict]:
        """GPU pools for RegisterNamespace replies (empty without the gpu tier): the shared
        slabs, or a tenant's own (`own`: pools.gpu_segments_of(tenant))."""
        descs = ([d for _, _, d in own] if own
                 else [t.describe() for t in self.state.gpu.values()])
        return [{"device": d["device"], "ipc_handle": d["handle"], "size": d["size"],
                 "owner_pid": d["pid"], "uuid": d.get("uuid", ""), "name": d.get("name", ""),
                 "kind": d["kind"]}
                for d in descs]
