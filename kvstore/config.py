"""Daemon configuration: an embedded default, a TOML file, `KVSTORE_*` variables, then flags.

Sizes accept plain integers (bytes) or strings with a unit ("512MiB", "2GB"). Every field is
validated once here so the store can trust its config; errors name the offending key.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore_client.common.errors import InvalidArgument

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6,
          "mib": 2**20, "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12,
          "tib": 2**40}


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
# The eviction policies kvstore/policies/__init__.py makes (a test checks they agree): named
# here so a wrong `<tier>.policy` is refused with its key before the store opens.
POLICIES = ("arc", "default", "lru")
HOST_PAGE = 4096                    # the host slab's page (tiers/host.py PAGE): its smallest size
# The longest lease a daemon may hand out (leases.max_ttl_s): every lease expires, and an
# engine that needs one longer renews it.
MAX_LEASE_TTL_S = 86400.0
# Settings whose values may hold secrets (a Redis URL may carry a password): an error about
# them names the key, never the value.
_SECRET_KEYS = ("password", "urls")


class ConfigError(InvalidArgument):
    """A configuration value is wrong; the message names the key."""


def parse_size(value: Any, key: str = "size") -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size, got {value!r}")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{key}: cannot read {value!r} as a size "
                              "(e.g. 4096, '512MiB', '2GB')")
        unit = _UNITS[m.group(2).lower()]
        if unit == 1 and "." in m.group(1):
            # (read as bytes, "2.9" became 2: refused later, or worse, taken as meant)
            raise ConfigError(f"{key}: {value!r} is a fraction of a byte; give a unit "
                              f"(e.g. '{m.group(1)}GiB') or a whole number of bytes")
        n = int(float(m.group(1)) * unit)
    if n < 0:
        raise ConfigError(f"{key}: size must not be negative")
    return n


def format_size(n: float) -> str:
    """A byte count as a person reads it: "512 B", "1.5 GiB" (parse_size reads it back)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass
class CapacityConfig:
    """A tier's switch and size. The remote tier has only these: Redis evicts by its own
    maxmemory policy, and the daemon stops demoting there at `capacity` (docs/remote.md)."""
    enabled: bool = True
    capacity: int = 0               # bytes

    def check(self, name: str) -> None:
        if self.enabled and self.capacity <= 0:
            raise ConfigError(f"{name}.capacity must be positive when {name} is enabled")


@dataclass
class TierConfig(CapacityConfig):
    """A tier the daemon evicts from itself: between watermarks, by a policy."""
    high_watermark: float = 0.95    # start evicting above this fraction of capacity
    low_watermark: float = 0.85     # evict down to this fraction
    policy: str = "default"

    def check(self, name: str) -> None:
        super().check(name)
        if self.policy not in POLICIES:
            raise ConfigError(f"{name}.policy: unknown eviction policy {self.policy!r}; choose "
                              f"one of {list(POLICIES)}")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ConfigError(f"{name}: need 0 < low_watermark <= high_watermark <= 1, got "
                              f"{self.low_watermark} / {self.high_watermark}")


@dataclass
class HostConfig(TierConfig):
    capacity: int = 1 << 30
    shm_name: str = ""              # default: derived from the data folder
    background_demotion: bool = True  # demote down to low_watermark on a background thread
    # Check each block's commit checksum before its bytes leave the pool (Get, demotion,
    # write-through). Off only to measure what the check costs (bench/rpc.py).
    verify_reads: bool = True
    # What Commit hashes of the slots a client filled: "sample" (one block per commit, so a
    # client writing into a stale mapping is told at once; the reads above catch the rest)
    # or "all". Without verify_reads, or a client that sends no checksums, it hashes all.
    commit_check: str = "sample"

    def check(self, name: str) -> None:
        super().check(name)
        if self.enabled and self.capacity < HOST_PAGE:
            raise ConfigError(f"{name}.capacity must be at least {HOST_PAGE} bytes (one page), "
                              f"got {self.capacity}")
        shm = self.shm_name.lstrip("/")
        if "/" in shm or "\0" in shm or len(shm) > 200:
            raise ConfigError(f"{name}.shm_name must be a plain name like 'kvstore-main' (no "
                              f"'/', at most 200 characters) or '', got {self.shm_name!r}")
        if self.commit_check not in ("sample", "all"):
            raise ConfigError(f'{name}.commit_check must be "sample" or "all", got '
                              f"{self.commit_check!r}")


@dataclass
class SSDConfig(TierConfig):
    capacity: int = 8 << 30
    sync: bool = False              # fsync every write batch (durable across power loss)
    write_through: bool = False     # also write every committed block to SSD immediately
    # Lossless namespaces' blocks on demotion: "auto" compresses only while the encoder keeps
    # up with the disk (kvstore/encode_choice.py), "always" / "never" force it.
    compress: str = "auto"

    def check(self, name: str) -> None:
        super().check(name)
        if self.compress not in COMPRESS_MODES:
            raise ConfigError(f"{name}.compress must be one of {list(COMPRESS_MODES)}, got "
                              f"{self.compress!r}")

    def check_serving(self, name: str) -> None:
        """The floor a daemon's SSD tier needs (SSD_MIN_CAPACITY), checked where a daemon's
        config is loaded (load_config). Store() alone skips it: tests build tiers of a few
        blocks on purpose, to drive a full SSD."""
        if self.enabled and self.capacity < SSD_MIN_CAPACITY:
            raise ConfigError(
                f"{name}.capacity must be at least {format_size(SSD_MIN_CAPACITY)} "
                f"({SSD_MIN_CAPACITY} bytes), got {self.capacity} bytes: the SSD tier takes "
                f"the host tier's evictions in batches of up to "
                f"{format_size(SSD_BATCH_BYTES)} and a block, and a batch it cannot hold "
                f"never lands (a bare number is bytes: write a size such as \"64GiB\")")


COMPRESS_MODES = ("auto", "always", "never")
# What a daemon's SSD tier must hold. The host tier's evictions (background demotion, Evict,
# a stop's flush) reach it in batches of up to 64 blocks and about SSD_BATCH_BYTES (the block
# that crosses it stays in the batch: kvstore/moves/host_room.py, BATCH_BYTES), and a batch
# the tier cannot hold even empty never lands: every write then fails "ssd tier full (0 of N
# bytes)" once the host pool is full. Twice a batch holds any batch of blocks up to 32 MiB.
SSD_BATCH_BYTES = 32 << 20
SSD_MIN_CAPACITY = 2 * SSD_BATCH_BYTES


@dataclass
class GPUConfig(TierConfig):
    enabled: bool = False
    capacity: int = 4 << 30         # per device
    devices: list[int] = field(default_factory=lambda: [0])
    # "auto": CUDA where a device exists, else the CPU device (tiers/device_cpu.py);
    # "cuda": CUDA or no gpu tier; "cpu": the CPU device even where CUDA exists.
    backend: str = "auto"

    def check(self, name: str) -> None:
        super().check(name)
        if self.backend not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"{name}.backend must be 'auto', 'cuda' or 'cpu', got "
                              f"{self.backend!r}")
        if not self.devices or len(set(self.devices)) != len(self.devices) \
                or any(not _is_int(d) or d < 0 for d in self.devices):
            raise ConfigError(f"{name}.devices must list distinct device numbers >= 0, got "
                              f"{self.devices!r}")


@dataclass
class RemoteConfig(CapacityConfig):
    enabled: bool = False
    capacity: int = 64 << 30        # raw bytes of the blocks indexed as remote (docs/remote.md)
    urls: list[str] = field(default_factory=list)
    cluster: bool = False
    password: str = ""
    username: str = ""
    tls: bool = False
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    key_prefix: str = "kvs:"
    deadline_ms: int = 200
    write_through: bool = False
    # A secret file every daemon sharing the Redis holds: values are then sealed with a keyed
    # hash, and one written without the secret is refused (tiers/remote/envelope.py).
    auth_key_file: str = ""
    # With KV events on, values carry their block's event text (tiers/remote/envelope.py,
    # KVR2), so a load from Redis is announced. Daemons before this setting existed delete
    # such values as corrupt: turn it on once every daemon sharing the Redis reads them.
    value_notes: bool = False


@dataclass
class ServerConfig:
    socket: str = ""                # default: <data_dir>/kvstore.sock
    tcp: str = "127.0.0.1:50551"    # "" disables TCP
    metrics: str = "127.0.0.1:9551"  # "" disables the Prometheus endpoint
    workers: int = 16
    max_message_bytes: int = 256 << 20   # the largest message sent (a Get reply batch)
    # The largest message received, any method: gRPC refuses a longer one from its length
    # prefix, before the body is buffered (docs/security.md, Limits).
    max_receive_bytes: int = 4 << 20
    metrics_tenants: bool = False   # per-tenant series on the metrics endpoint (opt-in)
    shutdown_grace_s: float = 10.0  # on SIGTERM: how long in-flight calls may take to finish
    stop_flush_s: float = 60.0      # on SIGTERM: how long writing host blocks to SSD may take
    lane: bool = True               # the fast lane beside the Unix socket (kvstore/lane.py)

    def check(self) -> None:
        for key in ("tcp", "metrics"):
            addr = getattr(self, key)
            if addr and not _is_host_port(addr):
                raise ConfigError(f"server.{key}: expected 'host:port' (port 0..65535, e.g. "
                                  f"'127.0.0.1:50551') or '' to disable, got {addr!r}")
        if len(self.socket.encode()) > 107:
            raise ConfigError(f"server.socket: a Unix socket path holds at most 107 bytes, "
                              f"{self.socket!r} is {len(self.socket.encode())}")
        if not 1 <= self.workers <= 1024:
            raise ConfigError(f"server.workers must be in 1..1024, got {self.workers}")
        if not 4 << 20 <= self.max_message_bytes <= (2 << 30) - 1:
            raise ConfigError("server.max_message_bytes must be between 4MiB and 2GiB "
                              f"(one message carries at least one block), got "
                              f"{self.max_message_bytes}")
        if not 4 << 20 <= self.max_receive_bytes <= (2 << 30) - 1:
            raise ConfigError("server.max_receive_bytes must be between 4MiB (the largest "
                              "valid request but Put) and 2GiB, got "
                              f"{self.max_receive_bytes}")
        if not 0 <= self.shutdown_grace_s <= 3600:
            raise ConfigError(f"server.shutdown_grace_s must be in 0..3600, got "
                              f"{self.shutdown_grace_s}")
        if not 0 <= self.stop_flush_s <= 86400:
            raise ConfigError(f"server.stop_flush_s must be in 0..86400 seconds, got "
                              f"{self.stop_flush_s}")


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and int(port) <= 65535)


@dataclass
class AuthConfig:
    """Who may call (docs/security.md). Tenants themselves are `[tenants.<name>]` tables."""
    tokens_file: str = ""           # a TOML file of [tenants.<name>] tables (secrets apart)
    insecure_tcp: bool = False      # allow TCP beyond loopback with neither tenants nor mTLS
    tls_cert_file: str = ""         # TCP listener's certificate and key: TLS on TCP
    tls_key_file: str = ""
    tls_client_ca_file: str = ""    # clients must present a certificate from this CA (mTLS)

    def check(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ConfigError("auth.tls_cert_file and auth.tls_key_file go together")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ConfigError("auth.tls_client_ca_file (mTLS) needs auth.tls_cert_file and "
                              "auth.tls_key_file for the server side")


_ENDPOINT = re.compile(r"tcp://(\*|\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})|ipc://.+")


def check_endpoint(value: str, key: str) -> None:
    """A ZMQ address the daemon binds: tcp://<host or *>:<port> or ipc://<path>."""
    m = _ENDPOINT.fullmatch(value)
    if not m or (m.group(2) is not None and int(m.group(2)) > 65535):
        raise ConfigError(f"{key}: expected 'tcp://<host or *>:<port>' or 'ipc://<path>', got "
                          f"{value!r}")


@dataclass
class EngineStreamConfig:
    """One engine's merged stream: its own KV events relayed beside the daemon's residency."""
    name: str                       # stable: names the stream's sequence file
    endpoint: str                   # ZMQ PUB address the router is pointed at for this engine
    source: str = ""                # the engine's --kv-events-config endpoint ("": none)
    source_replay: str = ""         # ...and its replay_endpoint ("": none; asked, never bound)
    replay_endpoint: str = ""       # ZMQ ROUTER address for replay requests ("": none)
    dp_rank: int = 0                # data_parallel_rank of this stream's own batches
    models: list[str] = field(default_factory=list)     # [] = events.models

    @classmethod
    def parse(cls, raw: Any, where: str) -> EngineStreamConfig:
        if isinstance(raw, EngineStreamConfig):
            return raw
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: expected a table ([[events.engines]])")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: unknown setting; known: {sorted(known)}")
        for key in ("name", "endpoint"):
            if not isinstance(raw.get(key), str) or not raw.get(key):
                raise ConfigError(f"{where}.{key}: required (a non-empty string)")
        out = cls(**raw)
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", out.name):
            raise ConfigError(f"{where}.name: letters, digits, '_', '.', '-' only (it names "
                              f"a file), got {out.name!r}")
        check_endpoint(out.endpoint, f"{where}.endpoint")
        for key in ("source", "source_replay", "replay_endpoint"):
            value = getattr(out, key)
            if not isinstance(value, str) or (value and not value.startswith(("tcp://",
                                                                             "ipc://"))):
                raise ConfigError(f"{where}.{key}: expected a tcp:// or ipc:// address or '', "
                                  f"got {value!r}")
        if out.source_replay and not out.source:
            raise ConfigError(f"{where}.source_replay: the engine's replay socket is asked only "
                              "for the events of a source; set source too")
        if not isinstance(out.dp_rank, int) or isinstance(out.dp_rank, bool) \
                or not 0 <= out.dp_rank < 1 << 16:
            raise ConfigError(f"{where}.dp_rank must be an integer in 0..65535")
        if not isinstance(out.models, list) or not all(isinstance(m, str) for m in out.models):
            raise ConfigError(f"{where}.models: expected a list of model names")
        return out


@dataclass
class EventsConfig:
    """KV events for cache-aware routers (vLLM's wire format, docs/routing.md)."""
    enabled: bool = False
    endpoint: str = "tcp://127.0.0.1:5557"     # the node stream ("": none)
    replay_endpoint: str = ""                   # its replay socket ("": none)
    topic: str = ""
    models: list[str] = field(default_factory=list)     # fnmatch patterns; [] = every model
    dp_rank: int = 0
    buffer_steps: int = 10000                   # batches kept per stream for replay
    replay_bytes: int = 64 << 20                # ...and their bytes at most
    hwm: int = 100000                           # ZMQ send high-water mark
    max_queue: int = 100000                     # residency changes queued for the publisher
    batch_events: int = 256                     # events per batch at most
    interval_ms: float = 10.0                   # gathering window after a change wakes it
    token_cache_blocks: int = 262144            # engine blocks whose tokens relays remember
    engines: list[Any] = field(default_factory=list)    # [[events.engines]] tables
    # Connections each bound events socket keeps, in all and from one peer (kvstore/events/
    # peers.py: a uid on this host, else an address, an IPv6 one by its /64)
    max_connections: int = 64
    max_connections_per_peer: int = 8
    # Events with [tenants.*]: every tenant's blocks and token ids go to whoever connects
    allow_with_tenants: bool = False

    def check(self) -> None:
        if self.endpoint:
            check_endpoint(self.endpoint, "events.endpoint")
        if self.replay_endpoint:
            check_endpoint(self.replay_endpoint, "events.replay_endpoint")
        for key, lo, hi in (("dp_rank", 0, 65535), ("buffer_steps", 0, 10**7),
                            ("hwm", 1, 10**8), ("max_queue", 16, 10**8),
                            ("batch_events", 1, 65536), ("token_cache_blocks", 0, 10**8),
                            ("max_connections", 1, 65536),
                            ("max_connections_per_peer", 1, 65536)):
            v = getattr(self, key)
            if not lo <= v <= hi:
                raise ConfigError(f"events.{key} must be in {lo}..{hi}, got {v}")
        if not 1 << 10 <= self.replay_bytes <= 1 << 40:
            raise ConfigError(f"events.replay_bytes must be a size from 1KiB to 1TiB, got "
                              f"{self.replay_bytes}")
        if not 1 <= self.interval_ms <= 1000:
            raise ConfigError(f"events.interval_ms must be in 1..1000, got {self.interval_ms}")
        self.engines = [EngineStreamConfig.parse(e, f"events.engines[{i}]")
                        for i, e in enumerate(self.engines)]
        names = [e.name for e in self.engines]
        if len(set(names)) != len(names) or "node" in names:
            raise ConfigError("events.engines: each engine needs its own name ('node' names "
                              "the node stream)")
        binds = [a for a in [self.endpoint, self.replay_endpoint] if a]
        binds += [a for e in self.engines for a in (e.endpoint, e.replay_endpoint) if a]
        dup = sorted({a for a in binds if binds.count(a) > 1 and not a.endswith(":0")})
        if dup:
            raise ConfigError(f"events: {dup[0]} is given to two sockets; each needs its own "
                              "address")
        if self.enabled and not self.endpoint and not self.engines:
            raise ConfigError("events.enabled = true but no stream: set events.endpoint or "
                              "add an [[events.engines]] table")


@dataclass
class LimitsConfig:
    """What one caller may hold of the daemon, and for how long (docs/security.md, Limits)."""
    request_deadline_s: float = 30.0  # a gRPC call's request (all of a Put) and a Get's reply
    tenant_calls: int = 0           # gRPC calls in flight per tenant (0: server.workers)
    preauth_calls: int = 8          # mTLS calls in flight while their certificate is matched
    # A tenant's calls refused as its own mistake (invalid, not its own), per second, and at
    # once; past them its calls are refused at the gate unread (kvstore/gate.py). Unknown ids
    # refill at the same rate into a larger bucket (unknown_id_burst).
    refusals_per_s: float = 10.0    # 0: no budget
    refusal_burst: int = 50
    hello_deadline_s: float = 5.0   # .auth request / .lane hello, from the connect
    pending_per_uid: int = 16       # unauthenticated .auth or .lane connections per peer uid;
    #                                 also a tenant's unread fd-carrying .auth replies
    pending_total: int = 1024       # ... of all peers, per listener
    lane_per_tenant: int = 64       # lane connections per tenant (no tenants: 256 in all)
    frame_deadline_s: float = 10.0  # a lane request frame, from its first byte
    sessions_per_tenant: int = 4096  # handshake sessions remembered per tenant
    # The store's, per tenant (the implicit one too; 0: no cap): leases held at once and slots
    # across them (kvstore/leases.py), namespaces held (an empty one is reclaimed at the cap)
    # and the size of one namespace spec as persisted (JSON; real ones are well under 1 KiB).
    leases_per_tenant: int = 4096
    lease_slots_per_tenant: int = 1 << 18
    namespaces_per_tenant: int = 1024
    namespace_spec_bytes: int = 4096
    # Heap bytes a tenant's Put and Get streams may hold at once (the implicit tenant's too;
    # 0: no cap): blocks arriving in pieces, Get reply batches in flight (kvstore/getcopy.py,
    # StreamBudget). A stalled stream keeps its share until its deadline.
    stream_bytes_per_tenant: int = 256 << 20

    def unknown_id_burst(self) -> int:
        """NOT_FOUND answers a tenant may get at once before the gate refuses its calls: one
        for each lease and namespace it may hold (an uncapped kind counts as its default), as
        an honest engine meets after a daemon restart (kvstore/gate.py, RefusalBudget)."""
        leases = self.leases_per_tenant or LimitsConfig.leases_per_tenant
        namespaces = self.namespaces_per_tenant or LimitsConfig.namespaces_per_tenant
        return self.refusal_burst + leases + namespaces

    def check(self) -> None:
        for key in ("request_deadline_s", "hello_deadline_s", "frame_deadline_s"):
            v = getattr(self, key)
            if not 0.1 <= v <= 3600:
                raise ConfigError(f"limits.{key} must be in 0.1..3600 seconds, got {v}")
        if not 0 <= self.tenant_calls <= 1024:
            raise ConfigError(f"limits.tenant_calls must be in 0..1024 (0: server.workers), "
                              f"got {self.tenant_calls}")
        if not 0 <= self.refusals_per_s <= 1 << 20:
            raise ConfigError(f"limits.refusals_per_s must be 0 (no budget) or a rate up to "
                              f"{1 << 20}, got {self.refusals_per_s}")
        for key in ("preauth_calls", "refusal_burst", "pending_per_uid", "pending_total",
                    "lane_per_tenant", "sessions_per_tenant"):
            v = getattr(self, key)
            if not 1 <= v <= 1 << 20:
                raise ConfigError(f"limits.{key} must be in 1..{1 << 20}, got {v}")
        for key in ("leases_per_tenant", "lease_slots_per_tenant", "namespaces_per_tenant"):
            v = getattr(self, key)
            if not 0 <= v <= 1 << 30:
                raise ConfigError(f"limits.{key} must be 0 (no cap) or a count up to "
                                  f"{1 << 30}, got {v}")
        if not 512 <= self.namespace_spec_bytes <= 1 << 20:
            raise ConfigError("limits.namespace_spec_bytes must be in 512..1048576, got "
                              f"{self.namespace_spec_bytes}")
        if not 0 <= self.stream_bytes_per_tenant <= 1 << 40:
            raise ConfigError("limits.stream_bytes_per_tenant must be 0 (no cap) or a size up "
                              f"to 1TiB, got {self.stream_bytes_per_tenant}")
        if self.pending_per_uid > self.pending_total:
            raise ConfigError(f"limits.pending_per_uid ({self.pending_per_uid}) must not be "
                              f"above limits.pending_total ({self.pending_total})")


@dataclass
class LeaseConfig:
    default_ttl_s: float = 30.0
    max_ttl_s: float = 600.0
    expired_write_hold_s: float = 30.0   # an expired write lease's slots kept unused this long


@dataclass
class StoreConfig:
    data_dir: str = "./data"
    host: HostConfig = field(default_factory=HostConfig)
    ssd: SSDConfig = field(default_factory=SSDConfig)
    gpu: GPUConfig = field(default_factory=GPUConfig)
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    leases: LeaseConfig = field(default_factory=LeaseConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    tenants: dict[str, Any] = field(default_factory=dict)   # kvstore/tenants.py reads them
    log_level: str = "info"

    def check(self) -> StoreConfig:
        self.host.check("host")
        if self.ssd.enabled:
            self.ssd.check("ssd")
        if self.gpu.enabled:
            self.gpu.check("gpu")
        if self.remote.enabled:
            self.remote.check("remote")
            if not self.remote.urls:
                raise ConfigError("remote.urls must list at least one redis:// URL when "
                                  "remote is enabled")
        ttl = self.leases
        if not 0 < ttl.default_ttl_s <= ttl.max_ttl_s <= MAX_LEASE_TTL_S:
            raise ConfigError(f"leases: need 0 < default_ttl_s <= max_ttl_s <= "
                              f"{MAX_LEASE_TTL_S:g} seconds (every lease expires; an engine "
                              f"renews one it needs longer), got {ttl.default_ttl_s!r} / "
                              f"{ttl.max_ttl_s!r}")
        if not 0 <= ttl.expired_write_hold_s <= 3600:
            raise ConfigError("leases.expired_write_hold_s must be in 0..3600 seconds, got "
                              f"{ttl.expired_write_hold_s!r}")
        self.server.check()
        self.auth.check()
        self.limits.check()
        self.events.check()
        # Events are not per tenant (nor authenticated): with tenants they would hand every
        # tenant's prompts (token ids) to any process that reaches the endpoint, which the
        # tenants' isolation promises no one sees. The operator must say so (docs/security.md).
        if (self.events.enabled and (self.tenants or self.auth.tokens_file)
                and not self.events.allow_with_tenants):
            raise ConfigError(
                "events.enabled = true with tenants ([tenants.*] or auth.tokens_file): the "
                "events carry every tenant's block hashes and token ids to anyone who can "
                "connect to the events endpoint; set events.allow_with_tenants = true to "
                "accept that, or turn events off")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log_level: expected one of {list(LOG_LEVELS)}, got "
                              f"{self.log_level!r}")
        return self

    @property
    def socket_path(self) -> str:
        return self.server.socket or str(Path(self.data_dir) / "kvstore.sock")


_SIZE_KEYS = {"capacity", "max_message_bytes", "max_receive_bytes",
              "stream_bytes_per_tenant", "replay_bytes"}


def _apply(obj: Any, values: dict[str, Any], where: str, text: bool = False) -> None:
    """Set `values` on `obj`, each checked against its field's type. `text`: values from a
    variable or a flag, where strings are read as the field's type ("16", "true", "0,1");
    a config file's (TOML's) values must have the field's type already."""
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for k, v in values.items():
        if k not in fields:
            raise ConfigError(f"{where}{k}: unknown setting; known: {sorted(fields)}")
        cur = getattr(obj, k)
        if dataclasses.is_dataclass(cur):
            if not isinstance(v, dict):
                raise ConfigError(f"{where}{k}: expected a table")
            _apply(cur, v, f"{where}{k}.", text)
            continue
        setattr(obj, k, _coerce(str(fields[k].type), cur, v, f"{where}{k}", k in _SIZE_KEYS,
                                text))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _shown(key: str, v: Any) -> str:
    """A value as an error may show it: a secret's is withheld."""
    return "(value withheld)" if key.rpartition(".")[2] in _SECRET_KEYS else repr(v)


def _from_text(kind: str, v: str, key: str) -> Any:
    """A variable's or flag's text read as a value of the field's type `kind`."""
    word = v.strip()
    if kind == "bool":
        if word.lower() in ("1", "true", "yes", "on"):
            return True
        if word.lower() in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{key}: expected true or false, got {_shown(key, v)}")
    try:
        if kind == "int":
            return int(word)
        if kind == "float":
            return float(word)
        if kind.startswith("list["):
            item = kind[len("list["):-1]
            return [x.strip() if item != "int" else int(x) for x in v.split(",") if x.strip()]
    except ValueError:
        what = {"int": "an integer", "float": "a number"}.get(kind, "a list of integers")
        raise ConfigError(f"{key}: cannot read {_shown(key, v)} as {what}") from None
    return v


def _coerce(kind: str, cur: Any, v: Any, key: str, is_size: bool, text: bool = False) -> Any:
    """`v` for a field of type `kind` (its annotation, e.g. "int", "list[str]"), or a
    ConfigError naming `key`: a bool is not a number, nor a number text (except from a
    variable or flag, `text`), and a float setting must be finite."""
    if is_size:
        return parse_size(v, key)
    if isinstance(cur, dict):
        if not isinstance(v, dict):
            raise ConfigError(f"{key}: expected a table")
        return {**cur, **v}
    if text and isinstance(v, str):
        v = _from_text(kind, v, key)
    shown = _shown(key, v)
    if kind == "bool":
        if not isinstance(v, bool):
            raise ConfigError(f"{key}: expected true or false, got {shown}")
        return v
    if kind == "int":
        if not _is_int(v):
            raise ConfigError(f"{key}: expected an integer, got {shown}")
        return v
    if kind == "float":
        if not (_is_int(v) or isinstance(v, float)):
            raise ConfigError(f"{key}: expected a number, got {shown}")
        if not math.isfinite(v):
            raise ConfigError(f"{key}: expected a finite number, got {shown}")
        return float(v)
    if kind == "str":
        if not isinstance(v, str):
            raise ConfigError(f"{key}: expected a string, got {shown}")
        return v
    if kind.startswith("list["):
        item = kind[len("list["):-1]
        ok = {"int": _is_int, "str": lambda x: isinstance(x, str)}.get(item, lambda x: True)
        if not isinstance(v, list) or not all(ok(x) for x in v):
            what = {"int": "integers", "str": "strings"}.get(item, "tables")
            raise ConfigError(f"{key}: expected a list of {what}, got {shown}")
        return list(v)
    raise ConfigError(f"{key}: cannot use {shown} here (expected {kind})")


# Variables that start with KVSTORE_ but are not daemon settings, so the loader leaves them
# alone: the config file's path; the SDK's default daemon address (kvstore_client.connect(),
# `kvstore status`); `kvstore status`'s bearer token (docs/security.md); the switches of the
# copy kernels the daemon and the SDK read (kvstore/getcopy.py, kvstore_client/blockcopy.py,
# docs/sdk.md); and what the benchmarks and the contract tests read (bench/peers.py,
# tests/).
NOT_SETTINGS = ("KVSTORE_CONFIG", "KVSTORE_ADDRESS", "KVSTORE_TOKEN", "KVSTORE_NO_KERNEL",
                "KVSTORE_NO_FUSED_HASH", "KVSTORE_LMCACHE_PYTHON", "KVSTORE_CONTRACT_REPORT")


def _env_values(environ: dict[str, str]) -> list[tuple[str, str, dict[str, Any]]]:
    """KVSTORE_HOST__CAPACITY=2GiB -> ("KVSTORE_HOST__CAPACITY", "2GiB",
    {"host": {"capacity": "2GiB"}}); KVSTORE_DATA_DIR -> data_dir. One entry per variable, so
    an error can name the variable that was set."""
    out = []
    for name, value in sorted(environ.items()):
        if not name.startswith("KVSTORE_") or name in NOT_SETTINGS:
            continue
        path = name[len("KVSTORE_"):].lower().split("__")
        nested: dict[str, Any] = {}
        d = nested
        for p in path[:-1]:
            d = d.setdefault(p, {})
        d[path[-1]] = value
        out.append((name, value, nested))
    return out


def load_config(path: str | os.PathLike | None = None, overrides: dict[str, Any] | None = None,
                environ: dict[str, str] | None = None) -> StoreConfig:
    """Default, then the TOML file (or $KVSTORE_CONFIG), then KVSTORE_* variables, then
    overrides."""
    cfg = StoreConfig()
    env = dict(os.environ if environ is None else environ)
    path = path or env.get("KVSTORE_CONFIG")
    if path:
        _apply(cfg, _read_toml(path), "")
    for name, value, nested in _env_values(env):
        try:
            _apply(cfg, nested, "", text=True)
        except ConfigError as e:
            # The value only where it is a known setting's and no secret: an unknown variable
            # may be anything (a token meant for another program).
            shown = f"={value!r}" if _plain_setting(nested) else ""
            raise ConfigError(f"environment variable {name}{shown}: {e}") from None
    if overrides:
        _apply(cfg, overrides, "", text=True)
    try:
        cfg.check()
        cfg.ssd.check_serving("ssd")
        return cfg
    except ConfigError as e:
        raise ConfigError(f"{e}{_set_by(str(e), env, overrides or {})}") from None


def _read_toml(path: str | os.PathLike) -> dict[str, Any]:
    """A config file's tables, or a ConfigError in one line naming the file."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"config file {path} is a folder, not a file; pass the TOML file "
                          "itself (--config or $KVSTORE_CONFIG)") from None
    except OSError as e:
        raise ConfigError(f"config file {path} cannot be read: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}); TOML files "
                          "are UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {path} is not valid TOML: {e}") from None


def _plain_setting(nested: dict[str, Any]) -> bool:
    """Whether a variable's path (one key per level) names a known setting that is no
    secret, so an error may show its value."""
    obj: Any = StoreConfig()
    while isinstance(nested, dict) and len(nested) == 1:
        (k, nested), = nested.items()
        if not dataclasses.is_dataclass(obj) or k not in {f.name for f in
                                                          dataclasses.fields(obj)}:
            return False
        obj = getattr(obj, k)
        if k in _SECRET_KEYS:
            return False
    return not isinstance(nested, dict) and not dataclasses.is_dataclass(obj) \
        and not isinstance(obj, dict)


def _dotted(nested: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in nested.items():
        out |= _dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
    return out


def _set_by(message: str, environ: dict[str, str], overrides: dict[str, Any]) -> str:
    """" (set by KVSTORE_X)" when a variable, not a flag, set a key the message names."""
    flagged = _dotted(overrides)
    names = [name for name, _, nested in _env_values(environ)
             for key in _dotted(nested) if key in message and key not in flagged]
    return f" (set by {', '.join(names)})" if names else ""
