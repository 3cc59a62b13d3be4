"""SGLang HiCache backend benchmark: SGLang's v1 zero-copy calls against memcpy.

Figures, each against a reference measured in the same run (the machine is shared):
  v1_set_vs_memcpy        (one tensor copy of a batch's bytes) / (batch_set_v1 of the same
                          pages from SGLang's host pool into the daemon, checksums on).
                          Target >= 1.0.
  v1_get_vs_memcpy        the same for batch_get_v1 (daemon -> host pool, checksums verified).
                          Target >= 1.0.
  batch_exists_64_p50_us  p50 of a 64-page batch_exists (one Locate round trip, promote-ahead
                          on), in microseconds.
  shm_v1_set_vs_memcpy,   the same two ratios with SGLang's shared-memory host pool
  shm_v1_get_vs_memcpy    (`"allocator": "shm"`: the pool is a memfd whose fd SGLang exports),
                          measured in the same process against its own memcpy. Target >= 1.0.
Also reported: GB/s of each path, the page size, the batch_exists p99.

SGLang runs in its environment (.venv-sglang, `make sglang-env`) through tests/sglang_runner.py,
with SGLang's own MHATokenToKVPoolHost (layer-first) and the backend built by SGLang's storage
factory; this script starts the daemon and prints the runner's figures.

Usage: .venv/bin/python bench/sglang.py [--quick]. Last line of output: one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller run, under a minute")
    ap.add_argument("--layout", default="layer_first",
                    choices=["layer_first", "page_first", "page_first_direct", "page_head"])
    args = ap.parse_args()
    py = ROOT / ".venv-sglang" / "bin" / "python"
    if not py.exists():
        sys.exit("bench/sglang.py: .venv-sglang is missing; build it with `make sglang-env`")
    sys.path.insert(0, str(ROOT))
    from tests.daemon import cleanup, start_daemon

    pages, reps = (128, 10) if args.quick else (128, 24)  # SGLang moves <= 128 pages a call
    # A page of 32 tokens x 8 layers x 4 KV heads x 128 dims, bf16, K and V: 512 KiB.
    geometry = ["--layers", "8", "--heads", "4", "--head-dim", "128", "--page", "32",
                "--capacity-pages", str(pages + 8)]
    # 128 pages of 512 KiB: a 64 MiB batch, twice the L3 cache, so memcpy is not cache-bound.
    with tempfile.TemporaryDirectory(prefix="kvs-bench-sgl-") as tmp:
        d = start_daemon(Path(tmp), {"host.capacity": "1GiB", "ssd.capacity": "1GiB",
                                     "log_level": "warning"})
        try:
            # The two pools take turns every round (one after the other, the second ran ~20%
            # slower whichever it was).
            steps = [{"op": "bench", "seed": 5, "pages": pages, "reps": reps,
                      "exists_reps": 50 if args.quick else 200,
                      "layouts": [args.layout, f"{args.layout}:shm"]}]
            env = {**os.environ,
                   "PYTHONPATH": os.pathsep.join([str(ROOT / "client"), str(ROOT)])}
            p = subprocess.run([str(py), str(ROOT / "tests" / "sglang_runner.py"),
                                "--address", d.address, "--layouts",
                                f"{args.layout},{args.layout}:shm",
                                "--steps", json.dumps(steps), *geometry],
                               capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
        finally:
            cleanup(d)
    if p.returncode != 0:
        sys.exit(f"bench/sglang.py: the runner failed:\n{p.stderr[-4000:]}")
    r = json.loads(p.stdout.strip().splitlines()[-1])
    fig, shm = r["steps"][0]
    if not r["pool_fd"][f"{args.layout}:shm"]:
        sys.exit("bench/sglang.py: SGLang's shm host pool exported no fd")
    result = {"bench": "sglang", "quick": args.quick, "layout": args.layout, **fig,
              **{f"shm_{k}": shm[k] for k in ("memcpy_gbps", "v1_set_gbps", "v1_get_gbps",
                                              "v1_set_vs_memcpy", "v1_get_vs_memcpy")}}
    for k in ("memcpy_gbps", "v1_set_gbps", "v1_get_gbps", "v1_set_vs_memcpy",
              "v1_get_vs_memcpy", "shm_v1_set_vs_memcpy", "shm_v1_get_vs_memcpy"):
        print(f"{k:24s} {result[k]:8.2f}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
