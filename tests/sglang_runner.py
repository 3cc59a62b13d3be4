"""Drives kvstore's SGLang backend through SGLang's own classes, for the SGLang tests and bench.

Runs under the SGLang environment (`.venv-sglang`, `make sglang-env`), never under pytest: the
tests start it as a subprocess, so every backend instance is a separate process with its own
host pool, as two SGLang servers on one node are. It builds SGLang's real MHATokenToKVPoolHost
(or, with --mla, MLATokenToKVPoolHost) on CPU, creates the backend through SGLang's
StorageBackendFactory exactly as `--hicache-storage-backend dynamic` does, runs the steps it
is given, and prints one JSON object (the steps' results) as its last line.

    python tests/sglang_runner.py --address ADDR --layouts layer_first,page_first --steps JSON

Steps (a JSON list, run in order; "layout" picks the pool): {"op": "set", "seed": S,
"pages": N} stores N pages of
prompt S (random bytes, seeded) through batch_set_v1; "exists"; "get" (batch_get_v1 into fresh
host slots, compared byte for byte with what prompt S's pages must hold); "set_flat" / "get_flat"
(the older flat-page calls); "locate" (per-page tier, waiting up to "wait_s" for "host");
"corrupt" (flip one byte of page "page" in the daemon's slot); "chaos" (back-to-back batches
while SIGKILLing the daemon "kill_pid" mid-batch); "stopped" (the steps "steps" while the
daemon "pid" is SIGSTOPped); "bench" (v1 set/get of each pool of "layouts" against a memcpy,
the pools taking turns every round).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import statistics
import sys
import threading
import time
import traceback

import numpy as np
import torch

# SGLang imports torchvision (through its multimodal configs); the only torchvision wheel on
# PyPI is a CUDA build whose kernels cannot load next to the CPU torch, and its import then
# fails registering fake kernels for two ops its kernels would have defined. Define those two
# op schemas (never called here) so `import torchvision` succeeds without its kernels.
_tv = torch.library.Library("torchvision", "DEF")
_tv.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_tv.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")

# ruff: noqa: E402
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str


def make_pool(layout: str, layers: int, heads: int, head_dim: int, page: int,
              capacity_pages: int, dtype: torch.dtype,
              allocator: str = "default") -> MHATokenToKVPoolHost:
    """SGLang's own MHA host pool on CPU (device KV buffers are small CPU tensors)."""
    dev = [torch.zeros(page, heads, head_dim, dtype=dtype) for _ in range(2 * layers)]
    k, v = tuple(dev[:layers]), tuple(dev[layers:])

    def ptrs(ts: tuple) -> torch.Tensor:
        return torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs(k), v_data_ptrs=ptrs(v),
                          layout=KVBufferLayout.NHD),
        page_size=page, head_num=heads, head_dim=head_dim, v_head_dim=head_dim, dtype=dtype,
        device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 1.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=page, start_layer=0, end_layer=layers,
                                host_token_capacity=capacity_pages * page,
                                allocator_type=allocator)


def make_mla_pool(layout: str, layers: int, page: int, capacity_pages: int,
                  dtype: torch.dtype) -> MLATokenToKVPoolHost:
    """SGLang's own MLA host pool on CPU (latent rank 64 + rope 16 per token and layer)."""
    lora, rope = 64, 16
    dev = tuple(torch.zeros(page, 1, lora + rope, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=dev, data_ptrs=torch.tensor([t.data_ptr() for t in dev], dtype=torch.uint64),
        layer_indices=tuple(range(layers)), device_layer_num=layers, page_size=page,
        kv_lora_rank=lora, qk_rope_head_dim=rope, kv_cache_dim=lora + rope, dtype=dtype,
        device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 1.0, 0, page, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=page, start_layer=0, end_layer=layers,
                                target_layer_num=layers,
                                host_token_capacity=capacity_pages * page)


def make_backend(args: argparse.Namespace, pool: MHATokenToKVPoolHost,
                 layout: str, allocator: str = "default") -> HiCacheStorage:
    extra = {"backend_name": "kvstore", "module_path": "kvstore_client.sglang",
             "class_name": "KVStoreHiCache", "interface_v1": 1, "address": args.address,
             "timeout_s": args.timeout_s, "exists_deadline_s": args.exists_deadline_s}
    if args.codec:
        extra["codec"] = args.codec
    if args.tenant_salt:
        extra["tenant_salt"] = args.tenant_salt
    if allocator != "default":
        extra["allocator"] = allocator             # what makes SGLang allocate the pool so
    cfg = HiCacheStorageConfig(tp_rank=args.tp_rank, tp_size=args.tp_size, pp_rank=0,
                               pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=args.mla,
                               enable_storage_metrics=True,
                               is_page_first_layout=layout == "page_first",
                               model_name=args.model, extra_config=extra)
    # What SGLang's cache controller does on attach (cache_controller.py).
    backend = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    backend.register_mem_pool_host(pool)
    return backend


class Prompt:
    """Prompt `seed`: its page keys (SGLang's own page hashes) and each page's bytes (random
    bytes, or with `normal` normally distributed values, for lossy codecs)."""

    def __init__(self, seed: int, pages: int, pool: MHATokenToKVPoolHost,
                 normal: bool = False) -> None:
        self.seed, self.pages, self.pool, self.normal = seed, pages, pool, normal
        tokens = [(seed * 7919 + i) % 32000 for i in range(pages * pool.page_size)]
        self.keys = list(get_storage_hash_str(tokens, None, page_size=pool.page_size))
        self.shape = pool.get_data_page(0, flat=False).shape

    def page(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100003 + i)
        if self.normal:
            return torch.randn(self.shape, generator=g).to(self.pool.dtype)
        nbytes = self.pool.get_data_page(0).numel() * self.pool.dtype.itemsize
        raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        return raw.view(self.pool.dtype).view(self.shape)


def host_slots(pool: MHATokenToKVPoolHost, pages: int, scramble: bool) -> torch.Tensor:
    """Token indices for `pages` host pages, in a scrambled page order when asked (so a reader
    never lands pages where the writer had them)."""
    idx = pool.alloc(pages * pool.page_size)
    if idx is None:
        raise RuntimeError("host pool full")
    if scramble:
        per = idx.view(pages, pool.page_size)
        order = torch.randperm(pages, generator=torch.Generator().manual_seed(pages))
        idx = per[order].reshape(-1).contiguous()
    return idx


def page_bytes(pool: MHATokenToKVPoolHost, start: int) -> bytes:
    return pool.get_data_page(start, flat=True).view(torch.uint8).numpy().tobytes()


def expect_equal(pool: MHATokenToKVPoolHost, prompt: Prompt, idx: torch.Tensor,
                 ok: list[bool], first: int = 0) -> list[bool]:
    """For each page reported loaded: are its bytes exactly prompt's page?"""
    P = pool.page_size
    out = []
    for j, good in enumerate(ok):
        if good:
            want = prompt.page(first + j).contiguous().view(torch.uint8).numpy().tobytes()
            out.append(page_bytes(pool, int(idx[j * P])) == want)
    return out


def op_set(backend, pool, s: dict) -> dict:
    pr = Prompt(s["seed"], s["pages"], pool, s.get("normal", False))
    idx = host_slots(pool, pr.pages, scramble=False)
    P = pool.page_size
    for j in range(pr.pages):
        pool.get_data_page(int(idx[j * P]), flat=False).copy_(pr.page(j))
    t0 = time.monotonic()
    ok = backend.batch_set_v1(pr.keys, idx)
    dt = time.monotonic() - t0
    pool.free(idx)
    digests = [hashlib.sha256(pr.page(j).contiguous().view(torch.uint8).numpy()).hexdigest()
               for j in range(pr.pages)]
    return {"ok": ok, "keys": pr.keys, "digests": digests, "s": dt}


def op_get(backend, pool, s: dict) -> dict:
    pr = Prompt(s["seed"], s["pages"], pool, s.get("normal", False))
    keys = pr.keys if not s.get("unknown") else [hashlib.sha256(f"miss{k}".encode()).hexdigest()
                                                 for k in pr.keys]
    idx = host_slots(pool, pr.pages, scramble=True)
    P = pool.page_size
    for j in range(pr.pages):       # poison the destination: stale bytes must not pass
        pool.get_data_page(int(idx[j * P]), flat=False).fill_(0)
    t0 = time.monotonic()
    ok = backend.batch_get_v1(keys, idx)
    dt = time.monotonic() - t0
    eq = expect_equal(pool, pr, idx, ok)
    digests = [hashlib.sha256(page_bytes(pool, int(idx[j * P]))).hexdigest() if good else None
               for j, good in enumerate(ok)]
    out = {"ok": ok, "equal": eq, "digests": digests, "s": dt}
    if s.get("measure"):            # how far loaded pages are from the stored values
        errs = [(pool.get_data_page(int(idx[j * P]), flat=False).float()
                 - pr.page(j).float()).abs().max().item() for j, good in enumerate(ok) if good]
        out["max_abs_err"] = max(errs, default=None)
        out["max_abs"] = max(pr.page(j).float().abs().max().item() for j in range(pr.pages))
    pool.free(idx)
    return out


def op_exists(backend, pool, s: dict) -> dict:
    pr = Prompt(s["seed"], s["pages"], pool)
    keys = list(pr.keys)
    if "hole" in s:                  # a page never stored in the middle of the prompt
        keys[s["hole"]] = hashlib.sha256(b"hole").hexdigest()
    t0 = time.monotonic()
    n = backend.batch_exists(keys)
    batch_s = time.monotonic() - t0
    single = [backend.exists(k) for k in keys[:2]]
    return {"n": n, "single": single, "s": time.monotonic() - t0, "batch_s": batch_s}


def op_set_flat(backend, pool, s: dict) -> dict:
    pr = Prompt(s["seed"], s["pages"], pool)
    ok = backend.batch_set(pr.keys, [pr.page(j).reshape(-1).clone() for j in range(pr.pages)])
    return {"ok": ok}


def op_get_flat(backend, pool, s: dict) -> dict:
    pr = Prompt(s["seed"], s["pages"], pool)
    outs = backend.batch_get(pr.keys, [pool.get_dummy_flat_data_page() for _ in pr.keys])
    eq = [o is not None and torch.equal(o.view(torch.uint8),
                                        pr.page(j).reshape(-1).view(torch.uint8))
          for j, o in enumerate(outs)]
    one = backend.get(pr.keys[0], pool.get_dummy_flat_data_page())
    return {"found": [o is not None for o in outs], "equal": eq, "single": one is not None}


def op_locate(backend, pool, s: dict) -> dict:
    from kvstore_client.sglang.identity import fold_key
    pr = Prompt(s["seed"], s["pages"], pool)
    keys = [fold_key(k) for k in pr.keys]
    end = time.monotonic() + s.get("wait_s", 0.0)
    ns = backend._namespace()                    # connects and registers; prefetches nothing
    while True:
        where = ns.locate(keys)
        if all(w == "host" for w in where) or time.monotonic() >= end:
            return {"where": where}
        time.sleep(0.05)


def op_corrupt(backend, pool, s: dict) -> dict:
    """Flip one byte of a stored page in the daemon's shared-memory slot (a stray write)."""
    from kvstore_client._proto import kvstore_pb2 as pb
    from kvstore_client.sglang.identity import fold_key
    pr = Prompt(s["seed"], s["pages"], pool)
    ns, client = backend._namespace(), backend._client
    key = fold_key(pr.keys[s["page"]])
    lease = client.call("Acquire", pb.AcquireRequest(namespace_id=ns.ns_id, keys=[key])).lease
    client.release(lease.lease_id)
    if not lease.slots:
        return {"corrupted": False}
    client.pool.slab.array[lease.slots[0].offset + s.get("byte", 100)] ^= 0xFF
    return {"corrupted": True}


def op_chaos(backend, pool, s: dict) -> dict:
    """Back-to-back get and set batches; the daemon is SIGKILLed while one is in flight."""
    stored = Prompt(s["seed"], s["pages"], pool)
    state = {"in_call": False, "calls": 0, "killed_in_call": None, "killed_at": None}

    def killer() -> None:
        end = time.monotonic() + 30
        while time.monotonic() < end:
            if state["calls"] >= s.get("after_calls", 3) and state["in_call"]:
                os.kill(s["kill_pid"], signal.SIGKILL)   # a batch is in flight (checked above)
                state["killed_in_call"] = True
                state["still_in_call_after_kill"] = state["in_call"]
                state["killed_at"] = time.monotonic()
                return
            time.sleep(0.0005)
    th = threading.Thread(target=killer, daemon=True)
    th.start()
    P = pool.page_size
    wrong = errors = 0
    ok_pages = failed_pages = 0
    durations_after = []
    end = time.monotonic() + 60
    i = 0
    while time.monotonic() < end:
        if state["killed_at"] and time.monotonic() > state["killed_at"] + s.get("seconds", 3):
            break
        i += 1
        t0 = time.monotonic()
        try:
            if i % 2:
                idx = host_slots(pool, stored.pages, scramble=True)
                state["in_call"] = True
                ok = backend.batch_get_v1(stored.keys, idx)
                state["in_call"] = False
                wrong += sum(1 for e in expect_equal(pool, stored, idx, ok) if not e)
            else:
                fresh = Prompt(s["seed"] * 1000 + i, s["pages"], pool)
                idx = host_slots(pool, fresh.pages, scramble=False)
                for j in range(fresh.pages):
                    pool.get_data_page(int(idx[j * P]), flat=False).copy_(fresh.page(j))
                state["in_call"] = True
                ok = backend.batch_set_v1(fresh.keys, idx)
                state["in_call"] = False
            pool.free(idx)
            if not isinstance(ok, list) or len(ok) != stored.pages:
                errors += 1
            ok_pages += sum(ok)
            failed_pages += len(ok) - sum(ok)
        except Exception:
            state["in_call"] = False
            errors += 1
            traceback.print_exc()
        state["calls"] += 1
        if state["killed_at"] and time.monotonic() >= state["killed_at"]:
            durations_after.append(time.monotonic() - t0)   # the call in flight counts too
    # The test restarts the daemon once it is dead: the same backend must serve again.
    recovered, recover_s = False, None
    t_rec = time.monotonic()
    while time.monotonic() < t_rec + s.get("recover_s", 30):
        try:
            fresh = Prompt(s["seed"] * 1000 + 999, 4, pool)
            idx = host_slots(pool, 4, scramble=False)
            for j in range(4):
                pool.get_data_page(int(idx[j * P]), flat=False).copy_(fresh.page(j))
            ok = backend.batch_set_v1(fresh.keys, idx)
            pool.free(idx)
            if all(ok):
                idx = host_slots(pool, 4, scramble=True)
                got = backend.batch_get_v1(fresh.keys, idx)
                eq = expect_equal(pool, fresh, idx, got)
                pool.free(idx)
                if all(got) and all(eq):
                    recovered, recover_s = True, time.monotonic() - t_rec
                    break
                wrong += sum(1 for e in eq if not e)
        except Exception:
            errors += 1
            traceback.print_exc()
        time.sleep(0.2)
    return {"killed_in_call": state["killed_in_call"], "calls": state["calls"],
            "still_in_call_after_kill": state.get("still_in_call_after_kill"),
            "calls_after_kill": len(durations_after),
            "max_call_s_after_kill": max(durations_after, default=0.0),
            "wrong_pages": wrong, "exceptions": errors, "ok_pages": ok_pages,
            "failed_pages": failed_pages, "recovered": recovered, "recover_s": recover_s}


def op_stopped(backend, pool, s: dict) -> dict:
    """The steps "steps" while the daemon "pid" is stopped (SIGSTOP, then SIGCONT whatever
    happens): each starts once the backend's own back-off is over, so each asks the daemon."""
    os.kill(s["pid"], signal.SIGSTOP)
    try:
        end = time.monotonic() + 10     # the signal is sent, not yet taken by every thread
        while time.monotonic() < end and not _stopped(s["pid"]):
            time.sleep(0.005)
        out = []
        for step in s["steps"]:
            while time.monotonic() < backend._down_until:
                time.sleep(0.005)
            r = OPS[step["op"]](backend, pool, step)
            out.append({"op": step["op"], **r, "last_error": backend.last_error})
        return {"steps": out}
    finally:
        os.kill(s["pid"], signal.SIGCONT)


def _stopped(pid: int) -> bool:
    """Every thread of `pid` is stopped (state T in /proc)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        return all(open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                   == "T" for t in tasks)
    except OSError:
        return False


def op_bench(sides: list, s: dict) -> list[dict]:
    """Pages through each (backend, pool) of `sides` against a memcpy of the same bytes (numpy,
    this thread), in the same process (the machine is shared: only same-run ratios mean
    anything). The sides take turns within every round, the first going first in odd rounds,
    so each figure saw the machine of the same moments as the others (timed one after the
    other, the second was ~20% slower whichever pool it was)."""
    from kvstore_client.sglang.identity import fold_key
    pages, reps = s["pages"], s.get("reps", 5)
    state = []
    for i, (backend, pool) in enumerate(sides):
        pr = Prompt(s["seed"] + 1000 * i, pages, pool)
        idx = host_slots(pool, pages, scramble=False)
        P = pool.page_size
        for j in range(pages):
            pool.get_data_page(int(idx[j * P]), flat=False).copy_(pr.page(j))
        state.append((backend, pool, pr, idx, {"sets": [], "gets": []}))
    nbytes = pages * sides[0][0].geometry.nbytes
    src = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)                            # fault the pages in
    memcpy = []
    for r in range(reps + 1):                      # round 0 warms up (connect, register)
        t0 = time.perf_counter()
        np.copyto(dst, src)
        t_copy = time.perf_counter() - t0
        for i, (backend, pool, _, idx, times) in (list(enumerate(state)) if r % 2
                                                   else list(enumerate(state))[::-1]):
            keys = Prompt(s["seed"] * 1000 + 100 * i + r, pages, pool).keys   # new pages
            t0 = time.perf_counter()
            ok = backend.batch_set_v1(keys, idx)
            t_set = time.perf_counter() - t0
            if not all(ok):
                raise RuntimeError(f"batch_set_v1 failed: {backend.stats()}")
            t0 = time.perf_counter()
            ok = backend.batch_get_v1(keys, idx)
            t_get = time.perf_counter() - t0
            if not all(ok):
                raise RuntimeError(f"batch_get_v1 failed: {backend.stats()}")
            if r:
                times["sets"].append(t_set)
                times["gets"].append(t_get)
            # Steady state: a full daemon recycles slots it freed. Deleting this round's
            # pages lets the next round write into slots already mapped, as after evictions.
            backend._ns.delete([fold_key(k) for k in keys])
        if r:
            memcpy.append(t_copy)
    med = statistics.median
    out = []
    for backend, _, pr, idx, times in state:
        backend.batch_set_v1(pr.keys, idx)
        ex = []
        for _ in range(s.get("exists_reps", 50)):
            t0 = time.perf_counter()
            n = backend.batch_exists(pr.keys[:64])
            ex.append(time.perf_counter() - t0)
        if n != min(64, pages):
            raise RuntimeError(f"batch_exists found {n} of {min(64, pages)} pages")
        sets, gets = times["sets"], times["gets"]
        out.append({"page_bytes": backend.geometry.nbytes, "pages": pages, "reps": reps,
                    "memcpy_gbps": nbytes / med(memcpy) / 1e9,
                    "v1_set_gbps": nbytes / med(sets) / 1e9,
                    "v1_get_gbps": nbytes / med(gets) / 1e9,
                    "v1_set_vs_memcpy": med(memcpy) / med(sets),
                    "v1_get_vs_memcpy": med(memcpy) / med(gets),
                    "batch_exists_64_p50_us": med(ex) * 1e6,
                    "batch_exists_64_p99_us": sorted(ex)[int(0.99 * (len(ex) - 1))] * 1e6})
    return out


def op_clear(backend, pool, s: dict) -> dict:
    """SGLang's "clear HiCache storage": this backend's namespace, every tier."""
    return {"ok": backend.clear()}


def op_demote(backend, pool, s: dict) -> dict:
    """Move every block the daemon holds to SSD and out of host memory, as eviction would."""
    backend._namespace()                         # connects and registers the namespace
    client = backend._client
    demoted = client.flush()
    freed = client.evict("host")
    return {"demoted": demoted, "evicted_blocks": freed[1]}


OPS = {"set": op_set, "get": op_get, "exists": op_exists, "set_flat": op_set_flat,
       "get_flat": op_get_flat, "locate": op_locate, "corrupt": op_corrupt, "chaos": op_chaos,
       "demote": op_demote, "clear": op_clear, "stopped": op_stopped}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--steps", required=True, help="JSON list of steps")
    ap.add_argument("--layouts", default="layer_first",
                    help="comma-separated host pool layouts, one pool and backend each; "
                         "LAYOUT:shm for SGLang's shared-memory pool (its fd exported)")
    ap.add_argument("--model", default="test-org/tiny-model")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--capacity-pages", type=int, default=600)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tp-rank", type=int, default=0)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--mla", action="store_true", help="SGLang's MLA host pool, an MLA model")
    ap.add_argument("--timeout-s", type=float, default=3.0)
    ap.add_argument("--exists-deadline-s", type=float, default=1.0)
    ap.add_argument("--codec", default="", help="the backend's codec setting")
    ap.add_argument("--tenant-salt", default="")
    ap.add_argument("--allocator", default="default",
                    help="host pool allocator: default, or shm (SGLang's memfd pool)")
    args = ap.parse_args()
    layouts = args.layouts.split(",")
    pairs = {}
    for entry in layouts:
        layout, _, allocator = entry.partition(":")     # "layer_first:shm": SGLang's shm pool
        allocator = allocator or args.allocator
        # SGLang sizes host pools against free memory less a 10 GiB reserve for the OS, more
        # than a shared 24 GiB test machine may have free; these pools are a few MiB, so
        # give them SGLang's explicit budget instead of its reading of the machine.
        with host_memory_budget_scope(1 << 30):
            if args.mla:
                pool = make_mla_pool(layout, args.layers, args.page, args.capacity_pages,
                                     getattr(torch, args.dtype))
            else:
                pool = make_pool(layout, args.layers, args.heads, args.head_dim, args.page,
                                 args.capacity_pages, getattr(torch, args.dtype), allocator)
        pairs[entry] = (make_backend(args, pool, layout, allocator), pool)
    first = pairs[layouts[0]][0]
    out: dict = {"backend": f"{type(first).__module__}.{type(first).__name__}",
                 "is_hicache_storage": isinstance(first, HiCacheStorage),
                 "pool": type(pairs[layouts[0]][1]).__name__, "pid": os.getpid(), "steps": [],
                 "pool_fd": {e: getattr(p, "fd", None) is not None for e, (_, p) in pairs.items()}}
    for step in json.loads(args.steps):
        if step["op"] == "bench":       # several pools at once: {"layouts": [...]}
            out["steps"].append(op_bench([pairs[e] for e in step.get("layouts", layouts)],
                                         step))
            continue
        backend, pool = pairs[step.get("layout", layouts[0])]
        out["steps"].append(OPS[step["op"]](backend, pool, step))
    out["stats"] = {layout: b.stats() for layout, (b, _) in pairs.items()}
    m = first.get_stats()
    out["storage_metrics"] = {"type": type(m).__name__, "prefetch_pgs": sum(m.prefetch_pgs),
                              "backup_pgs": sum(m.backup_pgs)} if m is not None else None
    for b, _ in pairs.values():
        b.close()
    sys.stdout.flush()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
