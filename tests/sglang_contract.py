"""SGLang's own backend tests and its cache controller, driving kvstore's HiCache backend.

Runs under the SGLang environment (`.venv-sglang`), never under pytest;
tests/test_sglang_contract.py starts it against a real daemon and checks the JSON it prints as
its last line.

    python tests/sglang_contract.py --address ADDR --only wheel_tests,controller [...]

- `wheel_tests`: SGLang's in-wheel `storage/mooncake_store/test_mooncake_store.py`, with the name
  `MooncakeStore` in that module bound to a function that builds kvstore's backend through
  SGLang's StorageBackendFactory (the `dynamic` backend, as `--hicache-storage-backend dynamic`
  does) from the test's own HiCacheStorageConfig. Each test function runs as the module's own
  `__main__` runs it, with the same configurations; tests/engine_deselected.py lists what is
  not run, and why.
- `controller`: SGLang's HiCacheController built on CPU with a real device pool, allocator and
  host pool, the backend attached by the controller itself; this runner plays the scheduler
  (it hands the controller host pages to back up and the buffers a prefetch lands in, as the
  radix cache does). Backup, hit query, transfer (bytes compared), then the daemon SIGKILLed:
  misses, no thread dies, and the same controller works again once the daemon is back.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
import traceback
from queue import Empty
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# tests.sglang_runner first: importing it defines the torchvision op schemas SGLang's imports
# need on the CPU torch (see there), before any SGLang module is imported.
from tests.engine_deselected import SGLANG_DESELECTED  # noqa: E402
from tests.sglang_runner import host_memory_budget_scope  # noqa: E402

WHEEL_TESTS = "sglang.srt.mem_cache.storage.mooncake_store.test_mooncake_store"
DEADLINE_S = 60.0


def _factory() -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    return StorageBackendFactory


def kvstore_extra(address: str, **more: Any) -> dict[str, Any]:
    return {"backend_name": "kvstore", "module_path": "kvstore_client.sglang",
            "class_name": "KVStoreHiCache", "interface_v1": 1, "address": address,
            "timeout_s": 3.0, "exists_deadline_s": 1.0, **more}


def wheel_tests(args: argparse.Namespace) -> dict[str, Any]:
    import importlib

    mt = importlib.import_module(WHEEL_TESTS)
    backends = []

    def stand_in(config: Any) -> Any:
        config.extra_config = kvstore_extra(args.address, model_name="sglang-wheel-tests")
        b = _factory().create_backend("dynamic", config, None)
        backends.append(b)
        return b

    mt.MooncakeStore = stand_in
    # The module's __main__: these calls, these configurations.
    cfg = mt.make_hicache_storage_config
    calls = {
        "test_mooncake_store.py::test_single_operation": lambda: mt.test_single_operation(),
        "test_mooncake_store.py::test_batch_operation[mha-tp0/1]":
            lambda: mt.test_batch_operation(cfg(is_mla_model=False, tp_rank=0, tp_size=1)),
        "test_mooncake_store.py::test_batch_operation[mla-tp0/1]":
            lambda: mt.test_batch_operation(cfg(is_mla_model=True, tp_rank=0, tp_size=1)),
        "test_mooncake_store.py::test_batch_operation[mha-tp1/4]":
            lambda: mt.test_batch_operation(cfg(is_mla_model=False, tp_rank=1, tp_size=4)),
        "test_mooncake_store.py::test_batch_operation[mla-tp3/8]":
            lambda: mt.test_batch_operation(cfg(is_mla_model=True, tp_rank=3, tp_size=8)),
    }
    found = sorted(n for n in dir(mt) if n.startswith("test_"))
    outcomes: dict[str, str] = {}
    for name, call in calls.items():
        if name in SGLANG_DESELECTED:
            continue
        try:
            call()
            outcomes[name] = "passed"
        except Exception:
            outcomes[name] = "failed: " + traceback.format_exc()[-2000:]
    stats = [b.stats() for b in backends]
    return {"outcomes": outcomes, "module_tests": found,
            "deselected": sorted(n for n in calls if n in SGLANG_DESELECTED),
            "backend": f"{type(backends[0]).__module__}.{type(backends[0]).__name__}",
            "errors": sum(s["errors"] for s in stats),
            "writers": [b.writer for b in backends]}


# -- the cache controller ------------------------------------------------------------------------

def _wait(q: Any, pred: Any, deadline_s: float = DEADLINE_S) -> Any:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            item = q.get(timeout=0.2)
        except Empty:
            continue
        if pred(item):
            return item
    raise TimeoutError("the controller did not answer within the deadline")


class Scheduler:
    """What the radix cache does around SGLang's HiCacheController, and nothing more."""

    def __init__(self, address: str, layout: str, allocator: str, page: int = 16) -> None:
        from sglang.srt.managers.cache_controller import HiCacheController
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                            attn_dcp_size=1, attn_dcp_rank=0)
        self.P, layers, heads, dim = page, 4, 2, 64
        dev = MHATokenToKVPool(self.P * 16, self.P, torch.bfloat16, heads, dim, layers, "cpu",
                               False, start_layer=0, end_layer=layers, enable_alt_stream=False)
        alloc = PagedTokenToKVPoolAllocator(size=self.P * 16, page_size=self.P,
                                            dtype=torch.bfloat16, device="cpu", kvcache=dev,
                                            need_sort=False)
        with host_memory_budget_scope(1 << 30):
            self.host = MHATokenToKVPoolHost(
                dev.get_device_pool_infos()[0].buffer_info, 8, 0, self.P, layout,
                device_capacity_tokens=dev.size, start_layer=0, end_layer=layers,
                pin_memory=False, device="cpu", allocator_type=allocator)
        extra = kvstore_extra(address, model_name="sglang-controller-test")
        if allocator == "shm":
            extra["allocator"] = "shm"       # what makes SGLang's server allocate the pool so
        self.cc = HiCacheController(alloc, self.host, self.P, tp_group=None,
                                    load_cache_event=threading.Event(), io_backend="direct",
                                    storage_backend="dynamic", model_name="m",
                                    storage_backend_extra_config=extra)
        self._req = 0

    def tokens(self, seed: int, pages: int) -> list[int]:
        return [(seed * 7919 + i) % 32000 for i in range(pages * self.P)]

    def hashes(self, tokens: list[int]) -> list[str]:
        from sglang.srt.mem_cache.utils import get_storage_hash_str
        return list(get_storage_hash_str(tokens, None, page_size=self.P))

    def page_bytes(self, idx: torch.Tensor, j: int) -> bytes:
        page = self.host.get_data_page(int(idx[j * self.P]), flat=True)
        return page.view(torch.uint8).numpy().tobytes()

    def backup(self, seed: int, pages: int) -> tuple[int, list[bytes]]:
        """Fill host pages with a prompt's KV and have the controller write them to storage."""
        tokens = self.tokens(seed, pages)
        idx = self.host.alloc(len(tokens))
        g = torch.Generator().manual_seed(seed)
        for j in range(pages):
            page = self.host.get_data_page(int(idx[j * self.P]), flat=False)
            page.view(torch.uint8).copy_(torch.randint(0, 256, page.view(torch.uint8).shape,
                                                       dtype=torch.uint8, generator=g))
        want = [self.page_bytes(idx, j) for j in range(pages)]
        op_id = self.cc.write_storage(idx, tokens, hash_value=self.hashes(tokens))
        op = _wait(self.cc.ack_backup_queue, lambda o: o.id == op_id)
        self.host.free(idx)
        return op.completed_tokens, want

    def prefetch(self, seed: int, pages: int) -> dict[str, Any]:
        """Hit query, then (for what hit) a transfer into fresh host buffers."""
        tokens = self.tokens(seed, pages)
        self._req += 1
        rid = f"r{self._req}"
        op = self.cc.prefetch(rid, tokens)
        op = _wait(self.cc.prefetch_hit_queue, lambda o: o.request_id == rid)
        out: dict[str, Any] = {"hit_tokens": op.storage_hit_count,
                               "hashes_match": op.hash_value == self.hashes(tokens)[
                                   :op.storage_hit_count // self.P]}
        if not op.storage_hit_count:
            return out
        idx = self.cc.alloc_prefetch_host_buffers(op, op.storage_hit_count)
        for j in range(op.storage_hit_count // self.P):     # stale bytes must not pass
            self.host.get_data_page(int(idx[j * self.P]), flat=False).fill_(0)
        op.host_indices = idx
        self.cc.prefetch_buffer.put(op)
        done = 0
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end:
            ack = _wait(self.cc.ack_prefetch_queue, lambda a: a.rid == rid)
            if ack.completed_tokens is not None:
                done = max(done, ack.completed_tokens)
            if getattr(ack, "completed_req", False):
                break
        out["loaded_tokens"] = done
        out["pages"] = [self.page_bytes(idx, j) for j in range(done // self.P)]
        self.host.free(idx)
        return out

    def threads_alive(self) -> bool:
        cc = self.cc
        return all(t.is_alive() for t in (cc.prefetch_thread, cc.backup_thread,
                                          cc.prefetch_io_aux_thread, cc.prefetch_sync_thread))


def controller(args: argparse.Namespace) -> dict[str, Any]:
    s = Scheduler(args.address, args.layout, args.allocator)
    out: dict[str, Any] = {"backend": type(s.cc.storage_backend).__name__,
                           "zero_copy_calls": s.cc.page_set_func.__name__,
                           "pool_fd": getattr(s.host, "fd", None) is not None,
                           "layout": s.host.layout}
    backed, want = s.backup(1, 6)
    got = s.prefetch(1, 6)
    out["backup_tokens"], out["prompt_tokens"] = backed, 6 * s.P
    out["hit_tokens"], out["hashes_match"] = got["hit_tokens"], got["hashes_match"]
    out["loaded_tokens"] = got.get("loaded_tokens")
    out["bytes_equal"] = got.get("pages") == want
    out["miss"] = s.prefetch(2, 4)["hit_tokens"]                  # never stored
    if args.kill_pid:
        os.kill(args.kill_pid, signal.SIGKILL)
        t0 = time.monotonic()
        out["killed_hit_tokens"] = s.prefetch(1, 6)["hit_tokens"]
        out["killed_backup_tokens"] = s.backup(3, 4)[0]
        out["killed_s"] = time.monotonic() - t0
        out["threads_alive_after_kill"] = s.threads_alive()
        with open(args.restart_gate, "w") as f:      # the test restarts the daemon now
            f.write("killed")
        recovered = False
        end = time.monotonic() + DEADLINE_S
        while time.monotonic() < end and not recovered:
            backed, want = s.backup(4, 4)
            if backed == 4 * s.P:
                got = s.prefetch(4, 4)
                recovered = got.get("loaded_tokens") == 4 * s.P and got["pages"] == want
            if not recovered:
                time.sleep(0.2)
        out["recovered"] = recovered
        out["threads_alive"] = s.threads_alive()
    out["stats"] = s.cc.storage_backend.stats()
    s.cc.detach_storage_backend()
    return out


RUNS = {"wheel_tests": wheel_tests, "controller": controller}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--address", required=True)
    ap.add_argument("--only", default="wheel_tests,controller")
    ap.add_argument("--layout", default="page_first")
    ap.add_argument("--allocator", default="default", help="host pool allocator: default, shm")
    ap.add_argument("--kill-pid", type=int, default=0)
    ap.add_argument("--restart-gate", default="")
    args = ap.parse_args()
    from kvstore_client.sglang.compat import check_sglang
    result: dict[str, Any] = {"sglang": check_sglang(), "runs": {}, "errors": {}}
    for name in args.only.split(","):
        try:
            result["runs"][name] = RUNS[name](args)
        except Exception:
            result["errors"][name] = traceback.format_exc()
    sys.stdout.flush()
    print(json.dumps(result, default=str))
    sys.stdout.flush()
    os._exit(0)     # the controller's daemon threads and SGLang's teardown are not waited on


if __name__ == "__main__":
    main()
