"""packaging/grafana/wcd.json, the dashboard the .deb installs under /usr/share/wcd/grafana/: it
loads as JSON and every expression names metrics, and groups by labels, that a real daemon exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.integration.test_daemon import model_config

DASHBOARD = Path(__file__).resolve().parents[2] / "packaging" / "grafana" / "wcd.json"


def expressions() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    found = [(p["title"], t["expr"]) for p in dash["panels"] for t in p.get("targets", [])]
    found += [(v["name"], v["definition"]) for v in dash["templating"]["list"] if v["type"] == "query"]
    return found


def test_every_expression_names_an_exported_metric(make_daemon, checkpoint):
    path, _ = checkpoint
    d = make_daemon(model_config(path))
    with d.client() as c, c.acquire("m"):
        text = c.metrics()
    labels: dict[str, set[str]] = {}  # sample name -> its label names
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    exprs = expressions()
    assert len(exprs) >= 10
    for title, expr in exprs:
        names = set(re.findall(r"\bwcd_\w+", expr))
        assert names, (title, expr)
        assert names <= set(labels), f"{title}: {sorted(names - set(labels))} not exported; have {sorted(labels)}"
        known = set().union(*(labels[n] for n in names)) | {"le", "instance", "job"}
        for group in re.findall(r"\bby \(([^)]*)\)", expr):
            wanted = {g.strip() for g in group.split(",")}
            assert wanted <= known, f"{title}: grouped by {sorted(wanted - known)}, which {sorted(names)} lack"
        for label in re.findall(r"[{,]\s*(\w+)\s*=~?\s*\"", expr):
            assert label in known, f"{title}: selects on {label}, which {sorted(names)} lack"


def test_the_panels_the_issue_asks_for():
    titles = " / ".join(t for t, _ in expressions()).lower()
    for wanted in ("resident bytes", "budget", "entries by state", "leases by uid", "load throughput", "phase",
                   "latency", "failure"):
        assert wanted in titles, wanted
