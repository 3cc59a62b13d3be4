"""The serving benchmark's replay: when each request is sent, and which node served it.

Two ways to send the workload (`--in-flight`):

- `one`: one request at a time in the trace's order, a fixed gap after each answer. This
  measures each setup's service time: no request ever waits for another's prefill.
- `trace`: each request at its trace arrival time divided by `time_scale`, but never before
  its conversation's previous turn has answered and the think gap has passed (a user does not
  send turn k+1 before reading answer k). Requests overlap and queue behind each other's
  prefills, as on a served fleet, so a setup that prefills less also waits less. Each
  conversation is one sender thread; the schedule is open-loop across conversations.

Both replay the requests before `restart_at`, then call `restart` and replay the rest. In
`trace` mode that is a quiesce: no request of the second half is sent before every request of
the first has answered, and the second half's schedule starts when the restart is done (the
first request after it is due at once, the others at their trace offsets from it). The
replay's wall time (`replay_s`) leaves the restart out, so requests / `replay_s` is the
throughput the fleet sustained.

Which node served a request: with requests overlapping, counting an engine's access-log lines
before and after a request says nothing. Every completion's `id` (`cmpl-...`, which the router
passes through) is in the serving engine's log (`--enable-log-requests`: "Received request
cmpl-...-0"), so `attribute` reads each engine's log for the ids. vllm-router's kv_aware
decisions (its debug log) carry no request id, only the worker and the prompt's length:
`match_decisions` pairs each request with a decision of the same worker and length, in send
order within such a pair.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.serving_client import Completion
from bench.serving_workload import Request

IN_FLIGHT = ("one", "trace")
JOIN_S = 900.0      # a phase's senders; each request has its own deadline well below this


@dataclass
class Sent:
    req: Request
    done: Completion
    sent_s: float       # since the replay started (the restart's time left out)
    done_s: float
    due_s: float        # when the schedule wanted it sent ("one": when it was sent)


def _phase_one(reqs: Sequence[Request], send: Callable[[Request], Completion], gap_s: float,
               t0: float, base: float) -> list[Sent]:
    out = []
    for r in reqs:
        sent = time.monotonic()
        done = send(r)
        end = time.monotonic()
        out.append(Sent(r, done, base + sent - t0, base + end - t0, base + sent - t0))
        time.sleep(gap_s)
    return out


def _phase_trace(reqs: Sequence[Request], send: Callable[[Request], Completion],
                 gap_s: float, scale: float, t0: float, base: float) -> list[Sent]:
    """One sender thread per conversation; the phase's first request is due at t0."""
    first_ms = reqs[0].timestamp_ms
    by_conv: dict[int, list[Request]] = {}
    for r in reqs:
        by_conv.setdefault(r.conversation, []).append(r)
    out: list[Sent] = []
    errors: list[BaseException] = []
    lock = threading.Lock()
    stop = threading.Event()

    def user(turns: list[Request]) -> None:
        ready = t0              # the previous turn's answer plus the think gap
        for r in turns:
            due = t0 + (r.timestamp_ms - first_ms) / 1000 / scale
            if stop.wait(max(due, ready) - time.monotonic()):
                return
            sent = time.monotonic()
            try:
                done = send(r)
            except BaseException as e:      # noqa: BLE001 - handed to the main thread
                with lock:
                    errors.append(e)
                stop.set()
                return
            end = time.monotonic()
            with lock:
                out.append(Sent(r, done, base + sent - t0, base + end - t0, base + due - t0))
            ready = end + gap_s

    threads = [threading.Thread(target=user, args=(turns,), daemon=True)
               for turns in by_conv.values()]
    for t in threads:
        t.start()
    end = time.monotonic() + JOIN_S
    for t in threads:
        t.join(max(end - time.monotonic(), 0.0))
    if any(t.is_alive() for t in threads):
        stop.set()
        raise RuntimeError(f"the replay's senders did not finish within {JOIN_S:.0f} s")
    if errors:
        raise errors[0]
    return sorted(out, key=lambda s: s.req.index)


def replay(requests: Sequence[Request], send: Callable[[Request], Completion], *,
           in_flight: str, time_scale: float, gap_s: float, restart_at: int,
           restart: Callable[[list[Sent]], None]) -> tuple[list[Sent], float]:
    """Every request sent once, `restart` called between the halves with what the first
    sent; returns what was sent (in request order) and the replay's wall time without the
    restart."""
    if in_flight not in IN_FLIGHT:
        raise ValueError(f"in_flight must be one of {IN_FLIGHT}, not {in_flight!r}")
    if in_flight == "trace" and not time_scale > 0:
        raise ValueError("time_scale must be positive")
    halves = [[r for r in requests if r.index < restart_at],
              [r for r in requests if r.index >= restart_at]]
    out: list[Sent] = []
    wall = 0.0
    for k, half in enumerate(halves):
        if k == 1:
            restart(list(out))
        if not half:
            continue
        t0 = time.monotonic()
        if in_flight == "one":
            got = _phase_one(half, send, gap_s, t0, wall)
        else:
            got = _phase_trace(half, send, gap_s, time_scale, t0, wall)
        wall = max(s.done_s for s in got)
        out += got
    return out, wall


def max_in_flight(sent: Sequence[Sent]) -> int:
    """The most requests that were in flight at one time."""
    edges = sorted([(s.sent_s, 1) for s in sent] + [(s.done_s, -1) for s in sent],
                   key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, d in edges:
        now += d
        most = max(most, now)
    return most


_RECEIVED = re.compile(r"Received request (\S+)-\d+: ")


def served_ids(log_text: str) -> set[str]:
    """The completion ids an engine's log says it received."""
    return set(_RECEIVED.findall(log_text))


def attribute(ids: Sequence[str], logs: Sequence[str]) -> list[int]:
    """For each completion id, the index of the one log that holds it, else -1."""
    held = [served_ids(text) for text in logs]
    out = []
    for cid in ids:
        where = [i for i, h in enumerate(held) if cid in h]
        out.append(where[0] if len(where) == 1 else -1)
    return out


def match_decisions(requests: Sequence[tuple[str, int]],
                    decisions: Sequence[tuple[str, int, int]]) -> list[int | None]:
    """For each request (its node's URL, its prompt tokens), in send order, the credited
    tokens of a router decision for the same worker and prompt length (the earliest not yet
    taken), or None when the router logged none such."""
    left: dict[tuple[str, int], list[int]] = {}
    for worker, tokens, credited in decisions:
        left.setdefault((worker, tokens), []).append(credited)
    out: list[int | None] = []
    for key in requests:
        pool = left.get(key)
        out.append(pool.pop(0) if pool else None)
    return out
