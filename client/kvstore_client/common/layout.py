"""KV layout and namespace identity.

A block is only comparable with blocks of the same model, layout, shard, hash scheme and codec,
so all of those go into the namespace digest. The digest is computed from a canonical encoding
(sorted JSON, no whitespace), never from Python's `hash`, so every process on every machine
agrees on it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import blake3

from .errors import InvalidArgument

# Element sizes of the dtypes a namespace may hold. fp8 is a storage codec, not a namespace dtype.
DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}
# Engine-native blocks may also hold an engine's own 8-bit KV (fp8 caches) or plain bytes; those
# are stored as opaque bytes: lossless codecs only.
OPAQUE_DTYPE_BYTES: dict[str, int] = {"fp8_e4m3": 1, "fp8_e5m2": 1, "uint8": 1}
# The axes of the canonical block [layers, K/V, tokens, heads, head_dim], one letter each; a
# declared engine layout names the order its block interior stores them in (e.g. "LH2TD").
CANONICAL_AXES = "L2THD"
CODECS: tuple[str, ...] = ("lossless", "fp8_e4m3", "int8")
HASH_SCHEMES: tuple[str, ...] = ("kvstore-blake3-v1", "external")

# One block above this is almost certainly a units mistake (tokens vs blocks, bytes vs MiB).
MAX_BLOCK_BYTES = 256 * 1024 * 1024
MAX_BLOCK_TOKENS = 4096


def _positive_int(name: str, value: object, upper: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    if value <= 0:
        raise InvalidArgument(f"{name} must be positive, got {value}")
    if value > upper:
        raise InvalidArgument(f"{name}={value} is larger than the supported maximum {upper}")
    return value


@dataclass(frozen=True)
class KVLayout:
    """Shape of one block in the canonical layout [layers, 2 (K,V), tokens, heads, head_dim].

    Engine-native blocks (`engine_layout` set) are opaque bytes of a fixed size (`block_bytes`)
    in an engine's own paged layout, so an engine can hand over its chunks without reshaping
    them. Their KV geometry is optional: with it and `kv_axes` (the order the block stores the
    canonical axes in, e.g. "LH2TD" for vLLM's CPU backend) lossy codecs know which bytes are K
    and V of which head; without it only lossless codecs apply.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    dtype: str = "bfloat16"
    engine_layout: str = ""
    block_bytes_opaque: int = 0
    kv_axes: str = ""

    def __post_init__(self) -> None:
        if self.engine_layout:
            self._check_engine_native()
            return
        _positive_int("num_layers", self.num_layers, 1024)
        _positive_int("num_kv_heads", self.num_kv_heads, 1024)
        _positive_int("head_dim", self.head_dim, 4096)
        _positive_int("block_tokens", self.block_tokens, MAX_BLOCK_TOKENS)
        if self.dtype not in DTYPE_BYTES:
            raise InvalidArgument(
                f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPE_BYTES)}")
        if self.block_bytes_opaque or self.kv_axes:
            raise InvalidArgument("block_bytes and kv_axes are for engine-native layouts only; "
                                  "set engine_layout to the engine's layout name")
        if self.block_bytes > MAX_BLOCK_BYTES:
            raise InvalidArgument(
                f"one block would be {self.block_bytes / 2**20:.1f} MiB, above the "
                f"{MAX_BLOCK_BYTES // 2**20} MiB limit; check block_tokens and the head sizes")

    def _check_engine_native(self) -> None:
        if not isinstance(self.engine_layout, str) or len(self.engine_layout) > 128:
            raise InvalidArgument("engine_layout must be a layout name of at most 128 characters")
        _positive_int("block_bytes", self.block_bytes_opaque, MAX_BLOCK_BYTES)
        if self.dtype not in DTYPE_BYTES and self.dtype not in OPAQUE_DTYPE_BYTES:
            raise InvalidArgument(
                f"unknown dtype {self.dtype!r} for an engine-native layout; expected one of "
                f"{sorted(DTYPE_BYTES) + sorted(OPAQUE_DTYPE_BYTES)}")
        if not self.kv_axes:
            return
        if sorted(self.kv_axes) != sorted(CANONICAL_AXES):
            raise InvalidArgument(f"kv_axes {self.kv_axes!r} must order the letters "
                                  f"{CANONICAL_AXES!r} (layers, K/V, tokens, heads, head_dim)")
        if self.dtype not in DTYPE_BYTES:
            raise InvalidArgument(f"a declared layout (kv_axes) needs a float dtype, not "
                                  f"{self.dtype!r}: lossy codecs cannot requantize it")
        _positive_int("num_layers", self.num_layers, 1024)
        _positive_int("num_kv_heads", self.num_kv_heads, 1024)
        _positive_int("head_dim", self.head_dim, 4096)
        _positive_int("block_tokens", self.block_tokens, MAX_BLOCK_TOKENS)
        kv = self.block_elements * DTYPE_BYTES[self.dtype]
        if kv != self.block_bytes_opaque:
            raise InvalidArgument(
                f"the declared KV geometry holds {kv} bytes but blocks are "
                f"{self.block_bytes_opaque}; declare the layout only when it covers the block")

    @property
    def engine_native(self) -> bool:
        return bool(self.engine_layout)

    @property
    def declared(self) -> bool:
        """Whether lossy codecs may be used: the canonical layout, or a declared engine one."""
        return not self.engine_layout or bool(self.kv_axes)

    def canonical_layout(self) -> KVLayout:
        """The canonical layout with this block's KV geometry (for lossy codecs)."""
        if not self.declared:
            raise InvalidArgument(f"engine layout {self.engine_layout!r} declares no KV "
                                  "geometry (kv_axes); only lossless codecs apply")
        return KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.block_tokens,
                        self.dtype)

    @property
    def interior_shape(self) -> tuple[int, ...]:
        """Shape of the block as stored, in `kv_axes` order (the canonical shape if none)."""
        size = dict(zip(CANONICAL_AXES, self.block_shape, strict=True))
        return tuple(size[a] for a in (self.kv_axes or CANONICAL_AXES))

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES.get(self.dtype) or OPAQUE_DTYPE_BYTES[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    @property
    def block_elements(self) -> int:
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    @property
    def block_bytes(self) -> int:
        if self.engine_layout:
            return self.block_bytes_opaque
        return self.block_elements * self.itemsize

    def identity(self) -> dict:
        """The fields that name this layout in a namespace digest.

        The engine-native fields appear only when set, so that namespaces registered before
        they existed keep their ids (and their stored blocks).
        """
        d = asdict(self)
        if not self.engine_layout:
            for k in ("engine_layout", "block_bytes_opaque", "kv_axes"):
                d.pop(k)
        return d


@dataclass(frozen=True)
class NamespaceSpec:
    """Everything that decides whether two writers' blocks are interchangeable."""

    model: str
    layout: KVLayout
    revision: str = ""
    shard_rank: int = 0
    shard_size: int = 1
    hash_scheme: str = "kvstore-blake3-v1"
    tenant_salt: str = ""
    codec: str = "lossless"
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise InvalidArgument("model must be a non-empty string naming the model")
        if len(self.model) > 512:
            raise InvalidArgument("model name is longer than 512 characters")
        if not isinstance(self.layout, KVLayout):
            raise InvalidArgument("layout must be a KVLayout")
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) \
                or self.shard_size < 1:
            raise InvalidArgument(f"shard_size must be a positive integer, got {self.shard_size!r}")
        if isinstance(self.shard_rank, bool) or not isinstance(self.shard_rank, int) \
                or not 0 <= self.shard_rank < self.shard_size:
            raise InvalidArgument(
                f"shard_rank must be in [0, shard_size={self.shard_size}), got {self.shard_rank!r}")
        if self.hash_scheme not in HASH_SCHEMES and not self.hash_scheme.startswith("external:"):
            raise InvalidArgument(
                f"unknown hash_scheme {self.hash_scheme!r}; use one of {list(HASH_SCHEMES)} "
                "or 'external:<name>' for engine-computed keys")
        if self.codec not in CODECS:
            raise InvalidArgument(f"unknown codec {self.codec!r}; expected one of {list(CODECS)}")
        if self.codec != "lossless" and not self.layout.declared:
            raise InvalidArgument(
                f"codec {self.codec!r} needs to know which bytes are K and V of which head, but "
                f"engine layout {self.layout.engine_layout!r} declares no KV geometry (kv_axes);"
                " use codec='lossless' or declare the layout")

    def canonical(self) -> bytes:
        """The byte string the digest covers (sorted-key JSON, stable across versions)."""
        d = asdict(self)
        d["layout"] = self.layout.identity()
        return json.dumps(d, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> bytes:
        """16-byte namespace id."""
        return blake3.blake3(b"kvstore-namespace-v1\0" + self.canonical()).digest(16)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> NamespaceSpec:
        d = dict(d)
        layout = d.pop("layout")
        if isinstance(layout, dict):
            try:
                layout = KVLayout(**layout)
            except TypeError as e:
                raise InvalidArgument(f"bad layout: {e}") from None
        try:
            return cls(layout=layout, **d)
        except TypeError as e:
            raise InvalidArgument(f"bad namespace spec: {e}") from None


RETENTION_LEVELS = ("low", "normal", "high")


def check_retention(level: object) -> str:
    """Validate a Retain level: "low" (not expected to be reused: evict first), "normal", or
    "high" (expected back: keep like a block already reused)."""
    if level not in RETENTION_LEVELS:
        raise InvalidArgument(f"retention level must be one of {', '.join(RETENTION_LEVELS)}; "
                              f"got {str(level)[:40]!r}")
    return str(level)
