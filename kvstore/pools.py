"""Per-tenant pools: which segment a namespace's blocks live in, and what room it has.

Why a collaborator of its own: eviction and allocation only need two answers, "which segment
does this namespace allocate from" and "which namespaces share that segment" (the victims that
can make room in it). A tenant with a host quota gets a segment of its own
(tiers/host_segments.py), so its quota is enforced by construction: it allocates only there and
evicts only its own blocks, and no other tenant's flood can evict them. Without tenants with a
host quota every answer is "the one slab, every namespace". The same holds for a tenant with a
gpu quota on every device (tiers/device_segments.py).

Which pools a namespace's slots may be leased in: only one its owner maps. A tenant with a
host quota maps its own pool; the shared pool's name goes only to admins and, without
tenants, to the implicit tenant. Any other tenant stores over Put and loads over Get, where the
daemon copies every byte itself. A lease in the shared pool would give it slots it cannot
write, and a Commit of those would publish whatever they last held: another tenant's freed or
demoted blocks. So such leases are refused (`check_lease_pool`), the same for the gpu tier's
shared slabs and tenants without a gpu quota. A slot a tenant may lease therefore only ever
held blocks of namespaces that tenant may read itself.

SSD and remote quotas are byte caps checked when blocks are written there (`fit_quota`).

The namespaces of each owner and of each segment are kept as sets, updated when a namespace is
registered, so eviction and quota checks never walk every tenant's namespaces.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvstore_client.common.errors import PermissionDenied, ResourceExhausted

from tiers.host_segments import SegmentedHost

from .config import ConfigError
from .state import StoreState
from .tenants import TENANT_KEY, Tenant, load_tenants

QUOTA_EVICT_ROUNDS = 8      # a tenant over its SSD quota evicts its own blocks at most this often


class TenantPools:
    """The tenants' pools and quotas over the store's tiers (see the module docstring)."""

    def __init__(self, state: StoreState) -> None:
        """Called once the shared slab exists (state.host): gives each tenant with a host
        quota its segment, replacing state.host with the segmented view."""
        self.state = state
        self.tenants: dict[str, Tenant] = load_tenants(state.config)
        self._quotas = {tier: {n: t.quota[tier] for n, t in self.tenants.items()
                               if t.quota.get(tier)} for tier in ("ssd", "remote")}
        pools = {n: t.quota["host"] for n, t in self.tenants.items() if t.quota.get("host")}
        self.segmented = bool(pools)
        if pools:
            state.attach(host=SegmentedHost(state.host, pools))
        self._ns_of_owner: dict[str | None, set[bytes]] = {}
        self._ns_of_seg: dict[int, set[bytes]] = {}

    # -- namespaces ---------------------------------------------------------------------------
    def owner(self, ns_id: bytes) -> str | None:
        info = self.state.namespaces.get(ns_id)
        return None if info is None else info.spec.extra.get(TENANT_KEY)

    def note_namespace(self, ns_id: bytes) -> None:
        """Note a namespace just added to `state.namespaces` under its owner and segment."""
        self._ns_of_owner.setdefault(self.owner(ns_id), set()).add(ns_id)
        if self.segmented:
            self._ns_of_seg.setdefault(self.segment_of(ns_id), set()).add(ns_id)

    def forget_namespace(self, ns_id: bytes) -> None:
        """Drop a namespace about to leave `state.namespaces` (reclaimed) from its sets."""
        own = self._ns_of_owner.get(self.owner(ns_id))
        if own is not None:
            own.discard(ns_id)
        if self.segmented:
            self._ns_of_seg.get(self.segment_of(ns_id), set()).discard(ns_id)

    def namespace_count(self, owner: str | None) -> int:
        """Namespaces registered by `owner` (None: the implicit tenant, or nobody's)."""
        return len(self._ns_of_owner.get(owner, ()))

    def owned_namespaces(self, tenant: str | None) -> set[bytes]:
        return set(self._ns_of_owner.get(tenant, ()))

    def check_lease_pool(self, ns_id: bytes, tier: str) -> None:
        """PermissionDenied unless this namespace's slots on `tier` lie in a pool its owner
        maps (see the module docstring). Free without tenants."""
        if not self.tenants:
            return
        owner = self.owner(ns_id)
        t = self.tenants.get(owner) if owner else None
        if t is None or t.admin:
            return          # nobody's (only admins reach it), or an admin's: the shared pool
        quota = "gpu" if tier == "gpu" else "host"
        if t.quota.get(quota):
            return
        what = "gpu slots" if quota == "gpu" else "host pool slots"
        raise PermissionDenied(
            f"tenant {t.name} may not lease {what}: it has no {quota}_quota, so its blocks "
            f"live in the shared {'slabs' if quota == 'gpu' else 'pool'}, which only admins "
            f"map; store with Put and load with Get (the SDK does so without a pool), or set "
            f"tenants.{t.name}.{quota}_quota for zero-copy in a pool of its own")

    # -- host segments ------------------------------------------------------------------------
    def segment_of(self, ns_id: bytes | None) -> int:
        """The host segment a namespace allocates from (0: the shared slab)."""
        if not self.segmented or ns_id is None:
            return 0
        return self.state.host.segment_of_tenant(self.owner(ns_id))

    def segment_namespaces(self, seg: int) -> set[bytes] | None:
        """The namespaces allocating from segment `seg` (None: all, when unsegmented). The
        live set, for membership tests only: it grows as namespaces are registered."""
        if not self.segmented:
            return None
        return self._ns_of_seg.setdefault(seg, set())

    def segment_room(self, seg: int) -> tuple[int, int]:
        """(capacity, used bytes) of a segment (the whole slab when unsegmented)."""
        host = self.state.host
        if not self.segmented:
            return host.capacity, host.used_bytes
        return host.capacity_of(seg), host.used_of(seg)

    def segment_count(self) -> int:
        return self.state.host.segment_count if self.segmented else 1

    def segment_full(self, seg: int) -> ResourceExhausted:
        cap, used = self.segment_room(seg)
        tenant = next(n for n in self.tenants if self.state.host.segment_of_tenant(n) == seg)
        return ResourceExhausted(
            f"tenant {tenant}'s host quota is full: {used} of {cap} bytes are leased or pinned "
            f"and none of its blocks is evictable; release leases or raise "
            f"tenants.{tenant}.host_quota")

    def tenant_pool(self, tenant: Tenant) -> tuple[int, int] | None:
        """(memfd, size) of a tenant's own pool, for the handshake; None without one."""
        if not self.segmented:
            return None
        seg = self.state.host.segment_of_tenant(tenant.name)
        return self.state.host.segment_fd(seg) if seg else None

    def tenant_base(self, tenant: str | None) -> int | None:
        """Offset of a tenant's own pool in the host offset space (None: it has none)."""
        if not self.segmented or not tenant:
            return None
        seg = self.state.host.segment_of_tenant(tenant)
        return self.state.host.base(seg) if seg else None

    # -- gpu segments -------------------------------------------------------------------------
    def split_gpu(self, prefix: str) -> None:
        """Called once the device tiers exist: give each tenant with a gpu_quota a slab of its
        own on every device (tiers/device_segments.py)."""
        quotas = {n: t.quota["gpu"] for n, t in self.tenants.items() if t.quota.get("gpu")}
        gpu = self.state.gpu
        if not quotas or not gpu:
            return
        from tiers.device_open import open_tenant_segment  # (numpy, CUDA: only with gpu quotas)
        from tiers.device_segments import SegmentedDevice
        for dev, shared in list(gpu.items()):
            def make(tenant: str, size: int, d: int, kind: str = shared.kind) -> Any:
                try:
                    return open_tenant_segment(kind, size, d, f"{prefix}gpu{d}-{tenant}")
                except Exception as e:
                    raise ConfigError(f"tenants.{tenant}.gpu_quota: cannot make its slab on "
                                      f"device {d}: {e}") from e
            gpu[dev] = SegmentedDevice(shared, quotas, make)

    def _segmented_device(self, dev: int) -> Any | None:
        t = self.state.gpu[dev]
        return t if hasattr(t, "segment_of_tenant") else None

    def gpu_segment(self, dev: int, ns_id: bytes) -> int:
        """The segment of device `dev` this namespace's blocks live in (0: the shared slab)."""
        t = self._segmented_device(dev)
        return t.segment_of_tenant(self.owner(ns_id)) if t is not None else 0

    def gpu_room(self, dev: int, seg: int) -> tuple[int, int]:
        """(capacity, used bytes) of a segment of a device (the whole slab when unsegmented)."""
        t = self.state.gpu[dev]
        if self._segmented_device(dev) is not None:
            return t.capacity_of(seg), t.used_of(seg)
        return t.capacity, t.used_bytes

    def in_gpu_segment(self, dev: int, seg: int, offset: int) -> bool:
        t = self._segmented_device(dev)
        return t is None or t.segment_of(offset) == seg

    def gpu_tenant_of(self, dev: int, seg: int) -> str | None:
        """The tenant owning segment `seg` of device `dev` (None: the shared slab)."""
        t = self._segmented_device(dev)
        return t.tenant_of(seg) if seg and t is not None else None

    def gpu_segments_of(self, tenant: str | None) -> list[tuple[int, int, dict]]:
        """(device, base offset, describe()) of a tenant's own slabs, one per device; [] for a
        tenant without a gpu_quota (or without the gpu tier)."""
        out = []
        for dev in sorted(self.state.gpu):
            t = self._segmented_device(dev)
            if t is not None:
                seg = t.segment_of_tenant(tenant)
                if seg:
                    out.append((dev, t.base(seg), t.describe_segment(seg)))
        return out

    def gpu_segment_fds(self, tenant: str | None) -> list[tuple[int, int, int]]:
        """(device, fd, size) of a tenant's own CPU-device slabs (memfds), for the handshake."""
        out = []
        for dev in sorted(self.state.gpu):
            t = self._segmented_device(dev)
            if t is not None:
                seg = t.segment_of_tenant(tenant)
                fd = getattr(t.tier(seg), "fd", None) if seg else None
                if fd is not None:
                    out.append((dev, fd, t.capacity_of(seg)))
        return out

    # -- SSD and remote quotas ----------------------------------------------------------------
    def tier_bytes(self, ns_ids: set[bytes], tier: str) -> int:
        """Raw block bytes those namespaces hold in `tier` ("ssd" or "remote"), from the
        index's running totals: a sum over the namespaces, not a walk of their blocks, so a
        quota check per demotion batch holds the lock as briefly at a million blocks as at
        one."""
        usage = self.state.index.tier_usage
        return sum(usage(ns, tier)[1] for ns in ns_ids)

    def fit_quota(self, tier: str, entries: Sequence[Any], values: Sequence[Any], strict: bool,
                  evict_own: Callable[[int, set[bytes]], tuple[int, int]] | None = None
                  ) -> tuple[list, list]:
        """The (entries, values) about to be written to `tier` that fit their tenants' quota
        for it (locked). A tenant over its SSD quota first evicts its own SSD blocks with
        `evict_own(bytes, its namespaces)` (kvstore/moves/ssd_room.py), never another's; what
        still does not fit raises ResourceExhausted naming tenant and tier (`strict`: Flush,
        write-through) or is left out and counted (eviction, where the block is dropped as a
        miss rather than evicting someone else's)."""
        caps = self._quotas.get(tier)
        if not caps:
            return list(entries), list(values)
        keep = [True] * len(entries)
        groups: dict[str, list[int]] = {}
        for i, e in enumerate(entries):
            t = self.owner(e.ns_id)
            if t in caps:
                groups.setdefault(t, []).append(i)
        for t, idx in groups.items():
            cap, own = caps[t], self.owned_namespaces(t)
            need = sum(entries[i].size for i in idx)
            used = self.tier_bytes(own, tier)
            for _ in range(QUOTA_EVICT_ROUNDS):
                if used + need <= cap or tier != "ssd" or evict_own is None:
                    break
                _, n = evict_own(used + need - cap, own)
                if not n:
                    break
                used = self.tier_bytes(own, tier)
            if used + need <= cap:
                continue
            if strict:
                raise ResourceExhausted(
                    f"tenant {t}'s {tier} quota is full: it holds {used} bytes of its "
                    f"{cap}-byte {tier} quota and {need} more do not fit after evicting its "
                    f"own evictable blocks; delete some or raise tenants.{t}.{tier}_quota")
            for i in idx:
                if used + entries[i].size <= cap:
                    used += entries[i].size
                else:
                    keep[i] = False
                    self.state.counters["tenant_quota_dropped_blocks"] += 1
        return ([e for e, k in zip(entries, keep, strict=True) if k],
                [v for v, k in zip(values, keep, strict=True) if k])
