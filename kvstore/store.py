"""The store: namespaces, lookups, leases, and the write and read paths engines call.

How blocks move between tiers (eviction, demotion, promotion) lives in kvstore/movement.py, in
a TierMovement object the store owns (`self.movement`), not a base class.
Everything that changes the index happens under one lock, so the invariants the tests check
(no leased block evicted, byte accounting equal to the resident sizes plus reserved and
in-flight slots, no tier over its cap) hold between any two calls. The slow work that can run
without it does: commit hashes its slots outside the lock, acquire reads, decodes and verifies
promoted blocks outside it, into slots reserved beforehand, and host eviction encodes its
victims and writes them to SSD outside it, freeing their slots afterwards (the protocols are in
docs/internals.md, "Locking"). SSD eviction, flush, write-through and put's copy into the slab
still run under the lock.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import msgpack
import xxhash
from kvstore_client.common.errors import (
    DataLoss,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvstore_client.common.hashing import MAX_KEY_BYTES, MIN_KEY_BYTES
from kvstore_client.common.layout import NamespaceSpec, check_retention
from kvstore_client.common.pinning import pin_host

from tiers.host import HostTier
from tiers.ssd import DiskFull, SSDTier

from . import warm_image
from .checksums import xxh3_many
from .config import StoreConfig
from .device_movement import DeviceMovement
from .index import NS_ID_BYTES, BlockIndex, Entry
from .keychain import check_distinct
from .leases import Lease, LeaseTable, Slot
from .movement import REMOTE_CHUNK, Promotion, TierMovement, _aligned
from .nsinfo import NamespaceInfo
from .policies import EvictionPolicy, make_policy
from .pools import TenantPools
from .tenants import TENANT_KEY
from .verify import first_mismatch

log = logging.getLogger("kvstore.store")

MAX_KEYS_PER_CALL = 1 << 16
PROMOTION_WAIT_S = 60.0     # an acquire waits this long for another's promotion of its block
TIERS = ("gpu", "host", "ssd", "remote")
TUNE_SLICE = 256            # deferred policy-tuning accesses fed per hold of the store lock


@dataclass
class LookupResult:
    prefix_blocks: int
    per_tier: dict[str, int] = field(default_factory=dict)


@dataclass
class CommitResult:
    stored: int
    duplicates: int


def _parents_first(parents: dict[bytes, bytes | None]) -> list[bytes]:
    """The keys of `parents` (gkey -> parent gkey or None) ordered so every parent comes before
    its children, in linear time.

    Why: the index and the policies check for parent-link cycles whenever a block arrives that
    indexed children already wait for, walking its ancestors. Loaded in LMDB's key order (random
    with respect to the chains) nearly every block is such a one, which made rebuilding 100k
    blocks of long prompts take 23 s; in this order no block ever waits. A cycle (impossible in
    data the store wrote, which drops cycle-closing links) just ends the walk.
    """
    done: set[bytes] = set()
    out: list[bytes] = []
    for g in parents:
        if g in done:
            continue
        chain = []
        while g is not None and g not in done and g in parents:
            chain.append(g)
            done.add(g)
            g = parents[g]
        out.extend(reversed(chain))
    return out


class Store(DeviceMovement, TenantPools):
    def __init__(self, config: StoreConfig, background: bool = True) -> None:
        """Open every tier and rebuild the index from SSD.

        `background=False` leaves the background threads (slab prefault, SSD write buffers,
        demoter, lease reaper) to `start_background()`: the daemon starts them once it reports
        SERVING, so its start does not wait for threads to be scheduled on a busy machine.
        """
        self.config = config.check()
        self.daemon_id = secrets.token_hex(16)     # (uuid would import platform: start time)
        self._lock = threading.RLock()
        self._closed = False            # set when close() starts: no new call begins
        self._shut = False              # set when close() has released every resource
        # Calls that released the lock mid-way: acquire rounds with promotions in flight,
        # eviction batches being demoted, allocations waiting for those (off the lock).
        self._busy = 0
        self._idle = threading.Condition(self._lock)    # notified when one of those settles
        self.counters: Counter = Counter()
        self.tier_counters: dict[str, Counter] = {t: Counter() for t in TIERS}
        self.namespaces: dict[bytes, NamespaceInfo] = {}
        self.index = BlockIndex()
        data = Path(config.data_dir)
        data.mkdir(parents=True, exist_ok=True)
        shm_name = config.host.shm_name or "kvstore-" + blake3.blake3(
            str(data.resolve()).encode()).hexdigest()[:16]
        self._slab = self.host = HostTier(config.host.capacity, shm_name=shm_name,
                                          prefault=False)
        self._setup_pools()             # tenants with a host quota get their own segment
        lim = config.limits
        # Leases are counted per tenant; without tenants all are the implicit tenant's, and
        # finding the owner costs nothing.
        self.leases = LeaseTable(config.leases.default_ttl_s, config.leases.max_ttl_s,
                                 max_leases=lim.leases_per_tenant,
                                 max_slots=lim.lease_slots_per_tenant,
                                 owner_of=self.owner if self.tenants else None)
        # Page-locked so host<->GPU copies (ours and clients') run at PCIe speed; a no-op
        # without CUDA. It must be unregistered before the slab is unmapped (close order).
        self._host_pin = pin_host(self._slab.buffer)
        self.gpu = {}
        if config.gpu.enabled:      # (numpy and the CUDA bindings only where configured)
            from tiers.device_open import open_device_tiers
            self.gpu = open_device_tiers(config.gpu.capacity, config.gpu.devices,
                                         config.gpu.backend, log, slab_prefix=shm_name + "-")
        self._split_gpu(shm_name + "-")  # tenants with a gpu quota get their own slabs
        self.device_counters = {dev: Counter() for dev in self.gpu}
        self.ssd: SSDTier | None = None
        self.remote = None
        self.events = None              # KV events (kvstore/events/), where [events] is on
        self.movement = TierMovement(self)
        self.policies: dict[str, EvictionPolicy] = {
            # No capacity hint: blocks differ in size per namespace, so the policy learns its
            # capacity in blocks from peak residency.
            "host": make_policy(config.host.policy, None),
            **{f"gpu{dev}": make_policy(config.gpu.policy, None) for dev in self.gpu}}
        # The host policy's self-tuning runs off the Commit path (SegmentedPolicy.defer_tuning;
        # fed by the reaper thread, and by any eviction first).
        defer = getattr(self.policies["host"], "defer_tuning", None)
        if defer is not None:
            defer()
        try:
            if config.ssd.enabled:
                self.ssd = SSDTier(str(data / "ssd"), config.ssd.capacity, sync=config.ssd.sync,
                                   warm=False)
                self.policies["ssd"] = make_policy(config.ssd.policy, None, rows=self.index)
            if config.remote.enabled:
                from tiers.remote import RemoteTier  # redis only where configured
                self.remote = RemoteTier(config.remote)
            self._rebuild()
            if config.events.enabled:       # pyzmq only where configured
                from .events.service import Events
                self.events = Events(self, config.events, data)
                self.events.attach(self.index)
        except BaseException:
            self._close_device_side()
            self.host.close()
            if self.ssd is not None:
                self.ssd.close()
            raise
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        if background:
            self.start_background()

    def start_background(self) -> None:
        """Start the background work (see __init__); a second call does nothing."""
        with self._lock:
            if self._reaper is not None or self._closed:
                return
            self._slab.start_prefault()
            if self.ssd is not None:
                self.ssd.warm_up()
            self.movement.start_background()
            if self.events is not None:
                self.events.start()
            self._reaper = threading.Thread(target=self._reap_loop, name="kvstore-reaper",
                                            daemon=True)
            self._reaper.start()

    # ----------------------------------------------------------------- lifecycle

    def _rebuild(self) -> None:
        """Warm restart: namespaces and SSD residency come back from LMDB's meta records, or
        from the index image of the last clean stop when LMDB is exactly as it left it."""
        if self.ssd is None:
            return
        for ns_id, blob in self.ssd.namespaces().items():
            spec = NamespaceSpec.from_dict(json.loads(blob))
            self.namespaces[ns_id] = NamespaceInfo(ns_id, spec)
            self._index_namespace(ns_id)
        if self._load_image():
            return
        policy = self.policies["ssd"]
        state = self.ssd.get_state("policy.ssd")
        parents: dict[bytes, bytes | None] = {}
        fields: dict[bytes, tuple[int, int]] = {}
        unpack, known = msgpack.unpackb, self.namespaces
        for gkey, meta, _vsize in self.ssd.scan_meta():
            ns_id = gkey[:NS_ID_BYTES]
            if ns_id in known:
                m = unpack(meta)
                p = m.get("p")
                parents[gkey] = ns_id + p if p else None
                fields[gkey] = (m["s"], m.get("c", 0))
        items = [(g, parents[g], *fields[g]) for g in _parents_first(parents)]
        del parents, fields
        self.index.load_ssd(items)
        if state:
            try:
                policy.restore(state)
            except Exception as exc:  # an old or damaged snapshot only costs recency
                log.warning("ignoring the saved SSD eviction state: %s", exc)
        # Blocks the snapshot does not name (none saved, or written after it: a crash) join
        # as new; each must be in the policy or it could never be evicted.
        for gkey, pg, size, _ in items:
            if gkey not in policy:
                policy.insert(gkey, pg, size)
        if (compact := getattr(policy, "compact", None)) is not None:
            compact()
        if len(self.index):
            log.info("rebuilt the index: %d blocks in %d namespaces from SSD", len(self.index),
                     len(self.namespaces))

    def _load_image(self) -> bool:
        """Index and SSD policy from the image (kvstore/warm_image.py); False: scan instead."""
        idx = self.ssd.image_section(warm_image.INDEX)
        pol = self.ssd.image_section(warm_image.POLICY)
        if idx is None or pol is None:
            return False
        policy = self.policies["ssd"]
        try:
            warm_image.load_index(self.index, idx)
        except warm_image.ImageError as exc:
            log.warning("ignoring the SSD index image (scanning the index): %s", exc)
            return False
        try:
            warm_image.load_policy(policy, pol, self.index)
        except warm_image.ImageError as exc:
            log.warning("ignoring the SSD index image (scanning the index): %s", exc)
            warm_image.reset_index(self.index)
            return False
        for r in warm_image.missing_from_policy(self.index, policy):
            g = self.index.key_at(r)
            policy.insert(g, self.index.parent_key(r), self.index.read(g).size)
        if len(self.index):
            log.info("loaded the index image: %d blocks in %d namespaces", len(self.index),
                     len(self.namespaces))
        return True

    def _ssd_image(self) -> dict[str, bytes] | None:
        """The store's sections of the index image written at close (None: no image)."""
        try:
            return warm_image.dump(self.index, self.policies.get("ssd"),
                                   set(self.ssd.namespaces()))
        except Exception:  # noqa: BLE001 - without an image the next start scans
            log.exception("no index image: building it failed")
            return None

    def close(self, flush: bool = True, flush_budget_s: float | None = None,
              progress: Callable[[str], None] | None = None) -> None:
        """Refuse new calls, let promotions and demotions in flight settle (they use the slab
        and LMDB without the lock), then flush and release everything. A second caller waits
        for the first.

        `flush_budget_s` bounds the flush (a stop must not hang on a full host pool): blocks
        not written by then are dropped, which is safe because host-only blocks were never
        promised durable. `progress` gets a line about once a second while it flushes.
        """
        with self._lock:
            if self._closed:
                while not self._shut:
                    self._idle.wait()
                return
            self._closed = True
            self._stop.set()
            while self._busy:
                self._idle.wait()
            try:
                if flush and self.ssd is not None:
                    self._flush_locked(flush_budget_s, progress)
            except ResourceExhausted as exc:   # disk or a tenant's quota full: the host-only
                log.warning("not every host block was flushed at close: %s", exc)  # blocks go
            finally:
                try:
                    self._release_resources()
                finally:
                    self._shut = True
                    self._idle.notify_all()

    def _release_resources(self) -> None:
        if self.events is not None:     # before the SSD tier: it reads texts from LMDB
            try:
                self.events.close()
            except Exception:  # noqa: BLE001 - a stop must go on to release the tiers
                log.exception("closing the KV event streams failed")
        if self.ssd is not None:
            self.ssd.close(image=self._ssd_image())
        if self.remote is not None:
            self.remote.close()
        self.movement.close()
        self._close_device_side()
        self.host.close()

    def _close_device_side(self) -> None:
        for t in self.gpu.values():
            t.close()
        self._host_pin.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the store is shutting down")

    def _reap_loop(self) -> None:
        while not self._stop.wait(0.25):
            try:
                with self._lock:
                    if not self._closed:
                        self._reap_locked()
                self._tune_policy()
            except Exception:  # the reaper must outlive any single bad lease
                log.exception("lease reaper")

    def _tune_policy(self) -> None:
        """Feed the host policy's tuning what commits and loads deferred, a slice per lock hold
        so no call waits long behind it."""
        tune = getattr(self.policies["host"], "tune", None)
        if tune is None:
            return
        while not self._stop.is_set():
            with self._lock:
                if self._closed or not tune(TUNE_SLICE):
                    return

    def _reap_locked(self) -> None:
        for lease in self.leases.reap():
            self.counters["leases_expired"] += 1
            self._end_lease(lease)

    # ----------------------------------------------------------------- validation

    def _ns(self, ns_id: bytes) -> NamespaceInfo:
        if not isinstance(ns_id, (bytes, bytearray)) or len(ns_id) != NS_ID_BYTES:
            raise InvalidArgument(f"namespace_id must be {NS_ID_BYTES} bytes as returned by "
                                  "RegisterNamespace")
        info = self.namespaces.get(bytes(ns_id))
        if info is None:
            raise NotFound(f"unknown namespace {bytes(ns_id).hex()}; register it first")
        return info

    @staticmethod
    def _keys(keys: Sequence[bytes], allow_empty: bool = False, chain: bool = False
              ) -> list[bytes]:
        """Checked keys; `chain`: a prefix chain (or Locate's set), which names each block
        once (kvstore/keychain.py)."""
        if not allow_empty and len(keys) == 0:
            raise InvalidArgument("no keys given")
        if len(keys) > MAX_KEYS_PER_CALL:
            raise InvalidArgument(f"{len(keys)} keys in one call; the limit is "
                                  f"{MAX_KEYS_PER_CALL}")
        if not keys:
            return []
        lens = list(map(len, keys)) if set(map(type, keys)) == {bytes} else None
        if lens and MIN_KEY_BYTES <= min(lens) and max(lens) <= MAX_KEY_BYTES:
            if chain:
                check_distinct(keys)
            return list(keys)               # the common case, checked at C speed
        out = []
        for i, k in enumerate(keys):
            ok = isinstance(k, (bytes, bytearray))
            if not ok or not MIN_KEY_BYTES <= len(k) <= MAX_KEY_BYTES:
                n = len(k) if ok else type(k).__name__
                raise InvalidArgument(f"key {i} is {n} bytes; block keys are "
                                      f"{MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes")
            out.append(bytes(k))
        if chain:
            check_distinct(out)
        return out

    @staticmethod
    def _parent(parent: bytes | None) -> bytes | None:
        if not parent:
            return None
        if not MIN_KEY_BYTES <= len(parent) <= MAX_KEY_BYTES:
            raise InvalidArgument(f"parent key is {len(parent)} bytes; block keys are "
                                  f"{MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes")
        return bytes(parent)

    def _tier(self, tier: str) -> str:
        tier = tier or "host"
        if tier == "host":
            return tier
        if tier == "gpu":
            if self.gpu:
                return tier
            raise Unavailable("the gpu tier is not enabled on this daemon")
        raise InvalidArgument(f"tier {tier!r} cannot hold leased slots; use 'host' or 'gpu'")

    def _admit_lease(self, ns_id: bytes, tier: str, slots: int) -> None:
        """Before a client's lease is made: its namespace's slots lie in a pool its owner maps
        (kvstore/pools.py) and its tenant is under its lease caps (kvstore/leases.py).

        Reads only (a namespace's owner, the tenant's lease counts), so without the lock: the
        caps are soft by what calls running at once hold, and an unknown namespace is left to
        the call to answer NOT_FOUND."""
        if self.tenants:
            self.check_lease_pool(ns_id, tier)
        self.leases.admit(ns_id, slots)

    # ----------------------------------------------------------------- namespaces

    def register_namespace(self, spec: NamespaceSpec) -> NamespaceInfo:
        if not isinstance(spec, NamespaceSpec):
            raise InvalidArgument("register_namespace takes a NamespaceSpec")
        if _aligned(spec.layout.block_bytes) > self.host.capacity:
            raise InvalidArgument(
                f"one block of this layout is {spec.layout.block_bytes} bytes, larger than the "
                f"host tier ({self.host.capacity} bytes)")
        ns_id = spec.digest
        with self._lock:
            self._check_open()
            info = self.namespaces.get(ns_id)
            if info is not None:
                return info
            blob = self._admit_namespace(spec)
            info = NamespaceInfo(ns_id, spec)
            self.namespaces[ns_id] = info
            self._index_namespace(ns_id)
            if self.ssd is None:
                return info
            self._busy += 1             # close() waits for the write below
        # The LMDB write (milliseconds) runs without the store lock: a tenant registering
        # namespaces must not stall every other tenant's calls behind it.
        try:
            self.ssd.put_namespace(ns_id, blob)
        except DiskFull as exc:         # host still serves it; a restart forgets it
            with self._lock:
                self.counters["ssd_disk_full_errors"] += 1
            log.warning("namespace %s not persisted: %s", ns_id.hex(), exc)
        finally:
            with self._lock:
                self._busy -= 1
                self._idle.notify_all()
        return info

    def _admit_namespace(self, spec: NamespaceSpec) -> bytes:
        """The spec as persisted, once it is known to fit its tenant's caps (locked).

        Why caps: a namespace is kept in memory and in LMDB for good, and a spec's free-form
        fields (extra, model, revision) could make one cost hundreds of KiB; a tenant could
        otherwise register them without end (docs/security.md, "The store's own checks")."""
        lim = self.config.limits
        blob = json.dumps(spec.to_dict()).encode()
        if len(blob) > lim.namespace_spec_bytes:
            raise InvalidArgument(
                f"the namespace spec is {len(blob)} bytes as stored, above the daemon's limit "
                f"of {lim.namespace_spec_bytes} (limits.namespace_spec_bytes); shorten "
                "spec.extra, model or revision")
        owner = spec.extra.get(TENANT_KEY)
        cap = lim.namespaces_per_tenant
        if cap and self.namespace_count(owner) >= cap:
            who = f"tenant {owner} has" if owner else "this daemon's clients have"
            raise ResourceExhausted(
                f"{who} registered {self.namespace_count(owner)} namespaces, the limit "
                f"(limits.namespaces_per_tenant = {cap}); namespaces already registered "
                "still work")
        return blob

    def wants_token_ids(self, ns_id: bytes) -> bool:
        """Whether a stream publishes this namespace's blocks, so Commit should carry their
        token ids (RegisterNamespace tells the client)."""
        if self.events is None:
            return False
        with self._lock:
            return self.events.wants_tokens(ns_id)

    def namespace(self, ns_id: bytes) -> NamespaceInfo:
        with self._lock:
            return self._ns(ns_id)

    # ----------------------------------------------------------------- lookup

    def lookup(self, ns_id: bytes, keys: Sequence[bytes]) -> LookupResult:
        keys = self._keys(keys, allow_empty=True, chain=True)
        with self._lock:
            self._check_open()
            self._ns(ns_id)
            # Hot path (one call per engine request): plain locals, no per-key tuples.
            n = h = d = r = gg = 0
            run_h = run_d = run_r = run_g = True
            # read-only views, no Entry made for a packed block; stops at the first unindexed
            for e in self.index.peek_run(ns_id, keys):
                on_h, on_d, on_r, on_g = e.host is not None, e.ssd, e.remote, e.gpu is not None
                if not (on_h or on_d or on_r or on_g):
                    break
                n += 1
                if run_g:
                    gg, run_g = (gg + 1, True) if on_g else (gg, False)
                if run_h:
                    h, run_h = (h + 1, True) if on_h else (h, False)
                if run_d:
                    d, run_d = (d + 1, True) if on_d else (d, False)
                if run_r:
                    r, run_r = (r + 1, True) if on_r else (r, False)
            per = {"host": h}
            if self.gpu:
                per["gpu"] = gg
            if self.ssd is not None:
                per["ssd"] = d
            if self.remote is not None:
                per["remote"] = r
            self.counters["lookups"] += 1
            self.counters["lookup_blocks"] += len(keys)
            self.counters["lookup_hit_blocks"] += n
            for t, c in per.items():
                self.tier_counters[t]["hits"] += c
                self.tier_counters[t]["misses"] += len(keys) - c
            for k in keys[n:n + 1]:
                for p in self.policies.values():
                    rec = getattr(p, "record_miss", None)
                    if rec is not None:
                        rec(ns_id + k)
        if self.remote is not None and n < len(keys):
            extra = self._remote_extend(ns_id, keys, n)
            if run_r:
                per["remote"] += extra
            n += extra
        return LookupResult(n, per)

    def where(self, ns_id: bytes, keys: Sequence[bytes]) -> list[str | None]:
        """The fastest tier holding each key, or None; every key on its own, not a prefix.

        For engines that look blocks up one by one (vLLM's tiered offloading). Keys no local
        tier holds are asked of the remote tier in one round trip.
        """
        keys = self._keys(keys, allow_empty=True, chain=True)
        out: list[str | None] = []
        with self._lock:
            self._check_open()
            info = self._ns(ns_id)
            get = self.index.get
            for k in keys:
                e = get(ns_id + k)
                # host before gpu: Locate's readers load from host, and a gpu-only block is
                # one a prefetch copies down (kvstore/device_movement.py)
                out.append(None if e is None else "host" if e.host is not None
                           else "gpu" if e.gpu is not None
                           else "ssd" if e.ssd else "remote" if e.remote else None)
            self.counters["locate_blocks"] += len(keys)
        missing = [i for i, t in enumerate(out) if t is None]
        if self.remote is not None and missing:
            found = self.remote.exists_many([ns_id + keys[i] for i in missing])
            with self._lock:
                for i, hit in zip(missing, found, strict=True):
                    if not hit:
                        continue
                    e = self.index.get(ns_id + keys[i])
                    if e is None:
                        e = Entry(ns_id, keys[i], None, info.block_bytes, 0)
                        self.index.add(e)
                    self.index.set_remote(e)
                    out[i] = "remote"
        return out

    def _remote_extend(self, ns_id: bytes, keys: list[bytes], start: int) -> int:
        """How many blocks after `start` the remote tier holds (one batched round trip)."""
        found = self.remote.exists_many([ns_id + k for k in keys[start:]])
        n = 0
        for hit in found:
            if not hit:
                break
            n += 1
        if n:
            with self._lock:
                info = self.namespaces.get(ns_id)
                if info is None:
                    return 0
                for i in range(start, start + n):
                    g = ns_id + keys[i]
                    e = self.index.get(g)
                    if e is None:
                        parent = keys[i - 1] if i > 0 else None
                        e = Entry(ns_id, keys[i], parent, info.block_bytes, 0)
                        self.index.add(e)
                    self.index.set_remote(e)
        return n

    # ----------------------------------------------------------------- write path

    def reserve(self, ns_id: bytes, n: int, tier: str = "host",
                ttl_s: float | None = None, device: int | None = None,
                ahead: bool = False) -> Lease:
        """A write lease over n slots. `ahead` (a Commit reserving for the client's next
        store): only from free room, never evicting, since that store may not come."""
        tier = self._tier(tier)
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise InvalidArgument(f"count must be a positive integer, got {n!r}")
        if n > MAX_KEYS_PER_CALL:
            raise InvalidArgument(f"count {n} is above the per-call limit {MAX_KEYS_PER_CALL}")
        self._admit_lease(ns_id, tier, n)
        if tier == "gpu":
            return self._gpu_reserve(ns_id, n, ttl_s, device)
        with self._lock:
            self._check_open()
            self._reap_locked()
            info = self._ns(ns_id)
            size = info.block_bytes
            if n * _aligned(size) > self.host.capacity * self.config.host.high_watermark:
                raise ResourceExhausted(
                    f"{n} blocks of {size} bytes do not fit the host tier "
                    f"({self.host.capacity} bytes); reserve in smaller batches")
            ttl = self.leases.ttl(ttl_s)
            if ahead and not self.movement.has_room(n * _aligned(size), ns_id):
                raise ResourceExhausted(f"no free room for {n} slots ahead")
            t0 = time.perf_counter()
            waits = self.movement.must_evict_inline(n * _aligned(size))
            self.movement._host_room(n * _aligned(size), ns_id)
            offsets: list[int] = []
            try:
                for _ in range(n):
                    offsets.append(self.movement._alloc_host(size, ns_id))
            except ResourceExhausted:
                for off in offsets:
                    self.host.free(off)
                raise
            if waits:                        # made room inline: this Reserve waited for it
                self.counters["reserve_waits"] += 1
                self.counters["reserve_wait_seconds"] += time.perf_counter() - t0
            return self.leases.new("write", bytes(ns_id), tier,
                                   [Slot(o, size) for o in offsets], ttl)

    def commit(self, lease_id: str, keys: Sequence[bytes], parent: bytes | None = None,
               checksums: Sequence[int] | None = None, first_slot: int = 0,
               token_ids: bytes | Sequence[int] | None = None) -> CommitResult:
        """Publish keys[i] from slot first_slot + i of a write lease; free its other slots.

        A checksum of 0 is refused: every host or gpu copy's checksum is checked on every read
        as it is, so a client may not mark a block "unknown"; without checksums the daemon
        hashes every block itself. `token_ids` (block_tokens per key: little-endian uint32
        bytes as Commit carries them, or a sequence of ints) name the blocks' tokens for KV
        events; kept only where a stream publishes the namespace (kvstore/events/)."""
        keys = self._keys(keys, allow_empty=True, chain=True)
        parent = self._parent(parent)
        if checksums and 0 in checksums:
            i = list(checksums).index(0)
            raise InvalidArgument(f"checksums[{i}] is 0; send each block's xxh3-64, or no "
                                  "checksums at all (the daemon then hashes every block)")
        if token_ids is not None and not isinstance(token_ids, bytes):
            from .events.texts import tokens_u32  # in-process callers may pass a sequence
            try:
                token_ids = tokens_u32(token_ids)
            except ValueError as e:
                raise InvalidArgument(str(e)) from None
        with self._lock:
            self._check_open()
            lease = self.leases.get(lease_id)
            if lease.kind != "write":
                raise InvalidArgument(f"lease {lease_id} is a read lease; commit takes the lease "
                                      "Reserve returned")
            if first_slot and lease.tier == "gpu":
                raise InvalidArgument("first_slot is for host leases; commit a gpu lease from "
                                      "its first slot")
            if first_slot + len(keys) > len(lease.slots):
                raise InvalidArgument(f"{len(keys)} keys from slot {first_slot} for a lease of "
                                      f"{len(lease.slots)} slots")
            if checksums and len(checksums) != len(keys):
                raise InvalidArgument(f"{len(checksums)} checksums for {len(keys)} keys")
            if token_ids and len(token_ids) != 4 * len(keys) * (
                    bt := self._ns(lease.ns_id).spec.layout.block_tokens):
                got = (f"{len(token_ids) // 4} token ids" if len(token_ids) % 4 == 0 else
                       f"{len(token_ids)} bytes of token ids (4 a token)")
                raise InvalidArgument(f"{got} for {len(keys)} keys; send {bt} per key (the "
                                      "namespace's block_tokens, little-endian uint32) or none")
            used = lease.slots[first_slot:first_slot + len(keys)]
            views = ([] if lease.tier == "gpu" else
                     [self.host.view(s.offset, s.length) for s in used])
        texts = (self.events.texts(lease.ns_id, keys, parent, token_ids,
                                   self.namespaces[lease.ns_id].spec.layout.block_tokens)
                 if token_ids and self.events is not None else None)
        if lease.tier == "gpu":
            return self._gpu_commit(lease_id, keys, parent, checksums, texts)
        # Hashing (the slow part) runs outside the lock, so one client's commit does not stall
        # every other call: the slots belong to this write lease alone, and a lease that
        # expires meanwhile fails the pop below.
        checked = self._commit_sample(views, checksums)
        hashed = xxh3_many([views[i] for i in checked])
        with self._lock:
            self._check_open()
            lease = self.leases.get(lease_id)
            for i, got in zip(checked, hashed, strict=True):
                if checksums and got != checksums[i]:
                    self.leases.pop(lease_id)
                    self._end_lease(lease)
                    self.counters["commit_checksum_mismatch"] += 1
                    raise DataLoss(f"block {i}'s bytes in the slot do not match the checksum "
                                   "sent with Commit (torn or overlapping write, or a client "
                                   "writing into a stale mapping of the pool); nothing from "
                                   "this lease was stored")
            sums = [int(c) for c in checksums] if checksums else hashed
            self.leases.pop(lease_id)
            stored = dups = 0
            published: list[Entry] = []
            batch: list[tuple[bytes, bytes | None, int]] = []    # host policy inserts, in order
            if texts:
                self.events.recorder.remember(lease.ns_id, keys, texts)
            for i, (k, slot) in enumerate(zip(keys, used, strict=True)):
                prev = parent if i == 0 else keys[i - 1]
                placed, e = self._publish(lease.ns_id, k, prev, slot.offset, slot.length, sums[i],
                                          batch)
                if placed:
                    stored += 1
                    published.append(e)
                else:
                    dups += 1
                    self.host.free(slot.offset)
            self.policies["host"].insert_many(batch)
            for slot in lease.slots[:first_slot] + lease.slots[first_slot + len(keys):]:
                self.host.free(slot.offset)
            self.counters["bytes_client_to_host"] += stored * (lease.slots[0].length
                                                               if lease.slots else 0)
            self._note_put(lease.ns_id, keys)
            self._write_through(published)
            return CommitResult(stored, dups)

    def _commit_sample(self, views: Sequence[Any], checksums: Sequence[int] | None) -> list[int]:
        """Which committed slots Commit hashes itself.

        Every block's checksum is checked again before its bytes leave the pool (verify_reads:
        Get, demotion, write-through; clients verify their own loads), so hashing all of them
        here too would be a third pass over the bytes on the engine's store path. One block per
        commit, chosen at random, still tells a client at once that it wrote into a mapping
        the daemon no longer uses (every block differs then). Without checksums from the
        client, or with verify_reads off, the daemon's own hash is the only one: all of them.
        """
        n = len(views)
        host = self.config.host
        if not checksums or not host.verify_reads or host.commit_check == "all" or n <= 1:
            return list(range(n))
        return [random.randrange(n)]

    def _publish(self, ns_id: bytes, key: bytes, parent: bytes | None, offset: int, size: int,
                 checksum: int, batch: list | None = None) -> tuple[bool, Entry]:
        """Make a filled slot the host copy of `key`; False when host already has one (dedup).
        With `batch`, the host policy's insert is appended there for one insert_many call
        (the policy's per-call cost is then paid once per commit); the caller makes it."""
        g = ns_id + key
        e = self.index.get(g)
        policy = self.policies["host"]
        if e is not None and e.host is not None:
            if batch:                        # keep the policy's order of accesses
                policy.insert_many(batch)
                batch.clear()
            policy.touch(g)
            self.counters["duplicate_blocks"] += 1
            return False, e
        if e is None:
            e = Entry(ns_id, key, parent, size, checksum)
            self.index.add(e)
        else:
            if not e.checksum:
                e.checksum = checksum
            self.index.set_parent(e, parent)
        self.index.set_host(e, offset)
        if batch is None:
            policy.insert(g, e.parent_gkey, size)
        else:
            batch.append((g, e.parent_gkey, size))
        self.tier_counters["host"]["stored"] += 1
        return True, e

    def _note_put(self, ns_id: bytes, keys: list[bytes]) -> None:
        """Tell the host policy which keys one write carried (it learns whether a write's last
        block, usually a prompt's partial tail, is worth keeping)."""
        hook = getattr(self.policies["host"], "note_put", None)
        if hook is not None and keys:
            hook([ns_id + k for k in keys])

    def _write_through(self, entries: list[Entry]) -> None:
        if not entries:
            return
        if self.ssd is not None and self.config.ssd.write_through:
            self.movement._demote_from_host(entries)
        if self.remote is not None and self.config.remote.write_through:
            # from_host=False: each block's source is its host copy if it still has one, else
            # its SSD copy (put's room-making may have evicted an entry it published earlier).
            self.movement._demote_to_remote([e for e in entries if not e.remote and e.resident],
                                   from_host=False)

    def put(self, ns_id: bytes, keys: Sequence[bytes], blocks: Sequence,
            parent: bytes | None = None) -> CommitResult:
        """Bytes path: store blocks sent over the network (dedup before copying)."""
        keys = self._keys(keys, chain=True)
        parent = self._parent(parent)
        if len(blocks) != len(keys):
            raise InvalidArgument(f"{len(blocks)} blocks for {len(keys)} keys")
        with self._lock:
            self._check_open()
            info = self._ns(ns_id)
            size = info.block_bytes
            for i, b in enumerate(blocks):
                if len(b) != size:
                    raise InvalidArgument(f"block {i} is {len(b)} bytes; this namespace's blocks "
                                          f"are {size} bytes")
            stored = dups = 0
            published = []
            for i, (k, b) in enumerate(zip(keys, blocks, strict=True)):
                e = self.index.get(ns_id + k)
                if e is not None and e.host is not None:
                    self.policies["host"].touch(e.gkey)
                    self.counters["duplicate_blocks"] += 1
                    dups += 1
                    continue
                # Making room may release the lock while victims are demoted (another call may
                # store this key meanwhile: _publish then dedups and the slot goes back).
                self.movement._host_room(_aligned(size), ns_id)
                off = self.movement._alloc_host(size, ns_id)
                src = memoryview(b).cast("B")
                self.host.view(off, size)[:] = src
                prev = parent if i == 0 else keys[i - 1]
                # The checksum is of the bytes sent, not of the slot: a client mapping the
                # pool could change the slot in between, and its hash would then vouch for it.
                placed, e = self._publish(bytes(ns_id), k, prev, off, size,
                                          xxhash.xxh3_64_intdigest(src))
                if not placed:
                    self.host.free(off)
                    dups += 1
                    continue
                published.append(e)
                stored += 1
            self.counters["bytes_client_to_host"] += stored * size
            self._note_put(bytes(ns_id), keys)
            self._write_through(published)
            return CommitResult(stored, dups)

    # ----------------------------------------------------------------- read path

    def acquire(self, ns_id: bytes, keys: Sequence[bytes], tier: str = "host",
                ttl_s: float | None = None, device: int | None = None,
                for_client: bool = True) -> Lease:
        """Pin the longest cached prefix in host memory, promoting from lower tiers.

        Blocks to promote get their host slots first, then are read and decoded in parallel
        without the store lock (zstd and torch release the GIL), then installed in order; the
        prefix ends at the first block that is missing or fails to decode.
        `for_client=False`: a lease the daemon holds itself while it copies (Get, prefetch),
        allowed in any pool (kvstore/pools.py, check_lease_pool).
        """
        tier = self._tier(tier)
        keys = self._keys(keys, chain=True)
        ttl = self.leases.ttl(ttl_s)
        if for_client:
            self._admit_lease(ns_id, tier, len(keys))
        else:
            self.leases.admit(ns_id, len(keys))
        if tier == "gpu":
            return self._gpu_acquire(ns_id, keys, ttl, device)
        want = self.movement._remote_wanted(ns_id, keys)
        if len(want) > REMOTE_CHUNK:
            return self._acquire_pipelined(ns_id, keys, tier, ttl, want)
        return self._acquire_from(ns_id, keys, tier, ttl, self.movement._fetch_remote(want))

    def _acquire_pipelined(self, ns_id: bytes, keys: list[bytes], tier: str, ttl: float,
                           want: list[bytes]) -> Lease:
        """Acquire in key ranges of REMOTE_CHUNK remote blocks, fetching range i+1 from Redis
        while range i is decoded; the ranges' leases are merged into one."""
        chunks = [want[i:i + REMOTE_CHUNK] for i in range(0, len(want), REMOTE_CHUNK)]
        where = {ns_id + k: i for i, k in enumerate(keys)}      # (the keys are distinct)
        ends = [where[c[0]] for c in chunks[1:]] + [len(keys)]
        wait_s = 5 + 4 * self.config.remote.deadline_ms / 1000
        parts: list[Lease] = []
        start = 0
        pending = self.movement._fetcher().submit(self.movement._fetch_remote, chunks[0])
        try:
            for j, end in enumerate(ends):
                values = pending.result(timeout=wait_s)
                if j + 1 < len(chunks):
                    pending = self.movement._fetcher().submit(self.movement._fetch_remote,
                                                              chunks[j + 1])
                part = self._acquire_from(ns_id, keys[start:end], tier, ttl, values)
                parts.append(part)
                if len(part.keys) < end - start:
                    break                   # the prefix ends inside this range
                start = end
            with self._lock:
                for part in parts:
                    self.leases.pop(part.id)
                return self.leases.new("read", bytes(ns_id), tier,
                                       [s for p in parts for s in p.slots], ttl,
                                       keys=[k for p in parts for k in p.keys],
                                       checksums=[c for p in parts for c in p.checksums])
        except BaseException:
            for part in parts:
                self.release(part.id, missing_ok=True)
            raise

    def _acquire_from(self, ns_id: bytes, keys: list[bytes], tier: str, ttl: float,
                      remote_values: dict) -> Lease:
        """Pin the longest prefix in rounds, then lease it.

        A round stops early at a block another acquire is promoting; this one then waits for that
        promotion to settle (holding no reservation, so two acquires never wait on each other)
        and goes on from that block, most likely a host hit by then.
        """
        pinned: list[Entry] = []
        try:
            while True:
                try:
                    got, wait = self._acquire_round(ns_id, keys[len(pinned):], remote_values)
                except ResourceExhausted:
                    if not pinned:
                        raise
                    self.counters["acquire_cut_host_full"] += 1     # as in _plan_round
                    break
                pinned += got
                if wait is None or not wait.wait(PROMOTION_WAIT_S):
                    break
            with self._lock:
                self._check_open()
                # one batch call per policy (the two policies are independent)
                self.policies["host"].touch_many([e.gkey for e in pinned])
                if any(e.ssd for e in pinned):
                    self.policies["ssd"].touch_many([e.gkey for e in pinned if e.ssd])
                self.counters["acquired_blocks"] += len(pinned)
                return self.leases.new("read", bytes(ns_id), tier,
                                       [Slot(e.host, e.size) for e in pinned], ttl,
                                       keys=[e.key for e in pinned],
                                       checksums=[e.checksum for e in pinned])
        except BaseException:
            with self._lock:
                self._unpin(pinned)
            raise

    def _acquire_round(self, ns_id: bytes, keys: list[bytes], remote_values: dict
                       ) -> tuple[list[Entry], threading.Event | None]:
        """Pin the longest prefix of `keys` that host holds or this round can promote.

        The locking protocol (docs/internals.md): under the lock, pin host hits and reserve a
        slot for each block to promote, marking it in flight; without the lock, read, decode and
        verify into those slots; under the lock again, publish them or give them back. Returns
        the pinned entries in key order and, when the prefix stopped at a block another acquire
        is promoting, the event that promotion sets when it settles.
        """
        flight = threading.Event()
        with self._lock:
            self._check_open()
            self._reap_locked()
            info = self._ns(ns_id)
            chain, wait = self._plan_round(ns_id, keys, remote_values, flight)
            jobs = [p for p in chain if isinstance(p, Promotion)]
            if not jobs:
                return chain, wait
            self._busy += 1                  # close() waits for this round to settle
        try:
            self.movement._fill(info, jobs)
        except BaseException:
            with self._lock:
                for p in jobs:
                    self.movement._abandon(p)
                self._unpin([x for x in chain if isinstance(x, Entry)])
                self._round_done(flight)
            raise
        with self._lock:
            pinned: list[Entry] = []
            cut = False
            for x in chain:
                # Every promotion settles, even past the cut: a good copy is worth keeping.
                ok = self.movement._settle(x) if isinstance(x, Promotion) else True
                e = x.entry if isinstance(x, Promotion) else x
                cut = cut or not ok
                if cut:
                    if isinstance(x, Entry):
                        e.pins -= 1          # a host hit past the end of the prefix
                    continue
                if isinstance(x, Promotion):
                    e.pins += 1
                pinned.append(e)
            self._round_done(flight)
            return pinned, None if cut else wait

    def _plan_round(self, ns_id: bytes, keys: list[bytes], remote_values: dict,
                    flight: threading.Event) -> tuple[list, threading.Event | None]:
        """Phase 1 of a round (locked): host hits pinned, promotions reserved, in key order."""
        chain: list[Entry | Promotion] = []
        try:
            for k in keys:
                e = self.index.get(ns_id + k)
                if e is None:
                    break
                if e.host is not None:
                    e.pins += 1              # pinned now: later room-making can't evict it
                    chain.append(e)
                    self.tier_counters["host"]["read_hits"] += 1
                    continue
                if e.moving is not None:
                    return chain, e.moving   # another acquire is promoting it
                try:
                    p = self.movement._reserve_promotion(e, remote_values, flight)
                except ResourceExhausted:
                    if not chain:
                        raise
                    # Host cannot make room beside what this acquire already pins (a prefix
                    # longer than the pool): the blocks that fit are the answer, not an error.
                    self.counters["acquire_cut_host_full"] += 1
                    break
                if p is None:
                    break
                chain.append(p)
        except BaseException:
            for x in chain:
                if isinstance(x, Promotion):
                    self.movement._abandon(x)
            self._unpin([x for x in chain if isinstance(x, Entry)])
            flight.set()
            raise
        return chain, None

    def _unpin(self, entries: list[Entry]) -> None:
        for e in entries:
            if e.pins > 0:
                e.pins -= 1

    def _round_done(self, flight: threading.Event) -> None:
        """A round's promotions have settled or been undone: wake its waiters and close()."""
        flight.set()
        self._busy -= 1
        self._idle.notify_all()

    def with_prefix(self, ns_id: bytes, keys: Sequence[bytes], fn, copies=None):
        """Call fn([(key, view), ...]) on the pinned host copies of the longest cached prefix.

        The views are valid only inside fn (the read lease is released after it), which lets a
        caller copy the bytes exactly once, straight into whatever it sends.
        `copies(result)` names the copies fn made, block by block; they are checked against the
        committed checksums (kvstore/verify.py) and a block that fails is counted, dropped and
        ends the prefix: fn is called again on the blocks before it.
        """
        lease = self.acquire(ns_id, keys, ttl_s=self.config.leases.default_ttl_s,
                             for_client=False)
        bad: list[bytes] = []
        try:
            views = [(k, memoryview(self.host.view(s.offset, s.length)))
                     for k, s in zip(lease.keys, lease.slots, strict=True)]
            while True:
                out = fn(views)
                if not self.config.host.verify_reads or copies is None:
                    break
                n = first_mismatch(copies(out), lease.checksums[:len(views)])
                if n == len(views):
                    break
                bad.append(ns_id + views[n][0])
                views = views[:n]
            self.counters["bytes_host_to_client"] += sum(v.nbytes for _, v in views)
            return out
        finally:
            self.release(lease.id, missing_ok=True)
            if bad:
                with self._lock:
                    for g in bad:
                        self.movement._corrupt_host_copy(g, "Get")

    def read_prefix(self, ns_id: bytes, keys: Sequence[bytes], fn):
        """fn(views, checksums) over the longest cached prefix, under a read lease: with_prefix
        without the check, for a caller that checks its own copies (Get, kvstore/getcopy.py)
        and reports a failure with corrupt_host_copy."""
        lease = self.acquire(ns_id, keys, ttl_s=self.config.leases.default_ttl_s,
                             for_client=False)
        try:
            views = [(k, self.host.view(s.offset, s.length))
                     for k, s in zip(lease.keys, lease.slots, strict=True)]
            self.counters["bytes_host_to_client"] += sum(s.length for s in lease.slots)
            return fn(views, lease.checksums)
        finally:
            self.release(lease.id, missing_ok=True)

    def corrupt_host_copy(self, ns_id: bytes, key: bytes, path: str) -> None:
        """Count and drop a host copy a reader found not to match its commit checksum."""
        with self._lock:
            if path == "Get":
                self.counters["get_checksum_mismatch"] += 1    # a Get stream was cut there
            self.movement._corrupt_host_copy(ns_id + key, path)

    def get(self, ns_id: bytes, keys: Sequence[bytes]) -> list[tuple[bytes, bytes]]:
        """Bytes path: copies of the longest cached prefix."""
        return self.with_prefix(ns_id, keys, lambda views: [(k, bytes(v)) for k, v in views],
                                copies=lambda out: [b for _, b in out])

    def release(self, lease_id: str, missing_ok: bool = False) -> None:
        with self._lock:
            try:
                lease = self.leases.pop(lease_id)
            except NotFound:
                if missing_ok:
                    return
                raise
            self._end_lease(lease)

    def renew(self, lease_id: str, ttl_s: float | None = None) -> float:
        with self._lock:
            self._check_open()
            return self.leases.renew(lease_id, ttl_s)

    def _end_lease(self, lease: Lease) -> None:
        if lease.tier == "gpu":
            self._gpu_end_lease(lease)
            return
        if lease.kind == "write":
            for s in lease.slots:
                self.host.free(s.offset)
            return
        for k in lease.keys:
            e = self.index.get(lease.ns_id + k)
            if e is not None and e.pins > 0:
                e.pins -= 1

    # ----------------------------------------------------------------- admin

    def delete(self, ns_id: bytes, keys: Sequence[bytes] | None = None) -> int:
        with self._lock:
            self._check_open()
            self._ns(ns_id)
            gkeys = (self.index.namespace_keys(ns_id) if keys is None
                     else [ns_id + k for k in self._keys(keys)])
            n = 0
            for g in gkeys:
                e = self.index.get(g)
                if e is None:
                    continue
                if e.pins or e.gpu_pins or e.moving is not None:
                    continue  # leased, or being promoted or demoted: it goes when evicted later
                self._drop_gpu_copy(e)
                if e.host is not None:
                    self.host.free(e.host)
                    self.policies["host"].remove(g)
                if e.ssd:
                    self.ssd.delete(g)
                    self.policies["ssd"].remove(g)
                if e.remote:
                    self.remote.delete_many([g])
                self.index.discard(g)
                n += 1
            self.counters["deleted_blocks"] += n
            return n

    def retain(self, ns_id: bytes, keys: Sequence[bytes], level: str) -> int:
        """Pass the engine's expectation of reuse to every tier's policy; returns the stored
        blocks it reached. Why: whether a request body will be reused (the conversation goes on,
        or the session was closed) is what decides a prefix cache's hit ratio, the engine may
        know it, and the store cannot guess it (docs/eviction.md)."""
        keys = self._keys(keys)
        level = check_retention(level)
        with self._lock:
            self._check_open()
            self._ns(ns_id)
            found = [g for g in (ns_id + k for k in keys) if self.index.get(g) is not None]
            for policy in self.policies.values():
                hook = getattr(policy, "note_retention", None)
                if hook is not None:
                    hook(found, level)      # a policy skips the keys it does not hold
            self.counters["retention_hint_blocks"] += len(found)
            return len(found)

    def evict(self, tier: str, nbytes: int = 0, only: set[bytes] | None = None
              ) -> tuple[int, int]:
        """Evict from `tier` until `nbytes` are freed (0: everything evictable); with `only`,
        blocks of those namespaces alone (a tenant's Evict)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise InvalidArgument(f"bytes must be a non-negative integer, got {nbytes!r}")
        with self._lock:
            self._check_open()
            if tier == "host":
                return self.movement._evict_host(nbytes or None, only)
            if tier == "gpu" and self.gpu:
                return self.evict_gpu(nbytes or None, only)
            if tier == "ssd":
                if self.ssd is None:
                    raise Unavailable("the ssd tier is not enabled")
                return self.movement._evict_ssd(nbytes or None, only)
            raise InvalidArgument(f"cannot evict from tier {tier!r}; use 'host', 'ssd' or "
                                  "'gpu' (where enabled)")

    def flush(self, only: set[bytes] | None = None) -> int:
        """Write every host-only block (of the namespaces `only` names) down to SSD and sync;
        returns blocks written.

        Evictions demoting without the lock settle first, so their blocks are synced too (or,
        if their write failed, written here)."""
        with self._lock:
            self._check_open()
            # Until none is in flight with the lock held: while it waited, the background
            # demoter (or another writer) may have started a batch, whose blocks flush would
            # skip (they are moving) and would then not be synced.
            while self.movement._wait_demotions():
                pass
            return self._flush_locked(only=only)

    def _flush_locked(self, budget_s: float | None = None,
                      progress: Callable[[str], None] | None = None,
                      only: set[bytes] | None = None) -> int:
        """Write host-only blocks (of the namespaces `only` names) to SSD in batches, then
        sync; returns blocks written.

        With `budget_s`, stops starting batches once that many seconds have passed and says
        how many blocks it dropped; with `progress`, reports about once a second.
        """
        if self.ssd is None:
            return 0
        todo = [e for e in self.index.hot_entries() if e.host is not None and not e.ssd
                and (only is None or e.ns_id in only)]
        start = last = time.monotonic()
        done = nbytes = 0
        if progress is not None and todo:
            limit = "" if budget_s is None else f", at most {budget_s:g} s"
            progress(f"flushing {len(todo)} host blocks to SSD{limit}")
        for i in range(0, len(todo), 64):
            now = time.monotonic()
            if budget_s is not None and now - start >= budget_s:
                left = len(todo) - done
                self.counters["stop_flush_dropped_blocks"] += left
                msg = (f"flush stopped after {now - start:.1f} s (server.stop_flush_s): "
                       f"{left} host-only blocks not written to SSD are dropped")
                log.warning(msg)
                if progress is not None:
                    progress(msg)
                break
            if progress is not None and now - last >= 1.0:
                last = now
                progress(f"flushed {done}/{len(todo)} blocks, "
                         f"{nbytes / max(now - start, 1e-9) / 1e9:.2f} GB/s")
            batch = todo[i:i + 64]
            self.movement._demote_from_host(batch)
            done += len(batch)
            nbytes += sum(e.size for e in batch)
        else:   # no time ran out: gpu-only blocks go down too
            done += self._flush_gpu_locked() if self.gpu else 0
        self.ssd.put_state("policy.ssd", self.policies["ssd"].snapshot())
        self.ssd.sync()
        if progress is not None and todo:
            dt = time.monotonic() - start
            progress(f"flushed {done} blocks ({nbytes / 1e9:.3f} GB) in {dt:.3f} s")
        return done

    # ----------------------------------------------------------------- reporting

    def host_info(self) -> dict:
        return self.host.describe()

    def gpu_info(self, own: list | None = None) -> list[dict]:
        """GPU pools for RegisterNamespace replies (empty without CUDA or with gpu disabled):
        the shared slabs, or a tenant's own (`own`: gpu_segments_of(tenant))."""
        descs = [d for _, _, d in own] if own else [t.describe() for t in self.gpu.values()]
        return [{"device": d["device"], "ipc_handle": d["handle"], "size": d["size"],
                 "owner_pid": d["pid"], "uuid": d.get("uuid", ""), "name": d.get("name", ""),
                 "kind": d["kind"]}
                for d in descs]

    def stats(self) -> dict:
        with self._lock:
            tiers = {}
            # Per-tier block counts come from state that already counts them (a tier's policy
            # holds exactly its resident blocks; LMDB counts its entries), not from a walk of
            # the whole index under the lock at every scrape. Remote residency has no such
            # count, so only a daemon with the remote tier walks the index.
            host_blocks = len(self.policies["host"])
            ssd_blocks = len(self.ssd) if self.ssd is not None else 0
            remote_blocks = self.index.remote_count() if self.remote is not None else 0
            if self.gpu:
                tiers["gpu"], gpu_devices = self.gpu_stats()
            tiers["host"] = {"capacity_bytes": self.host.capacity,
                             "used_bytes": self.host.used_bytes, "blocks": host_blocks,
                             **self.tier_counters["host"]}
            if self.ssd is not None:
                tiers["ssd"] = {"capacity_bytes": self.ssd.capacity,
                                "used_bytes": self.ssd.used_bytes, "blocks": ssd_blocks,
                                **self.tier_counters["ssd"]}
            if self.remote is not None:
                tiers["remote"] = {"capacity_bytes": self.config.remote.capacity,
                                   "used_bytes": self.remote.used_bytes,
                                   "blocks": remote_blocks, **self.tier_counters["remote"],
                                   **{f"remote_{k}": v for k, v in self.remote.stats.items()
                                      if isinstance(v, (int, float))}}
            for t in tiers.values():
                for k in ("hits", "misses", "evictions"):
                    t.setdefault(k, 0)
            out_remote = {} if self.remote is None else self.remote.stats
            return {"tiers": tiers, "counters": dict(self.counters), "remote": out_remote,
                    "gpu_devices": gpu_devices if self.gpu else {},
                    "namespaces": len(self.namespaces), "active_leases": len(self.leases),
                    "blocks": len(self.index), "daemon_id": self.daemon_id}
