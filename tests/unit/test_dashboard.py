"""The Grafana dashboard only queries metrics the workers actually export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import gpu_runtime.proc.metrics  # noqa: F401  (registers the metrics)

DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "milestone-dashboard.json"


def exported_names() -> set[str]:
    """Series names as Prometheus sees them (a labelled family has no sample until used)."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {
        family.name + suffix
        for family in REGISTRY.collect()
        for suffix in suffixes.get(family.type, ("",))
    }


def test_dashboard_queries_exported_metrics() -> None:
    doc = json.loads(DASHBOARD.read_text())
    used = {
        name
        for panel in doc["panels"]
        for target in panel["targets"]
        for name in re.findall(r"milestone_[a-z_]+", target["expr"])
    }
    assert used, "the dashboard queries nothing"
    missing = used - exported_names()
    assert not missing, f"dashboard queries unknown metrics: {sorted(missing)}"
