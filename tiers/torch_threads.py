"""How many intra-op threads torch gets in this process when a codec first imports it.

Why a setting of its own: the daemon runs codecs on its own worker threads, and torch's pool
on top of those oversubscribed the cores (single codec ops ran 10-100x slower with any
neighbour busy), so the daemon sets 1 at start. torch itself is imported only by the codecs that
need it (tiers/codecs/lossy_torch.py), which apply this on import; keeping the setting outside
tiers/codecs/ lets the daemon set it without loading the codecs at start.
"""

from __future__ import annotations

TORCH_THREADS: int | None = None     # None: torch's default
