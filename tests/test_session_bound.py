"""bench/session_bound.py: the ceiling for policies that know whether a session goes on but
not when (docs/eviction.md). Checked on a trace small enough to work out by hand, and as a
bound against the policies themselves."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(name: str):
    """A bench script as a module, loaded by path: bench/ never goes on sys.path, where it
    would shadow real packages for the rest of the session (bench/vllm.py is not vLLM)."""
    if name in sys.modules:
        return sys.modules[name]
    if name == "session_bound":
        _load("trace_replay")           # it imports trace_replay by name
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_bound_by_hand():
    """One session of 2 blocks that goes on after 10 one-block requests (15 references).
    Holding both blocks over the gap costs 2 x 10 block-accesses. At capacity 1 (budget 15)
    a uniform hold time catches nothing (T = 7.5 < 10), the best mix holds them for 3/4 of the
    sessions-worth: 1.5 hits = 10%; at capacity 2 both hit: 2 / 15."""
    sb = _load("session_bound")
    trace = [[1, 2], *([x] for x in range(10, 20)), [1, 2, 3]]
    own, shared, refs = sb.intervals(trace)
    assert own == [(10, 2)] and shared == [] and refs == 15
    out = sb.bound(trace, [1, 2])
    assert out["1"] == {"uniform": 0.0, "hull": 10.0, "bound": 10.0}
    assert out["2"]["uniform"] == out["2"]["hull"] == out["2"]["bound"] == pytest.approx(13.33)


def test_shared_blocks_are_counted_apart_from_a_sessions_own():
    """A system prompt [1] read by two sessions; [1, 2] goes on as [1, 2, 3]. Block 2 is that
    session's own (nothing reads it in between: gap 2 accesses); block 1 from request 0 to 1
    is shared. Request 1 reads as going on without its last block (the trace has no session
    ids; session_hints sees a later request start with its first block), so block 1 from 1
    to 2 counts as its own, with a gap of 0."""
    sb = _load("session_bound")
    trace = [[1, 2], [1, 5], [1, 2, 3]]
    own, shared, refs = sb.intervals(trace)
    assert own == [(0, 1), (2, 1)]
    assert shared == [0]
    assert refs == 7


@pytest.mark.parametrize("kind", ["chat", "rag"])
def test_the_bound_is_above_what_the_policies_reach(kind):
    sb = _load("session_bound")
    tr = _load("trace_replay")
    trace = tr.synthetic(kind, n_requests=1500, seed=11)
    keys = tr.as_keys(trace)
    signals = tr.session_signals(tr.session_hints(trace), trace)
    cap = len({x for r in trace for x in r}) // 8
    ceiling = sb.bound(trace, [cap])[str(cap)]
    assert ceiling["hull"] >= ceiling["uniform"]
    for name in ("lru", "default"):
        got = 100 * tr.replay_policy(name, keys, cap, signals=signals).ratio
        assert got <= ceiling["bound"], (name, got, ceiling)
