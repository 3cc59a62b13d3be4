"""Per-tenant host pools: which segment a namespace's blocks live in, and what room it has.

Why here and not in movement.py: eviction and allocation only need two answers, "which segment
does this namespace allocate from" and "which namespaces share that segment" (the victims that
can make room in it). A tenant with a host quota gets a segment of its own
(tiers/host_segments.py), so its quota is enforced by construction: it allocates only there and
evicts only its own blocks, and no other tenant's flood can evict them. Without tenants with a
host quota every answer is "the one slab, every namespace", exactly as before.

Which pools a namespace's slots may be leased in: only one its owner maps. A tenant with a
host quota maps its own pool; the shared pool's name goes only to admins and, without
tenants, to the implicit tenant. Any other tenant stores over Put and loads over Get, where the
daemon copies every byte itself. A lease in the shared pool would give it slots it cannot
write, and a Commit of those would publish whatever they last held: another tenant's freed or
demoted blocks. So such leases are refused (`check_lease_pool`), the same for the gpu tier's
shared slabs and tenants without a gpu quota. A slot a tenant may lease therefore only ever
held blocks of namespaces that tenant may read itself.

The namespaces of each owner and of each segment are kept as sets, updated when a namespace is
registered, so eviction and quota checks never walk every tenant's namespaces.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvstore_client.common.errors import PermissionDenied, ResourceExhausted

from tiers.host_segments import SegmentedHost

from .config import ConfigError
from .tenants import TENANT_KEY, Tenant, load_tenants


class TenantPools:
    """Mixin of Store (uses config, host, namespaces)."""

    tenants: dict[str, Tenant]
    _segmented: bool

    def _setup_pools(self) -> None:
        """Called once the shared slab exists: give each tenant with a host quota its segment."""
        self.tenants = load_tenants(self.config)
        self._quotas = {tier: {n: t.quota[tier] for n, t in self.tenants.items()
                               if t.quota.get(tier)} for tier in ("ssd", "remote")}
        pools = {n: t.quota["host"] for n, t in self.tenants.items() if t.quota.get("host")}
        self._segmented = bool(pools)
        if pools:
            self.host = SegmentedHost(self.host, pools)
        self._ns_of_owner: dict[str | None, set[bytes]] = {}
        self._ns_of_seg: dict[int, set[bytes]] = {}

    def _index_namespace(self, ns_id: bytes) -> None:
        """Note a namespace just added to `namespaces` under its owner and its segment."""
        self._ns_of_owner.setdefault(self.owner(ns_id), set()).add(ns_id)
        if self._segmented:
            self._ns_of_seg.setdefault(self._seg(ns_id), set()).add(ns_id)

    def namespace_count(self, owner: str | None) -> int:
        """Namespaces registered by `owner` (None: the implicit tenant, or nobody's)."""
        return len(self._ns_of_owner.get(owner, ()))

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

    def _split_gpu(self, prefix: str) -> None:
        """Called once the device tiers exist: give each tenant with a gpu_quota a slab of its
        own on every device (tiers/device_segments.py)."""
        quotas = {n: t.quota["gpu"] for n, t in self.tenants.items() if t.quota.get("gpu")}
        if not quotas or not self.gpu:
            return
        from tiers.device_open import open_tenant_segment  # (numpy, CUDA: only with gpu quotas)
        from tiers.device_segments import SegmentedDevice
        for dev, shared in list(self.gpu.items()):
            def make(tenant: str, size: int, d: int, kind: str = shared.kind) -> Any:
                try:
                    return open_tenant_segment(kind, size, d, f"{prefix}gpu{d}-{tenant}")
                except Exception as e:
                    raise ConfigError(f"tenants.{tenant}.gpu_quota: cannot make its slab on "
                                      f"device {d}: {e}") from e
            self.gpu[dev] = SegmentedDevice(shared, quotas, make)

    def owner(self, ns_id: bytes) -> str | None:
        info = self.namespaces.get(ns_id)
        return None if info is None else info.spec.extra.get(TENANT_KEY)

    def _seg(self, ns_id: bytes | None) -> int:
        if not self._segmented or ns_id is None:
            return 0
        return self.host.segment_of_tenant(self.owner(ns_id))

    def _seg_namespaces(self, seg: int) -> set[bytes] | None:
        """The namespaces allocating from segment `seg` (None: all, when unsegmented). The
        live set, for membership tests only: it grows as namespaces are registered."""
        if not self._segmented:
            return None
        return self._ns_of_seg.setdefault(seg, set())

    def _seg_room(self, seg: int) -> tuple[int, int]:
        """(capacity, used bytes) of a segment (the whole slab when unsegmented)."""
        if not self._segmented:
            return self.host.capacity, self.host.used_bytes
        return self.host.capacity_of(seg), self.host.used_of(seg)

    def _seg_full(self, seg: int) -> ResourceExhausted:
        cap, used = self._seg_room(seg)
        tenant = next(n for n, t in self.tenants.items()
                      if self.host.segment_of_tenant(n) == seg)
        return ResourceExhausted(
            f"tenant {tenant}'s host quota is full: {used} of {cap} bytes are leased or pinned "
            f"and none of its blocks is evictable; release leases or raise "
            f"tenants.{tenant}.host_quota")

    def tenant_pool(self, tenant: Tenant) -> tuple[int, int] | None:
        """(memfd, size) of a tenant's own pool, for the handshake; None without one."""
        if not self._segmented:
            return None
        seg = self.host.segment_of_tenant(tenant.name)
        return self.host.segment_fd(seg) if seg else None

    def tenant_base(self, tenant: str | None) -> int | None:
        """Offset of a tenant's own pool in the host offset space (None: it has none)."""
        if not self._segmented or not tenant:
            return None
        seg = self.host.segment_of_tenant(tenant)
        return self.host.base(seg) if seg else None

    # -- SSD and remote quotas ----------------------------------------------------------------
    def _owned_ns(self, tenant: str) -> set[bytes]:
        return set(self._ns_of_owner.get(tenant, ()))

    def _tier_bytes(self, ns_ids: set[bytes], tier: str) -> int:
        """Raw block bytes those namespaces hold in `tier` (a walk of their blocks)."""
        total = 0
        for ns in ns_ids:
            for g in self.index.namespace_keys(ns):
                e = self.index.read(g)
                if e is not None and (e.ssd if tier == "ssd" else e.remote):
                    total += e.size
        return total

    def _fit_quota(self, tier: str, entries: Sequence[Any], values: Sequence[Any],
                   strict: bool) -> tuple[list, list]:
        """The (entries, values) about to be written to `tier` that fit their tenants' quota
        for it (locked). A tenant over its SSD quota first evicts its own SSD blocks, never
        another's; what still does not fit raises ResourceExhausted naming tenant and tier
        (`strict`: Flush, write-through) or is left out and counted (eviction, where the block
        is dropped as a miss rather than evicting someone else's)."""
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
            cap, own = caps[t], self._owned_ns(t)
            need = sum(entries[i].size for i in idx)
            used = self._tier_bytes(own, tier)
            for _ in range(8):
                if used + need <= cap or tier != "ssd":
                    break
                _, n = self.movement._evict_ssd(used + need - cap, own)
                if not n:
                    break
                used = self._tier_bytes(own, tier)
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
                    self.counters["tenant_quota_dropped_blocks"] += 1
        return ([e for e, k in zip(entries, keep, strict=True) if k],
                [v for v, k in zip(values, keep, strict=True) if k])
