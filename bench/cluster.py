"""A shared cluster under three sharing policies: a trace of training jobs replayed on it.

    .venv/bin/python bench/cluster.py [--policies fifo fair elastic] [--nodes 6] [--sleep-ms 1]
                                      [--smoke] [--timeout-min 12] [--tag NAME]
    .venv/bin/python bench/cluster.py --smoke [--policies fifo fair elastic]   # 2 jobs, 3 nodes
    .venv/bin/python bench/cluster.py --simulate [--sim-jobs 200] [--sim-slots 32 64] [--seed 0]
    .venv/bin/python bench/cluster.py --from-json bench/results/cluster.json

The real run: a simulated cluster (``ray.cluster_utils.Cluster``: a head with no CPUs and
--nodes one-CPU worker nodes) and the control plane in this process (``api.jobs.JobManager``
on a fresh SQLite store, its cluster scheduler ticking every second), connected to it.  The
trace's jobs (bench/cluster_sim.py's TRACE: its shape and sources are described there) are
submitted at their arrival times as the tenants would (``JobManager.submit``), each a real
relaytrain job: a small paced MLP (bench/paced_mlp.py; 64 -> 4 blocks of
Linear(64)+ReLU+Sleep -> 10, float64, digits, SGD with momentum, global batch 48 in
microbatches of 4).  A Sleep layer
sleeps --sleep-ms per sample in its forward and twice that in its backward: simulated device
time, so that a job's step falls with its data-parallel replicas (each runs B/dp samples) on a
2-core machine where real compute would not.  Elastic jobs declare the sleeps as
``parallelism.layer_costs_ms`` so that their planner sees what a worker is worth.  The model
is a module written to a temporary folder, zipped and registered as an uploaded package
(``service.packages.save`` + ``Store.add_package``), the jobs' ``runtime_env.working_dir``.
The same trace runs under each policy (``RELAYTRAIN_QUEUE_POLICY``; service/fairshare.py) on a
fresh cluster:

    fifo       rigid shapes (an elastic job at its preferred dp), one queue in arrival order
    fair       rigid shapes, the next job admitted from the tenant furthest below its weighted share
    elastic    weighted max-min fair shares; elastic jobs admitted at 1 worker, grown into free
               slots up to 4 and shrunk at a step boundary when another tenant's job needs the room

It reports per policy: average and 95th-percentile job completion time (submission to end),
makespan (first submission to last end), cluster utilisation over time (slots held by jobs,
sampled every 0.5 s from the store as the cluster scheduler counts them, and Ray's CPUs in use),
each tenant's average slots against its weighted share while it has work (a job queued or
running), how many jobs failed, and whether every job's final model (the store's
``model/`` artifacts, as ``GET /v1/jobs/{id}/model`` serves it) equals the plain one-process
loop (tests/reference.py, the same builder with its sleeps at 0 ms: a Sleep layer has no
state and returns its input) to the tolerance of the engine's tests (rtol 1e-4, atol 2e-5),
with every step committed once across the reshapes; beside it, the simulation of the same trace.

--simulate runs bench/cluster_sim.py's discrete-event simulation (no Ray), which writes
bench/results/cluster_sim.{json,txt}; the real run writes bench/results/cluster.{json,txt}
(cluster_smoke.* with --smoke, cluster_<tag>.* with --tag).  Both redraw bench/results/cluster.png.
The goals the tables judge are in bench/cluster_sim.py's docstring.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cluster_sim import (BATCH, BLOCKS, POLICIES, RESULTS, SMOKE, TRACE, WEIGHTS,  # noqa: E402
                               _f, add_sim_args, goals, plot, policy_table, render_sim, simulate,
                               step_seconds, summarize, trace_jobs, util_series, write_simulations)
from bench.machine import machine  # noqa: E402
from bench.paced_mlp import PACED  # noqa: E402

# the paced model's other dimensions (its blocks and global batch: bench/cluster_sim.py)
IN, HIDDEN, OUT = 64, 64, 10
MICRO = 4                  # 12 microbatches a step: dp 1, 2, 3 and 4 all divide them
CKPT_EVERY = 50            # a preemptible job's checkpoints (it also writes one when preempted)


# ---------------------------------------------------------------- the real run

def job_spec(job: dict, sleep_ms: float, uri: str | None, seed: int):
    """The relaytrain spec of one trace job (``uri``: the package; None for the reference)."""
    from service.spec import parse_spec

    costs = [3 * sleep_ms * MICRO + 0.05] * BLOCKS + [0.05]  # ms of one microbatch, forward + backward
    d = {
        "name": f"{job['id']}-{job['tenant']}",
        "model": {"builder": "paced:build", "args": {"in_features": IN, "hidden": HIDDEN, "layers": BLOCKS,
                                                     "out_features": OUT, "sleep_ms": sleep_ms, "dtype": "float64"}},
        "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "training": {"global_batch_size": BATCH, "microbatch_size": MICRO, "steps": job["steps"], "seed": seed},
        "parallelism": {"dp": job["size"], "pp": 1, "transport": "collective", "layer_costs_ms": costs},
    }
    if job["elastic"]:
        d["elastic"] = {"enabled": True, "min_workers": job["min"], "max_workers": job["max"]}
    if job.get("preemptible"):
        d["scheduling"] = {"preemptible": True}
        d["checkpoint"] = {"every_steps": CKPT_EVERY, "keep": 1}
    if uri:
        d["runtime_env"] = {"working_dir": uri}
    return parse_spec(d)


def package(folder: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.write(folder / "paced.py", "paced.py")
    return buf.getvalue()


TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")
ACTIVE = ("QUEUED", "PENDING", "RUNNING", "RESHAPING")


class Sampler:
    """Every ``period`` s: the slots each active job holds (as the cluster scheduler counts
    them: its shape's dp x pp, or what it was allotted while it starts), its state, and Ray's
    CPUs in use (placement groups included)."""

    def __init__(self, manager, t0: float, capacity: float, period: float = 0.5):
        self.manager, self.t0, self.capacity, self.period = manager, t0, capacity, period
        self.samples: list[dict] = []
        self.names: dict[str, str] = {}   # the store's job id -> the trace's
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> "Sampler":
        self.thread.start()
        return self

    def _loop(self) -> None:
        import ray

        while not self.stop.wait(self.period):
            try:
                rows, _ = self.manager.store.list_jobs(states=ACTIVE, limit=10000)
                held = {self.names.get(r["id"], r["id"]): self.manager.cluster.holding(r) for r in rows
                        if r["state"] != "QUEUED"}
                states = {self.names.get(r["id"], r["id"]): r["state"] for r in rows}
                cpu = self.capacity - float(ray.available_resources().get("CPU", 0.0))
                self.samples.append({"t": time.time() - self.t0, "held": held, "states": states, "cpu": cpu})
            except Exception as e:  # noqa: BLE001  a missed sample is not a failed bench
                self.samples.append({"t": time.time() - self.t0, "error": f"{type(e).__name__}: {e}"})

    def finish(self) -> list[dict]:
        self.stop.set()
        self.thread.join(5)
        return [s for s in self.samples if "held" in s]


def reference_params(job: dict, sleep_ms: float, seed: int, paced_dir: str) -> dict:
    """The plain one-process loop (tests/reference.py) on the same builder, its sleeps at 0."""
    from tests import reference

    return reference.run(job_spec(job, 0.0, None, seed), search=[paced_dir])["params"]


def compare(got: dict, want: dict) -> dict:
    """Against the reference with the engine's tests' tolerance (tests/test_engine.py)."""
    import torch

    if list(got) != list(want):
        return {"equal": False, "why": f"keys differ: {list(got)[:4]}... vs {list(want)[:4]}..."}
    worst, bad = 0.0, []
    for k in want:
        a, b = got[k].double(), want[k].double()
        worst = max(worst, float((a - b).abs().max()))
        if not torch.allclose(a, b, rtol=1e-4, atol=2e-5):
            bad.append(k)
    return {"equal": not bad, "max_abs_diff": worst, "why": f"differ beyond rtol 1e-4, atol 2e-5: {bad}" if bad else ""}


def run_policy(policy: str, jobs: list[dict], args, zipped: bytes, paced_dir: str, refs: dict) -> dict:
    """One policy on a fresh simulated cluster and a fresh control plane."""
    import ray
    import torch
    from ray.cluster_utils import Cluster

    from api.jobs import JobManager
    from service import packages
    from service.settings import Settings
    from service.store import Store

    weights = WEIGHTS
    home = Path(tempfile.mkdtemp(prefix=f"relaytrain-clusterbench-{policy}-"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(args.nodes):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    settings = Settings(home=home, db=f"sqlite:///{home / 'relaytrain.db'}", queue_policy=policy,
                        queue_seconds=1.0, reconcile_seconds=5.0, ray_address=cluster.address,
                        start_timeout_s=300.0, max_active_jobs_per_tenant=100)
    store = Store(settings.db_url)
    manager = JobManager(settings, store, weights)
    out: dict = {"policy": policy, "errors": []}
    try:
        manager.connect()
        deadline = time.monotonic() + 60
        while ray.cluster_resources().get("CPU", 0) < args.nodes and time.monotonic() < deadline:
            time.sleep(0.2)
        sha, uri = packages.save(zipped, settings.packages_dir, settings.max_package_bytes)
        for tenant in weights:
            store.add_package(sha, tenant, len(zipped))
        packages.ensure_in_cluster(uri, settings.packages_dir)
        out["prewarmed_nodes"] = prewarm(uri)
        manager.start_background()
        t0 = time.time()
        sampler = Sampler(manager, t0, float(args.nodes)).start()
        ids: dict[str, str] = {}
        load = [os.getloadavg()[0]]
        for i, job in enumerate(sorted(jobs, key=lambda j: j["arrival"])):
            time.sleep(max(0.0, t0 + job["arrival"] - time.time()))
            try:
                row, _ = manager.submit(job["tenant"], job_spec(job, args.sleep_ms, uri, seed=i))
                ids[job["id"]] = row["id"]
                sampler.names[row["id"]] = job["id"]
                print(f"  [{policy} {time.time() - t0:6.1f} s] submitted {job['id']} ({job['tenant']}, "
                      f"{job['size']} workers, {'elastic' if job['elastic'] else 'rigid'}, {job['steps']} steps): "
                      f"{row['state']}", flush=True)
            except Exception as e:  # noqa: BLE001
                out["errors"].append(f"submit {job['id']}: {type(e).__name__}: {e}")
                print(f"  [{policy}] submit {job['id']} failed: {type(e).__name__}: {e}", flush=True)
        deadline = t0 + args.timeout_min * 60
        done: set = set()
        while time.time() < deadline:
            rows = {k: store.get_job(v) for k, v in ids.items()}
            for k, r in rows.items():
                if r and r["state"] in TERMINAL and k not in done:
                    done.add(k)
                    print(f"  [{policy} {time.time() - t0:6.1f} s] {k} {r['state']} "
                          f"(JCT {r['ended_at'] - r['created_at']:.1f} s){': ' + r['error'] if r.get('error') else ''}",
                          flush=True)
            if len(done) == len(ids):
                break
            load.append(os.getloadavg()[0])
            time.sleep(1.0)
        for k, v in ids.items():
            if k not in done:
                try:
                    manager.cancel(jobs_by_id(jobs)[k]["tenant"], v, wait=20)
                except Exception as e:  # noqa: BLE001
                    out["errors"].append(f"cancel {k}: {type(e).__name__}: {e}")
        samples = sampler.finish()
        manager.stop_background()
        out.update(rows=_job_rows(jobs, ids, manager, refs, args, paced_dir, t0, torch), samples=samples,
                   load_max=max(load), load_mean=statistics.fmean(load), cluster_view=_safe_view(manager))
    finally:
        manager.stop_background()
        ray.shutdown()
        cluster.shutdown()
    return out


def prewarm(uri: str) -> int:
    """Unpack the package on every node, one node after the other, before any job runs.

    The simulated cluster's nodes share one session folder, so they unpack a package into the
    same directory, and Ray's working_dir plugin unpacks with ``overwrite=True``
    (ray/_private/runtime_env/working_dir.py): the first time a node's runtime-env agent sees
    the package it deletes the directory and unpacks it again, under the feet of the actors that
    other nodes already started in it (their working directory is gone: a JobScheduler then
    fails to import torch, ``FileNotFoundError`` from ``os.getcwd``).  On real hosts each node has
    its own folder.  Once every agent holds the package in its cache, none unpacks it again."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def touch() -> str:
        import importlib

        importlib.import_module("paced")  # the package is importable from the working directory
        return os.getcwd()

    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    for node in nodes:
        ray.get(touch.options(runtime_env={"working_dir": uri},
                              scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote(),
                timeout=120)
    return len(nodes)


def jobs_by_id(jobs: list[dict]) -> dict:
    return {j["id"]: j for j in jobs}


def _safe_view(manager) -> dict | None:
    try:
        return manager.cluster.view(next(iter(WEIGHTS)))
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def _job_rows(jobs, ids, manager, refs, args, paced_dir, t0, torch) -> list[dict]:
    rows = []
    for i, job in enumerate(sorted(jobs, key=lambda j: j["arrival"])):
        jid = ids.get(job["id"])
        row = {"id": job["id"], "tenant": job["tenant"], "size": job["size"], "elastic": job["elastic"],
               "preemptible": job.get("preemptible", False), "steps": job["steps"], "job_id": jid}
        if jid is None:
            row.update(state="NOT SUBMITTED")
            rows.append(row)
            continue
        r = manager.store.get_job(jid)
        events = manager.store.get_events(jid, 0, 100000)
        metrics = manager.store.get_metrics(jid, 0, 100000)
        kinds: dict = {}
        for e in events:
            kinds[e["type"]] = kinds.get(e["type"], 0) + 1
        admitted = next((e["time"] for e in events if e["type"] == "admitted"), None)
        first_step = min((m["time"] for m in metrics), default=None)
        row.update(state=r["state"], error=r.get("error"), arrival=r["created_at"] - t0,
                   started=(r["started_at"] - t0) if r.get("started_at") else None,
                   end=(r["ended_at"] - t0) if r.get("ended_at") else None,
                   jct=(r["ended_at"] - r["created_at"]) if r.get("ended_at") else None,
                   wait=(admitted - r["created_at"]) if admitted else None,
                   start_s=(first_step - admitted) if admitted and first_step else None,
                   events=kinds, steps_once=[m["step"] for m in metrics] == list(range(1, job["steps"] + 1)),
                   reruns=sum(1 for m in metrics if m.get("rerun")),
                   shapes=[f"{e['new_shape'][0]}x{e['new_shape'][1]}" for e in events if e["type"] == "reshape"],
                   reshape_s=[round(e.get("recovery_s") or 0.0, 2) for e in events if e["type"] == "reshape"],
                   median_step_s={str(k): v for k, v in _step_times(metrics).items()},
                   messages=[f"{e['type']}: {e['message']}"[:300] for e in events
                             if e["type"] in ("failed", "preempt_failed", "worker_lost", "cancelled")])
        if r["state"] == "SUCCEEDED":
            try:
                got = torch.load(io.BytesIO(manager.models.whole(job["tenant"], jid)), weights_only=True)
                if job["id"] not in refs:
                    refs[job["id"]] = reference_params(job, args.sleep_ms, i, paced_dir)
                row["model"] = compare(got, refs[job["id"]])
            except Exception as e:  # noqa: BLE001
                row["model"] = {"equal": False, "why": f"{type(e).__name__}: {e}"}
        rows.append(row)
    return rows


def _step_times(metrics: list[dict]) -> dict:
    """The median step time per data-parallel width (dp x pp workers)."""
    by: dict = {}
    for m in metrics:
        w = (m.get("dp") or 0) * (m.get("pp") or 0) or None
        by.setdefault(w, []).append(m["step_time_s"])
    return {k: round(statistics.median(v), 4) for k, v in by.items() if k}


def _median(xs: list) -> float | None:
    return statistics.median(xs) if xs else None


def real_segments(samples: list[dict]) -> list[tuple]:
    out = []
    for a, b in zip(samples, samples[1:]):
        out.append((a["t"], b["t"], a["held"]))
    return out


def run_real(args) -> dict:
    rows = SMOKE if args.smoke else TRACE
    if args.smoke:
        args.nodes = min(args.nodes, 3)
    args.policies = args.policies or (["elastic"] if args.smoke else list(POLICIES))
    jobs = trace_jobs(rows)
    t_start, load_start = time.time(), os.getloadavg()[0]
    refs: dict = {}
    runs = {}
    with tempfile.TemporaryDirectory(prefix="relaytrain-paced-") as paced:
        (Path(paced) / "paced.py").write_text(PACED)
        zipped = package(Path(paced))
        for policy in args.policies:
            print(f"policy {policy}: {len(jobs)} jobs on {args.nodes} one-CPU nodes", flush=True)
            t = time.time()
            try:
                r = run_policy(policy, jobs, args, zipped, paced, refs)
            except Exception as e:  # noqa: BLE001  the other policies still run
                import traceback

                r = {"policy": policy, "errors": [f"{type(e).__name__}: {e}"], "traceback": traceback.format_exc()}
                print(r["traceback"], flush=True)
            r["wall_s"] = time.time() - t
            seg = real_segments(r.get("samples", []))
            done = [{"id": x["id"], "tenant": x["tenant"], "arrival": x.get("arrival", 0.0),
                     "end": x.get("end") if x.get("state") == "SUCCEEDED" else None,
                     "failed": x.get("state") in ("FAILED", "CANCELLED"),
                     "size": x["size"], "elastic": x["elastic"], "min": jobs_by_id(jobs)[x["id"]]["min"],
                     "max": jobs_by_id(jobs)[x["id"]]["max"]} for x in r.get("rows", [])]
            if done and seg:
                r.update(summarize(done, seg, args.nodes, WEIGHTS, policy))
                ser = util_series(seg, done)
                ser["cpu"] = [s["cpu"] for s in r["samples"][:len(seg)]] + [0]
                r["series"] = ser
            ok = [x for x in r.get("rows", []) if x.get("state") == "SUCCEEDED"]
            r["median_start_s"] = _median([x["start_s"] for x in ok if x.get("start_s") is not None])
            r["median_reshape_s"] = _median([v for x in ok for v in x.get("reshape_s", [])])
            cpu = r.get("series", {}).get("cpu", [])[:-1]
            r["cpu_utilisation"] = statistics.fmean(cpu) / args.nodes if cpu else None
            r["reshapes"] = sum(x.get("events", {}).get("reshape", 0) for x in r.get("rows", []))
            r["preemptions"] = sum(x.get("events", {}).get("preempted", 0) for x in r.get("rows", []))
            r["models_equal"] = sum(1 for x in r.get("rows", []) if x.get("model", {}).get("equal"))
            r["steps_once"] = sum(1 for x in r.get("rows", []) if x.get("steps_once"))
            r.pop("samples", None)
            runs[policy] = r
            print(f"policy {policy} done in {r['wall_s']:.0f} s: avg JCT {_f(r.get('avg_jct'))} s, "
                  f"makespan {_f(r.get('makespan'))} s, {r.get('failed')} failed, "
                  f"{r['models_equal']}/{len(jobs)} models equal", flush=True)
    res = {"kind": "real", "time": t_start, "smoke": args.smoke, "nodes": args.nodes, "sleep_ms": args.sleep_ms,
           "step_s_one_worker": step_seconds(args.sleep_ms), "weights": WEIGHTS, "trace": jobs, "runs": runs,
           "machine": machine(), "wall_s": time.time() - t_start, "load_start": load_start,
           "load_end": os.getloadavg()[0]}
    simulate_beside(res, args)
    return res


def simulate_beside(res: dict, args) -> None:
    """The simulation of the real run's trace, for comparison (--simulate's model)."""
    t1 = step_seconds(res["sleep_ms"]) * (1 + args.sim_overhead)
    jobs = [{**j, "work": j["steps"] * t1} for j in res["trace"]]
    sim = {p: simulate(jobs, res["nodes"], res["weights"], p, args.sim_start_s, args.sim_reshape_s)
           for p in res["runs"]}
    for v in sim.values():
        v.pop("series", None)
    res["simulated"] = sim
    res["simulated_with"] = {"start_s": args.sim_start_s, "reshape_s": args.sim_reshape_s,
                             "step_overhead": args.sim_overhead}


def render_real(res: dict) -> str:
    m = res["machine"]
    text = [f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(res['time']))}; {m['cores']} cores (shared), torch "
            f"{m['torch']}, Ray {m['ray']}; load average {res['load_start']:.1f} at the start, {res['load_end']:.1f} at "
            f"the end; bench time {res['wall_s'] / 60:.1f} min{' (--smoke)' if res['smoke'] else ''}.",
            f"Real relaytrain jobs on ray.cluster_utils.Cluster ({res['nodes']} one-CPU nodes, a 0-CPU head), the control "
            f"plane (JobManager, its cluster scheduler ticking every 1 s) in-process. Paced MLP, {res['sleep_ms']:g} ms "
            f"a sample a block: {res['step_s_one_worker']:.3f} s of sleep a step on one worker. Weights "
            f"{', '.join(f'{t} {w:g}' for t, w in res['weights'].items())}. JCT: submission to end. Utilisation: slots "
            "held (store shapes, sampled every 0.5 s) / slots, first submission to last end.\n"]
    text.append(policy_table(res["runs"]))
    text.append("\n" + goals(res["runs"]))
    eq = [f"{p}: {r.get('models_equal', 0)}/{len(r.get('rows', []))} final models equal the one-process loop, "
          f"{r.get('steps_once', 0)}/{len(r.get('rows', []))} with every step committed once"
          for p, r in res["runs"].items()]
    text.append("; ".join(eq))
    text.append("Measured costs (what --simulate's --sim-start-s and --sim-reshape-s stand for): "
                + "; ".join(f"{p}: start (admission to first step) median {_f(r.get('median_start_s')) or 'n/a'} s, "
                            f"reshape median {_f(r.get('median_reshape_s')) or 'n/a'} s, Ray CPUs in use "
                            f"{_f(r.get('cpu_utilisation') and r['cpu_utilisation'] * 100, '.0f')}% of the slots, load "
                            f"average max {_f(r.get('load_max'))}" for p, r in res["runs"].items()) + "\n")
    if res.get("simulated"):
        w = res.get("simulated_with", {})
        text.append(f"The simulation of the same trace (--simulate's model: start {w.get('start_s', '?')} s, reshape "
                    f"{w.get('reshape_s', '?')} s, step overhead {w.get('step_overhead', '?')}) for comparison:\n")
        text.append(policy_table(res["simulated"]))
    text.append("\nPer job (JCT s / wait for admission s / start: admission to first step s / reshapes (shapes) / "
                "model equal):\n")
    head = "| job | tenant | workers | kind | steps | " + " | ".join(res["runs"]) + " |"
    text += [head, "|" + "---|" * (5 + len(res["runs"]))]
    for j in res["trace"]:
        cells = []
        for p, r in res["runs"].items():
            x = next((y for y in r.get("rows", []) if y["id"] == j["id"]), {})
            if x.get("state") != "SUCCEEDED":
                cells.append(f"{x.get('state')}: {(x.get('error') or '')[:120]}")
                continue
            mod = x.get("model", {})
            cells.append(f"{_f(x.get('jct'))} / {_f(x.get('wait'))} / {_f(x.get('start_s'))} / {len(x['shapes'])}"
                         f"{' (' + ' '.join(x['shapes']) + ')' if x['shapes'] else ''}"
                         f"{' preempted ' + str(x['events'].get('preempted')) if x['events'].get('preempted') else ''}"
                         f" / {'yes' if mod.get('equal') else 'NO ' + mod.get('why', '')[:80]}"
                         f"{'' if x.get('steps_once') else ' (steps not once!)'}")
        kind = "elastic" if j["elastic"] else "preemptible" if j.get("preemptible") else "rigid"
        text.append(f"| {j['id']} | {j['tenant']} | {j['size']} | {kind} | {j['steps']} | " + " | ".join(cells) + " |")
    errs = [f"{p}: {e}" for p, r in res["runs"].items() for e in r.get("errors", [])]
    if errs:
        text.append("\nErrors: " + "; ".join(errs))
    return "\n".join(text)


# ---------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--simulate", action="store_true", help="the discrete-event simulation only (no Ray)")
    ap.add_argument("--policies", nargs="+", choices=POLICIES,
                    help="the real run's policies (default: all three; --smoke: elastic)")
    ap.add_argument("--smoke", action="store_true", help="2 jobs, the elastic policy, 3 nodes: to find interface problems")
    ap.add_argument("--timeout-min", type=float, default=12.0, help="per policy: jobs not ended by then are cancelled")
    ap.add_argument("--tag", help="write bench/results/cluster_<tag>.{json,txt}")
    add_sim_args(ap)  # --nodes, --sleep-ms, --sim-*, --seed
    ap.add_argument("--from-json", metavar="PATH", help="print the tables of a saved result again, run nothing")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        if res.get("kind") == "real":
            simulate_beside(res, args)  # with this invocation's --sim-* (no Ray)
            Path(args.from_json).write_text(json.dumps(res, indent=1, default=str))
        out = render_sim(res) if res.get("kind") == "simulate" else render_real(res)
        print(out)
        Path(args.from_json).with_suffix(".txt").write_text(out + "\n")
        plot(RESULTS / "cluster.png")
        return
    if args.simulate:
        write_simulations(args)
        return
    res = run_real(args)
    out = render_real(res)
    print()
    print(out)
    name = "cluster_smoke" if args.smoke else f"cluster_{args.tag}" if args.tag else "cluster"
    (RESULTS / f"{name}.txt").write_text(out + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    if name == "cluster":
        plot(RESULTS / "cluster.png")


if __name__ == "__main__":
    main()
