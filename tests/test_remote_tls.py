"""Remote tier over TLS with a password, against real TLS-only redis-servers (no mocks).

The servers listen on a TLS port only (`--port 0`), require a client certificate signed by the
test CA (`--tls-auth-clients yes`) and a password (`--requirepass`). Certificates are made in
Python with `trustme` (tests/redis_fixtures.py: `make_tls_files`).

What is pinned here: `tls`/`tls_ca_file`/`tls_cert_file`/`tls_key_file`/`password` round-trip
framed blocks byte-exactly (stored sealed, tiers/remote/envelope.py); a `rediss://` URL switches
TLS on by itself (and carries the password); a wrong or missing password, a missing client
certificate and an untrusted server CA each leave the tier down, every call a miss within the
deadline, never an exception through the non-raising API, and `stats["last_error"]` naming the
cause; a TLS cluster (TLS on the cluster bus too) works across nodes, one batch per node.
"""

from __future__ import annotations

import socket
import time

import pytest
from kvstore_client.errors import Unavailable

from tests.redis_fixtures import RedisProc, TlsFiles, make_tls_files, start_cluster, start_redis
from tests.test_remote_tier import (
    MARGIN_S,
    Cfg,
    cmd_calls,
    framed,
    gkeys,
    pairs,
    per_node_counts,
    sealed,
    stored,
    wait_until,
)
from tiers.frame import unframe
from tiers.remote import RemoteTier, make_key

pytestmark = pytest.mark.redis

PASSWORD = "kvs-test-secret"
OK_DEADLINE_MS = 2000


@pytest.fixture(name="tls_files", scope="module")
def tls_files_fixture(tmp_path_factory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls"))


@pytest.fixture(name="tls_server", scope="module")
def tls_server_fixture(tmp_path_factory, tls_files) -> RedisProc:
    """One TLS-only, password-protected server shared by the module (tests only add keys)."""
    proc = start_redis(tmp_path_factory.mktemp("tls-redis"), tls=tls_files, password=PASSWORD)
    yield proc
    proc.kill()


def tls_cfg(files: TlsFiles, urls: list[str], **kw) -> Cfg:
    """Mutual TLS and the password, as a daemon's [remote] section would set them; `kw`
    overrides single settings. The deadline is generous: these tests are about TLS and auth
    on a shared 2-core machine (deadlines are pinned in test_remote_tier.py)."""
    base = dict(urls=urls, tls=True, tls_ca_file=str(files.ca),
                tls_cert_file=str(files.client_cert), tls_key_file=str(files.client_key),
                password=PASSWORD, deadline_ms=OK_DEADLINE_MS)
    return Cfg(**{**base, **kw})


def round_trip(t: RemoteTier, server: RedisProc, n: int = 6) -> None:
    """Write framed blocks (small to 2 MiB) and read them back byte-exact, framed and unframed;
    they are stored sealed (seal + frame)."""
    keys = gkeys(n)
    vals = [framed((1 << 21) if i == 0 else 1000 * (i + 1), seed=i) for i in range(n)]
    assert t.put_many(pairs(keys, vals)) == stored(vals)
    assert t.exists_many(keys + gkeys(1)) == [True] * n + [False]
    assert t.get_many(keys) == vals
    got = t.get_many(keys[:2], unframed=True)
    assert [(c, r, bytes(p), cs) for c, r, p, cs, _ in got] == [
        (c, r, bytes(p), 0) for c, r, p in map(unframe, vals[:2])]
    assert server.client().get(make_key(b"kvs:", keys[1])) == sealed(keys[1], vals[1])
    s = t.stats
    assert s["up"] and s["errors"] == 0 and s["corrupt"] == 0 and s["last_error"] == ""


# ---------------------------------------------------------------------------------- working


def test_fixture_server_is_tls_only(tls_server):
    """The server really refuses plaintext, so the round trips below went over TLS."""
    with socket.create_connection((tls_server.host, tls_server.port), timeout=0.5) as s:
        s.sendall(b"PING\r\n")
        try:
            reply = s.recv(64)
        except OSError:             # reset or timeout: a TLS server does not speak RESP
            reply = b""
    assert not reply.startswith(b"+PONG")
    assert tls_server.client().ping()


def test_mutual_tls_and_password_round_trip(tls_server, tls_files):
    """`tls = true` with a plain redis:// URL: the setting alone switches TLS on."""
    url = f"redis://{tls_server.host}:{tls_server.port}"
    with RemoteTier(tls_cfg(tls_files, [url])) as t:
        round_trip(t, tls_server)


def test_rediss_url_switches_tls_on(tls_server, tls_files):
    """`tls = false` but a rediss:// URL (with the password in it): TLS with the configured CA
    and client certificate. (This raised TypeError in the constructor before.)"""
    url = f"rediss://:{PASSWORD}@{tls_server.host}:{tls_server.port}"
    with RemoteTier(tls_cfg(tls_files, [url], tls=False, password="")) as t:
        round_trip(t, tls_server)


# ---------------------------------------------------------------------------------- failing

# name -> (config changes, what last_error must say)
FAILURES = {
    "wrong password": ({"password": "not-the-password"}, "authentication failed"),
    "no password": ({"password": ""}, "authentication failed"),
    "no client certificate": ({"tls_cert_file": "", "tls_key_file": ""},
                              "require a client certificate"),
    "untrusted server CA": ({"tls_ca_file": "other-ca"}, "certificate verify failed"),
}


# The misconfiguration tests give the tier a deadline with room for a TLS handshake on a loaded
# 2-core machine: a handshake that runs past the deadline is reported as "no answer within N ms",
# which is true but hides the cause these tests are about (a later probe then records it).
FAIL_DEADLINE_MS = 1000


def failing_cfg(case: str, tls_files: TlsFiles, url: str, tmp_path) -> Cfg:
    changes, _ = FAILURES[case]
    if changes.get("tls_ca_file") == "other-ca":   # a CA that did not sign the server's cert
        changes = {**changes, "tls_ca_file": str(make_tls_files(tmp_path / "other").ca)}
    return tls_cfg(tls_files, [url], deadline_ms=FAIL_DEADLINE_MS, **changes)


def timed(fn, *args):
    t0 = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - t0


def names_cause(t: RemoteTier, keys: list[bytes], want: str) -> bool:
    """One more call (a down node is only probed when calls come in), then: does the tier's
    last error say `want`?"""
    t.exists_many(keys)
    return want in t.stats["last_error"]


@pytest.mark.parametrize("case", list(FAILURES))
def test_misconfigured_client_is_down_with_a_named_cause(case, tls_server, tls_files, tmp_path):
    """Each misconfiguration: the tier is built, every call is a miss within the deadline and
    nothing raises; the tier reads "down" and says why, and stays down (its probes fail the
    same way) instead of flapping."""
    cfg = failing_cfg(case, tls_files, tls_server.url, tmp_path)
    want = FAILURES[case][1]
    keys = gkeys(4)
    vals = [framed(1000, seed=i) for i in range(4)]
    with RemoteTier(cfg) as t:
        for _ in range(5):          # first call fails on the wire; later ones skip or re-probe
            for out, dt in (timed(t.exists_many, keys), timed(t.get_many, keys),
                            timed(t.put_many, pairs(keys, vals))):
                assert out in ([False] * 4, [None] * 4, 0)
                assert dt < FAIL_DEADLINE_MS / 1000 + MARGIN_S
            time.sleep(0.05)
        assert wait_until(lambda: names_cause(t, keys, want)), t.stats["last_error"]
        s = t.stats
        assert not s["up"] and s["errors"] >= 1 and s["hits"] == 0 and s["probes"] >= 1
        assert want in s["nodes"]["standalone"]["last_error"]
    # nothing was written behind the failure
    assert tls_server.client().exists(*[make_key(b"kvs:", k) for k in keys]) == 0
    # a tier that raises says the same in its exception (a long wait: the cause, not a timeout)
    with RemoteTier(cfg, raise_errors=True) as strict:
        with pytest.raises(Unavailable, match=want):
            strict.exists_many(keys, deadline_s=5.0)


# ---------------------------------------------------------------------------------- cluster


def test_tls_cluster_round_trip_across_nodes(tmp_path, tls_files):
    """Three TLS-only nodes (client port and cluster bus), password on every node: the tier's
    cluster path (RedisCluster with our TLS options) discovers them over TLS, spreads keys and
    sends one batch per node; a wrong password leaves the topology unknown and says why."""
    cluster = start_cluster(tmp_path / "c", tls=tls_files, password=PASSWORD)
    try:
        assert all(u.startswith("rediss://") for u in cluster.urls)
        with RemoteTier(tls_cfg(tls_files, cluster.urls, cluster=True, key_prefix="tls:")) as t:
            assert t.wait_ready()
            keys = gkeys(48)
            vals = [framed(2000, seed=i) for i in range(48)]
            assert t.put_many(pairs(keys, vals)) == stored(vals)
            counts = per_node_counts(cluster, b"tls:")
            assert sum(counts) == 48 and sum(1 for c in counts if c) >= 2, counts
            clients = [n.client() for n in cluster.nodes]
            rt0, gets0 = t.stats["round_trips"], [cmd_calls(c, "getrange") for c in clients]
            assert t.get_many(keys) == vals
            gets = [cmd_calls(c, "getrange") - g for c, g in zip(clients, gets0, strict=True)]
            assert gets == counts
            assert t.stats["round_trips"] - rt0 == sum(1 for c in counts if c)
            assert t.stats["up"] and t.stats["errors"] == 0

        bad = tls_cfg(tls_files, cluster.urls, cluster=True, password="not-the-password")
        with RemoteTier(bad) as t:
            assert not t.wait_ready(timeout=1.0)
            # the discovery fails (in the background, however long a loaded machine takes)
            assert wait_until(lambda: "authentication failed" in
                              t.stats["topology"]["last_error"], 20), t.stats["topology"]
            out, dt = timed(t.get_many, keys)
            assert out == [None] * 48 and dt < OK_DEADLINE_MS / 1000 + MARGIN_S
            s = t.stats
            assert not s["up"] and "authentication failed" in s["topology"]["last_error"]
            assert "authentication failed" in s["last_error"]
    finally:
        for node in cluster.nodes:
            node.kill()

