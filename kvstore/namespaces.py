"""Namespaces: registered once, kept for good (in memory and in LMDB), capped per tenant.

Why caps: a namespace is kept in memory and in LMDB for good, and a spec's free-form fields
(extra, model, revision) could make one cost hundreds of KiB; a tenant could otherwise
register them without end (docs/security.md, "The store's own checks").
"""

from __future__ import annotations

import json
import logging

from kvstore_client.common.errors import InvalidArgument, ResourceExhausted
from kvstore_client.common.layout import NamespaceSpec

from tiers.ssd import DiskFull

from .pools import TenantPools
from .state import NamespaceInfo, StoreState, aligned
from .tenants import TENANT_KEY

log = logging.getLogger("kvstore.store")


class Registry:
    def __init__(self, state: StoreState, pools: TenantPools) -> None:
        self.state = state
        self.pools = pools

    def register(self, spec: NamespaceSpec) -> NamespaceInfo:
        """Register a namespace; idempotent (its id is the spec's digest)."""
        st = self.state
        if not isinstance(spec, NamespaceSpec):
            raise InvalidArgument("register_namespace takes a NamespaceSpec")
        if aligned(spec.layout.block_bytes) > st.host.capacity:
            raise InvalidArgument(
                f"one block of this layout is {spec.layout.block_bytes} bytes, larger than the "
                f"host tier ({st.host.capacity} bytes)")
        self._check_fits_own_pool(spec)
        ns_id = spec.digest
        with st.lock:
            st.check_open()
            info = st.namespaces.get(ns_id)
            if info is not None:
                return info
            blob = self._admit(spec)
            info = NamespaceInfo(ns_id, spec)
            st.namespaces[ns_id] = info
            self.pools.note_namespace(ns_id)
            if st.ssd is None:
                return info
            st.enter_busy()             # close() waits for the write below
        # The LMDB write (milliseconds) runs without the store lock: a tenant registering
        # namespaces must not stall every other tenant's calls behind it.
        try:
            st.ssd.put_namespace(ns_id, blob)
        except DiskFull as exc:         # host still serves it; a restart forgets it
            with st.lock:
                st.counters["ssd_disk_full_errors"] += 1
            log.warning("namespace %s not persisted: %s", ns_id.hex(), exc)
        finally:
            st.leave_busy()
        return info

    def _check_fits_own_pool(self, spec: NamespaceSpec) -> None:
        """Refuse a block size larger than the owner's own host pool (its host_quota).

        Why: such a block can never be stored (the tenant allocates only in its own pool), yet
        its namespace would let the tenant stream ever larger split blocks into daemon memory
        (Put's buffer of a block in pieces, Get's reply messages) far past what its quota
        says it may hold; the shared pool's size is no bound for a tenant that cannot use it.
        """
        owner = spec.extra.get(TENANT_KEY)
        if not owner or not self.pools.segmented:
            return
        host = self.state.host
        seg = host.segment_of_tenant(owner)
        if not seg:
            return
        cap = host.capacity_of(seg)
        if aligned(spec.layout.block_bytes) > cap:
            raise InvalidArgument(
                f"one block of this layout is {spec.layout.block_bytes} bytes, larger than "
                f"tenant {owner}'s own host pool ({cap} bytes, tenants.{owner}.host_quota); "
                "such a block could never be stored")

    def _admit(self, spec: NamespaceSpec) -> bytes:
        """The spec as persisted, once it is known to fit its tenant's caps (locked)."""
        lim = self.state.config.limits
        blob = json.dumps(spec.to_dict()).encode()
        if len(blob) > lim.namespace_spec_bytes:
            raise InvalidArgument(
                f"the namespace spec is {len(blob)} bytes as stored, above the daemon's limit "
                f"of {lim.namespace_spec_bytes} (limits.namespace_spec_bytes); shorten "
                "spec.extra, model or revision")
        owner = spec.extra.get(TENANT_KEY)
        cap = lim.namespaces_per_tenant
        have = self.pools.namespace_count(owner)
        if cap and have >= cap:
            who = f"tenant {owner} has" if owner else "this daemon's clients have"
            raise ResourceExhausted(
                f"{who} registered {have} namespaces, the limit "
                f"(limits.namespaces_per_tenant = {cap}); namespaces already registered "
                "still work")
        return blob
