"""Executing transfer plans on a CUDA device: one Triton kernel per batch, launched cheaply.

Why this module: the kernel moves a batch of blocks at 0.91-0.94 of a device-to-device copy
(measured on an H200), but a batch of a few hundred MiB is a fraction of a millisecond of GPU
work, so the host's work before the kernel starts (argument checks, uploading the block ids,
Triton's argument binding) decided the end-to-end figure: 0.2-0.4 ms of Python per call had the
gather at 0.35-0.48 of a device-to-device copy. So each call here does as little as it can:

- The batch is written into a pinned staging buffer and copied to the device on the copier's
  stream, where the kernel reads it (reading the pinned buffer itself over PCIe measured
  slower: 0.52-0.74 of a device-to-device copy against 0.73-0.86). It is checked
  (`copy_plan.check_staged`) after the launch, while the kernel runs; the kernel skips any
  block id or slot out of bounds, and a batch that fails the checks is waited for before its
  error is raised, so nothing is left copying behind the caller.
- Batches are bucketed by size (powers of two); the first batch of a bucket captures the launch
  as a CUDA graph, and later ones launch it with one driver call (`cuGraphLaunch` on the
  copier's stream) instead of Triton's argument binding and torch's stream switch. The
  staging buffer's first word is the batch's block count, so a bucket's graph serves every
  batch that fits it; programs past the count do nothing.
- A staging buffer is reused once the last transfer that read it is done (its event), so a
  caller that keeps several transfers in flight gets one buffer per bucket, waited for only
  when it is still being read.

Where a graph cannot be captured, the executor falls back to plain launches, once, and says
which it uses in `mode`.
"""

from __future__ import annotations

import threading
from typing import Any

from .common.cuda_runtime import graph_launch

# Filled in by triton_kernel(); module globals so Triton's JIT can resolve them.
triton: Any = None
tl: Any = None

# Bytes each Triton program moves (at most one run), and its warps. On an H200, 256 x 2 MiB
# blocks with 64 KiB runs: the kernel alone moved 0.91-0.94 of a device-to-device copy at 16,
# 32 and 64 KiB programs and 4, 8 or 16 warps alike; one program per run is kept.
TRITON_PROGRAM_BYTES = 65536
TRITON_WARPS = 4
# Streaming cache hints (loads marked evict-first, stores `.cs`): a copy reads and writes each
# byte once, so caching it only displaces other data. Off until measured on a GPU against the
# plain kernel (bench/gpu_gather_phases.py times both; both compile for sm_90).
TRITON_CACHE_HINTS = False
# Batches up to this many blocks replay a captured graph; larger ones launch directly.
MAX_GRAPH_BLOCKS = 1 << 16
MIN_BUCKET = 64
LAUNCH_MODES = ("auto", "graph", "launch")
STAGING_WAIT_S = 60.0
EVENT_RING = 32

_kernel: Any = None
_WIDE = {8: "int64", 4: "int32", 2: "int16", 1: "int8"}


def triton_kernel() -> Any:
    """Compile-on-first-use batched block copy; None when Triton is not installed."""
    global _kernel
    if _kernel is not None:
        return _kernel or None
    try:
        import triton as _triton
        import triton.language as _tl
    except ImportError:
        _kernel = False
        return None
    globals()["triton"] = _triton   # Triton resolves `tl` through the function's globals
    globals()["tl"] = _tl

    @_triton.jit
    def _copy_blocks(base, ids, cap, nblocks, smax, eng_off, eng_stride, pool_off, runs,
                     run_elems, TO_POOL: tl.constexpr, W: tl.constexpr, VEC: tl.constexpr,
                     BLOCK: tl.constexpr, HINTS: tl.constexpr):
        # program = (block i, run r, part of the run); offsets in bytes, then W-byte elements.
        # ids = [count, block ids (cap), slot offsets (cap)]; programs of blocks >= count (a
        # graph's grid covers its whole bucket) move nothing, nor do block ids outside
        # [0, nblocks) or slots outside [0, smax]: the host checks the batch while this runs.
        pid = tl.program_id(0).to(tl.int64)
        parts = tl.cdiv(run_elems, BLOCK)
        part = pid % parts
        t = pid // parts
        r = t % runs
        i = t // runs
        live = i < tl.load(ids)
        j = tl.where(live, i, 0)          # a dead program reads block 0's ids, copies nothing
        b = tl.load(ids + 1 + j)
        s = tl.load(ids + 1 + cap + j)
        live = live & (b >= 0) & (b < nblocks) & (s >= 0) & (s <= smax)
        b = tl.where(live, b, 0)
        s = tl.where(live, s, 0)
        e = (tl.load(eng_off + r) + b * tl.load(eng_stride + r)) // W
        p = (tl.load(pool_off + r) + s) // W
        if TO_POOL:
            src = e
            dst = p
        else:
            src = p
            dst = e
        src = tl.multiple_of(src, VEC)   # VEC: run starts are VEC-element aligned
        dst = tl.multiple_of(dst, VEC)
        idx = part * BLOCK + tl.arange(0, BLOCK)
        mask = idx < run_elems * live.to(tl.int64)   # a product keeps run_elems' divisibility
        if HINTS:
            v = tl.load(base + (src + idx), mask=mask, eviction_policy="evict_first")
            tl.store(base + (dst + idx), v, mask=mask, cache_modifier=".cs")
        else:
            v = tl.load(base + (src + idx), mask=mask)
            tl.store(base + (dst + idx), v, mask=mask)

    _kernel = _copy_blocks
    return _kernel


def bucket(n: int) -> int:
    """Staging capacity for a batch of n blocks: the next power of two, at least MIN_BUCKET."""
    return max(MIN_BUCKET, 1 << max(0, n - 1).bit_length())


class Staging:
    """One bucket's block ids: [count, blocks (cap), slots (cap)] int64 in pinned host memory,
    a device copy of it, and the event of the last transfer that read them."""

    def __init__(self, cap: int, device: int) -> None:
        import torch

        self.cap = cap
        self.pinned = torch.zeros(1 + 2 * cap, dtype=torch.int64, pin_memory=True)
        self.host = self.pinned.numpy()
        self.dev = torch.zeros(1 + 2 * cap, dtype=torch.int64, device=f"cuda:{device}")
        self.event: Any = None
        self.graphs: dict[tuple, Any] = {}

    def batch(self, n: int) -> Any:
        """The (2, n) view a batch is written into; its count word set to n."""
        self.host[0] = n
        return self.host[1:].reshape(2, self.cap)[:, :n]

    def reusable(self) -> None:
        """Wait (with a deadline) until no transfer in flight still reads this buffer."""
        ev = self.event
        if ev is not None and not ev.query():
            from .common.transfer import Transfer

            Transfer(ev, nbytes=0).wait(STAGING_WAIT_S)


class TritonExecutor:
    """Launches one copier's batches: graph replay where it can, plain launches where not.

    `mode` says how: "graph" or "launch". `prefer="auto"` is "graph"; "launch" is the
    fallback where a graph cannot be captured, and can be asked for (tests and benchmarks
    compare them).
    """

    def __init__(self, span: Any, static: Any, runs: int, run_bytes: int, device: int,
                 stream: Any, nblocks: int, smax: int, prefer: str = "auto") -> None:
        self.kernel = triton_kernel()
        self.span, self.static, self.runs, self.run_bytes = span, static, runs, run_bytes
        self.nblocks, self.smax = nblocks, smax     # bounds the kernel holds every batch to
        self.device, self.stream = device, stream
        self.use_graphs = prefer in ("auto", "graph")
        self.raw_launch = True       # graphs launched through the driver, not torch's replay
        self._staging: dict[int, Staging] = {}
        self._views: dict[int, Any] = {}
        self._events: list[Any] = []
        self._next_event = 0
        self.lock = threading.Lock()

    @property
    def mode(self) -> str:
        return "graph" if self.use_graphs else "launch"

    def staging(self, n: int) -> Staging:
        cap = bucket(n)
        st = self._staging.get(cap)
        if st is None:
            st = self._staging[cap] = Staging(cap, self.device)
        st.reusable()
        return st

    def run(self, st: Staging, n: int, w: int, to_pool: bool) -> Any:
        """Enqueue the copy of the batch staged in `st` on `self.stream`; returns the CUDA
        event recorded after it."""
        import torch

        s = self.stream
        if self.use_graphs and st.cap <= MAX_GRAPH_BLOCKS:
            key = (to_pool, w)
            entry = st.graphs.get(key)
            if entry is None:
                with torch.cuda.device(self.device), torch.cuda.stream(s):
                    entry = st.graphs[key] = self._capture(st, w, to_pool)
            if entry is not None:
                g, handle = entry
                if not (self.raw_launch and handle and graph_launch(handle, s.cuda_stream)):
                    self.raw_launch = False
                    with torch.cuda.device(self.device), torch.cuda.stream(s):
                        g.replay()
                return self._record()
        with torch.cuda.device(self.device), torch.cuda.stream(s):
            self._upload(st)
            self._launch(st, n, w, to_pool)
        return self._record()

    # -- internals -------------------------------------------------------------------------------
    def _record(self) -> Any:
        """An event recorded after the copy, from a ring reused in turn (creating one costs
        more than recording it). Safe on one stream: an event re-recorded by a later copy
        completes only after every earlier copy on this stream, so a Transfer still holding
        it can only be told "not done" longer than needed, never "done" too early."""
        import torch

        if not self._events:
            self._events = [torch.cuda.Event() for _ in range(EVENT_RING)]
        ev = self._events[self._next_event]
        self._next_event = (self._next_event + 1) % EVENT_RING
        ev.record(self.stream)
        return ev

    def _upload(self, st: Staging) -> None:
        st.dev.copy_(st.pinned, non_blocking=True)

    def _launch(self, st: Staging, n: int, w: int, to_pool: bool) -> None:
        import torch

        tw = min(w, 8)
        span = self._views.get(tw)
        if span is None:
            span = self._views[tw] = self.span.view(getattr(torch, _WIDE[tw]))
        run = self.run_bytes // tw
        per_prog = TRITON_PROGRAM_BYTES // tw
        block = per_prog if run >= per_prog else max(16, 1 << (run - 1).bit_length())
        grid = (n * self.runs * ((run + block - 1) // block),)
        st_ = self.static
        self.kernel[grid](span, st.dev, st.cap, self.nblocks, self.smax, st_[0], st_[1],
                          st_[2], self.runs, run, TO_POOL=to_pool, W=tw,
                          VEC=2 if w >= 16 else 1, BLOCK=block, HINTS=TRITON_CACHE_HINTS,
                          num_warps=TRITON_WARPS)

    def _capture(self, st: Staging, w: int, to_pool: bool) -> tuple[Any, int] | None:
        """A graph of this bucket's launch (its grid covers `cap` blocks) and its executable's
        handle (0 where torch does not expose it), or None (and plain launches from now on)
        where capture is refused. Runs under the copier's stream."""
        import torch

        saved = st.host[0]
        try:
            # Compile and load the kernel outside the capture, with a count of 0 (no copy).
            st.host[0] = 0
            self._upload(st)
            self._launch(st, st.cap, w, to_pool)
            torch.cuda.current_stream(self.device).synchronize()
            g = torch.cuda.CUDAGraph()
            g.capture_begin(capture_error_mode="thread_local")
            try:
                self._upload(st)
                self._launch(st, st.cap, w, to_pool)
            finally:
                g.capture_end()
            try:
                handle = int(g.raw_cuda_graph_exec())
            except Exception:   # older torch: replays only
                handle = 0
            return g, handle
        except Exception:
            self.use_graphs = False
            return None
        finally:
            st.host[0] = saved
