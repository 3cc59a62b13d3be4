"""Transfer planning between an engine's paged cache and pool slots (pure numpy).

Why it is separate: the plan is the same whatever executes it (a Triton kernel or torch index
ops on a GPU, torch index ops on the CPU device), so it is written once, on the CPU, and
tested there. A plan lists equal-size runs that are contiguous on both sides; the executor only
moves bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .common.errors import InvalidArgument
from .common.layout import KVLayout

# More runs per block than this means the cache layout has no usable contiguous dimension.
MAX_RUNS_PER_BLOCK = 1 << 20


@dataclass(frozen=True)
class TensorGeom:
    """Address, element size, shape [num_blocks, block_tokens, heads, head_dim] and strides
    (in elements) of one K or V cache tensor of one layer."""

    addr: int
    itemsize: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]

    @classmethod
    def of(cls, t: Any) -> TensorGeom:
        return cls(int(t.data_ptr()), int(t.element_size()), tuple(t.shape), tuple(t.stride()))

    def extent(self) -> tuple[int, int]:
        """[lowest, highest+1) byte address any element can occupy."""
        lo = hi = 0
        for n, s in zip(self.shape, self.strides, strict=True):
            if n > 1:
                if s >= 0:
                    hi += (n - 1) * s
                else:
                    lo += (n - 1) * s
        return self.addr + lo * self.itemsize, self.addr + (hi + 1) * self.itemsize

    def block_span(self) -> int:
        """Bytes one block's elements spread over (must not exceed the block stride)."""
        return (sum((n - 1) * abs(s) for n, s in zip(self.shape[1:], self.strides[1:],
                                                     strict=True)) + 1) * self.itemsize


@dataclass(frozen=True)
class StaticPlan:
    """The per-cache part of every transfer, computed once per copier.

    Run r of block b lives at `eng_off[r] + b * eng_stride[r]` in the engine cache and at
    `slot + part_off[r]` in the pool; every run is `run_bytes` long and contiguous on both sides.
    """

    run_bytes: int
    eng_off: np.ndarray       # (R,) int64 absolute byte address of run r of block 0
    eng_stride: np.ndarray    # (R,) int64 bytes between consecutive blocks
    part_off: np.ndarray      # (R,) int64 byte offset of run r inside a canonical slot
    num_blocks: int


@dataclass(frozen=True)
class RunPlan:
    """Equal-size contiguous runs: run i is `run_bytes` at `engine[i]` ↔ `pool[i]`."""

    engine: np.ndarray       # int64 absolute byte addresses in the engine cache
    pool: np.ndarray         # int64 absolute byte addresses in the pool
    run_bytes: int

    @property
    def nbytes(self) -> int:
        return int(self.engine.size) * self.run_bytes


def _dense_suffix_elems(g: TensorGeom) -> int:
    """Elements of the longest row-major dense suffix of one block's [T, H, D]."""
    run, expected = 1, 1
    for n, s in zip(reversed(g.shape[1:]), reversed(g.strides[1:]), strict=True):
        if n != 1 and s != expected:
            break
        run *= n
        expected *= n
    return run


def _elements_overlap(g: TensorGeom) -> bool:
    """Whether two elements of one block [T, H, D] share an address (a stride 0, or strides
    that interleave). Why: the block check above looks only across blocks, and a copy into
    such a tensor keeps the last of several values. Sorted by stride, each axis must step past
    everything the smaller ones span, as the block stride must past a whole block."""
    span = 0                    # elements the smaller axes reach beyond their first
    for s, n in sorted((abs(s), n) for n, s in zip(g.shape[1:], g.strides[1:], strict=True)
                       if n > 1):
        if s <= span:
            return True
        span += (n - 1) * s
    return False


def static_plan(geoms: Sequence[TensorGeom], layout: KVLayout) -> StaticPlan:
    """Runs of one block: the largest pieces contiguous in both the engine tensor and the
    canonical slot, the same size for every tensor, so one launch moves a whole batch.

    `geoms` lists K and V in canonical order (layer 0 K, layer 0 V, layer 1 K, ...).
    """
    T, H, D = layout.block_tokens, layout.num_kv_heads, layout.head_dim
    if len(geoms) != 2 * layout.num_layers:
        raise InvalidArgument(f"the cache has {len(geoms)} K/V tensors; the layout needs "
                              f"{2 * layout.num_layers} ({layout.num_layers} layers x K,V)")
    nb = geoms[0].shape[0] if geoms and geoms[0].shape else 0
    for c, g in enumerate(geoms):
        if len(g.shape) != 4 or tuple(g.shape[1:]) != (T, H, D):
            raise InvalidArgument(f"cache tensor {c} has shape {g.shape}; expected "
                                  f"[num_blocks, {T}, {H}, {D}]")
        if g.itemsize != layout.itemsize:
            raise InvalidArgument(f"cache tensor {c} has {g.itemsize}-byte elements; the "
                                  f"namespace dtype {layout.dtype} has {layout.itemsize}")
        if g.shape[0] != nb:
            raise InvalidArgument("all cache tensors must have the same number of blocks")
        if nb > 1 and abs(g.strides[0]) * g.itemsize < g.block_span():
            raise InvalidArgument(f"cache tensor {c}: blocks overlap (block stride "
                                  f"{g.strides[0]} elements)")
        if _elements_overlap(g):
            raise InvalidArgument(
                f"cache tensor {c}: elements of one block overlap (strides {g.strides[1:]} for "
                f"[block_tokens, heads, head_dim] {g.shape[1:]}, e.g. a head axis broadcast "
                "with expand): a load would write several values to one address and leave "
                "the cache holding other bytes than the block; give every (token, head, dim) "
                "its own memory (e.g. .contiguous())")
    e = layout.itemsize
    chunk = T * H * D                      # elements of one (layer, K|V) part of a block
    run = 0
    for g in geoms:
        run = int(np.gcd(run, _dense_suffix_elems(g)))
    q = chunk // run                       # runs per (layer, K|V) part
    if len(geoms) * q > MAX_RUNS_PER_BLOCK:
        raise InvalidArgument(f"the cache layout is contiguous only in pieces of {run * e} "
                              f"bytes ({len(geoms) * q} per block); keep head_dim contiguous "
                              "(stride 1)")
    starts = np.arange(q, dtype=np.int64) * run          # canonical element offsets in a part
    t_i, h_i, d_i = np.unravel_index(starts, (T, H, D))
    within = np.stack([t_i * g.strides[1] + h_i * g.strides[2] + d_i * g.strides[3]
                       for g in geoms]).astype(np.int64)                     # (2L, q)
    addr = np.array([g.addr for g in geoms], dtype=np.int64)[:, None]
    eng_off = (addr + within * e).reshape(-1)
    eng_stride = np.repeat(np.array([g.strides[0] * e for g in geoms], dtype=np.int64), q)
    part_off = (np.arange(len(geoms), dtype=np.int64)[:, None] * chunk * e
                + (starts * e)[None, :]).reshape(-1)
    return StaticPlan(run * e, eng_off, eng_stride, part_off, nb)


def index_array(name: str, values: Any) -> np.ndarray:
    """`values` as a 1-D integer array, copied only where it is not one already."""
    arr = np.asarray(values.cpu() if hasattr(values, "cpu") else values)
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgument(f"{name} must be a 1-D sequence of integers")
    return arr


def write_batch(blocks: np.ndarray, slots: np.ndarray, out: np.ndarray) -> int:
    """Write a batch into `out` (int64 [2, n]: block ids, then slot offsets); returns the
    bitwise OR of the slot offsets (for `copy_width`). Checks only that the sizes agree."""
    n = blocks.size
    if slots.size != n:
        raise InvalidArgument(f"{n} block ids but {slots.size} slot offsets")
    if n == 0:
        return 0
    out[0] = blocks
    out[1] = slots
    return int(np.bitwise_or.reduce(out[1]))


def check_staged(sp: StaticPlan, layout: KVLayout, out: np.ndarray, pool_size: int,
                 to_pool: bool, distinct: bool = True) -> None:
    """Refuse a batch `write_batch` staged whose block ids or slots are out of bounds, or
    (with `distinct`) that names a destination twice, in a handful of numpy calls.

    On a GPU the copier runs these while the kernel copies (the kernel itself skips any block
    id or slot out of bounds), because a call's host work before the launch delays a copy of
    a few hundred MiB that takes a fraction of a millisecond."""
    if out.shape[1] == 0:
        return
    b, s = out[0], out[1]
    if distinct:        # the destinations sorted give their bounds too
        dst = np.sort(s if to_pool else b)
        lo, hi = int(dst[0]), int(dst[-1])
        other = b if to_pool else s
        b_lo, b_hi, s_lo, s_hi = ((int(other.min()), int(other.max()), lo, hi) if to_pool
                                  else (lo, hi, int(other.min()), int(other.max())))
    else:
        b_lo, b_hi, s_lo, s_hi = int(b.min()), int(b.max()), int(s.min()), int(s.max())
    if b_lo < 0:
        raise InvalidArgument("block_ids must not be negative")
    if b_hi >= sp.num_blocks:
        raise InvalidArgument(f"block_ids holds {b_hi}, outside [0, {sp.num_blocks})")
    if s_lo < 0:
        raise InvalidArgument("slot_offsets must not be negative")
    if s_hi + layout.block_bytes > pool_size:
        raise InvalidArgument(f"slot offset {s_hi} + block of {layout.block_bytes} bytes runs "
                              f"past the {pool_size}-byte pool")
    if distinct:
        _refuse_repeats(dst, layout.block_bytes, to_pool)


def _refuse_repeats(dst: np.ndarray, block_bytes: int, to_pool: bool) -> None:
    """Two copies writing the same destination would race: `dst` (sorted) must not repeat
    an engine block, or hold pool slots closer than a block apart."""
    if dst.size < 2:
        return
    if to_pool:
        if ((dst[1:] - dst[:-1]) < block_bytes).any():
            raise InvalidArgument("pool slots overlap: a destination appears twice in one "
                                  "transfer")
    elif (dst[1:] == dst[:-1]).any():
        raise InvalidArgument("engine blocks: a destination appears twice in one transfer")


def check_batch(sp: StaticPlan, layout: KVLayout, block_ids: Any, slot_offsets: Any,
                pool_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Validate a batch against the cache and pool; O(n), never O(runs). Returns the block
    ids and slot offsets as int64 arrays."""
    blocks = index_array("block_ids", block_ids)
    slots = index_array("slot_offsets", slot_offsets)
    out = np.empty((2, blocks.size), np.int64)
    write_batch(blocks, slots, out)
    check_staged(sp, layout, out, pool_size, to_pool=False, distinct=False)
    return out[0], out[1]


def check_distinct(blocks: np.ndarray, slots: np.ndarray, block_bytes: int,
                   to_pool: bool) -> None:
    """Two copies writing the same destination would race; refuse the batch."""
    _refuse_repeats(np.sort(slots if to_pool else blocks), block_bytes, to_pool)


def plan_block_runs(geoms: Sequence[TensorGeom], layout: KVLayout, block_ids: Any,
                    slot_offsets: Any, pool_addr: int, pool_size: int) -> RunPlan:
    """Absolute addresses of every run of a batch (host-side; the copier does this on device)."""
    sp = static_plan(geoms, layout)
    blocks, slots = check_batch(sp, layout, block_ids, slot_offsets, pool_size)
    engine = sp.eng_off[None, :] + blocks[:, None] * sp.eng_stride[None, :]
    pool = pool_addr + slots[:, None] + sp.part_off[None, :]
    return RunPlan(engine.reshape(-1), pool.reshape(-1), sp.run_bytes)


def copy_width(*values: Any) -> int:
    """Largest element width (≤16 bytes) dividing every address and size: the widest view."""
    acc = 16
    for v in values:
        if isinstance(v, np.ndarray):
            if v.size:
                acc |= int(np.bitwise_or.reduce(v.astype(np.int64)))
        else:
            acc |= int(v)
    return min(16, acc & -acc)

