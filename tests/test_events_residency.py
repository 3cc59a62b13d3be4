"""The residency seam: every change of where a block lives goes through BlockIndex's residency
methods, which tell one listener. KV events depend on it: a change made by assigning an
Entry's fields directly would never be published."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from kvstore_client import KVLayout, NamespaceSpec

from kvstore.events.recorder import CommitRun, Recorder
from kvstore.events.texts import LazyTexts
from kvstore.index import GPU, HOST, REMOTE, SSD, BlockIndex, Entry
from kvstore.state import NamespaceInfo

ROOT = Path(__file__).resolve().parent.parent
RESIDENCY_FIELDS = {"host", "ssd", "remote", "gpu", "gpu_dev"}
SEAM = ROOT / "kvstore" / "index.py"


def _violations(path: Path) -> list[str]:
    """Assignments to a residency field of anything but `self` (a tier object attribute such
    as `self.host = HostTier(...)` is not a block's residency), and Entry(...) calls that pass
    residency as keywords."""
    out = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        flat: list[ast.expr] = []
        for t in targets:
            flat += list(t.elts) if isinstance(t, ast.Tuple) else [t]
        for t in flat:
            if (isinstance(t, ast.Attribute) and t.attr in RESIDENCY_FIELDS
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: assigns .{t.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "Entry"
                and any(k.arg in RESIDENCY_FIELDS for k in node.keywords)):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: Entry(...) with residency")
    return out


def test_no_residency_change_bypasses_the_seam():
    files = sorted((ROOT / "kvstore").rglob("*.py")) + sorted((ROOT / "tiers").rglob("*.py"))
    bad = [v for f in files if f != SEAM for v in _violations(f)]
    assert not bad, ("residency changes outside kvstore/index.py (use BlockIndex.set_host / "
                     "clear_host / set_gpu / clear_gpu / set_ssd / set_remote / discard):\n"
                     + "\n".join(bad))


def test_the_check_finds_a_direct_assignment(tmp_path):
    f = ROOT / "kvstore" / "_seam_probe_never_committed.py"
    try:
        f.write_text("def f(e):\n    e.ssd = True\n    e.gpu, e.gpu_dev = 1, 0\n")
        assert len(_violations(f)) == 3
    finally:
        f.unlink()


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[bytes, str, bool]] = []

    def changed(self, e: Entry, tier: str, entered: bool) -> None:
        self.seen.append((e.key, tier, entered))

    def discarded(self, e: Entry) -> None:
        for tier, on in ((GPU, e.gpu is not None), (HOST, e.host is not None), (SSD, e.ssd),
                         (REMOTE, e.remote)):
            if on:
                self.seen.append((e.key, tier, False))


def test_listener_hears_changes_only():
    ix = BlockIndex()
    rec = _Recorder()
    ix.listener = rec
    ns = b"n" * 16
    e = Entry(ns, b"k" * 16, None, 8, 1)
    ix.add(e)
    ix.set_host(e, 4096)
    ix.set_host(e, 8192)            # a new offset is no change of residency
    ix.set_ssd(e)
    ix.set_ssd(e)
    ix.clear_host(e)
    ix.clear_host(e)
    assert not ix.drop_if_gone(e)
    ix.set_remote(e)
    ix.set_ssd(e, False)
    ix.set_remote(e, False)
    assert ix.drop_if_gone(e) and ix.get(e.gkey) is None
    k = b"k" * 16
    assert rec.seen == [(k, HOST, True), (k, SSD, True), (k, HOST, False), (k, REMOTE, True),
                        (k, SSD, False), (k, REMOTE, False)]


def test_discard_reports_every_tier_left_even_packed():
    ix = BlockIndex()
    rec = _Recorder()
    ns = b"n" * 16
    ix.load_ssd([(ns + b"a" * 16, None, 8, 1)])   # packed, SSD only, before the listener
    ix.listener = rec
    ix.discard(ns + b"a" * 16)
    assert rec.seen == [(b"a" * 16, SSD, False)]
    e = Entry(ns, b"b" * 16, None, 8, 1)
    ix.add(e)
    ix.set_gpu(e, 0, 0)
    ix.set_host(e, 0)
    rec.seen.clear()
    ix.discard(e.gkey)
    assert rec.seen == [(b"b" * 16, GPU, False), (b"b" * 16, HOST, False)]


def _batch(ns: bytes, n: int) -> list[Entry]:
    keys = [bytes([i]) * 16 for i in range(1, n + 1)]
    return [Entry(ns, k, p, 8, 1) for k, p in zip(keys, [None, *keys[:-1]], strict=True)]


def test_add_host_many_reports_as_one_block_at_a_time():
    """A commit's batch: the same changes, in the same order, and the same index (parents
    linked, host copies set) as add() then set_host() per block."""
    ns = b"n" * 16
    one, many = BlockIndex(), BlockIndex()
    rec_one, rec_many = _Recorder(), _Recorder()      # no changed_many: told one by one
    one.listener, many.listener = rec_one, rec_many
    for i, e in enumerate(_batch(ns, 5)):
        one.add(e)
        one.set_host(e, 4096 * i)
    many.add_host_many(_batch(ns, 5), [4096 * i for i in range(5)])
    assert rec_many.seen == rec_one.seen and len(rec_one.seen) == 5
    for e in _batch(ns, 5):
        a, b = one.get(e.gkey), many.get(e.gkey)
        assert (a.host, a.parent, a.children) == (b.host, b.parent, b.children)


def _recorders(max_queue: int, n: int = 2) -> tuple[bytes, list[Recorder]]:
    spec = NamespaceSpec(model="m", layout=KVLayout(num_layers=1, num_kv_heads=1, head_dim=8,
                                                   block_tokens=4, dtype="float16"))
    ns = b"n" * 16
    infos = {ns: NamespaceInfo(ns, spec)}
    recs = [Recorder(infos, [[]], max_queue, lambda g: None) for _ in range(n)]
    for rec in recs:
        rec.woke = 0
        rec.wake = lambda rec=rec: setattr(rec, "woke", rec.woke + 1)
    return ns, recs


@pytest.mark.parametrize("max_queue", [100, 3])
def test_recorder_changed_many_queues_what_changed_would(max_queue):
    """Recorder.changed_many of blocks no commit just remembered (a promotion's, a put's):
    the items, texts, wake-ups and overflow of changed() per block."""
    ns, recs = _recorders(max_queue)
    for rec in recs:
        rec.book[ns + bytes([2]) * 16] = "text-of-2"          # as remember() keeps them
    entries = _batch(ns, 5)
    for e in entries:
        recs[0].changed(e, HOST, True)
    recs[1].changed_many(entries, HOST, True)
    assert list(recs[1].queue) == list(recs[0].queue)
    assert recs[1].overflowed == recs[0].overflowed == (max_queue < 5)
    assert recs[1].queue[1][4] == "text-of-2" and bool(recs[1].woke) == bool(recs[0].woke)


@pytest.mark.parametrize("max_queue", [100, 3])
def test_a_remembered_commit_queues_one_record_of_its_blocks(max_queue):
    """The blocks of the commit remember() just took go in as one CommitRun (the internal
    shape: one item, not one per block) standing for the same changes: each block's text is
    the book's (what changed() would queue), the backlog counts every block (max_queue
    overflows as it would per block), one wake-up. The events a consumer sees from it are
    the per-block items' (tests/test_events_put.py: a Put's blocks, queued one by one, and a
    Commit's announce the same blocks, parents and token ids)."""
    ns, (one, many) = _recorders(max_queue)
    entries = _batch(ns, 5)
    keys = [e.key for e in entries]
    texts = LazyTexts(ns, keys, None, bytes(4 * 4 * 5), 4)
    for rec in (one, many):
        rec.remember(ns, keys, texts)
    for e in entries:
        one.changed(e, HOST, True)
    many.changed_many(entries, HOST, True)
    assert many.overflowed == one.overflowed == (max_queue < 5)
    assert bool(many.woke) == bool(one.woke)
    if max_queue < 5:
        assert not many.queue
        return
    (run,) = many.queue
    assert isinstance(run, CommitRun) and run.n == 5 and run.tiers == (HOST,)
    assert many.queued == one.queued == 5
    assert [(it[4].owner, it[4].i) for it in one.queue] == [(texts, i) for i in range(5)]
    assert [it[4]() for it in one.queue] == [run.text.text(i) for i in range(5)]
    assert [it[0] for it in one.queue][0] == run.gkey and run.entered and not run.gone


def test_changed_many_after_another_change_queues_per_block():
    """A change between remember() and changed_many (it may have touched the book) makes the
    batch go in block by block; so does a batch that is not the remembered commit."""
    ns, (rec,) = _recorders(100, 1)
    entries = _batch(ns, 4)
    keys = [e.key for e in entries]
    texts = LazyTexts(ns, keys, None, bytes(4 * 4 * 4), 4)
    rec.remember(ns, keys, texts)
    rec.discarded(entries[0])                   # not resident: queues nothing, forgets
    rec.changed_many(entries, HOST, True)
    assert len(rec.queue) == 4 and not any(isinstance(it, CommitRun) for it in rec.queue)
    rec.queue.clear()
    rec.remember(ns, keys, texts)
    rec.changed_many(entries[1:], HOST, True)   # a part only
    assert len(rec.queue) == 3 and not any(isinstance(it, CommitRun) for it in rec.queue)


def test_a_commits_book_entries_reach_every_reader_of_the_book():
    """A commit's book entries are made after it (Recorder.flush: by the publisher, or by the
    first reader under the lock): a later change of one of its blocks still finds its text,
    a removal still forgets it, and a text put in later (a Put's) still wins over it."""
    ns, (rec,) = _recorders(100, 1)
    entries = _batch(ns, 4)
    keys = [e.key for e in entries]
    texts = LazyTexts(ns, keys, None, bytes(range(4 * 4 * 4)), 4)
    rec.remember(ns, keys, texts)
    rec.changed_many(entries, HOST, True)
    entries[2].ssd = True                       # demoted: its SSD copy enters
    rec.changed(entries[2], SSD, True)
    assert rec.queue[-1][4]() == texts.text(2)
    assert set(rec.book) == {ns + k for k in keys}
    rec.remember(ns, keys, texts)
    rec.discarded(entries[0])                   # deleted: forgotten, not made again after
    rec.remember(ns, keys[1:2], ["put's text"])
    rec.flush()
    assert ns + keys[0] not in rec.book and rec.book[ns + keys[1]] == "put's text"
