"""A job's record as its scheduler keeps it: state, events, metrics rows, recent step
timelines and the output its actors printed, kept here for whoever polls and written to the
job store as they happen.  The controller is the only caller of ``set_state``."""
from __future__ import annotations

import collections
import functools
import math
import threading
import time
from typing import Any, Optional

from actors.failures import JobFailure
from actors.metrics import JobMetrics
from actors.output import OutputTap
from actors.store_sink import StoreSink
from service import partition, schedules, timeline
from service import replicas as rp
from service.states import JobState


class JobRecord:
    def __init__(self, job_id: str, steps: int, store_url: Optional[str]):
        self.job_id, self.steps = job_id, steps
        self.output = OutputTap.install()  # user code runs in the scheduler too (preflight, the layer profile)
        self.sink = StoreSink(store_url, job_id) if store_url else None
        self.job_metrics = JobMetrics(job_id)  # ray.util.metrics, tagged by job
        self.state = JobState.PENDING
        self.error: Optional[str] = None
        self.step = 0                                    # committed steps
        self.high = 0                                    # the highest step ever committed
        self.shape: dict[str, Any] = {}
        self.metrics: list[dict] = []
        self.events: list[dict] = []
        self.timelines: collections.deque = collections.deque(maxlen=16)  # recent steps only
        self._lock = threading.Lock()

    def event(self, kind: str, message: str, **fields) -> None:
        row = {"time": time.time(), "type": kind, "message": message, **fields}
        with self._lock:
            self.events.append(row)
        if self.sink:
            self.sink.write(events=[row])

    def set_state(self, state: JobState, error: Optional[str] = None) -> None:
        with self._lock:
            changed = state is not self.state or error is not None
            self.state = state
            if error is not None:
                self.error = error
        if self.sink and changed:
            self.sink.write(state=state, error=error)

    def set_shape(self, shape: dict) -> None:
        with self._lock:
            self.shape = shape
        if self.sink:
            self.sink.write(shape=shape)

    def go_back(self, committed: int) -> None:
        """The state went back to an older copy: steps after ``committed`` run again."""
        with self._lock:
            self.step = committed

    def end_at(self, committed: int) -> None:
        """The job ends after ``committed`` steps, before its last (asked to finish early): the
        store drops rows of later steps, committed before the state went back to an older copy
        (``metrics`` keeps them: pollers index it; ``runner._follow`` drops them)."""
        with self._lock:
            self.step = committed
        if self.sink:
            self.sink.write(end_at=committed)

    def check_finite(self, row: dict) -> None:
        """A step whose gradient norm is not finite fails the job, or was skipped on every
        worker (training.skip_nonfinite): then a ``skipped_step`` event says so."""
        step, norm, loss = row["step"], row["grad_norm"], row["loss"]
        for k in ("loss", "grad_norm", "eval_loss"):  # JSON (and PostgreSQL's json) has no inf or nan
            if row.get(k) is not None and not math.isfinite(row[k]):
                row[k] = None
        if row.get("skipped"):
            self.event("skipped_step", f"step {step} skipped: its gradient norm is {norm}; no parameter "
                                       "changed", step=step)
        elif not math.isfinite(norm):
            raise JobFailure(f"step {step}: the gradient norm is {norm} (the loss was {loss:.6g}); "
                             "set training.skip_nonfinite: true to skip such steps, or lower optimizer.lr or set "
                             "training.grad_clip_norm")

    def commit(self, row: dict, workers_timeline: dict) -> None:
        """Step ``row['step']`` committed: its metrics row and timeline."""
        with self._lock:
            self.timelines.append({"step": row["step"], "workers": workers_timeline})
            self.metrics.append(row)
            self.step = row["step"]
            self.high = max(self.high, self.step)
        if self.sink:
            shape = dict(self.shape, **{k: True for k in ("sends_early", "last_sent_early") if row.get(k)})
            self.sink.write(metrics=[row], timeline_entry=timeline.record(row["step"], shape, workers_timeline))
        self.job_metrics.committed(row)

    def announce_shape(self, shape, why: str, spec, *, gpus: float, workers: dict, costs: Optional[list],
                       usable: Optional[list] = None, skips=()) -> None:
        """A shape was installed: the job's shape field and a ``shape`` event (``skips``: the
        model's skip connections, whose portals between chunks it lists)."""
        p = spec.parallelism
        info = {"dp": shape.dp, "pp": shape.pp, "partition": list(shape.sizes), "schedule": p.schedule,
                "stages_per_worker": shape.chunks,
                **({"weight_group": p.weight_group} if p.weight_group > 1 else {}),
                "transport": p.transport, "microbatches": spec.microbatches,
                "microbatches_per_replica": shape.microbatches_per_replica, "gpus_per_worker": gpus,
                "workers": workers}
        if shape.replicas:  # workers per stage (replicated stages), and the stage costs their orders are planned with
            info["replicas"] = list(shape.replicas)
            info["stage_costs"] = list(shape.stage_costs)
        if shape.tp > 1:  # each stage's layers split over tp workers (tensor parallelism)
            info["tp"] = shape.tp
        if usable:  # an elastic job: the worker counts its planner uses whole (for the cluster scheduler)
            info["usable_workers"] = list(usable)
        bounds = partition.bounds(shape.sizes)
        portals = [[partition.chunk_of(bounds, s[0]), partition.chunk_of(bounds, s[1]), s[2]] for s in skips]
        if any(a != b for a, b, _ in portals):  # skips between model chunks: [from chunk, to chunk, name]
            info["portals"] = [q for q in portals if q[0] != q[1]]
        self.set_shape(info)
        per = "stage" if shape.chunks == 1 else f"model chunk ({shape.chunks} per worker)"
        reps = (f", workers per stage {list(shape.replicas)}" if shape.replicas else "") + (
            f" x tp={shape.tp} (each stage's layers split over {shape.tp} workers)" if shape.tp > 1 else "")
        self.event("shape", f"shape dp={shape.dp} x pp={shape.pp}{reps}, layers per {per} {list(shape.sizes)}, "
                   f"{p.schedule} with {shape.microbatches_per_replica} microbatches per replica, "
                   f"transport {p.transport} ({why})", **info, reason=why, layer_costs_s=costs)

    def reshaped(self, r, committed: int, seconds: float) -> None:
        """The first step of a new shape committed: a ``reshape`` event with the reshape's cost
        (``r``: actors.reshape.Reshaped; ``seconds`` from its detection to the commit, the
        ``recovery_s`` of the step's metrics row)."""
        now = time.time()
        phases = {k: round(v, 3) for k, v in r.phases.items() if k.endswith("_s")}
        phases["first_step_s"] = round(time.time() - r.phases.get("installed_at", time.time()), 3)
        tp = r.tp
        what = "layers' slices" if tp > 1 else "layers"
        name = lambda s: rp.shape_label(s[0], s[1], s[2] if len(s) > 2 else None, tp)  # noqa: E731
        old = name(r.old) if r.old else "none"
        lost = (f"{r.steps_lost} steps lost, restored from the {r.restored_from}" if r.steps_lost
                else f"no step lost{', lost layers restored from the ' + r.restored_from if r.restored_from else ''}")
        paused = now - (r.paused_since or r.detected)
        when = (f"committed {seconds:.2f} s after detection" if paused >= seconds - 0.01 else
                f"committed {paused:.2f} s after training paused (training went on while its workers "
                f"started, {seconds:.2f} s since detection)")
        self.event("reshape", f"reshaped {old} -> {name(r.new)} after {r.reason}: step {committed} "
                   f"{when}; {lost}; {r.moved} {what} copied to workers that lacked them ({r.why})",
                   **({"tp": tp} if tp > 1 else {}), reason=r.reason, old_shape=r.old, new_shape=r.new,
                   recovery_s=seconds, paused_s=paused, layers_moved=r.moved,
                   steps_lost=r.steps_lost, restored_from=r.restored_from, restored_from_step=r.restored_step,
                   step=committed, phases_s=phases)
        self.job_metrics.reshaped(seconds)

    def poll(self, metrics_from: int = 0, events_from: int = 0) -> dict:
        with self._lock:
            return {"state": self.state.value, "step": self.step, "steps": self.steps,
                    "shape": dict(self.shape), "error": self.error,
                    "metrics": self.metrics[metrics_from:], "events": self.events[events_from:]}

    def timeline(self, step: Optional[int] = None) -> Optional[dict]:
        """Measured (action, start, end) per worker for a recent step (the newest by default)."""
        with self._lock:
            for entry in reversed(self.timelines):
                if step is None or entry["step"] == step:
                    return entry
        return None

    def log_output(self, by_cell: dict) -> None:
        """Send what the workers (by cell) and this actor printed to the job's log."""
        rows = [{"time": t, "source": "scheduler", "stream": st, "line": line} for t, st, line in self.output.take()]
        for (r, s), lines in sorted(by_cell.items()):
            rows += [{"time": t, "source": f"w{r}.{s}", "stream": st, "line": line} for t, st, line in lines]
        if rows and self.sink:
            rows.sort(key=lambda row: row["time"])
            self.sink.write(logs=rows)


def grad_norm(stats: dict) -> float:
    """The whole model's gradient norm (before clipping) from every worker's step result: as
    the workers summed it, or from their shares."""
    summed = [s["grad_norm"] for s in stats.values() if s.get("grad_norm") is not None]
    return summed[0] if summed else math.sqrt(sum(s.get("grad_sq", 0.0) for s in stats.values()))


@functools.lru_cache(maxsize=64)
def plan_bubble(schedule: str, pp: int, m: int, chunks: int = 1, early: bool = False, weight_group: int = 1,
                last: bool = False) -> float:
    """The schedule's ideal bubble (backward = 2 x forward, split evenly into B and W); with
    ``early`` as run where every backward sends its input gradient before its weight
    gradients (``schedules.sends_early``), with ``last`` where only each worker's last backward
    of the step does (``schedules.simulate``'s ``last_early``); ``weight_group``: its W's
    grouped (``schedules.group_weights``)."""
    plan = schedules.build(schedule, pp, m, chunks, weight_group)
    return float(schedules.simulate(schedules.sends_early(plan) if early else plan, last_early=last).bubble)


def weight_split_message(kept: str, own: float, theirs: float, trials: dict) -> str:
    """The ``weight_split`` event's text: which split of the backward the model chunks that tried
    both keep (``trials``: worker -> its ``split_trial`` report; ``own``, ``theirs``: the fastest
    step with each, s; actors/controller.py ``_split_trial``)."""
    parts = [f"{w} chunk {c} (its Linears hold {share:.0%} of its weight-gradient work)"
             for w, t in trials.items() for c, share in zip(t["chunks"], t["cover"])]
    keeps = "keeps" if len(parts) == 1 else "keep"
    if kept == "torch":
        how = (f"{keeps} torch's split of the backward, every weight gradient in W: the fastest step took "
               f"{theirs * 1e3:.1f} ms so, {own * 1e3:.1f} ms with only the Linears' weight products in W")
    else:
        how = (f"{keeps} the Linears' own weight products in W and the other weight gradients in B: the fastest "
               f"step took {own * 1e3:.1f} ms so, {theirs * 1e3:.1f} ms with torch's split (every weight gradient in W)")
    return f"after trying both splits of the backward, {', '.join(parts)} {how}"


def sends_early(stats: dict) -> bool:
    """Did every worker's backward send its input gradient before its weight gradients (all
    their chunks' weights in plain Linear layers, a schedule without W)?"""
    return bool(stats) and all(s.get("sends_early") for s in stats.values())


def last_sent_early(stats: dict) -> bool:
    """Did every worker's last backward of the step send its input gradient before its weight
    gradients (torch's split of that backward, where a chunk's weights are not in plain Linears),
    or have none to send?"""
    return bool(stats) and all(s.get("last_early") for s in stats.values())


def metrics_row(step: int, stats: dict, wall: float, *, batch: int, dp: int, pp: int, schedule: str,
                microbatches: int, reshapes: int, snapshot_s: Optional[float], rerun: bool, lr: float,
                chunks: int = 1, replicas: tuple = (), stage_costs: tuple = (), tp: int = 1,
                weight_group: int = 1) -> dict:
    """The metrics row of committed step ``step + 1`` from every worker's step result (keyed
    (dp rank, slot): with ``replicas`` or ``tp``, a pipeline's workers are numbered stage by stage)."""
    loss = sum(s["loss"] for s in stats.values() if s["loss"] is not None)
    skipped = any(s.get("skipped") for s in stats.values())
    reps = tuple(replicas) or (tp,) * pp
    width = sum(reps)
    of_stage = [[rp.slot_of(reps, s, j) for j in range(reps[s])] for s in range(pp)]  # each stage's slots
    utils = []
    for r in range(dp):
        cells = [stats[(r, s)] for s in range(width)]
        span = max(c["pipe_end"] for c in cells) - min(c["start"] for c in cells)
        utils.append(sum(c["busy"] for c in cells) / (width * span) if span > 0 else 1.0)
    early = not replicas and sends_early(stats)
    last = not replicas and not early and last_sent_early(stats)
    ideal = (float(rp.plan(schedule, replicas, microbatches // dp, rp.relative(stage_costs)).bubble) if replicas
             else plan_bubble(schedule, pp, microbatches // dp, chunks, early, weight_group, last))
    return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm(stats), "time": time.time(),
            "samples_per_s": batch / wall,
            "step_time_s": wall, "dp": dp, "pp": pp,
            "bubble": max(0.0, 1.0 - sum(utils) / len(utils)), "bubble_plan": ideal,
            **({"sends_early": True} if early else {}), **({"last_sent_early": True} if last else {}),
            "peak_live": [max(stats[(r, t)]["peak_live"] for r in range(dp) for t in slots) for slots in of_stage],
            # bytes the first worker of each stage of replica 0 received from other workers, by kind
            # (act, grad, skip, skipgrad)
            "received_bytes": [dict(stats[(0, slots[0])].get("received", {})) for slots in of_stage],
            **({"replicas": list(replicas)} if replicas else {}), **({"tp": tp} if tp > 1 else {}),
            # bytes the layers' tensor-parallel collectives moved this step on TP rank 0 of each stage of replica 0
            **({"tp_bytes": [stats[(0, slots[0])].get("tp_bytes", 0) for slots in of_stage],
                "tp_collectives": [stats[(0, slots[0])].get("tp_collectives", 0) for slots in of_stage]}
               if tp > 1 else {}),
            "allreduce_s": max(s["allreduce_s"] for s in stats.values()), "reshapes": reshapes,
            **({"snapshot_s": snapshot_s} if snapshot_s is not None else {}),
            **({"rerun": True} if rerun else {}), **({"skipped": True} if skipped else {}),
            # its call reached the workers while the step before ran (no round trip between the two)
            **({"queued_early": True} if any(s.get("queued_early") for s in stats.values()) else {})}
