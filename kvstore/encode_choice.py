"""Whether a demotion to SSD compresses a lossless namespace's block or stores it as it is.

Why: lossless compression buys only SSD room (about 1.3-1.45x on bf16 KV) and costs an encode
that on a busy machine ran at 0.15-0.34 GB/s (zstd on the exponent plane) against a disk that
writes 1.3-2.4 GB/s. Demotion is on a spilling engine's critical path and on a stop's flush,
so compressing there made both 3-10x slower than the disk. In "auto" mode a block is
compressed only while compressing does not slow demotion down: the measured encode rate of
the worker threads, E, and the measured SSD write rate, D, with the measured compressed
fraction r, must satisfy 1/E + r/D <= 1/D (encode then write the smaller value is no slower
than writing the block as it is). Otherwise the block is stored `raw`: framed and checksummed
like every value, read back with no decoding. Lossy codecs are always applied: an operator
picks them for room and accepts their error.

While it stores raw, a copy of one block in a while (every PROBE_S) is compressed on a worker
thread and timed, off the demotion's path, so a codec or a machine that becomes fast enough is
noticed; a fresh store starts storing raw until the first probe says otherwise.
"""

from __future__ import annotations

import time

PROBE_S = 5.0           # while storing raw, compress one block at most this often to re-measure
_ALPHA = 0.3            # weight of a new measurement in the running averages


class EncodeChoice:
    """Running measurements of encode and SSD write speed, and the decision they imply.

    Not locked: the store calls it under its own lock (a stale read only delays a switch).
    """

    def __init__(self, mode: str, threads: int) -> None:
        """mode: "auto", "always" or "never" (config ssd.compress); threads: how many encode
        in parallel (a probe times one block on one thread and scales by this)."""
        self.mode = mode
        self.threads = max(1, threads)
        self.encode_bps: float | None = None   # input bytes per second, all threads
        self.write_bps: float | None = None    # bytes written per second (payload + sync)
        self.ratio = 0.75                      # compressed bytes / input bytes
        self._last_probe = -1e18

    def compress(self, codec: str) -> bool:
        """Whether this namespace's blocks are encoded with `codec` for SSD now."""
        if codec != "lossless" or self.mode == "always":
            return True
        if self.mode == "never" or self.encode_bps is None or self.write_bps is None:
            return False
        return 1 / self.encode_bps + self.ratio / self.write_bps <= 1 / self.write_bps

    def probe(self) -> bool:
        """While not compressing in auto mode: whether to compress one block now to measure."""
        now = time.monotonic()
        if self.mode != "auto" or now - self._last_probe < PROBE_S:
            return False
        self._last_probe = now
        return True

    def note_encode(self, in_bytes: int, out_bytes: int, seconds: float, one_thread: bool
                    ) -> None:
        """An encode of `in_bytes` to `out_bytes` took `seconds` of wall time (on one thread,
        or spread over the workers)."""
        if in_bytes <= 0 or seconds <= 0:
            return
        rate = in_bytes / seconds * (self.threads if one_thread else 1)
        self.encode_bps = _avg(self.encode_bps, rate)
        self.ratio = _avg(self.ratio, out_bytes / in_bytes)

    def note_write(self, nbytes: int, seconds: float) -> None:
        """`nbytes` were written to SSD (and synced) in `seconds`."""
        if nbytes > 0 and seconds > 0:
            self.write_bps = _avg(self.write_bps, nbytes / seconds)

    def describe(self) -> dict:
        return {"mode": self.mode, "encode_gbps": _gb(self.encode_bps),
                "write_gbps": _gb(self.write_bps), "ratio": round(self.ratio, 3),
                "compressing": self.compress("lossless")}


def _avg(old: float | None, new: float) -> float:
    return new if old is None else (1 - _ALPHA) * old + _ALPHA * new


def _gb(x: float | None) -> float | None:
    return None if x is None else round(x / 1e9, 3)
