"""A job beside other busy processes on its node: ``resources.nice`` 0 (the default) against 15
(what Ray gives its worker processes unless told otherwise).

    .venv/bin/python bench/priority.py [--busy 0 2] [--nice 0 15] [--hidden 256 1024]
                                       [--steps 60] [--cap 90]

On a local Ray of 4 CPU slots (2 cores here), for each (busy, nice, hidden) it starts ``busy``
processes that spin at nice 0 (``while True: pass``: a compile, a data job, another user's
notebook), then runs one job beside them: the built-in MLP (64 digit features, 4 Linear+ReLU
blocks of width ``hidden``, 10 classes), SGD, dp 1 x pp 2 (1F1B, collective transport), 4
microbatches of 32 rows a step, ``--steps`` steps.  It reports, from the job's scheduler polled
every 0.1 s (each poll waits at most 1 s for its answer):

  * scheduler: seconds from the submission until its scheduler first answered a poll;
  * first step: seconds until the job's first committed step;
  * steps/s: committed steps a second after the first one, to the last one seen;
  * reached: the last committed step within ``--cap`` seconds (the job is stopped there).

Writes bench/results/priority.json and .txt.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RELAYTRAIN_MODEL_PT_MAX_MB"] = "0"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def job_spec(name: str, hidden: int, nice: int, steps: int):
    from service.spec import parse_spec

    return parse_spec({
        "name": name, "model": {"kind": "mlp", "args": {"hidden": hidden, "layers": 4}}, "data": {"kind": "digits"},
        "optimizer": {"name": "sgd", "lr": 0.01, "momentum": 0.9},
        "training": {"global_batch_size": 128, "microbatch_size": 32, "steps": steps, "seed": 0},
        "parallelism": {"dp": 1, "pp": 2, "schedule": "1f1b", "transport": "collective"},
        "resources": {"nice": nice},
    })


def run_one(busy: int, nice: int, hidden: int, steps: int, cap: float) -> dict:
    import ray

    from actors import launch
    from actors.runner import run_job

    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    name = f"prio-{uuid.uuid4().hex[:6]}"
    out: dict = {"busy": busy, "nice": nice, "hidden": hidden}
    result: dict = {}
    t0 = time.monotonic()

    def job() -> None:
        try:
            result.update(run_job(spec=job_spec(name, hidden, nice, steps), out=tempfile.mkdtemp(), progress=False,
                                  record=False, timeout=cap + 60))
        except Exception as e:  # noqa: BLE001 - stopped at the cap, or failed: reported
            result["error"] = f"{type(e).__name__}: {e}"

    thread = threading.Thread(target=job, daemon=True)
    try:
        thread.start()
        deadline = t0 + cap
        job_id = launch.wait_for_job(name, cap)
        sched = launch.find_scheduler(job_id) if job_id else None
        seen: list = []
        while sched is not None and time.monotonic() < deadline and thread.is_alive():
            ref = sched.poll.remote(10**9, 10**9)
            ready, _ = ray.wait([ref], timeout=1.0)
            if ready:
                try:
                    p = ray.get(ref)
                except ray.exceptions.RayActorError:  # the job ended (failed, or stopped): see its result
                    break
                now = time.monotonic() - t0
                out.setdefault("scheduler_s", round(now, 1))
                if p["step"] and (not seen or p["step"] > seen[-1][1]):
                    seen.append((now, p["step"]))
            time.sleep(0.1)
        if time.monotonic() < deadline:  # it ended before the cap: its result is on its way
            thread.join(30)
        if seen:
            out["first_step_s"] = round(seen[0][0], 1)
            out["reached"] = seen[-1][1]
            if len(seen) > 1 and seen[-1][0] > seen[0][0]:
                out["steps_per_s"] = round((seen[-1][1] - seen[0][1]) / (seen[-1][0] - seen[0][0]), 1)
        else:
            out["reached"] = 0
        if result.get("state") == "SUCCEEDED":
            out["reached"] = steps
        out["state"] = result.get("state") or result.get("error") or "stopped at the cap"
        if thread.is_alive() and sched is not None:
            launch.stop(sched, job_id, grace=5)
        thread.join(30)
    finally:
        for s in spinners:
            s.kill()
            s.wait()
    return out


def fmt(v, unit="") -> str:
    return "-" if v is None else f"{v}{unit}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--nice", type=int, nargs="+", default=[0, 15])
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--cap", type=float, default=90.0)
    args = ap.parse_args()

    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
    rows = []
    info = machine()
    header = ", ".join(f"{k} {v}" for k, v in info.items() if v is not None)
    print(header, flush=True)
    for hidden in args.hidden:
        for busy in args.busy:
            for nice in args.nice:
                r = run_one(busy, nice, hidden, args.steps, args.cap)
                rows.append(r)
                print(f"hidden {hidden:5d}  busy {busy}  nice {nice:2d}:  scheduler {fmt(r.get('scheduler_s'), ' s'):>7}  "
                      f"first step {fmt(r.get('first_step_s'), ' s'):>7}  steps/s {fmt(r.get('steps_per_s')):>6}  "
                      f"reached {r['reached']}/{args.steps} in {args.cap:g} s  ({r['state']})", flush=True)
    ray.shutdown()
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "priority.json").write_text(json.dumps({"machine": info, "args": vars(args), "rows": rows}, indent=1))
    lines = [header, "", "| hidden | busy processes | resources.nice | scheduler up (s) | first step (s) | steps/s | "
             f"steps in {args.cap:g} s |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['hidden']} | {r['busy']} | {r['nice']} | {fmt(r.get('scheduler_s'))} | {fmt(r.get('first_step_s'))} | "
              f"{fmt(r.get('steps_per_s'))} | {r['reached']}/{args.steps} |" for r in rows]
    (RESULTS / "priority.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines[2:]))


if __name__ == "__main__":
    main()
