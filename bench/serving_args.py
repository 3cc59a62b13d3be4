"""The serving benchmark's command line (bench/serving.py) and the defaults it names."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.serving_fleet import SETUPS
from bench.serving_replay import IN_FLIGHT

MODEL = {"layers": 4, "hidden": 1024, "heads": 16, "kv_heads": 2}
TOKENS_PER_BLOCK = 128          # per 512-token trace block
GAP_S = 0.1                     # between requests
DRY_GAP_S = 0.02                # stand-ins announce a request's blocks before they answer it
TIME_SCALE = 100.0              # --in-flight trace: trace seconds per replay second
NODES = 2


def parse_args(argv: list[str] | None, description: str, root: Path) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="fewer conversations (a few minutes)")
    ap.add_argument("--dry-run", action="store_true",
                    help="the harness with stand-in engines: seconds, no figure that means "
                    "anything")
    ap.add_argument("--workload-only", action="store_true",
                    help="build and describe the workload only; start nothing")
    ap.add_argument("--setups", default=",".join(s.name for s in SETUPS),
                    help="comma-separated subset of: " + ", ".join(s.name for s in SETUPS))
    ap.add_argument("--trace", default="", help="the Mooncake conversation trace (file or "
                    "folder; default: $KVS_TRACES_DIR, else shared/traces beside the checkout)")
    ap.add_argument("--conversations", type=int, default=0,
                    help="conversations replayed (default 6 with --quick, else 10)")
    ap.add_argument("--turns", type=int, default=8, help="turns replayed per conversation")
    ap.add_argument("--tokens-per-block", type=int, default=TOKENS_PER_BLOCK,
                    help="prompt tokens per 512-token trace block")
    ap.add_argument("--gap-ms", type=float, default=None,
                    help=f"pause between requests (default {GAP_S * 1000:.0f}, "
                    f"{DRY_GAP_S * 1000:.0f} in a dry run)")
    ap.add_argument("--in-flight", choices=IN_FLIGHT, default="one",
                    help="one: one request at a time, --gap-ms after each answer; trace: "
                    "each at its trace arrival time / --time-scale, after its conversation's "
                    "previous answer and --gap-ms, overlapping (bench/serving_replay.py)")
    ap.add_argument("--time-scale", type=float, default=TIME_SCALE,
                    help=f"--in-flight trace: the trace's time compression (default "
                    f"{TIME_SCALE:g})")
    ap.add_argument("--engine-threads", type=int, default=None,
                    help="OMP_NUM_THREADS of each engine, 0 for torch's own (one a core; "
                    "default with --in-flight one); default with --in-flight trace: 1")
    ap.add_argument("--restart-node", type=int, default=-1,
                    help="the node whose engine restarts mid-run (default: the one that "
                    "served the most requests until then)")
    ap.add_argument("--vllm-python", default=str(root / ".venv-vllm" / "bin" / "python"))
    ap.add_argument("--router-bin", default=str(root / ".venv-routers" / "bin" / "vllm-router"))
    ap.add_argument("--redis-server", default="redis-server")
    ap.add_argument("--model-dir", default="", help="the random model's folder (default: "
                    "bench/out/serving-model-<size>, made once)")
    ap.add_argument("--model-size", default="",
                    help="LAYERSxHIDDEN of the random model (default "
                    f"{MODEL['layers']}x{MODEL['hidden']}; heads = hidden / 64)")
    ap.add_argument("--out", default="", help="folder for the plot, the per-request records "
                    "and the logs (default bench/out/serving, bench/out/serving-dry for a dry "
                    "run)")
    args = ap.parse_args(argv)
    args.model = dict(MODEL)
    if args.model_size:
        try:
            layers, hidden = (int(x) for x in args.model_size.lower().split("x"))
        except ValueError:
            ap.error(f"--model-size: expected LAYERSxHIDDEN, got {args.model_size!r}")
        if layers < 1 or hidden < 64 or hidden % 64:
            ap.error("--model-size: at least one layer, hidden a multiple of 64")
        args.model.update(layers=layers, hidden=hidden, heads=hidden // 64)
    if not args.conversations:
        args.conversations = 6 if args.quick else 10
    if not args.out:
        args.out = str(root / "bench" / "out" / ("serving-dry" if args.dry_run else "serving"))
    if args.gap_ms is None:
        args.gap_ms = (DRY_GAP_S if args.dry_run else GAP_S) * 1000
    known = {s.name for s in SETUPS}
    args.setup_list = [s for s in args.setups.split(",") if s]
    bad = [s for s in args.setup_list if s not in known]
    if bad or not args.setup_list:
        ap.error(f"unknown setups {bad}; choose from {sorted(known)}")
    if args.engine_threads is None:
        # overlapping requests keep both engines computing at once: with a thread a core
        # each, their OpenMP threads spin against each other on the same cores
        args.engine_threads = 1 if args.in_flight == "trace" else 0
    if args.engine_threads < 0:
        ap.error("--engine-threads must be >= 0")
    if not args.time_scale > 0:
        ap.error("--time-scale must be positive")
    if not -1 <= args.restart_node < NODES:
        ap.error(f"--restart-node must be 0..{NODES - 1} (or -1: the busiest)")
    return args
