"""NamespaceInfo: a registered namespace as the store and its movement half both see it.

Its own module so kvstore/movement.py can name it without importing kvstore/store.py (which
imports movement): no import cycle.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore_client.common.layout import NamespaceSpec


@dataclass(frozen=True)
class NamespaceInfo:
    ns_id: bytes
    spec: NamespaceSpec

    @property
    def block_bytes(self) -> int:
        return self.spec.layout.block_bytes
