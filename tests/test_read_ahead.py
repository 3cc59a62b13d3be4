"""A stream received on a thread of its own (kvstore_client/common/read_ahead.py): the daemon's
Put and the SDK's Get read their next message this way while working on the previous one.

Real threads, real blocking streams; every wait has a deadline.
"""

from __future__ import annotations

import threading

import pytest
from kvstore_client.common.read_ahead import ReadAhead

DEADLINE_S = 10.0


def test_items_come_in_order_the_first_on_the_callers_thread() -> None:
    who: list[str] = []

    def stream():
        for i in range(20):
            who.append(threading.current_thread().name)
            yield i
    ra = ReadAhead(stream(), depth=2, name="reader", inline=1)
    try:
        assert list(ra) == list(range(20))
    finally:
        ra.close()
    # the first, and the second (which tells the stream goes on), on the caller's thread
    assert who[:2] == [threading.current_thread().name] * 2
    assert set(who[2:]) == {"reader"}


def test_a_stream_no_longer_than_inline_starts_no_thread() -> None:
    for items in ([], [b"only"]):
        ra = ReadAhead(iter(items), inline=1)
        assert list(ra) == items
        ra.close()
        assert ra._thread is None
    ra = ReadAhead(iter([1, 2]), inline=1)
    assert list(ra) == [1, 2]
    assert ra._thread is not None


def test_the_reader_stays_at_most_depth_items_ahead() -> None:
    produced = 0
    taken: list[tuple[int, int]] = []

    def stream():
        nonlocal produced
        for i in range(50):
            produced += 1
            yield i
    ra = ReadAhead(stream(), depth=3)
    try:
        for i in ra:
            taken.append((i, produced))
            if i % 10 == 0:                 # a slow consumer now and then
                threading.Event().wait(0.02)
    finally:
        ra.close()
    # queued (3) + the one the reader holds while the queue is full
    assert all(p <= i + 1 + 3 + 1 for i, p in taken)


def test_an_error_of_the_stream_is_raised_where_its_item_would_be() -> None:
    def stream():
        yield 1
        yield 2
        raise OSError("stream broke")
    ra = ReadAhead(stream(), depth=2)
    got = []
    with pytest.raises(OSError, match="stream broke"):
        for i in ra:
            got.append(i)
    ra.close()
    assert got == [1, 2]


def test_close_ends_a_reader_blocked_on_a_full_queue() -> None:
    def endless():
        i = 0
        while True:
            i += 1
            yield i
    ra = ReadAhead(endless(), depth=1)
    it = iter(ra)
    assert next(it) == 1
    ra.close()
    assert ra._thread is not None
    ra._thread.join(DEADLINE_S)
    assert not ra._thread.is_alive()


def test_close_cancels_a_reader_blocked_on_the_stream() -> None:
    cancelled = threading.Event()

    def stalled():
        yield 1
        if not cancelled.wait(DEADLINE_S):     # a call that never sends its next message
            raise AssertionError("cancel was not called")
        raise ConnectionError("cancelled")
    ra = ReadAhead(stalled(), depth=2, cancel=cancelled.set)
    it = iter(ra)
    assert next(it) == 1
    ra.close()
    assert cancelled.is_set()
    assert ra._thread is not None
    ra._thread.join(DEADLINE_S)
    assert not ra._thread.is_alive()


def test_depth_must_be_positive() -> None:
    with pytest.raises(ValueError):
        ReadAhead(iter([]), depth=0)
