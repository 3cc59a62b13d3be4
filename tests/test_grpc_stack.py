"""kvstore_client picks gRPC's socket layer on first import (kvstore_client/common/grpc_stack.py):
the classic poller, unless the process set GRPC_EXPERIMENTS itself; and this grpcio knows the
experiments it names (an unknown name is only logged by gRPC, and the setting would silently
do nothing)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, **env: str | None) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "GRPC_EXPERIMENTS"}
    full.update({k: v for k, v in env.items() if v is not None})
    full["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "client"),
                                          full.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=120)


def test_import_sets_the_classic_poller():
    from kvstore_client.common.grpc_stack import EXPERIMENTS
    p = _run("import os, kvstore_client; print(os.environ['GRPC_EXPERIMENTS'])")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == EXPERIMENTS


def test_a_process_choice_is_kept():
    p = _run("import os, kvstore_client; print(repr(os.environ['GRPC_EXPERIMENTS']))",
             GRPC_EXPERIMENTS="")
    assert p.stdout.strip() == "''", p.stderr
    p = _run("import os, kvstore_client; print(os.environ['GRPC_EXPERIMENTS'])",
             GRPC_EXPERIMENTS="event_engine_client")
    assert p.stdout.strip() == "event_engine_client", p.stderr


ECHO = """
import os, shutil, sys, tempfile
import kvstore_client
from concurrent import futures
import grpc
d = tempfile.mkdtemp()
sock = "unix:" + os.path.join(d, "s.sock")
h = grpc.method_handlers_generic_handler("t.E", {"E": grpc.unary_unary_rpc_method_handler(
    lambda req, ctx: req)})
server = grpc.server(futures.ThreadPoolExecutor(2), options=[
    ("grpc.max_receive_message_length", 8 << 20)])
server.add_generic_rpc_handlers((h,))
server.add_insecure_port(sock)
server.start()
ch = grpc.insecure_channel(sock, options=[("grpc.max_receive_message_length", 8 << 20)])
call = ch.unary_unary("/t.E/E")
body = os.urandom(3 << 20)
assert call(body, timeout=30, wait_for_ready=True) == body
ch.close()
server.stop(None)
shutil.rmtree(d)
print("ECHO OK")
"""


def test_grpc_knows_the_experiments_and_serves_with_them():
    """A server and a channel on the classic poller move a 3 MiB message bit for bit, and gRPC
    reports no unknown experiment name."""
    p = _run(ECHO, GRPC_VERBOSITY="INFO")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "ECHO OK" in p.stdout
    assert "nknown experiment" not in p.stderr, p.stderr[-3000:]
