"""The gRPC call a handler thread is serving, so that a long call ends when its client does.

Why: Flush and Evict end at `limits.request_deadline_s` of their start. A client that set a
shorter deadline, or went away, used to leave them running until then: a gRPC worker and the
tenant's one Flush stayed taken, and the client's retry was refused as "already running". The
servicer records each call's context here for the length of the handler (a thread-local: a
handler runs on one pool thread from start to end), and the long handlers bound their work by
the client's deadline and presence as well as their own. A lane call has no gRPC context: its
bounds are the daemon's alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

_current = threading.local()


@contextmanager
def serving(context: Any) -> Iterator[None]:
    """Mark `context` as the call this thread serves until the block ends."""
    _current.context = context
    try:
        yield
    finally:
        _current.context = None


def bounds(own_s: float) -> tuple[float, Callable[[], bool] | None]:
    """(absolute deadline in time.monotonic(), `cancelled()` or None) of a long call: the
    earlier of `own_s` from now and the client's own deadline; `cancelled()` is true once the
    client went away or the call was ended (the gate's deadline included)."""
    deadline = time.monotonic() + own_s
    context = getattr(_current, "context", None)
    if context is None:
        return deadline, None
    try:
        left = context.time_remaining()
    except Exception:  # noqa: BLE001 - a context without one: the daemon's bound alone
        left = None
    if left is not None:
        deadline = min(deadline, time.monotonic() + max(0.0, float(left)))
    return deadline, lambda: not context.is_active()
