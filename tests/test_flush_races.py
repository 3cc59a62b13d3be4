"""Flush against Put, Delete, Evict and background demotion on one Store, from real threads.

Why: a Flush demotes blocks in batches, releasing the store lock for each batch's encode and
SSD write (and for the SSD evictions that make room for it), and waits for the background
demoter's batches that hold blocks it must write. Meanwhile the same keys are put again,
deleted (one by one and whole namespaces), evicted from host and from SSD. A block a Flush
settles as an SSD copy must still be the block the index holds: one that left the index
meanwhile made the SSD policy (kvstore/policies/packed_leaves.py, keyed by index row) raise
KeyError "block ... is not indexed; index it before its policy" out of Flush (the stress below
did so in 3 of 4 runs against the Flush before a685237, which listed the host-only blocks once
and wrote them batch by batch without re-checking them; the stop's flush kept that path, see
the second test). Every SSD write and delete is slowed a little so the windows in which the
lock is released overlap often.

At the end, once nothing is in flight, the SSD policy holds exactly the blocks the index says
are on SSD, and those are exactly the ones LMDB holds (besides the host accounting that
tests/test_store_concurrency.py checks).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import numpy as np
from kvstore_client.errors import ResourceExhausted

from .store_helpers import make_store, namespace, quiet, random_prompt
from .test_store_concurrency import check_quiet, expected, hammer

WINDOW_S = 0.001       # each SSD write and delete takes at least this long (off the lock)


def slow_ssd(store, monkeypatch) -> None:
    """Widen the windows in which moves run without the store lock (a slow disk)."""
    put_filled, delete_many = store.ssd.put_filled, store.ssd.delete_many
    delete_sized = store.ssd.delete_sized

    def slow_put(items, fill):
        time.sleep(WINDOW_S)
        return put_filled(items, fill)

    def slow_delete(keys):
        time.sleep(WINDOW_S)
        return delete_many(keys)

    def slow_delete_sized(keys):
        time.sleep(WINDOW_S)
        return delete_sized(keys)
    monkeypatch.setattr(store.ssd, "put_filled", slow_put)
    monkeypatch.setattr(store.ssd, "delete_many", slow_delete)
    monkeypatch.setattr(store.ssd, "delete_sized", slow_delete_sized)


def check_ssd_policy(store) -> None:
    """Once nothing is in flight: the SSD policy holds exactly the indexed SSD blocks."""
    with quiet(store):
        on_ssd = {e.gkey for e in store.index.entries() if e.ssd}
        policy = store.policies["ssd"]
        assert len(policy) == len(on_ssd), "the SSD policy and the index disagree"
        assert all(g in policy for g in on_ssd), "an SSD block the policy cannot evict"


def test_flush_races_puts_deletes_and_evictions(tmp_path, monkeypatch):
    # 320 host slots, so one Flush writes several batches, and SSD room for about 200 blocks:
    # writers keep the background demoter busy, a Flush's own writes evict from SSD, and the
    # same 240 keys come and go.
    with make_store(tmp_path, host_capacity=320 * 4096, ssd_capacity=200 * 4096) as store:
        ns = namespace(store)
        slow_ssd(store, monkeypatch)
        rng = np.random.default_rng(31)
        prompts = [random_prompt(rng, 6)[1] for _ in range(40)]
        seen = {"flushed": 0, "deleted": 0, "ssd_evicted": 0}
        lock = threading.Lock()

        def note(name: str, n: int) -> None:
            with lock:
                seen[name] += n

        def writer(seed: int) -> Callable[[], None]:
            r = np.random.default_rng(seed)

            def one() -> None:
                keys = prompts[int(r.integers(len(prompts)))]
                i = int(r.integers(len(keys)))
                part = keys[i:i + int(r.integers(1, len(keys) + 1))]
                store.put(ns, part, [expected(k) for k in part],
                          parent=keys[i - 1] if i else None)
            return one

        r_del = np.random.default_rng(32)

        def deleter() -> None:
            r = r_del
            if r.random() < 0.1:
                note("deleted", store.delete(ns))
            else:
                keys = prompts[int(r.integers(len(prompts)))]
                note("deleted", store.delete(ns, keys[int(r.integers(len(keys))):]))
            time.sleep(0.002)

        def flusher() -> None:
            note("flushed", store.flush())

        def evictor() -> None:
            store.evict("host", 16 * 4096)
            note("ssd_evicted", store.evict("ssd", 16 * 4096)[1])
            time.sleep(0.002)

        def enough(_: dict[str, int]) -> bool:
            with lock:
                return all(v > 0 for v in seen.values())
        hammer(1.5, [writer(1), writer(2), deleter, flusher, flusher, evictor],
               allowed=(ResourceExhausted,), until=enough)
        check_quiet(store)
        check_ssd_policy(store)
        # What is left is still whole: every prompt's stored prefix is served byte-exact.
        for keys in prompts:
            for k, got in store.get(ns, keys):
                assert got == expected(k), "a block came back with other bytes"


def test_stop_flush_skips_a_block_deleted_between_its_batches(tmp_path, monkeypatch):
    """The stop's flush (Moves.flush with a budget, as Store.close runs it) lists the host-only
    blocks once and writes them a batch at a time, releasing the lock for each batch's write.
    A block deleted while an earlier batch is written is not the index's any more when its own
    batch comes: it must not be written (its slot was freed) nor settled as an SSD copy.

    Before the fix, the deleted block's Entry still named its freed host slot, so the later
    batch wrote it to SSD and settled it into the SSD policy: KeyError "block ... is not
    indexed; index it before its policy" (and LMDB held a deleted block, which the next start
    would have indexed again). Up to a685237 every Flush call took this path; calls now
    re-check each block (Moves.flush), the stop's flush did not."""
    with make_store(tmp_path, host_capacity=1 << 20, background_demotion=False) as store:
        ns = namespace(store)
        keys = random_prompt(np.random.default_rng(33), 130)[1]     # three flush batches
        store.put(ns, keys, [expected(k) for k in keys])
        entered, go = threading.Event(), threading.Event()
        put_filled = store.ssd.put_filled

        def gated(items, fill):
            if not entered.is_set():
                entered.set()
                assert go.wait(10), "the test did not release the first batch's write"
            return put_filled(items, fill)
        monkeypatch.setattr(store.ssd, "put_filled", gated)
        failed: list[BaseException] = []

        def stop_flush() -> None:
            try:
                with store.state.lock:
                    store.moves.flush(budget_s=60)
            except BaseException as exc:    # reported by the test thread below
                failed.append(exc)
        t = threading.Thread(target=stop_flush)
        t.start()
        assert entered.wait(10), "the flush did not start writing"
        gone = keys[-1]                     # in the flush's last batch, still host-only
        assert store.delete(ns, [gone]) == 1
        go.set()
        t.join(30)
        assert not t.is_alive(), "the flush did not end"
        if failed:
            raise failed[0]
        assert not store.ssd.contains(ns + gone), "a deleted block was written to SSD"
        assert store.where(ns, [gone]) == [None]
        assert all(store.ssd.contains(ns + k) for k in keys[:-1]), "a listed block not written"
        check_quiet(store)
        check_ssd_policy(store)
