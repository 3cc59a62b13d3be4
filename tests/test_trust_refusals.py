"""Refused calls: what they cost the daemon.

A peer can make the daemon refuse calls in a loop (no token, a tenant out of its refusal
budget); each refusal must cost the daemon as little as grpcio allows.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import grpc
import pytest

from kvstore.tenants import hash_token
from tests.daemon import cleanup, start_daemon
from tests.trust_net_helpers import TOKENS, channel, settled

BURST = 5
LEASES = 40                          # limits.leases_per_tenant
NAMESPACES = 4                       # limits.namespaces_per_tenant


def settings(tmp: Path) -> dict:
    tokens = tmp / "tenants.toml"
    tokens.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(TOKENS['a'])}"
        host_quota = "8MiB"     # a pool of its own: it may hold leases
        [tenants.b]
        token_sha256 = "{hash_token(TOKENS['b'])}"
    """))
    # a budget that refills slowly, so that a lockout would last the whole test
    return {"auth.tokens_file": str(tokens), "limits.refusals_per_s": 0.2,
            "limits.refusal_burst": BURST, "limits.leases_per_tenant": LEASES,
            "limits.namespaces_per_tenant": NAMESPACES}


def test_refusals_take_no_worker_thread(tmp_path: Path) -> None:
    """A peer without a token can make the daemon refuse calls in a loop. Each refusal went
    through grpcio's thread pool (a worker woken, a context built, two batches posted); it is
    answered on grpcio's serving thread instead (kvstore/refusal.py), so a flood of them
    starts no worker thread and wakes none, whatever grpcio is pinned to."""
    from concurrent.futures import ThreadPoolExecutor

    from kvstore import refusal
    assert refusal.install(), "this grpcio lacks the rejection path kvstore/refusal.py uses"
    d = start_daemon(tmp_path, settings(tmp_path))
    try:
        settled(d)                           # its after-start threads have come and gone
        with channel(d.address) as ch:
            lookup = ch.unary_unary("/kvstore.v1.KVStore/Lookup",
                                    request_serializer=lambda b: b,
                                    response_deserializer=lambda b: b)
            put = ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                                  response_deserializer=lambda b: b)

            def refused(i: int) -> tuple:
                with pytest.raises(grpc.RpcError) as ei:
                    if i % 2:
                        lookup(b"\x0a\x10" + b"\x01" * 16, timeout=10)
                    else:
                        put(iter([b"\x0a\x10" + b"\x01" * 16]), timeout=10)
                return ei.value.code(), "no credentials" in ei.value.details()

            refused(0)                       # the channel connected, grpcio's threads up
            tasks = Path(f"/proc/{d.proc.pid}/task")
            before = len(list(tasks.iterdir()))
            with ThreadPoolExecutor(16) as pool:
                answers = set(pool.map(refused, range(256)))
            after = len(list(tasks.iterdir()))
        assert answers == {(grpc.StatusCode.UNAUTHENTICATED, True)}, answers
        assert after <= before + 1, (before, after)
    finally:
        cleanup(d)
