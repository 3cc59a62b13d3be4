"""Where the IPC gather's time goes: the host's work before the kernel, and the kernel alone.

bench/gpu.py times an engine process's `PagedCopier.load(...).wait()` of 256 x 2 MiB blocks
from the daemon's pool (opened over CUDA IPC) against one device-to-device copy of the same
bytes. This splits that end-to-end time: the batch's checks (`check_batch`,
`check_distinct`, `copy_width`), the block-id upload (pinned staging and the host-to-device
copy), the Triton launch as the host sees it, the wait for the copy, and the kernel alone
(ten launches back to back between two CUDA events, so that launch overheads overlap the
copies), for three program sizes and three warp counts. A gather whose kernel runs at device
speed but whose end-to-end figure does not is losing its time on the host before the kernel
starts.

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
        from kvstore_client import paged_copy as pc
        from kvstore_client.copy_plan import check_batch, check_distinct, copy_width

        pool, cache, targets = engine_side(desc, len(slots), n_cache)
        L = LAYOUT
        cp = cg.PagedCopier(pool, cache, L, method="auto")
        for _ in range(3):
            cp.load(targets, slots).wait(60)
        e2e = []
        for _ in range(REPS):
            t = time.perf_counter()
            cp.load(targets, slots).wait(60)
            e2e.append(time.perf_counter() - t)
        phases: dict[str, list[float]] = {"checks": [], "ids_upload": [], "launch": [],
                                          "wait": []}
        w = 0
        ids = None
        for _ in range(REPS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            blocks, sl = check_batch(cp._sp, L, targets, slots, pool.size)
            check_distinct(blocks, sl, L.block_bytes, False)
            w = copy_width(cp._w, sl)
            ids = torch.from_numpy(np.stack([blocks, sl]))
            t1 = time.perf_counter()
            with torch.cuda.stream(cp.stream):
                ids_d = ids.pin_memory().to(cp._dev, non_blocking=True)
                t2 = time.perf_counter()
                cp._execute_triton(ids_d, w, False)
                t3 = time.perf_counter()
            cp.stream.synchronize()
            t4 = time.perf_counter()
            for k, dt in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                phases[k].append(dt)
        ids_d = ids.to(cp._dev)

        def kernel_ms(prog: int, warps: int, reps: int = 10) -> float:
            old = pc.TRITON_PROGRAM_BYTES, pc.TRITON_WARPS
            pc.TRITON_PROGRAM_BYTES, pc.TRITON_WARPS = prog, warps
            try:
                with torch.cuda.stream(cp.stream):
                    cp._execute_triton(ids_d, w, False)
                    a = torch.cuda.Event(enable_timing=True)
                    b = torch.cuda.Event(enable_timing=True)
                    a.record(cp.stream)
                    for _ in range(reps):
                        cp._execute_triton(ids_d, w, False)
                    b.record(cp.stream)
                b.synchronize()
                return a.elapsed_time(b) / reps
            finally:
                pc.TRITON_PROGRAM_BYTES, pc.TRITON_WARPS = old

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
        kernel = {f"{prog >> 10}k_w{warps}": round(d2d / kernel_ms(prog, warps), 3)
                  for prog in (16384, 32768, 65536) for warps in (4, 8, 16)}
        q.put(("ok", {"e2e_ms": _ms(e2e), "d2d_ms": round(d2d, 4),
                      "e2e_vs_d2d": round(d2d / (statistics.median(e2e) * 1e3), 3),
                      "phases_ms": {k: _ms(v) for k, v in phases.items()},
                      "copy_width": w, "kernel_vs_d2d": kernel}))
    except BaseException as e:  # report instead of hanging the parent
        q.put(("error", repr(e)))


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
