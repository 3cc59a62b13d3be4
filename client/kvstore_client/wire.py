"""Put/Get messages encoded by hand, and the namespace spec as protobuf.

Put and Get move the block bytes; encoding them by hand avoids protobuf's extra copies of
multi-MiB `bytes` fields (one join here, and zero-copy views on the way back). The daemon's
server does the mirror image (kvstore/server.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._proto import kvstore_pb2 as pb
from .common.errors import DataLoss
from .common.layout import NamespaceSpec


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _read_varint(buf: memoryview, i: int) -> tuple[int, int]:
    shift = n = 0
    while True:
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7
        if shift > 63:
            raise DataLoss("malformed Get response from the daemon (varint too long)")


def encode_put(ns_id: bytes, parent: bytes, blocks: Sequence[tuple[bytes, Any]],
               token_ids: bytes = b"") -> bytes:
    """A serialized PutRequest holding `blocks` [(key, bytes-like or list of bytes-likes)] and
    their `token_ids` (little-endian uint32, block_tokens a block; b"": none)."""
    parts: list[Any] = []
    if ns_id:
        parts += [b"\x0a", _varint(len(ns_id)), ns_id]
    if parent:
        parts += [b"\x12", _varint(len(parent)), parent]
    if token_ids:
        parts += [b"\x22", _varint(len(token_ids)), token_ids]
    for key, data in blocks:
        pieces = data if isinstance(data, list) else [data]
        n = sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in pieces)
        inner = 1 + len(_varint(len(key))) + len(key) + 1 + len(_varint(n)) + n
        parts += [b"\x1a", _varint(inner), b"\x0a", _varint(len(key)), key, b"\x12",
                  _varint(n), *pieces]
    return b"".join(parts)


def split_put(ns_id: bytes, parent: bytes, block: tuple[bytes, Any], size: int,
              token_ids: bytes = b"") -> Iterator[bytes]:
    """The PutRequests of one block sent alone in pieces of at most `size` bytes: the first
    with its key and its token ids, the rest with neither (protocol 3, kvstore.proto
    PutRequest)."""
    key, data = block
    pieces = data if isinstance(data, list) else [data]
    flat = [memoryview(p).cast("B") if not isinstance(p, np.ndarray)
            else memoryview(np.ascontiguousarray(p).reshape(-1).view(np.uint8)) for p in pieces]
    first = True
    chunk: list[Any] = []
    room = size
    for view in flat:
        while len(view):
            take, view = view[:room], view[room:]
            chunk.append(take)
            room -= len(take)
            if not room:
                yield encode_put(ns_id, parent, [(key, chunk)], token_ids) if first \
                    else encode_put(b"", b"", [(b"", chunk)])
                first, chunk, room = False, [], size
    if chunk:
        yield encode_put(ns_id, parent, [(key, chunk)], token_ids) if first \
            else encode_put(b"", b"", [(b"", chunk)])


def _malformed(what: str) -> DataLoss:
    return DataLoss(f"malformed Get response from the daemon ({what})")


def decode_get(raw: bytes) -> list[tuple[bytes, int, int]]:
    """[(key, data offset, data length)] of a serialized GetResponse, offsets into `raw`.

    Fields other than blocks, key and data are refused, not skipped one at a time: a reply of
    nothing but unknown fields would otherwise cost a Python step per field.
    """
    try:
        return _decode_get(memoryview(raw))
    except IndexError:
        raise _malformed("truncated varint") from None


def _decode_get(buf: memoryview) -> list[tuple[bytes, int, int]]:
    out: list[tuple[bytes, int, int]] = []
    i, end = 0, len(buf)
    while i < end:
        tag, i = _read_varint(buf, i)
        if tag != 0x0A:
            raise _malformed(f"field {tag >> 3}, wire type {tag & 7}, is not a block")
        n, i = _read_varint(buf, i)
        j, bend = i, i + n
        if bend > end:
            raise _malformed("truncated block")
        key, doff, dlen = b"", -1, 0
        while j < bend:
            t, j = _read_varint(buf, j)
            m, j = _read_varint(buf, j)
            if j + m > bend:
                raise _malformed("truncated field")
            if t == 0x0A:
                key = bytes(buf[j:j + m])
            elif t == 0x12:
                doff, dlen = j, m
            else:
                raise _malformed(f"block field {t >> 3}, wire type {t & 7}")
            j += m
        if doff < 0:
            raise _malformed("block without data")
        out.append((key, doff, dlen))
        i = bend
    return out


def spec_to_proto(spec: NamespaceSpec) -> pb.NamespaceSpec:
    lay = spec.layout
    return pb.NamespaceSpec(
        model=spec.model, revision=spec.revision,
        layout=pb.KVLayout(num_layers=lay.num_layers, num_kv_heads=lay.num_kv_heads,
                           head_dim=lay.head_dim, block_tokens=lay.block_tokens,
                           dtype=lay.dtype, engine_layout=lay.engine_layout,
                           block_bytes=lay.block_bytes_opaque, kv_axes=lay.kv_axes),
        shard_rank=spec.shard_rank, shard_size=spec.shard_size, hash_scheme=spec.hash_scheme,
        tenant_salt=spec.tenant_salt, codec=spec.codec, extra=dict(spec.extra))
