"""Who is calling, and may they touch this namespace or lease.

Identity, per call, from the first of:
- `authorization: Bearer <token>` metadata: the token's SHA-256 names a tenant, or names a
  session the Unix-socket handshake (kvstore/handoff.py) issued to a peer uid;
- the common name of the mTLS client certificate (TCP with auth.tls_client_ca_file).
No tenants configured: every call is the implicit tenant, which may do everything (as before).

Authorization: a namespace belongs to the tenant that registered it. The daemon writes the
owner into the spec (extra["kvstore.tenant"]), so the namespace id is derived from it: two
tenants registering the same model get two namespaces, and knowing another tenant's namespace
id (or lease id) grants nothing. Admin tenants act on every namespace.

Why a thread-local for the caller: the servicer's RPC methods parse their own request (the
namespace id is only known after that), and each call runs on one worker thread from start to
end (streams included), so the gate (kvstore/gate.py) binds the caller once and the methods
check it where they need it without a second parse.

One answer for "unknown" and "not yours": a namespace id is derived from its spec, owner
included, so a tenant can compute the id another tenant's model would have. Answering
PERMISSION_DENIED for a foreign id and NOT_FOUND for an unknown one would tell it whether the
other tenant registered that model; both get the store's NOT_FOUND text instead, and so do
another tenant's lease ids.
"""

from __future__ import annotations

import hashlib
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any

from kvstore_client.common.errors import (
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
)
from kvstore_client.common.layout import NamespaceSpec

from .tenants import TENANT_KEY, Tenant

SESSIONS_PER_TENANT = 4096     # handshake sessions remembered per tenant (limits.*)
MAX_AUTHORIZATION = 4096       # characters of an authorization metadata value


class Auth:
    """Identity and ownership checks; with no tenants every check passes at no cost."""

    def __init__(self, tenants: dict[str, Tenant], owner_of: Callable[[bytes], str | None],
                 lease_ns: Callable[[str], bytes | None],
                 namespaces: Callable[[], Iterable[tuple[bytes, str | None]]],
                 mtls: bool = False) -> None:
        self.tenants = tenants
        self.enabled = bool(tenants)
        self.mtls = mtls
        self._owner_of = owner_of            # ns_id -> owner ("": nobody, None: unknown ns)
        self._lease_ns = lease_ns            # lease id -> its namespace id (None: unknown)
        self._namespaces = namespaces        # every (ns_id, owner)
        self._by_hash = {h: t for t in tenants.values() for h in t.token_sha256}
        self._by_uid = {u: t for t in tenants.values() for u in t.uids}
        self._by_cert = {c: t for t in tenants.values() for c in t.cert_names}
        self.sessions_per_tenant = SESSIONS_PER_TENANT
        # token hash -> tenant; one insertion-ordered dict per tenant, so a tenant that makes
        # sessions without end forgets its own oldest, never another tenant's.
        self._sessions: dict[str, Tenant] = {}
        self._by_tenant: dict[str, OrderedDict[str, None]] = {}
        # metadata value -> tenant: skips the hash on every call after the first. Only values
        # of live credentials are kept, and a forgotten session's goes with it (_value_of).
        self._seen: dict[str, Tenant] = {}
        self._value_of: dict[str, str] = {}     # session token hash -> its metadata value
        self._lock = threading.Lock()
        self._owners: dict[bytes, str | None] = {}
        self._local = threading.local()

    # -- identity -----------------------------------------------------------------------------
    def no_credentials(self) -> Unauthenticated:
        return Unauthenticated(
            "no credentials: this daemon has tenants, so every call must carry "
            "'authorization: Bearer <token>' metadata (kvstore_client.connect(..., "
            "token=...)); on the Unix socket the SDK can instead prove your uid, if a "
            "tenant lists it in `uids`" + (", or present a client certificate over mTLS"
                                           if self.mtls else ""))

    def from_metadata(self, metadata: Sequence[tuple[str, Any]]) -> Tenant | None:
        """The tenant an `authorization: Bearer` entry names (None: no such entry); raises
        Unauthenticated for a malformed or unknown one. Cheap enough for the gRPC server's
        own thread (kvstore/gate.py): a dict lookup, or one SHA-256 per new token."""
        for key, value in metadata:
            if key != "authorization":
                continue
            if not isinstance(value, str) or not value.startswith("Bearer ") \
                    or len(value) > MAX_AUTHORIZATION:
                raise Unauthenticated("the authorization metadata must be 'Bearer <token>'")
            seen = self._seen.get(value)
            if seen is not None:
                return seen
            h = hashlib.sha256(value[7:].encode()).hexdigest()
            tenant = self._by_hash.get(h) or self._sessions.get(h)
            if tenant is None:
                raise Unauthenticated("the bearer token matches no tenant of this daemon (or a "
                                      "session of a daemon run that has ended: reconnect)")
            with self._lock:
                if h in self._by_hash:
                    self._seen[value] = tenant
                elif self._sessions.get(h) is tenant:       # not forgotten meanwhile
                    self._seen[value] = tenant
                    self._value_of[h] = value
            return tenant
        return None

    def from_certificate(self, context: Any) -> Tenant | None:
        if not self.mtls:
            return None
        names = (context.auth_context() or {}).get("x509_common_name") or []
        for n in names:
            tenant = self._by_cert.get(n.decode(errors="replace") if isinstance(n, bytes) else n)
            if tenant is not None:
                return tenant
        return None

    def by_bearer(self, token: str) -> Tenant | None:
        """The tenant a bearer token stands for: a configured token or a handshake session."""
        h = hashlib.sha256(token.encode()).hexdigest()
        return self._by_hash.get(h) or self._sessions.get(h)

    def bind(self, tenant: Tenant | None) -> None:
        """Make `tenant` this thread's caller (the lane: identified once per connection)."""
        if self.enabled:
            self._local.tenant = tenant

    def by_uid(self, uid: int) -> Tenant | None:
        return self._by_uid.get(uid)

    def by_token(self, token: str) -> Tenant | None:
        return self._by_hash.get(hashlib.sha256(token.encode()).hexdigest())

    def new_session(self, tenant: Tenant) -> str:
        """A bearer token standing for `tenant` until the daemon stops (handshake result), or
        until the tenant has made `sessions_per_tenant` newer ones."""
        token = secrets.token_urlsafe(32)
        h = hashlib.sha256(token.encode()).hexdigest()
        with self._lock:
            mine = self._by_tenant.setdefault(tenant.name, OrderedDict())
            mine[h] = None
            self._sessions[h] = tenant
            while len(mine) > self.sessions_per_tenant:
                old, _ = mine.popitem(last=False)
                del self._sessions[old]
                value = self._value_of.pop(old, None)
                if value is not None:
                    self._seen.pop(value, None)
        return token

    @property
    def caller(self) -> Tenant | None:
        """The tenant of the RPC running on this thread (None: implicit, may do everything)."""
        return getattr(self._local, "tenant", None) if self.enabled else None

    # -- authorization ------------------------------------------------------------------------
    def tag(self, spec: NamespaceSpec) -> NamespaceSpec:
        """The spec a RegisterNamespace really registers: owned by the caller."""
        if TENANT_KEY in spec.extra:
            raise InvalidArgument(f"spec.extra[{TENANT_KEY!r}] is set by the daemon, not by "
                                  "clients; remove it")
        t = self.caller
        if t is None:
            return spec
        if not t.may_use_model(spec.model):
            raise PermissionDenied(f"tenant {t.name} may not register model {spec.model!r} "
                                   f"(its models: {', '.join(t.models)})")
        return replace(spec, extra={**spec.extra, TENANT_KEY: t.name})

    def check_ns(self, ns_id: bytes) -> None:
        t = self.caller
        if t is None or t.admin:
            return
        owner = self._owners.get(ns_id)
        if owner is None:
            owner = self._owner_of(ns_id)
            if owner is not None:
                self._owners[ns_id] = owner
        if owner != t.name:             # unknown, or another tenant's: one answer
            raise NotFound(f"unknown namespace {bytes(ns_id).hex()}; register it first "
                           f"(tenant {t.name} sees only the namespaces it registered)")

    def check_tier(self, tier: str) -> None:
        """gpu slots: a tenant with a gpu_quota leases them in its own slabs; the shared slabs
        are for admins only (every client mapping them could read every tenant's blocks)."""
        t = self.caller
        if tier == "gpu" and t is not None and not t.admin and not t.quota.get("gpu"):
            raise PermissionDenied(f"tenant {t.name} may not lease gpu slots: it has no "
                                   f"gpu_quota (its own device slabs) and the shared slabs are "
                                   f"for admins; set tenants.{t.name}.gpu_quota or use 'host'")

    def check_lease(self, lease_id: str) -> None:
        t = self.caller
        if t is None or t.admin:
            return
        ns = self._lease_ns(lease_id)
        if ns is None:              # unknown or expired: the store says so
            return
        try:
            self.check_ns(ns)
        except NotFound:
            raise NotFound(f"unknown lease {lease_id!r} (released already, or from another "
                           "daemon run)") from None

    def scope(self) -> set[bytes] | None:
        """The namespaces an Evict, Flush or Stats of this caller covers (None: all)."""
        t = self.caller
        if t is None or t.admin:
            return None
        return {ns for ns, owner in self._namespaces() if owner == t.name}


def store_auth(store: Any, tenants: dict[str, Tenant], mtls: bool = False) -> Auth:
    """An Auth reading ownership from a Store (a namespace registered before tenants were
    configured is owned by nobody: only admins reach it)."""
    def owner_of(ns_id: bytes) -> str | None:
        info = store.namespaces.get(ns_id)
        return None if info is None else info.spec.extra.get(TENANT_KEY, "")

    def lease_ns(lease_id: str) -> bytes | None:
        lease = store.leases.find(lease_id)
        return None if lease is None else lease.ns_id

    def namespaces() -> list[tuple[bytes, str | None]]:
        return [(ns, info.spec.extra.get(TENANT_KEY, ""))
                for ns, info in list(store.namespaces.items())]
    return Auth(tenants, owner_of, lease_ns, namespaces, mtls=mtls)


OPEN = Auth({}, lambda ns: None, lambda lid: None, lambda: [])
"""No tenants: every check passes (servicers built without an Auth use this)."""
