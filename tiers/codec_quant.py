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
  better). INT8 stays symmetric (no offsets), as the issue asks.
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
from kvstore_client.errors import DataLoss, InvalidArgument
from kvstore_client.layout import KVLayout

from . import codec_common
from .codec_common import NonFiniteBlock, cctx, check_block, scratch, zstd_decompress_into

if codec_common.TORCH_THREADS is not None:
    torch.set_num_threads(codec_common.TORCH_THREADS)

VERSION = 1
F_ZSTD = 1
F_SIDE_F32 = 2
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


SCHEMES: dict[str, QuantScheme] = {
    # zstd on INT8 codes saved only ~4% on real KV for ~40% of the encode time: off. On FP8 codes
    # (sign/exponent bits are skewed) it saves ~17% and keeps 16-token blocks under 0.55x: on.
    "int8": QuantScheme("int8", v_group=TOKEN, compress=False),
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

    Why: torch's own fp8 -> float conversion runs at ~0.8 GB/s on CPU (PERF-NOTES). Placing the
    e4m3 exponent/mantissa bits into an fp16 word gives value * 2**-8 for normals and subnormals
    alike (both formats' subnormal grids line up), so a single multiply by 256 * scale finishes it.
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


def _quant_part(x: torch.Tensor, group: int, offset: bool, s: QuantScheme, side_dt: torch.dtype,
                body: torch.Tensor, ytmp: torch.Tensor) -> list[torch.Tensor]:
    """Quantize one of K/V (float32 [L,T,H,D]) into `body` (uint8 [L,T,H,D]); returns side info."""
    dim = 1 if group == CHANNEL else 3
    hi = x.amax(dim, keepdim=True)
    lo = x.amin(dim, keepdim=True)
    side = []
    if offset:
        o = (hi * 0.5 + lo * 0.5).to(side_dt)
        of = o.float()
        amax = torch.maximum(hi - of, of - lo)
    else:
        amax = torch.maximum(hi, -lo)
    if not bool(torch.isfinite(amax).all()):
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
             body: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One block (any device, layout dtype, any shape with block_elements) -> (side, body).

    side: 1-D side-info tensor (bf16 or f32); body: uint8 [L, 2, T, H, D] code bytes.
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
    sides = []
    for j, (group, offset) in enumerate(((s.k_group, s.k_offset), (s.v_group, s.v_offset))):
        sides += _quant_part(x32[:, j], group, offset, s, side_dt, body[:, j], ytmp)
    side = torch.cat([p.reshape(-1) for p in sides])
    return side, body


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


def encode_tensor(t: torch.Tensor, layout: KVLayout, s: QuantScheme) -> bytes:
    """Quantize on t's device, then assemble the payload (header, side info, body) on the CPU."""
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
        side, _ = quantize(t, layout, s, body=body_cpu)
    else:
        side, body = quantize(t, layout, s)
        body_cpu.copy_(body)
    side_u8 = side.cpu().contiguous().view(torch.uint8).numpy()
    buf[HEADER_BYTES:HEADER_BYTES + side_bytes] = side_u8
    km, vm = _modes(s)
    flags = F_SIDE_F32 if s.side_f32 else 0
    if s.compress:
        comp = cctx().compress(buf[HEADER_BYTES:])
        if len(comp) < total - HEADER_BYTES:
            return _HDR.pack(VERSION, flags | F_ZSTD, km, vm, side_bytes) + comp
    _HDR.pack_into(buf, 0, VERSION, flags, km, vm, side_bytes)
    return buf.tobytes()


def encode(block: np.ndarray, layout: KVLayout, s: QuantScheme) -> bytes:
    check_block(block, layout)
    return encode_tensor(_as_tensor(block, TORCH_DTYPES[layout.dtype]), layout, s)


def parse_header(mv: memoryview, kind: str, layout: KVLayout) -> tuple[QuantScheme, int, int]:
    """Validate the payload header -> (scheme, flags, side bytes)."""
    if len(mv) < HEADER_BYTES:
        raise DataLoss(f"{kind} payload is {len(mv)} bytes, shorter than its header")
    version, flags, km, vm, side_bytes = _HDR.unpack_from(mv)
    if version != VERSION:
        raise DataLoss(f"{kind} payload version {version} is not supported (expected {VERSION})")
    if flags & ~(F_ZSTD | F_SIDE_F32):
        raise DataLoss(f"{kind} payload has unknown flags {flags:#x}")
    for m in (km, vm):
        if m & ~(M_OFFSET | 3) or (m & 3) not in (CHANNEL, TOKEN):
            raise DataLoss(f"{kind} payload has an unknown scaling mode {m:#x}")
    s = QuantScheme(kind, km & 3, bool(km & M_OFFSET), vm & 3, bool(vm & M_OFFSET),
                    side_f32=bool(flags & F_SIDE_F32))
    want = side_elements(layout, s) * (4 if s.side_f32 else 2)
    if side_bytes != want:
        raise DataLoss(f"{kind} payload declares {side_bytes} bytes of scales; its layout and "
                       f"modes need {want}")
    return s, flags, side_bytes


def decode(payload, kind: str, layout: KVLayout, out: np.ndarray) -> None:
    check_block(out, layout, "out")
    mv = memoryview(payload).cast("B")
    s, flags, side_bytes = parse_header(mv, kind, layout)
    n = side_bytes + layout.block_elements
    if flags & F_ZSTD:
        sections = scratch("dq_sections", n)
        zstd_decompress_into(mv[HEADER_BYTES:], sections, f"{kind} payload")
    else:
        if len(mv) != HEADER_BYTES + n:
            raise DataLoss(f"{kind} payload is {len(mv)} bytes; its layout needs "
                           f"{HEADER_BYTES + n}")
        sections = np.frombuffer(mv, np.uint8, count=n, offset=HEADER_BYTES)
    side_t = _as_tensor(sections[:side_bytes], torch.float32 if s.side_f32 else torch.bfloat16)
    body_t = _as_tensor(sections[side_bytes:], torch.uint8).view(layout.block_shape)
    out_t = torch.from_numpy(out).view(TORCH_DTYPES[layout.dtype]).view(layout.block_shape)
    dequantize(side_t, body_t, layout, s, out_t)
