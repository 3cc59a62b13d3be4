"""vLLM's KV-event wire format, byte for byte (vllm/distributed/kv_events.py, vLLM 0.32).

A message is three ZMQ frames: topic, the batch's sequence number (8 bytes big-endian), and
the batch as msgpack: `[timestamp, [event, ...], data_parallel_rank]`. Each event is a map
tagged by "type" with vLLM's field names in vLLM's order; fields whose default vLLM omits
(extra_keys, group_idx, ...) are left out as vLLM's encoder leaves them out. msgspec, which vLLM
encodes with, and msgpack write the same bytes for these values (a test decodes ours with
vLLM's own classes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from ..index import GPU, HOST, SSD

# What each tier is to a router: GPU is a device hit, CPU a host copy (vllm-router credits it
# 0.8 by default), STORAGE a disk copy (0.3).
MEDIUM = {GPU: "GPU", HOST: "CPU", SSD: "STORAGE"}
U64 = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)     # a replay's end marker (vLLM's END_SEQ)
CLEARED: dict[str, Any] = {"type": "AllBlocksCleared"}


def u64(h: int | bytes) -> int:
    """An engine's block hash as the unsigned 64-bit int routers index: a negative int (SGLang
    publishes signed ones) wraps, bytes keep their low 64 bits (vLLM's own conversion)."""
    if isinstance(h, int):
        return h & U64
    return int.from_bytes(h, "big") & U64


def stored(hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int,
           medium: str) -> dict[str, Any]:
    return {"type": "BlockStored", "block_hashes": list(hashes), "parent_block_hash": parent,
            "token_ids": list(tokens), "block_size": block_size, "lora_id": None,
            "medium": medium, "lora_name": None}


def removed(hashes: Sequence[int], medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


def encode_batch(ts: float, events: list[dict[str, Any]], dp_rank: int | None) -> bytes:
    return msgpack.packb([float(ts), events, dp_rank], use_bin_type=True)


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
