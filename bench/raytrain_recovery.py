"""Ray Train baseline for the elasticity benchmark: seconds from a node removal to the
next committed training step, for Ray Train v2's elastic TorchTrainer.

    .venv/bin/python bench/raytrain_recovery.py [--removals 3] [--steps-between 15]

A simulated cluster (ray.cluster_utils.Cluster: head with num_cpus=0 plus N one-CPU
worker nodes) runs a small DDP MLP under TorchTrainer with
ScalingConfig(num_workers=(min, max)) and FailureConfig(max_failures=-1). Every step
is reported with ray.train.report(metrics, checkpoint=...) (rank 0 saves the full
state each step), and rank 0 tells a Recorder actor on the head (step, wall time) once
report() has returned, i.e. once the step is committed. The driver removes a worker
node that hosts a train worker, and the recovery time is

    (wall time of the first step committed by the *restarted* worker group whose index
     is greater than any step committed before) - (time of cluster.remove_node call)

After each recovery a replacement node is added and the driver waits for
`steps_between` more committed steps before the next removal. By default the running
group is not upsized onto the replacement (that would be one more full restart, ~30 s
here, that could land inside the next measurement); Ray still uses it at the next
failure restart, which sizes the group to what is available. --upscale instead lets
Ray upsize (elastic_resize_monitor_interval_s=2) and waits for full size each time.

Prints the figures and writes bench/results/raytrain_recovery.json.
"""
from __future__ import annotations

import os

# Before importing ray: no usage stats, no token auth on the throwaway local cluster.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

import ray  # noqa: E402

# ray.train needs ray[train] extras (pandas, pyarrow, tensorboardX) that the project venv
# does not carry. Rather than touch the venv, they go to a side directory that is put on
# sys.path and PYTHONPATH (inherited by the simulated nodes' raylets and workers).
PYDEPS = os.environ.get("RAYTRAIN_BENCH_PYDEPS", "/tmp/rt_exp/pydeps")
TRAIN_EXTRAS = ["pandas", "pyarrow", "tensorboardX", "python-dateutil", "six", "tzdata"]


def _ensure_train_deps() -> None:
    try:
        import ray.train  # noqa: F401
        return
    except ImportError:
        pass
    import importlib
    import subprocess

    if not os.path.isdir(os.path.join(PYDEPS, "pandas")):
        print(f"installing ray[train] extras into {PYDEPS} (pip --target --no-deps)",
              flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", PYDEPS, *TRAIN_EXTRAS], check=True)
    sys.path.insert(0, PYDEPS)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [PYDEPS] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    for mod in [m for m in sys.modules if m == "ray.train" or m.startswith("ray.train.")]:
        del sys.modules[mod]
    importlib.invalidate_caches()
    import ray.train  # noqa: F401,F811


RESULTS = Path(__file__).resolve().parent / "results" / "raytrain_recovery.json"
NAMESPACE = "relaytrain_raytrain_bench"
RECORDER_NAME = "rt_recovery_recorder"


# --------------------------------------------------------------------------- recorder
@ray.remote(num_cpus=0)
class Recorder:
    """Committed steps and worker placement, as seen by the train workers."""

    def __init__(self):
        self.commits: List[Dict[str, Any]] = []  # rank-0 commits, in arrival order
        self.attempts: List[Dict[str, Any]] = []  # one per worker-group (re)start
        self.last_seen: Dict[str, float] = {}  # node_id -> wall time of last step
        self.node_rank: Dict[str, int] = {}
        self.node_world: Dict[str, int] = {}
        self.stop = False

    def attempt_started(self, t: float, world_size: int, resume_step: int) -> int:
        self.attempts.append({"t": t, "world_size": world_size, "resume_step": resume_step})
        return len(self.attempts) - 1

    def commit(self, step: int, t: float, world_size: int, attempt: int, loss: float):
        self.commits.append({"step": step, "t": t, "world_size": world_size,
                             "attempt": attempt, "loss": loss})

    def heartbeat(self, node_id: str, rank: int, world_size: int, t: float):
        self.last_seen[node_id] = t
        self.node_rank[node_id] = rank
        self.node_world[node_id] = world_size

    def set_stop(self):
        self.stop = True

    def should_stop(self) -> bool:
        return self.stop

    def snapshot(self) -> Dict[str, Any]:
        return {"commits": list(self.commits), "attempts": list(self.attempts),
                "last_seen": dict(self.last_seen), "node_rank": dict(self.node_rank),
                "node_world": dict(self.node_world)}


# --------------------------------------------------------------------- train function
def train_func(config: Dict[str, Any]):
    import tempfile as _tf
    import time as _time

    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import ray
    import ray.train
    import ray.train.torch

    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    node_id = ray.get_runtime_context().get_node_id()
    rec = ray.get_actor(config["recorder"], namespace=config["namespace"])

    torch.manual_seed(0)
    d_in, hidden, depth, d_out = 64, 128, 3, 10
    layers: List[nn.Module] = []
    width = d_in
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, d_out))
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    start_step = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"), weights_only=False)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start_step = state["step"] + 1
    model = ray.train.torch.prepare_model(model)  # DDP (gloo on CPU)

    attempt = -1
    if rank == 0:
        attempt = ray.get(rec.attempt_started.remote(_time.time(), world, start_step))

    global_batch = config["global_batch"]
    local_batch = max(1, global_batch // world)
    w_true = torch.randn(d_in, d_out, generator=torch.Generator().manual_seed(1))
    loss_fn = nn.CrossEntropyLoss()

    step = start_step
    while step < config["max_steps"]:
        # Agree on stopping collectively so every rank calls report() equally often.
        flag = torch.tensor([1.0 if ray.get(rec.should_stop.remote()) else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break

        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(local_batch, d_in, generator=g)
        y = (x @ w_true).argmax(dim=1)
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()  # DDP all-reduce of gradients
        opt.step()
        _time.sleep(config["step_sleep_s"])

        metrics = {"step": step, "loss": float(loss.item()), "world_size": world}
        rec.heartbeat.remote(node_id, rank, world, _time.time())
        if rank == 0:
            with _tf.TemporaryDirectory() as tmp:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "step": step}, os.path.join(tmp, "state.pt"))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))
            # report() returned: checkpoint persisted and all ranks passed the barrier.
            rec.commit.remote(step, _time.time(), world, attempt, metrics["loss"])
        else:
            ray.train.report(metrics, checkpoint=None)
        step += 1


# ------------------------------------------------------------------------ measurement
def _wait(pred, timeout: float, poll: float = 0.05):
    deadline = time.time() + timeout
    while time.time() < deadline:
        out = pred()
        if out:
            return out
        time.sleep(poll)
    return None


def measure_raytrain(removals: int = 3, steps_between: int = 15, *, num_workers: int = 3,
                     min_workers: int = 1, step_sleep_s: float = 0.05,
                     global_batch: int = 64, upscale: bool = False,
                     resize_monitor_interval_s: Optional[float] = None,
                     health_check_interval_s: Optional[float] = 0.25,
                     worker_group_start_timeout_s: Optional[float] = 20.0,
                     graceful: bool = False, recovery_timeout_s: float = 150.0,
                     upscale_timeout_s: float = 60.0, verbose: bool = True,
                     ray_logs: bool = False) -> dict:
    """Remove a worker node `removals` times and time each recovery.

    health_check_interval_s sets RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (Ray default 2.0 s;
    None keeps the default). It is the controller's poll period, and since each
    worker's result queue holds one report, it also caps report()-per-step training at
    one step per poll. worker_group_start_timeout_s sets
    RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (Ray default 60 s; None keeps it): after a
    node loss the elastic policy first retries at the old size (its view of the cluster
    comes from the AutoscalingCoordinator, refreshed every 20 s), and that placement
    group can only time out. The removal targets rotate over ranks world-1, ..., 1, 0.

    Returns {"recoveries_s", "median_s", "worst_s", "notes", "details"}.
    """
    _ensure_train_deps()
    from ray.cluster_utils import Cluster
    from ray.train import CheckpointConfig, FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer
    from ray.train.v2.api.config import ScalingConfig
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def log(*a):
        if verbose:
            print(f"[{time.strftime('%H:%M:%S')}]", *a, flush=True)

    if health_check_interval_s is not None:
        # Inherited by the raylets (started below) and so by controller and workers.
        os.environ["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"] = str(health_check_interval_s)
    if worker_group_start_timeout_s is not None:
        os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(
            worker_group_start_timeout_s)
    hc = float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0"))
    st = float(os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "60"))
    if resize_monitor_interval_s is None:
        resize_monitor_interval_s = 2.0 if upscale else 1e9  # 1e9: never upsize a live group
    scratch = Path(tempfile.mkdtemp(prefix="rt_recovery_", dir=_scratch_root()))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    fit_out: Dict[str, Any] = {}
    thread: Optional[threading.Thread] = None
    rec = None
    details: List[Dict[str, Any]] = []
    t0 = time.time()
    try:
        for _ in range(num_workers):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=ray_logs,
                 logging_level="WARNING")
        head_id = cluster.head_node.node_id
        rec = Recorder.options(
            name=RECORDER_NAME,
            scheduling_strategy=NodeAffinitySchedulingStrategy(head_id, soft=False),
        ).remote()
        ray.get(rec.snapshot.remote())

        trainer = TorchTrainer(
            train_func,
            train_loop_config={"recorder": RECORDER_NAME, "namespace": NAMESPACE,
                               "max_steps": 10**7, "step_sleep_s": step_sleep_s,
                               "global_batch": global_batch},
            scaling_config=ScalingConfig(
                num_workers=(min_workers, num_workers), use_gpu=False,
                elastic_resize_monitor_interval_s=resize_monitor_interval_s),
            run_config=RunConfig(
                name=f"raytrain_recovery_{uuid.uuid4().hex[:6]}",
                storage_path=str(scratch / "storage"),
                failure_config=FailureConfig(max_failures=-1),
                checkpoint_config=CheckpointConfig(num_to_keep=2)),
        )

        def _fit():
            try:
                fit_out["result"] = trainer.fit()
            except BaseException as e:  # noqa: BLE001 - reported in notes
                fit_out["error"] = repr(e)

        thread = threading.Thread(target=_fit, daemon=True)
        thread.start()

        snap = lambda: ray.get(rec.snapshot.remote())  # noqa: E731

        def full_and_past(step_floor: int):
            s = snap()
            c = s["commits"]
            if c and c[-1]["world_size"] == num_workers and c[-1]["step"] >= step_floor:
                return s
            return None

        s = _wait(lambda: full_and_past(steps_between), 120)
        if s is None:
            raise RuntimeError(f"training never reached step {steps_between} "
                               f"at full size: {fit_out}")
        log(f"training up: step {s['commits'][-1]['step']} at world_size {num_workers}, "
            f"{time.time() - t0:.1f}s after start")

        for i in range(removals):
            s = snap()
            n_attempts = len(s["attempts"])
            # Nodes hosting a worker of the current group: heartbeat since the group's
            # start and tagged with its world size; target ranks world-1, ..., 0 in turn.
            t_group = s["attempts"][-1]["t"]
            world_now = s["commits"][-1]["world_size"]
            hosting = {s["node_rank"][nid]: nid for nid, ts in s["last_seen"].items()
                       if ts > t_group and s["node_world"][nid] == world_now}
            want = (world_now - 1 - i) % world_now
            order = [want] + sorted(r for r in hosting if r != want)
            by_id = {n.node_id: n for n in cluster.worker_nodes}
            victim = next((by_id[hosting[r]] for r in order
                           if r in hosting and hosting[r] in by_id), None)
            if victim is None:
                raise RuntimeError(f"no worker node with a live train worker: {hosting}")
            victim_rank = s["node_rank"].get(victim.node_id)
            max_before = max(c["step"] for c in s["commits"])

            t_remove = time.time()
            cluster.remove_node(victim, allow_graceful=graceful)
            t_removed = time.time()
            log(f"removal {i + 1}: node {victim.node_id[:8]} (rank {victim_rank}) "
                f"removed at step {max_before} (remove_node took {t_removed - t_remove:.2f}s)")

            def recovered():
                s2 = snap()
                old = [c for c in s2["commits"] if c["attempt"] < n_attempts]
                old_max = max(c["step"] for c in old)
                new = [c for c in s2["commits"] if c["attempt"] >= n_attempts
                       and c["step"] > old_max and c["t"] > t_remove]
                return (s2, new[0], old_max) if new else None

            r = _wait(recovered, recovery_timeout_s)
            if r is None:
                raise RuntimeError(f"no recovery within {recovery_timeout_s}s: {fit_out}")
            s2, first_new, old_max = r
            att = s2["attempts"][first_new["attempt"]]
            rec_s = first_new["t"] - t_remove
            d = {
                "removal": i + 1, "recovery_s": round(rec_s, 3),
                "removed_rank": victim_rank,
                "max_step_before": max_before, "max_step_old_group": old_max,
                "resumed_from_step": att["resume_step"],
                "steps_rerun": max(0, old_max + 1 - att["resume_step"]),
                "restarts": len(s2["attempts"]) - n_attempts,
                "world_size_after": first_new["world_size"],
                "restart_started_after_s": round(att["t"] - t_remove, 3),
                "_t_remove": t_remove, "_t_first_new": first_new["t"],
            }
            details.append(d)
            log(f"  recovered in {rec_s:.2f}s: world_size {d['world_size_after']}, resumed "
                f"at step {d['resumed_from_step']} (re-ran {d['steps_rerun']}), group "
                f"restarted {d['restarts']}x, new group up after {d['restart_started_after_s']}s")

            # Replacement capacity; then steps must continue (and, with upscale, the
            # group must be back at full size) before the next removal.
            t_add = time.time()
            cluster.add_node(num_cpus=1)
            if not upscale:
                _wait(lambda: (lambda c: c and c[-1]["step"] >= first_new["step"]
                               + steps_between)(snap()["commits"]), 60)
                log(f"  replacement added; training continued to step "
                    f"{snap()['commits'][-1]['step']}")
                continue
            s3 = _wait(lambda: full_and_past(first_new["step"] + steps_between),
                       upscale_timeout_s)
            if s3 is None:
                d["upscale_s"] = None
                log(f"  not back to {num_workers} workers within {upscale_timeout_s}s")
                _wait(lambda: (lambda c: c and c[-1]["step"] >= first_new["step"]
                               + steps_between)(snap()["commits"]), 60)
            else:
                full = [a for a in s3["attempts"][first_new["attempt"] + 1:]
                        if a["world_size"] == num_workers]
                d["upscale_restart_s"] = round(full[0]["t"] - t_add, 3) if full else None
                log(f"  replacement added; back at {num_workers} workers "
                    f"(group restarted {d['upscale_restart_s']}s after add_node), "
                    f"step {s3['commits'][-1]['step']}")
    finally:
        controller_log = _controller_log_path()
        if rec is not None:
            try:
                ray.get(rec.set_stop.remote(), timeout=10)
            except Exception:  # noqa: BLE001
                pass
        if thread is not None:
            thread.join(timeout=30)
        final = None
        if rec is not None:
            try:
                final = ray.get(rec.snapshot.remote(), timeout=10)
                ray.kill(rec)
            except Exception:  # noqa: BLE001
                pass
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)

    events = _controller_events(controller_log)
    for d in details:
        lo, hi = d.pop("_t_remove"), d.pop("_t_first_new")
        d["controller_events"] = [f"+{t - lo:.1f}s {e}" for t, e in events if lo <= t <= hi]
    recs = [d["recovery_s"] for d in details]
    elapsed = time.time() - t0
    rerun = [d["steps_rerun"] for d in details]
    notes = (
        f"Ray {ray.__version__} Train v2 TorchTrainer, ScalingConfig(num_workers=("
        f"{min_workers}, {num_workers}), elastic_resize_monitor_interval_s="
        f"{resize_monitor_interval_s}), FailureConfig(max_failures=-1), "
        f"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S={hc} (Ray default 2.0), "
        f"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S={st} (Ray default 60); Cluster head "
        f"num_cpus=0 + {num_workers} x 1-CPU nodes, remove_node(allow_graceful={graceful}). "
        f"MLP 64->128x3->10, global batch {global_batch}, {step_sleep_s * 1000:.0f} ms "
        f"sleep/step, checkpoint every step (rank 0). Recovery = first step committed by "
        f"the restarted group with index > old max - remove_node() call time. On node loss "
        f"Ray Train tore down the whole worker group and restarted it from the latest "
        f"registered checkpoint (steps re-run per removal: {rerun}); it first retried at "
        f"the old size (its cluster view comes from the AutoscalingCoordinator, refreshed "
        f"every 20 s) until that placement group timed out; start timeouts per removal: "
        f"{[sum('timed out' in e for e in d['controller_events']) for d in details]}. "
        f"Upscale onto replacements: {'on (a further full restart)' if upscale else 'off; used at the next failure restart'}. "
        f"fit() ended with: {fit_out.get('error') or 'clean stop'}. Total {elapsed:.0f}s."
    )
    out = {
        "recoveries_s": recs,
        "median_s": round(statistics.median(recs), 3) if recs else None,
        "worst_s": round(max(recs), 3) if recs else None,
        "notes": notes,
        "details": details,
        "final_step": (final["commits"][-1]["step"] if final and final["commits"] else None),
        "worker_group_starts": (len(final["attempts"]) if final else None),
    }
    return out


def _controller_log_path() -> Optional[str]:
    try:
        import glob

        logs = os.path.join(ray._private.worker._global_node.get_session_dir_path(), "logs")
        found = glob.glob(os.path.join(logs, "train", "ray-train-sys-controller-*.log"))
        return max(found, key=os.path.getmtime) if found else None
    except Exception:  # noqa: BLE001
        return None


def _controller_events(path: Optional[str]) -> List[tuple]:
    """(epoch seconds, summary) of the Train controller's restart-related log lines."""
    out: List[tuple] = []
    if not path or not os.path.exists(path):
        return out
    keys = ("FailurePolicy", "timed out", "Attempting to start", "Started training",
            "Deciding to", "Worker group startup completed")
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            msg = rec.get("message", "")
            if not any(k in msg for k in keys):
                continue
            ts, ms = rec["asctime"].split(",")
            t = time.mktime(time.strptime(ts, "%Y-%m-%d %H:%M:%S")) + int(ms) / 1000
            out.append((t, " ".join(x.strip() for x in msg.split("\n")[:2])[:110]))
    return out


def _scratch_root() -> str:
    root = "/tmp/rt_exp"
    os.makedirs(root, exist_ok=True)
    return root


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--removals", type=int, default=3)
    ap.add_argument("--steps-between", type=int, default=15)
    ap.add_argument("--num-workers", type=int, default=3)
    ap.add_argument("--min-workers", type=int, default=1)
    ap.add_argument("--graceful", action="store_true",
                    help="remove_node(allow_graceful=True) instead of SIGKILL")
    ap.add_argument("--health-check-interval", type=float, default=0.25,
                    help="RAY_TRAIN_HEALTH_CHECK_INTERVAL_S; <=0 keeps Ray's 2.0 s")
    ap.add_argument("--start-timeout", type=float, default=20.0,
                    help="RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S; <=0 keeps Ray's 60 s")
    ap.add_argument("--upscale", action="store_true",
                    help="let Ray upsize onto each replacement and wait for full size")
    ap.add_argument("--ray-logs", action="store_true", help="forward worker logs")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)

    res = measure_raytrain(args.removals, args.steps_between, num_workers=args.num_workers,
                           min_workers=args.min_workers, graceful=args.graceful,
                           health_check_interval_s=(args.health_check_interval
                                                    if args.health_check_interval > 0
                                                    else None),
                           worker_group_start_timeout_s=(args.start_timeout
                                                         if args.start_timeout > 0
                                                         else None),
                           upscale=args.upscale, ray_logs=args.ray_logs)
    print()
    print("Ray Train elastic recovery (node removal -> next committed new step)")
    for d in res["details"]:
        print(f"  removal {d['removal']}: {d['recovery_s']:.2f} s  (resumed at step "
              f"{d['resumed_from_step']}, re-ran {d['steps_rerun']}, "
              f"world size {d['world_size_after']})")
        for e in d["controller_events"]:
            print(f"      {e}")
    print(f"  median {res['median_s']} s, worst {res['worst_s']} s")
    print(f"  notes: {res['notes']}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
