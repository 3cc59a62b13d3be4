"""Regenerate the committed Python stubs from proto/kvstore/v1/kvstore.proto.

grpc_tools writes `from kvstore.v1 import kvstore_pb2`, which would collide with the daemon's
`kvstore` package, so the import is rewritten to the SDK's private `_proto` package.
Run: python proto/generate.py  (tests/test_proto_stubs.py fails when the committed stubs differ).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "client" / "kvstore_client" / "_proto"
FILES = ("kvstore_pb2.py", "kvstore_pb2_grpc.py", "kvstore_pb2.pyi")


def generate() -> dict[str, str]:
    """Return {file name: text} of freshly generated stubs."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={tmp}", f"--grpc_python_out={tmp}",
                f"--pyi_out={tmp}", str(PROTO_DIR / "kvstore" / "v1" / "kvstore.proto")]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed")
        out = {}
        for name in FILES:
            text = (Path(tmp) / "kvstore" / "v1" / name).read_text()
            out[name] = text.replace("from kvstore.v1 import kvstore_pb2",
                                     "from kvstore_client._proto import kvstore_pb2")
        return out


def main() -> int:
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    for name, text in generate().items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {', '.join(FILES)} to {OUT_DIR.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
