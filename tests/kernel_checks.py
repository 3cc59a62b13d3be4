"""The build step of `make test`: load every compiled (numba) kernel, and fail if one does not;
and `require`, for the tests that mean a kernel.

    python -m tests.kernel_checks

Why a step of its own: the first use of a kernel compiles it into numba's on-disk cache (seconds
to tens of seconds on a loaded 2-core machine); done here once, no test pays it inside its
deadlines. And why it fails: at run time the SDK's block copy and the daemon's Get copy fall
back to numpy + xxhash when their kernel does not load (correct, slower, logged), so a broken
kernel would otherwise pass the suite on the fallback. Each kernel is run, not only imported:
numba compiles at the first call, so a kernel that imports can still fail to compile.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import pytest


def require(what: str, status: str) -> None:
    """In a test that means the compiled kernel: fail unless it loaded (`status` is the
    module's kernel_status()). KVSTORE_NO_KERNEL, a choice made on purpose, skips instead
    (and under CI no skip passes)."""
    if status == "compiled":
        return
    if os.environ.get("KVSTORE_NO_KERNEL"):
        pytest.skip(f"{what}: {status}")
    pytest.fail(f"{what} did not load, so this test would run the fallback: {status}",
                pytrace=False)


def _codecs() -> None:
    from tiers import codecs

    codecs.warm_up(("lossless", "int8", "fp8_e4m3"))


def _block_copy() -> None:
    from kvstore_client import blockcopy

    blockcopy.warm_up()


def _get_copy() -> None:
    from kvstore import getcopy

    getcopy.warm_up()
    status = getcopy.kernel_status()
    if status != "compiled":
        raise RuntimeError(status)


KERNELS: dict[str, Callable[[], None]] = {
    "codecs (tiers/codec_kernels*.py)": _codecs,
    "SDK block copy (kvstore_client/_blockcopy_kernel.py)": _block_copy,
    "daemon Get copy (kvstore/_getcopy_kernel.py)": _get_copy,
}


def main() -> int:
    failed = []
    for name, load in KERNELS.items():
        t0 = time.monotonic()
        try:
            load()
        except Exception as e:  # noqa: BLE001 - every kernel is tried, each failure named
            failed.append(f"{name}: {type(e).__name__}: {e}")
            continue
        print(f"kernel loaded: {name} ({time.monotonic() - t0:.1f} s)", flush=True)
    for line in failed:
        print(f"kernel did not load: {line}", file=sys.stderr)
    if failed:
        print("the tests of these kernels would run their fallbacks instead; fix the install "
              "(or unset KVSTORE_NO_KERNEL) before testing", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
