"""Opening the store: its tiers, their policies, and what a warm restart brings back.

The SSD tier opens first, then the host slab (tenants with a host quota get their own segments
of it), the devices, the remote tier and the KV events. Why the SSD tier before the slab: LMDB
maps what is on disk, and should a damaged file kill the process there, no slab is left in
/dev/shm; a slab name a live daemon holds is refused before either (tiers/host.py). On a
warm restart the namespaces come back from LMDB's meta records, and the index and the SSD
policy from the index image the last clean stop wrote (kvstore/warm_image.py) when LMDB is
exactly as that stop left it; otherwise from one scan of LMDB's block records, parents first,
and the SSD policy's saved state (blocks it does not name join as new).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import msgpack
from kvstore_client.common.layout import NamespaceSpec
from kvstore_client.common.pinning import PinnedHost, pin_host

from tiers.host import HostTier, check_free
from tiers.ssd import SSDTier

from . import warm_image
from .index import NS_ID_BYTES
from .policies import make_policy
from .pools import TenantPools
from .state import NamespaceInfo, StoreState

log = logging.getLogger("kvstore.store")


def open_tiers(state: StoreState, data: Path, shm_name: str) -> tuple[TenantPools, PinnedHost]:
    """Open every tier into `state` and rebuild the index from SSD; returns the tenant pools
    and the host slab's page-locking (released after the devices, before the slab). On an
    error whatever was opened is closed again."""
    config = state.config
    check_free(shm_name)            # another live daemon's slab: refused before slow work
    if config.ssd.enabled:
        state.attach(ssd=SSDTier(str(data / "ssd"), config.ssd.capacity,
                                 sync=config.ssd.sync, warm=False))
    host_pin: PinnedHost | None = None
    try:
        slab = HostTier(config.host.capacity, shm_name=shm_name, prefault=False)
        state.attach(host=slab)
        pools = TenantPools(state)      # tenants with a host quota get their own segment
        # Page-locked so host<->GPU copies (ours and clients') run at PCIe speed; a no-op
        # without CUDA. It must be unregistered before the slab is unmapped (close order).
        host_pin = pin_host(slab.buffer)
        if config.gpu.enabled:      # (numpy and the CUDA bindings only where configured)
            from tiers.device_open import open_device_tiers
            state.attach(gpu=open_device_tiers(config.gpu.capacity, config.gpu.devices,
                                               config.gpu.backend, log,
                                               slab_prefix=shm_name + "-"))
        pools.split_gpu(shm_name + "-")     # tenants with a gpu quota get their own slabs
        state.device_counters = {dev: Counter() for dev in state.gpu}
        # No capacity hint: blocks differ in size per namespace, so a policy learns its
        # capacity in blocks from peak residency.
        state.policies["host"] = make_policy(config.host.policy, None)
        for dev in state.gpu:
            state.policies[f"gpu{dev}"] = make_policy(config.gpu.policy, None)
        # The host policy's self-tuning runs off the Commit path (SegmentedPolicy.defer_tuning;
        # fed by the reaper thread, and by any eviction first).
        defer = getattr(state.policies["host"], "defer_tuning", None)
        if defer is not None:
            defer()
        if config.ssd.enabled:
            state.policies["ssd"] = make_policy(config.ssd.policy, None, rows=state.index)
        if config.remote.enabled:
            from tiers.remote import RemoteTier  # redis only where configured
            state.attach(remote=RemoteTier(config.remote))
        rebuild(state, pools)
        if config.events.enabled:       # pyzmq only where configured
            from .events.service import Events
            state.events = Events(state, config.events, data)
            state.events.attach(state.index)
    except BaseException:
        for t in state.gpu.values():
            t.close()
        if host_pin is not None:
            host_pin.close()
        if state.host is not None:
            state.host.close()
        if state.ssd is not None:
            state.ssd.close()
        raise
    return pools, host_pin


def parents_first(parents: dict[bytes, bytes | None]) -> list[bytes]:
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


def rebuild(state: StoreState, pools: TenantPools) -> None:
    """Namespaces and SSD residency from LMDB (before the store serves: no lock needed)."""
    ssd = state.ssd
    if ssd is None:
        return
    for ns_id, blob in ssd.namespaces().items():
        spec = NamespaceSpec.from_dict(json.loads(blob))
        state.namespaces[ns_id] = NamespaceInfo(ns_id, spec)
        pools.note_namespace(ns_id)
    if _load_image(state):
        return
    index, policy = state.index, state.policies["ssd"]
    saved = ssd.get_state("policy.ssd")
    parents: dict[bytes, bytes | None] = {}
    fields: dict[bytes, tuple[int, int]] = {}
    unpack, known = msgpack.unpackb, state.namespaces
    for gkey, meta, _vsize in ssd.scan_meta():
        ns_id = gkey[:NS_ID_BYTES]
        if ns_id in known:
            m = unpack(meta)
            p = m.get("p")
            parents[gkey] = ns_id + p if p else None
            fields[gkey] = (m["s"], m.get("c", 0))
    items = [(g, parents[g], *fields[g]) for g in parents_first(parents)]
    del parents, fields
    index.load_ssd(items)
    if saved:
        try:
            policy.restore(saved)
        except Exception as exc:  # an old or damaged snapshot only costs recency
            log.warning("ignoring the saved SSD eviction state: %s", exc)
    # Blocks the snapshot does not name (none saved, or written after it: a crash) join as new;
    # each must be in the policy or it could never be evicted.
    for gkey, pg, size, _ in items:
        if gkey not in policy:
            policy.insert(gkey, pg, size)
    if (compact := getattr(policy, "compact", None)) is not None:
        compact()
    if len(index):
        log.info("rebuilt the index: %d blocks in %d namespaces from SSD", len(index),
                 len(state.namespaces))


def _load_image(state: StoreState) -> bool:
    """Index and SSD policy from the image (kvstore/warm_image.py); False: scan instead."""
    ssd, index = state.ssd, state.index
    idx = ssd.image_section(warm_image.INDEX)
    pol = ssd.image_section(warm_image.POLICY)
    if idx is None or pol is None:
        return False
    policy = state.policies["ssd"]
    try:
        warm_image.load_index(index, idx)
    except warm_image.ImageError as exc:
        log.warning("ignoring the SSD index image (scanning the index): %s", exc)
        return False
    try:
        warm_image.load_policy(policy, pol, index)
    except warm_image.ImageError as exc:
        log.warning("ignoring the SSD index image (scanning the index): %s", exc)
        warm_image.reset_index(index)
        return False
    for r in warm_image.missing_from_policy(index, policy):
        g = index.key_at(r)
        policy.insert(g, index.parent_key(r), index.read(g).size)
    if len(index):
        log.info("loaded the index image: %d blocks in %d namespaces", len(index),
                 len(state.namespaces))
    return True


def ssd_image(state: StoreState) -> dict[str, bytes] | None:
    """The store's sections of the index image written at close (None: no image)."""
    try:
        return warm_image.dump(state.index, state.policies.get("ssd"),
                               set(state.ssd.namespaces()))
    except Exception:  # noqa: BLE001 - without an image the next start scans
        log.exception("no index image: building it failed")
        return None


def close_tiers(state: StoreState, moves, host_pin: PinnedHost) -> None:
    """Release what open_tiers opened, in the order its users need: the event streams before
    the SSD tier (they read texts from LMDB), the SSD tier with the index image a warm restart
    reads, the moves' threads, the devices, then the slab's page-locking and the slab."""
    if state.events is not None:
        try:
            state.events.close()
        except Exception:  # noqa: BLE001 - a stop must go on to release the tiers
            log.exception("closing the KV event streams failed")
    if state.ssd is not None:
        state.ssd.close(image=ssd_image(state))
    if state.remote is not None:
        state.remote.close()
    moves.close()
    for t in state.gpu.values():
        t.close()
    host_pin.close()
    state.host.close()
