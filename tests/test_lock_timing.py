"""The store lock's opt-in timing (kvstore/lock_timing.py): off, the lock is a plain RLock; on,
it is still a correct re-entrant lock and a Condition's lock, and it records outermost holds
and waits by call site, written as JSON when the store closes."""

from __future__ import annotations

import json
import threading
import time

from kvstore import lock_timing

from .store_helpers import make_store, namespace, random_prompt
from .test_store_concurrency import expected


def test_off_by_default_the_lock_is_a_plain_rlock(tmp_path, monkeypatch):
    monkeypatch.delenv(lock_timing.ENV, raising=False)
    with make_store(tmp_path) as store:
        assert type(store.state.lock) is type(threading.RLock())


def test_holds_and_waits_are_timed_by_site(tmp_path):
    lock = lock_timing.TimedRLock()
    cond = threading.Condition(lock)
    with lock:
        with lock:                      # re-entrant: one outermost hold
            time.sleep(0.006)
    assert sum(s.n for s in lock.holds.values()) == 1
    (key, stat), = lock.holds.items()
    assert "test_holds_and_waits_are_timed_by_site" in key and stat.long == 1
    assert len(lock.long) == 1 and lock.long[0][1] >= 6.0

    got = []

    def waiter() -> None:
        with cond:
            got.append(cond.wait(10))
    t = threading.Thread(target=waiter)
    t.start()
    while not lock.holds or sum(s.n for s in lock.holds.values()) < 2:
        time.sleep(0.001)               # the waiter's hold ended where it began to wait
    with cond:
        cond.notify()
    t.join(10)
    assert got == [True] and not lock._is_owned()
    assert lock.acquire(blocking=False)
    lock.release()
    out = tmp_path / "lock.json"
    lock.dump(str(out))
    report = json.loads(out.read_text())
    assert set(report) == {"holds", "waits", "long_holds"}
    assert sum(r["n"] for r in report["holds"].values()) == 5


def test_on_the_store_writes_its_figures_at_close(tmp_path, monkeypatch):
    out = tmp_path / "lock.json"
    monkeypatch.setenv(lock_timing.ENV, str(out))
    with make_store(tmp_path) as store:
        assert isinstance(store.state.lock, lock_timing.TimedRLock)
        ns = namespace(store)
        keys = random_prompt(__import__("numpy").random.default_rng(5), 3)[1]
        store.put(ns, keys, [expected(k) for k in keys])
        lease = store.acquire(ns, keys)
        assert len(lease.keys) == 3
        store.release(lease.id)
    report = json.loads(out.read_text())
    assert any("put" in k for k in report["holds"])
    assert any("acquire" in k for k in report["waits"])
