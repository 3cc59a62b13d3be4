"""A reliable subscriber to the daemon's KV event streams, for the events tests.

It does what a router does: subscribes to the PUB socket, asks the replay socket for what it
missed before its subscription took (PUB/SUB drops messages sent before that), and orders
batches by sequence number, dropping repeats. Every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

zmq = pytest.importorskip("zmq", reason="pyzmq is a daemon dependency (make setup installs it)")

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
DEADLINE_S = 30.0
END_SEQ = (-1).to_bytes(8, "big", signed=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lines:
    """A child's stdout, line by line (JSON), each read within an absolute deadline; `more()`
    adds what the child said elsewhere (its log) to a failure's message."""

    def __init__(self, proc: subprocess.Popen, what: str,
                 more: Callable[[], str] = lambda: "") -> None:
        self.proc, self.what, self.more, self._buf = proc, what, more, b""

    def ready(self) -> bool:
        return b"\n" in self._buf or bool(select.select([self.proc.stdout], [], [], 0)[0])

    def next(self, deadline_s: float) -> dict:
        end = time.monotonic() + deadline_s
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise AssertionError(f"{self.what} said nothing within {deadline_s} s"
                                     f"{self.more()}")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise AssertionError(f"{self.what} exited ({self.proc.wait(10)}){self.more()}")
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)


class Sub:
    def __init__(self, endpoint: str, replay: str | None = None, topic: bytes = b"") -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.setsockopt(zmq.LINGER, 0)
        mon = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        self.sub.connect(endpoint)
        try:
            if not mon.poll(int(DEADLINE_S * 1000)):
                raise TimeoutError(f"no connection to {endpoint} within {DEADLINE_S} s")
            mon.recv_multipart()
        finally:
            self.sub.disable_monitor()
            mon.close(0)
        self.batches: dict[int, tuple[float, list[dict], int | None]] = {}
        self.raw: dict[int, bytes] = {}
        self.replay_endpoint = replay
        if replay:
            self.replay_from(0)

    def replay_from(self, start: int) -> list[int]:
        """Ask the replay socket for the batches from `start`; their sequence numbers."""
        req = self.ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        got = []
        try:
            req.send_multipart([b"", start.to_bytes(8, "big")])
            end = time.monotonic() + DEADLINE_S
            while True:
                left = end - time.monotonic()
                if left <= 0 or not req.poll(int(left * 1000)):
                    raise TimeoutError("replay did not end within the deadline")
                _, topic, seq, payload = req.recv_multipart()
                if seq == END_SEQ:
                    return got
                n = int.from_bytes(seq, "big")
                got.append(n)
                self._keep(n, payload)
        finally:
            req.close(0)

    def _keep(self, seq: int, payload: bytes) -> None:
        if seq not in self.batches:
            self.raw[seq] = payload
            self.batches[seq] = tuple(msgpack.unpackb(payload, raw=False))  # type: ignore

    def pump(self, timeout_s: float = 0.05) -> None:
        """Take what arrived; a gap in the numbers is asked of the replay socket, as a
        router does."""
        if self.sub.poll(int(timeout_s * 1000)):
            while True:
                try:
                    _, seq, payload = self.sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                n = int.from_bytes(seq, "big")
                if self.replay_endpoint and self.batches and n > self.last_seq() + 1:
                    self.replay_from(self.last_seq() + 1)
                self._keep(n, payload)

    def events(self, since: int = 0) -> list[dict[str, Any]]:
        """Every event of the batches numbered `since` or later, in sequence order."""
        return [e for s in sorted(self.batches) if s >= since for e in self.batches[s][1]]

    def wait(self, pred: Callable[[list[dict[str, Any]]], bool], since: int = 0,
             deadline_s: float = DEADLINE_S, what: str = "events") -> list[dict[str, Any]]:
        end = time.monotonic() + deadline_s
        while True:
            evs = self.events(since)
            if pred(evs):
                return evs
            if time.monotonic() > end:
                raise AssertionError(f"{what} not seen within {deadline_s} s; got {len(evs)} "
                                     f"events, the last: {evs[-20:]}")
            self.pump()

    def last_seq(self) -> int:
        return max(self.batches) if self.batches else -1

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def per_block(evs: list[dict]) -> list[dict]:
    """`evs` as a router applies them, one event per block: a BlockStored of a chain (each
    block's parent the hash before it, token ids block_size a block, as vLLM and the
    publisher's merged runs send them) becomes one event a block, a BlockRemoved of several
    hashes one a hash."""
    out = []
    for e in evs:
        hs = e.get("block_hashes") or []
        if e["type"] == "BlockStored" and len(hs) > 1 and len(e["token_ids"]) == \
                len(hs) * e["block_size"]:
            bs, parent = e["block_size"], e["parent_block_hash"]
            for i, h in enumerate(hs):
                out.append({**e, "block_hashes": [h], "parent_block_hash": parent,
                            "token_ids": e["token_ids"][i * bs:(i + 1) * bs]})
                parent = h
        elif e["type"] == "BlockRemoved" and len(hs) > 1:
            out += [{**e, "block_hashes": [h]} for h in hs]
        else:
            out.append(e)
    return out


def stored(evs: list[dict], medium: str | None = None) -> list[dict]:
    """The BlockStored events of `evs`, one a block (per_block)."""
    return [e for e in per_block(evs) if e["type"] == "BlockStored"
            and (medium is None or e["medium"] == medium)]


def removed(evs: list[dict], medium: str | None = None) -> list[dict]:
    return [e for e in per_block(evs) if e["type"] == "BlockRemoved"
            and (medium is None or e["medium"] == medium)]


def firsts(evs: list[dict]) -> list[dict]:
    """`evs` without repeats (a new subscriber is told again what the daemon holds, so a
    stream may announce a block twice): the first of each (hashes, medium)."""
    seen, out = set(), []
    for e in evs:
        k = (e["type"], tuple(e.get("block_hashes", ())), e.get("medium"))
        if k not in seen:
            seen.add(k)
            out.append(e)
    return out


def hashes(evs: list[dict]) -> list[int]:
    return [h for e in evs for h in e["block_hashes"]]


def held(evs: list[dict]) -> dict[str, set[int]]:
    """What a router knows after `evs`: medium -> hashes held."""
    out: dict[str, set[int]] = {}
    for e in evs:
        if e["type"] == "AllBlocksCleared":
            out = {}
        elif e["type"] == "BlockStored":
            out.setdefault(e["medium"], set()).update(e["block_hashes"])
        elif e["type"] == "BlockRemoved":
            out.setdefault(e["medium"], set()).difference_update(e["block_hashes"])
    return {m: s for m, s in out.items() if s}


VLLM_DECODE = """
import sys, json, msgspec
from vllm.distributed.kv_events import KVEventBatch
dec = msgspec.msgpack.Decoder(KVEventBatch)
enc = msgspec.msgpack.Encoder()
out = []
for path in sys.argv[1:]:
    raw = open(path, "rb").read()
    batch = dec.decode(raw)
    out.append({"same_bytes": enc.encode(batch) == raw,
                "types": [type(e).__name__ for e in batch.events],
                "rank": batch.data_parallel_rank})
print(json.dumps(out))
"""


def vllm_decode(payloads: list[bytes], tmp: Path) -> list[dict] | None:
    """Decode payloads with vLLM's own msgspec classes in the vLLM environment (strictly
    typed: a field of the wrong type fails); None where that environment is not built."""
    if not VLLM_PY.exists():
        return None
    paths = []
    for i, p in enumerate(payloads):
        f = tmp / f"batch{i}.bin"
        f.write_bytes(p)
        paths.append(str(f))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(VLLM_PY), "-c", VLLM_DECODE, *paths], capture_output=True,
                       text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    import json
    return json.loads(r.stdout.strip().splitlines()[-1])


__all__ = ["Sub", "free_port", "stored", "removed", "hashes", "held", "firsts", "vllm_decode",
           "sys"]
