"""The committed gRPC stubs are what proto/generate.py makes from the .proto today.

Lines that only carry tool version numbers are ignored, so a different grpcio-tools or protobuf
patch release does not fail the test; any change to messages, fields or services does.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from tests import optional_deps

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "client" / "kvstore_client" / "_proto"

_VERSION_LINES = (
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
    # _runtime_version.ValidateProtobufRuntimeVersion(domain, major, minor, patch, suffix, file)
    re.compile(r"ValidateProtobufRuntimeVersion\([^)]*\)", re.S),
)


def normalize(text: str) -> str:
    for pattern in _VERSION_LINES:
        text = pattern.sub("<version>", text)
    return text


def _generate() -> dict[str, str]:
    optional_deps.module("grpc_tools", "grpcio-tools is a test dependency: `make dev`")
    spec = importlib.util.spec_from_file_location("kvstore_proto_generate",
                                                  ROOT / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.generate()


def test_committed_stubs_match_the_proto():
    fresh = _generate()
    assert set(fresh) == {"kvstore_pb2.py", "kvstore_pb2_grpc.py", "kvstore_pb2.pyi"}
    stale = [name for name, text in fresh.items()
             if normalize(text) != normalize((STUBS / name).read_text())]
    assert not stale, f"{stale} are out of date with proto/kvstore/v1/kvstore.proto: run " \
                      "`python proto/generate.py` and commit the result"


def test_normalize_ignores_only_version_numbers():
    text = (STUBS / "kvstore_pb2.py").read_text()
    bumped = re.sub(r"# Protobuf Python Version: \S+", "# Protobuf Python Version: 99.0.0", text)
    assert normalize(bumped) == normalize(text)
    changed = text.replace("namespace_id", "namespace_key", 1)
    assert normalize(changed) != normalize(text)
