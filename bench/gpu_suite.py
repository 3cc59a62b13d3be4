"""The CUDA half's proof in one prepared run: every figure and test that needs a GPU.

Why one script: a GPU machine is at hand for this project now and then, for minutes, with no
network. So everything that needs one runs from a single command, inside a deadline (8 minutes
on an H200 by default), each step in its own process with its own share of it, and the run
leaves one JSON object behind (last stdout line, and `--out`), which docs/gpu.md records:

1. `bench/gpu.py`: the gpu tier's figures on the CPU device; host <-> device copies through
   the daemon's pinned pools against plain pinned copies (`h2d_vs_pinned`, `d2h_vs_pinned`);
   the IPC gather into an engine's paged cache against a device-to-device copy, one engine
   process (`ipc_gather_vs_d2d`, per launch mode) and two at once (`ipc_gather_2proc_vs_d2d`).
2. `bench/hf_gpu.py`: an HF transformers Llama (~1B parameters, random weights, bf16) reusing
   an 8k-token prefix another process stored through the gpu tier, against recomputing it
   (`hf_gpu_ttft_speedup_8k`, `hf_gpu_outputs_equal`), with its forwards as CUDA graphs and
   eager (`hf_gpu_speedup_graphs`, `hf_gpu_speedup_eager`).
3. The CUDA tests (`pytest -m cuda`): passed, failed and skipped counts, failures by name.
4. `bench/gpu_gather_phases.py`: where the gather's time goes per launch mode (diagnostic).

Without a CUDA device it prints one line saying so and exits 0 (CI runs it that way).

Usage: python bench/gpu_suite.py [--out FILE] [--deadline-s 480] [--quick]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CUDA_TESTS = ["tests/test_gpu_tier.py", "tests/test_payload_versions.py",
              "tests/test_tenant_cuda.py"]
# (name, argv after the interpreter, the most seconds it may take)
STEPS: list[tuple[str, list[str], int]] = [
    ("gpu", ["bench/gpu.py"], 200),
    ("hf_gpu", ["bench/hf_gpu.py", "--tokens", "8192"], 220),
    ("tests", ["-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "cuda",
               *CUDA_TESTS], 240),
    ("phases", ["bench/gpu_gather_phases.py"], 90),
]
TARGETS = {"ipc_gather_vs_d2d": 0.8, "ipc_gather_2proc_vs_d2d": 0.8, "h2d_vs_pinned": 0.8,
           "d2h_vs_pinned": 0.8, "hf_gpu_ttft_speedup_8k": 5.0, "hf_gpu_outputs_equal": True,
           "cuda_tests_failed": 0}


def _cuda_device() -> str | None:
    """The device's name, or None without CUDA (checked in a child: this process stays
    free of CUDA state, and without a driver it never imports torch)."""
    sys.path.insert(0, str(ROOT / "client"))
    from kvstore_client.common.cuda_runtime import cuda_available

    if not cuda_available():
        return None
    import torch

    return str(torch.cuda.get_device_name(0))


def _last_json(text: str) -> dict[str, Any] | None:
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _pytest_counts(text: str) -> dict[str, Any]:
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)", text)}
    return {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0),
            "skipped": counts.get("skipped", 0), "errors": counts.get("error", 0),
            "failures": re.findall(r"^(?:FAILED|ERROR) (\S+)", text, re.M)[:20],
            "skips": re.findall(r"^SKIPPED .*$", text, re.M)[:20]}


def run_step(name: str, argv: list[str], limit_s: float, env: dict[str, str]) -> dict[str, Any]:
    t = time.monotonic()
    try:
        p = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=limit_s)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc = "timeout"
        out = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr or ""
    step: dict[str, Any] = {"rc": rc, "seconds": round(time.monotonic() - t, 1)}
    if name == "tests":
        step.update(_pytest_counts(out))
    else:
        step["result"] = _last_json(out)
    if rc != 0:
        step["tail"] = (out[-1500:] + "\n--- stderr ---\n" + err[-2500:]).strip()
    print(f"[{name}] rc {rc} in {step['seconds']} s", file=sys.stderr)
    return step


def figures(steps: dict[str, dict[str, Any]]) -> dict[str, Any]:
    gpu = steps.get("gpu", {}).get("result") or {}
    hf = steps.get("hf_gpu", {}).get("result") or {}
    tests = steps.get("tests", {})
    out = {k: gpu.get(k) for k in ("ipc_gather_vs_d2d", "ipc_gather_2proc_vs_d2d",
                                   "ipc_gather_launch", "ipc_gather_exact", "h2d_vs_pinned",
                                   "d2h_vs_pinned", "ipc_gather_kernel_vs_d2d",
                                   "gpu_tier_gather_vs_memcpy", "gpu_demote_vs_memcpy",
                                   "gpu_promote_vs_memcpy")}
    out.update({k: hf.get(k) for k in ("hf_gpu_ttft_speedup_8k", "hf_gpu_outputs_equal",
                                       "hf_gpu_kv_equal", "hf_gpu_ttft_reuse_ms",
                                       "hf_gpu_ttft_recompute_ms")})
    out["hf_gpu_engine"] = hf.get("engine")
    out["hf_gpu_speedup_eager"] = (hf.get("eager") or {}).get("speedup")
    out["hf_gpu_speedup_graphs"] = (hf.get("graphs") or {}).get("speedup")
    if "passed" in tests:
        out["cuda_tests_passed"] = tests["passed"]
        out["cuda_tests_failed"] = tests["failed"] + tests["errors"]
        out["cuda_tests_skipped"] = tests["skipped"]
    return out


def met(figs: dict[str, Any]) -> dict[str, bool]:
    res = {}
    for k, want in TARGETS.items():
        got = figs.get(k)
        if isinstance(want, bool):
            res[k] = got is want
        elif k == "cuda_tests_failed":
            res[k] = got == 0 and figs.get("cuda_tests_passed", 0) > 0
        else:
            res[k] = isinstance(got, (int, float)) and got >= want
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="also write the JSON object here")
    ap.add_argument("--deadline-s", type=float, default=480.0,
                    help="the whole run's deadline; each step gets what is left, at most its own")
    ap.add_argument("--quick", action="store_true", help="fewer repetitions in the benches")
    ap.add_argument("--only", nargs="*", help="run only these steps: " +
                    ", ".join(s[0] for s in STEPS))
    args = ap.parse_args()
    device = _cuda_device()
    if device is None:
        out: dict[str, Any] = {"bench": "gpu_suite", "cuda": "skipped: no CUDA device"}
        print(json.dumps(out))
        if args.out:
            args.out.write_text(json.dumps(out) + "\n")
        return 0
    import torch

    start = time.monotonic()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "client")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    steps: dict[str, dict[str, Any]] = {}
    for name, argv, limit in STEPS:
        if args.only and name not in args.only:
            continue
        left = args.deadline_s - (time.monotonic() - start)
        if left < 20:
            steps[name] = {"rc": "not run: the deadline was spent"}
            continue
        if args.quick and name in ("gpu", "hf_gpu"):
            argv = [*argv, "--quick"]
        steps[name] = run_step(name, argv, min(limit, left), env)
    figs = figures(steps)
    out = {"bench": "gpu_suite", "device": device, "torch": torch.__version__,
           "cuda": torch.version.cuda, "python": sys.version.split()[0],
           "date": dt.date.today().isoformat(), "seconds": round(time.monotonic() - start, 1),
           **figs, "targets": TARGETS, "targets_met": met(figs), "steps": steps}
    text = json.dumps(out)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
