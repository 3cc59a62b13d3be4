"""Prefetch is shared work: one tenant's burst of Locate(prefetch) must not starve another's.

The daemon promotes ahead on one thread. With a single queue, a tenant that asked for more
blocks than the queue holds had every other tenant's prefetch refused until its own burst was
done. These run a real daemon with two tenants whose blocks sit on SSD.
"""

from __future__ import annotations

import textwrap
import time

import kvstore_client
import numpy as np
from kvstore_client import KVLayout
from kvstore_client._proto import kvstore_pb2 as pb

from kvstore.tenants import hash_token
from tests.daemon import cleanup, start_daemon

TOKENS = {"a": "token-of-tenant-a", "b": "token-of-tenant-b"}
NBYTES = 4096
QUEUE, PER_TENANT = 4096, 1024          # kvstore/prefetch.py's defaults


def _layout() -> KVLayout:
    return KVLayout(0, 0, 0, 0, "uint8", engine_layout="engine:opaque",
                    block_bytes_opaque=NBYTES)


def _store(ns, n: int, tag: int) -> list[bytes]:
    keys = [bytes([tag]) + i.to_bytes(4, "big") * 4 + b"\0" * 15 for i in range(n)]

    def fill(base, offsets, first):
        for j, off in enumerate(offsets):
            base[off:off + NBYTES] = (first + j) % 251
    for i in range(0, n, 512):
        assert ns.store_blocks(keys[i:i + 512], fill if i == 0 else _shifted(fill, i)) == \
            len(keys[i:i + 512])
    return keys


def _shifted(fill, by: int):
    return lambda base, offsets, first: fill(base, offsets, first + by)


def test_one_tenants_burst_leaves_room_and_turns_for_another(tmp_path):
    tf = tmp_path / "tenants.toml"
    tf.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(TOKENS['a'])}"
        host_quota = "32MiB"
        [tenants.b]
        token_sha256 = "{hash_token(TOKENS['b'])}"
        host_quota = "32MiB"
    """))
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tf), "host.capacity": "128MiB",
                                "ssd.capacity": "256MiB"})
    try:
        with kvstore_client.connect(d.address, token=TOKENS["a"]) as ca, \
                kvstore_client.connect(d.address, token=TOKENS["b"]) as cb:
            lay = _layout()
            ns_a = ca.namespace(lay, model="engine", hash_scheme="external:test-v1")
            ns_b = cb.namespace(lay, model="engine", hash_scheme="external:test-v1")
            keys_a = _store(ns_a, 4, 1)
            keys_b = _store(ns_b, QUEUE + 200, 2)   # more than the whole queue holds
            ca.evict("host")
            cb.evict("host")
            assert ns_a.locate(keys_a) == ["ssd"] * 4
            assert ns_b.locate(keys_b[:8]) == ["ssd"] * 8

            # B's burst: only its own share is queued, the rest refused (it retries later)
            queued_b = cb.call("Locate", pb.LocateRequest(
                namespace_id=ns_b.ns_id, keys=keys_b, prefetch=True)).prefetching
            assert queued_b == PER_TENANT
            # A still gets its prefetch queued, and served between B's turns
            queued_a = ca.call("Locate", pb.LocateRequest(
                namespace_id=ns_a.ns_id, keys=keys_a, prefetch=True)).prefetching
            assert queued_a == 4
            deadline = time.monotonic() + 30
            while ns_a.locate(keys_a) != ["host"] * 4:
                assert time.monotonic() < deadline, "A's prefetch was not served"
                time.sleep(0.02)

            # B's share frees as it is served: a later burst is queued again
            deadline = time.monotonic() + 60
            while ns_b.locate(keys_b[:PER_TENANT]).count("host") < PER_TENANT:
                assert time.monotonic() < deadline, "B's prefetch was not served"
                time.sleep(0.05)
            again = cb.call("Locate", pb.LocateRequest(
                namespace_id=ns_b.ns_id, keys=keys_b[PER_TENANT:], prefetch=True)).prefetching
            assert again == PER_TENANT
            got = {}

            def drain(base, offsets, first):
                for j, off in enumerate(offsets):
                    got[first + j] = np.asarray(base[off:off + NBYTES]).copy()
            ns_a.load_blocks(keys_a, drain)
            assert all((got[i] == i % 251).all() for i in range(4))
    finally:
        cleanup(d)
