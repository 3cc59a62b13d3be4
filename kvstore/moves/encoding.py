"""Blocks as keyed tiers store them: encoding on the way down, decoding on the way up.

Every path that writes a block to a keyed tier (host->SSD, host->remote, SSD->remote,
gpu->SSD) encodes it here, on the host, with the compiled codecs (tiers/codecs/), so one codec
name always gives one payload version whatever the block came from. The codec fallback rule
lives here too: a lossy codec that refuses a block (inf/NaN) stores it lossless instead, and
the refusal is counted.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import xxhash
from kvstore_client.common.errors import DataLoss
from kvstore_client.common.layout import KVLayout
from kvstore_client.common.lazy import lazy_module

from tiers import frame

from ..index import Entry
from ..state import StoreState
from ..verify import matches
from .common import Workers

if TYPE_CHECKING:
    import numpy as np

    from tiers import codecs
else:   # imported by the first block that moves, not before the daemon is ready
    np = lazy_module("numpy", globals(), "np")
    codecs = lazy_module("tiers.codecs", globals(), "codecs")

LOSSY = ("fp8_e4m3", "int8")
ERROR_SAMPLE_EVERY = 32     # one lossy block in this many is decoded again to measure its error

# What one encode needs, taken under the lock: the block's bytes (a host slot's view or a
# private copy), layout, codec, whether to sample the codec's error, and the checksum the bytes
# must match before they are encoded (None: not checked).
EncodeJob = tuple


def encode_block(raw: np.ndarray, layout: KVLayout, codec: str, counters: Counter,
                 sample_error: bool = False) -> bytes:
    """Framed value for a keyed tier (ssd, remote); with `sample_error`, a lossy codec's error on
    this block is measured into the counters (callers sample one block in ERROR_SAMPLE_EVERY)."""
    try:
        payload = codecs.encode(codec, raw, layout)
    except codecs.NonFiniteBlock:
        counters["lossy_refused_nonfinite"] += 1
        codec = "lossless"
        payload = codecs.encode(codec, raw, layout)
    value = frame.frame(codec, len(raw), payload)
    counters[f"codec_in_bytes_{codec}"] += len(raw)
    counters[f"codec_out_bytes_{codec}"] += len(value)
    if codec in LOSSY and sample_error:
        _sample_error(raw, payload, layout, codec, counters)
    counters[f"codec_blocks_{codec}"] += 1
    return value


def _sample_error(raw: np.ndarray, payload, layout: KVLayout, codec: str,
                  counters: Counter) -> None:
    """Element-wise relative error ‖x̂−x‖/‖x‖ of one block, summed for the metrics' mean."""
    out = np.empty_like(raw)
    codecs.decode(codec, payload, layout, out)
    # numpy alone: torch imported here would stall the request that demoted (seconds).
    err = codecs.relative_error(codecs.as_float32(raw, layout.dtype),
                                codecs.as_float32(out, layout.dtype))
    counters[f"codec_error_sum_{codec}"] += err
    counters[f"codec_error_samples_{codec}"] += 1


def decode_block(value: bytes | memoryview | tuple, layout: KVLayout, out: np.ndarray,
                 checksum: int | None) -> str:
    """Decode a framed value into `out` and return the codec it was stored with; DataLoss when
    it does not decode or verify.

    A lossless block must reproduce the checksum taken when it was first stored; lossy blocks
    cannot, so the frame's own checksum (over the encoded payload) is what guards them.
    """
    # A keyed tier may hand over an already verified (codec, raw_len, payload, ...) tuple.
    codec, raw_len, payload = value[:3] if isinstance(value, tuple) else frame.unframe(value)
    if raw_len != len(out):
        raise DataLoss(f"stored block is {raw_len} bytes, the namespace expects {len(out)}")
    codecs.decode(codec, payload, layout, out)
    if checksum and codec not in LOSSY and xxhash.xxh3_64_intdigest(out) != checksum:
        raise DataLoss("block decoded but its checksum does not match the one stored")
    return codec


class Encoder:
    """Encodes batches of blocks on the shared worker pool (zstd and torch release the GIL).

    Encoding, not the disk, is the slow part of demotion (about 0.4 GB/s a core for lossless),
    so a batch is spread over the workers. Jobs are made under the lock (`jobs`), encoded
    without it (`encode`), and their counters added under it again by the caller.
    """

    def __init__(self, state: StoreState, workers: Workers) -> None:
        self.state = state
        self.workers = workers
        self._encoded = 0           # blocks encoded, to sample one in ERROR_SAMPLE_EVERY

    def job(self, e: Entry, data: object, checksum: int | None) -> EncodeJob:
        """An encode job for block `e` over `data` (locked)."""
        self._encoded += 1
        spec = self.state.namespaces[e.ns_id].spec
        return (data, spec.layout, spec.codec, self._encoded % ERROR_SAMPLE_EVERY == 1, checksum)

    def host_jobs(self, entries: list[Entry]) -> list[EncodeJob]:
        """Jobs over host copies (locked): the slot's view and, where host.verify_reads is on,
        the checksum its private copy must match."""
        verify = self.state.config.host.verify_reads
        host = self.state.host
        return [self.job(e, host.view(e.host, e.size), e.checksum if verify else None)
                for e in entries]

    def encode(self, jobs: list[EncodeJob]) -> tuple[list[bytes | None], Counter]:
        """Encode jobs in parallel; needs no lock. Returns the values (None for a block whose
        bytes fail their checksum: the caller drops it) and the codec counters, for the caller
        to add under the lock."""
        def one(job: EncodeJob) -> tuple[bytes | None, Counter]:
            view, layout, codec, sample, checksum = job
            local: Counter = Counter()
            if checksum is not None:
                # A private copy first: the slot is client-writable (kvstore/verify.py).
                view = np.array(view)
                if not matches(view, checksum):
                    return None, local
            return encode_block(view, layout, codec, local, sample), local

        done = self.workers.parallel(one, jobs)
        total: Counter = Counter()
        for _, local in done:
            total.update(local)
        return [v for v, _ in done], total
