"""Lookups: which tiers hold a prefix, or each key, without pinning or moving anything.

Lookup is the hot path (one call per engine request): one hold of the lock, read-only views
of the index (`peek_run` makes no Entry for a packed block), and for the remote tier, which no
index can know fully (another node may have written a block), one batched existence check
after the lock is released.

What the hit and miss counts mean (`tier_counters` hits/misses, `lookup_blocks`,
`lookup_hit_blocks`; the operator's hit rate): of the blocks engines asked for to load, how
many were cached. So they count a Lookup or LookupAcquire (a prefix: each tier's resident
prefix is its hits) and a Locate (every key on its own: the keys resident in a tier are its
hits; the vLLM and SGLang adapters look up this way), and not the lookup a store makes of the
prefix it need not write (LookupReserve, a Lookup marked `for_store`): counted, every store of
new blocks added its blocks as misses, and an engine that only loaded through Locate showed a
hit rate of 0. A store's lookups are counted in `store_lookups` only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .index import Entry
from .moves.host_remote import HostRemote
from .state import StoreState

REMOTE_LOCATE_KEYS = 4096   # keys one Locate asks the remote tier about (where)


@dataclass
class LookupResult:
    prefix_blocks: int
    per_tier: dict[str, int] = field(default_factory=dict)


class Queries:
    def __init__(self, state: StoreState, remote: HostRemote | None) -> None:
        self.state = state
        self.remote = remote

    def lookup(self, ns_id: bytes, keys: list[bytes], counted: bool = True) -> LookupResult:
        """The longest cached prefix of `keys` (checked by the store), overall and per tier;
        `counted`: in the hit and miss counts (module docstring)."""
        st = self.state
        with st.lock:
            st.check_open()
            st.namespace(ns_id)
            # Plain locals, no per-key tuples.
            n = h = d = r = gg = 0
            run_h = run_d = run_r = run_g = True
            # read-only views, no Entry made for a packed block; stops at the first unindexed
            for e in st.index.peek_run(ns_id, keys):
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
            per = self._per_tier(h, gg, d, r)
            if counted:
                st.counters["lookups"] += 1
                self._count(len(keys), n, per)
            else:
                st.counters["store_lookups"] += 1
            for k in keys[n:n + 1]:
                for p in st.policies.values():
                    rec = getattr(p, "record_miss", None)
                    if rec is not None:
                        rec(ns_id + k)
        if self.remote is not None and n < len(keys):
            extra = self.remote.extend(ns_id, keys, n)
            if run_r:
                per["remote"] += extra
            n += extra
        return LookupResult(n, per)

    def where(self, ns_id: bytes, keys: list[bytes]) -> list[str | None]:
        """The fastest tier holding each key, or None; every key on its own, not a prefix.

        For engines that look blocks up one by one (vLLM's tiered offloading). Keys no local
        tier holds are asked of the remote tier in one round trip.
        """
        st = self.state
        out: list[str | None] = []
        h = gg = d = r = 0                  # keys resident in each tier (module docstring)
        with st.lock:
            st.check_open()
            info = st.namespace(ns_id)
            get = st.index.get
            for k in keys:
                e = get(ns_id + k)
                if e is None:
                    out.append(None)
                    continue
                on_h, on_g = e.host is not None, e.gpu is not None
                h, gg, d, r = h + on_h, gg + on_g, d + e.ssd, r + e.remote
                # host before gpu: Locate's readers load from host, and a gpu-only block is
                # one a prefetch copies down (kvstore/moves/gpu_host.py)
                out.append("host" if on_h else "gpu" if on_g else "ssd" if e.ssd
                           else "remote" if e.remote else None)
            st.counters["locate_blocks"] += len(keys)
            # At most REMOTE_LOCATE_KEYS asked of Redis per call (the rest answer None, as for
            # a key nobody holds): one pipeline of 65,536 made-up keys cost the daemon about
            # half a second of CPU, and its late answer marked Redis down for every tenant.
            missing = ([i for i, t in enumerate(out) if t is None][:REMOTE_LOCATE_KEYS]
                       if st.remote is not None else [])
            if not missing:                 # counted now: no second hold of the lock
                self._count_located(keys, out, h, gg, d, r)
        if missing:
            asked = [ns_id + keys[i] for i in missing]
            found = st.remote.exists_many(asked)
            if self.remote is not None:         # a delete Redis has not had yet: absent
                found = self.remote.not_deleted(asked, found)
            with st.lock:
                for i, hit in zip(missing, found, strict=True):
                    if not hit:
                        continue
                    e = st.index.get(ns_id + keys[i])
                    if e is None:
                        e = Entry(ns_id, keys[i], None, info.block_bytes, 0)
                        st.index.add(e)
                    st.index.set_remote(e)
                    out[i] = "remote"
                    r += 1
                self._count_located(keys, out, h, gg, d, r)
        return out

    def _count_located(self, keys: list[bytes], out: list[str | None], h: int, gg: int,
                       d: int, r: int) -> None:
        """A Locate's hits and misses (locked): per tier the keys resident there, overall the
        keys found anywhere (module docstring)."""
        self._count(len(keys), len(keys) - out.count(None), self._per_tier(h, gg, d, r))

    def _per_tier(self, h: int, gg: int, d: int, r: int) -> dict[str, int]:
        """The tiers this store has, each with its count."""
        st = self.state
        per = {"host": h}
        if st.gpu:
            per["gpu"] = gg
        if st.ssd is not None:
            per["ssd"] = d
        if st.remote is not None:
            per["remote"] = r
        return per

    def _count(self, asked: int, hit: int, per: dict[str, int]) -> None:
        """One load's lookup in the hit and miss counts (locked): `hit` of `asked` keys found
        in any tier, `per` tier's hits (its misses are the rest)."""
        st = self.state
        st.counters["lookup_blocks"] += asked
        st.counters["lookup_hit_blocks"] += hit
        for t, c in per.items():
            st.tier_counters[t]["hits"] += c
            st.tier_counters[t]["misses"] += asked - c
