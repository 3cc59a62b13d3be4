"""What the remote tier counts: calls, hits, bytes, failures, and each operation's latency.

Why its own object: counters are bumped from the caller's thread and from the pool threads
that run node batches and probes, so they share one lock. The bytes this process wrote and has
not deleted (`used_bytes`) are derived from them: an upper bound, since Redis' own eviction is
seen only when the store finds a key missing (its index keeps the true figure).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field

LATENCY_SAMPLES = 2048          # recent samples kept per operation, for histograms/percentiles
OPS = ("exists", "get", "put", "delete")
COUNTERS = ("calls", "round_trips", "hits", "misses", "lookup_hits", "lookup_misses",
            "bytes_read", "bytes_written", "bytes_deleted", "keys_written",
            "keys_deleted", "errors", "timeouts", "corrupt", "oversize", "wrong_type",
            "skipped_down", "moved", "probes", "reconnects", "slow")


@dataclass
class OpStats:
    count: int = 0
    sum_s: float = 0.0
    max_s: float = 0.0
    samples: collections.deque = field(
        default_factory=lambda: collections.deque(maxlen=LATENCY_SAMPLES))

    def add(self, seconds: float) -> None:
        self.count += 1
        self.sum_s += seconds
        self.max_s = max(self.max_s, seconds)
        self.samples.append(seconds)


class RemoteStats:
    """The counters and latencies of one RemoteTier, safe to bump from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.latency: dict[str, OpStats] = {op: OpStats() for op in OPS}

    def add(self, *pairs: str | int) -> None:
        """name, delta, name, delta..."""
        with self._lock:
            c = self.counters
            for i in range(0, len(pairs), 2):
                c[pairs[i]] += pairs[i + 1]  # type: ignore[index,operator]

    def timed(self, op: str, seconds: float) -> None:
        with self._lock:
            self.latency[op].add(seconds)

    @property
    def used_bytes(self) -> int:
        """Bytes written and not deleted (an upper bound, module docstring)."""
        c = self.counters
        return max(0, c["bytes_written"] - c["bytes_deleted"])

    def latency_summary(self) -> dict[str, dict[str, float]]:
        return {op: {"count": o.count, "sum_s": o.sum_s, "max_s": o.max_s}
                for op, o in self.latency.items()}

    def samples(self, op: str) -> list[float]:
        return list(self.latency[op].samples)
