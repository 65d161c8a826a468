"""docker/grafana-dashboard.json against what it reads: every series a panel queries is one the services
export (prometheus_client's registry, once services.server.metrics is imported) or the process collector's,
and every job it names is one docker/prometheus.yml scrapes. Grafana itself cannot run here (its image needs a
registry), so a query naming a metric or job that does not exist would otherwise go unseen."""

from __future__ import annotations

import json
import re

import yaml
from prometheus_client import REGISTRY

import services.server.metrics  # noqa: F401 - registers the services' metrics
from tests.conftest import ROOT

DASHBOARD = json.loads((ROOT / "docker" / "grafana-dashboard.json").read_text())
SUFFIXES = {"histogram": ("_bucket", "_count", "_sum"), "counter": ("_total",), "gauge": ("",),
            "summary": ("_count", "_sum", "")}


def expressions() -> list[str]:
    return [t["expr"] for panel in DASHBOARD["panels"] for t in panel.get("targets", [])]


def exported() -> set[str]:
    return {family.name + suffix for family in REGISTRY.collect() for suffix in SUFFIXES.get(family.type, ("",))}


def test_every_series_the_dashboard_queries_is_exported():
    names = exported()
    queried = {name for expr in expressions() for name in re.findall(r"\b(specvox_\w+|process_\w+)", expr)}
    assert queried and not queried - names, sorted(queried - names)


def test_every_job_the_dashboard_names_is_scraped():
    scrape = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    jobs = {job["job_name"] for job in scrape["scrape_configs"]}
    for expr in expressions():
        for matcher, value in re.findall(r'job(=~|=)"([^"]*)"', expr):
            named = set(value.split("|")) if matcher == "=~" else {value}
            assert named <= jobs, (expr, jobs)


def test_the_data_source_is_compose_s_prometheus():
    source = yaml.safe_load((ROOT / "docker" / "grafana" / "provisioning" / "datasources" / "prometheus.yaml")
                            .read_text())
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    [entry] = source["datasources"]
    assert entry["url"] == "http://prometheus:9090" and "prometheus" in compose["services"]
    assert "9090:9090" in compose["services"]["prometheus"]["ports"]
