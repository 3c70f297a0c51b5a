"""The Grafana dashboard (deploy/grafana-dashboard.json) against the metrics a real Ray Serve
application exports: after requests that make every event the dashboard counts (images, a
refused request, an expired one, a cancelled step-engine image), the Prometheus endpoints of the
cluster's nodes (Ray's metrics export port) carry every metric name its queries use."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import requests

from pipelines.requests import GenerationRequest

from .helpers import SIZE, generate, sse_events

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana-dashboard.json"


def dashboard_metrics() -> set[str]:
    """Every metric name in the dashboard's Prometheus queries and variables."""
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [v["query"]["query"] if isinstance(v.get("query"), dict) else v.get("query", "")
              for v in board["templating"]["list"] if v.get("type") == "query"]
    return {m for e in exprs for m in re.findall(r"\bray_[a-z_]+\b", e)}


def scrape(cluster) -> set[str]:
    names = set()
    for node in cluster.nodes:
        try:
            text = requests.get(f"http://{node.node_ip_address}:{node.metrics_export_port}"
                                "/metrics", timeout=5).text
        except requests.RequestException:
            continue
        names |= {line.split("{")[0].split(" ")[0] for line in text.splitlines()
                  if line and not line.startswith("#")}
    return names


def test_the_dashboard_covers_what_it_should():
    board = json.loads(DASHBOARD.read_text())
    titles = " ".join(p["title"].lower() for p in board["panels"])
    for what in ("queue", "batch", "images/s", "step time", "latency", "errors", "cancelled",
                 "expired", "replicas", "cost"):
        assert what in titles, what
    used = dashboard_metrics()
    assert {"ray_maxdiff_replica_images", "ray_maxdiff_images_generated_total",
            "ray_maxdiff_http_latency_s_bucket"} <= used


def test_every_metric_the_dashboard_uses_is_exported(cluster, multi_app, step_app):
    """On the package's multi-model (engine=batch, priced) and step applications, which its
    group deploys anyway; the metrics are counters and histograms, so what other modules sent
    before only adds to them."""
    from ray import serve

    # images on both engines, and a request refused (422) for the errors panel
    assert generate(multi_app.url, seed=11).status_code == 200
    assert generate(step_app, seed=11, width=SIZE, height=SIZE).status_code == 200
    assert generate(multi_app.url, steps=10_000).status_code == 422
    # an expired request: a deadline that has passed when its device batch starts (the batch
    # waits batch_wait_timeout_s to fill); asked of the generator directly, so no caller gives
    # up first
    handle = serve.get_deployment_handle("Generator", app_name="multi")
    job = GenerationRequest("expires", None, 1, 1, SIZE, SIZE, 2, 0.0)
    with pytest.raises(Exception, match="deadline passed"):
        handle.generate.remote(job, 0.0).result(timeout_s=60)
    # a cancelled step-engine image: its client leaves mid-stream
    r = requests.post(f"{step_app}/v1/generate", json={
        "prompt": "abandoned", "steps": 50, "stream": True}, stream=True, timeout=120)
    for name, data in sse_events(r):
        if name == "progress" and data["step"] >= 2:
            break
    r.close()
    wanted = dashboard_metrics()
    deadline = time.monotonic() + 90
    while True:
        missing = wanted - scrape(cluster)
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not missing, sorted(missing)
