"""How far a reuse predictor could take an eviction policy on a trace (docs/eviction.md).

Why: on the Mooncake conversation trace the gap between LRU and the offline optimum comes from
first reuses of newly written request bodies (a conversation continues or not). An online
policy can only close it by predicting, when a body is written, whether it will be reused.
This measures how well that can be predicted from everything a store sees, and what even an
unrealistically good predictor would buy:

1. Features of each new request body at write time: its length, the prompt length, the
   length of the already-known prefix, how many earlier requests ended inside that prefix
   (turns), time since the parent block was written, the parent's child and use counts, the
   share of the parent's earlier bodies already seen reused, the request rate over the last
   10 s; generous extras a store does not see: the request's output
   length and its absolute time. Label: any of the body's blocks (but the last, usually a
   partial block) is referenced again.
2. A gradient-boosted model over them, scored by block-weighted ROC AUC in-sample (fitted on
   the trace it is scored on: an upper bound, it memorises) and with 2-fold cross-validation
   (what an online learner could hope for).
3. LRU over prefix leaves where bodies predicted not to be reused are admitted at the eviction
   end, replayed at 5k / 10k blocks with: no hint (must equal plain LRU), a perfect oracle,
   the in-sample model and the cross-validated model (each at the 30/50/70% score
   quantile, best kept), next to the target ``hit_target`` = LRU + (optimum - LRU) / 2.

    pip install -e '.[bench]'      # scikit-learn
    python bench/trace_predictability.py TRACE.jsonl

Last stdout line: one JSON object (``auc_*``, ``hit_*`` dicts keyed "5k"/"10k").
"""

from __future__ import annotations

import argparse
import heapq
import json
import sys
from collections import Counter, deque
from collections.abc import Sequence

import numpy as np
from trace_replay import replay_opt  # this folder is on sys.path when run as a script

CAPACITIES = (5000, 10000)
FEATURES = ["body_blocks", "prompt_blocks", "known_prefix", "turns", "s_since_parent",
            "parent_children", "parent_uses", "parent_reuse_rate", "requests_last_10s"]
EXTRAS = ["output_length", "time_s"]          # not visible to a store; generous


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def body_features(rows: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One row per request that writes >= 2 new blocks: features, label, weight, request no."""
    first: dict[int, int] = {}
    refs: Counter[int] = Counter()
    for i, r in enumerate(rows):
        for h in r["hash_ids"]:
            first.setdefault(h, i)
            refs[h] += 1
    written_at: dict[int, float] = {}
    children: Counter[int] = Counter()
    uses: Counter[int] = Counter()
    ends: set[int] = set()
    body_of: dict[int, int] = {}                   # block -> the request whose body wrote it
    body_parent: dict[int, int | None] = {}        # that request -> its body's parent block
    reused_under: Counter[int | None] = Counter()  # parent -> its bodies seen reused so far
    recent: deque[float] = deque()
    feats, labels, weights, reqs = [], [], [], []
    for i, r in enumerate(rows):
        ids, t = r["hash_ids"], r["timestamp"] / 1000
        while recent and recent[0] < t - 10:
            recent.popleft()
        recent.append(t)
        k = 0
        while k < len(ids) and first[ids[k]] < i:
            k += 1
        body, parent = ids[k:], (ids[k - 1] if k else None)
        row = [len(body), len(ids), k, sum(h in ends for h in ids[:k]),
               t - written_at[parent] if parent is not None else -1.0,
               children[parent] if parent is not None else -1,
               uses[parent] if parent is not None else -1,
               (reused_under[parent] + 1) / (children[parent] + 2), len(recent),
               r["output_length"], t]
        for h in ids[:k]:
            uses[h] += 1
            b = body_of.get(h)
            if b is not None and b in body_parent:   # first reuse of a body: credit its parent
                reused_under[body_parent.pop(b)] += 1
        if parent is not None and body:
            children[parent] += 1
        for h in body:
            written_at[h] = t
        for h in body[:-1]:
            body_of[h] = i
        body_parent[i] = parent
        if ids:
            ends.add(ids[-1])
        if len(body) >= 2:
            feats.append(row)
            labels.append(any(refs[h] > 1 for h in body[:-1]))
            weights.append(len(body) - 1)
            reqs.append(i)
    return (np.array(feats, float), np.array(labels), np.array(weights, float),
            np.array(reqs))


def replay_hinted(rows: list[dict], capacity: int, low: set[int]) -> float:
    """Block hit % of LRU over prefix leaves; bodies of requests in `low` go to the eviction
    end. The request's own blocks are pinned while it is processed (as in trace_replay)."""
    parent: dict[int, int] = {}
    kids: Counter[int] = Counter()
    prio: dict[int, tuple[int, int]] = {}
    heap: list[tuple[tuple[int, int], int]] = []
    clock = hits = refs = 0

    def offer(h: int) -> None:
        if kids[h] == 0:
            heapq.heappush(heap, (prio[h], h))

    for i, r in enumerate(rows):
        ids = r["hash_ids"]
        refs += len(ids)
        k = 0
        while k < len(ids) and ids[k] in prio:
            k += 1
        hits += k
        pinned = set(ids)
        for j, h in enumerate(ids):
            clock += 1
            if h in prio:
                prio[h] = (1, clock)
                offer(h)
                continue
            while len(prio) >= capacity:
                held = []
                while heap:
                    p, v = heapq.heappop(heap)
                    if prio.get(v) == p and kids[v] == 0:
                        if v in pinned:
                            held.append((p, v))
                            continue
                        break
                else:
                    break
                for item in held:
                    heapq.heappush(heap, item)
                del prio[v]
                pp = parent.pop(v, None)
                if pp is not None and pp in prio:
                    kids[pp] -= 1
                    offer(pp)
            prio[h] = (0 if (i in low and j >= k) else 1, clock)
            if j and ids[j - 1] in prio:
                parent[h] = ids[j - 1]
                kids[ids[j - 1]] += 1
            offer(h)
    return round(100 * hits / refs, 2)


def best_hinted(rows: list[dict], reqs: np.ndarray, score: np.ndarray | None,
                labels: np.ndarray | None = None) -> dict[str, float]:
    out = {}
    for cap in CAPACITIES:
        if labels is not None:
            hints = [set(reqs[~labels].tolist())]
        elif score is None:
            hints = [set()]
        else:
            hints = [set(reqs[score < np.quantile(score, q)].tolist()) for q in (0.3, 0.5, 0.7)]
        out[f"{cap // 1000}k"] = max(replay_hinted(rows, cap, h) for h in hints)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("trace")
    ap.add_argument("--quick", action="store_true", help="accepted for symmetry: ~25 s anyway")
    args = ap.parse_args(argv)
    try:
        from sklearn.ensemble import HistGradientBoostingClassifier
        from sklearn.metrics import roc_auc_score
        from sklearn.model_selection import cross_val_predict
    except ImportError:
        print("needs scikit-learn: pip install -e '.[bench]'", file=sys.stderr)
        return 2
    rows = load(args.trace)
    x, y, w, reqs = body_features(rows)
    res: dict[str, object] = {"bodies": len(y),
                              "reused_block_share": round(float(w[y].sum() / w.sum()), 3)}
    for name, cols in (("store", len(FEATURES)), ("all", len(FEATURES) + len(EXTRAS))):
        model = HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, random_state=0)
        p_in = model.fit(x[:, :cols], y, sample_weight=w).predict_proba(x[:, :cols])[:, 1]
        p_cv = cross_val_predict(
            HistGradientBoostingClassifier(max_iter=300, learning_rate=0.05, random_state=0),
            x[:, :cols], y, cv=2, method="predict_proba", params={"sample_weight": w})[:, 1]
        res[f"auc_{name}_in_sample"] = round(float(roc_auc_score(y, p_in, sample_weight=w)), 3)
        res[f"auc_{name}_2fold"] = round(float(roc_auc_score(y, p_cv, sample_weight=w)), 3)
        if name == "store":
            res["hit_model_in_sample"] = best_hinted(rows, reqs, p_in)
            res["hit_model_2fold"] = best_hinted(rows, reqs, p_cv)
    for j, name in enumerate(FEATURES + EXTRAS):
        auc = float(roc_auc_score(y, x[:, j], sample_weight=w))
        res[f"auc_single_{name}"] = round(max(auc, 1 - auc), 3)
    res["hit_lru"] = best_hinted(rows, reqs, None)
    res["hit_oracle"] = best_hinted(rows, reqs, None, labels=y)
    # the target: half the LRU-to-optimum gap closed (the optimum from trace_replay)
    trace = [r["hash_ids"] for r in rows]
    res["hit_target"] = {
        label: round(lru + (100 * replay_opt(trace, cap).ratio - lru) / 2, 2)
        for (label, lru), cap in zip(res["hit_lru"].items(), CAPACITIES, strict=True)}
    for key, val in res.items():
        print(f"{key:32s} {val}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
