"""Who is at the other end of a TCP connection, for the caps of listeners without
authentication (the metrics endpoint, the KV-events sockets): each peer holds only its own
share of their connections.

Why the uid and not the address: every local user reaches loopback, from any of 127/8's
addresses, so a local peer is named by the user owning its socket, which the kernel's
sock_diag tells for a socket of this host; a remote one by its address.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import struct

log = logging.getLogger("kvstore.peers")


# sock_diag (linux/sock_diag.h, linux/inet_diag.h): one socket's record, asked for by its four
# addresses and ports; the record's owner uid is at _DIAG_UID in the reply's payload.
_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_NLMSG_HEADER = struct.Struct("=IHHII")
_DIAG_UID = 64
_NO_COOKIE = 0xFFFFFFFF


class PeerNames:
    """Whose share a TCP connection counts in: "uid N" when the peer's end is a socket of this
    host (in this network namespace), else its address ("addr A"; an IPv6 peer by its /64,
    "net N", as a host there holds the whole prefix). Used from one thread."""

    def __init__(self) -> None:
        self._nl: socket.socket | None = None
        self._seq = 0
        self._unavailable = not hasattr(socket, "AF_NETLINK")

    def close(self) -> None:
        if self._nl is not None:
            self._nl.close()
            self._nl = None

    def key(self, sock: socket.socket) -> str:
        peer, local = sock.getpeername(), sock.getsockname()
        addr = ipaddress.ip_address(str(peer[0]).split("%")[0])
        here = ipaddress.ip_address(str(local[0]).split("%")[0])
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
            if isinstance(here, ipaddress.IPv6Address) and here.ipv4_mapped is not None:
                here = here.ipv4_mapped
        uid = self._uid(addr, int(peer[1]), here, int(local[1]))
        if uid is not None:
            return f"uid {uid}"
        if addr.version == 6:
            return f"net {ipaddress.ip_network((addr, 64), strict=False)}"
        return f"addr {addr}"

    def _uid(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int,
             here: ipaddress.IPv4Address | ipaddress.IPv6Address, here_port: int) -> int | None:
        """The owner of the socket at addr:port connected to here:here_port, or None: not a
        socket of this host, gone already, or sock_diag unavailable (a kernel without it)."""
        if self._unavailable or addr.version != here.version:
            return None
        family = socket.AF_INET if addr.version == 4 else socket.AF_INET6
        req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF)
        req += struct.pack("!HH", port, here_port)
        req += addr.packed.ljust(16, b"\0") + here.packed.ljust(16, b"\0")
        req += struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        msg = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(req), _SOCK_DIAG_BY_FAMILY,
                                 _NLM_F_REQUEST, self._seq, 0) + req
        try:
            if self._nl is None:
                self._nl = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM,
                                         _NETLINK_SOCK_DIAG)
                self._nl.settimeout(0.2)        # the kernel answers within the send
            self._nl.send(msg)
            while True:
                data = self._nl.recv(8192)
                _, kind, _, seq, _ = _NLMSG_HEADER.unpack_from(data)
                if seq == self._seq:
                    break
        except OSError as e:
            if self._nl is None:                # no sock_diag here: by address from now on
                log.info("peers of this host told apart by address only (no sock_diag: %s)", e)
                self._unavailable = True
            else:
                self._nl.close()
                self._nl = None
            return None
        if kind == _NLMSG_ERROR or len(data) < _NLMSG_HEADER.size + _DIAG_UID + 4:
            return None                         # (ENOENT: not a socket of this host)
        return struct.unpack_from("=I", data, _NLMSG_HEADER.size + _DIAG_UID)[0]
