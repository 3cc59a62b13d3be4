"""Every tier class satisfies the contract the moves use it by (tiers/base.py).

The contracts are Protocols the tier classes do not inherit from, so nothing else would notice
a tier that lost a method, renamed a parameter or a contract that grew one no tier has: the
moves would fail on the first block that takes that path. Checked two ways: the tiers a real
store opens (host, tenant segments, the CPU device, SSD) are isinstance of their contract, and
every contract method exists on every class that must provide it (the CUDA device and the
remote tier too, which this machine need not be able to open) with the contract's parameters.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from tiers.base import DeviceSlotTier, DiskTier, KeyedTier, NetworkTier, SlotTier
from tiers.device_cpu import CpuDeviceTier
from tiers.gpu import GPUTier
from tiers.host import HostTier
from tiers.host_segments import SegmentedHost
from tiers.remote import RemoteTier
from tiers.ssd import SSDTier

from .store_helpers import make_store

CLASSES = [(HostTier, SlotTier), (SegmentedHost, SlotTier), (CpuDeviceTier, DeviceSlotTier),
           (GPUTier, DeviceSlotTier), (SSDTier, DiskTier), (RemoteTier, NetworkTier)]


def methods(proto: type) -> dict[str, inspect.Signature]:
    """The contract's methods (its own and its bases'), by name."""
    out: dict[str, inspect.Signature] = {}
    for base in reversed(proto.__mro__):
        if base in (object,) or base.__name__ in ("Protocol", "Generic"):
            continue
        for name, value in vars(base).items():
            if inspect.isfunction(value) and not name.startswith("_"):
                out[name] = inspect.signature(value)
    return out


@pytest.mark.parametrize(("cls", "proto"), CLASSES, ids=lambda x: x.__name__)
def test_every_contract_method_exists_with_its_parameters(cls: type, proto: type) -> None:
    wanted = methods(proto)
    assert wanted, f"{proto.__name__} names no method"
    for name, sig in wanted.items():
        impl = getattr(cls, name, None)
        assert impl is not None, f"{cls.__name__} lacks {proto.__name__}.{name}"
        if isinstance(inspect.getattr_static(cls, name), property):
            continue
        have = inspect.signature(impl).parameters
        for p in sig.parameters.values():
            if p.name == "self":
                continue
            assert p.name in have, (f"{cls.__name__}.{name} has no parameter {p.name!r} that "
                                    f"{proto.__name__}.{name} passes")
            if p.default is not inspect.Parameter.empty:
                assert have[p.name].default is not inspect.Parameter.empty, \
                    f"{cls.__name__}.{name}: {p.name!r} is optional in the contract, not here"


def test_the_tiers_a_store_opens_are_their_contracts(tmp_path: Path) -> None:
    with make_store(tmp_path, gpu_capacity=1 << 20) as store:
        assert isinstance(store.host, SlotTier)
        (dev,) = store.gpu
        assert isinstance(store.gpu[dev], DeviceSlotTier)
        assert isinstance(store.ssd, DiskTier) and isinstance(store.ssd, KeyedTier)
        assert not isinstance(store.ssd, SlotTier)      # the contracts tell the kinds apart


def test_tenant_segments_are_a_slot_tier(tmp_path: Path) -> None:
    shared = HostTier(8 << 20, shm_name=None, prefault=False)
    try:
        seg = SegmentedHost(shared, {"a": 2 << 20})
        assert isinstance(seg, SlotTier)
    finally:
        shared.close()


def test_a_tier_missing_a_method_is_not_its_contract() -> None:
    """The check can fail: a class without `put_filled` is no DiskTier."""
    class Half:
        name, capacity, used_bytes = "ssd", 0, 0

        def delete_many(self, gkeys): ...

        def close(self): ...
    assert isinstance(Half(), KeyedTier) and not isinstance(Half(), DiskTier)
