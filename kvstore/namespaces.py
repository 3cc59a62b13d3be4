"""Namespaces: registered once, kept (in memory and in LMDB) while they hold anything, capped
per tenant.

Why a record that did not land is written again: a namespace registered while the SSD
filesystem is full still serves from host, but a restart knows only the namespaces LMDB holds:
blocks of one whose record is missing were misses after the restart and their SSD bytes leaked.
So the record is kept in `StoreState.unpersisted` until it lands: a background thread writes it
again every RETRY_S, a Flush writes it first (and refuses while it cannot: RESOURCE_EXHAUSTED),
and no flush writes the namespace's blocks to SSD meanwhile (Moves.flush).

Why caps: a namespace is kept in memory and in LMDB, and a spec's free-form fields (extra,
model, revision) could make one cost hundreds of KiB; a tenant could otherwise register them
without end (docs/security.md, "The store's own checks").

Why empty namespaces are reclaimed at the cap: a long-running daemon sees models, revisions,
layouts and codecs come and go, and a cap that counted every namespace ever registered would
end in a tenant that can register nothing new until its data folder is wiped. A namespace that
holds no block in any tier, no lease and no record still to land costs only its entry, and its
id is its spec's digest: registering it again gives it back as it was. So a registration past
the cap forgets the tenant's least recently used such namespace (memory, LMDB record, index
number) and takes its place. A client that still uses the forgotten one gets NOT_FOUND, which
the SDK answers by registering it again and retrying (kvstore_client/namespace.py). A bytes
Put copying into slots while its namespace is reclaimed finds it gone before it publishes
(HostWrites.put), and a lease keeps its namespace, so no block is ever indexed under an
unknown namespace.
"""

from __future__ import annotations

import json
import logging
import threading
import time

from kvstore_client.common.errors import InvalidArgument, ResourceExhausted
from kvstore_client.common.layout import NamespaceSpec

from tiers.ssd import DiskFull

from .leases import LeaseTable
from .pools import TenantPools
from .state import NamespaceInfo, StoreState, aligned
from .tenants import TENANT_KEY

log = logging.getLogger("kvstore.store")

RETRY_S = 0.5       # how often a namespace record that did not land is written again


class Registry:
    def __init__(self, state: StoreState, pools: TenantPools, leases: LeaseTable) -> None:
        self.state = state
        self.pools = pools
        self.leases = leases
        self._retrying = False      # the thread writing records that did not land runs

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
            st.ns_used[ns_id] = time.monotonic()
            if info is not None:
                blob = st.unpersisted.get(ns_id)
                if blob is None:
                    return info
                # Its record has not landed yet: try again now (the write below).
            else:
                blob = self._admit(spec)
                info = NamespaceInfo(ns_id, spec)
                st.namespaces[ns_id] = info
                self.pools.note_namespace(ns_id)
                if st.ssd is None:
                    return info
                # Pending until the write lands: a flush meanwhile (the id is the spec's
                # digest: another client may use it already) writes it first, or leaves the
                # namespace's blocks on host.
                st.unpersisted[ns_id] = blob
            st.enter_busy()             # close() waits for the write below
        # The LMDB write (milliseconds) runs without the store lock: a tenant registering
        # namespaces must not stall every other tenant's calls behind it.
        try:
            st.ssd.put_namespace(ns_id, blob)
        except DiskFull as exc:         # host still serves it; its record is written again
            with st.lock:
                st.counters["ssd_disk_full_errors"] += 1
                self._start_retries()
            log.warning("namespace %s not persisted yet: %s; its record is written again "
                        "every %g s until it lands, and its blocks stay off SSD until then",
                        ns_id.hex(), exc, RETRY_S)
        else:
            with st.lock:
                st.unpersisted.pop(ns_id, None)
        finally:
            st.leave_busy()
        return info

    def persist_pending(self, only: set[bytes] | None = None, strict: bool = True) -> None:
        """Write the records of the namespaces (of `only`) that have not landed on SSD yet
        (locked; released for the writes). `strict` (a Flush): ResourceExhausted while one
        still cannot be written, since no block of it may go to SSD before it; otherwise
        (the retries, the stop) such records stay pending."""
        st = self.state
        todo = [(k, v) for k, v in st.unpersisted.items() if only is None or k in only]
        if not todo or st.ssd is None:
            return
        landed: list[bytes] = []
        failed: tuple[bytes, DiskFull] | None = None
        with st.unlocked():
            for ns_id, blob in todo:
                try:
                    st.ssd.put_namespace(ns_id, blob)
                except DiskFull as exc:
                    failed = ns_id, exc
                    break
                landed.append(ns_id)
        for ns_id in landed:
            if st.unpersisted.pop(ns_id, None) is not None:
                log.info("namespace %s persisted (its record did not land when it was "
                         "registered)", ns_id.hex())
        if failed is not None and strict:
            raise ResourceExhausted(
                f"namespace {failed[0].hex()} is not persisted yet, so none of its blocks can "
                f"be written to SSD: {failed[1]}")

    def _start_retries(self) -> None:
        """Start the thread writing pending records again, unless it runs (locked)."""
        if self._retrying:
            return
        self._retrying = True
        threading.Thread(target=self._retry, name="kvstore-namespace-records",
                         daemon=True).start()

    def _retry(self) -> None:
        """Every RETRY_S, write the pending records again, until none is left or the store
        closes (its writes count as busy, so close() waits for one under way)."""
        st = self.state
        while True:
            time.sleep(RETRY_S)
            with st.lock:
                if st.closed or not st.unpersisted:
                    self._retrying = False
                    return
                try:
                    self.persist_pending(strict=False)
                except Exception as exc:    # noqa: BLE001 - not DiskFull: try again later
                    log.warning("writing pending namespace records failed: %s", exc)

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
        if cap and have >= cap and not self._reclaim(owner):
            who = f"tenant {owner} has" if owner else "this daemon's clients have"
            raise ResourceExhausted(
                f"{who} registered {have} namespaces, the limit "
                f"(limits.namespaces_per_tenant = {cap}), and every one holds blocks or "
                "leases; delete the blocks of one no longer needed (an empty one makes room), "
                "or raise the limit. Namespaces already registered still work")
        return blob

    def _reclaim(self, owner: str | None) -> bool:
        """Forget the owner's least recently used namespace that holds nothing (module
        docstring); False when none does (locked). The scan is over the owner's namespaces
        (the cap bounds them) and runs only at the cap."""
        st = self.state
        empty = [ns for ns in self.pools.owned_namespaces(owner)
                 if not st.index.holds(ns) and not self.leases.on_namespace(ns)
                 and ns not in st.unpersisted]
        if not empty:
            return False
        used = st.ns_used
        ns_id = min(empty, key=lambda ns: used.get(ns, 0.0))
        # (Both read the spec from st.namespaces: before it goes.)
        self.pools.forget_namespace(ns_id)
        if st.events is not None:
            st.events.recorder.forget_namespace(ns_id)
        del st.namespaces[ns_id]
        st.ns_used.pop(ns_id, None)
        st.index.forget_namespace(ns_id)
        st.counters["namespaces_reclaimed"] += 1
        if st.ssd is not None:
            # Under the lock, unlike register's write: a registration of the same id right
            # after must find the record deleted, not see its own write undone. It runs only
            # at the cap, one small transaction.
            try:
                st.ssd.delete_namespace(ns_id)
            except Exception as exc:    # noqa: BLE001 - read back empty at the next start,
                log.warning("reclaimed namespace %s: its record stays in LMDB (%s); the next "
                            "start reads it back, empty", ns_id.hex(), exc)   # reclaimed again
        log.info("namespace %s reclaimed (empty, least recently used of %s at "
                 "limits.namespaces_per_tenant)", ns_id.hex(), owner or "the implicit tenant")
        return True
