"""Seconds from a node removal to the next committed step: relaytrain beside Ray Train.

    .venv/bin/python bench/recovery.py [--removals 5] [--nodes 3] [--no-raytrain]
    .venv/bin/python bench/recovery.py --tp 2 [--d-model 256] [--removals 3] [--nodes 3]

A simulated cluster (ray.cluster_utils.Cluster: a head with no CPUs and N one-CPU worker
nodes) runs an elastic relaytrain job (an MLP 64 -> 128 x 3 -> 10 on digits, global batch
96, microbatch 8, dp = N, pp = 1, gloo).  The bench removes the node of a worker with
SIGKILL (``remove_node(allow_graceful=False)``: a crash, no goodbye), records the time of
the removal, and reads the commit time of the first step committed by the new shape (steps
already in flight may still commit in the old shape first).  Then it adds a replacement node, waits until the job has grown back
to N workers, and removes again.

The same removals are then made against Ray Train's elastic TorchTrainer
(``bench/raytrain_recovery.py``, run as a subprocess: each needs its own Ray).

Prints a table and writes bench/results/recovery.json and recovery.txt.

With ``--tp t`` the job is the built-in GPT (4 blocks of width ``--d-model``) split over TP
groups of t, on nodes of t CPUs (dp = N groups, pp = 1), beside the same GPT at tp = 1 on
nodes of one CPU: what a lost node costs a tensor-parallel job (its group's replica is dropped,
then grown back, the new group taking every slice rank by rank).  Writes recovery_tp.json/.txt.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "bench" / "results"


def spec(nodes: int):
    from service.spec import parse_spec

    return parse_spec({
        "name": "recovery-bench",
        "model": {"kind": "mlp", "args": {"in_features": 64, "hidden": 128, "layers": 3}},
        "data": {"kind": "digits"},
        "optimizer": {"name": "adam", "lr": 0.001},
        "training": {"global_batch_size": 96, "microbatch_size": 8, "steps": 1_000_000, "seed": 0},
        # declared costs of a compute-bound model (Ray Train's side sleeps 50 ms a step): the
        # planner then models every added replica as worth it and grows back after each loss
        "parallelism": {"dp": nodes, "pp": 1, "transport": "collective", "layer_costs_ms": [5, 5, 5, 1]},
        "elastic": {"enabled": True, "min_workers": 1, "max_workers": nodes},
    })


def gpt_spec(nodes: int, tp: int, d_model: int, tokens: str):
    from service.spec import parse_spec

    return parse_spec({
        "name": f"recovery-bench-tp{tp}",
        "model": {"kind": "gpt", "args": {"vocab_size": 256, "seq_len": 64, "d_model": d_model,
                                          "n_heads": max(2, d_model // 64), "n_layers": 4}},
        "data": {"kind": "tokens", "args": {"path": tokens, "seq_len": 64}}, "loss": "cross_entropy",
        "optimizer": {"name": "adamw", "lr": 0.001},
        "training": {"global_batch_size": 4 * nodes, "microbatch_size": 2, "steps": 1_000_000, "seed": 0},
        "parallelism": {"dp": nodes, "pp": 1, "tp": tp, "transport": "collective",
                        "layer_costs_ms": [1, 10, 10, 10, 10, 1, 1]},
        "elastic": {"enabled": True, "min_workers": tp, "max_workers": nodes * tp, "grow_payback_s": 0},
    })


def measure_relaytrain(removals: int, nodes: int, steps_between: int = 15, tp: int = 0, d_model: int = 256) -> dict:
    """``tp`` > 0: the GPT at that tp on nodes of tp CPUs (0: the MLP on 1-CPU nodes)."""
    import ray
    from ray.cluster_utils import Cluster

    from actors.runner import run_job

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    ray.init(address=cluster.address, logging_level="ERROR")
    cpus = max(tp, 1)
    for _ in range(nodes):
        cluster.add_node(num_cpus=cpus)
    cluster.wait_for_nodes()
    if tp:
        import numpy as np

        tokens = os.path.join(tempfile.mkdtemp(prefix="relaytrain-recovery-"), "train.bin")
        np.random.default_rng(0).integers(0, 256, 200_000).astype(np.uint16).tofile(tokens)
        job = gpt_spec(nodes, tp, d_model, tokens)
    else:
        job = spec(nodes)
    workers = nodes * cpus
    out = tempfile.mkdtemp(prefix="relaytrain-recovery-")
    done: dict = {}
    t = threading.Thread(target=lambda: done.setdefault("r", _run(run_job, job, out)), daemon=True)
    t.start()
    sched = _scheduler(ray, job.name)
    rows: list[dict] = []
    events: list[dict] = []

    def poll():
        p = ray.get(sched.poll.remote(len(rows), len(events)))
        rows.extend(p["metrics"])
        events.extend(p["events"])
        return p

    def wait_for(pred, timeout=120.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            p = poll()
            if pred(p):
                return p
            time.sleep(0.02)
        raise RuntimeError(f"timed out; last poll {p['state']} step {p['step']}")

    results = []
    try:
        p = wait_for(lambda p: p["step"] >= steps_between and len(p["shape"].get("workers", {})) == workers)
        for i in range(removals):
            victim = p["shape"]["workers"][max(p["shape"]["workers"])]  # the last worker's node
            before = max(r["step"] for r in rows)
            node = next(n for n in cluster.worker_nodes if n.node_id == victim)
            t_remove = time.time()
            cluster.remove_node(node, allow_graceful=False)
            # steps in flight may still commit in the old shape; recovery ends at the first step
            # committed by the new shape (the reshape event names it)
            wait_for(lambda p: any(e["type"] == "reshape" and e["time"] > t_remove for e in events))
            ev = next(e for e in events if e["type"] == "reshape" and e["time"] > t_remove)
            first = max(r["time"] for r in rows if r["step"] == ev["step"])
            results.append({"removal": i + 1, "recovery_s": round(first - t_remove, 3),
                            "detect_to_commit_s": round(ev["recovery_s"], 3), "phases_s": ev.get("phases_s"),
                            "steps_lost": ev["steps_lost"],
                            "old_shape": ev["old_shape"], "new_shape": ev["new_shape"],
                            "steps_committed_after_removal_by_old_shape": max(0, ev["step"] - 1 - before)})
            print(f"relaytrain removal {i + 1}: {results[-1]}", flush=True)
            cluster.add_node(num_cpus=cpus)
            grown = len([e for e in events if e["type"] == "reshape"]) + 1
            wait_for(lambda p: len([e for e in events if e["type"] == "reshape"]) >= grown, timeout=180)
            mark = max(r["step"] for r in rows)
            p = wait_for(lambda p: p["state"] == "RUNNING" and p["step"] >= mark + steps_between)
    finally:
        ray.get(sched.cancel.remote())
        t.join(60)
        ray.shutdown()
        cluster.shutdown()
    rec = [r["recovery_s"] for r in results]
    grows = [e for e in events if e["type"] == "reshape" and "joined" in e["reason"]]
    return {"recoveries_s": rec, "median_s": statistics.median(rec), "worst_s": max(rec), "details": results,
            "grow_detect_to_commit_s": [round(e["recovery_s"], 3) for e in grows],
            "grow_phases_s": [e.get("phases_s") for e in grows],
            "step_time_s": statistics.median(r["step_time_s"] for r in rows[-20:]) if rows else None}


def _run(run_job, job, out):
    try:
        return run_job(spec=job, out=out, progress=False, timeout=60, record=False)
    except Exception as e:  # cancelled at the end: that is the normal way out
        return {"error": str(e)}


def _scheduler(ray, name: str):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        for a in ray.util.list_named_actors(all_namespaces=True):
            if a["name"].startswith(f"relaytrain:{name}-") and a["name"].endswith(":scheduler"):
                return ray.get_actor(a["name"], namespace=a["namespace"])
        time.sleep(0.1)
    raise RuntimeError("the job's scheduler did not start")


def measure_raytrain(removals: int) -> dict:
    cmd = [sys.executable, str(ROOT / "bench" / "raytrain_recovery.py"), "--removals", str(removals)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    path = RESULTS / "raytrain_recovery.json"
    if r.returncode != 0 or not path.exists():
        return {"error": (r.stderr or r.stdout)[-2000:]}
    return json.loads(path.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--removals", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=3)
    ap.add_argument("--no-raytrain", action="store_true",
                    help="do not run Ray Train again; reuse bench/results/raytrain_recovery.json if present")
    ap.add_argument("--tp", type=int, default=0, help="measure the GPT at this tp beside tp = 1 instead")
    ap.add_argument("--d-model", type=int, default=256, help="the GPT's width (with --tp)")
    args = ap.parse_args()
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.tp:
        return tp_table(args)
    ours = measure_relaytrain(args.removals, args.nodes)
    theirs = None if args.no_raytrain else measure_raytrain(min(args.removals, 3))
    saved = RESULTS / "raytrain_recovery.json"
    if theirs is None and saved.exists():  # Ray Train's figures from its last run
        theirs = json.loads(saved.read_text())
    lines = ["| system | removals | median s | worst s | each (s) |", "|---|---|---|---|---|",
             f"| relaytrain (elastic, reshape in place) | {len(ours['recoveries_s'])} | {ours['median_s']:.2f} | "
             f"{ours['worst_s']:.2f} | {', '.join(f'{x:.2f}' for x in ours['recoveries_s'])} |"]
    if theirs and "median_s" in theirs:
        lines.append(f"| Ray Train TorchTrainer (num_workers=(1, {args.nodes}), restart from checkpoint) | "
                     f"{len(theirs['recoveries_s'])} | {theirs['median_s']:.2f} | {theirs['worst_s']:.2f} | "
                     f"{', '.join(f'{x:.2f}' for x in theirs['recoveries_s'])} |")
    elif theirs:
        lines.append(f"| Ray Train | failed: {theirs['error'][-200:]!r} | | | |")
    table = "\n".join(lines)
    print(table)
    (RESULTS / "recovery.txt").write_text(table + "\n")
    (RESULTS / "recovery.json").write_text(json.dumps({"relaytrain": ours, "raytrain": theirs}, indent=2))


def tp_table(args) -> None:
    out = {}
    lines = ["| GPT d_model | tp | nodes x CPUs | shapes (dp x pp) | step s | removals | median s | worst s | "
             "grow-back detect->commit s |", "|---|---|---|---|---|---|---|---|---|"]
    for tp in (1, args.tp):
        r = out[f"tp{tp}"] = measure_relaytrain(args.removals, args.nodes, steps_between=5, tp=tp, d_model=args.d_model)
        grow = r["grow_detect_to_commit_s"]
        d = r["details"][0]
        shapes = f"{'x'.join(map(str, d['old_shape']))} -> {'x'.join(map(str, d['new_shape']))}"
        lines.append(f"| {args.d_model} | {tp} | {args.nodes} x {tp} | {shapes} | {r['step_time_s']:.3f} | "
                     f"{len(r['recoveries_s'])} | "
                     f"{r['median_s']:.2f} | "
                     f"{r['worst_s']:.2f} | {statistics.median(grow) if grow else float('nan'):.2f} |")
        print(lines[-1], flush=True)
    table = "\n".join(lines)
    print(table)
    name = f"recovery_tp_d{args.d_model}"
    (RESULTS / f"{name}.txt").write_text(table + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
