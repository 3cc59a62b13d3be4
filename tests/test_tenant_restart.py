"""Tenants across a daemon restart, against real daemons on one data folder (docs/security.md):

- namespaces registered while the daemon had no tenants belong to nobody once tenants are
  configured: only admins reach them, other tenants get PERMISSION_DENIED;
- a client identified by its uid (the `<socket>.auth` handshake) holds a session that ends with
  the daemon run that issued it; after a restart the SDK makes a new one by itself, and the old
  session token is refused.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import grpc
import pytest
import torch
from kvstore_client import connect
from kvstore_client._proto import kvstore_pb2 as pb
from kvstore_client._proto import kvstore_pb2_grpc as pbg
from kvstore_client.wire import decode_get

from kvstore.tenants import hash_token
from tests.daemon import cleanup, start_daemon
from tests.kv_data import LAYOUT, T, make_kv, prompt

TOKENS = {"team-a": "token-of-a", "ops": "token-of-ops"}


def block_bytes(kv: torch.Tensor, i: int) -> bytes:
    """Block i of a [L, 2, tokens, H, D] tensor as the store holds it."""
    return kv[:, :, i * T:(i + 1) * T].contiguous().view(torch.int16).numpy().tobytes()


def md(tenant: str) -> tuple:
    return (("authorization", f"Bearer {TOKENS[tenant]}"),)


def test_namespaces_from_before_tenants_are_reached_by_admins_only(tmp_path: Path) -> None:
    d = start_daemon(tmp_path)                           # no tenants: one implicit tenant
    try:
        ids, kv = prompt(1, 4), make_kv(1, 4)
        with connect(d.address) as c:
            ns = c.namespace(LAYOUT, model="a-legacy")
            assert ns.store(ids, kv) == 4
            old, keys = ns.ns_id, ns.keys(ids)
        assert d.stop() == 0                             # host blocks are written to SSD
        tenants = tmp_path / "tenants.toml"
        tenants.write_text(textwrap.dedent(f"""
            [tenants.team-a]
            token_sha256 = "{hash_token(TOKENS['team-a'])}"
            models = ["a-*"]
            [tenants.ops]
            token_sha256 = "{hash_token(TOKENS['ops'])}"
            admin = true
        """))
        d.settings["auth.tokens_file"] = str(tenants)
        d.start()
        with d.channel() as ch:
            stub = pbg.KVStoreStub(ch)
            # A tenant, even one whose models match, cannot use the ownerless namespace ...
            for call in (lambda: stub.Lookup(pb.LookupRequest(namespace_id=old, keys=keys),
                                             metadata=md("team-a"), timeout=30),
                         lambda: stub.Acquire(pb.AcquireRequest(namespace_id=old, keys=keys),
                                              metadata=md("team-a"), timeout=30),
                         lambda: list(stub.Get(pb.GetRequest(namespace_id=old, keys=keys),
                                               metadata=md("team-a"), timeout=30))):
                with pytest.raises(grpc.RpcError) as ei:
                    call()
                # docs/security.md: the answer an id nobody registered gets, word for word
                assert ei.value.code() == grpc.StatusCode.NOT_FOUND
                assert ei.value.details().startswith(
                    f"unknown namespace {old.hex()}; register it first"), ei.value.details()
            # ... registering the same model gives it a namespace of its own, empty ...
            with connect(d.address, token=TOKENS["team-a"], transport="grpc") as a:
                mine = a.namespace(LAYOUT, model="a-legacy")
                assert mine.ns_id != old and mine.lookup(ids) == 0
                assert a.stats()["namespaces"] == 1      # and its Stats shows only that one
            # ... and an admin reaches it, blocks intact.
            got = stub.Lookup(pb.LookupRequest(namespace_id=old, keys=keys), metadata=md("ops"),
                              timeout=30)
            assert got.prefix_blocks == 4
            data = b"".join(bytes(m.SerializeToString()) for m in stub.Get(
                pb.GetRequest(namespace_id=old, keys=keys), metadata=md("ops"), timeout=30))
            blocks = {k: data[off:off + n] for k, off, n in decode_get(data)}
            assert [blocks[k] for k in keys] == [block_bytes(kv, i) for i in range(4)]
    finally:
        cleanup(d)


def test_a_uid_session_is_renewed_after_a_restart_and_the_old_one_refused(tmp_path) -> None:
    """uid 0 (this process) is a tenant with a pool of its own: the session brings its pool fd,
    and after the restart the SDK needs a new session for a new fd as well as for the token."""
    tenants = tmp_path / "tenants.toml"
    tenants.write_text(textwrap.dedent("""
        [tenants.root-procs]
        uids = [0]
        host_quota = "4MiB"
    """))
    d = start_daemon(tmp_path / "run", {"auth.tokens_file": str(tenants)})
    try:
        ids, kv = prompt(2, 4), make_kv(2, 4)
        with connect(d.address, transport="shm") as c:
            ns = c.namespace(LAYOUT, model="m")
            assert c.tenant == "root-procs" and c.pool.fd_backed
            assert ns.store(ids, kv) == 4
            old_token = c._session.token
            d.restart()
            with d.channel() as ch:                      # the old session died with its run
                with pytest.raises(grpc.RpcError) as ei:
                    pbg.KVStoreStub(ch).Stats(pb.StatsRequest(), timeout=30, metadata=(
                        ("authorization", f"Bearer {old_token}"),))
                assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED
            out = torch.zeros_like(kv)
            assert ns.load(ids, out) == 4 * T            # the same client carries on
            assert torch.equal(out.view(torch.int16), kv.view(torch.int16))
            assert c._session.token != old_token and c.tenant == "root-procs"
            assert c.session_current()
            ids2, kv2 = prompt(3, 4), make_kv(3, 4)
            assert ns.store(ids2, kv2) == 4              # into the new run's pool
            out2 = torch.zeros_like(kv2)
            assert ns.load(ids2, out2) == 4 * T
            assert torch.equal(out2.view(torch.int16), kv2.view(torch.int16))
    finally:
        cleanup(d)
