"""Stats lists namespaces on request: which models hold the cache, and which sit empty.

An operator's first question of a full cache is which models (revisions, codecs, shards,
tenants) hold it; with namespaces reclaimed when empty at the cap, the second is which ones sit
empty and idle. `Stats(list_namespaces)` answers both from running counts, a tenant seeing only
its own namespaces; `kvstore status --namespaces` prints it, and `kvstore delete --model`
drops a retired model's blocks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from kvstore_client import connect

from kvstore.tenants import hash_token
from tests.daemon import cleanup, start_daemon
from tests.kv_data import LAYOUT, make_kv, prompt

TOKENS = {"a": "token-of-a", "b": "token-of-b", "ops": "token-of-ops"}


def test_each_tenant_sees_its_namespaces_and_an_admin_sees_all(tmp_path) -> None:
    tf = tmp_path / "tenants.toml"
    tf.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(TOKENS['a'])}"
        [tenants.b]
        token_sha256 = "{hash_token(TOKENS['b'])}"
        [tenants.ops]
        token_sha256 = "{hash_token(TOKENS['ops'])}"
        admin = true
    """))
    d = start_daemon(tmp_path, {"auth.tokens_file": str(tf)})
    try:
        with connect(d.address, token=TOKENS["a"], transport="grpc") as a, \
                connect(d.address, token=TOKENS["b"], transport="grpc") as b, \
                connect(d.address, token=TOKENS["ops"], transport="grpc") as ops:
            na = a.namespace(LAYOUT, model="org/a-model", revision="v2")
            assert na.store(prompt(1, 3), make_kv(1, 3)) == 3
            idle = a.namespace(LAYOUT, model="org/a-idle", codec="int8")
            nb = b.namespace(LAYOUT, model="org/b-model", shard_rank=1, shard_size=2)
            assert nb.store(prompt(2, 2), make_kv(2, 2)) == 2

            mine = {n["model"]: n for n in a.stats(namespaces=True)["namespace_list"]}
            assert set(mine) == {"org/a-model", "org/a-idle"}
            m = mine["org/a-model"]
            assert (m["revision"], m["codec"], m["tenant"], m["namespace_id"]) == \
                ("v2", "lossless", "a", na.ns_id)
            assert (m["blocks"], m["host_blocks"], m["ssd_blocks"], m["remote_blocks"]) == \
                (3, 3, 0, 0)
            assert m["block_bytes"] == LAYOUT.block_bytes and 0 <= m["idle_s"] < 60
            e = mine["org/a-idle"]
            assert (e["codec"], e["blocks"], e["leases"]) == ("int8", 0, 0)
            assert e["namespace_id"] == idle.ns_id
            assert list(mine) == ["org/a-model", "org/a-idle"]         # most blocks first

            theirs = b.stats(namespaces=True)["namespace_list"]
            assert [(n["model"], n["shard_rank"], n["shard_size"], n["blocks"], n["tenant"])
                    for n in theirs] == [("org/b-model", 1, 2, 2, "b")]
            assert "namespace_list" not in b.stats()             # only when asked

            ops.flush()
            every = {n["model"]: n for n in ops.stats(namespaces=True)["namespace_list"]}
            assert {"org/a-model", "org/a-idle", "org/b-model"} <= set(every)
            assert every["org/a-model"]["ssd_blocks"] == 3

        # The command line, as an operator runs it (the admin's token).
        env = {**d.env, "KVSTORE_TOKEN": TOKENS["ops"]}
        status = [sys.executable, "-m", "kvstore", "status", "--socket", d.socket,
                  "--namespaces"]
        r = subprocess.run(status, capture_output=True, text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        rows = {ln.split()[0]: ln.split() for ln in r.stdout.splitlines() if ln.strip()}
        assert rows["org/a-model"][:6] == ["org/a-model", "v2", "lossless", "0/1", "a", "3"]
        assert rows["org/b-model"][3:6] == ["1/2", "b", "2"]
        assert rows["org/a-idle"][1:6] == ["-", "int8", "0/1", "a", "0"]
        r = subprocess.run(status + ["--json"], capture_output=True, text=True, timeout=60,
                           env=env)
        listed = {n["model"]: n for n in json.loads(r.stdout)["namespace_list"]}
        assert listed["org/a-model"]["blocks"] == 3
        assert bytes.fromhex(listed["org/a-model"]["namespace_id"]) == na.ns_id

        # `kvstore delete --model`: lists without --yes, deletes with it, a tenant reaching
        # only its own namespaces.
        env_a = {**d.env, "KVSTORE_TOKEN": TOKENS["a"]}
        delete = [sys.executable, "-m", "kvstore", "delete", "--socket", d.socket]
        r = subprocess.run(delete + ["--model", "org/b-*"], capture_output=True, text=True,
                           timeout=60, env=env_a)
        assert r.returncode == 1 and "no namespace of model 'org/b-*'" in r.stderr, r.stderr
        r = subprocess.run(delete + ["--model", "org/a-*"], capture_output=True, text=True,
                           timeout=60, env=env_a)
        assert r.returncode == 0, r.stderr
        assert "3 blocks in 2 namespace(s)" in r.stdout and "--yes" in r.stdout, r.stdout
        r = subprocess.run(delete + ["--model", "org/a-*", "--revision", "v2", "--yes"],
                           capture_output=True, text=True, timeout=60, env=env_a)
        assert r.returncode == 0, r.stderr
        assert "deleted 3 blocks in 1 namespace(s)" in r.stdout, r.stdout
        with connect(d.address, token=TOKENS["ops"], transport="grpc") as ops:
            every = {n["model"]: n for n in ops.stats(namespaces=True)["namespace_list"]}
            assert every["org/a-model"]["blocks"] == 0 and every["org/b-model"]["blocks"] == 2
    finally:
        cleanup(d)
