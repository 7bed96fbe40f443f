"""What a job's processes cost to start, with their settings in a ``runtime_env`` against
inherited from the node (actors/nodeenv.py).

    .venv/bin/python bench/process_start.py [--rounds 2] [--jobs 5] [--actors 4] [--shape 2 2]

Each round runs each way in turn, in a fresh Python with a local Ray of its own (8 CPU slots):

  * ``runtime_env``: the Ray started as before nodeenv (no settings in its environment, no
    label), so the scheduler and the workers get the settings in a runtime_env, and Ray starts
    each of them through ``setup_worker.py``;
  * ``node``: the Ray started as relaytrain starts its own (``nodeenv.prepare()``: the settings in
    its environment, the label ``relaytrain/process-env=1``), so a job with no runtime_env of its
    own starts them with none.

In each: ``--actors`` actors that import torch, three times (ready time, and the CPU the actors
used, from ``os.times`` in each: exec keeps a process's CPU times); then ``--jobs`` jobs of the
built-in MLP (hidden 16, 2 blocks), dp x pp ``--shape``, 3 steps, one after another through
``run_job`` (time, and the whole machine's CPU from /proc/stat over them).  Run it on an
otherwise idle machine.  Writes bench/results/process_start_<dp>x<pp>.json and .txt.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402

MODES = ("runtime_env", "node")


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent outside idle and iowait since boot."""
    a = list(map(int, open("/proc/stat").readline().split()[1:]))
    return (sum(a) - a[3] - a[4]) / os.sysconf("SC_CLK_TCK")


def one(mode: str, jobs: int, actors: int, shape: tuple[int, int]) -> dict:
    """One way, in this process (a fresh Python: the settings go into its environment)."""
    import ray

    from actors import nodeenv

    if mode == "node":
        kw = {"labels": nodeenv.prepare()}
    else:
        for k in nodeenv.settings(0, env={}):
            os.environ.pop(k, None)
        kw = {}
    ray.init(address="local", num_cpus=8, include_dashboard=False, logging_level="ERROR",
             log_to_driver=False, **kw)
    from actors import heap, launch
    from actors.runner import run_job
    from service.spec import parse_spec

    out: dict = {"mode": mode, "scheduler_runtime_env": launch.job_process_env({}, 0),
                 "worker_runtime_env": heap.runtime_env({}, 0, {})}

    @ray.remote(num_cpus=1)
    class Torch:
        def __init__(self):
            import torch  # noqa: F401

        def cpu(self):
            t = os.times()
            return t.user + t.system

    env = out["worker_runtime_env"]
    rounds = []
    for _ in range(3):
        t0 = time.monotonic()
        hs = [Torch.options(**env).remote() for _ in range(actors)]
        cpu = sum(ray.get([h.cpu.remote() for h in hs]))
        rounds.append({"ready_s": time.monotonic() - t0, "actors_cpu_s": cpu})
        for h in hs:
            ray.kill(h)
        time.sleep(1.0)
    out["actors"] = rounds

    def spec(i):
        return parse_spec({
            "name": f"start-{mode.replace('_', '-')}-{i}", "model": {"kind": "mlp", "args": {"hidden": 16, "layers": 2}},
            "data": {"kind": "digits"}, "optimizer": {"name": "sgd", "lr": 0.05},
            "training": {"global_batch_size": 16, "microbatch_size": 4, "steps": 3, "seed": 1},
            "parallelism": {"dp": shape[0], "pp": shape[1]}})

    with tempfile.TemporaryDirectory() as tmp:
        run_job(spec=spec(0), out=f"{tmp}/warm", progress=False, record=False)  # imports, caches
        c0, t0 = busy_cpu_s(), time.monotonic()
        for i in range(jobs):
            r = run_job(spec=spec(i + 1), out=f"{tmp}/{i}", progress=False, record=False)
            assert r["state"] == "SUCCEEDED", r.get("error")
        out["jobs"] = {"n": jobs, "shape": list(shape), "time_s": time.monotonic() - t0, "machine_cpu_s": busy_cpu_s() - c0}
    ray.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=5)
    ap.add_argument("--actors", type=int, default=4)
    ap.add_argument("--shape", type=int, nargs=2, default=(2, 2), metavar=("DP", "PP"))
    ap.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)  # a child: one way, printed as JSON
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.one, a.jobs, a.actors, tuple(a.shape))), flush=True)
        return
    runs = []
    for r in range(a.rounds):
        for mode in MODES:
            subprocess.run([shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray", "stop", "--force"],
                           capture_output=True)
            p = subprocess.run([sys.executable, __file__, "--one", mode, "--jobs", str(a.jobs), "--actors", str(a.actors),
                                "--shape", *map(str, a.shape)], capture_output=True, text=True, cwd=ROOT)
            line = next((x for x in p.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                sys.exit(f"the {mode} run failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
            runs.append({"round": r, **json.loads(line[len("RESULT "):])})
            print(f"round {r} {mode}: done", file=sys.stderr, flush=True)
    lines = [f"# {machine()}",
             f"{a.actors} actors that import torch (3 times in each run), then {a.jobs} {a.shape[0]}x{a.shape[1]} jobs "
             f"of the built-in MLP, 3 steps, one after another; {a.rounds} runs each way, alternated", "",
             "| way | scheduler's runtime_env | actors ready (s) | actors' CPU (s) | jobs (s) | machine CPU over the jobs (s) |",
             "|---|---|---|---|---|---|"]
    for mode in MODES:
        mine = [x for x in runs if x["mode"] == mode]
        ready = [y["ready_s"] for x in mine for y in x["actors"]]
        cpu = [y["actors_cpu_s"] for x in mine for y in x["actors"]]
        jt = [x["jobs"]["time_s"] for x in mine]
        jc = [x["jobs"]["machine_cpu_s"] for x in mine]
        env = mine[0]["scheduler_runtime_env"]
        lines.append(f"| {mode} | {'none' if env is None else ', '.join(sorted(env.get('env_vars', {})))} | "
                     f"{min(ready):.1f}-{max(ready):.1f} (median {statistics.median(ready):.1f}) | "
                     f"{min(cpu):.1f}-{max(cpu):.1f} | {', '.join(f'{t:.1f}' for t in jt)} | {', '.join(f'{c:.0f}' for c in jc)} |")
    text = "\n".join(lines)
    print(text)
    res = ROOT / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    name = f"process_start_{a.shape[0]}x{a.shape[1]}"
    (res / f"{name}.json").write_text(json.dumps(runs, indent=1))
    (res / f"{name}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
