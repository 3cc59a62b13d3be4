"""A long replay to a stalled reader: vLLM's ROUTER drops what does not fit, the relay asks again.

vLLM's own ZmqEventPublisher (in `.venv-vllm`) holds 10000 batches of ~7 KB, its default
`buffer_steps`. kvstore's Replay (kvstore/events/replay.py), in a process of its own, asks it
for all of them, and that process is stopped (SIGSTOP) while the engine serves the answer: the
engine's ROUTER drops what its pipe and the sockets' buffers cannot take (the tail, end marker
included). Continued, the reader must still end up with every batch, in order, byte for byte
(it asks again from the first missing number), the end marker seen, in a few requests.

The engine is driven from here line by line: it says when a replay request waits, serves it
on the word, and says when it has (vLLM's own `_service_replay` does the serving).
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.events_helpers import ROOT, Lines, free_port
from tests.test_events_replay import VLLM_PY, _need_vllm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N = 10000                   # vLLM's default buffer_steps
PER = 64                    # blocks per batch: ~7 KB a batch, ~70 MB in all, past what the
                            # ROUTER's pipe and both TCP buffers (32 MiB at most) hold
READY_S = 300.0             # importing vLLM and encoding the batches on a loaded machine
DEADLINE_S = 120.0          # each step of the exchange
REPLAY_S = 60.0             # the reader's replay deadline, from its first request

# vLLM's publisher with N batches in its buffer; before serving each replay request it prints
# {"asked": true} and waits for a stdin line (read by the main thread), then prints
# {"served": true}.
ENGINE = """
import hashlib, json, sys, threading, time
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher
endpoint, replay, n, per = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, buffer_steps=n)
serve, go = pub._service_replay, threading.Event()
def gated():
    print(json.dumps({"asked": True}), flush=True)
    go.wait()
    go.clear()
    serve()
    print(json.dumps({"served": True}), flush=True)
pub._service_replay = gated
for i in range(n):
    hs = [hashlib.sha256(f"{i}-{j}".encode()).digest() for j in range(per)]
    pub.publish(KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=hs, parent_block_hash=None, token_ids=[100000 + i] * (16 * per),
        block_size=16, lora_id=None, medium="GPU", lora_name=None)]))
pub._event_queue.join()
digest = hashlib.sha256(b"".join(p for _, p in pub._buffer)).hexdigest()
print(json.dumps({"ready": len(pub._buffer), "digest": digest}), flush=True)
for line in sys.stdin:
    go.set()
"""

# kvstore's Replay from 0; prints what it got once it ended.
READER = """
import hashlib, json, sys, threading, zmq
from kvstore.events.replay import Replay
done = threading.Event()
rep = Replay(zmq.Context(), sys.argv[1], 0, 1 << 30, done.set, deadline_s=float(sys.argv[2]))
done.wait()
res = rep.result
seqs = [s for s, _ in res.batches]
print(json.dumps({"complete": res.complete, "why": res.why, "n": len(seqs),
                  "in_order": seqs == list(range(len(seqs))),
                  "rounds": getattr(res, "rounds", 1),
                  "digest": hashlib.sha256(b"".join(p for _, p in res.batches)).hexdigest()}),
      flush=True)
"""


def test_a_replay_the_engine_dropped_to_a_stalled_reader_arrives_whole(tmp_path):
    _need_vllm()
    d = Path(tempfile.mkdtemp(prefix="kvs-rr-"))
    replay = f"tcp://127.0.0.1:{free_port()}"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    log = open(tmp_path / "engine.log", "wb")
    engine = subprocess.Popen([str(VLLM_PY), "-c", ENGINE, f"ipc://{d}/events", replay,
                               str(N), str(PER)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(tmp_path))
    reader = None
    try:
        eng = Lines(engine, "the engine")
        ready = eng.next(READY_S)
        assert ready["ready"] == N, ready
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, replay, str(REPLAY_S)], stdout=subprocess.PIPE,
            env=dict(env, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "client")])))
        out = Lines(reader, "the reader")
        # the first request: the reader is stopped while the engine serves the whole answer
        assert eng.next(DEADLINE_S) == {"asked": True}
        os.kill(reader.pid, signal.SIGSTOP)
        try:
            engine.stdin.write(b"go\n")
            engine.stdin.flush()
            assert eng.next(DEADLINE_S) == {"served": True}
        finally:
            os.kill(reader.pid, signal.SIGCONT)
        # the reader goes on: every further request is served at once, until it has ended
        asked = 1
        end = time.monotonic() + DEADLINE_S
        while not out.ready():
            assert time.monotonic() < end, "the reader did not end"
            select.select([engine.stdout, reader.stdout], [], [], 0.1)
            if eng.ready():
                assert eng.next(DEADLINE_S) == {"asked": True}
                asked += 1
                engine.stdin.write(b"go\n")
                engine.stdin.flush()
                assert eng.next(DEADLINE_S) == {"served": True}
        got = out.next(DEADLINE_S)
        assert (got["complete"], got["n"], got["in_order"], got["why"]) == \
            (True, N, True, ""), got
        assert got["digest"] == ready["digest"]
        # it asked again: the first answer lost batches (its tail, to the stopped reader)
        assert 1 < got["rounds"] == asked, (got, asked)
    finally:
        if reader is not None and reader.poll() is None:
            reader.kill()
            reader.wait(10)
        try:
            engine.stdin.close()
            engine.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            engine.kill()
            engine.wait(10)
        log.close()
        shutil.rmtree(d, ignore_errors=True)
