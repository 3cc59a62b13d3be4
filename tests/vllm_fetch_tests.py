"""Fetch vLLM's own offloading tests from a vLLM release's sdist on PyPI (for `make vllm-tests`).

    python3 tests/vllm_fetch_tests.py VERSION URL SHA256 DEST

Downloads the sdist, refuses it unless its sha256 is the pinned one, and extracts only
`tests/v1/kv_offload/` into DEST (an ignored folder; nothing fetched is ever committed), then
writes DEST/.fetched. Standard library only: it runs before any environment exists.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request

MEMBER = "tests/v1/kv_offload/"
DEADLINE_S = 300


def main() -> None:
    version, url, sha256, dest = sys.argv[1:5]
    prefix = f"vllm-{version}/"
    os.makedirs(os.path.dirname(os.path.abspath(dest)), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="vllm-sdist-",
                                     dir=os.path.dirname(os.path.abspath(dest))) as tmp:
        path = os.path.join(tmp, "sdist.tar.gz")
        digest = hashlib.sha256()
        with urllib.request.urlopen(url, timeout=DEADLINE_S) as r, open(path, "wb") as f:
            while chunk := r.read(1 << 20):
                digest.update(chunk)
                f.write(chunk)
        if digest.hexdigest() != sha256:
            sys.exit(f"{url}: sha256 {digest.hexdigest()}, expected {sha256}; not extracting")
        out = os.path.join(tmp, "out")
        with tarfile.open(path) as tar:
            members = [m for m in tar.getmembers()
                       if m.name.startswith(prefix + MEMBER) and (m.isfile() or m.isdir())]
            if not members:
                sys.exit(f"{url} has no {prefix}{MEMBER}")
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(out, members=members, filter="data")
        shutil.rmtree(dest, ignore_errors=True)
        shutil.move(out, dest)
    with open(os.path.join(dest, ".fetched"), "w") as f:
        f.write(f"{url}\n{sha256}\n")
    print(f"vLLM {version}: {len(members)} entries of {MEMBER} in {dest}")


if __name__ == "__main__":
    main()
