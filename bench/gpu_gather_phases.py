"""Where the IPC gather's time goes: the host's work before the kernel, and the kernel alone.

bench/gpu.py times an engine process's `PagedCopier.load(...).wait()` of 256 x 2 MiB blocks
from the daemon's pool (opened over CUDA IPC) against one device-to-device copy of the same
bytes. This splits that end-to-end time, for each way of launching the kernel
(`kvstore_client.triton_copy`): writing the batch into its staging buffer, ordering after the
engine's stream (nothing to order when it is idle), the launch or graph launch with its
completion event as the host sees it, the batch's checks (which run while the kernel copies),
and the wait; and it times the kernel alone (ten
launches back to back between two CUDA events, so that launch overheads overlap the copies)
at two program sizes and two warp counts, and with streaming cache hints (`_hints`,
`triton_copy.TRITON_CACHE_HINTS`). A gather whose kernel runs at device speed but
whose end-to-end figure does not is losing its time on the host before the kernel starts.
`host` times a Python loop step and a numpy sort, to compare the host's speed with other
machines'.

Usage: python bench/gpu_gather_phases.py. The last line is one JSON object; without a CUDA
device it says so in one line and exits 0.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from kvstore_client import gpu as cg  # noqa: E402

from bench.gpu import LAYOUT, engine_side  # noqa: E402

BLOCKS = 256
REPS = 20


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 4)


def _client(desc: dict, slots: list[int], n_cache: int, q: Any) -> None:
    """Runs in its own process, where the pool is a real IPC mapping."""
    try:
        import torch
        from kvstore_client import triton_copy as tc
        from kvstore_client.copy_plan import check_staged, copy_width, index_array, write_batch

        pool, cache, targets = engine_side(desc, len(slots), n_cache)
        slots = np.asarray(slots, dtype=np.int64)   # as an engine holds them: an array
        L = LAYOUT
        out: dict[str, Any] = {"launch": {}}
        for launch in ("graph", "launch"):
            cp = cg.PagedCopier(pool, cache, L, method="triton", launch=launch)
            ex = cp._triton
            for _ in range(3):
                cp.load(targets, slots).wait(60)
            e2e = []
            for _ in range(REPS):
                t = time.perf_counter()
                cp.load(targets, slots).wait(60)
                e2e.append(time.perf_counter() - t)
            phases: dict[str, list[float]] = {"stage": [], "order": [], "launch": [],
                                              "checks": [], "wait": []}
            for _ in range(REPS):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                blocks = index_array("block_ids", targets)
                sl = index_array("slot_offsets", slots)
                st = ex.staging(blocks.size)
                rows = st.batch(blocks.size)
                w = copy_width(cp._w, write_batch(blocks, sl, rows))
                t1 = time.perf_counter()
                if not cp._engine_idle():
                    cp._ready.record(torch.cuda.current_stream())
                    cp.stream.wait_event(cp._ready)
                t2 = time.perf_counter()
                ev = st.event = ex.run(st, blocks.size, w, False)
                t3 = time.perf_counter()
                check_staged(cp._sp, L, rows, pool.size, False)
                t4 = time.perf_counter()
                cg.Transfer(ev).wait(60)
                t5 = time.perf_counter()
                for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4),
                                 strict=True):
                    phases[k].append(dt)
            out["launch"][launch] = {"used": ex.mode, "raw_launch": ex.raw_launch,
                                     "e2e_ms": _ms(e2e),
                                     "phases_ms": {k: _ms(v) for k, v in phases.items()}}
        ex = cg.PagedCopier(pool, cache, L, method="triton", launch="launch")._triton
        st = ex.staging(len(slots))
        st.batch(len(slots))[:] = np.stack([targets, np.asarray(slots)])
        w = 16

        def kernel_ms(prog: int, warps: int, hints: bool, reps: int = 10) -> float:
            old = tc.TRITON_PROGRAM_BYTES, tc.TRITON_WARPS, tc.TRITON_CACHE_HINTS
            tc.TRITON_PROGRAM_BYTES, tc.TRITON_WARPS, tc.TRITON_CACHE_HINTS = prog, warps, hints
            try:
                ex.run(st, len(slots), w, False)
                a = torch.cuda.Event(enable_timing=True)
                b = torch.cuda.Event(enable_timing=True)
                a.record(ex.stream)
                for _ in range(reps):
                    ex.run(st, len(slots), w, False)
                b.record(ex.stream)
                b.synchronize()
                return a.elapsed_time(b) / reps
            finally:
                tc.TRITON_PROGRAM_BYTES, tc.TRITON_WARPS, tc.TRITON_CACHE_HINTS = old

        nbytes = len(slots) * L.block_bytes
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            dst.copy_(src)
        b.record()
        b.synchronize()
        d2d = a.elapsed_time(b) / 10
        out["kernel_vs_d2d"] = {}
        for prog, warps, hints in ((16384, 4, False), (16384, 8, False), (65536, 4, False),
                                   (65536, 8, False), (16384, 4, True), (65536, 4, True)):
            name = f"{prog >> 10}k_w{warps}" + ("_hints" if hints else "")
            try:
                out["kernel_vs_d2d"][name] = round(d2d / kernel_ms(prog, warps, hints), 3)
            except Exception as e:   # one variant failing must not lose the others' figures
                out["kernel_vs_d2d"][name] = f"error: {e!r}"[:300]
        out["d2d_ms"] = round(d2d, 4)
        for v in out["launch"].values():
            v["e2e_vs_d2d"] = round(d2d / v["e2e_ms"], 3)
        out["host"] = host_speed()
        q.put(("ok", out))
    except BaseException as e:  # report instead of hanging the parent
        q.put(("error", repr(e)))


def host_speed() -> dict[str, float]:
    """This host's Python and numpy speed (microseconds), to compare machines: the gather's
    host work is a few dozen such steps."""
    x = np.arange(256, dtype=np.int64)
    t = time.perf_counter()
    for _ in range(10000):
        pass
    loop = (time.perf_counter() - t) / 10000
    t = time.perf_counter()
    for _ in range(1000):
        np.sort(x)
    sort = (time.perf_counter() - t) / 1000
    return {"py_loop_iter_us": round(loop * 1e6, 4), "np_sort_256_us": round(sort * 1e6, 2)}


def main() -> int:
    if not cg.cuda_available():
        print(json.dumps({"bench": "gpu_gather_phases", "cuda": "skipped: no CUDA device"}))
        return 0
    import torch

    from tiers.gpu import GPUTier

    L = LAYOUT
    tier = GPUTier(BLOCKS * L.block_bytes + (8 << 20), 0, slab_name="bench-gpu-phases")
    try:
        slots = [tier.alloc(L.block_bytes) for _ in range(BLOCKS)]
        np.random.default_rng(0).shuffle(slots)
        tier.view(0, tier.capacity).random_(0, 255)
        torch.cuda.synchronize()
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_client, args=(tier.describe(), slots, 2 * BLOCKS, q),
                           daemon=True)
        proc.start()
        status, res = q.get(timeout=300)
        proc.join(60)
    finally:
        tier.close()
    if status != "ok":
        raise RuntimeError(f"client process failed: {res}")
    out = {"bench": "gpu_gather_phases", "device": torch.cuda.get_device_name(0),
           "blocks": BLOCKS, "block_bytes": L.block_bytes, **res}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
