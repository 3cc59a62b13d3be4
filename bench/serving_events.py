"""A listener beside the router: what the KV event streams the router subscribes to carried.

Why: a kv_aware figure means something only if the router was told where the blocks are. The
tap subscribes to the same endpoints as the router and counts, per stream, the batches, the
stored and removed blocks by medium, the AllBlocksCleared events and sequence numbers that
went back, so the report shows what each setup's router could know (e.g. that kvstore's
streams announced CPU blocks again after the engine restart).
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any


class EventTap:
    def __init__(self, endpoints: dict[str, str]) -> None:
        import msgpack
        import zmq

        self._msgpack = msgpack
        self._zmq = zmq
        self.ctx = zmq.Context()
        self.socks: dict[Any, str] = {}
        for name, ep in endpoints.items():
            s = self.ctx.socket(zmq.SUB)
            s.setsockopt(zmq.SUBSCRIBE, b"")
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            self.socks[s] = name
        self.counts: dict[str, Counter] = {name: Counter() for name in endpoints}
        self._last_seq: dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="event-tap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        zmq = self._zmq
        poller = zmq.Poller()
        for s in self.socks:
            poller.register(s, zmq.POLLIN)
        while not self._stop.is_set():
            for s, _ in poller.poll(100):
                try:
                    frames = s.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                self._count(self.socks[s], frames)

    def _count(self, name: str, frames: list[bytes]) -> None:
        c = Counter()
        c["batches"] += 1
        if len(frames) != 3 or len(frames[1]) != 8:
            c["bad"] += 1
        else:
            seq = int.from_bytes(frames[1], "big", signed=True)
            last = self._last_seq.get(name)
            if last is not None and seq <= last:
                c["seq_back"] += 1
            self._last_seq[name] = seq
            try:
                batch = self._msgpack.unpackb(frames[2], raw=False, strict_map_key=False)
                events = batch[1]
            except (ValueError, TypeError, IndexError, self._msgpack.UnpackException):
                c["bad"] += 1
                events = []
            for ev in events:
                if isinstance(ev, dict):
                    kind, medium = ev.get("type"), ev.get("medium") or "GPU"
                    n = len(ev.get("block_hashes") or ())
                elif isinstance(ev, (list, tuple)) and ev:       # msgspec array_like form
                    kind, medium, n = ev[0], "?", 1
                else:
                    c["bad"] += 1
                    continue
                if kind == "AllBlocksCleared":
                    c["cleared"] += 1
                else:
                    c[f"{'stored' if kind == 'BlockStored' else 'removed'}_{medium}"] += n
        with self._lock:
            self.counts[name].update(c)

    def snapshot(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {name: dict(sorted(c.items())) for name, c in self.counts.items()}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for s in self.socks:
            s.close(linger=0)
        self.ctx.term()
