"""KVStoreHiCache: SGLang's HiCache storage backend over a kvstore daemon.

SGLang's cache controller runs the backend on its prefetch and backup threads, and a thread
whose storage call raises (or returns None) stops for good. So no call here raises: a daemon
that is down, slow, restarting, full or serving a corrupt page makes the call a miss (False,
0, None), counted in `stats()` and logged once per outage. Every RPC has a deadline, and after
an outage calls answer misses at once for a growing back-off instead of waiting on a dead socket.

Pages move without a temporary: the zero-copy v1 calls (`"interface_v1": 1`) copy each page
with one strided copy between SGLang's host pool and the daemon's shared-memory slot (the
SDK's kernel copies and checksums in one pass where it applies); loads are checksum-verified
per page, and only a verified prefix is reported True.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import numpy as np

from .compat import check_sglang

check_sglang()

# ruff: noqa: E402  (the version check must run before SGLang's modules are imported)
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from .. import blockcopy, connect
from ..common.errors import DeadlineExceeded, InvalidArgument, KVStoreError, Unavailable
from ..common.layout import CODECS
from . import identity, pages

log = logging.getLogger("kvstore.sglang")

_DEFAULT_ADDRESS = "data/kvstore.sock"
# Extra-config keys that belong to SGLang's factory and controller, not to this backend.
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "interface_v2",
                "tp_lcm_size", "should_split_heads", "allocator"}
_COUNTERS = ("exists_queries", "exists_pages", "exists_below_host", "exists_failed", "pages_set",
             "pages_set_failed", "pages_get", "pages_get_failed", "errors")
_KNOWN = {"address", "timeout_s", "exists_deadline_s", "codec", "tenant_salt", "model_name",
          "prefetch"}


class KVStoreHiCache(HiCacheStorage):
    """HiCache storage backend; SGLang's factory builds it as `cls(storage_config, kwargs)`.

    Settings, from the extra config (all optional): address (daemon socket or host:port;
    default $KVSTORE_ADDRESS or data/kvstore.sock), timeout_s (deadline of each transfer RPC),
    exists_deadline_s (a batch_exists unanswered this long is a miss), codec ("lossless",
    "int8", "fp8_e4m3": lossy only where the page layout is declared), tenant_salt,
    model_name (overrides SGLang's), prefetch (promote pages found on SSD or the remote tier
    into host memory as soon as batch_exists finds them; default true).
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        settings = dict(getattr(storage_config, "extra_config", None) or {})
        settings.update(kwargs or {})
        unknown = sorted(set(settings) - _KNOWN - _SGLANG_KEYS)
        if unknown:
            log.warning("kvstore: ignoring unknown extra-config settings %s", unknown)
        self.config = storage_config
        self.address = str(settings.get("address") or os.environ.get("KVSTORE_ADDRESS")
                           or _DEFAULT_ADDRESS)
        self.timeout_s = float(settings.get("timeout_s", 5.0))
        self.exists_deadline_s = float(settings.get("exists_deadline_s", 1.0))
        if self.timeout_s <= 0 or self.exists_deadline_s <= 0:
            raise ValueError("kvstore: timeout_s and exists_deadline_s must be positive seconds")
        self.codec = str(settings.get("codec", "lossless"))
        if self.codec not in CODECS:
            raise ValueError(f"kvstore: unknown codec {self.codec!r} in the extra config; "
                             f"expected one of {list(CODECS)}")
        self.tenant_salt = str(settings.get("tenant_salt", ""))
        self.model_name = str(settings.get("model_name") or "")
        self.prefetch = bool(settings.get("prefetch", True))
        self.mem_pool_host: Any = None
        self._geo: pages.PageGeometry | None = None
        self._views: pages.PageViews | None = None
        self._plan: Any = None       # the SDK's copy kernel plan for the pool, when it applies
        self._client: Any = None
        self._ns: Any = None
        self._registering: Future | None = None     # the registration in flight (_namespace)
        self._ns_lock = threading.Lock()
        self._disabled: str | None = None
        self._down_until = 0.0
        self._backoff = 0.5
        self._stat_lock = threading.Lock()
        self.counters: Counter = Counter()
        self.last_error = ""
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [],
                                          "prefetch_bandwidth": [], "backup_bandwidth": []}
        # MLA pages are the same on every TP rank, and one namespace serves them all: SGLang's
        # controller backs up from the writer rank only (backup_skip). A replica rank that is
        # asked to store anyway stores: its pages are the writer's bytes under the writer's
        # keys, so the daemon keeps one copy, and no rank ever reports a page stored that is not.
        self.writer = bool(getattr(storage_config, "is_storage_writer", True))
        log.info("kvstore: SGLang HiCache backend on %s (tp %s/%s)", self.address,
                 getattr(storage_config, "tp_rank", 0), getattr(storage_config, "tp_size", 1))

    # -- setup ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        with self._ns_lock:
            self._ns, self._registering = None, None
            try:
                self._geo = pages.geometry(mem_pool_host)
                self._views = pages.views_for(mem_pool_host, self._geo)
                self._plan = (self._views.kernel_plan()
                              if isinstance(self._views, pages.PageViews)
                              and blockcopy.kernel_available() else None)
                self._disabled = None
            except Exception as e:
                self._geo = None
                self._disabled = (f"cannot address pages of SGLang's {type(mem_pool_host).__name__}"
                                  f" host pool: {e}")
                log.error("kvstore: %s; every storage call is a miss", self._disabled)

    @property
    def geometry(self) -> pages.PageGeometry | None:
        return self._geo

    def _namespace(self, wait_s: float | None = None) -> Any:
        """The namespace, connected and registered on a thread of its own the first time, so
        the caller waits for it at most `wait_s`, its own bound: a first batch_exists against
        a daemon that does not answer is a miss after exists_deadline_s, not after the
        registration's timeout_s. A registration that outlives its caller goes on; a later
        call finds it done. `wait_s` None: timeout_s."""
        if self._ns is not None:
            return self._ns
        with self._ns_lock:
            if self._ns is not None:
                return self._ns
            if self._disabled:
                raise Unavailable(self._disabled)
            if self._geo is None:
                raise Unavailable("SGLang has not registered its host pool with the backend")
            reg = self._registering
            if reg is None:
                if self._client is None:
                    self._client = connect(self.address, timeout=self.timeout_s)
                reg = self._registering = Future()
                threading.Thread(target=self._register, name="kvstore-sglang-register",
                                 args=(reg, self._client, self._geo), daemon=True).start()
        wait_s = self.timeout_s if wait_s is None else wait_s
        try:
            return reg.result(timeout=wait_s)
        except FutureTimeout:
            raise DeadlineExceeded(f"registering the namespace with the daemon at "
                                   f"{self.address} took longer than {wait_s:g} s (it goes "
                                   "on meanwhile)") from None

    def _register(self, reg: Future, client: Any, geo: pages.PageGeometry) -> None:
        """Register, then publish the namespace unless the host pool was registered again
        (or the backend closed) meanwhile: that registration is for a pool no longer used."""
        cfg = self.config
        if self.model_name:
            cfg = _Renamed(cfg, self.model_name)
        try:
            args = identity.namespace_args(cfg, geo, codec=self.codec,
                                           tenant_salt=self.tenant_salt)
            try:
                ns = client.namespace(**args)
            except InvalidArgument as e:     # the daemon refuses this namespace: for good
                why = f"the daemon refused the namespace: {e}"
                with self._ns_lock:
                    if self._registering is reg:
                        self._disabled = why
                        log.error("kvstore: %s; every storage call is a miss", why)
                raise Unavailable(why) from None
        except BaseException as e:
            with self._ns_lock:
                if self._registering is reg:
                    self._registering = None
            reg.set_exception(e)
            return
        with self._ns_lock:
            current = self._registering is reg
            if current:
                self._ns, self._registering = ns, None
        if not current:
            reg.set_exception(Unavailable("the host pool was registered again during the "
                                          "namespace's registration"))
            return
        log.info("kvstore: namespace %s for %s (%s, %d-byte pages, %s)", ns.ns_id.hex(),
                 args["model"], geo.engine_layout, geo.nbytes, args["codec"])
        reg.set_result(ns)

    def _guard(self, wait_s: float | None = None) -> Any:
        """The namespace (`_namespace`), or Unavailable at once while the daemon is known to
        be down."""
        if time.monotonic() < self._down_until:
            raise Unavailable(f"kvstore daemon at {self.address} is unreachable; retrying "
                              "shortly")
        return self._namespace(wait_s)

    def _failed(self, what: str, e: BaseException) -> None:
        with self._stat_lock:
            self.counters["errors"] += 1
            self.last_error = f"{what}: {type(e).__name__}: {e}"
        if isinstance(e, KVStoreError) and e.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
            if self._disabled or time.monotonic() < self._down_until:
                return
            self._down_until = time.monotonic() + self._backoff
            if self._backoff < 8:
                log.warning("kvstore: daemon at %s unreachable (%s); serving misses",
                            self.address, e)
            self._backoff = min(self._backoff * 2, 10.0)
        else:
            log.warning("kvstore: %s failed: %s: %s", what, type(e).__name__, e)

    def _ok(self) -> None:
        self._backoff = 0.5

    def _count(self, **kv: int) -> None:
        with self._stat_lock:
            self.counters.update(kv)

    def _metric(self, kind: str, n: int, seconds: float) -> None:
        if not getattr(self.config, "enable_storage_metrics", False) or not n:
            return
        gb = n * (self._geo.nbytes if self._geo else 0) / (1 << 30)
        with self._stat_lock:
            self._metrics[f"{kind}_pgs"].append(n)
            self._metrics[f"{kind}_bandwidth"].append(gb / max(seconds, 1e-9))

    @staticmethod
    def _parent(extra_info: Any) -> bytes | None:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        return identity.fold_key(prefix[-1]) if prefix else None

    # -- lookups ----------------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """Pages of the longest stored prefix of `keys`, in any tier. Pages found on SSD or the
        remote tier start moving into host memory now, so the batch_get that follows is a host
        hit (promote-ahead)."""
        if not keys:
            return 0
        try:
            # One bound for the whole query, a first call's registration included.
            end = time.monotonic() + self.exists_deadline_s
            ns = self._guard(self.exists_deadline_s)
            left = end - time.monotonic()
            if left <= 0:
                raise DeadlineExceeded(f"batch_exists: no time left of exists_deadline_s "
                                       f"({self.exists_deadline_s:g} s) after the registration")
            where = ns.locate([identity.fold_key(k) for k in keys], prefetch=self.prefetch,
                              timeout=left)
            self._ok()
        except Exception as e:
            self._failed("batch_exists", e)
            self._count(exists_queries=1, exists_failed=1)
            return 0
        n = next((i for i, w in enumerate(where) if w is None), len(where))
        below = sum(1 for w in where[:n] if w != "host")
        self._count(exists_queries=1, exists_pages=n, exists_below_host=below)
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- zero-copy v1 -----------------------------------------------------------------------
    def _mover(self, ns: Any, host_indices: Any, n: int, to_slots: bool) -> Any:
        """The fill (to_slots) or drain between the pages at `host_indices` and pool slots:
        the SDK's one-pass kernel where every page starts on a page boundary of the pool,
        else numpy copies page by page."""
        geo, views = self._geo, self._views
        starts = pages.page_starts(host_indices, n, geo.page_size)
        if starts is None:
            raise ValueError(f"{n} keys but {host_indices.numel()} host indices "
                             f"(page size {geo.page_size})")
        if self._plan is not None and all(st % geo.page_size == 0 for st in starts):
            return ns.fused_move(self._plan, to_slots, [st // geo.page_size for st in starts])
        if isinstance(views, pages.MetaPages):
            def move_runs(base: Any, offsets: Sequence[int], first: int) -> None:
                for j, off in enumerate(offsets):
                    views.copy(starts[first + j], base[off:off + geo.nbytes], to_slots)
            return move_runs

        def move(base: Any, offsets: Sequence[int], first: int) -> None:
            for j, off in enumerate(offsets):
                page = views.view(starts[first + j])
                slot = pages.slot_words(base, off, page)
                if to_slots:
                    np.copyto(slot, page)
                else:
                    np.copyto(page, slot)
        return move

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        """Store the pages at `host_indices` (page_size token indices per key)."""
        n = len(keys)
        if not n:
            return []
        t0 = time.perf_counter()
        try:
            ns = self._guard()
            ns.store_blocks([identity.fold_key(k) for k in keys],
                            self._mover(ns, host_indices, n, True),
                            parent=self._parent(extra_info))
            self._ok()
        except Exception as e:
            self._failed("batch_set_v1", e)
            self._count(pages_set_failed=n)
            return [False] * n
        self._count(pages_set=n)
        self._metric("backup", n, time.perf_counter() - t0)
        return [True] * n

    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        """Load pages into the host pool at `host_indices`; True for each page loaded and
        checksum-verified, a prefix of the keys (the rest of the pages are left unspecified,
        as SGLang frees them)."""
        n = len(keys)
        if not n:
            return []
        t0 = time.perf_counter()
        try:
            ns = self._guard()
            got = ns.load_blocks([identity.fold_key(k) for k in keys],
                                 self._mover(ns, host_indices, n, False))
            self._ok()
        except Exception as e:
            self._failed("batch_get_v1", e)
            self._count(pages_get_failed=n)
            return [False] * n
        self._count(pages_get=got, pages_get_failed=n - got)
        self._metric("prefetch", got, time.perf_counter() - t0)
        return [True] * got + [False] * (n - got)

    # -- the older calls: flat page tensors -------------------------------------------------
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        n = len(keys)
        if not n:
            return True
        t0 = time.perf_counter()
        try:
            ns, geo = self._guard(), self._geo
            if values is None or len(values) != n:
                raise ValueError(f"{n} keys but {0 if values is None else len(values)} values")
            src = [pages.flat_words(v, geo) for v in values]

            def fill(base: Any, offsets: Sequence[int], first: int) -> None:
                for j, off in enumerate(offsets):
                    np.copyto(pages.slot_words(base, off, src[first + j]), src[first + j])
            ns.store_blocks([identity.fold_key(k) for k in keys], fill)
            self._ok()
        except Exception as e:
            self._failed("batch_set", e)
            self._count(pages_set_failed=n)
            return False
        self._count(pages_set=n)
        self._metric("backup", n, time.perf_counter() - t0)
        return True

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[Any]:
        n = len(keys)
        if not n:
            return []
        t0 = time.perf_counter()
        try:
            ns, geo = self._guard(), self._geo
            if target_locations is None:
                import torch
                target_locations = [torch.empty(geo.nbytes // geo.torch_dtype.itemsize,
                                                dtype=geo.torch_dtype) for _ in keys]
            if len(target_locations) != n:
                raise ValueError(f"{n} keys but {len(target_locations)} target locations")
            dst = [pages.flat_words(t, geo) for t in target_locations]

            def drain(base: Any, offsets: Sequence[int], first: int) -> None:
                for j, off in enumerate(offsets):
                    np.copyto(dst[first + j], pages.slot_words(base, off, dst[first + j]))
            got = ns.load_blocks([identity.fold_key(k) for k in keys], drain)
            self._ok()
        except Exception as e:
            self._failed("batch_get", e)
            self._count(pages_get_failed=n)
            return [None] * n
        self._count(pages_get=got, pages_get_failed=n - got)
        self._metric("prefetch", got, time.perf_counter() - t0)
        return list(target_locations[:got]) + [None] * (n - got)

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    # -- admin and stats --------------------------------------------------------------------
    def clear(self) -> bool:
        """Delete every page of this backend's namespace from every tier of the daemon."""
        try:
            self._guard().delete(None)
            return True
        except Exception as e:
            self._failed("clear", e)
            return False

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics since the last call (with --enable-cache-report metrics)."""
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except ImportError:
            return None
        with self._stat_lock:
            m = StorageMetrics(**{k: list(v) for k, v in self._metrics.items()})
            for v in self._metrics.values():
                v.clear()
        return m

    def stats(self) -> dict[str, Any]:
        """Totals since start, for logs and tests."""
        with self._stat_lock:
            out: dict[str, Any] = {k: 0 for k in _COUNTERS}
            out.update(self.counters)
            out["last_error"] = self.last_error
        client = self._client
        out["checksum_failures"] = client.counters["checksum_failures"] if client else 0
        out["disabled"] = self._disabled
        out["namespace"] = self._ns.ns_id.hex() if self._ns is not None else None
        out["codec"] = self._ns.spec.codec if self._ns is not None else None
        out["page_bytes"] = self._geo.nbytes if self._geo else 0
        out["engine_layout"] = self._geo.engine_layout if self._geo else ""
        out["copy"] = "kernel" if self._plan is not None else "numpy"
        return out

    def close(self) -> None:
        """Release leases and the connection (SGLang calls this when it detaches storage)."""
        if self._client is not None:
            try:
                self._client.close()
            except Exception:
                pass
            self._client = None
            self._ns, self._registering = None, None


class _Renamed:
    """The storage config with the model name the extra config sets."""

    def __init__(self, config: Any, model_name: str) -> None:
        self._config = config
        self.model_name = model_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)
