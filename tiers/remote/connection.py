"""How this process talks to one Redis / Valkey node: redis-py's options from the tier's config
and URLs, and the text of a connection failure an operator can act on.

Why its own module: the options are built once and shared by the standalone client, the
cluster client and every node connection the cluster client makes, and they carry the rules
that are easy to get wrong (a rediss:// URL must keep the CA and client certificate of the
config; `parse_url`'s pool options are not client options). The error text exists because
redis-py's own messages often hide the cause (a wrong password, a certificate the server
refused), and `stats["last_error"]` is what an operator reads.

The config is duck-typed (any object with RemoteConfig's attribute names): tiers never import
kvstore.
"""

from __future__ import annotations

import inspect
import re
import ssl
from collections.abc import Iterable
from typing import Any
from urllib.parse import unquote, urlsplit

import redis
from kvstore_client.common.errors import InvalidArgument
from redis.connection import parse_url
from redis.exceptions import AuthenticationError

ERROR_CHARS = 300               # last_error strings are cut to this length
# How long after the deadline a node's sockets time out (see connection_kwargs).
SOCKET_GRACE_S = 1.0
# No CLIENT SETINFO on connect (redis-py >= 5 sends LIB-NAME and LIB-VER, one round trip each,
# before a new connection's first command): named as the installed redis-py names it.
NO_SETINFO: dict[str, Any] = (
    {"driver_info": None} if "driver_info" in inspect.signature(redis.Redis.__init__).parameters
    else {"lib_name": None, "lib_version": None})


def cfg_value(cfg: Any, name: str, default: Any) -> Any:
    """`cfg.name`, or `default` where it is missing or None."""
    value = getattr(cfg, name, default)
    return default if value is None else value


def mask_url(url: str) -> str:
    """`url` with its password (userinfo or `?password=`) replaced by `***`, for messages."""
    try:
        netloc = urlsplit(url).netloc
    except ValueError:
        netloc = ""
    out = url
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        if colon:
            out = url.replace(netloc, f"{user}:***@{host}", 1)
    elif "@" in url:        # not a URL urlsplit can read: keep only what follows the last @
        out = "***@" + url.rpartition("@")[2]
    return re.sub(r"([?&]password=)[^&#]*", r"\1***", out)


def url_secrets(urls: Iterable[str], password: str = "") -> list[str]:
    """The passwords a config carries (remote.password and those in the URLs, as written and
    decoded): error texts are scrubbed of them before anyone can read them."""
    found = {password} if password else set()
    for url in urls:
        try:
            pw = urlsplit(url).password
        except ValueError:
            pw = None
        if pw:
            found |= {pw, unquote(pw)}
        for m in re.finditer(r"[?&]password=([^&#]*)", url):
            if m.group(1):
                found |= {m.group(1), unquote(m.group(1))}
    # longest first, so a password that contains another is replaced whole
    return sorted(found, key=len, reverse=True)


def scrub(text: str, secrets: Iterable[str]) -> str:
    for s in secrets:
        if s:
            text = text.replace(s, "***")
    return text


def check_urls(urls: list[str], cluster: bool) -> None:
    """Refuse a URL redis-py could not use, naming `remote.urls` and the URL (password masked).

    Called by the tier's constructor in both modes: a cluster's URLs are otherwise only read
    by the background discovery, where a typo would keep the tier down for ever, silently.
    """
    for url in urls:
        shown = mask_url(str(url))
        why = ""
        if not isinstance(url, str):
            why = "not a string"
        else:
            try:
                kw = parse_url(url)
            except ValueError as e:             # bad scheme, port, or query option
                why = scrub(str(e), url_secrets([url]))
            else:
                if url.startswith("unix://"):
                    if cluster:
                        why = "a cluster's seed nodes need redis:// or rediss:// host:port URLs"
                    elif not kw.get("path"):
                        why = "a unix:// URL needs the socket's path (unix:///path/to/redis.sock)"
        if why:
            raise InvalidArgument(f"remote.urls: cannot use {shown!r}: {why}")


def url_kwargs(url: str) -> dict[str, Any]:
    """`redis.Redis` options for a redis://, rediss:// or unix:// URL.

    `parse_url` returns ConnectionPool options (`connection_class`, `path`), which
    `redis.Redis(**kw)` rejects with a TypeError; the client takes `ssl=True` and
    `unix_socket_path=` instead.
    """
    kw = dict(parse_url(url))
    cls = kw.pop("connection_class", None)
    if cls is redis.SSLConnection:
        kw["ssl"] = True
    elif cls is redis.UnixDomainSocketConnection:
        kw["unix_socket_path"] = kw.pop("path")
    return kw


def connection_kwargs(cfg: Any, tls: bool) -> dict[str, Any]:
    """Options passed through to redis-py for every node connection.

    `tls`: `tls = true` or a rediss:// URL; either way the CA and client certificate apply
    (a rediss:// URL alone must not silently drop them and fail verification).
    """
    deadline = float(cfg_value(cfg, "deadline_ms", 200)) / 1000.0
    kw: dict[str, Any] = {
        # The caller stops waiting at the deadline (and counts a timeout); the sockets give
        # up SOCKET_GRACE_S later, only to free a worker thread stuck on a server that
        # never answers. A socket timeout equal to the deadline would race the caller's
        # wait and, on a busy machine, end some batches first as plain errors.
        "socket_timeout": deadline + SOCKET_GRACE_S,
        "socket_connect_timeout": deadline + SOCKET_GRACE_S,
        "socket_keepalive": True,
        # Large replies: read big chunks (fewer hiredis feeds; see docs/remote.md figures).
        "socket_read_size": int(cfg_value(cfg, "socket_read_size", 1 << 20)),
        "health_check_interval": int(cfg_value(cfg, "health_check_interval_s", 30)),
        # A new connection pays its round trips (TCP, TLS, AUTH) inside the first call's
        # deadline; redis-py's two CLIENT SETINFO calls would add two more for a label in
        # CLIENT LIST. At 100 ms to the server they alone outlast the default deadline.
        **NO_SETINFO,
    }
    if cfg_value(cfg, "username", ""):
        kw["username"] = cfg.username
    if cfg_value(cfg, "password", ""):
        kw["password"] = cfg.password
    if tls:
        kw["ssl"] = True
        if cfg_value(cfg, "tls_ca_file", ""):
            kw["ssl_ca_certs"] = cfg.tls_ca_file
        if cfg_value(cfg, "tls_cert_file", ""):
            kw["ssl_certfile"] = cfg.tls_cert_file
        if cfg_value(cfg, "tls_key_file", ""):
            kw["ssl_keyfile"] = cfg.tls_key_file
    return kw


def _chain(err: BaseException) -> list[BaseException]:
    """`err` and the exceptions it was raised from (redis-py wraps ssl/socket errors)."""
    out: list[BaseException] = []
    e: BaseException | None = err
    while e is not None and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def describe_error(err: BaseException | str, *, tls: bool = False,
                   client_cert: bool = False, secrets: Iterable[str] = ()) -> str:
    """A last-error string that names the cause an operator can act on.

    redis-py's own messages hide it in two common cases: a wrong or missing password reads
    "invalid username-password pair" or "HELLO must be called ...", and a server that requires a
    client certificate just closes the TLS connection ("EOF occurred in violation of protocol").
    An untrusted server certificate already says "certificate verify failed"; it gets a prefix.
    `secrets` (see url_secrets) are replaced by `***`: the text is logged and shown in stats.
    """
    if isinstance(err, str):
        return scrub(err, secrets)[:ERROR_CHARS]
    text = f"{type(err).__name__}: {err}"
    chain = _chain(err)
    if any(isinstance(e, AuthenticationError) for e in chain):
        text = f"authentication failed (check remote.username/password): {text}"
    elif any(isinstance(e, ssl.SSLCertVerificationError) for e in chain):
        text = f"TLS: server certificate not trusted (check remote.tls_ca_file): {text}"
    elif tls and any(isinstance(e, ssl.SSLEOFError) or "alert certificate" in str(e)
                     for e in chain):
        why = ("the server may have rejected the client certificate" if client_cert else
               "the server may require a client certificate (remote.tls_cert_file/key_file)")
        text = f"TLS: connection closed by the server during setup; {why}: {text}"
    elif any(isinstance(e, ssl.SSLError) for e in chain):
        text = f"TLS: {text}"
    return scrub(text, secrets)[:ERROR_CHARS]
