"""The residency listener: each change of a published block, queued under the store lock.

Everything here runs inside a store call holding the store lock, so it does the least it can:
a namespace lookup (cached), a tuple appended to a deque, and the book of token texts kept in
step (texts of blocks with a host or gpu copy; an SSD copy keeps its text in its LMDB meta).
A commit's new blocks are one queued record (CommitRun), not one per block, and their book
entries are made off the commit (flush(): by the publisher thread, or by the first reader of
the book, whichever comes first). Encoding and sending are the publisher thread's
(publisher.py). The queue is bounded: when the publisher
falls max_queue changes behind, new changes are dropped until it starts every stream over from
what the daemon holds; a store never waits for it.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from fnmatch import fnmatchcase
from typing import Any, NamedTuple

from ..entry import GPU, HOST, REMOTE, SSD, Entry
from .texts import OWN, BlockText, LazyTexts, kind_of

GONE_KEPT = 4096        # reclaimed namespaces whose answer is kept (Recorder._gone)


class CommitRun(NamedTuple):
    """All the blocks of one commit entering a tier, in order, as one queued record: the
    changes changed() would queue for each, whose texts are the commit's LazyTexts. Why: one
    item per block cost the store path a tuple, a book lookup and a key each, and the
    publisher a look at each (its fields 0-4 line up with a change's, so the publisher's
    per-field views of the queue stay valid: its text is no LazyText, so no run of single
    changes continues through it)."""

    gkey: bytes                 # the first block's
    tiers: tuple[str, ...]
    entered: bool               # True
    gone: bool                  # False
    text: LazyTexts             # block i's text is text.text(i)
    n: int                      # how many blocks (changes) it stands for


# A queued change: (gkey, tiers, entered, gone, text), or a CommitRun of many. `gone`: the
# block holds no published tier any more (the publisher forgets what it kept for it); `text`:
# its text when known then.
Item = tuple[bytes, tuple[str, ...], bool, bool, BlockText | None] | CommitRun


class Recorder:
    def __init__(self, namespaces: dict[bytes, Any], stream_models: list[list[str]],
                 max_queue: int, ssd_text: Callable[[bytes], BlockText | None]) -> None:
        self.namespaces = namespaces            # the store's: ns_id -> NamespaceInfo
        self.ssd_text = ssd_text                # a block's text from its SSD meta, or None
        self.stream_models = stream_models      # per stream: fnmatch patterns ([] = all)
        self.max_queue = max_queue
        self.queue: deque[Item] = deque()
        # Changes queued in all (a CommitRun counts its blocks) and taken by the publisher:
        # each written by one thread only (queued under the store lock, taken by the
        # publisher), so their difference, the backlog max_queue bounds, needs no lock.
        self.queued = 0
        self.taken = 0
        # gkey -> text. Every reader under the lock calls flush() first (changed, discarded,
        # Events.book); the publisher reads it unlocked only for blocks no unkept commit holds
        # (those reach it as CommitRuns, or through a start-over, which flushes first).
        self.book: dict[bytes, BlockText] = {}
        # Commits remember() took whose book entries are not made yet: (ns_id, keys,
        # LazyTexts), oldest first. Why: filling the book cost a commit of 256 blocks ~50 us
        # under the lock (a key, a LazyText and a dict slot each), on the store's path.
        self.unkept: list[tuple[bytes, list[bytes], LazyTexts]] = []
        # The commit remember() just took (ns_id, keys, LazyTexts), for the changed_many call
        # that publishes its blocks next under the same hold of the lock; any other change
        # forgets it (it may have touched the book).
        self._fresh: tuple[bytes, list[bytes], LazyTexts] | None = None
        self.overflowed = False                 # set here, cleared by the publisher (locked)
        self.overflows = 0
        self._ns: dict[bytes, tuple[str, int]] = {}
        # The answers of namespaces reclaimed lately, oldest first, at most GONE_KEPT: a
        # removal recorded before its namespace was reclaimed is published after, and must
        # still reach the streams that saw the block stored (a router would keep it).
        self._gone: OrderedDict[bytes, tuple[str, int]] = OrderedDict()
        # Whether the publisher was woken since it last cleared this (it clears it before
        # draining): one wake-up (a byte to a pipe) per batch of changes, not per change.
        self.woken = False
        self.wake: Callable[[], None] = _no_wake

    def ns(self, ns_id: bytes) -> tuple[str, int]:
        """(kind of keys, bit mask of the streams that publish it; 0: none) of a namespace.
        Only shard rank 0 of a sharded namespace is published: every rank stores the same
        keys, and the group can load a block only as a whole."""
        got = self._ns.get(ns_id)
        if got is None:
            info = self.namespaces.get(ns_id)
            if info is None:
                return self._gone.get(ns_id, (OWN, 0))
            spec = info.spec
            mask = 0
            if spec.shard_rank == 0:
                for i, pats in enumerate(self.stream_models):
                    if not pats or any(fnmatchcase(spec.model, p) for p in pats):
                        mask |= 1 << i
            got = self._ns[ns_id] = (kind_of(spec.hash_scheme), mask)
        return got

    def forget_namespace(self, ns_id: bytes) -> None:
        """Move the answer of a namespace about to be reclaimed (still registered: locked)
        from the cache to the bounded list of gone ones: namespaces come and go, and the
        cache must not keep every one ever seen."""
        got = self.ns(ns_id)
        self._ns.pop(ns_id, None)
        gone = self._gone
        gone[ns_id] = got
        gone.move_to_end(ns_id)
        while len(gone) > GONE_KEPT:
            gone.popitem(last=False)

    def wants_tokens(self, ns_id: bytes) -> bool:
        kind, mask = self.ns(ns_id)
        return bool(mask) and kind == OWN

    def remember(self, ns_id: bytes, keys: list[bytes], texts: Sequence[Any]) -> None:
        """Texts of blocks a commit is about to publish (locked). A commit's LazyTexts, for
        the keys it was made with, waits in `unkept` for flush() (no work per block here)."""
        if type(texts) is LazyTexts and len(texts) == len(keys):
            self.unkept.append((ns_id, keys, texts))
            self._fresh = (ns_id, keys, texts)
            return
        self._fresh = None
        if self.unkept:
            self.flush()
        book = self.book
        for k, t in zip(keys, texts, strict=True):
            book[ns_id + k] = t

    def flush(self) -> None:
        """Make the book entries of the commits remember() took (locked), in their order:
        one pass in C per commit."""
        unkept, self.unkept = self.unkept, []
        book = self.book
        for ns_id, keys, texts in unkept:
            texts.keep(book, ns_id, keys)

    # -- ResidencyListener ---------------------------------------------------------------
    def changed(self, e: Entry, tier: str, entered: bool) -> None:
        # (Inlined lookups: this runs for every block of every store, under the store lock.)
        if tier == REMOTE:
            return              # a Redis-only block is announced by no node (docs/routing.md)
        self._fresh = None
        if self.unkept:
            self.flush()
        got = self._ns.get(e.ns_id)
        if not (got if got is not None else self.ns(e.ns_id))[1]:
            return
        g = e.ns_id + e.key
        if entered:
            text = self.book.get(g)
            if text is None and tier != SSD and e.ssd:
                # Promoted from SSD: its text comes back from its meta, to stay with the new
                # copy (the SSD copy may be evicted before the publisher reads it, and a later
                # demotion writes the book's text into the new meta).
                text = self.ssd_text(g)
                if text is not None:
                    self.book[g] = text
            item: Item = (g, (tier,), True, False, text)
        else:
            fast = e.host is not None or e.gpu is not None
            if not fast:
                self.book.pop(g, None)
            item = (g, (tier,), False, not (fast or e.ssd), None)
        if self.overflowed:
            return
        if self.queued - self.taken >= self.max_queue:
            self._overflow()
            return
        self.queue.append(item)
        self.queued += 1
        if not self.woken:
            self.woken = True
            self.wake()

    def changed_many(self, entries: Sequence[Entry], tier: str, entered: bool) -> None:
        """changed() for each entry, in order, in one call: a commit's blocks (locked). Why:
        per block, the call and its checks were most of what events cost a store. The blocks
        of the commit remember() just took, all new, are queued as one CommitRun."""
        if tier == REMOTE or not entered or not entries:
            for e in entries:
                self.changed(e, tier, entered)
            return
        fresh, self._fresh = self._fresh, None
        if fresh is not None and self._commit_run(fresh, entries, tier):
            return
        if self.unkept:
            self.flush()
        book, cache = self.book, self._ns
        tiers = (tier,)         # one tuple for the batch (the publisher compares them in runs)
        items: list[Item] = []
        last: bytes | None = None
        publish = False
        for e in entries:
            ns_id = e.ns_id
            if ns_id is not last:
                got = cache.get(ns_id)
                publish = bool((got if got is not None else self.ns(ns_id))[1])
                last = ns_id
            if not publish:
                continue
            g = ns_id + e.key
            text = book.get(g)
            if text is None and tier != SSD and e.ssd:     # promoted from SSD: as changed()
                text = self.ssd_text(g)
                if text is not None:
                    book[g] = text
            items.append((g, tiers, True, False, text))
        self._put_many(items)

    def _commit_run(self, fresh: tuple[bytes, list[bytes], LazyTexts],
                    entries: Sequence[Entry], tier: str) -> bool:
        """Queue `entries` as one CommitRun when they are exactly the blocks of the commit
        remember() took, in order, none with an SSD copy (so each one's text is its book
        entry, as changed() would find it); False to have them queued one by one. Why the
        ends are enough: `fresh` survives only from remember() to the next listener call, and
        in that span only the commit's own publish of new blocks (index.add_host_many, which
        makes an entry of each key in order, none on SSD) reaches this; a per-block check
        cost the store path ~12 us a commit of 256."""
        ns_id, keys, texts = fresh
        n = len(entries)
        if n != len(keys) or not n:
            return False
        first, last = entries[0], entries[-1]
        if (first.key != keys[0] or last.key != keys[-1] or first.ns_id != ns_id
                or last.ns_id != ns_id or first.ssd or last.ssd):
            return False
        got = self._ns.get(ns_id)
        if not (got if got is not None else self.ns(ns_id))[1]:
            return True                 # not published: nothing to queue, as changed()
        if self.overflowed:
            return True
        if self.queued - self.taken + n > self.max_queue:
            self._overflow()
            return True
        self.queue.append(CommitRun(ns_id + keys[0], (tier,), True, False, texts, n))
        self.queued += n
        if not self.woken:
            self.woken = True
            self.wake()
        return True

    def discarded(self, e: Entry) -> None:
        # (Inlined lookups and a table of the tier tuples: a delete calls this for each of its
        # blocks under the store lock, and a generator per block was most of its cost.)
        self._fresh = None
        if self.unkept:
            self.flush()
        ns_id = e.ns_id
        got = self._ns.get(ns_id)
        if not (got if got is not None else self.ns(ns_id))[1]:
            return
        g = ns_id + e.key
        self.book.pop(g, None)
        tiers = _TIERS[(e.gpu is not None) << 2 | (e.host is not None) << 1 | bool(e.ssd)]
        if tiers:
            self._put((g, tiers, False, True, None))

    def _put(self, item: Item) -> None:
        if self.overflowed:
            return
        if self.queued - self.taken >= self.max_queue:
            self._overflow()
            return
        self.queue.append(item)
        self.queued += 1
        if not self.woken:
            self.woken = True
            self.wake()

    def _put_many(self, items: list[Item]) -> None:
        """_put() for each item, in order: those that fit the queue, then an overflow."""
        if not items or self.overflowed:
            return
        room = self.max_queue - (self.queued - self.taken)
        if len(items) > room:
            if room > 0:
                self.queue.extend(items[:room])
                self.queued += room
            self._overflow()
            return
        self.queue.extend(items)
        self.queued += len(items)
        if not self.woken:
            self.woken = True
            self.wake()

    def _overflow(self) -> None:
        self.overflowed = True
        self.overflows += 1
        self.woken = True
        self.wake()                     # the publisher starts every stream over


def _no_wake() -> None:
    pass


# The tiers a discarded block still holds, by (gpu, host, ssd) as bits 2, 1, 0; in the order
# its events go out (gpu first).
_TIERS: tuple[tuple[str, ...], ...] = tuple(
    tuple(t for t, bit in ((GPU, 4), (HOST, 2), (SSD, 1)) if bits & bit) for bits in range(8))
