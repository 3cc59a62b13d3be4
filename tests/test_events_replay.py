"""A relay asks the engine's replay socket for what it missed (`source_replay`).

Against a real store, an engine made here with pyzmq (its PUB and its replay ROUTER: the
engine's side, not kvstore's), whose replay socket answers as vLLM's does, or answers
garbage, or nothing at all:

- the engine's batches sent before the daemon started come from its replay buffer, and a gap
  in its numbers is filled from it; batches its buffer no longer has are counted as lost;
- an answer the engine's ROUTER dropped part of (its tail with the end marker, or a hole) is
  asked for again from the first missing number, and each block still reaches the router
  once, in order, the resume counted (`replay_resumes`) and not taken for a failure;
- a garbage answer (malformed frames, numbers out of order, payloads that are not msgpack, an
  answer that never ends) costs the relay what it may hold (`replay_bytes`) at most, and the
  engine's live batches go on;
- a replay socket that never answers holds the live batches back for the replay's deadline at
  most, and the daemon's own events meanwhile not at all;
- `source_replay` without `source` is a ConfigError.

Then vLLM's own ZmqEventPublisher (in `.venv-vllm`, driven line by line from here) against a
real daemon:

- The engine stores and removes GPU blocks while the daemon is down: the restarted daemon's
  merged stream credits exactly what the engine holds, from the engine's replay buffer, and
  names with the replayed token ids a chunk the engine's adapter stores by hash alone; the
  engine's next batch is forwarded without a second start-over.
- The daemon is stopped (SIGSTOP) while the engine publishes more than the sockets between
  them buffer: PUB/SUB drops the rest silently. The engine's next batch shows the gap in its
  numbers, and the relay fetches the missing batches: the router ends up with every block.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import msgpack
import numpy as np
import pytest
from kvstore_client import KVLayout, connect

from kvstore.config import ConfigError, EngineStreamConfig, load_config
from kvstore.events import replay as replay_mod
from tests.daemon import cleanup, start_daemon
from tests.events_helpers import ROOT, Lines, Sub, free_port, held, stored, zmq
from tests.store_helpers import random_prompt
from tests.test_events import FakeEngine, make, put, register

VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
READY_S = 300.0             # importing vLLM on a loaded 2-core machine
DEADLINE_S = 30.0
T = 16                      # tokens per engine block
END = (-1).to_bytes(8, "big", signed=True)


def _need_vllm() -> None:
    if not VLLM_PY.exists():
        if os.environ.get("CI"):
            raise RuntimeError(f"{VLLM_PY} is missing: `make test` builds it (make vllm-env)")
        pytest.skip(".venv-vllm is not built (make vllm-env)")


def chain(seed: int | str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}-{i}".encode()).digest() for i in range(n)]


def u64(h: bytes) -> int:
    return int.from_bytes(h, "big") & (2**64 - 1)


def tokens_of(h: bytes, bs: int) -> list[int]:
    return [b % 97 + 3 for b in (h * (bs // len(h) + 1))[:bs]]


# -- an engine made here ---------------------------------------------------------------------

def gpu_store(h: bytes) -> dict:
    return {"type": "BlockStored", "block_hashes": [h], "parent_block_hash": None,
            "token_ids": tokens_of(h, T), "block_size": T, "lora_id": None, "medium": "GPU",
            "lora_name": None}


def batch(*events: dict) -> bytes:
    """A batch as FakeEngine sends it, byte for byte (as vLLM's replay buffer keeps it)."""
    return msgpack.packb([1.0, list(events), 0], use_bin_type=True)


class ReplaySocket:
    """An engine's replay ROUTER on its own thread: each request [id, b"", start] is answered
    with `answer(start)`, a list of messages ([b"", seq, payload] as vLLM sends them), sent as
    fast as ZMQ takes them (a ROUTER drops what a slow peer's pipe has no room for, as
    vLLM's does). `requests`: the start of each request, in order."""

    def __init__(self, answer: Callable[[int], list[list[bytes]]]) -> None:
        self.answer = answer
        self.requests: list[int] = []
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.sock.poll(50):
                continue
            ident, _, start = self.sock.recv_multipart()
            self.requests.append(int.from_bytes(start, "big"))
            for msg in self.answer(self.requests[-1]):
                self.sock.send_multipart([ident, *msg])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.sock.close(0)
        self.ctx.term()


def served(history: dict[int, bytes]) -> Callable[[int], list[list[bytes]]]:
    """vLLM's answer from a buffer holding `history` (seq -> payload)."""
    return lambda start: [[b"", s.to_bytes(8, "big"), history[s]] for s in sorted(history)
                          if s >= start] + [[b"", END, b""]]


@contextmanager
def relaying(tmp_path, answer: Callable[[int], list[list[bytes]]], **events):
    """A store relaying a FakeEngine whose replay socket answers `answer`, and a subscriber of
    the merged stream: (engine, replay socket, store, subscriber, the relay)."""
    engine = FakeEngine()
    try:
        rep = ReplaySocket(answer)
        try:
            eng = EngineStreamConfig(name="e0", source=engine.endpoint,
                                     source_replay=rep.endpoint,
                                     endpoint=f"tcp://127.0.0.1:{free_port()}",
                                     replay_endpoint=f"tcp://127.0.0.1:{free_port()}")
            with make(tmp_path, endpoint="", replay_endpoint="", engines=[eng],
                      **events) as store:
                sub = Sub(*store.events.addresses["e0"])
                try:
                    yield engine, rep, store, sub, store.events.publisher.relays[0]
                finally:
                    sub.close()
        finally:
            rep.close()
    finally:
        engine.close()


def test_the_engines_history_and_a_gap_come_from_its_replay_socket(tmp_path):
    # the engine published 10 batches before the daemon started; its buffer keeps the last 5
    hs = chain("fake", 20)
    history = {s: batch(gpu_store(hs[s])) for s in range(5, 10)}
    with relaying(tmp_path, served(history)) as (engine, rep, store, sub, relay):
        engine.seq = 10
        engine.send([gpu_store(hs[10])])
        want = {u64(h) for h in hs[5:11]}
        sub.wait(lambda e: held(e).get("GPU") == want, what="the engine's history")
        assert rep.requests == [0]
        # batches 11..14 are lost on the way: batch 15 shows the gap, the replay fills it
        for s in range(11, 15):
            history[s] = batch(gpu_store(hs[s]))
        engine.seq = 15
        history[15] = batch(gpu_store(hs[15]))
        engine.send([gpu_store(hs[15])])
        want |= {u64(h) for h in hs[11:16]}
        evs = sub.wait(lambda e: held(e).get("GPU") == want, what="the gap, filled")
        assert rep.requests == [0, 11]
        # each block once, in the engine's order: the replayed batches are not sent twice
        assert [e["block_hashes"][0] for e in stored(evs, "GPU")] == [u64(h) for h in hs[5:16]]
        c = relay.counters
        assert (c["replays"], c["replay_batches"], c["replay_failures"], c["gaps"],
                c["replay_missed"], c["restarts"]) == (2, 10, 0, 1, 5, 0), c
        # ...which the store's counters show too
        sub.wait(lambda e: store.stats()["counters"].get("events_relay_replay_missed") == 5,
                 what="the counters in Stats")


def dropping(history: dict[int, bytes], lost: set[int]) -> Callable[[int], list[list[bytes]]]:
    """vLLM's answer as a reader that fell behind gets it: the first answer lacks the batches
    in `lost` (a ROUTER past its high-water mark drops them; with the last one goes the end
    marker, and the answer goes quiet), later answers are whole."""
    asked = []

    def answer(start: int) -> list[list[bytes]]:
        asked.append(start)
        msgs = served(history)(start)
        if len(asked) > 1:
            return msgs
        last = max(history)
        return [m for m in msgs if int.from_bytes(m[1], "big", signed=True) not in lost
                and not (last in lost and m[1] == END)]
    return answer


@pytest.mark.parametrize("lost", [range(6, 10), range(3, 5)], ids=["tail", "hole"])
def test_a_replay_the_engine_dropped_part_of_is_asked_again_and_forwarded_once(tmp_path, lost):
    """The relay's side of a replay in rounds (replay.py asks again from the first missing
    number): every block reaches the router once and in the engine's order, the repeats of a
    second round are skipped, and the resume is counted, not taken for a failure."""
    hs = chain("resume", 11)
    history = {s: batch(gpu_store(hs[s])) for s in range(10)}
    with relaying(tmp_path, dropping(history, set(lost))) as (engine, rep, store, sub, relay):
        engine.seq = 10
        engine.send([gpu_store(hs[10])])
        want = {u64(h) for h in hs}
        evs = sub.wait(lambda e: held(e).get("GPU") == want, what="every batch, resumed")
        assert rep.requests == [0, min(lost)]
        assert [e["block_hashes"][0] for e in stored(evs, "GPU")] == [u64(h) for h in hs]
        c = relay.counters
        assert (c["replays"], c["replay_resumes"], c["replay_failures"], c["replay_missed"],
                c["gaps"]) == (1, 1, 0, 0, 0), c


FILLER = batch({"type": "BlockRemoved", "block_hashes": [bytes(32)] * 8, "medium": "GPU"})
GARBAGE = {
    # a seq frame that is not 8 bytes: the answer is dropped there
    "malformed": lambda start: [[b"", b"\x01", b"x"]],
    # numbers going back: the answer is taken up to there
    "out of order": lambda start: [[b"", (3).to_bytes(8, "big"), batch(gpu_store(b"a" * 32))],
                                   [b"", (1).to_bytes(8, "big"), batch(gpu_store(b"b" * 32))],
                                   [b"", END, b""]],
    # payloads that are not msgpack: counted as bad messages
    "not msgpack": lambda start: [[b"", s.to_bytes(8, "big"), b"\xc1 not msgpack"]
                                  for s in range(start, start + 3)] + [[b"", END, b""]],
    # an answer that never ends: taken up to replay_bytes
    "endless": lambda start: [[b"", s.to_bytes(8, "big"), FILLER]
                              for s in range(start, start + 20000)],
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
def test_a_garbage_replay_answer_costs_a_bounded_replay_and_the_relay_goes_on(tmp_path, kind):
    replay_bytes = 16 << 10
    with relaying(tmp_path, GARBAGE[kind], replay_bytes=replay_bytes) as (
            engine, rep, store, sub, relay):
        # the daemon's start asked; the answer is in (a failure) or taken whole
        sub.wait(lambda e: relay.counters["replays"] == 1 and relay._replay is None,
                 what="the replay's end")
        hs = chain(kind, 3)
        engine.seq = 30000
        for h in hs:
            engine.send([gpu_store(h)])
        sub.wait(lambda e: {u64(h) for h in hs} <= held(e).get("GPU", set()),
                 what="the engine's live batches")
        c = relay.counters
        assert c["restarts"] == 0, c
        if kind == "not msgpack":
            # whole answers, each payload dropped: the live batch's gap was asked for too
            assert (c["replays"], c["replay_failures"], c["bad_messages"],
                    c["replay_batches"]) == (2, 0, 6, 0), c
        else:
            # a failed replay: the live batch's gap is not asked for (REPLAY_RETRY_S)
            assert (c["replays"], c["replay_failures"]) == (1, 1), c
        assert c["replay_missed"] == 30000 - c["replay_batches"], c
        if kind == "endless":
            # what the relay kept of it: replay_bytes, as the replay counts them
            assert 0 < c["replay_batches"] <= replay_bytes // (len(FILLER) +
                                                               replay_mod.OVERHEAD) + 1, c


def test_a_replay_socket_that_never_answers_holds_live_batches_for_its_deadline_at_most(
        tmp_path):
    hs = chain("silent", 12)
    with relaying(tmp_path, lambda start: []) as (engine, rep, store, sub, relay):
        engine.send([gpu_store(hs[0])])         # seq 0: waits for the replay asked at start
        # meanwhile the daemon's own events go out: the publisher thread is not held up
        rng = np.random.default_rng(3)
        ns = register(store)
        tokens, keys = random_prompt(rng, 2)
        put(store, ns, keys, tokens)
        sub.wait(lambda e: len(held(e).get("CPU", ())) == 2, what="the daemon's own blocks")
        # the live batch goes out once the replay's deadline passed
        evs = sub.wait(lambda e: u64(hs[0]) in held(e).get("GPU", set()),
                       deadline_s=replay_mod.DEADLINE_S + DEADLINE_S, what="the live batch")
        assert rep.requests == [0] and relay.counters["replay_failures"] == 1, relay.counters
        first_gpu = next(i for i, e in enumerate(evs) if e.get("medium") == "GPU")
        assert len(held(evs[:first_gpu]).get("CPU", ())) == 2
        # the engine goes on: the next batch is forwarded; a gap is lost, counted, not waited
        # for (a replay socket that failed is not asked again for REPLAY_RETRY_S)
        engine.send([gpu_store(hs[1])])
        engine.seq = 10
        engine.send([gpu_store(hs[10])])
        engine.send([gpu_store(hs[11])])
        want = {u64(hs[i]) for i in (0, 1, 10, 11)}
        sub.wait(lambda e: held(e).get("GPU") == want,
                 deadline_s=replay_mod.DEADLINE_S + DEADLINE_S, what="the engine's next batches")
        c = relay.counters
        assert (c["replay_missed"], c["gaps"], c["restarts"]) == (8, 1, 0), c


def test_live_batches_past_replay_bytes_end_the_wait_for_a_replay(tmp_path, caplog):
    hs = chain("many", 8)
    with relaying(tmp_path, lambda start: [], replay_bytes=1 << 10) as (
            engine, rep, store, sub, relay):
        # 8 batches of ~200 bytes wait for the replay asked at start: past 1 KiB it is given
        # up and they go out, before its deadline
        for h in hs:
            engine.send([gpu_store(h)])
        sub.wait(lambda e: held(e).get("GPU") == {u64(h) for h in hs},
                 deadline_s=replay_mod.DEADLINE_S + DEADLINE_S, what="the live batches")
        c = relay.counters
        assert (c["replays"], c["replay_failures"], c["replay_missed"]) == (1, 1, 0), c
        assert "outgrew events.replay_bytes" in caplog.text


def test_source_replay_needs_a_source_and_an_address():
    def cfg(**engine: str):
        return load_config(overrides={"events": {"enabled": True, "endpoint": "", "engines": [
            {"name": "e0", "endpoint": "tcp://*:5610", **engine}]}}, environ={})

    with pytest.raises(ConfigError, match=r"events.engines\[0\].source_replay: .*set source"):
        cfg(source_replay="tcp://127.0.0.1:5601")
    with pytest.raises(ConfigError, match=r"events.engines\[0\].source_replay: expected"):
        cfg(source="tcp://127.0.0.1:5600", source_replay="http://127.0.0.1:5601")
    got = cfg(source="tcp://127.0.0.1:5600", source_replay="tcp://127.0.0.1:5601")
    assert got.events.engines[0].source_replay == "tcp://127.0.0.1:5601"
    assert cfg(source="tcp://127.0.0.1:5600").events.engines[0].source_replay == ""


# -- vLLM's own publisher ----------------------------------------------------------------------

# vLLM's publisher, publishing what each stdin line lists: {"batches": [[event, ...], ...]},
# an event {"stored": [hex hash, ...], "parent": hex or null, "tokens": [...], "bs": n} or
# {"removed": [hex hash, ...]}. It answers each line once every batch is sent and in its
# replay buffer (the publisher's queue joined) with the next sequence number.
ENGINE = """
import json, sys, time
from vllm.distributed.kv_events import (BlockRemoved, BlockStored, KVEventBatch,
                                        ZmqEventPublisher)
endpoint, replay, hwm = sys.argv[1], sys.argv[2], int(sys.argv[3])
pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, hwm=hwm,
                        buffer_steps=100000)
print(json.dumps({"ready": True}), flush=True)
n = 0
for line in sys.stdin:
    for batch in json.loads(line)["batches"]:
        evs = []
        for e in batch:
            if "stored" in e:
                parent = bytes.fromhex(e["parent"]) if e["parent"] else None
                evs.append(BlockStored(block_hashes=[bytes.fromhex(h) for h in e["stored"]],
                                       parent_block_hash=parent, token_ids=e["tokens"],
                                       block_size=e["bs"], lora_id=None, medium="GPU",
                                       lora_name=None))
            else:
                evs.append(BlockRemoved(block_hashes=[bytes.fromhex(h) for h in e["removed"]],
                                        medium="GPU"))
        pub.publish(KVEventBatch(ts=time.time(), events=evs))
        n += 1
    pub._event_queue.join()
    print(json.dumps({"next_seq": n}), flush=True)
pub.shutdown()
"""


class Engine:
    """vLLM's ZmqEventPublisher in a subprocess: its PUB on an ipc path it binds (the daemon
    connects), its ROUTER replay socket on a loopback port."""

    def __init__(self, tmp: Path, hwm: int = 100000) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="kvs-eng-"))     # short: sockaddr_un
        self.endpoint = f"ipc://{self.dir}/events"
        self.replay = f"tcp://127.0.0.1:{free_port()}"
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.log = open(tmp / "engine.log", "wb")
        self.proc = subprocess.Popen(
            [str(VLLM_PY), "-c", ENGINE, self.endpoint, self.replay, str(hwm)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, env=env,
            cwd=str(tmp))
        self.lines = Lines(self.proc, "the engine", lambda: f"; its log:\n{self._tail()}")
        assert self.lines.next(READY_S) == {"ready": True}

    def _tail(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_bytes()[-4000:].decode(errors="replace")

    def publish(self, *batches: list[dict]) -> int:
        """Publish these batches; the next sequence number once they are all sent."""
        self.proc.stdin.write(json.dumps({"batches": list(batches)}).encode() + b"\n")
        self.proc.stdin.flush()
        return self.lines.next(DEADLINE_S)["next_seq"]

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        finally:
            self.log.close()
            shutil.rmtree(self.dir, ignore_errors=True)


def stores(hs: list[bytes], parent: bytes | None = None, bs: int = T) -> list[dict]:
    """One BlockStored of the chain `hs`, as vLLM's scheduler sends a request's new blocks."""
    return [{"stored": [h.hex() for h in hs], "parent": parent.hex() if parent else None,
             "tokens": [t for h in hs for t in tokens_of(h, bs)], "bs": bs}]


def daemon_with(tmp: Path, engine: Engine, **events: str):
    """A daemon relaying `engine` (with its replay socket) on a merged stream; (daemon,
    merged PUB address, its replay address)."""
    merged, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = tmp / "kvstore.toml"
    cfg.write_text("\n".join([
        "[events]", "enabled = true", 'endpoint = ""',
        *[f"{k} = {v}" for k, v in events.items()],
        "[[events.engines]]", 'name = "e0"', f'source = "{engine.endpoint}"',
        f'source_replay = "{engine.replay}"', f'endpoint = "{merged}"',
        f'replay_endpoint = "{replay}"']) + "\n")
    d = start_daemon(tmp / "node", env={"KVSTORE_CONFIG": str(cfg)})
    return d, merged, replay


def until(sub: Sub, want: set[int], deadline_s: float) -> list[dict] | None:
    """The merged stream's events once the router holds exactly `want` on GPU; None if it
    does not within `deadline_s`."""
    end = time.monotonic() + deadline_s
    while True:
        evs = sub.events()
        if held(evs).get("GPU", set()) == want:
            return evs
        if time.monotonic() > end:
            return None
        sub.pump()


def settle(engine: Engine, sub: Sub, want: set[int], tag: str) -> list[dict]:
    """Publish one-block stores ("probes", added to `want`) until the merged stream holds
    `want` on GPU: a batch the relay missed (sent before its SUB socket joined, or dropped on
    the way) shows only as a gap in the numbers at the next one."""
    end = time.monotonic() + 2 * DEADLINE_S
    for i in range(10000):
        probe = chain(f"{tag}-{i}", 1)[0]
        engine.publish(stores([probe]))
        want.add(u64(probe))
        evs = until(sub, want, 2.0)
        if evs is not None:
            return evs
        if time.monotonic() > end:
            break
    got = held(sub.events()).get("GPU", set())
    raise AssertionError(f"{tag}: {len(want - got)} of the engine's {len(want)} blocks are "
                         f"missing at the router, {len(got - want)} too many")


def test_a_restarted_daemon_credits_the_gpu_blocks_the_engine_stored_while_it_was_down(
        tmp_path):
    _need_vllm()
    engine = Engine(tmp_path)
    d = sub = None
    try:
        d, merged, replay = daemon_with(tmp_path, engine)
        a, b, c = chain(1, 4), chain(2, 3), chain(3, 2)
        sub = Sub(merged, replay)
        engine.publish(stores(a))
        live = {u64(h) for h in a}
        settle(engine, sub, live, "up")
        sub.close()
        sub = None
        d.stop()
        # while the daemon is down the engine stores b and drops half of a
        engine.publish(stores(b), [{"removed": [h.hex() for h in a[2:]]}])
        d.start()
        sub = Sub(merged, replay)
        want = live - {u64(h) for h in a[2:]} | {u64(h) for h in b}
        evs = sub.wait(lambda e: held(e).get("GPU") == want, what="the engine's blocks")
        gpu = {e["block_hashes"][0]: e["token_ids"] for e in stored(evs, "GPU")}
        assert all(gpu[u64(h)] == tokens_of(h, T) for h in b)
        # the engine's adapter stores b's last block by hash alone: the daemon names it with
        # the token ids it learned from the replay
        from kvstore_client.vllm.keyspace import fold_key
        layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_tokens=T,
                          dtype="float16")
        with connect(d.address) as client:
            ns = client.namespace(layout, model="m", hash_scheme="external:vllm-sha256-0123")
            kv = np.ones((2, 2, T, 2, 16), np.float16)
            assert ns.store_keys([fold_key(b[2] + bytes(4))], kv) == 1
            evs = sub.wait(lambda e: held(e).get("CPU") == {u64(b[2])}, what="a named chunk")
            [cpu] = stored(evs, "CPU")
            assert cpu["token_ids"] == tokens_of(b[2], T)
            assert cpu["parent_block_hash"] == u64(b[1])
            # the engine goes on: its next batch is forwarded, the stream not started over
            engine.publish(stores(c))
            want |= {u64(h) for h in c}
            evs = settle(engine, sub, want, "after")
            assert [e["type"] for e in evs].count("AllBlocksCleared") == 1
            counters = client.stats()["counters"]
        assert counters["events_relay_replays"] >= 1, counters
        assert counters["events_relay_restarts"] == 0, counters
    finally:
        if sub is not None:
            sub.close()
        if d is not None:
            cleanup(d)
        engine.close()


def test_a_gap_in_the_engines_numbers_is_fetched_from_its_replay_socket(tmp_path):
    # While the daemon is stopped, what the engine sends it waits in the engine's PUB queue
    # (16 batches) and one Unix socket's buffers (a few hundred KB), far below the burst:
    # the rest is dropped.
    _need_vllm()
    engine = Engine(tmp_path, hwm=16)
    d = sub = None
    try:
        d, merged, replay = daemon_with(tmp_path, engine)
        sub = Sub(merged, replay)
        want: set[int] = set()
        settle(engine, sub, want, "up")
        bs = 2048                   # about 6 KB of token ids a batch: 600 batches, ~4 MB
        burst = chain("burst", 600)
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            engine.publish(*[stores([h], bs=bs) for h in burst])
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        # the tail of the burst was dropped: only the engine's next batch shows the gap
        want |= {u64(h) for h in burst}
        settle(engine, sub, want, "after")
        with connect(d.address) as client:
            counters = client.stats()["counters"]
        # the burst did lose batches on the way, and the replay brought them all
        assert counters["events_relay_gaps"] >= 1, counters
        assert counters["events_relay_replays"] >= 2, counters        # the start, the gap
        assert counters["events_relay_replay_missed"] == 0, counters
    finally:
        if sub is not None:
            sub.close()
        if d is not None:
            cleanup(d)
        engine.close()
