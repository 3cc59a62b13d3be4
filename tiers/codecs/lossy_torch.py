"""Lossy codecs `int8` and `fp8_e4m3`: scaled quantization in torch, so it runs on any device.

Why torch: the same code quantizes a block on the GPU before its device-to-host copy (half the
bytes cross PCIe) and on the CPU for host→SSD demotion, where torch's vectorized, multi-threaded
elementwise kernels run at several GB/s. Everything is whole-block tensor code: no loop over
tokens or elements.

Scaling (chosen by measurement on real MiniLM KV, docs/codecs.md):
- Keys carry outlier channels, so K is scaled per channel: one scale per (layer, head, head-dim
  channel) over the block's tokens. For FP8 the channel is also centred first (offset = midrange),
  because outlier channels are mostly a large constant offset and FP8's error is relative to the
  magnitude it stores.
- Values: INT8 per token (one scale per layer, token and head; KIVI-style), which measured both
  more accurate and smaller than per channel on real KV; FP8 per channel (per token was no
  better). INT8 stays symmetric (no offsets).
- Scales and offsets are stored as bfloat16: fp32's exponent range (so no block is out of range)
  in 2 bytes. Quantization uses the stored (rounded) value, so rounding a scale only changes the
  grid by <0.4%, never the correctness; results are then clamped to the code range.
- Non-finite input raises NonFiniteBlock (the store then keeps the block lossless).

Payload (little-endian), after the frame header:
    0  u8   version (1)
    1  u8   flags: bit 0 = everything after this 8-byte header is one zstd frame;
                   bit 1 = side info is float32 (else bfloat16)
    2  u8   K mode: bits 0-1 group (0 = per channel [L,H,D], 1 = per token [L,T,H]);
                    bit 2 = offsets present
    3  u8   V mode: same
    4  u32  side-info bytes
    8  ...  side info: K scales, K offsets?, V scales, V offsets? (each group-shaped, C order)
    then    body: one code byte per element, [L, 2, T, H, D] (int8 two's complement / e4m3fn)
"""

from __future__ import annotations

import struct
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import zstandard as zstd
from kvstore_client.common.errors import DataLoss, InvalidArgument
from kvstore_client.common.layout import KVLayout

from .. import torch_threads
from .common import NonFiniteBlock, cctx, check_block, scratch, zstd_decompress_into

if torch_threads.TORCH_THREADS is not None:
    torch.set_num_threads(torch_threads.TORCH_THREADS)

VERSION = 2               # writes 2 when a block has sink keys kept exact, else 1
VERSIONS = (1, 2)
F_ZSTD = 1
F_SIDE_F32 = 2
F_EXACT = 4               # v2: a bitmap of exact keys and their raw values follow the codes
SINK_RATIO = 0.3          # a (layer, token, head) whose |v| < SINK_RATIO x the block's median
CHANNEL, TOKEN = 0, 1
M_OFFSET = 4
_HDR = struct.Struct("<BBBBI")
HEADER_BYTES = _HDR.size

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}


@dataclass(frozen=True)
class QuantScheme:
    """How one lossy codec scales K and V; the defaults are the measured best (docs/codecs.md)."""

    kind: str                 # "int8" | "fp8_e4m3"
    k_group: int = CHANNEL
    k_offset: bool = False
    v_group: int = CHANNEL
    v_offset: bool = False
    side_f32: bool = False    # store scales/offsets as float32 (only to measure bf16's cost)
    compress: bool = True     # zstd the payload when it pays
    exact_sinks: bool = True  # keep attention-sink keys exact (v2 payloads; see sink_mask)


SCHEMES: dict[str, QuantScheme] = {
    # zstd on INT8 codes saved only ~4% on real KV for ~40% of the encode time: off. On FP8 codes
    # (sign/exponent bits are skewed) it saves ~17% and keeps 16-token blocks under 0.55x: on.
    # INT8 zstds too: that pays for the exact sink keys (size stays <= 0.55x).
    "int8": QuantScheme("int8", v_group=TOKEN),
    "fp8_e4m3": QuantScheme("fp8_e4m3", k_offset=True),
}


def _group_shape(layout: KVLayout, group: int) -> tuple[int, ...]:
    L, _, T, H, D = layout.block_shape
    return (L, 1, H, D) if group == CHANNEL else (L, T, H, 1)


def side_elements(layout: KVLayout, s: QuantScheme) -> int:
    n = 0
    for group, off in ((s.k_group, s.k_offset), (s.v_group, s.v_offset)):
        g = int(np.prod(_group_shape(layout, group)))
        n += g * (2 if off else 1)
    return n


def _work(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """Scratch tensor: reused per thread on CPU (no page faults), fresh on accelerators."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(scratch(name, nbytes)).view(dtype).view(shape)


def _fp8_to_half(codes: torch.Tensor) -> torch.Tensor:
    """e4m3fn code bytes -> float16 equal to value * 2**-8, by bit arithmetic.

    Why: torch's own fp8 -> float conversion runs at ~0.8 GB/s on CPU (docs/performance.md).
    Placing the e4m3 exponent/mantissa bits into an fp16 word gives value * 2**-8 for normals
    and subnormals alike (both formats' subnormal grids line up), so a single multiply by
    256 * scale finishes it.
    NaN codes (0x7f/0xff, never written by the encoder) decode as a finite 480 * scale.
    """
    shape = codes.shape
    b = _work("f8_b", shape, torch.int16, codes.device)
    h = _work("f8_h", shape, torch.int16, codes.device)
    b.copy_(codes.view(torch.int8))                        # sign-extended
    torch.bitwise_and(b, 0x7F, out=h).bitwise_left_shift_(7)
    b.bitwise_left_shift_(8).bitwise_and_(-32768)          # the sign bit
    h.bitwise_or_(b)
    return h.view(torch.float16)


def sink_mask(v: torch.Tensor) -> torch.Tensor:
    """[L,T,H] True where a token's value vector is far smaller than the block's median for
    that (layer, head): the signature of an attention sink (a token most queries attend to,
    whose value is near zero). Its key decides where most attention mass goes, so a small key
    error there moves the whole head's output; measured on SmolLM2, keeping these keys exact
    halves the worst head's error (docs/codecs.md). At most the smallest per (layer, head),
    so the size cost is bounded (about 1% of keys on SmolLM2)."""
    n = torch.linalg.vector_norm(v, dim=-1)
    low = n.amin(dim=1, keepdim=True)
    # at most one per (layer, head) per block (a tie keeps both: rare, and still exact)
    return (n == low) & (low < SINK_RATIO * n.median(dim=1, keepdim=True).values)


def _quant_part(x: torch.Tensor, group: int, offset: bool, s: QuantScheme, side_dt: torch.dtype,
                body: torch.Tensor, ytmp: torch.Tensor, skip: torch.Tensor | None = None
                ) -> list[torch.Tensor]:
    """Quantize one of K/V (float32 [L,T,H,D]) into `body` (uint8 [L,T,H,D]); returns side info.
    `skip` ([L,T,H]): vectors stored exactly elsewhere, left out of the scales."""
    dim = 1 if group == CHANNEL else 3
    if skip is not None:
        m = skip.unsqueeze(-1)
        hi = torch.where(m, -torch.inf, x).amax(dim, keepdim=True)
        lo = torch.where(m, torch.inf, x).amin(dim, keepdim=True)
        hi = torch.where(torch.isinf(hi), 0.0, hi)      # a group made only of skipped vectors
        lo = torch.where(torch.isinf(lo), 0.0, lo)
    else:
        hi = x.amax(dim, keepdim=True)
        lo = x.amin(dim, keepdim=True)
    side = []
    if offset:
        o = (hi * 0.5 + lo * 0.5).to(side_dt)
        of = o.float()
        amax = torch.maximum(hi - of, of - lo)
    else:
        amax = torch.maximum(hi, -lo)
    if not bool(torch.isfinite(amax).all()) or (
            skip is not None and not bool(torch.isfinite(x).all())):
        raise NonFiniteBlock(f"{s.kind} refuses a block holding inf or NaN")
    qmax = QMAX[s.kind]
    sc = (amax / qmax).to(side_dt)
    sc = torch.where(sc > 0, sc, torch.ones_like(sc))   # all-zero (or underflowing) group
    scf = sc.float()
    side.append(sc)
    if offset:
        side.append(o)
        torch.sub(x, of, out=ytmp)
        ytmp.div_(scf)
    else:
        torch.div(x, scf, out=ytmp)
    ytmp.clamp_(-qmax, qmax)
    if s.kind == "int8":
        ytmp.round_()
        body.view(torch.int8).copy_(ytmp)
    else:
        body.view(torch.float8_e4m3fn).copy_(ytmp)
    return side


def quantize(t: torch.Tensor, layout: KVLayout, s: QuantScheme,
             body: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One block (any device, layout dtype, any shape with block_elements) -> (side, body, sinks).

    side: 1-D side-info tensor (bf16 or f32); body: uint8 [L, 2, T, H, D] code bytes; sinks:
    [L, T, H] bool of keys to keep exact (None when the scheme keeps none or finds none).
    """
    shape = layout.block_shape
    x = t.reshape(shape)
    dev = x.device
    if body is None:
        body = torch.empty(shape, dtype=torch.uint8, device=dev)
    if x.dtype == torch.float32:
        x32 = x
    else:
        x32 = _work("q_x32", shape, torch.float32, dev)
        x32.copy_(x)
    side_dt = torch.float32 if s.side_f32 else torch.bfloat16
    part_shape = (shape[0], shape[2], shape[3], shape[4])
    ytmp = _work("q_y", part_shape, torch.float32, dev)
    sinks = sink_mask(x32[:, 1]) if s.exact_sinks else None
    if sinks is not None and not bool(sinks.any()):
        sinks = None
    sides = []
    for j, (group, offset) in enumerate(((s.k_group, s.k_offset), (s.v_group, s.v_offset))):
        sides += _quant_part(x32[:, j], group, offset, s, side_dt, body[:, j], ytmp,
                             sinks if j == 0 else None)
    side = torch.cat([p.reshape(-1) for p in sides])
    return side, body, sinks


def _split_side(side: torch.Tensor, layout: KVLayout, s: QuantScheme) -> list:
    parts, pos = [], 0
    for group, offset in ((s.k_group, s.k_offset), (s.v_group, s.v_offset)):
        gs = _group_shape(layout, group)
        n = int(np.prod(gs))
        sc = side[pos:pos + n].reshape(gs)
        pos += n
        o = None
        if offset:
            o = side[pos:pos + n].reshape(gs)
            pos += n
        parts.append((sc, o))
    return parts


def dequantize(side: torch.Tensor, body: torch.Tensor, layout: KVLayout, s: QuantScheme,
               out: torch.Tensor) -> None:
    """(side, body) -> `out` ([L,2,T,H,D] in the layout dtype). DataLoss on bad side info."""
    side32 = side.float()
    if not bool(torch.isfinite(side32).all()):
        raise DataLoss(f"{s.kind} payload has non-finite scales or offsets")
    shape = layout.block_shape
    part_shape = (shape[0], shape[2], shape[3], shape[4])
    tmp = _work("dq_y", part_shape, torch.float32, out.device)
    for j, (sc, o) in enumerate(_split_side(side32, layout, s)):
        if not bool((sc > 0).all()):
            raise DataLoss(f"{s.kind} payload has zero or negative scales")
        codes = body[:, j]
        if s.kind == "int8":
            torch.mul(codes.view(torch.int8), sc, out=tmp)
        else:
            torch.mul(_fp8_to_half(codes), sc * 256.0, out=tmp)
        if o is not None:
            tmp.add_(o)
        out[:, j].copy_(tmp)


# ---------------------------------------------------------------- bytes <-> payload


def _modes(s: QuantScheme) -> tuple[int, int]:
    return (s.k_group | (M_OFFSET if s.k_offset else 0),
            s.v_group | (M_OFFSET if s.v_offset else 0))


def _as_tensor(block: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    if block.flags.writeable:
        return torch.from_numpy(block).view(dtype)
    with warnings.catch_warnings():   # read-only input (bytes): we never write through it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(block).view(dtype)


def _exact_section(t: torch.Tensor, layout: KVLayout, sinks: torch.Tensor) -> np.ndarray:
    """Bitmap of the [L,T,H] sink keys (packed, C order) + their raw key bytes in that order."""
    bits = np.packbits(sinks.cpu().numpy().reshape(-1).astype(np.uint8))
    keys = t.reshape(layout.block_shape)[:, 0]                      # [L,T,H,D]
    raw = keys[sinks].cpu().contiguous().view(torch.uint8).numpy().reshape(-1)
    return np.concatenate([bits, raw])


def encode_tensor(t: torch.Tensor, layout: KVLayout, s: QuantScheme) -> bytes:
    """Quantize on t's device, then assemble the payload (header, side info, body[, exact keys])
    on the CPU."""
    if t.numel() != layout.block_elements or t.dtype != TORCH_DTYPES[layout.dtype]:
        raise InvalidArgument(f"tensor must hold {layout.block_elements} {layout.dtype} values, "
                              f"got {t.numel()} {t.dtype}")
    side_dt_size = 4 if s.side_f32 else 2
    side_bytes = side_elements(layout, s) * side_dt_size
    total = HEADER_BYTES + side_bytes + layout.block_elements
    buf = scratch("q_payload", total)
    body_np = buf[HEADER_BYTES + side_bytes:]
    body_cpu = torch.from_numpy(body_np).view(layout.block_shape)
    if t.device.type == "cpu":
        side, _, sinks = quantize(t, layout, s, body=body_cpu)
    else:
        side, body, sinks = quantize(t, layout, s)
        body_cpu.copy_(body)
    side_u8 = side.cpu().contiguous().view(torch.uint8).numpy()
    buf[HEADER_BYTES:HEADER_BYTES + side_bytes] = side_u8
    km, vm = _modes(s)
    flags = F_SIDE_F32 if s.side_f32 else 0
    version = 1
    if sinks is not None:
        version, flags = 2, flags | F_EXACT
        buf = np.concatenate([buf, _exact_section(t, layout, sinks)])
        total = len(buf)
    if s.compress:
        comp = cctx().compress(buf[HEADER_BYTES:])
        if len(comp) < total - HEADER_BYTES:
            return _HDR.pack(version, flags | F_ZSTD, km, vm, side_bytes) + comp
    _HDR.pack_into(buf, 0, version, flags, km, vm, side_bytes)
    return buf.tobytes()


def encode(block: np.ndarray, layout: KVLayout, s: QuantScheme) -> bytes:
    check_block(block, layout)
    return encode_tensor(_as_tensor(block, TORCH_DTYPES[layout.dtype]), layout, s)


def parse_header(mv: memoryview, kind: str, layout: KVLayout) -> tuple[QuantScheme, int, int]:
    """Validate the payload header -> (scheme, flags, side bytes)."""
    if len(mv) < HEADER_BYTES:
        raise DataLoss(f"{kind} payload is {len(mv)} bytes, shorter than its header")
    version, flags, km, vm, side_bytes = _HDR.unpack_from(mv)
    if version not in VERSIONS:
        raise DataLoss(f"{kind} payload version {version} is not supported (expected one of "
                       f"{VERSIONS})")
    known = F_ZSTD | F_SIDE_F32 | (F_EXACT if version >= 2 else 0)
    if flags & ~known:
        raise DataLoss(f"{kind} payload has unknown flags {flags:#x}")
    for m in (km, vm):
        if m & ~(M_OFFSET | 3) or (m & 3) not in (CHANNEL, TOKEN):
            raise DataLoss(f"{kind} payload has an unknown scaling mode {m:#x}")
    s = QuantScheme(kind, km & 3, bool(km & M_OFFSET), vm & 3, bool(vm & M_OFFSET),
                    side_f32=bool(flags & F_SIDE_F32), exact_sinks=bool(flags & F_EXACT))
    want = side_elements(layout, s) * (4 if s.side_f32 else 2)
    if side_bytes != want:
        raise DataLoss(f"{kind} payload declares {side_bytes} bytes of scales; its layout and "
                       f"modes need {want}")
    return s, flags, side_bytes


def _bitmap_bytes(layout: KVLayout) -> int:
    L, _, T, H, _ = layout.block_shape
    return (L * T * H + 7) // 8


def decode(payload, kind: str, layout: KVLayout, out: np.ndarray) -> None:
    check_block(out, layout, "out")
    mv = memoryview(payload).cast("B")
    s, flags, side_bytes = parse_header(mv, kind, layout)
    n = side_bytes + layout.block_elements
    item = layout.block_bytes // layout.block_elements
    L, _, T, H, D = layout.block_shape
    nbits = _bitmap_bytes(layout) if flags & F_EXACT else 0
    most = n + nbits + (L * T * H * D * item if nbits else 0)
    if flags & F_ZSTD:
        try:
            size = zstd.frame_content_size(mv[HEADER_BYTES:])
        except zstd.ZstdError as e:
            raise DataLoss(f"{kind} payload: not a zstd frame ({e})") from None
        if not n + nbits <= size <= most:
            raise DataLoss(f"{kind} payload: zstd frame holds {size} bytes; its layout needs "
                           f"{n + nbits} to {most}")
        sections = scratch("dq_sections", size)
        zstd_decompress_into(mv[HEADER_BYTES:], sections, f"{kind} payload")
    else:
        size = len(mv) - HEADER_BYTES
        if not (size == n if not nbits else n + nbits <= size <= most):
            raise DataLoss(f"{kind} payload is {len(mv)} bytes; its layout needs "
                           f"{HEADER_BYTES + n}" + (" plus its exact keys" if nbits else ""))
        sections = np.frombuffer(mv, np.uint8, count=size, offset=HEADER_BYTES)
    side_t = _as_tensor(sections[:side_bytes], torch.float32 if s.side_f32 else torch.bfloat16)
    body_t = _as_tensor(sections[side_bytes:n], torch.uint8).view(layout.block_shape)
    out_t = torch.from_numpy(out).view(TORCH_DTYPES[layout.dtype]).view(layout.block_shape)
    dequantize(side_t, body_t, layout, s, out_t)
    if nbits:
        mask = np.unpackbits(sections[n:n + nbits], count=L * T * H).astype(bool)
        raw = sections[n + nbits:]
        if raw.size != int(mask.sum()) * D * item:
            raise DataLoss(f"{kind} payload's exact keys are {raw.size} bytes; its bitmap "
                           f"names {int(mask.sum())} keys of {D * item} bytes")
        if raw.size:
            keys = _as_tensor(np.ascontiguousarray(raw), TORCH_DTYPES[layout.dtype])
            out_t[:, 0][torch.from_numpy(mask.reshape(L, T, H))] = keys.view(-1, D)
