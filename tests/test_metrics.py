"""Metric names and tags as the README documents them: the job metrics a scheduler records
through ray.util.metrics, read back from the node's Prometheus export, and the API
server's /metrics."""
from __future__ import annotations

import math
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from actors.metrics import DEFINITIONS, TAG_KEYS
from service.states import JobState

README = Path(__file__).resolve().parent.parent / "README.md"


def observability_section() -> str:
    text = README.read_text()
    start = text.index("## Observability")
    return text[start:text.index("\n## ", start + 1)]


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_job_metrics_are_documented_with_their_tag():
    doc = observability_section()
    rows = dict(re.findall(r"^\| `(ray_relaytrain_job_[a-z_]+)` \| (\w+) \|", doc, re.M))
    assert rows == {d.exported: d.kind for d in DEFINITIONS}
    assert TAG_KEYS == ("job",) and "tagged `job`" in doc
    assert all(d.exported == "ray_" + d.name for d in DEFINITIONS)
    assert [d.name for d in DEFINITIONS if d.kind == "counter"] == ["relaytrain_job_reshapes_total"]


def test_api_metrics_names_and_labels(tmp_path, monkeypatch):
    from fastapi.testclient import TestClient

    from api.app import create_app
    from service.settings import Settings
    from service.store import Store

    monkeypatch.delenv("RELAYTRAIN_API_TOKENS", raising=False)
    settings = Settings(home=tmp_path)
    store = Store(settings.db_url)
    store.create_job("a-1", "local", {"name": "a", "training": {"steps": 3}})
    store.add_events("a-1", [{"type": "reshape", "message": "reshaped 2x2 -> 1x3", "recovery_s": 1.5},
                             {"type": "shape", "message": "shape"},
                             {"type": "restarted", "message": "restart 1 of 2", "restart": 1},
                             {"type": "restarted", "message": "restart 2 of 2", "restart": 2}])
    with TestClient(create_app(settings, connect_ray=False)) as c:
        assert c.get("/v1/jobs/a-1").status_code == 200
        assert c.get("/v1/jobs/nope").status_code == 404
        fam = families(c.get("/metrics").text)
    jobs = fam["relaytrain_jobs"]
    assert jobs.type == "gauge"
    by_state = {s.labels["state"]: s.value for s in jobs.samples}
    assert by_state == {s.value: (1.0 if s is JobState.PENDING else 0.0) for s in JobState}
    requests = fam["relaytrain_http_requests"]
    assert requests.type == "counter"
    seen = {(s.labels["method"], s.labels["route"], s.labels["status"]) for s in requests.samples
            if s.name.endswith("_total")}
    assert {("GET", "/v1/jobs/{job_id}", "200"), ("GET", "/v1/jobs/{job_id}", "404")} <= seen
    latency = fam["relaytrain_http_request_seconds"]
    assert latency.type == "histogram" and {"method", "route", "le"} <= set(latency.samples[0].labels)
    reshapes = fam["relaytrain_reshapes"]
    assert reshapes.type == "counter" and [s.value for s in reshapes.samples if s.name.endswith("_total")] == [1.0]
    restarts = fam["relaytrain_restarts"]
    assert restarts.type == "counter" and [s.value for s in restarts.samples if s.name.endswith("_total")] == [2.0]
    doc = observability_section()
    for name in ("relaytrain_jobs{state}", "relaytrain_http_requests_total{method,route,status}",
                 "relaytrain_http_request_seconds{method,route}", "relaytrain_reshapes_total",
                 "relaytrain_restarts_total"):
        assert f"`{name}`" in doc, name


def test_ray_exports_the_job_metrics_tagged_by_job(ray_session):
    """A real scheduler records step, loss, samples/s, bubble and workers as it commits; a
    reshape's counter and recovery histogram are recorded from a probe actor (a real reshape
    needs a multi-node cluster: tests/test_elastic.py).  Both are read back from the node's
    metrics export, the endpoint Prometheus scrapes."""
    ray = ray_session
    from actors.launch import start_scheduler
    from tests.test_api import small_spec

    port = ray._private.worker.global_worker.node.metrics_export_port
    job_id, probe_job = f"metrics-{uuid.uuid4().hex[:8]}", f"probe-{uuid.uuid4().hex[:8]}"

    @ray.remote(num_cpus=0)
    class Probe:
        def record(self, job):
            from actors.metrics import JobMetrics

            m = JobMetrics(job)
            m.reshaped(1.5)
            m.reshaped(0.7)
            return len(m.m)

    def exported(wanted, job, what):
        """The export once it holds ``wanted`` names tagged ``job`` (Ray exports about every 10 s)."""
        deadline = time.monotonic() + 60
        while True:
            fam = families(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
            have = {name for name, f in fam.items() if any(s.labels.get("job") == job for s in f.samples)}
            if wanted <= have:
                return fam
            if time.monotonic() > deadline:
                pytest.fail(f"{what}: not exported within 60 s: {sorted(wanted - have)}")
            time.sleep(1.0)

    def value(fam, name, job, sample=None):
        return [s.value for s in fam[name].samples if s.labels.get("job") == job
                and (sample is None or s.name == sample)]

    # a reshape's counter, histogram and exact last seconds, recorded by a probe actor, read first:
    # observed on this machine, with a scheduler running beside it the probe's last_recovery_seconds
    # gauge was not exported within 60 s (also at the previous round's commit), alone it is in ~6 s
    probe = Probe.remote()
    assert ray.get(probe.record.remote(probe_job)) == len(DEFINITIONS)
    fam = exported({"ray_relaytrain_job_reshapes", "ray_relaytrain_job_recovery_seconds",
                    "ray_relaytrain_job_last_recovery_seconds"}, probe_job, "the probe's reshape metrics")
    assert fam["ray_relaytrain_job_reshapes"].type == "counter"
    assert value(fam, "ray_relaytrain_job_reshapes", probe_job, "ray_relaytrain_job_reshapes_total") == [2.0]
    assert fam["ray_relaytrain_job_recovery_seconds"].type == "histogram"
    assert value(fam, "ray_relaytrain_job_recovery_seconds", probe_job,
                 "ray_relaytrain_job_recovery_seconds_count") == [2.0]
    # Ray exports a histogram's sum from its buckets' midpoints: 0.75 + 1.5, not 0.7 + 1.5
    assert value(fam, "ray_relaytrain_job_recovery_seconds", probe_job,
                 "ray_relaytrain_job_recovery_seconds_sum") == [pytest.approx(2.25)]
    assert value(fam, "ray_relaytrain_job_last_recovery_seconds", probe_job) == [pytest.approx(0.7)]
    ray.kill(probe)

    spec = small_spec("metrics", steps=100000, parallelism={"dp": 1, "pp": 1})
    sched = start_scheduler(job_id, spec, [])
    done = sched.run.remote()
    try:
        gauges = {d.exported for d in DEFINITIONS if d.kind == "gauge"} - {"ray_relaytrain_job_last_recovery_seconds"}
        fam = exported(gauges, job_id, "the job's metrics")
        assert value(fam, "ray_relaytrain_job_step", job_id)[0] >= 1
        assert math.isfinite(value(fam, "ray_relaytrain_job_loss", job_id)[0])
        assert value(fam, "ray_relaytrain_job_samples_per_second", job_id)[0] > 0
        assert value(fam, "ray_relaytrain_job_workers", job_id) == [1.0]
        assert value(fam, "ray_relaytrain_job_bubble_plan_fraction", job_id) == [0.0]  # one stage: no bubble
        assert 0 <= value(fam, "ray_relaytrain_job_bubble_fraction", job_id)[0] <= 1
    finally:
        ray.get(sched.cancel.remote())
        ray.get(done, timeout=60)
        ray.kill(sched)
