from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "dtype", "engine_layout", "block_bytes", "kv_axes")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_LAYOUT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_AXES_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str
    engine_layout: str
    block_bytes: int
    kv_axes: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., engine_layout: _Optional[str] = ..., block_bytes: _Optional[int] = ..., kv_axes: _Optional[str] = ...) -> None: ...

class NamespaceSpec(_message.Message):
    __slots__ = ("model", "revision", "layout", "shard_rank", "shard_size", "hash_scheme", "tenant_salt", "codec", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANK_FIELD_NUMBER: _ClassVar[int]
    SHARD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HASH_SCHEME_FIELD_NUMBER: _ClassVar[int]
    TENANT_SALT_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    layout: KVLayout
    shard_rank: int
    shard_size: int
    hash_scheme: str
    tenant_salt: str
    codec: str
    extra: _containers.ScalarMap[str, str]
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., shard_rank: _Optional[int] = ..., shard_size: _Optional[int] = ..., hash_scheme: _Optional[str] = ..., tenant_salt: _Optional[str] = ..., codec: _Optional[str] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class HostPool(_message.Message):
    __slots__ = ("kind", "name", "size")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    name: str
    size: int
    def __init__(self, kind: _Optional[str] = ..., name: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class GpuPool(_message.Message):
    __slots__ = ("device", "ipc_handle", "size", "owner_pid", "kind", "name")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    OWNER_PID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    device: int
    ipc_handle: bytes
    size: int
    owner_pid: int
    kind: str
    name: str
    def __init__(self, device: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ..., size: _Optional[int] = ..., owner_pid: _Optional[int] = ..., kind: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class RegisterNamespaceRequest(_message.Message):
    __slots__ = ("spec",)
    SPEC_FIELD_NUMBER: _ClassVar[int]
    spec: NamespaceSpec
    def __init__(self, spec: _Optional[_Union[NamespaceSpec, _Mapping]] = ...) -> None: ...

class RegisterNamespaceResponse(_message.Message):
    __slots__ = ("namespace_id", "block_bytes", "host_pool", "gpu_pools", "daemon_id", "protocol", "wants_token_ids")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_POOL_FIELD_NUMBER: _ClassVar[int]
    GPU_POOLS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    WANTS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    block_bytes: int
    host_pool: HostPool
    gpu_pools: _containers.RepeatedCompositeFieldContainer[GpuPool]
    daemon_id: str
    protocol: int
    wants_token_ids: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., block_bytes: _Optional[int] = ..., host_pool: _Optional[_Union[HostPool, _Mapping]] = ..., gpu_pools: _Optional[_Iterable[_Union[GpuPool, _Mapping]]] = ..., daemon_id: _Optional[str] = ..., protocol: _Optional[int] = ..., wants_token_ids: _Optional[bool] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "for_store")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    FOR_STORE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    for_store: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., for_store: _Optional[bool] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("prefix_blocks", "per_tier")
    class PerTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PER_TIER_FIELD_NUMBER: _ClassVar[int]
    prefix_blocks: int
    per_tier: _containers.ScalarMap[str, int]
    def __init__(self, prefix_blocks: _Optional[int] = ..., per_tier: _Optional[_Mapping[str, int]] = ...) -> None: ...

class Slot(_message.Message):
    __slots__ = ("offset", "length", "device")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    offset: int
    length: int
    device: int
    def __init__(self, offset: _Optional[int] = ..., length: _Optional[int] = ..., device: _Optional[int] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "deadline", "tier", "slots", "keys", "checksums")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    deadline: float
    tier: str
    slots: _containers.RepeatedCompositeFieldContainer[Slot]
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, lease_id: _Optional[str] = ..., deadline: _Optional[float] = ..., tier: _Optional[str] = ..., slots: _Optional[_Iterable[_Union[Slot, _Mapping]]] = ..., keys: _Optional[_Iterable[bytes]] = ..., checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class ReserveRequest(_message.Message):
    __slots__ = ("namespace_id", "count", "tier", "ttl_s", "device")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    count: int
    tier: str
    ttl_s: float
    device: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., count: _Optional[int] = ..., tier: _Optional[str] = ..., ttl_s: _Optional[float] = ..., device: _Optional[int] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("lease_id", "keys", "parent", "checksums", "reserve_next", "next_ttl_s", "first_slot", "release_leases", "token_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    RESERVE_NEXT_FIELD_NUMBER: _ClassVar[int]
    NEXT_TTL_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_SLOT_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    parent: bytes
    checksums: _containers.RepeatedScalarFieldContainer[int]
    reserve_next: int
    next_ttl_s: float
    first_slot: int
    release_leases: _containers.RepeatedScalarFieldContainer[str]
    token_ids: bytes
    def __init__(self, lease_id: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., parent: _Optional[bytes] = ..., checksums: _Optional[_Iterable[int]] = ..., reserve_next: _Optional[int] = ..., next_ttl_s: _Optional[float] = ..., first_slot: _Optional[int] = ..., release_leases: _Optional[_Iterable[str]] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("stored", "duplicates", "next_lease")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    NEXT_LEASE_FIELD_NUMBER: _ClassVar[int]
    stored: int
    duplicates: int
    next_lease: Lease
    def __init__(self, stored: _Optional[int] = ..., duplicates: _Optional[int] = ..., next_lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "tier", "ttl_s", "device", "release_leases")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tier: str
    ttl_s: float
    device: int
    release_leases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., tier: _Optional[str] = ..., ttl_s: _Optional[float] = ..., device: _Optional[int] = ..., release_leases: _Optional[_Iterable[str]] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("lease_id", "lease_ids")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_IDS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    lease_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, lease_id: _Optional[str] = ..., lease_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ReleaseResult(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ReleaseResult]
    def __init__(self, results: _Optional[_Iterable[_Union[ReleaseResult, _Mapping]]] = ...) -> None: ...

class RenewLeaseRequest(_message.Message):
    __slots__ = ("lease_id", "ttl_s")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    ttl_s: float
    def __init__(self, lease_id: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class RenewLeaseResponse(_message.Message):
    __slots__ = ("deadline",)
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    deadline: float
    def __init__(self, deadline: _Optional[float] = ...) -> None: ...

class Block(_message.Message):
    __slots__ = ("key", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: bytes
    data: bytes
    def __init__(self, key: _Optional[bytes] = ..., data: _Optional[bytes] = ...) -> None: ...

class PutRequest(_message.Message):
    __slots__ = ("namespace_id", "parent", "blocks", "token_ids")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    PARENT_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    parent: bytes
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    token_ids: bytes
    def __init__(self, namespace_id: _Optional[bytes] = ..., parent: _Optional[bytes] = ..., blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ..., token_ids: _Optional[bytes] = ...) -> None: ...

class PutResponse(_message.Message):
    __slots__ = ("stored", "duplicates")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DUPLICATES_FIELD_NUMBER: _ClassVar[int]
    stored: int
    duplicates: int
    def __init__(self, stored: _Optional[int] = ..., duplicates: _Optional[int] = ...) -> None: ...

class GetRequest(_message.Message):
    __slots__ = ("namespace_id", "keys")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class GetResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    def __init__(self, blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ...) -> None: ...

class RetainRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "level")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    level: str
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., level: _Optional[str] = ...) -> None: ...

class RetainResponse(_message.Message):
    __slots__ = ("blocks",)
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    blocks: int
    def __init__(self, blocks: _Optional[int] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "all")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    ALL_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    all: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., all: _Optional[bool] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("deleted",)
    DELETED_FIELD_NUMBER: _ClassVar[int]
    deleted: int
    def __init__(self, deleted: _Optional[int] = ...) -> None: ...

class EvictRequest(_message.Message):
    __slots__ = ("tier", "bytes")
    TIER_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    tier: str
    bytes: int
    def __init__(self, tier: _Optional[str] = ..., bytes: _Optional[int] = ...) -> None: ...

class EvictResponse(_message.Message):
    __slots__ = ("freed_bytes", "blocks")
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    blocks: int
    def __init__(self, freed_bytes: _Optional[int] = ..., blocks: _Optional[int] = ...) -> None: ...

class FlushRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FlushResponse(_message.Message):
    __slots__ = ("demoted",)
    DEMOTED_FIELD_NUMBER: _ClassVar[int]
    demoted: int
    def __init__(self, demoted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("list_namespaces",)
    LIST_NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    list_namespaces: bool
    def __init__(self, list_namespaces: _Optional[bool] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace_id", "model", "revision", "codec", "shard_rank", "shard_size", "tenant", "block_bytes", "blocks", "host_blocks", "ssd_blocks", "remote_blocks", "leases", "idle_s")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    SHARD_RANK_FIELD_NUMBER: _ClassVar[int]
    SHARD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    SSD_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    IDLE_S_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    model: str
    revision: str
    codec: str
    shard_rank: int
    shard_size: int
    tenant: str
    block_bytes: int
    blocks: int
    host_blocks: int
    ssd_blocks: int
    remote_blocks: int
    leases: int
    idle_s: float
    def __init__(self, namespace_id: _Optional[bytes] = ..., model: _Optional[str] = ..., revision: _Optional[str] = ..., codec: _Optional[str] = ..., shard_rank: _Optional[int] = ..., shard_size: _Optional[int] = ..., tenant: _Optional[str] = ..., block_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., host_blocks: _Optional[int] = ..., ssd_blocks: _Optional[int] = ..., remote_blocks: _Optional[int] = ..., leases: _Optional[int] = ..., idle_s: _Optional[float] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "capacity_bytes", "used_bytes", "blocks", "hits", "misses", "evictions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    capacity_bytes: int
    used_bytes: int
    blocks: int
    hits: int
    misses: int
    evictions: int
    def __init__(self, name: _Optional[str] = ..., capacity_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ..., blocks: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tiers", "counters", "namespaces", "active_leases", "daemon_id", "namespace_list")
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    TIERS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_LEASES_FIELD_NUMBER: _ClassVar[int]
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_LIST_FIELD_NUMBER: _ClassVar[int]
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    counters: _containers.ScalarMap[str, float]
    namespaces: int
    active_leases: int
    daemon_id: str
    namespace_list: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    def __init__(self, tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., counters: _Optional[_Mapping[str, float]] = ..., namespaces: _Optional[int] = ..., active_leases: _Optional[int] = ..., daemon_id: _Optional[str] = ..., namespace_list: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ...) -> None: ...

class LocateRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "prefetch")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    prefetch: bool
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., prefetch: _Optional[bool] = ...) -> None: ...

class LocateResponse(_message.Message):
    __slots__ = ("tier_names", "where", "prefetching")
    TIER_NAMES_FIELD_NUMBER: _ClassVar[int]
    WHERE_FIELD_NUMBER: _ClassVar[int]
    PREFETCHING_FIELD_NUMBER: _ClassVar[int]
    tier_names: _containers.RepeatedScalarFieldContainer[str]
    where: bytes
    prefetching: int
    def __init__(self, tier_names: _Optional[_Iterable[str]] = ..., where: _Optional[bytes] = ..., prefetching: _Optional[int] = ...) -> None: ...

class LookupReserveRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "tier", "ttl_s", "max_slots", "device")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tier: str
    ttl_s: float
    max_slots: int
    device: int
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., tier: _Optional[str] = ..., ttl_s: _Optional[float] = ..., max_slots: _Optional[int] = ..., device: _Optional[int] = ...) -> None: ...

class LookupReserveResponse(_message.Message):
    __slots__ = ("prefix_blocks", "per_tier", "lease")
    class PerTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PER_TIER_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    prefix_blocks: int
    per_tier: _containers.ScalarMap[str, int]
    lease: Lease
    def __init__(self, prefix_blocks: _Optional[int] = ..., per_tier: _Optional[_Mapping[str, int]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class LookupAcquireRequest(_message.Message):
    __slots__ = ("namespace_id", "keys", "tier", "ttl_s", "device", "release_leases")
    NAMESPACE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_FIELD_NUMBER: _ClassVar[int]
    namespace_id: bytes
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    tier: str
    ttl_s: float
    device: int
    release_leases: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace_id: _Optional[bytes] = ..., keys: _Optional[_Iterable[bytes]] = ..., tier: _Optional[str] = ..., ttl_s: _Optional[float] = ..., device: _Optional[int] = ..., release_leases: _Optional[_Iterable[str]] = ...) -> None: ...

class LookupAcquireResponse(_message.Message):
    __slots__ = ("prefix_blocks", "per_tier", "lease")
    class PerTierEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    PREFIX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PER_TIER_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    prefix_blocks: int
    per_tier: _containers.ScalarMap[str, int]
    lease: Lease
    def __init__(self, prefix_blocks: _Optional[int] = ..., per_tier: _Optional[_Mapping[str, int]] = ..., lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...
