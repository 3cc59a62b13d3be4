"""The monitoring kit in deploy/ against a live daemon: the Grafana dashboard is a valid
dashboard whose every expression names metrics the daemon exports, the alert rules pass
promtool (where installed), and every series exists at 0 from the first scrape.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from kvstore.metrics import RPC_CODES, rpc_methods

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana-dashboard.json"
ALERTS = ROOT / "deploy" / "prometheus-alerts.yml"
ALERT_TESTS = ROOT / "deploy" / "prometheus-alerts.test.yml"
PANEL_TYPES = {"row", "timeseries", "stat", "gauge", "bargauge", "table", "text"}
_METRIC = re.compile(r"\bkvstore_[a-z0-9_]+")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(url: str) -> dict[str, dict[str, float]]:
    """{metric name: {label text: value}} of one /metrics page."""
    with urllib.request.urlopen(url, timeout=30) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = _SAMPLE.match(line)
        assert m, line
        out.setdefault(m.group(1), {})[m.group(2) or ""] = float(m.group(3))
    return out


def _names(expr: str) -> set[str]:
    return set(_METRIC.findall(expr))


def _panels(d: dict) -> list[dict]:
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def test_dashboard_is_a_valid_grafana_dashboard():
    d = json.loads(DASHBOARD.read_text())
    assert d["title"] and d["uid"] and isinstance(d["schemaVersion"], int)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    panels = _panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    graphs = [p for p in panels if p["type"] != "row"]
    assert len(graphs) >= 10
    for p in panels:
        assert p["type"] in PANEL_TYPES, p["type"]
        g = p["gridPos"]
        assert {"h", "w", "x", "y"} <= g.keys() and 0 <= g["x"] and g["x"] + g["w"] <= 24
    for p in graphs:
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert _names(t["expr"]), (p["title"], t["expr"])
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
    # What the dashboard must show.
    exprs = " ".join(t["expr"] for p in graphs for t in p["targets"])
    for needed in ("kvstore_tier_hits_total", "kvstore_tier_used_bytes",
                   "kvstore_tier_capacity_bytes", "kvstore_bytes_moved_total",
                   "kvstore_rpc_duration_seconds_bucket", "kvstore_rpc_errors_total",
                   "kvstore_active_leases"):
        assert needed in exprs, needed
    assert "histogram_quantile(0.99" in exprs


def _alert_exprs() -> list[str]:
    return [m.group(1) for m in re.finditer(r"^\s+expr: (.+)$", ALERTS.read_text(), re.M)]


def test_every_dashboard_and_alert_metric_is_exported(daemon):
    """Scraped before any RPC: the series exist from the start, or the panels stay empty."""
    exported = scrape(daemon.metrics_url)
    d = json.loads(DASHBOARD.read_text())
    named = {n for p in _panels(d) for t in p.get("targets", []) for n in _names(t["expr"])}
    named |= {n for e in _alert_exprs() for n in _names(e)}
    assert len(named) >= 15
    # The remote tier's series exist only with the remote tier on (this daemon has none):
    # tests/test_remote_up.py checks the rules' kvstore_remote_* names against one that has.
    missing = sorted(n for n in named if n not in exported
                     and not n.startswith("kvstore_remote_"))
    assert not missing, missing
    assert {"KVStoreDown", "KVStoreInternalErrors", "KVStoreTierFull",
            "KVStoreCorruptBlocks"} <= set(re.findall(r"alert: (\w+)", ALERTS.read_text()))


def test_every_series_starts_at_zero(daemon):
    exported = scrape(daemon.metrics_url)
    errors = exported["kvstore_rpc_errors_total"]
    for method in rpc_methods():
        assert errors[f'{{code="INTERNAL",method="{method}"}}'] == 0.0, method
        assert f'{{method="{method}"}}' in exported["kvstore_rpc_duration_seconds_count"]
        for code in RPC_CODES:
            assert f'{{code="{code}",method="{method}"}}' in exported["kvstore_rpcs_total"]
    for tier in ("host", "ssd"):
        for field in ("stored", "demotions", "demotions_in", "promotions", "read_hits",
                      "evictions", "hits", "misses"):
            assert exported[f"kvstore_tier_{field}_total"][f'{{tier="{tier}"}}'] == 0.0
    for path in ("client->host", "host->client", "host->ssd", "ssd->host"):
        assert exported["kvstore_bytes_moved_total"][f'{{path="{path}"}}'] == 0.0
    for codec in ("lossless", "fp8_e4m3", "int8"):
        assert exported["kvstore_codec_bytes_in_total"][f'{{codec="{codec}"}}'] == 0.0
    for name in ("kvstore_corrupt_blocks_total", "kvstore_leases_expired_total",
                 "kvstore_lookups_total"):
        assert exported[name][""] == 0.0


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus provides it)")
    res = subprocess.run([promtool, "check", "rules", str(ALERTS)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    res = subprocess.run([promtool, "test", "rules", str(ALERT_TESTS)], capture_output=True,
                         text=True, timeout=60, cwd=ALERT_TESTS.parent)
    assert res.returncode == 0, res.stdout + res.stderr
