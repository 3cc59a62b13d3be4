"""vLLM's KV-event wire format, byte for byte (vllm/distributed/kv_events.py, vLLM 0.32).

A message is three ZMQ frames: topic, the batch's sequence number (8 bytes big-endian), and
the batch as msgpack: `[timestamp, [event, ...], data_parallel_rank]`. Each event is a map
tagged by "type" with vLLM's field names in vLLM's order; fields whose default vLLM omits
(extra_keys, group_idx, ...) are left out as vLLM's encoder leaves them out. msgspec, which vLLM
encodes with, and msgpack write the same bytes for these values (a test decodes ours with
vLLM's own classes and encodes them back to the same bytes).

Events are built as msgpack bytes, not as maps: a stored event is the block's text (its
hashes, parent and token ids, already packed: texts.py) between constant pieces, and a batch
is its events' bytes joined under a header. That keeps the publisher's work per event to a
few joins of bytes (it shares the GIL with the store).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import msgpack

from ..entry import GPU, HOST, SSD

# What each tier is to a router: GPU is a device hit, CPU a host copy (vllm-router credits it
# 0.8 by default), STORAGE a disk copy (0.3).
MEDIUM = {GPU: "GPU", HOST: "CPU", SSD: "STORAGE"}
U64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)     # a replay's end marker (vLLM's END_SEQ)


_local = threading.local()


def packer() -> msgpack.Packer:
    """This thread's packer (msgpack.packb makes a Packer per call: most of its cost on small
    values; a Packer is not thread-safe)."""
    p = getattr(_local, "packer", None)
    if p is None:
        p = _local.packer = msgpack.Packer(use_bin_type=True)
    return p


def pack(obj: Any) -> bytes:
    return packer().pack(obj)


_STORED_HEAD = b"\x88" + pack("type") + pack("BlockStored") + pack("block_hashes")
_K_PARENT = pack("parent_block_hash")
_K_TOKENS = pack("token_ids")
_K_BLOCK_SIZE = pack("block_size")
_LORA_ID_NIL = pack("lora_id") + pack(None)
_STORED_TAIL = {m: pack("medium") + pack(m) + pack("lora_name") + pack(None)
                for m in MEDIUM.values()}
_REMOVED_HEAD = b"\x83" + pack("type") + pack("BlockRemoved") + pack("block_hashes")
_K_MEDIUM = pack("medium")
CLEARED = pack({"type": "AllBlocksCleared"})


def u64(h: int | bytes) -> int:
    """An engine's block hash as the unsigned 64-bit int routers index: a negative int (SGLang
    publishes signed ones) wraps, bytes keep their low 64 bits (vLLM's own conversion)."""
    if isinstance(h, int):
        return h & U64
    return int.from_bytes(h, "big") & U64


def stored(hashes: Sequence[int], parent: int | None, packed_tokens: bytes, block_size: int,
           medium: str, lora: tuple[int | None, str | None] | None = None) -> bytes:
    """A BlockStored event; `packed_tokens` is the token ids as a msgpack array. `lora` is
    the (lora_id, lora_name) of the engine blocks a relay learned it from: routers hash a
    LoRA adapter's blocks with its name, so a block announced without it would be credited
    to the base model's requests."""
    p = packer().pack
    if lora is None:
        return b"".join((_STORED_HEAD, p(hashes), _K_PARENT, p(parent), _K_TOKENS,
                         packed_tokens, _K_BLOCK_SIZE, p(block_size), _LORA_ID_NIL,
                         _STORED_TAIL[medium]))
    return b"".join((_STORED_HEAD, p(hashes), _K_PARENT, p(parent), _K_TOKENS,
                     packed_tokens, _K_BLOCK_SIZE, p(block_size), p("lora_id"), p(lora[0]),
                     _K_MEDIUM, p(medium), p("lora_name"), p(lora[1])))


def removed(hashes: Sequence[int], medium: str) -> bytes:
    return b"".join((_REMOVED_HEAD, pack(hashes), _K_MEDIUM, pack(medium)))


def array_header(n: int) -> bytes:
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode_batch(ts: float, events: Sequence[bytes], dp_rank: int | None) -> bytes:
    """A batch of already encoded events."""
    return b"".join((b"\x93", pack(float(ts)), array_header(len(events)), *events,
                     pack(dp_rank)))


def array_length(packed: bytes) -> int:
    """The element count of a msgpack array (-1 for anything else)."""
    if not packed:
        return -1
    b = packed[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(packed) >= 3:
        return int.from_bytes(packed[1:3], "big")
    if b == 0xDD and len(packed) >= 5:
        return int.from_bytes(packed[1:5], "big")
    return -1


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """An engine's batch; ValueError for anything that is not one (garbage costs a log line)."""
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several kinds
        raise ValueError(f"not msgpack ({type(e).__name__})") from None
    if not isinstance(obj, (list, tuple)) or len(obj) < 2 or not isinstance(obj[1], list):
        raise ValueError("not a [ts, [events], dp_rank] batch")
    ts = obj[0] if isinstance(obj[0], (int, float)) else 0.0
    rank = obj[2] if len(obj) > 2 and isinstance(obj[2], int) else None
    return float(ts), [e for e in obj[1] if isinstance(e, dict)], rank


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")
