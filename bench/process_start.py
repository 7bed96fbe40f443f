"""What a job's processes cost to start, with their settings in a ``runtime_env`` against
inherited from the node (actors/nodeenv.py); with ``--code``, a job of user code with its folder
in Ray's ``working_dir`` against shipped by relaytrain (actors/codepkg.py).

    .venv/bin/python bench/process_start.py [--rounds 2] [--jobs 5] [--actors 4] [--shape 2 2] [--code]

Each round runs each way in turn, in a fresh Python with a local Ray of its own (8 CPU slots):

  * ``runtime_env``: the Ray started as before nodeenv (no settings in its environment, no
    label), so the scheduler and the workers get the settings in a runtime_env, and Ray starts
    each of them through ``setup_worker.py``;
  * ``node``: the Ray started as relaytrain starts its own (``nodeenv.prepare()``: the settings in
    its environment, the label ``relaytrain/process-env=1``), so a job with no runtime_env of its
    own starts them with none.

With ``--code`` both ways run on a Ray started as relaytrain's (``node``), the model is a user
module (the same MLP) in a folder of its own, and the ways are:

  * ``working_dir``: ``RELAYTRAIN_SHIP_CODE=0``, the folder goes to Ray as the job's
    ``runtime_env.working_dir`` (each process started through ``setup_worker.py``, in the folder
    the runtime-env agent unpacked);
  * ``shipped``: relaytrain reads the package and each process unpacks it once per node.

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
CODE_MODES = ("working_dir", "shipped")
USER_MODEL = """
from torch import nn


def build(hidden=16, layers=2):
    blocks = [nn.Linear(64, hidden), nn.ReLU()]
    for _ in range(layers - 1):
        blocks += [nn.Linear(hidden, hidden), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(hidden, 10))
"""


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent outside idle and iowait since boot."""
    a = list(map(int, open("/proc/stat").readline().split()[1:]))
    return (sum(a) - a[3] - a[4]) / os.sysconf("SC_CLK_TCK")


def one(mode: str, jobs: int, actors: int, shape: tuple[int, int]) -> dict:
    """One way, in this process (a fresh Python: the settings go into its environment)."""
    import ray

    from actors import nodeenv

    code = mode in CODE_MODES
    if code:
        os.environ["RELAYTRAIN_SHIP_CODE"] = "1" if mode == "shipped" else "0"
    if mode == "node" or code:
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
    folder = tempfile.mkdtemp(prefix="relaytrain-bench-code-")
    Path(folder, "benchmodel.py").write_text(USER_MODEL)
    if mode == "working_dir":  # the actors as a job's, with the folder in their runtime_env
        env = {"runtime_env": {"working_dir": launch.upload_runtime_env({"working_dir": folder})["working_dir"]}}
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
        model = {"builder": "benchmodel:build"} if code else {"kind": "mlp", "args": {"hidden": 16, "layers": 2}}
        return parse_spec({
            "name": f"start-{mode.replace('_', '-')}-{i}", "model": model,
            "data": {"kind": "digits"}, "optimizer": {"name": "sgd", "lr": 0.05},
            "training": {"global_batch_size": 16, "microbatch_size": 4, "steps": 3, "seed": 1},
            "parallelism": {"dp": shape[0], "pp": shape[1]}})

    with tempfile.TemporaryDirectory() as tmp:
        where = {"spec_dir": folder} if code else {}
        run_job(spec=spec(0), out=f"{tmp}/warm", progress=False, record=False, **where)  # imports, caches
        c0, t0 = busy_cpu_s(), time.monotonic()
        for i in range(jobs):
            r = run_job(spec=spec(i + 1), out=f"{tmp}/{i}", progress=False, record=False, **where)
            assert r["state"] == "SUCCEEDED", r.get("error")
        out["jobs"] = {"n": jobs, "shape": list(shape), "time_s": time.monotonic() - t0, "machine_cpu_s": busy_cpu_s() - c0}
    ray.shutdown()
    shutil.rmtree(folder, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--jobs", type=int, default=5)
    ap.add_argument("--actors", type=int, default=4)
    ap.add_argument("--shape", type=int, nargs=2, default=(2, 2), metavar=("DP", "PP"))
    ap.add_argument("--code", action="store_true", help="a job of user code: Ray's working_dir against relaytrain's shipping")
    ap.add_argument("--one", choices=MODES + CODE_MODES, help=argparse.SUPPRESS)  # a child: one way, printed as JSON
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(one(a.one, a.jobs, a.actors, tuple(a.shape))), flush=True)
        return
    runs = []
    modes = CODE_MODES if a.code else MODES
    for r in range(a.rounds):
        for mode in modes:
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
             f"of {'a user module (an MLP)' if a.code else 'the built-in MLP'}, 3 steps, one after another; "
             f"{a.rounds} runs each way, alternated", "",
             "| way | scheduler's runtime_env | actors ready (s) | actors' CPU (s) | jobs (s) | machine CPU over the jobs (s) |",
             "|---|---|---|---|---|---|"]
    for mode in modes:
        mine = [x for x in runs if x["mode"] == mode]
        ready = [y["ready_s"] for x in mine for y in x["actors"]]
        cpu = [y["actors_cpu_s"] for x in mine for y in x["actors"]]
        jt = [x["jobs"]["time_s"] for x in mine]
        jc = [x["jobs"]["machine_cpu_s"] for x in mine]
        env = mine[0]["scheduler_runtime_env"]
        env = "working_dir" if mode == "working_dir" else "none" if env is None else ", ".join(sorted(env.get("env_vars", {})))
        lines.append(f"| {mode} | {env} | "
                     f"{min(ready):.1f}-{max(ready):.1f} (median {statistics.median(ready):.1f}) | "
                     f"{min(cpu):.1f}-{max(cpu):.1f} | {', '.join(f'{t:.1f}' for t in jt)} | {', '.join(f'{c:.0f}' for c in jc)} |")
    text = "\n".join(lines)
    print(text)
    res = ROOT / "bench" / "results"
    res.mkdir(parents=True, exist_ok=True)
    name = f"process_start_{'code_' if a.code else ''}{a.shape[0]}x{a.shape[1]}"
    (res / f"{name}.json").write_text(json.dumps(runs, indent=1))
    (res / f"{name}.txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
