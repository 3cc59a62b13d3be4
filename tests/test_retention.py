"""Engine signals -> retention levels (client/kvstore_client/retention.py)."""

from __future__ import annotations

import pytest
from kvstore_client import InvalidArgument
from kvstore_client.common.layout import RETENTION_LEVELS
from kvstore_client.retention import SIGNALS, hints, level_for

from kvstore.policies import SegmentedPolicy, make_policy


def test_every_signal_maps_to_a_level_the_daemon_accepts() -> None:
    assert set(SIGNALS) >= {"request_finished", "session_closed", "session_continues",
                            "preempted"}
    assert level_for("session_closed") == "low"
    assert level_for("request_finished") == "normal"
    assert level_for("session_continues") == "high"
    assert level_for("preempted") == "high"
    assert all(level_for(s) in RETENTION_LEVELS for s in SIGNALS)


@pytest.mark.parametrize("bad", ["session_ended", "", None, 3])
def test_unknown_signals_name_the_problem(bad) -> None:
    with pytest.raises(InvalidArgument, match="unknown engine signal"):
        level_for(bad)


def test_hints_split_a_partial_tail_off_a_continuing_session() -> None:
    keys = [bytes([i]) * 16 for i in range(4)]
    assert hints("session_continues", keys, partial_tail=True) == [(keys[:3], "high"),
                                                                  (keys[3:], "low")]
    assert hints("session_continues", keys) == [(keys, "high")]
    assert hints("session_closed", keys, partial_tail=True) == [(keys, "low")]
    assert hints("request_finished", keys) == []          # normal: nothing to send
    assert hints("session_continues", keys[:1], partial_tail=True) == [(keys[:1], "low")]
    assert hints("preempted", []) == []


@pytest.mark.parametrize("name", ["lru", "default"])
def test_a_closed_session_is_evicted_before_a_continuing_one(name: str) -> None:
    """The levels mean what the signals say to the policies the store runs."""
    # the default policy fixed in its hint-following mode (its tuner follows hints only where
    # they pay: tests/test_policy.py)
    pol = SegmentedPolicy(8, shadow=False, mode=(None, False, True)) if name == "default" \
        else make_policy(name, 8)
    closed = [b"c%d" % i for i in range(3)]
    going = [b"g%d" % i for i in range(3)]
    for chain in (going, closed):                 # the closed session is the more recent
        parent = None
        for k in chain:
            pol.insert(k, parent, 1)
            parent = k
    for keys, level in hints("session_closed", closed) + hints("session_continues", going):
        pol.note_retention(keys, level)
    order = []
    while (victim := pol.pick(lambda g: True)) is not None:
        order.append(victim)
        pol.remove(victim)
    assert order[:3] == closed[::-1]              # leaves first: the chain from its tail
    assert sorted(order[3:]) == sorted(going)
