"""Engine signals -> retention levels: the one place that decides what an engine's news means.

Why one module: the vLLM and SGLang adapters, the trace bench and any other engine integration
must send the same level for the same event, or the eviction policy's tuning (which learns
whether hints help, docs/eviction.md) sees different meanings from different engines. An engine
knows things the store cannot infer (whether a conversation goes on); it says so with a
*signal*, and this module turns the signal into the level `Namespace.retain` carries.

Signals (what the engine knows when it sends them):

* ``"request_finished"`` — a request ended and the engine knows nothing about what follows
  (no session information): ``"normal"``, recency alone decides.
* ``"session_closed"`` — the conversation (or a one-shot request) is over; the blocks it wrote
  will not be read by it again: ``"low"``. Blocks other requests share are still kept by their
  own reuse: a hint only reorders, and a parent is never evicted before its children.
* ``"session_continues"`` — a follow-up turn of this conversation is expected (open chat
  session, agent loop): ``"high"``.
* ``"preempted"`` — the engine preempted the request and will resume it soon: ``"high"``.

A prompt's last block is often partial; its key changes as soon as the conversation grows, so
when a session continues that block will not be read again: `hints` sends it ``"low"``.
"""

from __future__ import annotations

from collections.abc import Sequence

from .common.errors import InvalidArgument

SIGNAL_LEVELS: dict[str, str] = {
    "request_finished": "normal",
    "session_closed": "low",
    "session_continues": "high",
    "preempted": "high",
}
SIGNALS = tuple(SIGNAL_LEVELS)


def level_for(signal: str) -> str:
    """The retention level ("low", "normal" or "high") an engine signal maps to."""
    level = SIGNAL_LEVELS.get(signal) if isinstance(signal, str) else None
    if level is None:
        raise InvalidArgument(f"unknown engine signal {str(signal)[:40]!r}; expected one of "
                              f"{', '.join(SIGNALS)}")
    return level


def hints(signal: str, keys: Sequence[bytes], partial_tail: bool = False
          ) -> list[tuple[list[bytes], str]]:
    """The ``(keys, level)`` Retain calls to make for `signal` on a request's blocks `keys`
    (in chain order). `partial_tail`: the last key stands for a partial block. "normal" needs
    no call, so it is left out; an empty list means: send nothing."""
    level = level_for(signal)
    keys = list(keys)
    out: list[tuple[list[bytes], str]] = []
    if partial_tail and keys and signal == "session_continues":
        body, tail = keys[:-1], keys[-1:]
        if body and level != "normal":
            out.append((body, level))
        out.append((tail, "low"))
        return out
    if keys and level != "normal":
        out.append((keys, level))
    return out
