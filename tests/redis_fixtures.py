"""Real redis-server processes for tests and benchmarks: one standalone server or a small cluster.

Why a helper module and not mocks: the remote tier's behaviour that matters (one batch per node,
deadlines when a server hangs or dies, keys vanishing under maxmemory, slot routing) only shows
against a real server. Every server listens on a free 127.0.0.1 port, keeps its files in a
temporary folder and is killed at teardown. `stop()` then `start()` restarts a server on the same
port (and, for cluster nodes, with the same nodes.conf) so tests can check recovery.

Use from a test module:

    from tests.redis_fixtures import redis_cluster_fixture, redis_server_fixture  # noqa: F401
    def test_x(redis_server): ...

or call `start_redis(tmp_path)` / `start_cluster(tmp_path)` directly (bench/remote.py does).

TLS and passwords: `make_tls_files(dir)` writes a throw-away CA, a server certificate and a client
certificate (made in Python with `trustme`, no `openssl` binary); pass them as `tls=` and a
`password=` to `start_redis` / `start_cluster` for a TLS-only server (`--port 0`) that requires
client certificates and AUTH. Readiness is then checked over TLS, and `client()` connects with
the same files and password.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import optional_deps

HOST = "127.0.0.1"
CLUSTER_BUS_OFFSET = 10000  # Redis Cluster talks to peers on port + 10000


def redis_server_path() -> str | None:
    """The redis-server binary on PATH (`make redis` installs it), or None."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


def redis_cli_path() -> str | None:
    return shutil.which("redis-cli") or shutil.which("valkey-cli")


def require_redis() -> str:
    """Skip the calling test with a reason a person can act on when redis-server is missing."""
    path = redis_server_path()
    if path is None:
        pytest.skip("redis-server not on PATH; run `make redis` (apt-get install redis-server)")
    return path


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def free_port(cluster_bus: bool = False) -> int:
    """A port nobody listens on now (and port+10000 too when the server is a cluster node).

    There is a small race between picking and binding; `RedisProc.start` retries on a new port
    when the server fails to bind on its first start.
    """
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = s.getsockname()[1]
        if not cluster_bus:
            return port
        if port + CLUSTER_BUS_OFFSET < 65536 and _port_free(port + CLUSTER_BUS_OFFSET):
            return port
    raise RuntimeError("no free loopback port pair found")


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for a TLS server that requires client certificates, and for its clients.

    One CA signs both certificates; the server certificate also serves as the client certificate
    cluster nodes present to each other (`--tls-cluster yes`), so it carries clientAuth too.
    """

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path

    def client_kwargs(self) -> dict[str, str | bool]:
        """redis-py connection options for a client that trusts the CA and shows its cert."""
        return {"ssl": True, "ssl_ca_certs": str(self.ca), "ssl_certfile": str(self.client_cert),
                "ssl_keyfile": str(self.client_key)}

    def client_context(self) -> ssl.SSLContext:
        """The same as an `ssl` context, for a bare socket (readiness checks)."""
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


def make_tls_files(directory: Path) -> TlsFiles:
    """A fresh CA with a server certificate for 127.0.0.1/localhost and a client certificate.

    Needs the `trustme` package (the `test` extra); a test skips with a reason without it.
    """
    trustme = optional_deps.module("trustme", "TLS tests need it: `make dev`")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert(HOST, "localhost")
    client = ca.issue_cert("kvstore-test-client")
    files = TlsFiles(ca=d / "ca.pem", server_cert=d / "server.pem", server_key=d / "server.key",
                     client_cert=d / "client.pem", client_key=d / "client.key")
    ca.cert_pem.write_to_path(str(files.ca))
    server.cert_chain_pems[0].write_to_path(str(files.server_cert))
    server.private_key_pem.write_to_path(str(files.server_key))
    client.cert_chain_pems[0].write_to_path(str(files.client_cert))
    client.private_key_pem.write_to_path(str(files.client_key))
    return files


@dataclass
class RedisProc:
    """One redis-server process bound to 127.0.0.1 with its files under `dir`."""

    dir: Path
    port: int = 0
    cluster: bool = False
    extra: dict[str, str] = field(default_factory=dict)   # more config directives
    proc: subprocess.Popen | None = None
    tls: TlsFiles | None = None      # TLS only (plaintext port off), client certs required
    password: str = ""               # requirepass (and masterauth, for cluster nodes)

    host: str = HOST

    @property
    def url(self) -> str:
        """No credentials in it: tests pass the password (or not) explicitly."""
        return f"{'rediss' if self.tls else 'redis'}://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _args(self, binary: str) -> list[str]:
        args = [binary, "--bind", self.host, "--dir", str(self.dir),
                "--save", "", "--appendonly", "no", "--daemonize", "no",
                "--logfile", str(self.dir / "redis.log"), "--protected-mode", "no"]
        if self.tls is None:
            args += ["--port", str(self.port)]
        else:
            t = self.tls
            args += ["--port", "0", "--tls-port", str(self.port),
                     "--tls-cert-file", str(t.server_cert), "--tls-key-file", str(t.server_key),
                     "--tls-ca-cert-file", str(t.ca), "--tls-auth-clients", "yes"]
            if self.cluster:
                args += ["--tls-cluster", "yes", "--tls-replication", "yes"]
        if self.password:
            args += ["--requirepass", self.password, "--masterauth", self.password]
        if self.cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                     "--cluster-node-timeout", "3000",
                     # Keep serving the slots that are up while a node is down: a cache with a
                     # missing shard should miss on that shard only, not go dark.
                     "--cluster-require-full-coverage", "no"]
        for k, v in self.extra.items():
            args += [f"--{k}", str(v)]
        return args

    def start(self, timeout: float = 10.0) -> RedisProc:
        """Start (or restart, on the same port) and wait until it answers PING."""
        binary = require_redis()
        self.dir.mkdir(parents=True, exist_ok=True)
        first = self.port == 0
        for _attempt in range(5 if first else 1):
            if first:
                self.port = free_port(cluster_bus=self.cluster)
            self.proc = subprocess.Popen(self._args(binary), stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
            if self._wait_ready(timeout):
                return self
            self.kill()
        raise RuntimeError(f"redis-server on port {self.port} did not start; see "
                           f"{self.dir / 'redis.log'}")

    def _wait_ready(self, timeout: float) -> bool:
        """A bare PING (over TLS when the server is TLS-only). With a password the server
        answers -NOAUTH before AUTH: that also proves it is up and serving commands."""
        ctx = self.tls.client_context() if self.tls is not None else None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is None or self.proc.poll() is not None:
                return False
            try:
                reply = self._ping(ctx)
            except OSError:      # ssl.SSLError is an OSError: handshake before the server is up
                reply = b""
            if reply.startswith(b"+PONG") or (self.password and reply.startswith(b"-NOAUTH")):
                return True
            time.sleep(0.02)
        return False

    def _ping(self, ctx: ssl.SSLContext | None) -> bytes:
        """Send PING on a fresh connection (TLS when `ctx`) and return the first reply bytes."""
        raw = socket.create_connection((self.host, self.port), timeout=0.5)
        with raw if ctx is None else ctx.wrap_socket(raw, server_hostname=self.host) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64)

    def stop(self) -> None:
        """SIGTERM and wait (a graceful shutdown; the port frees at once)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.resume()   # a SIGSTOPped process would not act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: the server vanishes without closing anything cleanly."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the port stays open and accepts, but nothing answers (a hung server)."""
        if self.alive:
            os.kill(self.proc.pid, signal.SIGSTOP)   # type: ignore[union-attr]

    def resume(self) -> None:
        if self.alive:
            os.kill(self.proc.pid, signal.SIGCONT)   # type: ignore[union-attr]

    def client_kwargs(self) -> dict:
        """TLS files and password for a redis-py client of this server (empty when plain)."""
        kw: dict = dict(self.tls.client_kwargs()) if self.tls is not None else {}
        if self.password:
            kw["password"] = self.password
        return kw

    def client(self, **kw):
        """A plain redis-py client to inspect or tamper with the server directly."""
        import redis

        return redis.Redis(host=self.host, port=self.port, socket_timeout=5,
                           **{**self.client_kwargs(), **kw})


@dataclass
class ClusterProc:
    """A Redis Cluster of `n` primaries (no replicas) on loopback."""

    nodes: list[RedisProc]

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def start(self, timeout: float = 20.0) -> ClusterProc:
        """Restart every stopped node (same ports, same nodes.conf); wait for cluster_state:ok."""
        for n in self.nodes:
            if not n.alive:
                n.start()
        self.wait_ok(timeout)
        return self

    def wait_ok(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            ok = True
            for n in self.nodes:
                try:
                    info = n.client().execute_command("CLUSTER INFO")  # parsed into a dict
                except Exception:
                    ok = False
                    break
                if info.get("cluster_state") != "ok":
                    ok = False
                    break
            if ok:
                return
            time.sleep(0.05)
        raise RuntimeError("cluster did not reach cluster_state:ok")

    def node_for_key(self, key: bytes) -> RedisProc:
        """The node that owns `key`'s slot right now (asks the cluster, not a local table)."""
        slot = self.nodes[0].client().execute_command("CLUSTER KEYSLOT", key)
        for n in self.nodes:
            for s in n.client().execute_command("CLUSTER SLOTS"):
                if s[0] <= slot <= s[1] and int(s[2][1]) == n.port:
                    return n
        raise LookupError(f"no node owns slot {slot}")

    # Slot migration, step by step as `redis-cli --cluster reshard` does it, so tests can stop
    # half-way (ASK) or after the move (MOVED to clients with an old slot table).

    @staticmethod
    def node_id(node: RedisProc) -> str:
        node_id = node.client().execute_command("CLUSTER MYID")
        return node_id.decode() if isinstance(node_id, bytes) else node_id

    def begin_migration(self, slot: int, src: RedisProc, dst: RedisProc) -> None:
        """`slot` IMPORTING on `dst`, MIGRATING on `src`: from now on `src` serves the keys it
        still holds and answers -ASK for the others."""
        dst.client().execute_command("CLUSTER SETSLOT", slot, "IMPORTING", self.node_id(src))
        src.client().execute_command("CLUSTER SETSLOT", slot, "MIGRATING", self.node_id(dst))

    @staticmethod
    def migrate_keys(src: RedisProc, dst: RedisProc, keys: list[bytes]) -> None:
        """MIGRATE `keys` (all in the migrating slot) from `src` to `dst` in one command."""
        auth = ["AUTH", src.password] if src.password else []
        src.client().execute_command("MIGRATE", dst.host, dst.port, "", 0, 5000, *auth,
                                     "KEYS", *keys)

    def finish_migration(self, slot: int, dst: RedisProc) -> None:
        """Assign `slot` to `dst` on every node, `dst` first (as redis-cli does); the old owner
        answers -MOVED for the slot from then on."""
        dst_id = self.node_id(dst)
        for n in [dst, *[x for x in self.nodes if x is not dst]]:
            n.client().execute_command("CLUSTER SETSLOT", slot, "NODE", dst_id)

    def move_slot(self, slot: int, src: RedisProc, dst: RedisProc) -> list[bytes]:
        """Migrate the whole `slot` (and every key in it) from `src` to `dst`; returns the keys."""
        self.begin_migration(slot, src, dst)
        found = src.client().execute_command("CLUSTER GETKEYSINSLOT", slot, 100_000)
        keys = [k.encode() if isinstance(k, str) else k for k in found]   # redis-py decodes
        if keys:
            self.migrate_keys(src, dst, keys)
        self.finish_migration(slot, dst)
        return keys

    def client(self, **kw):
        from redis.cluster import ClusterNode, RedisCluster

        return RedisCluster(startup_nodes=[ClusterNode(n.host, n.port) for n in self.nodes],
                            socket_timeout=5, **{**self.nodes[0].client_kwargs(), **kw})


def start_redis(tmp_path: Path, tls: TlsFiles | None = None, password: str = "",
                **extra: str) -> RedisProc:
    """A standalone redis-server; `extra` adds directives, e.g. maxmemory="2mb"."""
    return RedisProc(dir=Path(tmp_path) / "redis", extra=dict(extra), tls=tls,
                     password=password).start()


def _cli_auth_args(tls: TlsFiles | None, password: str) -> list[str]:
    """redis-cli options to reach a server started with these `tls` files and `password`."""
    args: list[str] = []
    if tls is not None:
        args += ["--tls", "--cacert", str(tls.ca), "--cert", str(tls.client_cert),
                 "--key", str(tls.client_key)]
    if password:
        args += ["-a", password, "--no-auth-warning"]
    return args


def start_cluster(tmp_path: Path, n: int = 3, tls: TlsFiles | None = None, password: str = "",
                  **extra: str) -> ClusterProc:
    """`n` cluster-enabled servers joined with `redis-cli --cluster create`, state ok.

    With `tls` the nodes talk TLS to clients and to each other (cluster bus); with `password`
    every node requires it.
    """
    cli = redis_cli_path()
    if cli is None:
        pytest.skip("redis-cli not on PATH; run `make redis` (apt-get install redis-server)")
    nodes = [RedisProc(dir=Path(tmp_path) / f"cluster-{i}", cluster=True, extra=dict(extra),
                       tls=tls, password=password)
             for i in range(n)]
    try:
        for node in nodes:
            node.start()
        cmd = [cli, *_cli_auth_args(tls, password), "--cluster", "create",
               *[f"{x.host}:{x.port}" for x in nodes], "--cluster-replicas", "0",
               "--cluster-yes"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout}\n{r.stderr}")
        cluster = ClusterProc(nodes)
        cluster.wait_ok()
        return cluster
    except BaseException:
        for node in nodes:
            node.kill()
        raise


@pytest.fixture(name="redis_server")
def redis_server_fixture(tmp_path):
    """A fresh standalone redis-server for one test."""
    proc = start_redis(tmp_path)
    yield proc
    proc.kill()


@pytest.fixture(name="redis_cluster", scope="module")
def redis_cluster_fixture(tmp_path_factory):
    """A 3-node cluster shared by a module's tests (creating one takes ~1-2 s).

    Tests that stop nodes must restart them (`cluster.start()`) before they return.
    """
    cluster = start_cluster(tmp_path_factory.mktemp("cluster"))
    yield cluster
    for node in cluster.nodes:
        node.kill()
