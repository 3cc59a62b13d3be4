"""The residency seam: every change of where a block lives goes through BlockIndex's residency
methods, which tell one listener. KV events depend on it: a change made by assigning an
Entry's fields directly would never be published."""

from __future__ import annotations

import ast
from pathlib import Path

from kvstore.index import GPU, HOST, REMOTE, SSD, BlockIndex, Entry

ROOT = Path(__file__).resolve().parent.parent
RESIDENCY_FIELDS = {"host", "ssd", "remote", "gpu", "gpu_dev"}
SEAM = ROOT / "kvstore" / "index.py"


def _violations(path: Path) -> list[str]:
    """Assignments to a residency field of anything but `self` (a tier object attribute such
    as `self.host = HostTier(...)` is not a block's residency), and Entry(...) calls that pass
    residency as keywords."""
    out = []
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        flat: list[ast.expr] = []
        for t in targets:
            flat += list(t.elts) if isinstance(t, ast.Tuple) else [t]
        for t in flat:
            if (isinstance(t, ast.Attribute) and t.attr in RESIDENCY_FIELDS
                    and not (isinstance(t.value, ast.Name) and t.value.id == "self")):
                out.append(f"{path.relative_to(ROOT)}:{node.lineno}: assigns .{t.attr}")
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id == "Entry"
                and any(k.arg in RESIDENCY_FIELDS for k in node.keywords)):
            out.append(f"{path.relative_to(ROOT)}:{node.lineno}: Entry(...) with residency")
    return out


def test_no_residency_change_bypasses_the_seam():
    files = sorted((ROOT / "kvstore").rglob("*.py")) + sorted((ROOT / "tiers").rglob("*.py"))
    bad = [v for f in files if f != SEAM for v in _violations(f)]
    assert not bad, ("residency changes outside kvstore/index.py (use BlockIndex.set_host / "
                     "clear_host / set_gpu / clear_gpu / set_ssd / set_remote / discard):\n"
                     + "\n".join(bad))


def test_the_check_finds_a_direct_assignment(tmp_path):
    f = ROOT / "kvstore" / "_seam_probe_never_committed.py"
    try:
        f.write_text("def f(e):\n    e.ssd = True\n    e.gpu, e.gpu_dev = 1, 0\n")
        assert len(_violations(f)) == 3
    finally:
        f.unlink()


class _Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[bytes, str, bool]] = []

    def changed(self, e: Entry, tier: str, entered: bool) -> None:
        self.seen.append((e.key, tier, entered))

    def discarded(self, e: Entry) -> None:
        for tier, on in ((GPU, e.gpu is not None), (HOST, e.host is not None), (SSD, e.ssd),
                         (REMOTE, e.remote)):
            if on:
                self.seen.append((e.key, tier, False))


def test_listener_hears_changes_only():
    ix = BlockIndex()
    rec = _Recorder()
    ix.listener = rec
    ns = b"n" * 16
    e = Entry(ns, b"k" * 16, None, 8, 1)
    ix.add(e)
    ix.set_host(e, 4096)
    ix.set_host(e, 8192)            # a new offset is no change of residency
    ix.set_ssd(e)
    ix.set_ssd(e)
    ix.clear_host(e)
    ix.clear_host(e)
    assert not ix.drop_if_gone(e)
    ix.set_remote(e)
    ix.set_ssd(e, False)
    ix.set_remote(e, False)
    assert ix.drop_if_gone(e) and ix.get(e.gkey) is None
    k = b"k" * 16
    assert rec.seen == [(k, HOST, True), (k, SSD, True), (k, HOST, False), (k, REMOTE, True),
                        (k, SSD, False), (k, REMOTE, False)]


def test_discard_reports_every_tier_left_even_packed():
    ix = BlockIndex()
    rec = _Recorder()
    ns = b"n" * 16
    ix.load_ssd([(ns + b"a" * 16, None, 8, 1)])   # packed, SSD only, before the listener
    ix.listener = rec
    ix.discard(ns + b"a" * 16)
    assert rec.seen == [(b"a" * 16, SSD, False)]
    e = Entry(ns, b"b" * 16, None, 8, 1)
    ix.add(e)
    ix.set_gpu(e, 0, 0)
    ix.set_host(e, 0)
    rec.seen.clear()
    ix.discard(e.gkey)
    assert rec.seen == [(b"b" * 16, GPU, False), (b"b" * 16, HOST, False)]
