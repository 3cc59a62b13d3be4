"""The store's sections of the SSD index image (tiers/ssd/image.py): index rows and SSD policy.

Why: a warm restart used to read every LMDB record, unpack its msgpack meta, order parents
before children, fill the index row by row and replay the policy snapshot node by node, a
Python step per block (about 3 s for 100k blocks under load). At a clean stop the
result of all that is in memory; here it is written as packed arrays, keyed by the same index
rows, and read back with bulk operations (a dict of the keys, a few list comprehensions).

What the image holds is exactly what the scan would rebuild: the blocks the SSD tier holds, of
namespaces LMDB knows, with the index's own fields, and the SSD policy's state. Host-only
blocks are left out (a restart has no host copies), and their rows are free rows in the
image. Only a SegmentedPolicy over index rows (the default SSD policy) has an image; any
other policy, or a policy that names a row the image does not hold, means no image, and the
restart scans as before.

These functions read and set the private state of BlockIndex, RowLeaves, GhostKeys and
SegmentedPolicy on purpose: the image is a copy of that state, and tests restore from it and
from the scan and compare the results (tests/test_warm_image.py).
"""

from __future__ import annotations

from array import array
from typing import Any

import msgpack

from .entry import NS_ID_BYTES
from .index import _SSD, _STATE, BlockIndex
from .policies.evicted_keys import GhostKeys
from .policies.packed_leaves import RowLeaves
from .policies.segmented import SegmentedPolicy

VERSION = 3
INDEX = "store.index"
POLICY = "store.policy.ssd"
_INT_ARRAYS = ("_prio", "_nchild", "_prow", "_first", "_next", "_prev")
_SSD_BIT = bytes(f & _SSD for f in range(256))   # a flags byte -> 1 if on SSD (other bits off)
_STATE_BITS = bytes(f & _STATE for f in range(256))


class ImageError(ValueError):
    """A section that cannot be loaded: the caller rebuilds from the scan instead."""


def _kept_rows(index: BlockIndex, known_ns: set[bytes]) -> bytearray:
    """1 for each row whose block is on SSD in a namespace LMDB knows."""
    kept = bytearray(len(index._keys))
    hot, flags, ns, ns_ids = index._hot, index._flags, index._ns, index._ns_ids
    for r, g in enumerate(index._keys):
        if g is None:
            continue
        e = hot.get(g)
        on_ssd = e.ssd if e is not None else bool(flags[r] & _SSD)
        if on_ssd and ns_ids[ns[r]] in known_ns:
            kept[r] = 1
    return kept


def dump(index: BlockIndex, policy: Any, known_ns: set[bytes]) -> dict[str, bytes] | None:
    """The store's image sections, or None when this state has none (see module docstring)."""
    if not isinstance(policy, SegmentedPolicy) or not isinstance(policy._leaves, RowLeaves) \
            or not isinstance(policy._ghost, GhostKeys):
        return None
    kept = _kept_rows(index, known_ns)
    leaves = policy._leaves
    if leaves._n and not _subset(leaves._in, kept):
        return None                 # the policy names a block the image leaves out
    return {INDEX: _dump_index(index, kept), POLICY: _dump_policy(policy)}


def _subset(inner: bytearray, outer: bytearray) -> bool:
    """Whether every row set in `inner` (bytes 0/1) is set in `outer`, in bulk."""
    n = max(len(inner), len(outer))
    a = int.from_bytes(bytes(inner).ljust(n, b"\0"), "little")
    b = int.from_bytes(bytes(outer).ljust(n, b"\0"), "little")
    return not a & ~b


def _dump_index(index: BlockIndex, kept: bytearray) -> bytes:
    keys, hot, rows = index._keys, index._hot, index._rows
    parent_of, size, csum, ns = index._parent, index._size, index._sum, index._ns
    out_rows, out_keys, out_prow, out_size, out_sum, out_ns = (
        array("i"), [], array("i"), array("q"), array("Q"), array("H"))
    out_flags = bytearray()          # the SSD bit and the row's child link (lookups follow it)
    flags = index._flags
    awaited: list[list[Any]] = []
    for r, k in enumerate(kept):
        if not k:
            continue
        g = keys[r]
        e = hot.get(g)
        if e is not None:
            pg, sz, cs = e.parent_gkey, e.size, e.checksum
        else:
            pg, sz, cs = parent_of[r], size[r], csum[r]
        p = -1
        if pg is not None:
            pr = rows.get(pg)
            if pr is not None and kept[pr]:
                p = pr
            else:
                awaited.append([len(out_rows), pg])
        out_rows.append(r)
        out_keys.append(g)
        out_prow.append(p)
        out_size.append(sz)
        out_sum.append(cs)
        out_ns.append(ns[r])
        out_flags.append(_SSD | (flags[r] & ~_STATE))
    children = array("i", bytes(4 * len(out_rows)))
    pos = {r: i for i, r in enumerate(out_rows)} if len(out_rows) != len(keys) else None
    for p in out_prow:
        if p >= 0:
            children[p if pos is None else pos[p]] += 1
    return msgpack.packb({
        "v": VERSION, "n": len(keys), "rows": out_rows.tobytes(), "keys": out_keys,
        "prow": out_prow.tobytes(), "await": awaited, "size": out_size.tobytes(),
        "children": children.tobytes(),
        "sum": out_sum.tobytes(), "ns": out_ns.tobytes(), "ns_ids": index._ns_ids,
        "flags": bytes(out_flags),
    }, use_bin_type=True)


def _arr(code: str, raw: bytes) -> array:
    a = array(code)
    a.frombytes(raw)
    return a


def load_index(index: BlockIndex, blob: bytes | memoryview) -> None:
    """Fill an empty index from its image section; ImageError (index left empty) if the
    section is not one this build wrote or does not add up."""
    assert not index._rows and not index._keys, "load_index() fills an empty index only"
    assert index.listener is None, "bulk loads run before a residency listener attaches"
    try:
        m = msgpack.unpackb(blob, raw=False)
        if m.get("v") != VERSION:
            raise ImageError("unknown index image version")
        n = int(m["n"])
        kept = _arr("i", m["rows"])
        prow, size, csum, nums, children = (
            _arr("i", m["prow"]), _arr("q", m["size"]), _arr("Q", m["sum"]), _arr("H", m["ns"]),
            _arr("i", m["children"]))
        gkeys = m["keys"]               # a msgpack list of bin: bytes objects made in C
        if not isinstance(gkeys, list) or (gkeys and not isinstance(gkeys[0], bytes)):
            raise ImageError("index image keys are not a list of bytes")
        ns_ids = [bytes(x) for x in m["ns_ids"]]
        row_flags = bytearray(m["flags"])
        awaited_list = [(int(i), bytes(pg)) for i, pg in m["await"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ImageError(f"index image is malformed: {exc}") from None
    count = len(kept)
    if not (len(gkeys) == len(prow) == len(size) == len(csum) == len(nums) == len(children)
            == len(row_flags) == count) \
            or row_flags.translate(_STATE_BITS) != bytearray([_SSD]) * count \
            or count > n or (count and (kept[-1] >= n or kept[0] < 0)) \
            or any(len(g) <= NS_ID_BYTES for g in gkeys[:1]) \
            or (count and max(nums) >= len(ns_ids)) \
            or (count and not all(ns_ids[k] for k in set(nums))):
        raise ImageError("index image does not add up")
    full = count == n and (not n or (kept[0] == 0 and kept[-1] == n - 1))
    rows = dict(zip(gkeys, range(count) if full else kept, strict=True))
    if len(rows) != count:
        raise ImageError("index image repeats a key")
    try:
        pk: list[bytes | None] = [gkeys[p] if p >= 0 else None
                                  for p in _rows_to_idx(prow, kept, full)]
    except IndexError:
        raise ImageError("index image names a parent row it does not hold") from None
    awaited: dict[bytes, int] = {}
    for i, pg in awaited_list:
        if not 0 <= i < count:
            raise ImageError("index image names a row it does not hold")
        pk[i] = pg
        awaited[pg] = awaited.get(pg, 0) + 1
    if full:
        keys: list[bytes | None] = gkeys      # type: ignore[assignment]
        parents = pk
        flags = row_flags
        free = array("i")
    else:
        keys, parents = [None] * n, [None] * n
        flags = bytearray(n)
        sz, cs, ch, ns = (array("q", bytes(8 * n)), array("Q", bytes(8 * n)),
                          array("i", bytes(4 * n)), array("H", bytes(2 * n)))
        for i, r in enumerate(kept):
            keys[r], parents[r], flags[r] = gkeys[i], pk[i], row_flags[i]
            sz[r], cs[r], ch[r], ns[r] = size[i], csum[i], children[i], nums[i]
        size, csum, children, nums = sz, cs, ch, ns
        free = array("i", [r for r in range(n - 1, -1, -1) if keys[r] is None])
    index._rows, index._keys, index._parent = rows, keys, parents
    index._size, index._sum, index._flags, index._children, index._ns = (
        size, csum, flags, children, nums)
    index._ns_ids = ns_ids
    index._ns_no = {g: k for k, g in enumerate(ns_ids) if g}
    index._ns_free = [k for k, g in enumerate(ns_ids) if not g]
    index._free = free
    index._awaited = awaited
    index.rebuild_namespace_rows()


def _rows_to_idx(prow: array, kept: array, full: bool) -> list[int]:
    """Parent rows as positions in the kept lists (the same when every row is kept)."""
    if full:
        return prow.tolist()
    pos = {r: i for i, r in enumerate(kept)}
    try:
        return [pos[p] if p >= 0 else -1 for p in prow]
    except KeyError:
        raise ImageError("index image names a parent row it does not hold") from None


def _dump_policy(policy: SegmentedPolicy) -> bytes:
    leaves, ghost = policy._leaves, policy._ghost
    return msgpack.packb({
        "v": VERSION, "clock": policy._clock, "peak": policy._peak,
        "mode": list(policy._mode), "scores": [sh[2] for sh in policy._shadows or []],
        "in": bytes(leaves._in), "seg": bytes(leaves._seg),
        **{name: getattr(leaves, name).tobytes() for name in _INT_ARRAYS},
        "heaps": [array("q", h).tobytes() for h in leaves._heaps],
        "sizes": leaves.sizes, "leafs": leaves._leafs, "n": leaves._n,
        "orphans": [[pg, sorted(rs)] for pg, rs in leaves._orphans.items()],
        "ghost": {"fp": ghost._fp.tobytes(), "pos": ghost._pos.tobytes(), "n": ghost._n,
                  "ring": ghost._ring.tobytes(), "base": ghost._base, "head": ghost._head},
    }, use_bin_type=True)


def load_policy(policy: SegmentedPolicy, blob: bytes | memoryview, index: BlockIndex
                ) -> None:
    """Restore `policy` (made over `index`, just loaded from the same image) from its
    section; ImageError if it is not one this build wrote or names rows the index lacks."""
    if not isinstance(policy, SegmentedPolicy) or policy._rows is not index:
        raise ImageError("the SSD policy is not the default policy over the index")
    try:
        m = msgpack.unpackb(blob, raw=False)
        if m.get("v") != VERSION:
            raise ImageError("unknown policy image version")
        inside, seg = bytearray(m["in"]), bytearray(m["seg"])
        ints = {name: _arr("q" if name == "_prio" else "i", m[name]) for name in _INT_ARRAYS}
        heaps = [_arr("q", h).tolist() for h in m["heaps"]]
        g = m["ghost"]
        ghost = GhostKeys()
        ghost._fp, ghost._pos, ghost._ring = _arr("I", g["fp"]), _arr("I", g["pos"]), \
            _arr("I", g["ring"])
        ghost._n, ghost._base, ghost._head = int(g["n"]), int(g["base"]), int(g["head"])
        share, tail, hinted = m["mode"]
        mode = (None if share is None else float(share), bool(tail), int(hinted))
        sizes, leafs, count = [int(x) for x in m["sizes"]], [int(x) for x in m["leafs"]], \
            int(m["n"])
        orphans = {bytes(pg): {int(r) for r in rs} for pg, rs in m["orphans"]}
        clock, peak, scores = int(m["clock"]), int(m["peak"]), [float(s) for s in m["scores"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ImageError(f"policy image is malformed: {exc}") from None
    if any(len(a) != len(inside) for a in (seg, *ints.values())) \
            or len(heaps) != len(policy._leaves._heaps) or len(sizes) != len(heaps) \
            or len(leafs) != len(heaps) or sum(sizes) != count \
            or inside.count(1) != count or len(ghost._fp) != len(ghost._pos) \
            or len(ghost._fp) & (len(ghost._fp) - 1):
        raise ImageError("policy image does not add up")
    if count and not _subset(inside, index._flags.translate(_SSD_BIT)):
        raise ImageError("policy image names a block the index image does not hold")
    rows = policy._rows
    rows.on_free.remove(policy._leaves._forget)
    policy.__init__(policy._hint, shadow=policy._shadows is not None, rows=rows)
    leaves = policy._leaves
    leaves._in, leaves._seg = inside, seg
    for name, a in ints.items():
        setattr(leaves, name, a)
    leaves._heaps, leaves.sizes, leaves._leafs, leaves._n = heaps, sizes, leafs, count
    leaves._orphans = orphans
    leaves._orphan_of = {r: pg for pg, rs in orphans.items() for r in rs}
    policy._ghost = ghost
    policy._clock, policy._peak = clock, max(peak, count)
    policy._set_mode(mode)
    for sh, score in zip(policy._shadows or [], scores, strict=False):
        sh[2] = score


def reset_index(index: BlockIndex) -> None:
    """Empty an index loaded from an image whose policy section then failed, keeping its
    on_free subscribers (the SSD policy), so the restart can scan instead."""
    subscribers = index.on_free
    index.__init__()
    index.on_free = subscribers


def missing_from_policy(index: BlockIndex, policy: SegmentedPolicy) -> list[int]:
    """Rows of indexed SSD blocks the policy does not hold (none after a consistent stop)."""
    inside = policy._leaves._in
    on_ssd = index._flags.translate(_SSD_BIT)
    if _subset(on_ssd, inside):
        return []
    return [r for r, f in enumerate(on_ssd) if f and (r >= len(inside) or not inside[r])]
