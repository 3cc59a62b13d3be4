"""The serving benchmark's records and figures: per setup, per request, and as ratios to
round-robin without kvstore, with the targets; and the TTFT plot.

Why figures are computed from per-request records and not from the engines' counters: the
counters include the warm-ups and die with a restarted engine, while the response's usage says
exactly what each measured request prefilled.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.serving_fleet import Setup
from bench.serving_workload import Request


@dataclass
class Record:
    index: int
    conversation: int
    turn: int
    node: int
    after_restart: bool
    ttft_ms: float
    latency_ms: float
    prompt_tokens: int
    cached_tokens: int
    tokens: list[int]
    router_credited_tokens: int | None = None   # kv_aware: the prefix its events credited
    sent_s: float = 0.0         # since the replay started, the restart left out
    done_s: float = 0.0
    due_s: float = 0.0          # when the schedule wanted it sent


@dataclass
class SetupRun:
    setup: Setup
    records: list[Record] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=dict)
    events_before_restart: dict[str, dict[str, int]] = field(default_factory=dict)
    events: dict[str, dict[str, int]] = field(default_factory=dict)
    start_s: list[float] = field(default_factory=list)      # engine starts, seconds
    wall_s: float = 0.0
    restarted_node: int = -1
    loadavg: list[float] = field(default_factory=list)     # 1-min, replay start and end
    replay_s: float = 0.0       # the replay's wall time, the restart left out
    max_in_flight: int = 0



def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def setup_figures(run: SetupRun, nodes: int) -> dict[str, Any]:
    recs = run.records
    after = [r for r in recs if r.after_restart]
    ttft = [r.ttft_ms for r in recs]
    c = run.counters
    return {
        "ttft_p50_ms": round(_pct(ttft, 50), 1),
        "ttft_p90_ms": round(_pct(ttft, 90), 1),
        "prefill_tokens": sum(r.prompt_tokens - r.cached_tokens for r in recs),
        "cached_tokens": sum(r.cached_tokens for r in recs),
        # one in flight: requests / the sum of their latencies, the rate of a fleet that
        # serves one at a time; overlapping: requests / the replay's wall time
        "rps": round(len(recs) / (sum(r.latency_ms for r in recs) / 1000 if
                                  run.max_in_flight <= 1 else run.replay_s), 3),
        "replay_s": round(run.replay_s, 1),
        "max_in_flight": run.max_in_flight,
        "late_p50_ms": round(_pct([max(r.sent_s - r.due_s, 0) * 1000 for r in recs], 50), 1),
        "ttft_p50_after_restart_ms": round(_pct([r.ttft_ms for r in after], 50), 1),
        "prefill_tokens_after_restart": sum(r.prompt_tokens - r.cached_tokens for r in after),
        "router_credited_tokens": (sum(r.router_credited_tokens or 0 for r in recs)
                                   if any(r.router_credited_tokens is not None for r in recs)
                                   else None),
        # requests for which the router logged no decision of their node and prompt length:
        # 0 unless the node attribution is wrong
        "router_unmatched": (sum(r.router_credited_tokens is None for r in recs)
                             if run.setup.policy == "kv_aware" else None),
        "gpu_hit_tokens": int(c.get("prompt_tokens_local_cache_hit", 0)),
        "tier_hit_tokens": int(c.get("prompt_tokens_external_kv_transfer", 0)),
        "computed_tokens": int(c.get("prompt_tokens_local_compute", 0)),
        "kvstore_loaded_chunks": int(c.get("kvstore_loaded_chunks", 0)),
        "requests_per_node": [sum(r.node == i for r in recs) for i in range(nodes)],
        "restarted_node": run.restarted_node,
        "events": run.events,
        "events_before_restart": run.events_before_restart,
        "engine_start_s": run.start_s,
        "loadavg": run.loadavg,
        "wall_s": run.wall_s,
    }


RATIOS = (("ttft_p50", "ttft_p50_ms"), ("ttft_p90", "ttft_p90_ms"),
          ("prefill_tokens", "prefill_tokens"), ("rps", "rps"))
TARGETS = (("kv_aware_ttft_p50_vs_rr_kvstore", 0.5), ("kv_aware_ttft_p50_vs_rr_none", 0.3),
           ("kv_aware_prefill_tokens_vs_rr_none", 0.3),
           ("kv_aware_ttft_p50_vs_vllm_native", 1.0))


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b else None


def report(runs: list[SetupRun], nodes: int, restart_at: int, requests: int
           ) -> dict[str, Any]:
    """Every setup's figures, keyed `<setup>_<figure>`, each as a ratio to `rr_none`, the
    kv_aware comparisons the targets name, whether every setup generated the same tokens,
    and which targets were met."""
    figs = {r.setup.name: setup_figures(r, nodes) for r in runs}
    out: dict[str, Any] = {}
    for name, f in figs.items():
        for k, v in f.items():
            out[f"{name}_{k}"] = v
    base = figs.get("rr_none")
    for name, f in figs.items():
        if base is None or name == "rr_none":
            continue
        for label, key in RATIOS:
            out[f"{name}_{label}_vs_rr_none"] = _ratio(f[key], base[key])
    kv = figs.get("kv_aware")
    for other in ("rr_kvstore", "vllm_native"):
        if kv is not None and other in figs:
            out[f"kv_aware_ttft_p50_vs_{other}"] = _ratio(kv["ttft_p50_ms"],
                                                         figs[other]["ttft_p50_ms"])
            out[f"kv_aware_ttft_p50_after_restart_vs_{other}"] = _ratio(
                kv["ttft_p50_after_restart_ms"], figs[other]["ttft_p50_after_restart_ms"])
    outputs = [[r.tokens for r in run.records] for run in runs]
    out["outputs_equal"] = all(o == outputs[0] for o in outputs)
    # requests whose greedy tokens differ between setups (batching may change them)
    out["outputs_differ_requests"] = sum(len({tuple(o[i]) for o in outputs}) > 1
                                         for i in range(min(map(len, outputs), default=0)))
    met = {k: out.get(k) is not None and out[k] <= bound for k, bound in TARGETS
           if k in out}
    out["targets_met"] = met
    out["restart_before_request"] = restart_at
    out["requests_after_restart"] = requests - restart_at
    return out


def plot(runs: list[SetupRun], requests: list[Request], restart_at: int, path: Path
         ) -> Path | None:
    """TTFT per turn (median over conversations) and per request, every setup; None without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    turns = max(r.turn for r in requests) + 1
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2))
    for run in runs:
        by_turn = [statistics.median([r.ttft_ms for r in run.records if r.turn == t] or [0])
                   for t in range(turns)]
        left.plot(range(1, turns + 1), by_turn, marker="o", label=run.setup.name)
        right.plot([r.index for r in run.records], [r.ttft_ms for r in run.records],
                   marker=".", linewidth=0.8, label=run.setup.name)
    left.set_xlabel("turn of the conversation")
    left.set_ylabel("TTFT, median over conversations (ms)")
    left.set_yscale("log")
    left.legend(fontsize=8)
    right.axvline(restart_at - 0.5, color="grey", linestyle="--")
    right.text(restart_at - 0.3, 0.02, " an engine restarted",
               color="grey", fontsize=8, transform=right.get_xaxis_transform(), va="bottom")
    right.set_xlabel("request (replay order)")
    right.set_ylabel("TTFT (ms)")
    right.set_yscale("log")
    fig.suptitle(f"{len(requests)} requests, {len({r.conversation for r in requests})}"
                 " conversations of the Mooncake trace, 2 nodes, vllm-router")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
