"""Denial-of-service budget: what an unauthenticated local user and a hostile tenant cost the
daemon and tenant A (docs/security.md, Limits).

One daemon with two tenants, A and B (tokens, neither with a host pool of its own), and TCP on
loopback. Tenant A runs an engine's loop in this process: store a prompt of BLOCKS blocks over
Put, load it back over Get, delete it (freed slots keep A's bytes: the shared-pool attack
below reads them if it can). Its store + load latency is measured in alternating windows,
quiet and under attack (the attackers started afresh for each attack window and stopped
before the next quiet one), so that a slow spell of the machine falls on both kinds alike;
each kind's p99 is taken over all its windows' rounds together (hundreds of rounds, not the
few of one window), and each window's p99 is printed beside it. The attack:
- an unauthenticated process (another uid when run as root) holds ATTACK_CONNS stalled
  connections on every listener: gRPC on the Unix socket and on TCP (the HTTP/2 preface a byte
  at a time), `<socket>.auth` and `<socket>.lane` (a byte at a time, never a line; reconnecting
  a second after the daemon closes one or refuses to take it), plus 32 gRPC Put calls without
  a token whose message never comes, renewed as the daemon ends them (looked at every 0.2 s);
- tenant B floods with its own token, each flood a request PACE_S after its last answer: 12
  empty Put streams held open; lane frames that announce more than they send (64 MiB, one past
  the frame cap, the cap; 4 KiB of body each, held 15 s); a Lookup whose message announces
  64 MiB; a Put of four 4 MiB messages of unknown fields; Get and Acquire naming one block
  65,536 times; namespaces and leases without end; and reads of A's blocks (A's namespace id,
  computed; slots of the shared pool reserved and committed unwritten, then read back).
The attackers are written to spend little CPU of their own for what the daemon receives, since
on a machine of few cores their CPU delays A as the daemon's work for them does: one epoll
loop drives all of the unauthenticated process's sockets; its token-less calls and B's 64 MiB
Lookup are raw HTTP/2 frames (bench/h2_raw.py), so the daemon gets the same HEADERS and as
much of the body as its flow-control windows admit, without grpcio building and copying
64 MiB or starting a thread per call; B's unary floods (repeated keys, namespaces, leases,
the reads of A's blocks) are raw HTTP/2 calls too, each flood thread on a connection of its
own, their messages built once where they do not change (the 1 MiB repeated-key requests).
A raw call's status is not decoded: B's refusals show as `<flood>:Refused`.
A metrics scraper (per-tenant series on) runs in every window.

Figures (last line, JSON):
  attack_p99_vs_quiet       A's p99 store + load latency under attack / quiet. Target <= 2.0.
  attack_rss_growth_mib     daemon RSS, highest under attack - highest in the first quiet
                            window (before any attack). Target <= 64. By kind (anonymous,
                            file, shared pool) in `rss_growth_by_kind_mib`.
  max_request_cpu_s         the most daemon CPU seconds one request of the attacks cost, each
                            sent alone to an otherwise idle daemon (probes, before the attack;
                            per kind in `request_cpu_s`). Target <= 1.0.
  cross_tenant_bytes_read   bytes of A's blocks that B got back by any call. Target = 0.
Also: A's p50/p99 each kind of window, the CPU each process used per second and the time the
daemon's and A's threads waited for a core (schedstat run-queue wait: on a 2-core machine the
attackers' own CPU shows there, not as daemon work), how many attacker connections the daemon
closed, B's refusals. `--without KIND ...` leaves flood kinds out (`unauthenticated`: the
whole unauthenticated process), to see what each costs.

Usage: python bench/dos.py [--quick]. Read figures on a quiet machine (the run uses both cores).
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

from dos_attackers import (  # noqa: E402 - beside this script, on sys.path as its folder
    ATTACK_CONNS,
    FLOODS,
    MARKER,
    TENANT_CALLS,
    TOKENS,
    run_b,
    run_unauth,
)
from procstat import RunQueue, cpu_seconds  # noqa: E402 - beside this script, on sys.path

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------- the bench itself

RSS_PARTS = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem"}


def _rss_mib(pid: int) -> dict[str, float]:
    """The daemon's resident memory, whole and by kind (MiB)."""
    out = dict.fromkeys(RSS_PARTS.values(), 0.0)
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in RSS_PARTS:
            out[RSS_PARTS[name]] = int(value.split()[0]) / 1024
    return out


def _pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(len(s) * q))] if s else float("nan")


class TenantA:
    """An engine's store / load / delete loop over Put and Get, its blocks marked."""

    def __init__(self, address: str, blocks: int) -> None:
        import numpy as np
        import torch
        from kvstore_client import KVLayout, connect

        self.np, self.torch = np, torch
        self.lay = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_tokens=16,
                            dtype="bfloat16")                  # 32 KiB blocks
        self.blocks = blocks
        self.client = connect(address, token=TOKENS["a"])
        self.ns = self.client.namespace(self.lay, model="a-engine")
        n = blocks * 16
        raw = np.frombuffer((MARKER * 4 + bytes(range(64)) * 15)[:1024] * (
            self.lay.block_bytes * blocks // 1024), dtype=np.uint8)
        self.kv = torch.from_numpy(raw.copy()).view(torch.bfloat16).reshape(
            4, 2, n, 2, 64)
        self.out = torch.zeros_like(self.kv)
        self.round = 0

    def once(self) -> float:
        self.round += 1
        ids = self.np.arange(self.blocks * 16) + self.round * 10**6
        t0 = time.perf_counter()
        assert self.ns.store(ids, self.kv) == self.blocks
        assert self.ns.load(ids, out=self.out) == self.blocks * 16
        dt = time.perf_counter() - t0
        self.ns.delete(self.ns.keys(ids))
        return dt


def window(a: TenantA, pids: dict[str, int], seconds: float, scrape_url: str | None
           ) -> dict:
    """Tenant A's rounds for `seconds`: their latencies, the daemon's highest RSS, and the CPU
    each process in `pids` (the daemon's first) used per second of the window."""
    stop = threading.Event()
    rss: list[dict[str, float]] = []
    daemon = next(iter(pids.values()))

    runq = {k: RunQueue(pids[k]) for k in ("daemon", "tenant_a")}

    def sample() -> None:
        while not stop.wait(0.05):
            rss.append(_rss_mib(daemon))
            for r in runq.values():
                r.sample()

    def scrape() -> None:
        import urllib.request
        while not stop.wait(1.0):
            try:
                urllib.request.urlopen(scrape_url, timeout=10).read()
            except OSError:
                pass
    threads = [threading.Thread(target=sample, daemon=True)]
    if scrape_url:
        threads.append(threading.Thread(target=scrape, daemon=True))
    for t in threads:
        t.start()
    cpu0 = {k: cpu_seconds(v) for k, v in pids.items()}
    lat: list[float] = []
    errors = 0
    t0 = time.monotonic()
    end = t0 + seconds
    while time.monotonic() < end:
        try:
            lat.append(a.once())
        except Exception as e:  # noqa: BLE001 - a failed store/load counts, and is said
            errors += 1
            print(f"  tenant A's round failed: {type(e).__name__}: {e}", flush=True)
    stop.set()
    wall = time.monotonic() - t0
    cpu = {k: round((cpu_seconds(v) - cpu0[k]) / wall, 2) for k, v in pids.items()}
    for r in runq.values():
        r.sample()
    for t in threads:
        t.join(5)
    runq_per_s = {k: round(r.seconds() / wall, 3) for k, r in runq.items()}
    rss_max = {k: max([r[k] for r in rss] or [0.0]) for k in RSS_PARTS.values()}
    return {"lat": lat, "errors": errors, "rss_max_mib": rss_max, "cpu_per_s": cpu,
            "runq_per_s": runq_per_s}


def summary(windows: list[dict]) -> dict:
    """Windows of one kind pooled: A's percentiles over all their rounds, each window's p99,
    the mean CPU per second of each process."""
    lat = [x for w in windows for x in w["lat"]]
    names = windows[0]["cpu_per_s"]
    return {"p50_ms": round(_pct(lat, 0.5) * 1e3, 2), "p99_ms": round(_pct(lat, 0.99) * 1e3, 2),
            "rounds": len(lat), "errors": sum(w["errors"] for w in windows),
            "p99_ms_by_window": [round(_pct(w["lat"], 0.99) * 1e3, 1) for w in windows],
            "cpu_per_s": {k: round(sum(w["cpu_per_s"][k] for w in windows) / len(windows), 2)
                          for k in names},
            "runq_wait_per_s": {k: round(sum(w["runq_per_s"][k] for w in windows)
                                         / len(windows), 3) for k in ("daemon", "tenant_a")},
            "rss_max_mib": {k: round(max(w["rss_max_mib"][k] for w in windows), 1)
                            for k in RSS_PARTS.values()}}


def probes(address: str, sock: str, pid: int, a_ns: bytes) -> dict[str, float]:
    """Daemon CPU seconds of each attack request, sent alone to an idle daemon."""
    import grpc
    from kvstore_client._proto import kvstore_pb2 as pb
    from kvstore_client._proto import kvstore_pb2_grpc as pbg
    from kvstore_client.common.lane_wire import HEADER, MAX_FRAME, METHOD_ID
    from kvstore_client.common.layout import KVLayout, NamespaceSpec
    from kvstore_client.wire import encode_put, spec_to_proto

    md = (("authorization", f"Bearer {TOKENS['b']}"),)
    ch = grpc.insecure_channel(address, options=[
        ("grpc.max_send_message_length", 1 << 30), ("grpc.max_receive_message_length", 1 << 30)])
    stub = pbg.KVStoreStub(ch)
    tiny = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, block_tokens=16,
                    dtype="bfloat16")
    reg = stub.RegisterNamespace(pb.RegisterNamespaceRequest(spec=spec_to_proto(
        NamespaceSpec(model="b-probe", layout=tiny))), timeout=30, metadata=md)
    ns, key = reg.namespace_id, b"\x05" * 16
    put = ch.stream_unary("/kvstore.v1.KVStore/Put", request_serializer=lambda b: b,
                          response_deserializer=lambda b: b)
    put(iter([encode_put(ns, b"", [(key, bytes(reg.block_bytes))])]), timeout=30, metadata=md)
    raw_lookup = ch.unary_unary("/kvstore.v1.KVStore/Lookup", request_serializer=lambda b: b,
                                response_deserializer=lambda b: b)
    junk = b"\x38\x01" * ((4 << 20) // 2 - 512)

    def lane_frame(announce: int, body: bytes) -> None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(30)
        s.connect(sock + ".lane")
        s.sendall(json.dumps({"v": 1, "token": TOKENS["b"]}).encode() + b"\n")
        s.recv(4096)
        s.sendall(HEADER.pack(announce, METHOD_ID["Lookup"]) + body)
        try:
            s.recv(65536)
        except OSError:
            pass
        s.close()

    kinds = {
        "unauthenticated_192mib_lookup": lambda: raw_lookup(bytes(192 << 20), timeout=60),
        "lookup_64mib": lambda: raw_lookup(bytes(64 << 20), timeout=60, metadata=md),
        "put_unknown_fields_16mib": lambda: put(iter([junk] * 4), timeout=60, metadata=md),
        "get_one_key_65536_times": lambda: list(stub.Get(pb.GetRequest(
            namespace_id=ns, keys=[key] * 65536), timeout=60, metadata=md)),
        "acquire_one_key_65536_times": lambda: stub.Acquire(pb.AcquireRequest(
            namespace_id=ns, keys=[key] * 65536, ttl_s=1), timeout=60, metadata=md),
        "lookup_65536_keys": lambda: stub.Lookup(pb.LookupRequest(
            namespace_id=ns, keys=[os.urandom(32) for _ in range(65536)]), timeout=60,
            metadata=md),
        "lookup_of_a_namespace": lambda: stub.Lookup(pb.LookupRequest(
            namespace_id=a_ns, keys=[key]), timeout=60, metadata=md),
        "lane_frame_64mib_announced": lambda: lane_frame(64 << 20, b"\0" * 4096),
        "lane_frame_at_cap_garbage": lambda: lane_frame(MAX_FRAME, os.urandom(MAX_FRAME)),
    }
    out: dict[str, float] = {}
    time.sleep(1.0)
    t0, c0 = time.monotonic(), cpu_seconds(pid)
    time.sleep(1.0)
    idle = (cpu_seconds(pid) - c0) / (time.monotonic() - t0)     # background work per second
    for name, fn in kinds.items():
        c0, t0 = cpu_seconds(pid), time.monotonic()
        try:
            fn()
        except grpc.RpcError:
            pass                                            # refused: what we measure
        time.sleep(0.1)                                     # the daemon's tail of it
        used = cpu_seconds(pid) - c0 - idle * (time.monotonic() - t0)
        out[name] = round(max(0.0, used), 3)
    ch.close()
    return out


def spawn(role: list[str]) -> subprocess.Popen:
    """This script in another role (the unauthenticated one drops to uid 65534 itself)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "client"),
                                                        *sys.path])}
    return subprocess.Popen([sys.executable, str(Path(__file__).resolve()), *role],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)


def wait_line(p: subprocess.Popen, timeout: float) -> str:
    r, _, _ = select.select([p.stdout], [], [], timeout)
    if not r:
        raise RuntimeError("an attacker process did not start")
    return p.stdout.readline().strip()


def other_uid_ok() -> bool:
    """Whether a child under another uid can import from this checkout (tests/other_uid.py
    says why not where it cannot)."""
    if os.geteuid() != 0:
        return False
    return all(d.stat().st_mode & 0o001 for d in (ROOT, *ROOT.parents))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--role", choices=("unauth", "b"))
    ap.add_argument("--without", nargs="*", default=[], choices=FLOODS,
                    help="leave these kinds out of B's flood (to see what each costs)")
    ap.add_argument("args", nargs="*")
    args = ap.parse_args()
    if args.role == "unauth":
        run_unauth(args.args[0], args.args[1], int(args.args[2]), args.args[3] == "1")
        return
    if args.role == "b":
        run_b(args.args[0], args.args[1], int(args.args[2]),
              set(args.args[3:]) - {"unauthenticated"})
        return
    sys.path[:0] = [str(ROOT), str(ROOT / "client")]
    from kvstore.tenants import hash_token
    from tests.daemon import cleanup, start_daemon

    cycles, window_s, blocks = (4, 3.0, 16) if args.quick else (8, 6.0, 32)
    base = Path(tempfile.mkdtemp(prefix="kvs-dos-"))
    base.chmod(0o755)
    tf = base / "tenants.toml"
    tf.write_text(textwrap.dedent(f"""
        [tenants.a]
        token_sha256 = "{hash_token(TOKENS['a'])}"
        [tenants.b]
        token_sha256 = "{hash_token(TOKENS['b'])}"
    """))
    d = start_daemon(base, {"auth.tokens_file": str(tf), "server.tcp": "127.0.0.1:0",
                            "server.metrics_tenants": True, "host.capacity": "256MiB",
                            "limits.tenant_calls": TENANT_CALLS})
    attackers: list[subprocess.Popen] = []
    try:
        end = time.monotonic() + 120
        while "codec kernels loaded" not in d.output() and time.monotonic() < end:
            time.sleep(0.2)                                  # after-start work done
        pid = d.proc.pid
        a = TenantA(d.address, blocks)
        for _ in range(3):
            a.once()                                         # warm
        print(f"load average {os.getloadavg()[0]:.2f}; probing single requests ...",
              flush=True)
        cpu = probes(d.address, d.socket, pid, a.ns.ns_id)
        for k, v in cpu.items():
            print(f"  {k:34s} {v:6.3f} s of daemon CPU", flush=True)
        other = other_uid_ok()
        quiet_w: list[dict] = []
        attack_w: list[dict] = []
        held: dict[str, int] = {}
        found: dict = {"cross_tenant_bytes_read": 0, "errors": {}}
        pids = {"daemon": pid, "tenant_a": os.getpid()}
        for i in range(cycles):
            quiet_w.append(window(a, pids, window_s, d.metrics_url))
            unauth = spawn(["--role", "unauth", d.socket, d.tcp,
                            "0" if "unauthenticated" in args.without else str(ATTACK_CONNS),
                            "1" if other else "0"])
            b = spawn(["--role", "b", d.socket, a.ns.ns_id.hex(), str(a.lay.block_bytes),
                       *args.without])
            attackers = [unauth, b]
            for p in attackers:
                if wait_line(p, 60) != "ready":
                    raise RuntimeError("an attacker did not get ready")
            attack_w.append(window(a, {**pids, "unauth": unauth.pid, "tenant_b": b.pid},
                                   window_s, d.metrics_url))
            got = _stop(attackers)
            attackers = []
            for k, v in got[0].get("closed_by_daemon", {}).items():
                held[k] = held.get(k, 0) + v
            _merge(found, got[1])
            print(f"cycle {i + 1}/{cycles}: A's p99 quiet "
                  f"{_pct(quiet_w[-1]['lat'], 0.99) * 1e3:.1f} ms, under attack "
                  f"{_pct(attack_w[-1]['lat'], 0.99) * 1e3:.1f} ms; load average "
                  f"{os.getloadavg()[0]:.2f}", flush=True)
        quiet, attack = summary(quiet_w), summary(attack_w)
        print(f"quiet:  {quiet}", flush=True)
        print(f"attack: {attack}", flush=True)
        print(f"unauthenticated ({'uid 65534' if other else 'this uid'}), connections the "
              f"daemon closed: {held}", flush=True)
        if not other:
            print("  (run as root from a checkout other users can read for another uid: "
                  "then the per-uid caps keep its connections apart from A's)", flush=True)
        print(f"tenant B: {found}", flush=True)
        a.client.close()
        figures = {
            "attack_p99_vs_quiet": round(attack["p99_ms"] / quiet["p99_ms"], 2),
            "attack_rss_growth_mib": round(max(0.0, attack["rss_max_mib"]["rss"]
                                               - quiet_w[0]["rss_max_mib"]["rss"]), 1),
            "rss_growth_by_kind_mib": {k: round(v - quiet_w[0]["rss_max_mib"][k], 1)
                                       for k, v in attack["rss_max_mib"].items()},
            "max_request_cpu_s": max(cpu.values()),
            # -1: a cycle's B said nothing, so its reads are not shown to be none
            "cross_tenant_bytes_read": (-1 if found.get("silent_cycles") else
                                        int(found["cross_tenant_bytes_read"])),
            "quiet_p99_ms": quiet["p99_ms"], "attack_p99_ms": attack["p99_ms"],
            "quiet_rounds": quiet["rounds"], "attack_rounds": attack["rounds"],
            "attack_errors": attack["errors"], "request_cpu_s": cpu,
            "cpu_per_s_quiet": quiet["cpu_per_s"],
            "cpu_per_s_under_attack": attack["cpu_per_s"],
            # On a machine of few cores the attackers' own CPU (unauth, tenant_b) delays A's
            # and the daemon's threads as much as the daemon's work for them does: their
            # run-queue wait, quiet and under attack, tells the two apart.
            "runq_wait_per_s_quiet": quiet["runq_wait_per_s"],
            "runq_wait_per_s_under_attack": attack["runq_wait_per_s"],
            "unauthenticated_other_uid": other, "b_floods_left_out": args.without,
            "load_average": round(os.getloadavg()[0], 2),
        }
        print(json.dumps(figures), flush=True)
    finally:
        for p in attackers:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        cleanup(d)
        shutil.rmtree(base, ignore_errors=True)


def _stop(attackers: list[subprocess.Popen]) -> list[dict]:
    """Close each attacker's stdin (its signal to stop) and read the JSON it ends with."""
    out = []
    for p in attackers:
        p.stdin.close()
    for p in attackers:
        try:
            out.append(json.loads(wait_line(p, 60) or "{}"))
        except (RuntimeError, ValueError):
            out.append({})
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
    return out


def _merge(total: dict, more: dict) -> None:
    """B's findings of one cycle added to those of the cycles before."""
    for k, v in more.items():
        if isinstance(v, dict):
            for kk, vv in v.items():
                total.setdefault(k, {})[kk] = total.get(k, {}).get(kk, 0) + vv
        else:
            total[k] = total.get(k, 0) + v
    if not more:
        total["silent_cycles"] = total.get("silent_cycles", 0) + 1


if __name__ == "__main__":
    main()
