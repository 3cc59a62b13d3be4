"""Executing transfer plans: the engine's paged cache and the copier that moves its blocks.

Why one copier for both devices: the plan (`copy_plan`) is executed as one Triton kernel launch
on a GPU, or as bounded pairs of torch `index_select` / `index_copy_` over one wide-dtype view
spanning the pool and the cache, on a GPU without Triton or on host memory (the CPU device's
pool, which is a shared-memory slab). Both work for any cache layout described by strides and
a block table. Copies run on the client's own stream, after the engine's current stream; a
`Transfer` carries the event so the engine can make a stream wait on it (GPU-side) or wait with
a deadline (host-side) before Commit/Release.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .common.cuda_runtime import device_tensor, require_cuda, stream_idle
from .common.errors import InvalidArgument, Unavailable
from .common.layout import KVLayout
from .common.pools import host_tensor
from .common.runs import coalesce_runs
from .common.transfer import Transfer
from .copy_plan import (
    RunPlan,
    TensorGeom,
    check_batch,
    check_distinct,
    check_staged,
    copy_width,
    index_array,
    static_plan,
    write_batch,
)
from .triton_copy import LAUNCH_MODES, TritonExecutor, triton_kernel

if TYPE_CHECKING:  # pragma: no cover - typing only
    import torch

# A GPU without Triton stages through a temporary of at most this many bytes per step.
TORCH_STAGE_BYTES = 256 << 20
# On host memory (the CPU device), runs at least this long are copied one memcpy each ("runs"):
# torch's index ops over the overlapping-row view run at a fraction of memcpy speed there.
HOST_RUN_MIN_BYTES = 4096
# A refused GPU batch is waited for (what was in bounds is being copied) up to this long.
BAD_BATCH_WAIT_S = 60.0

# ---------------------------------------------------------------------------------------------
# executing plans
# ---------------------------------------------------------------------------------------------
_WIDE = {16: "complex128", 8: "int64", 4: "int32", 2: "int16", 1: "uint8"}


def _span_tensor(base: int, end: int, device: int | None, owner: object) -> torch.Tensor:
    """One 1-D uint8 tensor from `base` to `end` covering the cache and the pool (and the gaps
    between them, which are never touched), so one index op or kernel reaches both."""
    if device is None:
        return host_tensor(base, end - base, owner)
    return device_tensor(base, end - base, device, owner)


# ---------------------------------------------------------------------------------------------
# the engine-facing copier
# ---------------------------------------------------------------------------------------------
def _torch_dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


class PagedKVCache:
    """The engine's paged cache: per layer a K and a V tensor [num_blocks, tokens, heads, dim].

    Any strides are accepted (views into a bigger tensor are fine); head_dim should be
    contiguous. Constructors cover the common engines.
    """

    def __init__(self, layers: Sequence[tuple[Any, Any]]) -> None:
        if not layers:
            raise InvalidArgument("the cache has no layers")
        self.tensors: list[Any] = []
        for i, kv in enumerate(layers):
            if len(kv) != 2:
                raise InvalidArgument(f"layer {i}: expected a (K, V) pair")
            self.tensors.extend(kv)
        devs = {str(t.device) for t in self.tensors}
        if len(devs) != 1:
            raise InvalidArgument(f"cache tensors live on several devices: {sorted(devs)}")
        self.device = self.tensors[0].device
        self.dtype = _torch_dtype_name(self.tensors[0])

    @classmethod
    def from_layers(cls, layers: Sequence[tuple[Any, Any]]) -> PagedKVCache:
        return cls(layers)

    @classmethod
    def from_vllm(cls, kv_caches: Sequence[Any], kv_dim: int = 0) -> PagedKVCache:
        """vLLM flash-attn caches are [2, num_blocks, ...] per layer (kv_dim=0); FlashInfer's
        are [num_blocks, 2, ...] (kv_dim=1)."""
        if kv_dim not in (0, 1):
            raise InvalidArgument("kv_dim must be 0 ([2, blocks, ...]) or 1 ([blocks, 2, ...])")
        return cls([(t.select(kv_dim, 0), t.select(kv_dim, 1)) for t in kv_caches])

    def geoms(self) -> list[TensorGeom]:
        return [TensorGeom.of(t) for t in self.tensors]

    def check(self, layout: KVLayout) -> None:
        if self.dtype != layout.dtype:
            raise InvalidArgument(f"cache dtype {self.dtype} differs from the namespace dtype "
                                  f"{layout.dtype}")


class PagedCopier:
    """Moves blocks between one engine cache and one pool (device or host region).

    `pool` is a `DevicePool` or any object with `.ptr`, `.size` and `.device` (None for host
    memory, which runs the same torch path on the CPU). The per-cache plan is computed once
    here; a transfer uploads only its block ids and slot offsets and expands them to run
    addresses on the device. Copies run on `stream` (default: a stream owned by this copier),
    after the work already queued on the engine's current stream. `method`: "auto" (Triton
    when installed), "triton" or "torch". `launch`: how Triton batches are launched
    (`triton_copy.TritonExecutor`; "auto" picks the cheapest this machine allows).
    """

    def __init__(self, pool: Any, cache: PagedKVCache, layout: KVLayout,
                 stream: Any = None, method: str = "auto", launch: str = "auto") -> None:
        import torch

        if method not in ("auto", "triton", "torch", "runs"):
            raise InvalidArgument(f"unknown copy method {method!r}")
        if launch not in LAUNCH_MODES:
            raise InvalidArgument(f"unknown launch mode {launch!r}; one of {LAUNCH_MODES}")
        cache.check(layout)
        self.pool, self.cache, self.layout, self.method = pool, cache, layout, method
        self.device: int | None = None
        self.stream = None
        if cache.device.type == "cuda":
            torch_ = require_cuda(cache.device.index, "GPU copy")
            self.device = cache.device.index if cache.device.index is not None else \
                torch_.cuda.current_device()
            if pool.device is None:
                raise InvalidArgument("a CUDA cache needs a GPU pool (use the host slab for "
                                      "host memory)")
            self.stream = stream or torch.cuda.Stream(device=self.device)
            self._dev = torch.device("cuda", self.device)
        elif pool.device is not None:
            raise InvalidArgument("a CPU cache cannot copy from a GPU pool")
        else:
            self._dev = torch.device("cpu")
        geoms = cache.geoms()
        self._sp = static_plan(geoms, layout)
        regions = [g.extent() for g in geoms] + [(pool.ptr, pool.ptr + pool.size)]
        self._base = min(lo for lo, _ in regions)
        self._end = max(hi for _, hi in regions)
        sp = self._sp
        self._w = copy_width(sp.eng_off, sp.eng_stride, sp.part_off, sp.run_bytes, pool.ptr,
                             self._base)
        eng_rel = sp.eng_off - self._base
        pool_rel = sp.part_off + (pool.ptr - self._base)
        static = np.stack([eng_rel, sp.eng_stride, pool_rel])       # (3, R) bytes
        self._static = torch.from_numpy(static).to(self._dev)
        if self.stream is not None:
            self._static.record_stream(self.stream)   # used on our stream, made on another
        self._span: Any = None
        self._triton: TritonExecutor | None = None
        if self.device is not None:
            # Once, not per call: the caching allocator then holds these tensors' memory
            # until every copy queued on our stream so far is done, should the engine free it.
            for t in self.cache.tensors:
                t.record_stream(self.stream)
            self._ready = torch.cuda.Event()      # the engine's stream, re-recorded per call
            self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
            if method in ("auto", "triton"):
                if triton_kernel() is not None:
                    self._triton = TritonExecutor(
                        self._span_view(), self._static, self.runs_per_block, sp.run_bytes,
                        self.device, self.stream, sp.num_blocks,
                        pool.size - layout.block_bytes, launch)
                elif method == "triton":
                    raise Unavailable("Triton is not installed; use method='torch'")

    @property
    def runs_per_block(self) -> int:
        return int(self._sp.eng_off.size)

    def plan(self, block_ids: Any, slot_offsets: Any) -> RunPlan:
        """Host-side expansion of a batch (for inspection and tests; transfers use the device)."""
        blocks, slots = check_batch(self._sp, self.layout, block_ids, slot_offsets,
                                    self.pool.size)
        sp = self._sp
        engine = sp.eng_off[None, :] + blocks[:, None] * sp.eng_stride[None, :]
        pool = self.pool.ptr + slots[:, None] + sp.part_off[None, :]
        return RunPlan(engine.reshape(-1), pool.reshape(-1), sp.run_bytes)

    def load(self, block_ids: Any, slot_offsets: Any, after: Any = None) -> Transfer:
        """Pool slots → engine blocks (after a cache hit). Make compute wait on the result."""
        return self._run(block_ids, slot_offsets, after, to_pool=False)

    def store(self, block_ids: Any, slot_offsets: Any, after: Any = None) -> Transfer:
        """Engine blocks → pool slots (before Commit). Wait on the result before Commit."""
        return self._run(block_ids, slot_offsets, after, to_pool=True)

    # -- internals -------------------------------------------------------------------------------
    def _span_view(self) -> torch.Tensor:
        if self._span is None:
            self._span = _span_tensor(self._base, self._end, self.device, self.pool)
        return self._span

    def _run(self, block_ids: Any, slot_offsets: Any, after: Any, to_pool: bool) -> Transfer:
        import torch

        if getattr(self.pool, "closed", False):
            raise InvalidArgument("the GPU pool mapping is closed (daemon restarted? re-open it)")
        if self._triton is not None:
            return self._run_triton(block_ids, slot_offsets, after, to_pool)
        blocks, slots = check_batch(self._sp, self.layout, block_ids, slot_offsets,
                                    self.pool.size)
        check_distinct(blocks, slots, self.layout.block_bytes, to_pool)
        nbytes = int(blocks.size) * self.layout.block_bytes
        if blocks.size == 0:
            return Transfer(None, method="none")
        w = copy_width(self._w, slots)
        ids = torch.from_numpy(np.stack([blocks, slots]))
        if self.device is None:
            if self.method == "runs" or (self.method == "auto"
                                         and self._sp.run_bytes >= HOST_RUN_MIN_BYTES):
                self._execute_runs(blocks, slots, to_pool)
                return Transfer(None, method="runs", nbytes=nbytes)
            self._execute_torch(ids, w, to_pool)
            return Transfer(None, method="torch", nbytes=nbytes)
        s = self.stream
        with torch.cuda.device(self.device):
            s.wait_stream(torch.cuda.current_stream(self.device))   # engine's writes first
            if isinstance(after, Transfer):
                after.wait_stream(s)
            elif after is not None:          # a torch.cuda.Event
                s.wait_event(after)
            with torch.cuda.stream(s):
                # pinned staging: a pageable upload would block the host on the stream
                ids_d = ids.pin_memory().to(self._dev, non_blocking=True)
                method = self._execute_torch(ids_d, w, to_pool)
                ev = torch.cuda.Event()
                ev.record(s)
        return Transfer(ev, keepalive=(self.pool, ids_d), method=method, nbytes=nbytes)

    def _run_triton(self, block_ids: Any, slot_offsets: Any, after: Any,
                    to_pool: bool) -> Transfer:
        """The GPU's common path, kept short (triton_copy says why): write the batch into the
        bucket's staging buffer, order after the engine's stream, launch, then check the
        batch while the kernel (which skips anything out of bounds) copies."""
        import torch

        blocks = index_array("block_ids", block_ids)
        slots = index_array("slot_offsets", slot_offsets)
        n = blocks.size
        if n == 0 == slots.size:
            return Transfer(None, method="none")
        ex = self._triton
        with ex.lock:
            st = ex.staging(n)
            rows = st.batch(n)
            w = copy_width(self._w, write_batch(blocks, slots, rows))
            s = self.stream
            if not self._engine_idle():   # the engine's queued writes first (if any remain)
                self._ready.record(torch.cuda.current_stream(self.device))
                s.wait_event(self._ready)
            if isinstance(after, Transfer):
                after.wait_stream(s)
            elif after is not None:       # a torch.cuda.Event
                s.wait_event(after)
            ev = st.event = ex.run(st, n, w, to_pool)
            try:
                check_staged(self._sp, self.layout, rows, self.pool.size, to_pool)
            except InvalidArgument:
                # The kernel moved only what is in bounds; it must be done before the caller,
                # told the batch failed, reuses any block or slot it named.
                Transfer(ev, nbytes=0).wait(BAD_BATCH_WAIT_S)
                raise
        return Transfer(ev, keepalive=self.pool, method="triton",
                        nbytes=n * self.layout.block_bytes)

    def _engine_idle(self) -> bool:
        """True when the engine's current stream has nothing queued: then there is nothing
        to order the copy after (asked of the driver with the raw handle; torch's
        current_stream() builds a Python object per call)."""
        import torch

        raw = self._raw_stream
        # The raw handle of a default stream (0) names the current context's, so the driver
        # is asked only where this thread's current device is the copier's.
        if raw is not None and torch.cuda.current_device() == self.device:
            idle = stream_idle(raw(self.device))
            if idle is not None:
                return idle
        return bool(torch.cuda.current_stream(self.device).query())

    def _execute_runs(self, blocks: np.ndarray, slots: np.ndarray, to_pool: bool) -> None:
        """Host memory: one memcpy per run of the plan (no temporaries, no second pass)."""
        span = self._span_view().numpy()
        sp = self._sp
        eng = (sp.eng_off[None, :] + blocks[:, None] * sp.eng_stride[None, :]) - self._base
        pool = (self.pool.ptr - self._base) + slots[:, None] + sp.part_off[None, :]
        src, dst = (eng, pool) if to_pool else (pool, eng)
        src, dst, nb = coalesce_runs(src.reshape(-1), dst.reshape(-1),
                                     np.full(src.size, sp.run_bytes, np.int64))
        for so, do, n in zip(src.tolist(), dst.tolist(), nb.tolist(), strict=True):
            np.copyto(span[do:do + n], span[so:so + n])

    def _execute_torch(self, ids: torch.Tensor, w: int, to_pool: bool) -> str:
        """Fallback: index_select into a bounded temporary, then index_copy_, over overlapping
        rows of one wide view (row k = run_bytes starting at element k)."""
        import torch

        span = self._span_view()
        n_el = span.numel() // w
        wide = span[:n_el * w].view(getattr(torch, _WIDE[w]))
        run = self._sp.run_bytes // w
        rows = wide.as_strided((n_el - run + 1, run), (1, 1))
        st = self._static
        eng = ((st[0][None, :] + ids[0][:, None] * st[1][None, :]) // w).reshape(-1)
        pool = ((st[2][None, :] + ids[1][:, None]) // w).reshape(-1)
        src, dst = (eng, pool) if to_pool else (pool, eng)
        step = max(1, TORCH_STAGE_BYTES // self._sp.run_bytes)
        for i in range(0, src.numel(), step):   # bounded: one step per TORCH_STAGE_BYTES moved
            tmp = rows.index_select(0, src[i:i + step])
            rows.index_copy_(0, dst[i:i + step], tmp)
        return "torch"
