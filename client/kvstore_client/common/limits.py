"""The protocol's size limits, shared by the daemon's checks and the fast lane's framing.

Why here: the daemon (kvstore/server.py) refuses requests past these, and the lane
(lane_wire.py) sizes its frame cap from them; one definition keeps the two from drifting.
"""

from __future__ import annotations

MAX_KEYS = 1 << 16            # per request: a 1M-token prompt in 16-token blocks
MIN_KEY_BYTES, MAX_KEY_BYTES = 16, 32
# The largest valid request other than Put: MAX_KEYS keys (a tag and a length byte before up
# to MAX_KEY_BYTES each) and as many checksums (a uint64 varint of up to 10 bytes and a tag),
# plus the small fields (ids, lease ids, the spec) within 256 KiB: 3,211,264 bytes.
MAX_REQUEST_BYTES = MAX_KEYS * (2 + MAX_KEY_BYTES + 11) + (256 << 10)
# Leases one call may give back in passing (release_leases). The daemon ends them under its
# store lock, so without a cap one request of ~1M short ids held that lock for a second; a
# client finishes far fewer in the 50 ms a release waits to be carried, and sends the rest
# with a later call.
MAX_CARRIED_RELEASES = 1024
