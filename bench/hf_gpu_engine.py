"""The engine side of bench/hf_gpu.py: what its spawned producer and consumer processes run.

Why a module of its own: the parent (bench/hf_gpu.py) only starts a daemon and two processes
and reports; each process builds the model and works the gpu tier through the SDK, as an
engine would, and all of that is here.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

MODEL_NAME = "bench/hf_gpu"

T0 = time.time()          # wall clock: the spawned processes stamp their lines from the same


def say(msg: str) -> None:
    print(f"[hf_gpu {time.time() - T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _engine(setup: dict) -> tuple[Any, Any, Any]:
    """(torch, model, sync) in this process: the seeded model built on the target device.

    Both processes run exactly this, so their weights are bit-identical: the same seed, the
    same construction on the same device (CUDA initialises there: no CPU-side 1B init), the
    same cast."""
    import torch
    import transformers

    dev = setup["device"]
    if dev == "cuda":
        torch.cuda.set_device(0)
        sync = torch.cuda.synchronize
    else:
        torch.set_num_threads(1)        # small model, 2-core machines: one thread is steadier

        def sync() -> None:
            return None
    cfg = transformers.LlamaConfig(**setup["shape"],
                                   max_position_embeddings=setup["max_positions"],
                                   attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda:0" if dev == "cuda" else "cpu"):
        model = transformers.LlamaForCausalLM(cfg)
    model = model.to(getattr(torch, setup["dtype"])).eval()
    sync()
    return torch, model, sync


def _fingerprint(torch: Any, tensors: Any) -> str:
    """xxh3 of the tensors' bytes in order (moved to host memory): equal iff bit-identical."""
    import xxhash

    h = xxhash.xxh3_64()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().view(torch.uint8).numpy())
    return h.hexdigest()


def _weights_fingerprint(torch: Any, model: Any) -> str:
    """A cheap identity of the weights: each parameter's float64 sum, hashed."""
    sums = torch.stack([p.detach().double().sum() for p in model.parameters()])
    return _fingerprint(torch, [sums])


def _prefix_kv(cache: Any, layers: int, tokens: int) -> list[Any]:
    """K, V of every layer's first `tokens` positions, [1, H, tokens, D] each, in layer order."""
    from kvstore_client.hf import _layer_kv

    out = []
    for layer in range(layers):
        k, v = _layer_kv(cache, layer)
        out += [k[:, :, :tokens], v[:, :, :tokens]]
    return out


def _token_major(t: Any, block_tokens: int) -> Any:
    """An HF cache tensor [1, H, S, D] as paged-cache blocks [S / bt, bt, H, D], contiguous:
    a view where the tensor is token-major already, else a copy.

    Why not a view of HF's own head-major layout: a block of it is interleaved with the other
    blocks (head h of block b sits between heads h-1 and h+1 of every block), which
    `PagedKVCache` refuses (copy_plan.static_plan: a block must span no more than the block
    stride)."""
    x = t[0].transpose(0, 1)                        # [S, H, D]
    if not x.is_contiguous():
        x = x.contiguous()
    seq, heads, dim = x.shape
    return x.view(seq // block_tokens, block_tokens, heads, dim)


def _hf_view(blocks: Any) -> Any:
    """Paged-cache blocks [n, bt, H, D] seen as the HF tensor [1, H, n * bt, D] (a view)."""
    n, bt, heads, dim = blocks.shape
    return blocks.view(n * bt, heads, dim).transpose(0, 1).unsqueeze(0)


def _new_cache(model: Any) -> Any:
    """An empty DynamicCache for `model`, made the way kvstore_client.hf makes one for the
    installed transformers version."""
    import torch
    from kvstore_client.hf import canonical_to_cache

    return canonical_to_cache(torch.empty((0, 2, 0, 0, 0)), model.config)


def engine_forwards(model: Any, bufs: list[Any], ids: Any, prefix: int
                    ) -> tuple[Callable[[], tuple[Any, Any]], Callable[[], Any]]:
    """The consumer's two forwards over a prompt `ids` (on the model's device):
    (suffix_forward, full_forward).

    suffix_forward is the engine once the prefix is loaded into `bufs` (K, V per layer, the
    HF shape [1, H, prefix, D]): a cache over them, then the tokens from `prefix` on; it returns
    (logits, cache). full_forward is the engine without kvstore: one forward of the whole
    prompt. Both are captured as CUDA graphs, so neither may sync with the host or upload host
    data (tests/test_hf_gpu_bench.py checks that on the CPU)."""
    from kvstore_client.hf import forward_with_cache

    layers = model.config.num_hidden_layers
    suffix = ids[prefix:]

    def suffix_forward() -> tuple[Any, Any]:
        cache = _new_cache(model)
        for layer in range(layers):
            cache.update(bufs[2 * layer], bufs[2 * layer + 1], layer)
        return forward_with_cache(model, suffix, cache, prefix), cache

    def full_forward() -> Any:
        return forward_with_cache(model, ids, _new_cache(model), 0)

    return suffix_forward, full_forward


def _capture_engine(torch: Any, dev: Any, suffix_forward: Any, full_forward: Any,
                    load: Any) -> dict[str, Any]:
    """The engine's two forwards captured as CUDA graphs, as serving engines run theirs:
    {"reuse": (graph, logits), "full": (graph, logits), "report": {...}}; only "report" (why
    not) where there is no CUDA or capture fails.

    Each is warmed up twice on a side stream, then captured; a replay recomputes into the
    same output tensors. The reuse graph reads the loaded buffers, so a load before each
    replay is all the reuse path needs."""
    if dev.type != "cuda":
        return {"report": {"skipped": "no CUDA device"}}
    out: dict[str, Any] = {}
    try:
        load()
        for name, fn in (("reuse", lambda: suffix_forward()[0]), ("full", full_forward)):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode="thread_local"):
                logits = fn()
            out[name] = (g, logits)
        torch.cuda.synchronize()
    except Exception as e:  # the eager figures stand alone
        return {"report": {"error": "".join(traceback.format_exception_only(e))[-2000:]}}
    out["report"] = {"captured": True}
    return out


def _produce(setup: dict) -> dict:
    torch, model, sync = _engine(setup)
    import numpy as np
    from kvstore_client import connect
    from kvstore_client.device_kv import DeviceKV
    from kvstore_client.gpu import PagedKVCache
    from kvstore_client.hf import cache_seq_length, forward_with_cache, layout_for_model

    bt, p = setup["block_tokens"], setup["prefix"]
    nb = p // bt
    layers = model.config.num_hidden_layers
    ids = torch.tensor(setup["ids"], dtype=torch.int64)
    out: dict[str, Any] = {"weights": _weights_fingerprint(torch, model)}
    # Everything under inference mode: the cache tensors the forward makes are inference
    # tensors, and the copier's stream bookkeeping (record_stream) counts as writing them.
    with torch.inference_mode(), connect(setup["address"]) as c:
        layout = layout_for_model(model, block_tokens=bt)
        ns = c.namespace(layout, model=MODEL_NAME)
        keys = ns.keys(ids[:p].numpy())
        if len(keys) != nb:
            raise RuntimeError(f"{len(keys)} keys for a {p}-token prefix of {bt}-token blocks")
        cache = _new_cache(model)
        sync()
        t0 = time.perf_counter()
        forward_with_cache(model, ids[:p], cache, 0)
        sync()
        out["prefill_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        if cache_seq_length(cache) != p:
            raise RuntimeError(f"the cache holds {cache_seq_length(cache)} tokens, not {p}")
        kv = _prefix_kv(cache, layers, p)
        blocks = [_token_major(t, bt) for t in kv]
        dkv = DeviceKV(ns, PagedKVCache([(blocks[2 * i], blocks[2 * i + 1])
                                         for i in range(layers)]), device=0)
        t0 = time.perf_counter()
        out["stored"] = dkv.store_keys(keys, np.arange(nb))
        out["store_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        out["per_tier"] = ns.lookup_result(keys).per_tier
        out["kv"] = _fingerprint(torch, kv)
    say(f"producer: prefill of {p} tokens {out['prefill_ms']:.1f} ms, stored {out['stored']} "
        f"blocks into the gpu tier in {out['store_ms']:.1f} ms ({out['per_tier']})")
    return out


def _consume(setup: dict) -> dict:
    torch, model, sync = _engine(setup)
    import numpy as np
    import transformers
    from kvstore_client import connect
    from kvstore_client.device_kv import DeviceKV
    from kvstore_client.gpu import PagedKVCache
    from kvstore_client.hf import forward_with_cache, greedy_decode, layout_for_model

    bt, p, reps, steps = setup["block_tokens"], setup["prefix"], setup["reps"], setup["steps"]
    nb = p // bt
    cfg = model.config
    layers, kv_heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    dtype = getattr(torch, setup["dtype"])
    dev = torch.device("cuda:0" if setup["device"] == "cuda" else "cpu")
    ids = torch.tensor(setup["ids"], dtype=torch.int64)
    prefix_ids, suffix_ids = ids[:p], ids[p:]
    block_ids = np.arange(nb)
    out: dict[str, Any] = {
        "weights": _weights_fingerprint(torch, model),
        "device": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda if dev.type == "cuda" else None,
        "params": sum(x.numel() for x in model.parameters()),
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
    }

    with torch.inference_mode(), connect(setup["address"]) as c:
        layout = layout_for_model(model, block_tokens=bt)
        ns = c.namespace(layout, model=MODEL_NAME)
        keys = ns.keys(prefix_ids.numpy())
        out["block_bytes"] = layout.block_bytes
        out["prefix_bytes"] = nb * layout.block_bytes
        out["per_tier_before"] = ns.lookup_result(keys).per_tier
        # The engine's buffers for a loaded prefix, bound to the gpu tier once (as an engine
        # binds its cache); each load below still leases, gathers and releases. They are
        # token-major blocks [n, bt, H, D]; the model sees them as [1, H, P, D] through a
        # view, which the DynamicCache takes as it takes any key/value tensor.
        blocks = [torch.empty((nb, bt, kv_heads, head_dim), dtype=dtype, device=dev)
                  for _ in range(2 * layers)]
        bufs = [_hf_view(b) for b in blocks]
        dkv = DeviceKV(ns, PagedKVCache([(blocks[2 * i], blocks[2 * i + 1])
                                         for i in range(layers)]), device=0)
        out["runs_per_block"] = getattr(dkv.copier, "runs_per_block", None)

        ids_dev = ids.to(dev)                                   # graph-capturable inputs

        def load() -> int:
            n = dkv.load_keys(keys, block_ids)      # returns once the gather is complete
            if n != nb:
                raise RuntimeError(f"load_keys returned {n} of the prefix's {nb} blocks "
                                   f"(lookup now: {ns.lookup_result(keys).per_tier})")
            return n

        suffix_forward, full_forward = engine_forwards(model, bufs, ids_dev, p)

        def timed(fn: Any) -> dict:
            sync()
            t0 = time.perf_counter()
            r = fn()
            r["token"] = int(r["logits"].argmax())
            sync()
            r["ttft"] = time.perf_counter() - t0
            return r

        def reuse() -> dict:
            t0 = time.perf_counter()
            n = load()
            t1 = time.perf_counter()
            logits, cache = suffix_forward()
            return {"load": t1 - t0, "logits": logits, "cache": cache, "blocks": n}

        paths: dict[str, Any] = {
            "reuse": lambda: timed(reuse),
            "recompute": lambda: timed(lambda: {"logits": full_forward()}),
        }
        graphs = _capture_engine(torch, dev, suffix_forward, full_forward, load)
        out["graphs"] = graphs.pop("report")
        if graphs:
            (g_reuse, g_reuse_logits), (g_full, g_full_logits) = graphs["reuse"], graphs["full"]

            def reuse_graphed() -> dict:
                t0 = time.perf_counter()
                n = load()
                t1 = time.perf_counter()
                g_reuse.replay()
                return {"load": t1 - t0, "logits": g_reuse_logits, "blocks": n}

            def recompute_graphed() -> dict:
                g_full.replay()
                return {"logits": g_full_logits}

            paths["reuse_graphs"] = lambda: timed(reuse_graphed)
            paths["recompute_graphs"] = lambda: timed(recompute_graphed)

        say(f"consumer: warm-up of {sorted(paths)}")
        for fn in paths.values():
            fn()
        times: dict[str, list[float]] = {k: [] for k in paths}
        times.update({"load": [], "load_graphs": []})
        first_tokens: dict[str, set[int]] = {k: set() for k in paths}
        loaded: list[int] = []
        names = list(paths)
        for i in range(reps):
            for name in (names if i % 2 == 0 else names[::-1]):   # alternated
                r = paths[name]()
                times[name].append(r["ttft"])
                if "load" in r:
                    times["load" if name == "reuse" else "load_graphs"].append(r["load"])
                    loaded.append(r["blocks"])
                first_tokens[name].add(r["token"])
                del r
            say(f"consumer: rep {i + 1}/{reps}: " + ", ".join(
                f"{k} {times[k][-1] * 1e3:.2f} ms" for k in names))
        med = statistics.median
        for name in names:
            out[f"ttft_{name}_ms"] = round(med(times[name]) * 1e3, 3)
            out[f"{name}_times_ms"] = [round(t * 1e3, 3) for t in times[name]]
        out["load_ms"] = med(times["load"]) * 1e3
        if times["load_graphs"]:
            out["load_graphs_ms"] = round(med(times["load_graphs"]) * 1e3, 3)
        out["first_tokens"] = {k: sorted(v) for k, v in first_tokens.items()}
        out["first_tokens_agree"] = len(first_tokens["reuse"]) == 1

        # Correctness: a load into poisoned buffers, against a recompute split the same way
        # (prefix, then suffix), so the KV and the last forward are computed identically.
        for t in blocks:
            t.fill_(float("nan"))
        r = reuse()
        ref_cache = _new_cache(model)
        forward_with_cache(model, prefix_ids, ref_cache, 0)
        ref_logits = forward_with_cache(model, suffix_ids, ref_cache, p)
        ref_kv = _prefix_kv(ref_cache, layers, p)
        out["blocks_loaded"] = min(loaded + [r["blocks"]])     # each load checked == nb
        out["kv_equal"] = all(torch.equal(a, b) for a, b in zip(bufs, ref_kv, strict=True))
        out["kv_loaded"] = _fingerprint(torch, bufs)
        out["kv_recomputed"] = _fingerprint(torch, ref_kv)
        out["max_abs_logit_diff"] = float((r["logits"].float() - ref_logits.float())
                                          .abs().max())
        if graphs:      # the graphed engine's reuse computes what the eager one does
            g_reuse.replay()
            out["graphs"].update(
                logits_equal=bool(torch.equal(g_reuse_logits, r["logits"])),
                max_abs_logit_diff=float((g_reuse_logits.float() - r["logits"].float())
                                         .abs().max()),
                first_token_equal=int(g_reuse_logits.argmax()) == int(r["logits"].argmax()))
        out["single_forward_first_token_equal"] = \
            int(full_forward().argmax()) == int(r["logits"].argmax())
        out["tokens_reuse"], _ = greedy_decode(model, r["logits"], r["cache"], steps)
        out["tokens_recompute"], _ = greedy_decode(model, ref_logits, ref_cache, steps)
        del r, ref_cache, ref_logits, ref_kv
        # Where the load's time goes: the Acquire and Release round trips, the gather.
        from kvstore_client._proto import kvstore_pb2 as pb

        acq, rel, copy = [], [], []
        for _ in range(reps):
            t0 = time.perf_counter()
            lease = c.call("Acquire", pb.AcquireRequest(
                namespace_id=ns.ns_id, keys=keys, tier="gpu", ttl_s=c.lease_ttl_s,
                device=0)).lease
            t1 = time.perf_counter()
            offsets = dkv._offsets(lease.slots)
            t2 = time.perf_counter()
            dkv.copier.load(block_ids, offsets).wait(60)
            t3 = time.perf_counter()
            c.release(lease.lease_id)
            acq.append(t1 - t0)
            copy.append(t3 - t2)
            rel.append(time.perf_counter() - t3)
        out["acquire_ms"] = round(statistics.median(acq) * 1e3, 3)
        out["gather_ms"] = round(statistics.median(copy) * 1e3, 3)
        out["release_ms"] = round(statistics.median(rel) * 1e3, 3)
        stats = c.stats()
        out["gpu_tier"] = stats["tiers"].get("gpu", {})
        out["gpu_counters"] = {k: v for k, v in stats["counters"].items() if "gpu" in k}
    return out


def child(fn_name: str, setup: dict, q: Any) -> None:
    """Entry point of a spawned process: the result, or the error, goes back through `q`."""
    global T0
    T0 = setup["t0"]
    try:
        q.put(("ok", globals()[fn_name](setup)))
    except BaseException as e:  # report instead of leaving the parent waiting
        q.put(("error", "".join(traceback.format_exception(e))[-6000:]))
