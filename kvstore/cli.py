"""The `kvstore` command: `serve` runs the daemon, `status` and `delete` call a running one
(cli_daemon.py), `plan` sizes tiers, `demo` demos.

Why `serve` tunes malloc first: without glibc's MALLOC_* settings every multi-MiB gRPC message
is a fresh mmap and a round of page faults (3.5× slower for 2 MiB messages,
docs/performance.md). glibc reads the variables only at exec, so `serve` applies the same four
values in-process with mallopt(3) before any thread starts (it used to re-execute itself,
which cost a second interpreter start and import on every start). Values the operator set in
the environment are left to glibc; `--no-malloc-tuning` skips the whole step.

Config errors and operator mistakes found before start (kvstore/preflight.py: data folder,
socket path, ports in use, /dev/shm size, conflicting settings) exit with code 2 and one line
on stderr, before torch is imported or the store opens; a daemon that cannot start for a reason
only found later (data folder locked by another daemon, a port taken since the check) exits
with 1, also in one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from . import cli_daemon
from .cli_daemon import fail
from .config import ConfigError, StoreConfig, format_size, load_config

# glibc malloc tunables for large gRPC messages (see module docstring and README.md (Metrics)).
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "4",                      # 16 RPC threads must not mean 16 arenas
    "MALLOC_MMAP_THRESHOLD_": str(32 << 20),      # serve messages up to 32 MiB from the heap
    "MALLOC_TRIM_THRESHOLD_": str(256 << 20),     # and keep freed heap for the next message
    "MALLOC_TOP_PAD_": str(64 << 20),             # grow the heap in big steps
}
# mallopt(3) parameter numbers (malloc.h) of the variables above.
_MALLOPT = {"MALLOC_ARENA_MAX": -8, "MALLOC_MMAP_THRESHOLD_": -3,
            "MALLOC_TRIM_THRESHOLD_": -1, "MALLOC_TOP_PAD_": -2}
SMALL_MACHINE_BYTES = 8 << 30
SMALL_HOST_POOL = 512 << 20


def default_config_path() -> Path:
    """The embedded default.toml (loaded when neither --config nor $KVSTORE_CONFIG is given).

    Beside this module, as the package ships it (importlib.resources cost ~15 ms of import on
    every daemon start, for the same path)."""
    return Path(__file__).resolve().with_name("default.toml")


def version() -> str:
    """The installed distribution's version; the source tree's when run uninstalled."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvstore")
    except PackageNotFoundError:
        return "0.1.0 (not installed)"


def _set_pair(text: str) -> tuple[list[str], str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects section.key=value, got {text!r}")
    return key.strip().split("."), value


def _nest(overrides: dict[str, Any], path: list[str], value: Any) -> None:
    d = overrides
    for p in path[:-1]:
        d = d.setdefault(p, {})
        if not isinstance(d, dict):
            raise ConfigError(f"--set {'.'.join(path)}: {p} is a value, not a section")
    d[path[-1]] = value


def overrides_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Flags -> the nested overrides dict load_config applies last."""
    out: dict[str, Any] = {}
    for text in args.set or []:
        path, value = _set_pair(text)
        _nest(out, path, value)
    named = {("data_dir",): args.data_dir, ("server", "socket"): args.socket,
             ("server", "tcp"): args.tcp, ("server", "metrics"): args.metrics,
             ("host", "capacity"): args.host_capacity, ("ssd", "capacity"): args.ssd_capacity,
             ("log_level",): args.log_level}
    for path, value in named.items():
        if value is not None:
            _nest(out, list(path), value)
    return out


def _sets_host_capacity(config_path: str | None, overrides: dict, environ: dict) -> bool:
    if "capacity" in overrides.get("host", {}) or "KVSTORE_HOST__CAPACITY" in environ:
        return True
    if config_path:
        import tomllib
        try:
            with open(config_path, "rb") as f:
                return "capacity" in tomllib.load(f).get("host", {})
        except (OSError, ValueError):   # TOMLDecodeError, UnicodeDecodeError
            return True   # load_config reports the problem
    return False


def _physical_memory() -> int:
    """The memory this process may use: the machine's, or its cgroup's limit if lower (a
    container's), which the host pool is charged to."""
    from .preflight import memory_limit

    try:
        phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        phys = 1 << 40
    limit = memory_limit()
    return min(phys, limit[0]) if limit else phys


def build_config(args: argparse.Namespace, environ: dict[str, str] | None = None
                 ) -> StoreConfig:
    """--config / $KVSTORE_CONFIG / the embedded default, then KVSTORE_*, then flags."""
    env = dict(os.environ if environ is None else environ)
    overrides = overrides_from_args(args)
    user_path = args.config or env.get("KVSTORE_CONFIG")
    path = user_path or str(default_config_path())
    cfg = load_config(path, overrides, env)
    if (not _sets_host_capacity(user_path, overrides, env)
            and _physical_memory() < SMALL_MACHINE_BYTES):
        cfg.host.capacity = min(cfg.host.capacity, SMALL_HOST_POOL)
    return cfg


def tune_malloc() -> dict[str, str]:
    """Apply MALLOC_ENV with mallopt(3) for each variable the environment does not set; returns
    what it applied. The values are also put in os.environ, for processes this one starts.
    Without glibc (no mallopt) nothing is applied."""
    import ctypes

    missing = {k: v for k, v in MALLOC_ENV.items() if k not in os.environ}
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return {}
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    done = {k: v for k, v in missing.items() if mallopt(_MALLOPT[k], int(v)) == 1}
    os.environ.update(done)
    return done


# -------------------------------------------------------------------------------- commands

def cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from .preflight import PreflightError, preflight

    try:
        cfg = build_config(args)
    except ConfigError as e:
        return fail(f"config error: {e}")
    try:
        preflight(cfg)
    except PreflightError as e:
        return fail(f"cannot start: {e}")
    warning = metrics_exposure(cfg)
    if warning:
        print(f"kvstore: WARNING: {warning}", file=sys.stderr, flush=True)
    # Said before the slow part (imports, prefaulting the pool, opening LMDB), so a watcher
    # sees at once what the daemon is doing.
    print(f"kvstore: starting: data folder {os.path.abspath(cfg.data_dir)}, host pool "
          f"{format_size(cfg.host.capacity)}, ssd "
          f"{format_size(cfg.ssd.capacity) if cfg.ssd.enabled else 'off'}", file=sys.stderr,
          flush=True)
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .daemon import run
    return run(cfg)


def metrics_exposure(cfg: StoreConfig) -> str | None:
    """The warning for a metrics endpoint beyond loopback: it has no authentication."""
    from .binding import is_loopback

    addr = cfg.server.metrics
    if not addr or is_loopback(addr):
        return None
    tenants = (", with each tenant's series (server.metrics_tenants)"
               if cfg.server.metrics_tenants else "")
    return (f"server.metrics={addr} listens beyond loopback with no authentication: anyone "
            f"who reaches it reads the daemon's figures{tenants}; bind it to 127.0.0.1 or "
            "firewall the port")


def cmd_status(args: argparse.Namespace) -> int:
    return cli_daemon.status(args, lambda a: build_config(a).socket_path)


def cmd_delete(args: argparse.Namespace) -> int:
    return cli_daemon.delete(args, lambda a: build_config(a).socket_path)


def run_demo(demo_args: list[str]) -> int:
    """`kvstore demo ...`: every argument goes to kvstore_demo.chat (imported only now)."""
    try:
        from kvstore_demo.chat import main as demo_main
    except ImportError as e:
        return fail(f"the demo is not available in this install ({e})", 1)
    return int(demo_main(demo_args) or 0)


def cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(args.demo_args)


def cmd_plan(args: argparse.Namespace) -> int:
    import json

    from .plan import (
        PlanError,
        explicit_shape,
        format_plan,
        load_hf_config,
        plan,
        shape_from_hf_config,
        tiers_from_config,
    )

    try:
        if args.model_config:
            if args.layers or args.kv_heads or args.head_dim:
                raise PlanError("give either a config.json or --layers/--kv-heads/--head-dim, "
                                "not both")
            shape = shape_from_hf_config(load_hf_config(args.model_config), args.dtype)
        else:
            missing = [f for f in ("layers", "kv_heads", "head_dim") if not getattr(args, f)]
            if missing:
                raise PlanError("give a model's config.json, or all of --layers, --kv-heads "
                                "and --head-dim (missing: "
                                + ", ".join("--" + m.replace("_", "-") for m in missing) + ")")
            shape = explicit_shape(args.layers, args.kv_heads, args.head_dim,
                                   args.dtype or "bfloat16", args.attention_heads)
        tiers = tiers_from_config(build_config(args))
        result = plan(shape, args.block_tokens, tiers)
    except PlanError as e:
        return fail(f"plan: {e}")
    except ConfigError as e:
        return fail(f"config error: {e}")
    print(json.dumps(result, indent=2) if args.json else format_plan(result))
    return 0


def _defaults_help() -> dict[str, str]:
    """Flag help with the default each flag falls back to (from StoreConfig, one source)."""
    d = StoreConfig()
    return {
        "data_dir": f"data folder: SSD tier, lock file, default socket (default: {d.data_dir})",
        "socket": "Unix socket path (default: <data-dir>/kvstore.sock)",
        "tcp": f"TCP listen address host:port, '' disables (default: {d.server.tcp})",
        "metrics": f"Prometheus listen address host:port, '' disables (default: "
                   f"{d.server.metrics})",
        "host_capacity": f"host (shared-memory) tier size, e.g. 2GiB (default: "
                         f"{format_size(d.host.capacity)}; {format_size(SMALL_HOST_POOL)} on "
                         f"machines, or under memory limits, of less than "
                         f"{format_size(SMALL_MACHINE_BYTES)})",
        "ssd_capacity": f"SSD tier size, e.g. 100GiB (default: {format_size(d.ssd.capacity)})",
        "log_level": f"debug | info | warning | error | critical (default: {d.log_level})",
    }


def _config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML config file (default: $KVSTORE_CONFIG, else the "
                                    "embedded default)")
    p.add_argument("--data-dir", help=_defaults_help()["data_dir"])
    p.add_argument("--socket", help=_defaults_help()["socket"])
    p.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="any config key, e.g. --set ssd.sync=true (repeatable)")
    # Accepted here so `status --config x` and `serve --config x` find the same socket.
    p.add_argument("--tcp", help=argparse.SUPPRESS)
    p.add_argument("--metrics", help=argparse.SUPPRESS)
    p.add_argument("--host-capacity", help=argparse.SUPPRESS)
    p.add_argument("--ssd-capacity", help=argparse.SUPPRESS)
    p.add_argument("--log-level", help=argparse.SUPPRESS)


class _VersionAction(argparse.Action):
    """`--version`, with the version looked up only when asked: importlib.metadata scans the
    installed distributions, which cost every daemon start 10-20 ms."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS,
                 default: str = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0,
                         help=help or "show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        print(f"kvstore {version()}")
        parser.exit()


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstore", description="Tiered KV-cache store for LLM inference engines.")
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon",
                           description="Run the daemon until SIGTERM/SIGINT. Settings: "
                           "embedded default < --config file < KVSTORE_* variables < flags.")
    _config_flags(serve)
    helps = _defaults_help()
    for action in serve._actions:   # the capacity/listener flags are documented for serve
        if action.dest in helps:
            action.help = helps[action.dest]
    serve.add_argument("--no-malloc-tuning", action="store_true",
                       help="do not apply the MALLOC_* settings (mallopt)")
    serve.set_defaults(func=cmd_serve)

    status = sub.add_parser("status", help="show a running daemon's tiers",
                            description="Ask a running daemon for its Stats and print a table.")
    _config_flags(status)
    status.add_argument("--address", help="gRPC target, e.g. unix:./data/kvstore.sock or "
                                          "127.0.0.1:50551 (default: $KVSTORE_ADDRESS, else "
                                          "the config's socket)")
    status.add_argument("--json", action="store_true", help="print the raw stats as JSON")
    status.add_argument("--namespaces", action="store_true",
                        help="also list each namespace (model, revision, codec, shard, "
                             "tenant) with its blocks per tier, leases and idle time, most "
                             "blocks first (a tenant sees its own)")
    status.add_argument("--timeout", type=float, default=5.0, help="seconds to wait")
    status.set_defaults(func=cmd_status)

    delete = sub.add_parser(
        "delete", help="delete a model's blocks from a running daemon",
        description="Delete every block (host, SSD, remote, gpu) of the namespaces whose model "
        "matches MODEL (a shell pattern: 'org/llama-*'), e.g. after a model is retired, so "
        "they stop crowding out live models' blocks. Lists them without --yes. A tenant "
        "reaches only its own namespaces ($KVSTORE_TOKEN, or its uid).")
    _config_flags(delete)
    delete.add_argument("--model", required=True, help="model name or shell pattern")
    delete.add_argument("--revision", help="only this revision ('' for none)")
    delete.add_argument("--yes", action="store_true", help="delete (else only list)")
    delete.add_argument("--address", help="gRPC target (as for status)")
    delete.add_argument("--timeout", type=float, default=60.0,
                        help="seconds each call may take")
    delete.set_defaults(func=cmd_delete)

    plan = sub.add_parser(
        "plan", help="how many tokens and blocks of a model fit in each tier",
        description="Bytes per token and per block of a model's KV cache (MHA, GQA, MQA, MLA) "
        "and how many tokens and blocks fit in each configured tier, at each codec's measured "
        "size. The tiers come from the same config sources as `serve`.")
    plan.add_argument("model_config", nargs="?", metavar="CONFIG_JSON",
                      help="a Hugging Face config.json (or the folder holding it)")
    plan.add_argument("--layers", type=int, help="number of layers")
    plan.add_argument("--kv-heads", type=int, help="KV heads (1: MQA)")
    plan.add_argument("--head-dim", type=int, help="dimension of one head")
    plan.add_argument("--attention-heads", type=int,
                      help="query heads, to name the variant (default: = --kv-heads)")
    plan.add_argument("--dtype", help="KV dtype: bfloat16, float16, float32, fp8, int8 "
                                      "(default: the config's torch_dtype, else bfloat16)")
    plan.add_argument("--block-tokens", type=int, default=16,
                      help="tokens per block (default: 16)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    _config_flags(plan)
    for action in plan._actions:
        if action.dest in ("host_capacity", "ssd_capacity"):
            action.help = _defaults_help()[action.dest]
    plan.set_defaults(func=cmd_plan)

    demo = sub.add_parser("demo", help="run the end-to-end demo (kvstore_demo)",
                          add_help=False)
    demo.add_argument("demo_args", nargs=argparse.REMAINDER)
    demo.set_defaults(func=cmd_demo)
    return parser


# A command whose reader went away (`kvstore status | head -1`) exits with this code: what a
# shell reports for a C tool killed by SIGPIPE (128 + 13), so `set -o pipefail` and PIPESTATUS
# see it as they see `cat big | head`'s writer, and nothing is printed.
BROKEN_PIPE_EXIT = 141


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `kvstore` script and `python -m kvstore`.

    Only a real command line (argv None) tunes malloc, so calling main([...]) from Python
    never changes the caller's allocator. Only a real command line handles a closed stdout:
    Python ignores SIGPIPE, so a reader that stops early (`| head`) turns the next write or
    the flush at exit into a BrokenPipeError traceback or an "Exception ignored" message.
    """
    if argv is not None:
        return _main(list(argv), from_command_line=False)
    try:
        try:
            return _main(sys.argv[1:], from_command_line=True)
        finally:
            sys.stdout.flush()     # a reader gone shows here, not at interpreter exit
    except BrokenPipeError:
        # The interpreter flushes stdout again at exit: point it at /dev/null so that flush
        # of what is still buffered succeeds silently.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return BROKEN_PIPE_EXIT


def _main(argv: list[str], from_command_line: bool) -> int:
    if argv[:1] == ["demo"]:       # argparse would eat the demo's own options (--help...)
        return run_demo(argv[1:])
    args = make_parser().parse_args(argv)
    if from_command_line and args.command == "serve" and not args.no_malloc_tuning:
        tune_malloc()
    code = int(args.func(args) or 0)
    if from_command_line and args.command == "serve":
        # The daemon has closed everything it owns (store flushed, LMDB closed, shm unlinked,
        # socket removed, lock released). Skipping the interpreter's teardown (torch, thread
        # pools, module globals) saves 1-2 s of an idle stop on a loaded machine.
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code
