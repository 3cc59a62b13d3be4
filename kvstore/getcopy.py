"""Get replies built in one pass: each block copied out of the host pool into the reply and
checked against its commit checksum while the copy is still in L1.

Why the copy is what gets checked: clients map the host pool read-write, so a slot can change
between a check and the copy that is sent; only a hash of the bytes that leave says something
about them (kvstore/verify.py). The previous way did that in two passes: `b"".join` the batch
into a message, then hash the message again (read back from L3 or RAM) on a worker thread.
Here the reply is a `bytes` object allocated uninitialised (PyBytes_FromStringAndSize(NULL, n):
nobody else holds it until it is returned, so filling it in place is safe) and the compiled
kernel (_getcopy_kernel.py) copies each block into it chunk by chunk, hashing each chunk of the
copy right after writing it. The check then costs the hash's arithmetic, not a second pass over
memory, a thread handoff, or parsing the message back.

Batch i+1 is copied and checked on a worker thread while the handler thread waits for gRPC to
send batch i (stream()), so neither the copy nor its check sits on the stream's critical path
when a core is free; the check is then as cheap with checking off (the bench's reference) as on.

A block whose copy does not match ends the reply there: the blocks before it (already checked)
go out, the caller counts and drops the block, and the rest is a miss. Without the kernel
(numba missing, KVSTORE_NO_KERNEL=1) the same contract holds with a join and a hash pass.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, NamedTuple

from kvstore_client.common.lazy import lazy_module

from .keychain import check_distinct
from .stream_budget import Tab
from .verify import first_mismatch

if TYPE_CHECKING:
    import numpy as np
else:   # loaded by the first Get (or the warm-up after SERVING), not at the daemon's start
    np = lazy_module("numpy", globals(), "np")

# Bytes copied, then hashed, at a time: small enough to stay in L1/L2 between the two.
CHUNK = 64 << 10

_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_bytes_addr = ctypes.pythonapi.PyBytes_AsString
_bytes_addr.restype = ctypes.c_void_p
_bytes_addr.argtypes = (ctypes.py_object,)

log = logging.getLogger(__name__)

_kernel: Any = None
_kernel_error: str | None = None
_lock = threading.Lock()


def _build() -> Any:
    """The compiled kernel (loaded from numba's disk cache after the first time), or None."""
    global _kernel, _kernel_error
    if _kernel is not None or _kernel_error is not None:
        return _kernel
    with _lock:
        if _kernel is None and _kernel_error is None:
            if os.environ.get("KVSTORE_NO_KERNEL"):
                _kernel_error = "disabled by KVSTORE_NO_KERNEL"
            else:
                try:
                    from ._getcopy_kernel import copy_check
                    _kernel = copy_check
                except Exception as e:  # noqa: BLE001 - numba or xxhash's C API missing
                    _kernel_error = f"{type(e).__name__}: {e}"
                    # The same bytes, slower; numba is a dependency, so this is a broken
                    # install, and it must not pass unseen.
                    log.error("the Get copy kernel did not load; replies take the join + hash "
                              "path: %s", _kernel_error)
    return _kernel


def kernel_status() -> str:
    """'compiled', or why Get replies take the join + hash path."""
    return "compiled" if _build() is not None else str(_kernel_error)


def warm_up() -> None:
    """Compile (or load) the kernel ahead of the first Get (a first compile takes seconds)."""
    src = np.zeros(2 * CHUNK + 1, np.uint8)
    encode([(b"k", src)], [0], check=True)
    encode([(b"k", src)], [0], check=False)


class Reply(NamedTuple):
    """blocks: how many blocks `msg` holds; bad: the key of the block that failed its check
    (the one after those in msg), None when every block passed."""

    blocks: int
    msg: bytes
    bad: bytes | None


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _header(key: bytes, n: int) -> bytes:
    """GetResponse.blocks entry up to its data: Block { bytes key = 1; bytes data = 2; }."""
    inner = 1 + len(_varint(len(key))) + len(key) + 1 + len(_varint(n)) + n
    return b"".join((b"\x0a", _varint(inner), b"\x0a", _varint(len(key)), key,
                     b"\x12", _varint(n)))


def encode(blocks: Sequence[tuple[bytes, np.ndarray]], checksums: Sequence[int],
           check: bool = True, kernel: bool = True) -> Reply:
    """The GetResponse wire bytes of `blocks` [(key, 1-D uint8 view of its slot)], each block's
    copy checked against `checksums` (every value, 0 included) unless check is False.

    kernel=False takes the path used without the compiled kernel (for tests of it).
    """
    if not blocks:
        return Reply(0, b"", None)
    kern = _build() if kernel else None
    if kern is None:
        return _encode_joined(blocks, checksums, check)
    heads = [_header(k, v.nbytes) for k, v in blocks]
    n = len(blocks)
    src = np.empty(n, np.uint64)
    lens = np.empty(n, np.int64)
    off = np.empty(n, np.int64)
    starts = []
    pos = 0
    for j, ((_, v), h) in enumerate(zip(blocks, heads, strict=True)):
        if v.dtype != np.uint8 or v.ndim != 1 or (v.nbytes and v.strides != (1,)):
            raise ValueError("a block view must be a contiguous 1-D uint8 array")
        starts.append(pos)
        src[j] = v.__array_interface__["data"][0]
        lens[j] = v.nbytes
        off[j] = pos + len(h)
        pos += len(h) + v.nbytes
    want = np.asarray(checksums[:n], dtype=np.uint64)
    if len(want) < n:
        raise ValueError(f"{n} blocks but {len(want)} checksums")
    msg = _new_bytes(None, pos)           # uninitialised; private to this call until returned
    addr = _bytes_addr(msg)
    for p, h in zip(starts, heads, strict=True):
        ctypes.memmove(addr + p, h, len(h))
    good = kern(addr, src, off, lens, want, CHUNK if check else 0)
    if good < 0:
        raise MemoryError("Get: could not allocate an xxh3 state")
    if good == n:
        return Reply(n, msg, None)
    # Only the blocks before the failed one were copied whole; the rest of msg is unwritten.
    return Reply(good, msg[:starts[good]], blocks[good][0])


def _encode_joined(blocks: Sequence[tuple[bytes, np.ndarray]], checksums: Sequence[int],
                   check: bool) -> Reply:
    """Without the kernel: one join, then a hash pass over the message (its private copy)."""
    parts: list[Any] = []
    starts, spans = [], []
    pos = 0
    for key, v in blocks:
        h = _header(key, v.nbytes)
        starts.append(pos)
        spans.append((pos + len(h), v.nbytes))
        parts += [h, v]
        pos += len(h) + v.nbytes
    msg = b"".join(parts)
    if not check:
        return Reply(len(blocks), msg, None)
    view = memoryview(msg)
    good = first_mismatch([view[o:o + m] for o, m in spans], checksums)
    if good == len(blocks):
        return Reply(good, msg, None)
    return Reply(good, msg[:starts[good]], blocks[good][0])


def stream(read: Callable[[list[bytes]], Reply], keys: list[bytes], per: int,
           report: Callable[[bytes], None], pool: ThreadPoolExecutor | None,
           tab: Tab | None = None, block_cost: int = 0) -> Iterator[bytes]:
    """The replies of the longest cached prefix of `keys`, `per` blocks at a time.

    read(chunk) copies and checks one batch (under its own read lease); report(key) counts and
    drops a block that failed. While batch i is sent, batch i+1 is read on `pool`; a read the
    pool has not started by the time it is needed runs on this thread instead (no waiting in
    the queue behind other streams). A stream cut short leaves a read in flight to finish on
    its own (it releases its lease; its reply is dropped).

    Each batch is charged block_cost bytes a block to `tab` (the tenant's StreamBudget) from
    before its read until its message has been sent (grpc's send returns once the message has
    left, so a client that stops reading holds the charge): the batch sent waits for room
    (until the call's deadline), the one read ahead is skipped when there is none, so a
    tenant's stalled Gets hold at most its budget of heap, not three blocks each.

    The keys must be distinct, checked here over the whole list: each batch's read checks its
    own, but a list repeating a run of keys in step with the batches would pass those checks
    and stream the same blocks again and again (kvstore/keychain.py).
    """
    check_distinct(keys)
    ahead: Future | None = None
    held = 0                        # charged to tab: this batch, and the one read ahead
    i = 0
    try:
        while i < len(keys):
            chunk = keys[i:i + per]
            cost = len(chunk) * block_cost if tab is not None else 0
            if ahead is None:       # holds nothing here: waiting cannot deadlock the tenant
                if tab is not None:
                    tab.take(cost, "Get")
                held += cost
            reply: Reply | None = (read(chunk) if ahead is None or ahead.cancel()
                                   else ahead.result())
            ahead = None
            assert reply is not None
            if reply.bad is not None:
                report(reply.bad)
            i += reply.blocks
            whole = reply.blocks == len(chunk)
            if whole and i < len(keys) and pool is not None:
                nxt = keys[i:i + per]
                ahead_cost = len(nxt) * block_cost if tab is not None else 0
                if tab is None or tab.try_take(ahead_cost):
                    held += ahead_cost
                    ahead = pool.submit(read, nxt)
            sent = reply.blocks
            if sent:
                yield reply.msg
            reply = None            # the message is sent: drop it before giving its charge
            if tab is not None:
                tab.give(cost)
            held -= cost
            if not whole:
                return
    finally:
        if ahead is not None:
            ahead.cancel()
        if tab is not None:
            tab.give(held)
