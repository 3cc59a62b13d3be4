"""What the daemon loads once it is serving, so no call pays for it: compiled kernels, and one
intra-op thread for torch.

Why after SERVING and not before: a start must reach SERVING at gRPC-server speed (an engine
waits for it), and each of these takes from a fraction of a second to seconds (numba loading
its on-disk cache, or compiling in a fresh checkout). Each is best effort: a failure only logs,
and the thing loads on first use instead.
"""

from __future__ import annotations

import logging
import sys
import threading
import time

log = logging.getLogger("kvstore.daemon")


def one_torch_thread() -> None:
    """One intra-op thread per torch call: the store runs codecs on its own worker threads.

    torch's own pool on top of ours oversubscribed the cores; with any neighbour busy, single
    codec ops ran 10-100x slower. torch itself is not imported here: a daemon whose namespaces
    never quantize never loads it (tiers/torch_threads.py); the codecs apply this on import.
    """
    from tiers import torch_threads

    torch_threads.TORCH_THREADS = 1
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)


def warm_codecs(stop: threading.Event) -> None:
    """Load the compiled codec kernels (numba: from its on-disk cache, or a compile of several
    seconds in a fresh checkout) after the daemon is ready, so the first demotion or Evict does
    not wait for them inside its deadline. Failure only logs: the codecs load on first use.
    A stop ends it between codecs: the stop's flush would otherwise share the cores and the
    GIL with compiles nothing will use."""
    try:
        t0 = time.monotonic()
        from tiers.codecs import warm_up
        for name in ("lossless", "int8"):
            if stop.is_set():
                return
            warm_up((name,))
        log.info("codec kernels loaded in %.1f s", time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - best effort, off the serving path
        log.warning("codec warm-up failed (they load on first use instead): %s", e)


def warm_get() -> None:
    """Load Get's copy-and-check kernel (kvstore/getcopy.py) after the daemon is ready, so the
    first Get does not pay numba's import and cache load (or a compile in a fresh checkout)."""
    try:
        from . import getcopy
        getcopy.warm_up()
    except Exception as e:  # noqa: BLE001 - best effort, off the serving path
        log.warning("Get kernel warm-up failed (it loads on first use instead): %s", e)
