"""Move blocks between an engine's tensor and the pool in one pass, checksummed on the way.

Why a compiled kernel: a block is gathered from (or scattered into) many rows of the engine's
tensor, one per layer and K/V, and both directions need the block's xxh3-64. Done with numpy
and the xxhash module that is one numpy call per block (a Python cost per block, which 128 KiB
blocks feel) plus a second pass over every byte for the checksum. The kernel here (numba, a
PyPI wheel: no build toolchain at install, compiled on first use and cached on disk) copies a
row and checksums it while it is still in L1, so the checksum costs no extra pass over memory;
it releases the GIL, and a batch is split into
one contiguous range of blocks per thread, so all the cores the engine lends copy in parallel
and a batch costs a handful of Python calls however many blocks it holds.

The checksum is the xxhash wheel's XXH3-64, called from the kernel (see _blockcopy_kernel.py),
so it is the daemon's bit for bit. The kernel needs each row of a block to be contiguous in the
engine's tensor (true of the canonical layouts and of paged caches); the `*_plan()` helpers
return None for anything else and callers fall back to numpy copies plus xxhash (correct,
slower). Without numba installed, or with KVSTORE_NO_KERNEL=1, the same fallback runs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

_kernel: Any = None
_kernel_module: Any = None     # _blockcopy_kernel, once _build() imported it
_kernel_lock = threading.Lock()
_kernel_error: str | None = None


def _build() -> Any:
    """Compile (or load from numba's on-disk cache) the copy kernel; None without numba."""
    global _kernel, _kernel_error, _kernel_module
    if _kernel is not None or _kernel_error is not None:
        return _kernel
    with _kernel_lock:
        if _kernel is not None or _kernel_error is not None:
            return _kernel
        if os.environ.get("KVSTORE_NO_KERNEL"):
            _kernel_error = "disabled by KVSTORE_NO_KERNEL"
            return None
        try:
            from . import _blockcopy_kernel as k
            _kernel, _kernel_module = k.move_blocks, k
        except ImportError as e:        # numba missing: numpy + xxhash fallback
            _kernel_error = f"numba unavailable ({e})"
        except Exception as e:  # noqa: BLE001 - e.g. an xxhash build without the C API
            _kernel_error = f"kernel unavailable ({type(e).__name__}: {e})"
        if _kernel_error is not None:
            # Correct but slower; numba is a dependency, so this is a broken install: say so.
            log.warning("kvstore: the block copy kernel did not load, copies take the numpy + "
                        "xxhash path: %s", _kernel_error)
        return _kernel


def _fused_hash_fits(plan: Plan, eng_blk: np.ndarray, slot_off: np.ndarray, pool: int,
                     to_slots: bool) -> bool:
    """Whether the one-pass copy + XXH3 kernel takes this batch: rows a whole number of
    XXH3's 1 KiB blocks, destinations 32-byte aligned (streaming stores)."""
    if plan.row_bytes % 1024 or os.environ.get("KVSTORE_NO_FUSED_HASH"):
        return False
    if to_slots:
        return pool % 32 == 0 and not (slot_off % 32).any()
    eng = plan.base + eng_blk[:, None] + plan.eng_row[None, :]
    return not (eng % 32).any()


def kernel_available() -> bool:
    """True when the compiled kernel can run (numba importable, not disabled)."""
    return _build() is not None


def kernel_status() -> str:
    """'compiled' or why the numpy fallback is used (for benches and logs)."""
    return "compiled" if _build() is not None else str(_kernel_error)


def warm_up() -> None:
    """Compile (or load from numba's disk cache) both copy kernels, each way: the one that
    hashes inside the copy and the two-pass one. Raises RuntimeError when the kernel does not
    load, so a build step can fail on it (callers at run time fall back instead)."""
    if _build() is None:
        raise RuntimeError(f"blockcopy kernel unavailable: {_kernel_error}")
    x = np.arange(2 * 2 * 16 * 64, dtype=np.int16).reshape(1, 2, 2 * 16, 1, 64)
    plan = seq_plan(x, 16)
    pool = np.zeros(4 * plan.block_bytes + 64, dtype=np.uint8)
    base = -_addr(pool) % 32                      # a 32-byte aligned slot takes the fused kernel
    sums = np.zeros(2, dtype=np.uint64)
    for offsets in ([base, base + plan.block_bytes], [base + 8, base + 8 + plan.block_bytes]):
        for to_slots in (True, False):
            run(plan, pool, [0, 1], offsets, to_slots, sums, 1)
            run(plan, pool, [0, 1], offsets, to_slots, None, 1)


# ----------------------------------------------------------------------------- threads

_pool_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_retired: list[ThreadPoolExecutor] = []   # never shut down: another thread may still use one


# Memory bandwidth is saturated well before this many copy threads; more only take cores from
# the engine. `connect(copy_threads=N)` overrides.
MAX_DEFAULT_THREADS = 16


def default_threads() -> int:
    """The cores this process may run on (the engine's share of the machine), at most 16."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:          # not Linux
        n = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_THREADS, n))


def _executor(threads: int) -> ThreadPoolExecutor | None:
    global _pool, _pool_size
    if threads <= 1:
        return None
    with _pool_lock:
        if _pool is None or _pool_size < threads - 1:
            if _pool is not None:
                _retired.append(_pool)
            _pool = ThreadPoolExecutor(max_workers=threads - 1,
                                       thread_name_prefix="kvstore-copy")
            _pool_size = threads - 1
        return _pool


# Below this many bytes per thread a batch runs on the calling thread alone: handing work to
# another thread costs more than the copy.
_MIN_BYTES_PER_THREAD = 1 << 20
# Work ranges per thread in a parallel batch (see run()).
_RANGES_PER_THREAD = 8


# ----------------------------------------------------------------------------- plans

@dataclass
class Plan:
    """Where every row of every block sits in the engine's memory, as byte offsets from `base`.

    Block i's row r is at base + eng_blk[i] + eng_row[r], row_bytes long; in a slot it is at
    slot + r * row_bytes (the canonical order). `keep` holds the arrays the addresses point
    into, so they live as long as the plan.
    """

    keep: list[Any]
    base: int
    eng_blk: np.ndarray
    eng_row: np.ndarray
    row_bytes: int

    @property
    def block_bytes(self) -> int:
        return self.row_bytes * len(self.eng_row)


def _addr(x: np.ndarray) -> int:
    return int(x.__array_interface__["data"][0])


def seq_plan(x: np.ndarray, block_tokens: int) -> Plan | None:
    """A plan for the dense layout x = [L, 2, tokens, H, D] (integers, any positive strides).

    Block i is tokens [i*T, (i+1)*T) of every (layer, K/V) row: one contiguous run per row when
    the (tokens, H, D) axes of a row are contiguous.
    """
    if not isinstance(x, np.ndarray) or x.ndim != 5 or x.size == 0:
        return None
    L, _, N, H, D = x.shape
    isz = x.itemsize
    s = x.strides
    if s[0] < 0 or s[1] < 0 or s[4] != isz or (H > 1 and s[3] != D * isz) \
            or (N > 1 and s[2] != H * D * isz):
        return None
    row_bytes = block_tokens * H * D * isz
    n = N // block_tokens
    eng_blk = np.arange(n, dtype=np.int64) * row_bytes
    eng_row = np.array([lay * s[0] + k * s[1] for lay in range(L) for k in range(2)],
                       dtype=np.int64)
    return Plan([x], _addr(x), eng_blk, eng_row, row_bytes)


def paged_plan(layers: Sequence[np.ndarray], kv_axis: int, page_axis: int) -> Plan | None:
    """A plan for a paged cache: per layer [2, pages, T, H, D] or [pages, 2, T, H, D] (the
    (T, H, D) axes contiguous, every layer with the same shape and strides). Block j of a move
    is a page id: its rows are (layer, K/V) of that page."""
    if not layers or any(not isinstance(x, np.ndarray) or x.ndim != 5 or x.size == 0
                         for x in layers):
        return None
    x0 = layers[0]
    if any(x.shape != x0.shape or x.strides != x0.strides for x in layers):
        return None
    s, isz = x0.strides, x0.itemsize
    _, _, T, H, D = x0.shape
    if s[kv_axis] < 0 or s[page_axis] < 0 or s[4] != isz or (H > 1 and s[3] != D * isz) \
            or (T > 1 and s[2] != H * D * isz):
        return None
    addrs = [_addr(x) for x in layers]
    base = min(addrs)
    pages = x0.shape[page_axis]
    eng_blk = np.arange(pages, dtype=np.int64) * s[page_axis]
    eng_row = np.array([a - base + k * s[kv_axis] for a in addrs for k in range(2)],
                       dtype=np.int64)
    return Plan(list(layers), base, eng_blk, eng_row, T * H * D * isz)


# Rows of a flat block are fed to the hash right after their copy: small enough that the
# bytes are still in L1/L2 then (a whole 2 MiB block would be read back from L3 or memory).
_FLAT_ROW_BYTES = 32 << 10


def rows_plan(x: np.ndarray, block_bytes: int) -> Plan | None:
    """A plan for blocks that are the first `block_bytes` of each row of a 2-D array (an
    engine's own chunk pool, e.g. vLLM's primary CPU tier): block j is row j."""
    if not isinstance(x, np.ndarray) or x.ndim != 2 or x.size == 0 or block_bytes <= 0:
        return None
    if x.strides[1] != 1 or x.strides[0] < block_bytes or x.shape[1] < block_bytes:
        return None
    # A row size that divides the block, down to 4 KiB; else the block is one row (a hash
    # call per few bytes would cost more than reading a small block back from L2).
    row = next((r for r in (_FLAT_ROW_BYTES >> i for i in range(4)) if block_bytes % r == 0),
               block_bytes)
    eng_blk = np.arange(x.shape[0], dtype=np.int64) * x.strides[0]
    eng_row = np.arange(0, block_bytes, row, dtype=np.int64)
    return Plan([x], _addr(x), eng_blk, eng_row, row)


def run(plan: Plan, pool: np.ndarray, blocks: Sequence[int] | np.ndarray,
        offsets: Sequence[int], to_slots: bool, sums: np.ndarray | None,
        threads: int) -> None:
    """Move plan blocks `blocks[j]` to (to_slots) or from the slot at pool[offsets[j]:]; fill
    sums[j] with the XXH3-64 of each block's bytes when sums (uint64) is given.

    pool: a 1-D uint8 array (the mapped pool or a staging buffer). `blocks` index the plan's
    blocks (token blocks for a sequence, page ids for a paged cache) and are bounds-checked.
    """
    kern = _build()
    if kern is None:
        raise RuntimeError(f"blockcopy kernel unavailable: {_kernel_error}")
    n = len(offsets)
    if n == 0:
        return
    slot_off = np.asarray(offsets, dtype=np.int64)
    bb = plan.block_bytes
    if slot_off.min() < 0 or slot_off.max() + bb > pool.nbytes or pool.strides != (1,):
        raise ValueError("a slot lies outside the pool")
    idx = np.asarray(blocks, dtype=np.int64)
    if len(idx) != n or (n and (idx.min() < 0 or idx.max() >= len(plan.eng_blk))):
        raise ValueError(f"block indices must be {n} values in [0, {len(plan.eng_blk)})")
    if sums is not None and (sums.dtype != np.uint64 or len(sums) < n):
        raise ValueError("sums must be a uint64 array with one entry per block")
    eng_blk = plan.eng_blk[idx]
    out = sums if sums is not None else np.empty(0, dtype=np.uint64)
    if sums is not None and _fused_hash_fits(plan, eng_blk, slot_off, _addr(pool), to_slots):
        k = _kernel_module
        args = (plan.base, _addr(pool), eng_blk, plan.eng_row, slot_off, plan.row_bytes,
                to_slots, out, k._SEC, k._LAST, k._MERGE, k._INIT)
        kern = k.move_blocks_x3
    else:
        args = (plan.base, _addr(pool), eng_blk, plan.eng_row, slot_off, plan.row_bytes,
                to_slots, sums is not None, out)
    w = max(1, min(threads, n, (n * bb) // _MIN_BYTES_PER_THREAD))
    if w == 1:
        rcs = [kern(*args, 0, n)]
    else:
        # Ranges are handed out as threads ask for them, several per thread: on a busy machine
        # a thread can lose its core for a time slice, and a fixed half-and-half split would
        # make the whole batch wait for that straggler.
        per = max(1, -(-n // (w * _RANGES_PER_THREAD)), _MIN_BYTES_PER_THREAD // bb)
        ranges = iter([(j, min(n, j + per)) for j in range(0, n, per)])
        lock = threading.Lock()

        def drain_ranges() -> int:
            rc = 0
            while True:
                with lock:
                    r = next(ranges, None)
                if r is None:
                    return rc
                rc |= kern(*args, r[0], r[1])

        ex = _executor(w)
        futs = [ex.submit(drain_ranges) for _ in range(w - 1)]  # type: ignore[union-attr]
        rcs = [drain_ranges()] + [f.result() for f in futs]
    if any(rc != 0 for rc in rcs):
        raise MemoryError("blockcopy: could not allocate an xxh3 state")
