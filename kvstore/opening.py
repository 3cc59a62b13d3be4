"""Opening the store: its tiers, their policies, and what a warm restart brings back.

The SSD tier opens first, then the host slab (tenants with a host quota get their own segments
of it), the devices, the remote tier and the KV events. Why the SSD tier before the slab: LMDB
maps what is on disk, and should a damaged file kill the process there, no slab is left in
/dev/shm; a slab name a live daemon holds is refused before either (tiers/host.py). On a
warm restart the namespaces come back from LMDB's meta records, and the index and the SSD
policy from the index image the last clean stop wrote (kvstore/warm_image.py) when LMDB is
exactly as that stop left it; otherwise from one scan of LMDB's block records, parents first,
and the SSD policy's saved state (blocks it does not name join as new).

Why each LMDB record is read under its own guard (`rebuild`): one damaged record (a flipped
bit in a namespace's JSON or a block's msgpack meta) used to end the start in a traceback, and
the only way back was to throw the whole SSD tier away. A namespace record that does not parse,
or whose spec's digest is not its id, is skipped: its blocks stay in LMDB unindexed (no index
image then: the image would index them under no namespace), registering the namespace again
writes its record anew, and the next start, which scans (`SSDTier.scan_next_open`), indexes
them again. A block record that does not parse, or whose value is longer than its namespace's
blocks can be, is skipped and deleted. One WARNING counts them (`ssd_damaged_records`). A file
LMDB itself finds damaged ends the start with one line naming it (tiers/ssd/index.py,
`unreadable`).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import msgpack
from kvstore_client.common.layout import MAX_BLOCK_BYTES, NamespaceSpec
from kvstore_client.common.pinning import PinnedHost, pin_host

from tiers import frame
from tiers.host import HostTier, check_free
from tiers.ssd import SSDTier

from . import warm_image
from .index import NS_ID_BYTES
from .moves.host_remote import CODEC_SLACK_BYTES
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
                                 sync=config.ssd.sync, warm=False,
                                 value_limit=ssd_value_limit(state)))
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


def value_bound(block_bytes: int) -> int:
    """The longest SSD value a block of `block_bytes` can be: the block, a codec's worst case
    over it (lossless stores a block as is when it does not shrink; lossy codes and scales stay
    under an eighth more), a codec's headers and the frame's (as kvstore/moves/host_remote.py
    bounds a remote value)."""
    return block_bytes + block_bytes // 8 + CODEC_SLACK_BYTES + frame.HEADER_BYTES


def ssd_value_limit(state: StoreState):
    """The SSD tier's `value_limit`: a value is at most value_bound() of its namespace's block
    size, or, for a namespace not known yet (the tier's own open), of the size in its meta
    record. Reads only the namespaces dict (no lock, no store call) and never raises."""
    namespaces = state.namespaces
    bounds: dict[bytes, int] = {}

    def limit(gkey: bytes, meta: memoryview) -> int | None:
        ns_id = gkey[:NS_ID_BYTES]
        got = bounds.get(ns_id)
        if got is not None:
            return got
        info = namespaces.get(ns_id)
        if info is not None:
            got = bounds[ns_id] = value_bound(info.block_bytes)
            return got
        try:
            size = msgpack.unpackb(meta)["s"]
        except Exception:  # noqa: BLE001 - a meta that does not parse bounds nothing
            return None
        return value_bound(size) if _is_count(size, MAX_BLOCK_BYTES) else None

    return limit


def _is_count(v: object, most: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= most


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
    bad_ns: list[tuple[bytes, str]] = []
    for ns_id, blob in ssd.namespaces().items():
        try:
            spec = NamespaceSpec.from_dict(json.loads(blob))
            if spec.digest != ns_id:
                raise ValueError("its spec's digest is not its id")
        except Exception as exc:  # noqa: BLE001 - one damaged record: skip it (docstring)
            bad_ns.append((ns_id, _why(exc)))
            continue
        state.namespaces[ns_id] = NamespaceInfo(ns_id, spec)
        pools.note_namespace(ns_id)
    state.counters["ssd_damaged_records"] += ssd.dropped_at_open + len(bad_ns)
    if bad_ns:
        ssd.scan_next_open = True
    elif _load_image(state):
        return
    index, policy = state.index, state.policies["ssd"]
    saved = ssd.get_state("policy.ssd")
    parents: dict[bytes, bytes | None] = {}
    fields: dict[bytes, tuple[int, int]] = {}
    bad: dict[bytes, str] = {}
    unpack, known = msgpack.unpackb, state.namespaces
    bounds = {ns_id: value_bound(info.block_bytes) for ns_id, info in known.items()}
    for gkey, meta, vsize in ssd.scan_meta():
        ns_id = gkey[:NS_ID_BYTES]
        bound = bounds.get(ns_id)
        if bound is None:
            continue
        # (Inlined checks: this runs once a block at every start that scans.)
        try:
            m = unpack(meta)
            p, size, checksum = m.get("p"), m["s"], m.get("c", 0)
        except Exception as exc:  # noqa: BLE001 - one damaged record: skip it (docstring)
            bad[gkey] = _why(exc)
            continue
        if (vsize > bound or type(size) is not int or not 0 <= size <= MAX_BLOCK_BYTES
                or type(checksum) is not int or not 0 <= checksum < 1 << 64
                or not (p is None or type(p) is bytes)):
            bad[gkey] = _fault(vsize, bound, p, size, checksum)
            continue
        parents[gkey] = ns_id + p if p else None
        fields[gkey] = (size, checksum)
    items = [(g, parents[g], *fields[g]) for g in parents_first(parents)]
    del parents, fields
    if bad:
        state.counters["ssd_damaged_records"] += len(bad)
        try:
            ssd.delete_many(list(bad))
        except Exception as exc:  # noqa: BLE001 - not indexed either way: never served
            log.warning("could not delete the damaged SSD block records (the next start "
                        "skips them again): %s", exc)
    _warn_damaged(ssd, bad_ns, bad)
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


def _fault(vsize: int, bound: int, p: object, size: object, checksum: object) -> str:
    """Why a block record that parsed is damaged (rebuild's checks, spelled out)."""
    if vsize > bound:
        return f"its value is {vsize} bytes, more than its namespace's blocks take ({bound})"
    if not (p is None or isinstance(p, bytes)):
        return f"its parent is a {type(p).__name__}"
    return f"its size ({size!r:.40}) or checksum ({checksum!r:.40}) is out of range"


def _why(exc: BaseException) -> str:
    return (f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)[:200]


def _warn_damaged(ssd: SSDTier, bad_ns: list[tuple[bytes, str]], bad: dict[bytes, str]
                  ) -> None:
    """One WARNING for the damaged records this start skipped (the SSD tier's open logs the
    ones it dropped itself)."""
    if not bad_ns and not bad:
        return
    first = (f"namespace {bad_ns[0][0].hex()}: {bad_ns[0][1]}" if bad_ns else
             f"block {next(iter(bad)).hex()}: {next(iter(bad.values()))}")
    log.warning("the SSD tier at %s holds %d damaged namespace record(s) (skipped: their "
                "blocks are indexed again at the first start after the namespace is registered "
                "again) and %d damaged block record(s) (deleted); none is served (e.g. %s)",
                ssd.path, len(bad_ns), len(bad), first)


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
    if state.ssd.scan_next_open:        # a namespace skipped at open: the next start scans
        return None
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
