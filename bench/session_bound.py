"""How far can knowing *whether* a session goes on (not *when*) take an eviction policy?

Why: the trace bench gives the policy the engine's session signals (continues / closed). What
they leave open is which open session returns first. Where the time to a session's next turn
is independent of everything a store can see (as in the synthetic session traces, whose think
times are drawn independently), a policy can only choose how long to hold each open
session's blocks after their last use, and that choice is independent of the actual return.
This bounds every such policy on a trace:

* each continuation (request i, then request j of the same session) holds the blocks of i
  that j reads and nothing reads in between (the session's own blocks) for min(gap, T)
  block accesses,
  gap = accesses between i and j, T = the hold time the policy picks; it hits them if gap <= T;
* the cache's capacity C allows C x (accesses in the trace) block-accesses of holding;
* uniform T is LRU over live sessions (closed ones bypassed); the best mix of hold times
  (any choice made without knowing the return: by age, size, turn, at random) is the concave
  hull of (cost, hits) over T, at that budget.

Shared blocks (system prompts, documents) are given the optimum's knowledge: their reuse
intervals take the rest of the budget shortest first. `bound` is the best split of the budget:
an optimistic ceiling (no prefix rule, no pinned requests) for policies that know whether a
session goes on but not when. Compare with LRU + (optimum - LRU) / 2 from
bench/trace_replay.py.

    python bench/session_bound.py --synthetic chat [--capacities 2000,5000,10000]
    python bench/session_bound.py TRACE.jsonl

Last stdout line: JSON {capacity: {"uniform": %, "hull": %, "bound": %}, "own_blocks": %,
"shared_reuses": %} (hit ratios in % of all block references).
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections.abc import Sequence

# Run as a script, bench/ is first on sys.path already. Imported (by tests, which load
# trace_replay first), it must not put bench/ there: bench/vllm.py would shadow vLLM.
import trace_replay as tr


def intervals(trace: tr.Trace) -> tuple[list[tuple[int, int]], list[int], int]:
    """Every reuse interval of a block (a reference to a block that is referenced again),
    as its gap in block accesses: per continuation of a session (gap, the session's own
    blocks in it: those the next turn reads and nothing reads in between), the gaps of every
    other interval (shared blocks), and the references in all."""
    nxt = tr.next_uses(trace)
    goes_on = tr.session_hints(trace, nxt)
    cum = [0]
    for r in trace:
        cum.append(cum[-1] + len(r))
    own_events = []
    shared = []
    for i, (uses, n) in enumerate(zip(nxt, goes_on, strict=True)):
        j = nxt[i][n - 1] if n else -1         # the request that goes on with this session
        own = 0
        for p, u in enumerate(uses):
            if u == tr.INF:
                continue
            if p < n and u == j:
                own += 1
            else:
                shared.append(cum[u] - cum[i + 1])
        if own:
            own_events.append((cum[j] - cum[i + 1], own))
    return sorted(own_events), sorted(shared), cum[-1]


def _concave_at(curve: list[tuple[float, float]], budget: float) -> float:
    if budget <= 0:
        return 0.0
    for (c0, h0), (c1, h1) in zip(curve, curve[1:], strict=False):
        if c0 <= budget <= c1:
            return h0 + (h1 - h0) * ((budget - c0) / (c1 - c0) if c1 > c0 else 0.0)
    return curve[-1][1]


def bound(trace: tr.Trace, capacities: Sequence[int]) -> dict:
    """Per capacity: own-block hits of uniform hold times (LRU over open sessions) and of the
    best age-only mix (hull), both with the whole budget; and `bound`, the best split of the
    budget between the own blocks (age-only hull) and every shared-block interval, the latter
    chosen *knowing* each gap (shortest first, as Belady would): an upper bound on policies
    that know whether a session goes on but not when."""
    events, shared, refs = intervals(trace)
    gaps = [g for g, _ in events]
    total = sum(s for _, s in events)
    ps, psg = [0], [0]
    for g, s in events:
        ps.append(ps[-1] + s)
        psg.append(psg[-1] + s * g)

    def point(t: int) -> tuple[float, float]:
        k = bisect.bisect_right(gaps, t)
        return psg[k] + t * (total - ps[k]), ps[k]

    ts = sorted({int(1.03 ** e) for e in range(1, 700)} | set(gaps))
    pts = [(0.0, 0.0)] + [point(t) for t in ts if t <= (gaps[-1] if gaps else 1)]
    hull: list[tuple[float, float]] = []
    for p in pts:
        while len(hull) >= 2 and ((hull[-1][1] - hull[-2][1]) * (p[0] - hull[-2][0])
                                  <= (p[1] - hull[-2][1]) * (hull[-1][0] - hull[-2][0])):
            hull.pop()
        hull.append(p)
    sh = [(0.0, 0.0)]
    for g in shared:
        sh.append((sh[-1][0] + g, sh[-1][1] + 1))
    sh = sh[::max(1, len(sh) // 4000)] + [sh[-1]]     # concave already (sorted gaps)
    out: dict = {"own_blocks": round(100 * total / refs, 2),
                 "shared_reuses": round(100 * len(shared) / refs, 2)}
    for c in capacities:
        budget = c * refs
        best = max(_concave_at(hull, budget * f / 400) + _concave_at(sh, budget * (1 - f / 400))
                   for f in range(401))
        out[str(c)] = {"uniform": round(100 * _concave_at(pts, budget) / refs, 2),
                       "hull": round(100 * _concave_at(hull, budget) / refs, 2),
                       "bound": round(100 * best / refs, 2)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", nargs="?")
    ap.add_argument("--synthetic", choices=sorted(tr.SESSION_SHAPES))
    ap.add_argument("--capacities", default="2000,5000,10000,20000")
    args = ap.parse_args(argv)
    if bool(args.trace) == bool(args.synthetic):
        ap.error("give a trace path or --synthetic KIND")
    trace = tr.synthetic(args.synthetic) if args.synthetic else tr.load_trace(args.trace)
    out = bound(trace, [int(c) for c in args.capacities.split(",")])
    for c, v in out.items():
        print(c, v)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
