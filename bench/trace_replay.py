"""Replay a Mooncake-format request trace against the eviction policies (docs/eviction.md).

Why: the eviction policy is judged by block hit ratio on real prompt traffic, not by
micro-benchmarks. This replays a trace in process, with prefix semantics (a request hits its
longest cached leading run of blocks; afterwards all its blocks are stored), against
`kvstore.policies` exactly as the store drives it, and compares with the offline optimum.

    python bench/trace_replay.py [--quick] [--plot PNG] [--through-store] [--policies arc]
                                 TRACE.jsonl
    python bench/trace_replay.py --synthetic KIND   (hot-prompts, scan, shifting, conversation,
                                                  chat, agent, short-scan, rag)

Prints a table, then as its last stdout line one JSON object:
``hit_lru`` / ``hit_policy`` / ``hit_opt`` (dicts keyed "1k", "2k", "5k", ...: block hit ratio
at that capacity in blocks; ``hit_NAME`` for each ``--policies NAME``), ``hit_lru_plain`` and
``hit_opt_readme`` (the trace README's reference rules, to validate the harness),
``gap_closed_5k`` / ``gap_closed_10k`` = (policy - lru) / (opt - lru), and
``policy_refs_per_s`` (block references per second through the default policy).
``hit_hinted`` and ``gap_closed_5k_hinted`` / ``gap_closed_10k_hinted``: the default policy
given the Retain hints an engine that knows which conversations go on would send (engine
signals mapped by kvstore_client.retention; read off the trace's future, since the trace has
no session ids); ``hit_lru_hinted``: LRU given the same hints. ``policy_ge_lru_everywhere``:
the default, blind and hinted, at or above LRU at every capacity; ``hinted_ge_blind_everywhere``:
hinted at or above blind at every capacity. Capacities: the six standard ones plus 1% and 100%
of the trace's distinct blocks.
"""

from __future__ import annotations

import argparse
import heapq
import importlib.util
import json
import math
import os
import random
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Run from a checkout (as a script, or imported by one beside it) kvstore may not be
# importable yet; where it is (the tests), the importer's sys.path is left as it was.
if importlib.util.find_spec("kvstore") is None:
    sys.path.insert(0, str(ROOT))

from kvstore_client.retention import hints as retention_hints  # noqa: E402

from kvstore.policies import make_policy  # noqa: E402

Trace = list[list[int]]
CAPACITIES = [1000, 2000, 5000, 10000, 20000, 50000]
EXTRA_CAPACITIES = [3000, 7000, 15000, 30000, 100000]    # full (non --quick) runs, for the plot
INF = 1 << 62


def cap_label(cap: int) -> str:
    return f"{cap // 1000}k" if cap % 1000 == 0 else str(cap)


def load_trace(path: str | os.PathLike) -> Trace:
    """hash_ids of each request, in arrival order."""
    with open(path) as f:
        return [json.loads(line)["hash_ids"] for line in f if line.strip()]


# ------------------------------------------------------------------ synthetic traces

def synthetic(kind: str, n_requests: int | None = None, seed: int = 0) -> Trace:
    """Traces with other shapes than the conversation trace, so the policy is not fitted to it.

    hot-prompts: a few long shared system prompts, each followed by a random one-shot tail.
    scan: a steady reused working set interleaved with long one-shot scans.
    shifting: conversations whose popular set changes every phase.
    conversation: multi-turn chats (each turn extends the previous prompt), Zipf-popular.
    """
    if n_requests is None:
        n_requests = 1 << 30 if kind in SESSION_SHAPES else 6000
    rng = random.Random(seed)
    next_id = [0]

    def fresh(n: int) -> list[int]:
        out = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return out

    reqs: Trace = []
    if kind == "hot-prompts":
        prompts = [fresh(rng.randint(8, 40)) for _ in range(12)]
        weights = [1 / (i + 1) for i in range(len(prompts))]
        for _ in range(n_requests):
            p = rng.choices(prompts, weights)[0]
            reqs.append(p + fresh(rng.randint(1, 12)))
    elif kind == "scan":
        hot = [fresh(rng.randint(4, 16)) for _ in range(150)]
        for _ in range(n_requests):
            if rng.random() < 0.3:
                reqs.append(fresh(rng.randint(30, 120)))     # a one-shot scan
            else:
                reqs.append(rng.choice(hot) + fresh(rng.randint(0, 2)))
    elif kind == "shifting":
        per_phase = max(1, n_requests // 5)
        for _phase in range(5):
            docs = [fresh(rng.randint(6, 30)) for _ in range(80)]
            for _ in range(per_phase):
                d = docs[min(int(rng.paretovariate(1.2)) - 1, len(docs) - 1)]
                reqs.append(d + fresh(rng.randint(1, 6)))
    elif kind == "conversation":
        live: list[list[int]] = []
        for _ in range(n_requests):
            if live and rng.random() < 0.45:
                i = min(int(rng.paretovariate(1.0)) - 1, len(live) - 1)
                conv = live[-1 - i]
                conv.extend(fresh(rng.randint(1, 6)))
                reqs.append(list(conv))
                if rng.random() < 0.3:
                    live.remove(conv)
            else:
                conv = [0] + fresh(rng.randint(2, 30)) if rng.random() < 0.7 else \
                    fresh(rng.randint(2, 30))
                live.append(conv)
                reqs.append(list(conv))
                if len(live) > 2000:
                    live.pop(0)
    elif kind in SESSION_SHAPES:
        reqs = _sessions(kind, rng, fresh, n_requests)
    else:
        raise ValueError(f"unknown synthetic trace {kind!r}")
    return reqs


# Larger traces in the Mooncake format whose working sets span the bench's capacities (tens of
# thousands of distinct blocks), each of another shape than the shared trace. A request's last
# block stands for a partial block: when its session goes on, the next prompt re-keys it.
SESSION_SHAPES = {
    # long multi-turn chats: 40 shared system prompts, many turns, heavy-tailed think times
    "chat": dict(sessions=1500, systems=40, sys_blocks=(4, 16), turns=(2, 10),
                 turn_blocks=(2, 10), gap=(20, 3000), burst=1, scan=0.0),
    # agents in bursts: long shared tool prompts, many quick steps (far more reuse)
    "agent": dict(sessions=900, systems=12, sys_blocks=(10, 30), turns=(4, 16),
                  turn_blocks=(1, 4), gap=(5, 4000), burst=6, scan=0.0),
    # many short sessions (1-3 turns) plus one-shot long scans that should not pollute
    "short-scan": dict(sessions=6000, systems=300, sys_blocks=(6, 30), turns=(1, 3),
                       turn_blocks=(1, 6), gap=(50, 8000), burst=1, scan=0.1),
    # retrieval: a question (1-3 turns) about one of 600 Zipf-popular documents placed after
    # one of 6 system prompts, so the shared part sits in the middle of the prompt and the
    # sessions that close say "low" over documents other sessions will read again
    "rag": dict(sessions=5000, systems=6, sys_blocks=(2, 8), turns=(1, 3),
                turn_blocks=(1, 3), gap=(10, 2500), burst=1, scan=0.0,
                docs=600, doc_blocks=(6, 40)),
}


def _sessions(kind: str, rng: random.Random, fresh: Callable[[int], list[int]],
              n_requests: int) -> Trace:
    """Sessions started in arrival order (in bursts of `burst`), each turn re-sent after a
    log-uniform gap of `gap` requests; with probability `scan`, a request is instead a
    one-shot scan of 20-80 fresh blocks. `n_requests` caps the trace length."""
    shape = SESSION_SHAPES[kind]
    systems = [fresh(rng.randint(*shape["sys_blocks"])) for _ in range(shape["systems"])]
    weights = [1 / (i + 1) for i in range(len(systems))]
    n_docs = shape.get("docs", 0)
    doc_len = [rng.randint(*shape["doc_blocks"]) for _ in range(n_docs)]
    doc_weights = [1 / (i + 1) for i in range(n_docs)]
    doc_ids: dict[tuple[int, int], list[int]] = {}   # ids are prefix hashes: per system
    lo, hi = shape["gap"]
    due: list[tuple[float, int, list[int], int]] = []   # (time, seq, prompt, turns left)
    seq = 0
    t = 0.0
    for s_i in range(shape["sessions"]):
        if s_i % shape["burst"] == 0:
            t += rng.expovariate(1.0) * shape["burst"] * 2.5
        if n_docs:
            si = rng.choices(range(len(systems)), weights)[0]
            di = rng.choices(range(n_docs), doc_weights)[0]
            doc = doc_ids.get((si, di)) or doc_ids.setdefault((si, di), fresh(doc_len[di]))
            prompt = systems[si] + doc + fresh(rng.randint(*shape["turn_blocks"]))
        else:
            prompt = rng.choices(systems, weights)[0] + fresh(rng.randint(*shape["turn_blocks"]))
        heapq.heappush(due, (t, seq, prompt, rng.randint(*shape["turns"])))
        seq += 1
    reqs: Trace = []
    while due and len(reqs) < n_requests:
        t, _, prompt, left = heapq.heappop(due)
        if shape["scan"] and rng.random() < shape["scan"]:
            reqs.append(fresh(rng.randint(20, 80)))
        reqs.append(list(prompt))
        if left > 1:
            nxt = prompt[:-1] + fresh(rng.randint(*shape["turn_blocks"]) + 1)
            gap = math.exp(rng.uniform(math.log(lo), math.log(hi)))
            heapq.heappush(due, (t + gap, seq, nxt, left - 1))
            seq += 1
    return reqs


# ------------------------------------------------------------------ replays

@dataclass
class Result:
    kind: str
    capacity: int
    hits: int
    refs: int
    seconds: float

    @property
    def ratio(self) -> float:
        return self.hits / self.refs if self.refs else 0.0


def as_keys(trace: Trace) -> list[list[bytes]]:
    """Trace ids as global keys. A trace id already names its whole prefix (it is a prefix
    hash), so the id itself is a valid key; 16 bytes like a real ns-less block key."""
    cache: dict[int, bytes] = {}
    return [[cache.get(x) or cache.setdefault(x, x.to_bytes(16, "little")) for x in r]
            for r in trace]


def session_hints(trace: Trace, nxt: list[list[int]] | None = None) -> list[int]:
    """Per request, how many of its leading blocks its conversation goes on with: all of them
    when a later request starts with this whole prompt, all but the last when a later one
    starts with the prompt up to its last block (a partial block, whose key changes when the
    prompt grows), else 0 (the conversation ends here).

    An engine that knows its sessions (and whether its last block is partial) knows this; the
    trace has no session ids, so it is read off the trace's future. The replay turns it into
    the Retain(level="low") call such an engine would make after storing a request, on the
    blocks it wrote past that point. `nxt`: next_uses(trace), when the caller has it."""
    out = []
    for uses in nxt if nxt is not None else next_uses(trace):
        n = len(uses)
        out.append(n if n and uses[-1] < INF else n - 1 if n >= 2 and uses[-2] < INF else 0)
    return out


def session_signals(goes_on: Sequence[int], trace: Trace) -> list[tuple[str, bool]]:
    """Per request, the engine signal (kvstore_client.retention) an engine that knows its
    sessions sends after storing it, and whether its last block is partial: the conversation
    goes on with the whole prompt ("session_continues"), goes on re-keying its last block
    ("session_continues", partial tail), or is over ("session_closed")."""
    out = []
    for n, req in zip(goes_on, trace, strict=True):
        if n and n == len(req):
            out.append(("session_continues", False))
        elif n:
            out.append(("session_continues", True))
        else:
            out.append(("session_closed", False))
    return out


def replay_policy(name: str, requests: Sequence[Sequence[bytes]], capacity: int,
                  signals: Sequence[tuple[str, bool]] | None = None) -> Result:
    """Drive a policy the way the store does, with a set standing in for the block index.

    Per request: the hit is the longest resident leading run; the first missing key is
    reported to record_miss (as Store.lookup does); hits are touched (acquire); missing blocks
    are inserted with their parent (put), evicting via pick() until within capacity; then the
    optional ``note_put(keys)`` hook gets the keys that put wrote, in order (as Store.put and
    Store.commit do after publishing). The request's own blocks are pinned while it is
    processed (its read lease / write in flight). With `signals` (per request, from
    session_signals), the request's blocks (its whole prompt: the engine hints what the
    conversation holds, not only what this turn wrote) then get the Retain levels
    ``kvstore_client.retention.hints`` maps its signal to, through the policy's
    ``note_retention(keys, level)`` (as Store.retain does).
    """
    policy = make_policy(name, capacity)
    note_retention = getattr(policy, "note_retention", None) if signals is not None else None
    note_put = getattr(policy, "note_put", None)
    resident: set[bytes] = set()
    hits = refs = 0
    t0 = time.perf_counter()
    for i, req in enumerate(requests):
        n = len(req)
        k = 0
        while k < n and req[k] in resident:
            k += 1
        hits += k
        refs += n
        if k < n:
            policy.record_miss(req[k])
        pinned = set(req)
        can_evict = lambda g: g not in pinned  # noqa: B023 - used within this iteration
        parent = None
        for key in req:
            if key in resident:
                policy.touch(key)
            else:
                policy.insert(key, parent, 1)
                resident.add(key)
                while len(resident) > capacity:
                    victim = policy.pick(can_evict)
                    if victim is None:
                        break
                    resident.discard(victim)
                    policy.remove(victim)
            parent = key
        if note_put is not None and k < n:
            note_put(req[k:])          # the store: once per put/commit, after its inserts
        if note_retention is not None:
            signal, partial = signals[i]
            for keys, level in retention_hints(signal, req, partial):
                note_retention(keys, level)
    return Result(name, capacity, hits, refs, time.perf_counter() - t0)


def replay_lru_plain(trace: Trace, capacity: int) -> Result:
    """Plain (not prefix-aware) LRU touching blocks in request order: the trace README's rule."""
    od: OrderedDict[int, None] = OrderedDict()
    hits = refs = 0
    t0 = time.perf_counter()
    for req in trace:
        k = 0
        while k < len(req) and req[k] in od:
            k += 1
        hits += k
        refs += len(req)
        for x in req:
            if x in od:
                od.move_to_end(x)
            else:
                od[x] = None
        pinned = set(req)
        while len(od) > capacity:
            victim = next((x for x in od if x not in pinned), None)
            if victim is None:
                break
            del od[victim]
    return Result("lru_plain", capacity, hits, refs, time.perf_counter() - t0)


def next_uses(trace: Trace) -> list[list[int]]:
    """For each (request, position): index of the next request using that block, or INF."""
    out: list[list[int]] = [[] for _ in trace]
    last: dict[int, int] = {}
    for i in range(len(trace) - 1, -1, -1):
        req = trace[i]
        out[i] = [last.get(x, INF) for x in req]
        for x in req:
            last[x] = i
    return out


def replay_opt(trace: Trace, capacity: int, deeper_first: bool = True,
               nxt: list[list[int]] | None = None) -> Result:
    """Belady with bypass: evict the block used furthest in the future, never admit a block
    that is never used again.

    Prefix semantics need no special rule: a parent is used whenever its child is, so its next
    use is never later than the child's. On a tie (same next request) the deeper block goes
    first (deeper_first), which never orphans a child; the trace README's figures break ties
    the other way (deeper_first=False reproduces them), a slightly weaker bound.
    """
    nxt = nxt if nxt is not None else next_uses(trace)
    sign = -1 if deeper_first else 1
    resident: dict[int, int] = {}
    heap: list[tuple[int, int, int]] = []
    hits = refs = 0
    t0 = time.perf_counter()
    for i, req in enumerate(trace):
        k = 0
        while k < len(req) and req[k] in resident:
            k += 1
        hits += k
        refs += len(req)
        for depth, (x, n) in enumerate(zip(req, nxt[i], strict=True)):
            if n == INF:
                resident.pop(x, None)
                continue
            resident[x] = n
            heapq.heappush(heap, (-n, sign * depth, x))
        while len(resident) > capacity:
            n, _d, x = heapq.heappop(heap)
            if resident.get(x) == -n:
                del resident[x]
    return Result("opt" if deeper_first else "opt_readme", capacity, hits, refs,
                  time.perf_counter() - t0)


def replay_store(name: str, trace: Trace, capacity: int) -> Result:
    """Drive the real kvstore.store.Store (host tier of `capacity` tiny blocks, ssd off).

    Keys are prefix-chained like real ones: key_i = blake3(key_{i-1} || id_i)[:16]. Per request:
    lookup, acquire the hit prefix (touch + pin), put the missing blocks, release.
    """
    import blake3
    from kvstore_client.common.layout import KVLayout, NamespaceSpec

    from kvstore.config import load_config
    from kvstore.state import SLAB_ALIGN
    from kvstore.store import Store

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, block_tokens=4,
                      dtype="float16")
    blob = bytes(layout.block_bytes)
    chained: dict[tuple[bytes, int], bytes] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(overrides={
            "data_dir": tmp,
            "host": {"capacity": capacity * SLAB_ALIGN, "high_watermark": 1.0,
                     "low_watermark": 1.0, "policy": name,
                     "shm_name": f"kvs-replay-{os.getpid()}-{capacity}"},
            "ssd": {"enabled": False},
            "server": {"tcp": "", "metrics": ""},
        }, environ={})
        store = Store(cfg)
        try:
            # The store sizes its policy hint from capacity // 1 MiB; with tiny blocks that
            # is wrong, so hand it the true capacity in blocks (see docs/eviction.md).
            store.policies["host"] = make_policy(name, capacity)
            ns = store.register_namespace(NamespaceSpec(model="trace-replay", layout=layout))
            ns_id = ns.ns_id
            hits = refs = 0
            t0 = time.perf_counter()
            for req in trace:
                keys = []
                prev = b""
                for x in req:
                    key = chained.get((prev, x))
                    if key is None:
                        key = blake3.blake3(prev + x.to_bytes(8, "little")).digest(16)
                        chained[(prev, x)] = key
                    keys.append(key)
                    prev = key
                k = store.lookup(ns_id, keys).prefix_blocks
                hits += k
                refs += len(keys)
                lease = store.acquire(ns_id, keys[:k]) if k else None
                try:
                    if k < len(keys):
                        store.put(ns_id, keys[k:], [blob] * (len(keys) - k),
                                  parent=keys[k - 1] if k else None)
                finally:
                    if lease is not None:
                        store.release(lease.id)
            return Result(f"store:{name}", capacity, hits, refs, time.perf_counter() - t0)
        finally:
            store.close(flush=False)


# ------------------------------------------------------------------ driver

_TRACE: Trace = []
_KEYS: list[list[bytes]] = []
_NEXT: list[list[int]] = []
_SIGNALS: list[tuple[str, bool]] = []


def _init(trace: Trace) -> None:
    global _TRACE, _KEYS, _NEXT, _SIGNALS
    _TRACE = trace
    _KEYS = as_keys(trace)
    _NEXT = next_uses(trace)
    _SIGNALS = session_signals(session_hints(trace, _NEXT), trace)


def _task(kind: str, cap: int) -> Result:
    if kind == "lru":
        return replay_policy("lru", _KEYS, cap)
    if kind == "policy":
        r = replay_policy("default", _KEYS, cap)
        r.kind = "policy"
        return r
    if kind == "hinted":
        r = replay_policy("default", _KEYS, cap, signals=_SIGNALS)
        r.kind = "hinted"
        return r
    if kind == "lru_hinted":
        r = replay_policy("lru", _KEYS, cap, signals=_SIGNALS)
        r.kind = "lru_hinted"
        return r
    if kind == "opt":
        return replay_opt(_TRACE, cap, True, _NEXT)
    if kind == "opt_readme":
        return replay_opt(_TRACE, cap, False, _NEXT)
    if kind == "lru_plain":
        return replay_lru_plain(_TRACE, cap)
    if kind.startswith("store:"):
        return replay_store(kind.split(":", 1)[1], _TRACE, cap)
    if kind.startswith("pol:"):
        r = replay_policy(kind.split(":", 1)[1], _KEYS, cap)
        r.kind = kind
        return r
    raise ValueError(kind)


def run_all(trace: Trace, capacities: Sequence[int], kinds: Sequence[str], workers: int,
            progress: Callable[[], None] = lambda: None) -> dict[str, dict[int, Result]]:
    """Every (kind, capacity) replay, the slow ones first, in `workers` processes."""
    weight = {"policy": 6, "hinted": 8, "lru": 2, "lru_hinted": 2, "store:default": 20,
              "store:lru": 20, "pol:arc": 4}
    jobs = sorted(((k, c) for k in kinds for c in capacities),
                  key=lambda kc: -weight.get(kc[0], 1) * (1 + kc[1] / 50000))
    out: dict[str, dict[int, Result]] = {k: {} for k in kinds}
    if workers <= 1:
        _init(trace)
        for k, c in jobs:
            out[k][c] = _task(k, c)
            progress()
        return out
    with ProcessPoolExecutor(workers, initializer=_init, initargs=(trace,)) as pool:
        futs = {pool.submit(_task, k, c): (k, c) for k, c in jobs}
        for f in as_completed(futs):
            k, c = futs[f]
            out[k][c] = f.result()
            progress()
    return out


def working_set_capacities(trace: Trace) -> list[int]:
    """1% of the trace's distinct blocks and all of them: the ends of the range the policy
    must hold LRU's hit ratio over (the standard capacities fill the middle)."""
    distinct = len({x for r in trace for x in r})
    return [max(1, distinct // 100), distinct]


def gap_closed(policy: float, lru: float, opt: float) -> float | None:
    return round((policy - lru) / (opt - lru), 4) if opt > lru else None


def summarize(res: dict[str, dict[int, Result]], capacities: Sequence[int]) -> dict:
    def col(kind: str) -> dict[str, float]:
        return {cap_label(c): round(res[kind][c].ratio, 4) for c in capacities if c in res[kind]}
    out: dict = {"hit_lru": col("lru"), "hit_policy": col("policy"), "hit_opt": col("opt")}
    for extra in ("opt_readme", "lru_plain", "hinted", "lru_hinted"):
        if extra in res:
            out[f"hit_{extra}"] = col(extra)
    for c in (5000, 10000):
        if c in res["policy"]:
            out[f"gap_closed_{cap_label(c)}"] = gap_closed(
                res["policy"][c].ratio, res["lru"][c].ratio, res["opt"][c].ratio)
        if c in res.get("hinted", {}):
            out[f"gap_closed_{cap_label(c)}_hinted"] = gap_closed(
                res["hinted"][c].ratio, res["lru"][c].ratio, res["opt"][c].ratio)
    # "never below LRU, blind or hinted": the default without hints and with them, against LRU
    # (hit_lru_hinted, LRU given the same hints, is reported beside it)
    out["policy_ge_lru_everywhere"] = all(
        res[k][c].ratio >= res["lru"][c].ratio for k in ("policy", "hinted") if k in res
        for c in res[k])
    if "hinted" in res:
        out["hinted_ge_blind_everywhere"] = all(
            res["hinted"][c].ratio >= res["policy"][c].ratio for c in res["hinted"])
    speeds = sorted(r.refs / r.seconds for r in res["policy"].values() if r.seconds > 0)
    out["policy_refs_per_s"] = round(speeds[len(speeds) // 2]) if speeds else None
    for kind in res:
        if kind.startswith("pol:"):
            out[f"hit_{kind.split(':', 1)[1]}"] = col(kind)
        if kind.startswith("store:"):
            out[f"hit_{kind.replace(':', '_')}"] = col(kind)
            sp = sorted(r.refs / r.seconds for r in res[kind].values() if r.seconds > 0)
            out[f"{kind.replace(':', '_')}_refs_per_s"] = round(sp[len(sp) // 2]) if sp else None
    return out


def table(res: dict[str, dict[int, Result]], capacities: Sequence[int]) -> str:
    kinds = [k for k in ("lru_plain", "lru", "lru_hinted", "policy", "hinted", "opt_readme",
                         "opt")
             if k in res]
    kinds += [k for k in res if k.startswith(("store:", "pol:"))]
    lines = ["capacity | " + " | ".join(f"{k:>13}" for k in kinds) + " | gap closed"]
    for c in capacities:
        row = [f"{100 * res[k][c].ratio:12.2f}%" if c in res[k] else f"{'-':>13}" for k in kinds]
        g = gap_closed(res["policy"][c].ratio, res["lru"][c].ratio, res["opt"][c].ratio)
        lines.append(f"{cap_label(c):>8} | " + " | ".join(row) +
                     f" | {g if g is not None else '-'}")
    return "\n".join(lines)


def plot(res: dict[str, dict[int, Result]], capacities: Sequence[int], path: str,
         title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = {"lru": "LRU (prefix leaves)", "policy": "default policy",
             "hinted": "default policy + session hints (Retain low)",
             "opt": "offline optimum (Belady)", "lru_plain": "plain LRU (README rule)"}
    for kind, label in names.items():
        if kind in res:
            cs = [c for c in capacities if c in res[kind]]
            ax.plot(cs, [100 * res[kind][c].ratio for c in cs], marker="o", label=label,
                    linestyle="--" if kind in ("lru_plain", "hinted") else "-")
    ax.set_xscale("log")
    ax.set_xlabel("capacity (blocks)")
    ax.set_ylabel("block hit ratio (%)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?", help="Mooncake-format JSONL trace")
    ap.add_argument("--synthetic", choices=["hot-prompts", "scan", "shifting", "conversation",
                                            *SESSION_SHAPES],
                    help="replay a generated trace instead of a file")
    ap.add_argument("--quick", action="store_true", help="the six standard capacities only")
    ap.add_argument("--capacities", help="comma-separated capacities in blocks")
    ap.add_argument("--plot", default=str(ROOT / "bench" / "out" / "trace_replay.png"))
    ap.add_argument("--through-store", action="store_true",
                    help="also replay through kvstore.store.Store (slow: small capacities)")
    ap.add_argument("--policies", default="",
                    help="comma-separated extra policy names to replay too (e.g. arc)")
    ap.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    if bool(args.trace) == bool(args.synthetic):
        ap.error("give a trace path or --synthetic KIND")
    trace = synthetic(args.synthetic) if args.synthetic else load_trace(args.trace)
    if args.capacities:
        caps = sorted(int(c) for c in args.capacities.split(","))
    else:
        caps = sorted(set(CAPACITIES + ([] if args.quick else EXTRA_CAPACITIES)
                          + working_set_capacities(trace)))
    kinds = ["lru", "lru_hinted", "policy", "hinted", "opt", "opt_readme", "lru_plain"]
    kinds += [f"pol:{p}" for p in args.policies.split(",") if p]
    if args.through_store:
        kinds += ["store:lru", "store:default"]
    from tqdm import tqdm
    t0 = time.perf_counter()
    with tqdm(total=len(kinds) * len(caps), desc="replays", file=sys.stderr) as bar:
        res = run_all(trace, caps, kinds, args.workers, progress=lambda: bar.update(1))
    summary = summarize(res, caps)
    refs = sum(len(r) for r in trace)
    summary.update({"trace": args.synthetic or Path(args.trace).name, "requests": len(trace),
                    "block_refs": refs, "capacities": [cap_label(c) for c in caps],
                    "wall_s": round(time.perf_counter() - t0, 1)})
    name = args.synthetic or Path(args.trace).name
    plot(res, caps, args.plot, f"block hit ratio vs capacity — {name}")
    print(f"trace {name}: {len(trace)} requests, {refs} block references")
    print(table(res, caps))
    print(f"default policy replay speed: {summary['policy_refs_per_s']} block refs/s; "
          f"plot: {args.plot}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
