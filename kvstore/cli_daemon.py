"""The commands that call a running daemon: `status` (its tiers, and its namespaces with
`--namespaces`) and `delete` (drop the blocks of a model's namespaces).

Why apart from cli.py: `serve` and `plan` need no daemon and no gRPC; these need the address,
the credentials of a daemon with tenants ($KVSTORE_TOKEN or the uid handshake) and the same
one-line errors for a daemon that is not there.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import Any

from kvstore_client.common.errors import InvalidArgument

from .config import ConfigError, format_size


def format_status(resp: Any) -> str:
    """A StatsResponse as a table a person reads at a terminal."""
    rows = [("tier", "capacity", "used", "fill", "blocks", "hits", "misses", "hit rate",
             "evictions")]
    for t in resp.tiers:
        fill = f"{100 * t.used_bytes / t.capacity_bytes:.1f}%" if t.capacity_bytes else "-"
        looked = t.hits + t.misses
        rate = f"{100 * t.hits / looked:.1f}%" if looked else "-"
        rows.append((t.name, format_size(t.capacity_bytes), format_size(t.used_bytes), fill,
                     str(t.blocks), str(t.hits), str(t.misses), rate, str(t.evictions)))
    lines = [f"daemon {resp.daemon_id}   namespaces {resp.namespaces}   "
             f"active leases {resp.active_leases}", ""]
    lines += _table(rows)
    if resp.namespace_list:
        lines += ["", *namespace_table(resp.namespace_list)]
        if len(resp.namespace_list) < resp.namespaces:
            lines.append(f"(the {len(resp.namespace_list)} holding most blocks of "
                         f"{resp.namespaces})")
    return "\n".join(lines)


def namespace_table(listed: Any) -> list[str]:
    """NamespaceStats records as aligned lines, a header first."""
    rows = [("model", "revision", "codec", "shard", "tenant", "blocks", "host", "ssd",
             "remote", "leases", "idle")]
    for n in listed:
        rows.append((n.model, n.revision or "-", n.codec, f"{n.shard_rank}/{n.shard_size}",
                     n.tenant or "-", str(n.blocks), str(n.host_blocks), str(n.ssd_blocks),
                     str(n.remote_blocks), str(n.leases),
                     f"{n.idle_s:.0f}s" if n.idle_s >= 0 else "-"))
    return _table(rows, left=5)


def _table(rows: list[tuple[str, ...]], left: int = 1) -> list[str]:
    """Rows as aligned lines: the first `left` columns flush left, the rest right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w)
                      for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
            for r in rows]


def _int64_as_numbers(descriptor: Any, d: dict[str, Any]) -> dict[str, Any]:
    """`d` (MessageToDict of a `descriptor` message) with 64-bit integers as JSON numbers.

    protobuf's JSON mapping quotes them (JavaScript doubles lose digits past 2^53), and its
    `unquote_int64_if_possible` still quotes the large ones; Python's json writes any int
    exactly, so a script reads the same type whatever the value."""
    from google.protobuf.descriptor import FieldDescriptor as F

    wide = {F.TYPE_INT64, F.TYPE_UINT64, F.TYPE_SINT64, F.TYPE_FIXED64, F.TYPE_SFIXED64}

    def value(field: Any, v: Any) -> Any:
        if field.message_type is not None:
            return _int64_as_numbers(field.message_type, v)
        return int(v) if field.type in wide else v

    for f in descriptor.fields:
        if f.name not in d:
            continue
        v = d[f.name]
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            vf = f.message_type.fields_by_name["value"]
            d[f.name] = {k: value(vf, x) for k, x in v.items()}
        elif f.is_repeated:
            d[f.name] = [value(f, x) for x in v]
        else:
            d[f.name] = value(f, v)
    return d


def stats_json(resp: Any) -> dict[str, Any]:
    """A StatsResponse as `status --json` prints it: every field, zeros included (an empty
    tier has `"blocks": 0`), counts as numbers, proto field names."""
    from google.protobuf.json_format import MessageToDict

    d = _int64_as_numbers(resp.DESCRIPTOR, MessageToDict(
        resp, always_print_fields_with_no_presence=True, preserving_proto_field_name=True))
    for rec, n in zip(d.get("namespace_list", []), resp.namespace_list, strict=True):
        rec["namespace_id"] = n.namespace_id.hex()      # (not protobuf's base64)
    return d


class Failed(Exception):
    """A one-line error for the operator, and the exit code."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


def _credentials(address: str, timeout: float) -> tuple | None:
    """On a daemon with tenants: $KVSTORE_TOKEN, else the uid handshake (docs/security.md)."""
    from kvstore_client.common.handoff import handshake, handshake_path

    token = os.environ.get("KVSTORE_TOKEN", "")
    path = handshake_path(address[len("unix:"):]) if address.startswith("unix:") else ""
    if not token and path and os.path.exists(path):
        token = handshake(path, "", timeout).token
    return (("authorization", f"Bearer {token}"),) if token else None


def _connect(args: argparse.Namespace, socket_path: Callable[[argparse.Namespace], str]
             ) -> tuple[str, tuple | None]:
    """The daemon's address (as the SDK reads one; `socket_path(args)`, the config's socket,
    when none is given) and the call metadata; Failed if there is no daemon to ask or no
    credentials it takes."""
    from kvstore_client.common.address import grpc_target
    from kvstore_client.common.errors import KVStoreError, Unauthenticated

    try:
        # The SDK's reading of addresses: a bare or relative path is a Unix socket.
        address = grpc_target(args.address or os.environ.get("KVSTORE_ADDRESS")
                              or socket_path(args))[0]
    except (ConfigError, InvalidArgument) as e:
        raise Failed(f"config error: {e}" if isinstance(e, ConfigError) else str(e), 2) from None
    if address.startswith("unix:") and not os.path.exists(address[len("unix:"):]):
        raise Failed(f"no kvstore daemon at {address}: the socket does not exist (start one "
                     "with `kvstore serve`, or pass --address / --data-dir)")
    try:
        return address, _credentials(address, args.timeout)
    except KVStoreError as e:       # the handshake (tenants): refused, or no answer
        hint = ("; pass a tenant's token in $KVSTORE_TOKEN, or run as a uid a tenant lists "
                "(docs/security.md)" if isinstance(e, Unauthenticated) else "")
        raise Failed(f"{args.command} at {address}: {e.code}: {e}{hint}") from None


def _rpc(address: str, metadata: tuple | None, method: str, request: Any,
         timeout: float) -> Any:
    """One unary call; Failed with the daemon's answer when it is not OK."""
    import grpc
    from kvstore_client._proto import kvstore_pb2_grpc

    try:
        with grpc.insecure_channel(address) as ch:
            return getattr(kvstore_pb2_grpc.KVStoreStub(ch), method)(
                request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as e:
        if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            raise Failed(f"no kvstore daemon answers at {address} ({e.code().name}: "
                         f"{e.details()}); start one with `kvstore serve` or pass "
                         "--address") from None
        raise Failed(f"{method} at {address} failed: {e.code().name}: {e.details()}") from None


def fail(message: str, code: int = 2) -> int:
    """One line on stderr, the way every kvstore command reports an operator's error."""
    print(f"kvstore: {message}", file=sys.stderr, flush=True)
    return code


def status(args: argparse.Namespace, socket_path: Callable[[argparse.Namespace], str]) -> int:
    import json

    from kvstore_client._proto import kvstore_pb2

    try:
        address, metadata = _connect(args, socket_path)
        resp = _rpc(address, metadata, "Stats",
                    kvstore_pb2.StatsRequest(list_namespaces=args.namespaces), args.timeout)
    except Failed as f:
        return fail(str(f), f.code)
    if args.json:
        print(json.dumps(stats_json(resp), indent=2))
    else:
        print(format_status(resp))
    return 0


def delete(args: argparse.Namespace, socket_path: Callable[[argparse.Namespace], str]) -> int:
    """Delete every block of the namespaces of a model (a shell pattern), in every tier.

    Why: after a model is retired or upgraded, its blocks are never read again, yet they
    stay until eviction gets to them, crowding out the live models' blocks; and an emptied
    namespace is the one a registration at the cap reclaims. Without --yes it only lists
    what it would delete."""
    from fnmatch import fnmatchcase

    from kvstore_client._proto import kvstore_pb2 as pb

    try:
        address, metadata = _connect(args, socket_path)
        resp = _rpc(address, metadata, "Stats", pb.StatsRequest(list_namespaces=True),
                    args.timeout)
        hits = [n for n in resp.namespace_list if fnmatchcase(n.model, args.model)
                and (args.revision is None or n.revision == args.revision)]
        if len(resp.namespace_list) < resp.namespaces:
            fail(f"Stats listed the {len(resp.namespace_list)} namespaces holding most blocks "
                 f"of {resp.namespaces}; run again for the rest", 0)
        what = f"model {args.model!r}" + (f" revision {args.revision!r}"
                                          if args.revision is not None else "")
        if not hits:
            return fail(f"no namespace of {what} at {address}", 1)
        blocks = sum(n.blocks for n in hits)
        if not args.yes:
            print("\n".join(namespace_table(hits)))
            print(f"\n{blocks} blocks in {len(hits)} namespace(s) of {what}; pass --yes to "
                  "delete them")
            return 0
        total = 0
        for n in hits:
            r = _rpc(address, metadata, "Delete",
                     pb.DeleteRequest(namespace_id=n.namespace_id, all=True), args.timeout)
            total += r.deleted
            print(f"deleted {r.deleted} blocks of {n.model} (revision {n.revision or '-'}, "
                  f"{n.codec}, shard {n.shard_rank}/{n.shard_size}, tenant {n.tenant or '-'})")
    except Failed as f:
        return fail(str(f), f.code)
    print(f"deleted {total} blocks in {len(hits)} namespace(s) of {what}")
    return 0
