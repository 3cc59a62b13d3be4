"""What an unauthenticated peer of the KV events endpoints can cost a real `kvstore serve`:
long subscriptions do not grow its memory (libzmq would keep each in its
subscription trie for the whole connection), a replay flooder that never reads does not hold
a core, and events with tenants need the operator's explicit opt-in."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from kvstore_client import KVLayout, connect

from kvstore.config import ConfigError, load_config
from tests.daemon import cleanup, start_daemon
from tests.events_helpers import Sub, firsts, stored, zmq
from tests.test_events_daemon import EVENTS, streams_of

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16, dtype="float16")
T = LAYOUT.block_tokens
HUGE_SUBSCRIBER = """
import os, sys, time, zmq
socks = []
for i in range(2):
    s = zmq.Context.instance().socket(zmq.SUB)
    s.connect(sys.argv[1])
    s.setsockopt(zmq.SUBSCRIBE, bytes([65 + i]) * (4 << 20))
    socks.append(s)
time.sleep(2.5)
os._exit(0)
"""


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def store(ns, first: int, blocks: int) -> np.ndarray:
    tokens = np.arange(first, first + blocks * T)
    ns.store(tokens, np.zeros((1, 2, len(tokens), 1, 16), np.float16))
    return tokens


def test_huge_subscriptions_do_not_grow_the_daemon(tmp_path):
    d = start_daemon(tmp_path, EVENTS)
    ctx = zmq.Context()
    peers = []
    sub = None
    try:
        pid = d.proc.pid
        pub, replay = streams_of(d)["node"]
        sub = Sub(pub, replay)
        time.sleep(1.5)                     # the first announcement is out
        before = rss_mib(pid)
        # two 4 MiB subscriptions (each made the daemon ~200 MiB larger before)
        # The huge ones from a process that exits without closing: libzmq's own SUB frees a
        # 4 MiB-deep trie by recursion, which overflows the stack.
        big = subprocess.Popen([sys.executable, "-c", HUGE_SUBSCRIBER, pub])
        assert big.stdout is None
        big.wait(timeout=60)
        grown = rss_mib(pid) - before
        assert grown < 32, f"daemon RSS grew {grown:.0f} MiB"
        # an ordinary subscriber still gets what is stored
        client = connect(d.address)
        ns = client.namespace(model="m", layout=LAYOUT)
        tokens = store(ns, 7000, 3)
        evs = sub.wait(lambda e: len(firsts(stored(e, "CPU"))) == 3, what="stored")
        assert [t for e in firsts(stored(evs, "CPU")) for t in e["token_ids"]] == \
            tokens.tolist()
        client.close()
        assert d.proc.poll() is None
    finally:
        for p in peers:
            p.close(0)
        ctx.term()
        if sub is not None:
            sub.close()
        cleanup(d)


def test_a_replay_flooder_that_never_reads_does_not_hold_a_core(tmp_path):
    d = start_daemon(tmp_path, {**EVENTS, "events.batch_events": "1",
                                "host.capacity": "64MiB"})
    ctx = zmq.Context()
    stop = threading.Event()
    th = None
    try:
        pid = d.proc.pid
        pub, replay = streams_of(d)["node"]
        client = connect(d.address)
        ns = client.namespace(model="m", layout=LAYOUT)
        for i in range(4):                  # 2000 blocks: 2000 batches to replay
            store(ns, i * 10**6, 500)
        sub = Sub(pub, replay)
        sub.wait(lambda e: len(e) >= 2000, what="the blocks")
        sub.close()
        malformed = ctx.socket(zmq.DEALER)       # a request past the frame limit: dropped
        malformed.setsockopt(zmq.LINGER, 0)
        malformed.connect(replay)
        malformed.send_multipart([b"", b"x" * (1 << 20)])

        def flood() -> None:
            a = ctx.socket(zmq.DEALER)
            a.setsockopt(zmq.SNDHWM, 0)
            a.setsockopt(zmq.LINGER, 0)
            a.connect(replay)
            while not stop.is_set():
                a.send_multipart([b"", (0).to_bytes(8, "big")])
                time.sleep(0.005)
            a.close(0)

        th = threading.Thread(target=flood)
        th.start()
        time.sleep(1.0)
        c0, t0 = cpu_s(pid), time.monotonic()
        time.sleep(2.0)
        used, took = cpu_s(pid) - c0, time.monotonic() - t0
        assert used < 0.5 * took / 2.0, f"daemon used {used:.2f} s CPU in {took:.1f} s"
        # an honest replay is still answered, whole
        sub = Sub(pub, replay)
        assert len(sub.batches) >= 2000
        sub.close()
        malformed.close(0)
        client.close()
    finally:
        stop.set()
        if th is not None:
            th.join()
        ctx.term()
        cleanup(d)


def test_events_with_tenants_need_the_opt_in(tmp_path):
    tf = tmp_path / "tenants.toml"
    tf.write_text('[tenants.team-a]\ntoken_sha256 = "%s"\n' % ("0" * 64))
    auth = {"tokens_file": str(tf)}

    def cfg(events: dict, **more):
        return load_config(overrides={"events": events, **more}, environ={})

    with pytest.raises(ConfigError, match="allow_with_tenants"):
        cfg({"enabled": True}, auth=auth)
    with pytest.raises(ConfigError, match="every tenant's block hashes and token ids"):
        cfg({"enabled": True}, tenants={"team-a": {"token_sha256": "0" * 64}})
    assert cfg({"enabled": True, "allow_with_tenants": True}, auth=auth).events.enabled
    assert not cfg({}, auth=auth).events.enabled
    assert cfg({"enabled": True}).events.enabled
    assert cfg({"replay_bytes": "1MiB"}).events.replay_bytes == 1 << 20
