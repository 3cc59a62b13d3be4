"""GPU tier transfer throughput, as ratios against references measured in the same run.

The gpu tier as a tier, on the CPU device, on every machine (bench/gpu_tier.py):
gpu_tier_gather_vs_memcpy, gpu_demote_vs_memcpy, gpu_promote_vs_memcpy (>= 0.5 is the target).

Where a CUDA device exists, also the CUDA figures (>= 0.8 is the target):
- ipc_gather_vs_d2d: a separate client process opens the daemon's pool over CUDA IPC and
  gathers 256 blocks (shuffled slots) into a vLLM-layout paged cache (random block table),
  end to end through `PagedCopier.load` + wait, against one device-to-device copy of the same
  bytes in that process, the two timed alternately (medians), for each launch mode
  (`ipc_gather_by_launch`; the figure is the default's). `ipc_gather_kernel_vs_d2d` is the
  default on CUDA-event time (its first event is recorded before the host's work);
  `ipc_gather_torch_vs_d2d` is the no-Triton fallback. Every gather is checked byte for byte.
- ipc_gather_2proc_vs_d2d: two engine processes gathering at once (different block tables)
  against the same two copying device to device at once: the ratio of their aggregate rates.
- h2d_vs_pinned / d2h_vs_pinned: the GPU tier's batched copies between pool slots and the
  registered (cudaHostRegister) shared-memory host slab, 256 blocks in shuffled order, against
  torch copies between a device tensor and a pin_memory() tensor of the same size.
Raw GB/s and the device model are recorded alongside.

Usage: python bench/gpu.py [--quick] [--blocks N]. The last line is one JSON object; without a
CUDA device it holds the CPU-device figures and "cuda": "skipped: no CUDA device".
"""

from __future__ import annotations

import argparse
import json
import mmap
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
# This folder holds a script named like the `tiers` package: take it off the path (bench/tiers.py).
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"]
for p in (ROOT, ROOT / "client"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from kvstore_client import gpu as cg  # noqa: E402
from kvstore_client.common.layout import KVLayout  # noqa: E402

# 16 layers x 2 x 32 tokens x 8 heads x 128 dims x bf16 = 2 MiB, a typical block.
LAYOUT = KVLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_tokens=32, dtype="bfloat16")


def _time(fn: Any, reps: int) -> float:
    """Median wall seconds of `fn` (which must return only when its copy is complete)."""
    fn()
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def _paired(fn: Any, ref: Any, reps: int) -> tuple[float, float]:
    """Median wall seconds of `fn` and of `ref`, timed alternately rep by rep, so that a drift
    of the machine (clocks, a busy neighbour) weighs on the copy and on its limit alike."""
    for _ in range(2):
        fn()
        ref()
    a, b = [], []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        a.append(time.perf_counter() - t)
        t = time.perf_counter()
        ref()
        b.append(time.perf_counter() - t)
    return statistics.median(a), statistics.median(b)


def engine_side(desc: dict, n_slots: int, n_cache: int) -> tuple[Any, Any, np.ndarray]:
    """In an engine's process: the daemon's pool opened over CUDA IPC, a vLLM-layout paged
    cache of `n_cache` blocks, and `n_slots` distinct random target blocks in it."""
    import torch

    torch.cuda.set_device(0)
    pool = cg.open_pool(desc)
    L = LAYOUT
    caches = [torch.zeros((2, n_cache, L.block_tokens, L.num_kv_heads, L.head_dim),
                          dtype=torch.bfloat16, device="cuda") for _ in range(L.num_layers)]
    cache = cg.PagedKVCache.from_vllm(caches)
    targets = np.random.default_rng(1).permutation(n_cache)[:n_slots]
    return pool, cache, targets


def gathered_exactly(pool: Any, cache: Any, targets: np.ndarray, slots: list[int]) -> bool:
    """Every target block of the engine cache holds its pool slot's bytes, in canonical order."""
    import torch

    L = LAYOUT
    for b, s in zip(targets.tolist(), np.asarray(slots).tolist(), strict=True):
        got = torch.cat([t[b].reshape(-1).view(torch.uint8) for t in cache.tensors])
        want = cg.device_tensor(pool.ptr + s, L.block_bytes, pool.device)
        if not torch.equal(got, want):
            return False
    return True


def _client(desc: dict, slots: list[int], n_cache: int, reps: int, q: Any) -> None:
    """Runs in its own process: the pool is a real IPC mapping here."""
    try:
        import torch
        from kvstore_client.triton_copy import LAUNCH_MODES

        pool, cache, targets = engine_side(desc, len(slots), n_cache)
        slots = np.asarray(slots, dtype=np.int64)   # as an engine holds them: an array
        L = LAYOUT
        nbytes = len(slots) * L.block_bytes
        res: dict[str, Any] = {"modes": {}}
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)

        def d2d() -> None:
            dst.copy_(src)
            torch.cuda.synchronize()

        res["d2d_s"] = _time(d2d, reps)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        res["d2d_kernel_s"] = a.elapsed_time(b) / 1e3
        plan = [("auto", m) for m in LAUNCH_MODES] + [("torch", "auto")]
        for method, launch in plan:
            cp = cg.PagedCopier(pool, cache, L, method=method, launch=launch)
            for t in cache.tensors:
                t.zero_()

            def gather(cp: cg.PagedCopier = cp) -> None:
                cp.load(targets, slots).wait(60)

            secs, ref = _paired(gather, d2d, reps)
            exact = gathered_exactly(pool, cache, targets, slots)
            used = (cp._triton.mode + ("+raw" if cp._triton.raw_launch else "")
                    if cp._triton is not None else cp.load(targets, slots).method)
            if method == "torch":
                res.update(torch_s=secs, torch_vs_d2d=ref / secs, torch_exact=exact)
                continue
            res["modes"][launch] = {"s": secs, "vs_d2d": ref / secs, "used": used,
                                    "exact": exact}
            if launch == "auto":
                res.update(auto_s=secs, auto_vs_d2d=ref / secs,
                           auto_method=cp.load(targets, slots).method, auto_mode=used,
                           auto_exact=exact)
                torch.cuda.synchronize()
                evs = []
                for _ in range(reps):
                    a = torch.cuda.Event(enable_timing=True)
                    b = torch.cuda.Event(enable_timing=True)
                    a.record(cp.stream)
                    t = cp.load(targets, slots)
                    b.record(cp.stream)
                    t.wait(60)
                    b.synchronize()
                    evs.append(a.elapsed_time(b) / 1e3)
                res["auto_kernel_s"] = statistics.median(evs)
        q.put(("ok", res))
    except BaseException as e:  # report instead of hanging the parent
        q.put(("error", repr(e)))


def _engine(desc: dict, slots: list[int], n_cache: int, seed: int, loops: int, barrier: Any,
            q: Any) -> None:
    """One of several engine processes gathering at once: `loops` gathers back to back, then
    (after all have finished) as many device-to-device copies of the same bytes, each phase
    started together with the others through `barrier`; reports its phases' start and end."""
    try:
        import torch

        pool, cache, _ = engine_side(desc, len(slots), n_cache)
        targets = np.random.default_rng(seed).permutation(n_cache)[:len(slots)]
        slots = np.asarray(slots, dtype=np.int64)
        cp = cg.PagedCopier(pool, cache, LAYOUT)
        for _ in range(3):
            cp.load(targets, slots).wait(60)
        nbytes = len(slots) * LAYOUT.block_bytes
        src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        dst.copy_(src)
        torch.cuda.synchronize()
        out = {}
        barrier.wait(120)
        t0 = time.monotonic()
        for _ in range(loops):
            cp.load(targets, slots).wait(60)
        out["gather"] = (t0, time.monotonic())
        barrier.wait(120)
        t0 = time.monotonic()
        for _ in range(loops):
            dst.copy_(src)
            torch.cuda.synchronize()
        out["d2d"] = (t0, time.monotonic())
        out["exact"] = gathered_exactly(pool, cache, targets, slots)
        q.put(("ok", out))
    except BaseException as e:  # report instead of hanging the parent
        q.put(("error", repr(e)))


def gather_at_once(desc: dict, slots: list[int], n_cache: int, procs: int, loops: int
                   ) -> dict[str, Any]:
    """`procs` engine processes gathering from one pool at once, against as many processes
    copying the same bytes device to device at once: the ratio of their aggregate rates."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(procs)
    ps = [ctx.Process(target=_engine, args=(desc, slots, n_cache, 7 + i, loops, barrier, q),
                      daemon=True) for i in range(procs)]
    for p in ps:
        p.start()
    try:
        got = [q.get(timeout=300) for _ in ps]
    finally:
        for p in ps:
            p.join(60)
            if p.is_alive():
                p.kill()
    errors = [r for status, r in got if status != "ok"]
    if errors:
        raise RuntimeError(f"engine process failed: {errors[0]}")
    res = [r for _, r in got]

    def span(phase: str) -> float:
        return max(r[phase][1] for r in res) - min(r[phase][0] for r in res)

    nbytes = procs * loops * len(slots) * LAYOUT.block_bytes
    g, d = span("gather"), span("d2d")
    return {"procs": procs, "vs_d2d": round(d / g, 3), "GBps": round(nbytes / g / 1e9, 1),
            "d2d_GBps": round(nbytes / d / 1e9, 1), "exact": all(r["exact"] for r in res)}


def _host_buffer(nbytes: int) -> tuple[np.ndarray, Any, str]:
    """The host tier's shm slab; an anonymous mapping where /dev/shm is too small."""
    try:
        from tiers.host import HostTier

        host = HostTier(nbytes)
        return host.array, host, "shm slab"
    except Exception as e:  # small /dev/shm in containers
        buf = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
        buf[:] = 0
        return buf, None, f"anonymous mmap ({type(e).__name__}: shm unavailable)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (< 1 minute)")
    ap.add_argument("--blocks", type=int, default=256)
    args = ap.parse_args()
    from bench import gpu_tier

    tier_blocks = 48 if args.quick else args.blocks
    cpu_dev = gpu_tier.run(LAYOUT, tier_blocks, 5 if args.quick else 9)
    cpu_dev["targets"] = {"gpu_tier_gather_vs_memcpy": 0.5, "gpu_demote_vs_memcpy": 0.5}
    print(f"cpu device: gather {cpu_dev['gpu_tier_gather_GBps']} GB/s, demote "
          f"{cpu_dev['gpu_demote_GBps']}, promote {cpu_dev['gpu_promote_GBps']} vs memcpy "
          f"{cpu_dev['memcpy_GBps']}", file=sys.stderr)
    if not cg.cuda_available():
        print(json.dumps({**cpu_dev, "cuda": "skipped: no CUDA device"}))
        return 0
    import torch

    from tiers.gpu import GPUTier

    reps = 5 if args.quick else 20
    n = args.blocks
    L = LAYOUT
    nbytes = n * L.block_bytes
    rng = np.random.default_rng(0)
    tier = GPUTier(nbytes + (8 << 20), 0, slab_name="bench-gpu0")
    host_arr, host_tier, host_kind = _host_buffer(nbytes)
    try:
        slots = [tier.alloc(L.block_bytes) for _ in range(n)]
        rng.shuffle(slots)
        tier.view(0, tier.capacity).random_(0, 255)
        torch.cuda.synchronize()

        # --- client gather over IPC (separate process) ---
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        proc = ctx.Process(target=_client, args=(tier.describe(), slots, 2 * n, reps, q),
                           daemon=True)
        proc.start()
        status, res = q.get(timeout=300)
        proc.join(60)
        if status != "ok":
            raise RuntimeError(f"client process failed: {res}")
        two = gather_at_once(tier.describe(), slots, 2 * n, 2, 100 if args.quick else 300)

        # --- pool <-> registered host slab, against pin_memory() copies ---
        pin = tier.pin_host(host_arr)
        host_offs = (rng.permutation(n) * L.block_bytes).tolist()
        items = [(g, h, L.block_bytes) for g, h in zip(slots, host_offs, strict=True)]

        def h2d() -> None:
            tier.copy_from_host_batch(items, host_arr).wait(60)

        def d2h() -> None:
            tier.copy_to_host_batch(items, host_arr).wait(60)

        t_h2d, t_d2h = _time(h2d, reps), _time(d2h, reps)
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def ref_h2d() -> None:
            dev.copy_(pinned, non_blocking=True)
            torch.cuda.synchronize()

        def ref_d2h() -> None:
            pinned.copy_(dev, non_blocking=True)
            torch.cuda.synchronize()

        r_h2d, r_d2h = _time(ref_h2d, reps), _time(ref_d2h, reps)
        host_pinned = pin.pinned
        pin.close()
    finally:
        tier.close()
        if host_tier is not None:
            host_tier.close()

    def gbps(s: float) -> float:
        return round(nbytes / s / 1e9, 2)

    props = torch.cuda.get_device_properties(0)
    out = {
        "device": props.name, "torch": torch.__version__, "cuda": torch.version.cuda,
        "blocks": n, "block_bytes": L.block_bytes, "host_buffer": host_kind,
        "host_pinned": host_pinned,
        "ipc_gather_vs_d2d": round(res["auto_vs_d2d"], 3),
        "ipc_gather_method": res["auto_method"], "ipc_gather_launch": res["auto_mode"],
        "ipc_gather_exact": res["auto_exact"] and res["torch_exact"]
        and all(m["exact"] for m in res["modes"].values()),
        "ipc_gather_by_launch": {k: {"vs_d2d": round(m["vs_d2d"], 3), "used": m["used"]}
                                 for k, m in res["modes"].items()},
        "ipc_gather_kernel_vs_d2d": round(res["d2d_kernel_s"] / res["auto_kernel_s"], 3),
        "ipc_gather_torch_vs_d2d": round(res["torch_vs_d2d"], 3),
        "ipc_gather_2proc_vs_d2d": two["vs_d2d"], "ipc_gather_2proc": two,
        "ipc_gather_GBps": gbps(res["auto_s"]), "ipc_gather_torch_GBps": gbps(res["torch_s"]),
        "d2d_GBps": gbps(res["d2d_s"]),
        "h2d_vs_pinned": round(r_h2d / t_h2d, 3), "d2h_vs_pinned": round(r_d2h / t_d2h, 3),
        "h2d_GBps": gbps(t_h2d), "d2h_GBps": gbps(t_d2h),
        "pinned_h2d_GBps": gbps(r_h2d), "pinned_d2h_GBps": gbps(r_d2h),
        "targets": {"ipc_gather_vs_d2d": 0.8, "ipc_gather_2proc_vs_d2d": 0.8,
                    "h2d_vs_pinned": 0.8, "d2h_vs_pinned": 0.8,
                    **cpu_dev.pop("targets")},
    }
    out = {**cpu_dev, **out}
    print(f"{out['device']}: gather {out['ipc_gather_GBps']} GB/s ({out['ipc_gather_method']}) "
          f"vs d2d {out['d2d_GBps']}; h2d {out['h2d_GBps']} vs {out['pinned_h2d_GBps']}; "
          f"d2h {out['d2h_GBps']} vs {out['pinned_d2h_GBps']}", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
