"""A job's metrics through ``ray.util.metrics``, tagged by job.

The scheduler records them when a step commits and when a reshape's first step commits:
a few ``Gauge.set`` calls into the local core worker (microseconds), nothing on the workers'
step path.  Ray's metrics agent on each node exports them in Prometheus text with a ``ray_``
prefix (``relaytrain_job_loss`` is scraped as ``ray_relaytrain_job_loss``), beside Ray's own
metrics, which is where the Ray dashboard's Metrics view (Prometheus + Grafana) reads them.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

TAG_KEYS = ("job",)
PREFIX = "ray_"  # what Ray's exporter puts before every name


@dataclass(frozen=True)
class MetricDef:
    name: str
    kind: str  # gauge, counter or histogram
    description: str
    boundaries: tuple[float, ...] = ()

    @property
    def exported(self) -> str:
        return PREFIX + self.name


DEFINITIONS = (
    MetricDef("relaytrain_job_step", "gauge", "committed steps of the job"),
    MetricDef("relaytrain_job_loss", "gauge", "loss of the job's last committed step (mean over the global batch)"),
    MetricDef("relaytrain_job_samples_per_second", "gauge", "samples per second of the last committed step"),
    MetricDef("relaytrain_job_step_seconds", "gauge", "wall time of the last committed step"),
    MetricDef("relaytrain_job_bubble_fraction", "gauge",
              "measured pipeline bubble of the last committed step (idle share of the stages' time)"),
    MetricDef("relaytrain_job_bubble_plan_fraction", "gauge",
              "the schedule's ideal bubble for the current shape (backward = 2 x forward)"),
    MetricDef("relaytrain_job_workers", "gauge", "workers (dp x pp) of the current shape"),
    MetricDef("relaytrain_job_reshapes_total", "counter", "reshapes of the job (shape changes while it ran)"),
    MetricDef("relaytrain_job_recovery_seconds", "histogram",
              "seconds from detecting a change (lost, draining or joining node) to the new shape's first commit",
              (0.5, 1, 2, 5, 10, 30, 60, 120, 300)),
    MetricDef("relaytrain_job_last_recovery_seconds", "gauge",
              "the last reshape's recovery seconds, exact (Ray exports a histogram's sum from bucket midpoints)"),
)
BY_NAME = {d.name: d for d in DEFINITIONS}


class JobMetrics:
    """The metrics of one job, recorded from its scheduler.  Outside a Ray worker (or if
    Ray's metrics cannot be made) it records nothing and says so once."""

    def __init__(self, job_id: str):
        self.tags = {"job": job_id}
        self.m: dict = {}
        try:
            from ray.util import metrics as rm

            for d in DEFINITIONS:
                if d.kind == "gauge":
                    self.m[d.name] = rm.Gauge(d.name, d.description, tag_keys=TAG_KEYS)
                elif d.kind == "counter":
                    self.m[d.name] = rm.Counter(d.name, d.description, tag_keys=TAG_KEYS)
                else:
                    self.m[d.name] = rm.Histogram(d.name, d.description, boundaries=list(d.boundaries),
                                                  tag_keys=TAG_KEYS)
        except Exception as e:  # metrics are a view: never a reason to stop a job
            print(f"relaytrain: job metrics disabled: {type(e).__name__}: {e}", file=sys.stderr)
            self.m = {}

    def _set(self, name: str, value: Optional[float]) -> None:
        if value is not None and name in self.m:
            self.m[name].set(float(value), tags=self.tags)

    def committed(self, row: dict) -> None:
        """A step committed; ``row`` is its metrics row (step, loss, samples_per_s, ...)."""
        if not self.m:
            return
        try:
            self._set("relaytrain_job_step", row.get("step"))
            self._set("relaytrain_job_loss", row.get("loss"))
            self._set("relaytrain_job_samples_per_second", row.get("samples_per_s"))
            self._set("relaytrain_job_step_seconds", row.get("step_time_s"))
            self._set("relaytrain_job_bubble_fraction", row.get("bubble"))
            self._set("relaytrain_job_bubble_plan_fraction", row.get("bubble_plan"))
            if row.get("dp") and row.get("pp"):
                self._set("relaytrain_job_workers", row["dp"] * row["pp"])
        except Exception as e:
            print(f"relaytrain: recording job metrics failed: {e}", file=sys.stderr)

    def reshaped(self, recovery_s: float) -> None:
        """A reshape's first step committed ``recovery_s`` after the change was detected."""
        if not self.m:
            return
        try:
            self.m["relaytrain_job_reshapes_total"].inc(1, tags=self.tags)
            self.m["relaytrain_job_recovery_seconds"].observe(float(recovery_s), tags=self.tags)
            self._set("relaytrain_job_last_recovery_seconds", recovery_s)
        except Exception as e:
            print(f"relaytrain: recording job metrics failed: {e}", file=sys.stderr)
