"""Configured tenants: who may call the daemon, with which credentials, for which models.

Why tenants are optional: a sidecar serving one engine needs no identities, and `make serve`
must keep working with no config. With no `[tenants.*]` table there is one implicit tenant
that may do everything, exactly as before. As soon as one tenant is configured every call
must say who it is (docs/security.md).

A tenant table (in the daemon config, or in `auth.tokens_file` to keep secrets apart):

    [tenants.team-a]
    token_sha256 = ["<hex sha256 of the bearer token>"]   # docs/security.md: how to hash
    uids = [1001]            # Unix-socket peers with this uid are this tenant (SO_PEERCRED)
    cert_names = ["team-a"]  # mTLS client certificates with this common name
    models = ["llama-*"]     # fnmatch patterns of the models it may register ("*": any)
    admin = false            # admins act on every namespace (Evict, Flush, Stats of all)
    host_quota = "2GiB"      # per-tier byte caps; 0 means no cap of its own
    ssd_quota = "16GiB"
    remote_quota = "0"
    gpu_quota = "4GiB"       # its own slab on every gpu-tier device (0: no gpu slots at all)
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
import tomllib
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError, StoreConfig, parse_size

TENANT_KEY = "kvstore.tenant"       # spec.extra entry naming a namespace's owner (daemon-set)
QUOTA_TIERS = ("host", "ssd", "remote", "gpu")
_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,31}")
_KEYS = {"token_sha256", "uids", "cert_names", "models", "admin", *(f"{t}_quota"
                                                                     for t in QUOTA_TIERS)}


@dataclass(frozen=True)
class Tenant:
    name: str
    token_sha256: frozenset[str] = frozenset()
    uids: frozenset[int] = frozenset()
    cert_names: frozenset[str] = frozenset()
    models: tuple[str, ...] = ("*",)
    admin: bool = False
    quota: dict[str, int] = field(default_factory=dict)    # tier -> bytes (0: none)

    def may_use_model(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, p) for p in self.models)


def hash_token(token: str) -> str:
    """The hex SHA-256 a tenant table stores for a bearer token (never the token itself)."""
    return hashlib.sha256(token.encode()).hexdigest()


def _strings(v: Any, key: str) -> list[str]:
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{key}: expected a string or a list of strings")
    return v


def _tenant(name: str, t: Any) -> Tenant:
    where = f"tenants.{name}"
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: tenant names are 1-32 characters of a-z, 0-9, '_' and '-' "
                          "(they become metric labels)")
    if not isinstance(t, dict):
        raise ConfigError(f"{where}: expected a table")
    unknown = set(t) - _KEYS
    if unknown:
        raise ConfigError(f"{where}.{sorted(unknown)[0]}: unknown setting; known: {sorted(_KEYS)}")
    hashes = [h.lower() for h in _strings(t.get("token_sha256", []), f"{where}.token_sha256")]
    for h in hashes:
        if not re.fullmatch(r"[0-9a-f]{64}", h):
            raise ConfigError(f"{where}.token_sha256: {h[:12]!r}... is not a hex SHA-256 (64 "
                              "hex digits; store the hash of the token, not the token)")
    uids = t.get("uids", [])
    if not isinstance(uids, list) or not all(isinstance(u, int) and u >= 0 for u in uids):
        raise ConfigError(f"{where}.uids: expected a list of non-negative integers")
    admin = t.get("admin", False)
    if not isinstance(admin, bool):
        raise ConfigError(f"{where}.admin: expected true or false")
    quota = {tier: parse_size(t.get(f"{tier}_quota", 0), f"{where}.{tier}_quota")
             for tier in QUOTA_TIERS}
    tenant = Tenant(name=name, token_sha256=frozenset(hashes), uids=frozenset(uids),
                    cert_names=frozenset(_strings(t.get("cert_names", []),
                                                  f"{where}.cert_names")),
                    models=tuple(_strings(t.get("models", ["*"]), f"{where}.models")),
                    admin=admin, quota=quota)
    if not (tenant.token_sha256 or tenant.uids or tenant.cert_names):
        raise ConfigError(f"{where}: give at least one credential (token_sha256, uids or "
                          "cert_names), or the tenant can never be used")
    return tenant


def load_tenants(cfg: StoreConfig) -> dict[str, Tenant]:
    """The configured tenants (config tables plus `auth.tokens_file`); {} when none."""
    tables = dict(cfg.tenants)
    if cfg.auth.tokens_file:
        try:
            with open(cfg.auth.tokens_file, "rb") as f:
                extra = tomllib.load(f)
        except OSError as e:
            raise ConfigError(f"auth.tokens_file: cannot read {cfg.auth.tokens_file}: "
                              f"{e.strerror or e}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"auth.tokens_file: {cfg.auth.tokens_file} is not UTF-8 text "
                              f"(byte {e.start}); TOML files are UTF-8") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"auth.tokens_file: {cfg.auth.tokens_file} is not valid TOML: "
                              f"{e}") from None
        more = extra.get("tenants", {})
        if set(extra) - {"tenants"} or not isinstance(more, dict):
            raise ConfigError(f"auth.tokens_file: {cfg.auth.tokens_file} may hold only "
                              "[tenants.<name>] tables")
        for name in more:
            if name in tables:
                raise ConfigError(f"tenants.{name} is defined both in the config and in "
                                  "auth.tokens_file")
        tables.update(more)
    tenants = {name: _tenant(name, t) for name, t in tables.items()}
    seen: dict[tuple[str, Any], str] = {}
    for t in tenants.values():
        for kind, values in (("token", t.token_sha256), ("uid", t.uids),
                             ("certificate name", t.cert_names)):
            for v in values:
                other = seen.setdefault((kind, v), t.name)
                if other != t.name:
                    raise ConfigError(f"tenants.{t.name} and tenants.{other} share a {kind}; "
                                      "one credential names one tenant")
    return tenants


def quota_overcommit(cfg: StoreConfig, tenants: dict[str, Tenant]) -> list[str]:
    """One warning per shared tier (ssd, remote) whose quotas cannot keep tenants apart.

    A quota caps what a tenant stores; it keeps tenant A's blocks from being pushed out by
    tenant B only while every tenant's cap fits the tier together. When a tenant has no cap
    there, or the caps add up to more than the tier holds, the tier can fill below every cap
    and then evicts by recency across tenants. The operator may want that (overcommit, as
    with memory); it is said at start rather than discovered in an incident.

    Also one per tier that is off while tenants carry a quota for it: the quota does nothing
    there (no gpu slabs of their own are made), and a tenants file shared by nodes with and
    without that tier is legitimate, so it is a warning, not a refusal to start.
    """
    out = []
    for tier in ("gpu", "ssd", "remote"):
        capped = sorted(t.name for t in tenants.values() if t.quota.get(tier))
        if capped and not getattr(cfg, tier).enabled:
            out.append(f"{tier}_quota of tenant(s) {', '.join(capped)} has no effect: the "
                       f"{tier} tier is off ({tier}.enabled = false)")
    for tier in ("ssd", "remote"):
        tc = getattr(cfg, tier)
        if not tenants or not tc.enabled:
            continue
        uncapped = sorted(t.name for t in tenants.values() if not t.quota.get(tier))
        total = sum(t.quota.get(tier, 0) for t in tenants.values())
        if uncapped:
            why = f"tenant(s) {', '.join(uncapped)} have no {tier}_quota"
        elif total > tc.capacity:
            why = f"the {tier}_quota values add up to {total} bytes, more than {tier}.capacity " \
                  f"({tc.capacity})"
        else:
            continue
        out.append(f"{tier} quotas do not isolate tenants: {why}, so the {tier} tier can fill "
                   f"while tenants are under their quotas and then evicts across tenants by "
                   f"recency (docs/security.md, Quotas)")
    return out
