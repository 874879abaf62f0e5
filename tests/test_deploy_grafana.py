"""The Grafana dashboard queries only metrics p2pkv defines (a renamed metric fails this test)."""

from __future__ import annotations

import ast
import functools
import json
import re
from typing import Any

import pytest

from tests.deploy_support import (
    DASHBOARD,
    ROOT,
)

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                 "offset", "inf", "nan"}


def promql_metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression selects (label matchers, grouping labels, functions, ranges dropped)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)                      # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)                     # range / subquery durations
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in re.finditer(r"(?<![\w:$.])([A-Za-z_:][\w:]*)(\s*\()?", text):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def _dashboard_exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return [v for k, v in node.items() if k == "expr" and isinstance(v, str)] + \
            [e for k, v in node.items() if k != "expr" for e in _dashboard_exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in _dashboard_exprs(v)]
    return []


def engine_metric_definitions() -> dict[str, str]:
    """``name`` → ``counter|histogram|gauge`` as defined in p2pkv/telemetry/metrics.py (read from its source)."""
    tree = ast.parse((ROOT / "p2pkv" / "telemetry" / "metrics.py").read_text())
    kinds = {"_counter_cls": "counter", "_histogram_cls": "histogram", "_gauge_cls": "gauge"}
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in kinds:
            name = next(k.value for k in node.keywords if k.arg == "name")
            assert isinstance(name, ast.Constant) and isinstance(name.value, str)
            out[name.value] = kinds[node.func.attr]
    return out


def proxy_metric_definitions() -> dict[str, str]:
    """``name`` → type, from a live :class:`p2pkv.tools.proxy.proxy_metrics.ProxyMetrics` registry."""
    from p2pkv.tools.proxy.proxy_metrics import ProxyMetrics

    return {family.name: family.type for family in ProxyMetrics().registry.collect()}


def series_names(definitions: dict[str, str]) -> set[str]:
    """The series names Prometheus scrapes for these metric definitions."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {name.removesuffix("_total") + s for name, kind in definitions.items() for s in suffixes[kind]}


def unknown_dashboard_metrics(dashboard: dict[str, Any], known: set[str]) -> set[str]:
    """Metric names the dashboard's queries select that no p2pkv definition produces."""
    return {n for e in _dashboard_exprs(dashboard) for n in promql_metric_names(e)} - known


@functools.cache
def _known_series() -> frozenset[str]:
    return frozenset(series_names(engine_metric_definitions()) | series_names(proxy_metric_definitions()))


def test_promql_metric_name_extraction() -> None:
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(p2pkv:pull_seconds_bucket{job="x"}[$__rate_interval])))'
    ) == {"p2pkv:pull_seconds_bucket"}
    assert promql_metric_names(
        "sum(rate(a_sum[5m])) / sum without (engine) (rate(a_count[5m])) * on (instance) group_left b"
    ) == {"a_sum", "a_count", "b"}
    assert promql_metric_names('count(up{kind="p2pkv:x"} offset 5m) > bool 0') == {"up"}


def test_metric_definitions_are_read_from_the_code() -> None:
    engine = engine_metric_definitions()
    assert engine["p2pkv:pull_seconds"] == "histogram" and engine["p2pkv:pull_failures"] == "counter"
    assert len(engine) >= 8
    proxy = proxy_metric_definitions()
    assert proxy["p2pkv_proxy_requests"] == "counter" and proxy["p2pkv_proxy_overhead_seconds"] == "histogram"
    known = _known_series()
    assert {"p2pkv:pull_bytes_total", "p2pkv:pull_seconds_bucket", "p2pkv_proxy_requests_total"} <= known
    assert "p2pkv:pull_bytes" not in known and "p2pkv:pulls_bucket" not in known


def test_engine_metric_names_match_what_the_engine_exposes() -> None:
    """The names read from p2pkv/telemetry/metrics.py are the series a real P2pKvPromMetrics exposes."""
    from types import SimpleNamespace

    try:
        from p2pkv.telemetry.metrics import P2pKvPromMetrics
    except ImportError as exc:
        pytest.skip(f"vLLM is not importable here ({exc}); the source-read names are checked elsewhere")
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    reg = CollectorRegistry()
    types = {cls: functools.partial(cls, registry=reg) for cls in (Counter, Gauge, Histogram)}
    prom = P2pKvPromMetrics(SimpleNamespace(kv_transfer_config=None), types, ["model_name", "engine"],
                            {0: ["model", "0"]})
    prom.observe({"pull_bytes": [4096], "pull_seconds": [0.002], "pull_descriptors": [4],
                  "handshake_seconds": [0.01], "leases_expired": 1, "leases_notified": 2,
                  "failures": {"timeout": 1}, "transports": {"DRAM:cma": 1}, "phase_seconds": {"read": [0.001]},
                  "directions": {"push": 1}, "push_requests": {"accepted": 1}, "push_writes": {"written": 1},
                  "push_bytes": 4096, "push_agents_unloaded": 1, "streams_landed": {"whole": 1},
                  "kv_checks": {"pull:verified": 1}, "stream_tail_seconds": [0.003, 0.004]})
    engine = {"model_name": "model", "engine": "0"}
    counted = {("p2pkv:kv_checks_total", (("direction", "pull"), ("outcome", "verified"))): 1,
               ("p2pkv:peer_transport_total", (("mem_type", "DRAM"), ("transport", "cma"))): 1,
               ("p2pkv:pull_failures_total", (("kind", "timeout"),)): 1,
               ("p2pkv:leases_notified_total", ()): 2, ("p2pkv:push_bytes_total", ()): 4096,
               ("p2pkv:pulls_total", ()): 1, ("p2pkv:pull_bytes_total", ()): 4096,
               ("p2pkv:stream_tail_seconds_count", ()): 2, ("p2pkv:pull_phase_seconds_count", (("phase", "read"),)): 1}
    assert {key: reg.get_sample_value(key[0], {**engine, **dict(key[1])}) for key in counted} == counted
    exposed = {s.name for fam in reg.collect() for s in fam.samples if not s.name.endswith("_created")}
    assert exposed == series_names(engine_metric_definitions())
    labels = {tuple(sorted(s.labels)) for fam in reg.collect() for s in fam.samples if s.name.endswith("_total")}
    assert ("engine", "kind", "model_name") in labels
    assert ("engine", "mem_type", "model_name", "transport") in labels


def test_dashboard_structure() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert 36 <= dash["schemaVersion"] <= 41
    assert [i["name"] for i in dash["__inputs"]] == ["DS_PROMETHEUS"]
    assert dash["__inputs"][0]["pluginId"] == "prometheus"
    panels = [p for p in dash["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}, p["title"]
        assert p["targets"] and all(t["expr"].strip() for t in p["targets"]), p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    titles = {p["title"] for p in panels}
    for wanted in ("KV pull throughput", "KV pulls per second", "KV pull latency", "NIXL descriptors per pull",
                   "Handshake time", "KV pull failures by kind", "Held prefill requests released",
                   "Proxy requests by status", "Proxy latency", "Proxy overhead"):
        assert wanted in titles
    exprs = " ".join(_dashboard_exprs(dash))
    for q in ("histogram_quantile(0.5, sum by (le) (rate(p2pkv:pull_seconds_bucket",
              "histogram_quantile(0.99, sum by (le) (rate(p2pkv:pull_seconds_bucket",
              "histogram_quantile(0.5, sum by (le) (rate(p2pkv_proxy_overhead_seconds_bucket",
              "sum by (kind) (rate(p2pkv:pull_failures_total", "sum by (endpoint, status) (rate("):
        assert q in exprs, q


def test_dashboard_queries_only_metrics_p2pkv_defines() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert unknown_dashboard_metrics(dash, set(_known_series())) == set()
    # Every metric p2pkv defines has a panel.
    used = {n for e in _dashboard_exprs(dash) for n in promql_metric_names(e)}
    for name in {**engine_metric_definitions(), **proxy_metric_definitions()}:
        assert any(u.startswith(name.removesuffix("_total")) for u in used), f"{name}: no panel"


@pytest.mark.parametrize(("old", "new"), [
    ("p2pkv:pull_bytes_total", "p2pkv:pulled_bytes_total"),   # a renamed metric
    ("p2pkv:pulls_total", "p2pkv:pulls_bucket"),               # a counter read as a histogram
    ("p2pkv_proxy_overhead_seconds_bucket", "p2pkv_proxy_overhead_bucket"),
])
def test_dashboard_check_rejects_unknown_metrics(old: str, new: str) -> None:
    text = DASHBOARD.read_text()
    assert old in text
    dash = json.loads(text.replace(old, new))
    assert unknown_dashboard_metrics(dash, set(_known_series())) == {new}
