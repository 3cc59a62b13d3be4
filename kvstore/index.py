"""The block index: where each block lives, its parent, size and checksum.

Keyed by global key (namespace id + block key) so one dict serves every namespace and no lookup
can reach another namespace's block. A key appears once per tier (dedup): an entry records
residency per tier rather than holding copies.

Why two forms: an SSD tier holds millions of blocks and a Python object per block costs about
twice the per-block budget (docs/internals.md, "Block index"). Every indexed block has
a *row* in packed arrays (size, checksum, parent, flags, child count) and one dict slot key ->
row;
only blocks with live state (a host or GPU copy, pins, a move in flight) or that were asked
for recently also have an `Entry` object ("hot"). `get()` hands out the block's Entry,
creating it from the row on first use, so callers keep reading and changing fields the way
they always did. A hot entry goes back to packed form ("freezes") only in `_sweep`, and only
when nothing but the index refers to it (`sys.getrefcount`): an entry held anywhere, in a
demotion batch, a Promotion, a local variable of a thread waiting for the lock, keeps its
identity, so code that re-checks `index.get(g) is e` after releasing the lock still sees
exactly what it would with one object per block. Rows stay fixed while a block is indexed,
so a policy may key its own arrays by row (kvstore/policies/packed_leaves.py).

Why lookups follow child links (`peek_run`): a lookup asks for a prompt's chain of blocks,
each the child of the one before. In a dict of a million keys every probe misses the CPU
cache (slot, entry, key object: three dependent loads each, ~0.3 us a key on this class of
machine), so the latency of a 16-key lookup grew by half from 10k to 1M blocks. Each row
remembers where its most recently indexed child's row is, in the spare bits of its flags
byte (no extra array: a separately grown array cost ~25 bytes a block of heap holes). A
chain's rows were indexed together (and rows freed leaf-first come back in order), so the
next key's row, key object and flags sit next to the last one's in memory (a row without a
link guesses the next row). The link is only a guess, checked by comparing keys: a stale or
missing one (row freed and reused, another child indexed since, child more than 31 rows on)
costs one dict probe, never a wrong answer.

Why each namespace keeps its rows (`_ns_rows`): Stats, SSD and remote quota checks and
Delete-all walk one tenant's namespaces under the store lock, and a scan of every row made
that cost grow with every other tenant's blocks (1,024 one-block namespaces against a 100k-row
index held the lock 5 s). A packed array of row numbers per namespace, and each row's place in
it for an O(1) swap-remove, costs 8 bytes a row (about 8.4 with array growth: ~8 MB at a
million rows; a dict of sets of row ints would cost ~70).

Why each namespace keeps running totals of its SSD and remote blocks (`tier_usage`) and a
count of its host copies (`host_blocks`): the SSD and remote quota checks run under the store
lock once per demotion batch, and a tenant's Stats once per call, and a walk of even one
tenant's blocks made each batch of a tenant with a million SSD blocks hold the lock for
0.1-0.3 s. Every change of a block's residency, or of whether it is indexed, already passes
through this class (set_host / clear_host, set_ssd / set_remote, add, add_cold, discard,
the bulk loads; a test checks that no other code assigns the fields), so each updates its
namespace's counts and bytes there: 40 bytes a namespace, nothing a row. A hot entry's own
fields rule while it has one and a packed row's flags otherwise, and packing and unpacking carry the
same fields across, so sweeps leave the totals as they are. A block's size never changes
while it is indexed. A detached copy from read() or entries() must never be passed to
set_ssd / set_remote (it is not the block: its change would count without being made).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Iterator, Sequence

from .entry import GPU, HOST, NS_ID_BYTES, REMOTE, SSD, Entry, ResidencyListener

# A namespace's slots in BlockIndex._tier_sums, from 4 * its number: SSD blocks, SSD bytes,
# remote blocks, remote bytes.
_SUMS = 4
_SSD_SLOT, _REMOTE_SLOT = 0, 2
_TIER_SLOT = {SSD: _SSD_SLOT, REMOTE: _REMOTE_SLOT}


class _Cold:
    """What lookup() reads of a block without an Entry: one shared, read-only object per
    combination of flags (no allocation on the lookup path)."""

    __slots__ = ("ssd", "remote")
    host = None
    gpu = None
    pins = 0
    gpu_pins = 0
    moving = None

    def __init__(self, ssd: bool, remote: bool) -> None:
        self.ssd = ssd
        self.remote = remote


# A row's flags byte: tier bits, _HOT, and in bits 3..7 the last child's row minus this row
# (1..31; 0 = no link), a guess that peek_run checks. _HOT is this process's state: anything
# that saves the flags and loads them back (an index image) must clear it (`f & ~_HOT`);
# readers treat a _HOT row without an Entry as packed.
_SSD, _REMOTE = 1, 2
_HOT = 4                        # the row's block has an Entry in _hot (its fields rule)
_STATE = 7                      # the bits above; the rest is the child link
_LINK_SHIFT, _LINK_MAX = 3, 31
_COLD = [_Cold(bool(f & _SSD), bool(f & _REMOTE)) for f in range(4)]
_REMOTE_PACKED = bytes(int(f & (_REMOTE | _HOT) == _REMOTE) for f in range(256))
_SWEEP_MIN = 4096               # hot entries beyond those found busy at the last sweep


def _tiers(e: Entry) -> int:
    """An entry's lower tiers as flag bits (_SSD, _REMOTE)."""
    return (_SSD if e.ssd else 0) | (_REMOTE if e.remote else 0)


def _refs(hot: dict[bytes, Entry], g: bytes) -> int:
    """References to hot[g] seen from here; compared with the same call on a probe entry that
    only a dict holds, so the baseline is this interpreter's own."""
    e = hot[g]
    return sys.getrefcount(e)


_probe = {b"": Entry(b"", b"", None, 0, 0)}
_ALONE = _refs(_probe, b"")
del _probe


class BlockIndex:
    def __init__(self) -> None:
        self._rows: dict[bytes, int] = {}           # every indexed gkey -> its row
        self._hot: dict[bytes, Entry] = {}          # gkeys that have an Entry now
        self._keys: list[bytes | None] = []         # row -> gkey (None: free row)
        self._parent: list[bytes | None] = []       # row -> parent gkey (packed rows)
        self._size = array("q")
        self._sum = array("Q")
        self._flags = bytearray()
        self._children = array("i")
        self._ns = array("H")                       # row -> namespace number
        self._ns_no: dict[bytes, int] = {}
        self._ns_ids: list[bytes] = []              # number -> ns_id (b"": a free number)
        self._ns_free: list[int] = []               # numbers of forgotten namespaces
        # Namespace number -> its rows (no order), row -> its place there (module docstring).
        self._ns_rows: list[array] = []
        self._ns_pos = array("i")
        # Namespace number -> its SSD and remote blocks and bytes (_SUMS slots each).
        self._tier_sums = array("q")
        # Namespace number -> its blocks with a host copy (host_blocks).
        self._host_n = array("q")
        self._free = array("i")
        self._sweep_at = _SWEEP_MIN
        # Parents named by indexed blocks but not indexed themselves: only a key in here can
        # close a cycle of parent links when it arrives, so only then is its ancestry walked.
        self._awaited: dict[bytes, int] = {}
        # Called with a row just before it is freed (a row-keyed policy forgets it).
        self.on_free: list[Callable[[int], None]] = []
        # Told of every residency change (see "residency" below); None: nobody listens.
        self.listener: ResidencyListener | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, gkey: bytes) -> bool:
        return gkey in self._rows

    # ------------------------------------------------------------------ rows
    def row(self, gkey: bytes) -> int | None:
        """The block's row (fixed while it stays indexed), None when not indexed."""
        return self._rows.get(gkey)

    def key_at(self, row: int) -> bytes:
        k = self._keys[row]
        assert k is not None, f"row {row} is free"
        return k

    def parent_key(self, row: int) -> bytes | None:
        """The parent gkey of the block at `row` (None for a first block)."""
        g = self._keys[row]
        e = self._hot.get(g) if g is not None else None
        return e.parent_gkey if e is not None else self._parent[row]

    def _new_row(self, g: bytes, ns_id: bytes) -> int:
        n = self._ns_no.get(ns_id)
        if n is None:
            n = self._number(ns_id)
        own = self._ns_rows[n]
        if self._free:
            r = self._free.pop()
            self._keys[r] = g
            self._ns[r] = n
            self._ns_pos[r] = len(own)
            own.append(r)
            return r
        r = len(self._keys)
        self._keys.append(g)
        self._parent.append(None)
        self._size.append(0)
        self._sum.append(0)
        self._flags.append(0)
        self._children.append(0)
        self._ns.append(n)
        self._ns_pos.append(len(own))
        own.append(r)
        return r

    def _number(self, ns_id: bytes) -> int:
        """A number for a namespace's first row: a forgotten namespace's, else a new one."""
        if self._ns_free:
            n = self._ns_free.pop()
            self._ns_ids[n] = ns_id
        else:
            n = len(self._ns_ids)
            self._ns_ids.append(ns_id)
            self._ns_rows.append(array("i"))
            self._tier_sums.extend((0,) * _SUMS)
            self._host_n.append(0)
        self._ns_no[ns_id] = n
        return n

    def holds(self, ns_id: bytes) -> int:
        """Blocks the namespace has in any tier (its rows)."""
        n = self._ns_no.get(ns_id)
        return 0 if n is None else len(self._ns_rows[n])

    def forget_namespace(self, ns_id: bytes) -> None:
        """Give a namespace's number back once it holds no block (the store reclaimed it).

        Why numbers are reused: rows keep theirs in 16 bits, and namespaces that come and go
        (each reclaimed when empty) would otherwise use up 65,536 numbers in a long run."""
        n = self._ns_no.get(ns_id)
        if n is None:
            return
        if self._ns_rows[n]:
            raise ValueError(f"namespace {ns_id.hex()} still holds {len(self._ns_rows[n])} "
                             "blocks")
        del self._ns_no[ns_id]
        self._ns_ids[n] = b""
        self._tier_sums[_SUMS * n:_SUMS * (n + 1)] = array("q", bytes(8 * _SUMS))
        self._host_n[n] = 0
        self._ns_free.append(n)

    def _free_row(self, r: int) -> None:
        for cb in self.on_free:
            cb(r)
        own, i = self._ns_rows[self._ns[r]], self._ns_pos[r]
        last = own.pop()
        if last != r:
            own[i] = last
            self._ns_pos[last] = i
        self._keys[r] = None
        self._parent[r] = None
        self._flags[r] = 0
        self._children[r] = 0
        self._free.append(r)

    def _tally(self, r: int, tiers: int, size: int, sign: int) -> None:
        """Count the block at row `r` into (sign 1) or out of (-1) its namespace's totals for
        `tiers` (_SSD, _REMOTE bits; 0: nothing)."""
        if tiers:
            t, i = self._tier_sums, _SUMS * self._ns[r]
            if tiers & _SSD:
                t[i + _SSD_SLOT] += sign
                t[i + _SSD_SLOT + 1] += sign * size
            if tiers & _REMOTE:
                t[i + _REMOTE_SLOT] += sign
                t[i + _REMOTE_SLOT + 1] += sign * size

    def _flip(self, r: int, slot: int, size: int, on: bool) -> None:
        """A block at row `r` entered (on) or left the tier at `slot` (_SSD_SLOT or
        _REMOTE_SLOT): _tally for one tier, kept apart because every demoted, promoted or
        evicted block passes through it."""
        t, i = self._tier_sums, _SUMS * self._ns[r] + slot
        if on:
            t[i] += 1
            t[i + 1] += size
        else:
            t[i] -= 1
            t[i + 1] -= size

    def _canonical(self, g: bytes | None) -> bytes | None:
        """The index's own key object for `g` when indexed (shared, not copied per child)."""
        if g is None:
            return None
        r = self._rows.get(g)
        return self._keys[r] if r is not None else g

    # ------------------------------------------------------------------ entries
    def get(self, gkey: bytes) -> Entry | None:
        """The block's Entry (the same object for as long as anyone holds it), or None."""
        e = self._hot.get(gkey)
        if e is not None:
            return e
        r = self._rows.get(gkey)
        if r is None:
            return None
        g = self._keys[r]
        assert g is not None
        e = self._thaw(g, r)
        self._hot[g] = e
        self._flags[r] |= _HOT
        if len(self._hot) > self._sweep_at:
            self._sweep()
        return e

    def peek(self, gkey: bytes) -> Entry | _Cold | None:
        """Read-only view for hot paths that only read residency (lookup): the Entry if there
        is one, else a shared object with the block's tier flags. Never change what it returns."""
        r = self._rows.get(gkey)
        if r is None:
            return None
        f = self._flags[r]
        e = self._hot.get(gkey) if f & _HOT else None
        return e if e is not None else _COLD[f & 3]

    def peek_run(self, ns_id: bytes, keys: Sequence[bytes]) -> list[Entry | _Cold]:
        """`peek()` of each of `keys` in turn, stopping before the first one not indexed.

        Tries each row's last-child link (or, without one, the next row) before asking the
        dict (module docstring: a prompt's chain is found where the previous key was, not by
        a cache miss per key)."""
        rows, names, flags, hot = self._rows, self._keys, self._flags, self._hot
        out: list[Entry | _Cold] = []
        end = len(names)
        r = -1
        f = 0
        for k in keys:
            g = ns_id + k
            c = r + ((f >> _LINK_SHIFT) or 1)
            if r >= 0 and c < end and names[c] == g:
                r = c
            else:
                r = rows.get(g, -1)
                if r < 0:
                    break
            f = flags[r]
            e = hot.get(g) if f & _HOT else None
            out.append(e if e is not None else _COLD[f & 3])
        return out

    def read(self, gkey: bytes) -> Entry | None:
        """The block's fields for a walk that only reads them (stats, quotas): its Entry, or a
        detached copy for a packed block, so a walk over every block does not unpack them
        all. Never change what it returns."""
        e = self._hot.get(gkey)
        if e is not None:
            return e
        r = self._rows.get(gkey)
        return None if r is None else self._thaw(gkey, r)

    def _thaw(self, g: bytes, r: int) -> Entry:
        pg = self._parent[r]
        f = self._flags[r]
        return Entry(g[:NS_ID_BYTES], g[NS_ID_BYTES:], pg[NS_ID_BYTES:] if pg else None,
                     self._size[r], self._sum[r], ssd=bool(f & _SSD), remote=bool(f & _REMOTE),
                     children=self._children[r], row=r)

    def _freeze(self, e: Entry) -> None:
        r = e.row
        self._parent[r] = self._canonical(e.parent_gkey)
        self._size[r] = e.size
        self._sum[r] = e.checksum
        self._flags[r] = (self._flags[r] & ~_STATE) | (_SSD if e.ssd else 0) | (
            _REMOTE if e.remote else 0)
        self._children[r] = e.children

    def _sweep(self) -> None:
        """Pack every hot entry that has no live state and that nobody else refers to."""
        hot = self._hot
        for g in list(hot):
            e = hot[g]
            idle = (e.host is None and e.gpu is None and not e.pins and not e.gpu_pins
                    and e.moving is None)
            del e
            if idle and _refs(hot, g) <= _ALONE:
                self._freeze(hot.pop(g))
        self._sweep_at = 2 * len(hot) + _SWEEP_MIN

    def compact(self) -> None:
        """Pack what can be packed now (after a bulk load, before measuring memory)."""
        self._sweep()

    # ------------------------------------------------------------------ residency
    # Every change of where a block lives goes through these methods (a test checks that no
    # other code assigns the fields): the one place a listener (KV events) hears of stores,
    # demotions, promotions, evictions and deletions. Each reports a change only (setting a
    # tier a block is already in reports nothing); without a listener each costs one test.

    def set_host(self, e: Entry, offset: int) -> None:
        was = e.host
        e.host = offset
        if was is None:
            if e.row >= 0:
                self._host_n[self._ns[e.row]] += 1
            if self.listener is not None:
                self.listener.changed(e, HOST, True)

    def add_host_many(self, entries: Sequence[Entry], offsets: Sequence[int]) -> None:
        """add() then set_host() for each of a batch of new blocks (none indexed, none
        resident yet), in order; the listener hears the batch in one changed_many call, the
        same changes in the same order as one block at a time. Why: a commit publishes its
        blocks together, and a listener call per block was a visible share of its cost."""
        rows, hot, flags, awaited = self._rows, self._hot, self._flags, self._awaited
        for e, off in zip(entries, offsets, strict=True):
            # add(), inlined (its per-call cost was a third of a commit's index pass); the
            # sweep runs once after the batch, when every entry holds its host copy.
            g = e.ns_id + e.key
            if g in rows:
                self.discard(g)
            if e.parent and g in awaited and self._reaches(e.parent_gkey, g):
                e.parent = None
            r = e.row = self._new_row(g, e.ns_id)
            rows[g] = r
            hot[g] = e
            flags[r] = _HOT
            e.children = awaited.pop(g, 0) if awaited else 0
            if e.parent:
                self._link(e.ns_id + e.parent, 1, r)
            if e.ssd or e.remote:
                self._tally(r, _tiers(e), e.size, 1)
            e.host = off
            self._host_n[self._ns[r]] += 1
        if len(hot) > self._sweep_at:
            self._sweep()
        listener = self.listener
        if listener is None or not entries:
            return
        many = getattr(listener, "changed_many", None)
        if many is not None:
            many(entries, HOST, True)
        else:
            for e in entries:
                listener.changed(e, HOST, True)

    def clear_host(self, e: Entry) -> None:
        if e.host is not None:
            e.host = None
            if e.row >= 0:
                self._host_n[self._ns[e.row]] -= 1
            if self.listener is not None:
                self.listener.changed(e, HOST, False)

    def set_gpu(self, e: Entry, offset: int, device: int) -> None:
        was = e.gpu
        e.gpu, e.gpu_dev = offset, device
        if was is None and self.listener is not None:
            self.listener.changed(e, GPU, True)

    def clear_gpu(self, e: Entry) -> None:
        if e.gpu is not None:
            e.gpu = None
            if self.listener is not None:
                self.listener.changed(e, GPU, False)

    def set_ssd(self, e: Entry, on: bool = True) -> None:
        if e.ssd != on:
            e.ssd = on
            if e.row >= 0:          # indexed (discard sets -1): its namespace's totals
                self._flip(e.row, _SSD_SLOT, e.size, on)
            if self.listener is not None:
                self.listener.changed(e, SSD, on)

    def set_remote(self, e: Entry, on: bool = True) -> None:
        if e.remote != on:
            e.remote = on
            if e.row >= 0:
                self._flip(e.row, _REMOTE_SLOT, e.size, on)
            if self.listener is not None:
                self.listener.changed(e, REMOTE, on)

    def drop_if_gone(self, e: Entry) -> bool:
        """Discard a block no tier holds any more; True when it was discarded."""
        if e.resident:
            return False
        self.discard(e.gkey)
        return True

    # ------------------------------------------------------------------ changes
    def add(self, entry: Entry) -> None:
        g = entry.gkey
        if g in self._rows:
            self.discard(g)
        if entry.parent and g in self._awaited and self._reaches(entry.parent_gkey, g):
            entry.parent = None     # a client-given parent that would close a cycle is dropped
        entry.row = self._new_row(g, entry.ns_id)
        self._rows[g] = entry.row
        self._hot[g] = entry
        self._flags[entry.row] = _HOT
        entry.children = self._awaited.pop(g, 0)
        self._link(entry.parent_gkey, 1, entry.row)
        self._tally(entry.row, _tiers(entry), entry.size, 1)
        if entry.host is not None:
            self._host_n[self._ns[entry.row]] += 1
        if self.listener is not None and entry.resident:
            for tier, on in ((GPU, entry.gpu is not None), (HOST, entry.host is not None),
                             (SSD, entry.ssd), (REMOTE, entry.remote)):
                if on:
                    self.listener.changed(entry, tier, True)
        if len(self._hot) > self._sweep_at:
            self._sweep()

    def add_cold(self, ns_id: bytes, key: bytes, parent: bytes | None, size: int,
                 checksum: int, ssd: bool = False, remote: bool = False) -> None:
        """Index a block straight into packed form (warm restart: no Entry per block). Adding
        parents before children, as `Store._rebuild` does, never walks an ancestry. A bulk
        load tells no listener: one attaches after it and takes what is held as a whole."""
        assert self.listener is None, "bulk loads run before a residency listener attaches"
        g = ns_id + key
        if g in self._rows:
            self.discard(g)
        pg = ns_id + parent if parent else None
        if pg is not None and g in self._awaited and self._reaches(pg, g):
            pg = None
        r = self._new_row(g, ns_id)
        self._rows[g] = r
        self._parent[r] = self._canonical(pg)
        self._size[r] = size
        self._sum[r] = checksum
        self._flags[r] = (_SSD if ssd else 0) | (_REMOTE if remote else 0)
        self._tally(r, self._flags[r], size, 1)
        self._children[r] = self._awaited.pop(g, 0)
        self._link(pg, 1, r)

    def load_ssd(self, items: list[tuple[bytes, bytes | None, int, int]]) -> None:
        """Bulk `add_cold(..., ssd=True)` into an empty index (warm restart): `items` are
        (gkey, parent gkey or None, size, checksum), parents before children. A parent that
        comes after its child can only close a cycle (parents-first order puts every other
        parent first) and is dropped, as add() would."""
        assert not self._rows and not self._keys, "load_ssd() fills an empty index only"
        assert self.listener is None, "bulk loads run before a residency listener attaches"
        n = len(items)
        keys = [it[0] for it in items]
        rows = dict(zip(keys, range(n), strict=True))
        if len(rows) != n:                  # repeated keys: take the careful path
            for g, pg, size, checksum in items:
                ns = g[:NS_ID_BYTES]
                self.add_cold(ns, g[NS_ID_BYTES:], pg[NS_ID_BYTES:] if pg else None, size,
                              checksum, ssd=True)
            return
        parents: list[bytes | None] = []
        children = array("i", bytes(4 * n))
        flags = bytearray([_SSD]) * n
        awaited = self._awaited
        for r, it in enumerate(items):
            pg = it[1]
            if pg is not None:
                p = rows.get(pg)
                if p is None:
                    awaited[pg] = awaited.get(pg, 0) + 1
                elif p < r:
                    children[p] += 1
                    if r - p <= _LINK_MAX:
                        flags[p] = _SSD | (r - p) << _LINK_SHIFT
                    pg = keys[p]            # the parent's own key object, not a copy
                else:
                    pg = None
            parents.append(pg)
        self._rows = rows
        self._keys = keys
        self._parent = parents
        self._size = array("q", [it[2] for it in items])
        self._sum = array("Q", [it[3] for it in items])
        self._flags = flags
        self._children = children
        ns_no, ns_ids = self._ns_no, self._ns_ids
        nums = []
        for g in keys:
            ns = g[:NS_ID_BYTES]
            k = ns_no.get(ns)
            if k is None:
                k = ns_no[ns] = len(ns_ids)
                ns_ids.append(ns)
            nums.append(k)
        self._ns = array("H", nums)
        self.rebuild_namespace_rows()

    def rebuild_namespace_rows(self) -> None:
        """Each namespace's rows and SSD and remote totals from the row arrays, after a bulk
        load set them directly (load_ssd, an index image): rows ascending within a namespace."""
        own: list[list[int]] = [[] for _ in self._ns_ids]
        pos = array("i", bytes(4 * len(self._keys)))
        ns = self._ns
        for r, g in enumerate(self._keys):
            if g is not None:
                rows = own[ns[r]]
                pos[r] = len(rows)
                rows.append(r)
        self._ns_rows = [array("i", rows) for rows in own]
        self._ns_pos = pos
        flags, size, keys, hot = self._flags, self._size, self._keys, self._hot
        sums = self._tier_sums = array("q", bytes(8 * _SUMS * len(own)))
        for n, rows in enumerate(own):
            if hot:                 # hot entries' own fields rule: counted below
                rows = [r for r in rows if not (flags[r] & _HOT and keys[r] in hot)]
            ssd = [size[r] for r in rows if flags[r] & _SSD]
            remote = [size[r] for r in rows if flags[r] & _REMOTE]
            sums[_SUMS * n:_SUMS * (n + 1)] = array("q", (len(ssd), sum(ssd), len(remote),
                                                          sum(remote)))
        self._host_n = array("q", bytes(8 * len(own)))
        for e in hot.values():
            self._tally(e.row, _tiers(e), e.size, 1)
            if e.host is not None:
                self._host_n[ns[e.row]] += 1

    def _link(self, p: bytes | None, delta: int, child: int = -1) -> None:
        """Count a child in (delta 1) or out (-1) of parent `p`, indexed or awaited; a child
        counted in at row `child` becomes the parent's last-child link."""
        if p is None:
            return
        if (e := self._hot.get(p)) is not None:
            e.children += delta
            if child >= 0:
                self._set_link(e.row, child)
        elif (r := self._rows.get(p)) is not None:
            self._children[r] += delta
            if child >= 0:
                self._set_link(r, child)
        elif delta > 0:
            self._awaited[p] = self._awaited.get(p, 0) + 1
        elif (n := self._awaited.get(p, 0)) > 1:
            self._awaited[p] = n - 1
        else:
            self._awaited.pop(p, None)

    def _set_link(self, r: int, child: int) -> None:
        """Make `child` row `r`'s last-child link when it is near enough to encode."""
        d = child - r
        if 0 < d <= _LINK_MAX:
            self._flags[r] = (self._flags[r] & _STATE) | d << _LINK_SHIFT

    def _parent_of(self, g: bytes) -> bytes | None:
        e = self._hot.get(g)
        if e is not None:
            return e.parent_gkey
        r = self._rows.get(g)
        return None if r is None else self._parent[r]

    def _reaches(self, start: bytes | None, target: bytes) -> bool:
        """Whether walking parent links up from `start` arrives at `target` (a cycle)."""
        seen = 0
        while start is not None and seen <= len(self._rows):
            if start == target:
                return True
            start = self._parent_of(start)
            seen += 1
        return False

    def recount_children(self) -> None:
        """Child counts after a bulk load in arbitrary order."""
        self._awaited.clear()
        for e in self._hot.values():
            e.children = 0
        for r, g in enumerate(self._keys):
            if g is not None and g not in self._hot:
                self._children[r] = 0
        for r, g in enumerate(self._keys):
            if g is not None:
                self._link(self._parent_of(g), 1, r)

    def set_parent(self, entry: Entry, parent: bytes | None) -> None:
        """Fill in a parent learned late (a block first seen without one)."""
        if entry.parent or not parent or self._reaches(entry.ns_id + parent, entry.gkey):
            return
        entry.parent = parent
        self._link(entry.parent_gkey, 1, entry.row)

    def discard(self, gkey: bytes) -> None:
        """Forget a block, whatever tiers it is still in (each is reported left)."""
        r = self._rows.pop(gkey, None)
        if r is None:
            return
        e = self._hot.pop(gkey, None)
        if self.listener is not None:
            gone = e if e is not None else self._thaw(gkey, r)
            if gone.resident:
                self.listener.discarded(gone)
        p = e.parent_gkey if e is not None else self._parent[r]
        self._link(p, -1)
        # Children still indexed wait for this block again, as children stored before their
        # parent do: a parent dropped while a child regained a copy (an SSD eviction batch
        # that took both while the child was stored again) is counted right when re-stored.
        n = e.children if e is not None else self._children[r]
        if n > 0:
            self._awaited[gkey] = n
        if e is not None:
            self._tally(r, _tiers(e), e.size, -1)
            if e.host is not None:
                self._host_n[self._ns[r]] -= 1
        elif tiers := self._flags[r] & (_SSD | _REMOTE):
            self._tally(r, tiers, self._size[r], -1)
        self._free_row(r)
        if e is not None:
            e.row = -1

    # ------------------------------------------------------------------ walks
    def namespace_keys(self, ns_id: bytes) -> list[bytes]:
        """The namespace's keys, in no set order, found through its own rows: the cost is
        its blocks, however many other namespaces hold (a tenant's walk under the lock must
        not grow with other tenants' data)."""
        n = self._ns_no.get(ns_id)
        if n is None:
            return []
        keys = self._keys
        return [keys[r] for r in self._ns_rows[n]]

    def namespace_residency(self, ns_id: bytes) -> Iterator[tuple[bool, bool, bool, int]]:
        """(host copy, ssd, remote, size) of each of the namespace's blocks, as `residency`
        but through the namespace's own rows and without an Entry per packed block (Stats
        and quota checks of one tenant, under the store lock)."""
        n = self._ns_no.get(ns_id)
        if n is None:
            return
        keys, hot, flags, size = self._keys, self._hot, self._flags, self._size
        for r in self._ns_rows[n]:
            f = flags[r]
            e = hot.get(keys[r]) if f & _HOT else None
            if e is not None:
                yield e.host is not None, e.ssd, e.remote, e.size
            else:
                yield False, bool(f & _SSD), bool(f & _REMOTE), size[r]

    def tier_usage(self, ns_id: bytes, tier: str) -> tuple[int, int]:
        """(blocks, raw bytes) the namespace holds in `tier` ("ssd" or "remote"), from its
        running totals: no walk (module docstring), so a quota check under the store lock
        costs the same at a million blocks as at one."""
        n = self._ns_no.get(ns_id)
        if n is None:
            return 0, 0
        i = _SUMS * n + _TIER_SLOT[tier]
        return self._tier_sums[i], self._tier_sums[i + 1]

    def host_blocks(self, ns_id: bytes) -> int:
        """The namespace's blocks with a host copy, from its running count: no walk (a
        tenant's Stats, under the store lock, cost a walk of every block it held)."""
        n = self._ns_no.get(ns_id)
        return 0 if n is None else self._host_n[n]

    def tier_total(self, tier: str) -> tuple[int, int]:
        """(blocks, raw bytes) of every namespace in `tier` ("ssd" or "remote"): a sum over
        the namespaces' running totals, not over blocks."""
        i = _TIER_SLOT[tier]
        return sum(self._tier_sums[i::_SUMS]), sum(self._tier_sums[i + 1::_SUMS])

    def entries(self) -> Iterator[Entry]:
        """Every block: the hot ones as their Entry, the packed ones as detached copies (read
        them; change a block only through get())."""
        hot = list(self._hot.values())
        cold = [(r, g) for r, g in enumerate(self._keys) if g is not None and g not in self._hot]
        yield from hot
        for r, g in cold:
            yield self._thaw(g, r)

    def hot_entries(self) -> list[Entry]:
        """The blocks that have an Entry: every block with a host or GPU copy, pins or a move
        in flight is among them (a packed block has none of those), so a walk for such blocks
        (flush, GPU write-down) need not look at the packed rows."""
        return list(self._hot.values())

    def residency(self, start: int = 0, stop: int | None = None
                  ) -> Iterator[tuple[bytes, bool, bool, bool, int]]:
        """(ns_id, host copy, ssd, remote, size) of every block in rows start..stop, without
        making an Entry for the packed ones. Per-tenant usage (kvstore/tenant_metrics.py)
        walks the rows a slice at a time, each under the store lock, not all under it."""
        hot = self._hot
        ns_ids, ns, flags, size = self._ns_ids, self._ns, self._flags, self._size
        for r, g in enumerate(self._keys[start:stop], start):
            if g is None:
                continue
            e = hot.get(g)
            if e is not None:
                yield e.ns_id, e.host is not None, e.ssd, e.remote, e.size
            else:
                f = flags[r]
                yield ns_ids[ns[r]], False, bool(f & _SSD), bool(f & _REMOTE), size[r]

    @property
    def rows(self) -> int:
        """Rows in use or free: residency's range."""
        return len(self._keys)

    def held(self, start: int, count: int) -> tuple[int, list[tuple[bytes, bool, bool, bool]]]:
        """(gkey, gpu copy, host copy, ssd) of the blocks in rows [start, start + count), and
        the row to go on from (-1: done). For a walk in slices, each under the store lock
        (KV events re-announce what is held without stopping the store for the whole walk)."""
        keys, hot, flags = self._keys, self._hot, self._flags
        end = min(start + count, len(keys))
        out = []
        for r in range(start, end):
            g = keys[r]
            if g is None:
                continue
            e = hot.get(g)
            if e is not None:
                out.append((g, e.gpu is not None, e.host is not None, e.ssd))
            else:
                out.append((g, False, False, bool(flags[r] & _SSD)))
        return (end if end < len(keys) else -1), out

    def remote_count(self) -> int:
        """Blocks with a remote copy, counted from the packed flags (Stats calls it)."""
        n = self._flags.translate(_REMOTE_PACKED).count(1)        # packed rows only
        return n + sum(e.remote for e in self._hot.values())      # hot rows carry _HOT

    @property
    def hot_count(self) -> int:
        """Blocks that have an Entry object right now."""
        return len(self._hot)
