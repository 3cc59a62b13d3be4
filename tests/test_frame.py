"""Frame header: round trip, and every kind of damage is a DataLoss, never another exception."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvstore_client.errors import DataLoss, InvalidArgument

from tiers import frame


def test_round_trip_every_codec():
    payload = bytes(range(256)) * 10
    for codec in ("raw", "lossless", "fp8_e4m3", "int8"):
        value = frame.frame(codec, 12345, payload)
        assert len(value) == frame.HEADER_BYTES + len(payload)
        name, raw_len, body = frame.unframe(value)
        assert (name, raw_len, bytes(body)) == (codec, 12345, payload)


def test_empty_payload_and_memoryview_input():
    value = frame.frame("raw", 0, memoryview(b""))
    assert frame.unframe(bytearray(value)) == ("raw", 0, memoryview(b""))


def test_frame_into_matches_frame():
    payload = b"abc" * 1000
    buf = bytearray(frame.HEADER_BYTES + len(payload) + 7)
    n = frame.frame_into(buf, "int8", 77, payload)
    assert bytes(buf[:n]) == frame.frame("int8", 77, payload)
    with pytest.raises(InvalidArgument):
        frame.frame_into(bytearray(10), "int8", 77, payload)


def test_unknown_codec_name_is_invalid_argument():
    with pytest.raises(InvalidArgument):
        frame.frame("zip", 1, b"x")


@pytest.mark.parametrize("what", ["magic", "version", "flags", "codec", "raw_len", "plen",
                                  "checksum", "payload"])
def test_each_damaged_field_is_rejected(what):
    value = bytearray(frame.frame("lossless", 4096, b"\x01\x02" * 500))
    pos = {"magic": 0, "version": 4, "codec": 5, "flags": 6, "raw_len": 8, "plen": 16,
           "checksum": 24, "payload": 100}[what]
    value[pos] ^= 0x01
    with pytest.raises(DataLoss):
        frame.unframe(value)


def test_unknown_codec_id_with_valid_checksum_is_data_loss():
    payload = b"hello"
    prefix = struct.pack("<4sBBHQQ", frame.MAGIC, frame.VERSION, 9, 0, 5, len(payload))
    value = prefix + struct.pack("<Q", frame._checksum(prefix, payload)) + payload
    with pytest.raises(DataLoss, match="unknown codec id 9"):
        frame.unframe(value)


def test_truncated_and_extended_values_are_rejected():
    value = frame.frame("int8", 100, b"z" * 100)
    for bad in (value[:-1], value[:frame.HEADER_BYTES - 1], value + b"\0", b""):
        with pytest.raises(DataLoss):
            frame.unframe(bad)


def test_non_buffer_is_data_loss():
    with pytest.raises(DataLoss):
        frame.unframe(12345)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes_only_data_loss(data):
    try:
        frame.unframe(data)
    except DataLoss:
        pass


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=1, max_size=64), st.integers(0, 95), st.integers(0, 7))
def test_fuzz_any_single_bit_flip_is_caught(payload, pos, bit):
    value = bytearray(frame.frame("fp8_e4m3", 64, payload))
    pos %= len(value)
    value[pos] ^= 1 << bit
    with pytest.raises(DataLoss):
        frame.unframe(value)
