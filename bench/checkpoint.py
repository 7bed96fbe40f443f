"""What asynchronous checkpoints cost a training step: every step against none.

    .venv/bin/python bench/checkpoint.py [--quick] [--sizes 1024 2048 2896] [--mbs 8 32]
                                         [--storage local s3] [--compute real paced] [--steps 12]
                                         [--sleep-ms 2] [--local-dir DIR] [--tag NAME] [--from-json PATH]

Trains the built-in MLP (``{"kind": "mlp", "args": {"hidden": H, "layers": 6}}``: 64 digit
features -> 6 Linear+ReLU blocks of width H -> 10 classes; scikit-learn's digits) with Adam,
dp 1, pp 2 (1F1B, collective transport, the partition fixed at [3 blocks | 3 blocks + head]),
a step being 4 microbatches, over the grid

    hidden H       1024 | 2048 | 2896        5.3 M | 21 M | 42 M parameters; train state
                                             (16 B a parameter with Adam) 81 | 323 | 644 MiB
    microbatch     8 | 32                    (global batch 32 | 128)
    storage        local | s3                a fresh folder under --local-dir (default: the
                                             system's temporary folder; its filesystem is in the
                                             header), or s3://<bucket>/<job> on a moto server
                                             (``python -m moto.server``) that this bench starts
                                             on a loopback port, the bucket made with boto3, the
                                             endpoint and fake credentials in AWS_* set before
                                             ray.init so that the workers inherit them
    compute        real | paced              real: the MLP as is. paced: the same layers, each
                                             block followed by a Sleep layer that sleeps a fixed
                                             --sleep-ms per sample in its forward and twice that
                                             in its backward (simulated device time: the worker
                                             waits as on an accelerator and leaves the 2 cores
                                             to the upload; ``model.builder: "paced:build"``,
                                             a module written to a temporary folder that the
                                             job ships as its working_dir)

For each (H, microbatch, compute) it runs one job without checkpoints (``checkpoint.every_steps:
0``) and, per storage, one with a checkpoint every step (``every_steps: 1``, ``keep: 1``), the
same steps (12; the first 2 are the warm-up and not counted).  It reports

  * step time: the median ``step_time_s`` of the job's metrics rows after the first 2 steps,
    and the overhead of every-step checkpoints against none.  ``step_time_s`` is the scheduler's
    wall time of the step itself (the workers' forward, backward and update), so it shows what
    the background upload costs the compute it runs beside, but not the pause at the step
    boundary, which comes between two steps;
  * step period: the mean time between consecutive metrics rows after the first 2 (the
    rows' ``time``), which holds the step, the commit and the boundary's pause (starting each
    stage's part: the copy of the state and the upload run in the worker's thread beside the
    next step, the manifest in a thread of the scheduler): what training really runs at.  A mean, not a median: a checkpoint starts only when the one
    before it is written, so most boundaries may have no pause at all;
  * between steps: the period less the step time (a mean): the commit and the checkpoint's
    pause at the boundary;
  * from the ``checkpoint`` events: the checkpoint's size (``bytes``, every stage's part), the
    median ``pause_s`` (what the step boundary waited for) and ``write_s`` (from the boundary
    until the scheduler saw every part written, which it looks at only at boundaries: an upper
    bound), how many checkpoints were written against the steps that asked for one, how many
    were late (``asked_at`` != ``step``: due while the previous one was still being written,
    taken at the first boundary after it; with ``every_steps: 1`` that boundary asks for one
    itself, so none is late and "written < asked" is what shows uploads falling behind), and
    ``checkpoint_failed`` events.

The goal of issue 17: asynchronous checkpoints cost the step under 5% on a model whose state
is hundreds of MB.  Before each job the machine's MemAvailable must be above 6 GiB, else the
job is skipped, saying so.  ``--quick``: H 2048, microbatch 8, local and s3, real compute.
``--sizes``, ``--mbs``, ``--storage``, ``--compute``, ``--steps`` change the grid.  Writes
bench/results/checkpoint.json and .txt (checkpoint_quick.* with --quick, checkpoint_<tag>.*
with --tag).  The machine is shared: the load average at the start and the end is in the
header, and each job's in the JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ["RELAYTRAIN_MODEL_PT_MAX_MB"] = "0"  # no one-file model.pt from the driver: not under test
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.machine import machine  # noqa: E402
from bench.memory import GiB, MiB, meminfo  # noqa: E402
from bench.paced_mlp import PACED  # noqa: E402  the paced model: the built-in MLP's layers + sleeps

RESULTS = ROOT / "bench" / "results"

LAYERS = 6            # hidden Linear+ReLU blocks; the head makes 7 layers
IN, OUT = 64, 10      # digits: 64 features, 10 classes
MICROBATCHES = 4      # a step; global batch = 4 x microbatch
SKIP = 2              # warm-up steps left out of the medians
MIN_AVAILABLE = 6 * GiB
JOB_TIMEOUT = 900.0
BUCKET = "relaytrain-bench"
FULL = {"sizes": [1024, 2048, 2896], "mbss": [8, 32], "storages": ["local", "s3"], "computes": ["real", "paced"],
        "steps": 12, "sleep_ms": 2.0}
QUICK = {"sizes": [2048], "mbss": [8], "storages": ["local", "s3"], "computes": ["real"], "steps": 12,
         "sleep_ms": 2.0}


def param_count(hidden: int, layers: int = LAYERS) -> int:
    return IN * hidden + hidden + (layers - 1) * (hidden * hidden + hidden) + hidden * OUT + OUT


def partition(layers: int = LAYERS) -> list[int]:
    """Half the blocks on each stage, the head on the last: the same sleeps on both stages."""
    return [layers // 2, layers - layers // 2 + 1]


def job_spec(name: str, hidden: int, mbs: int, steps: int, compute: str, sleep_ms: float, every: int, path: str):
    from service.spec import parse_spec

    if compute == "paced":
        model = {"builder": "paced:build",
                 "args": {"in_features": IN, "hidden": hidden, "layers": LAYERS, "out_features": OUT,
                          "sleep_ms": sleep_ms}}
    else:
        model = {"kind": "mlp", "args": {"in_features": IN, "hidden": hidden, "layers": LAYERS, "out_features": OUT}}
    return parse_spec({
        "name": name, "model": model, "data": {"kind": "digits"}, "loss": "cross_entropy",
        "optimizer": {"name": "adam", "lr": 1e-4},
        "training": {"global_batch_size": MICROBATCHES * mbs, "microbatch_size": mbs, "steps": steps, "seed": 0},
        "parallelism": {"dp": 1, "pp": 2, "schedule": "1f1b", "transport": "collective", "partition": partition()},
        "checkpoint": {"every_steps": every, "path": path, "keep": 1},
    })


# ---------------------------------------------------------------- S3: a moto server on loopback

def moto_empty(moto, bucket: str, prefix: str) -> int:
    """Delete every object under ``prefix`` (moto keeps them in its memory); how many."""
    c, n = moto.client(), 0
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
        if keys:
            c.delete_objects(Bucket=bucket, Delete={"Objects": keys})
            n += len(keys)
    return n


def moto_rss(moto) -> int | None:
    """The moto server's resident memory (bytes)."""
    try:
        with open(f"/proc/{moto.proc.pid}/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS"))
    except (OSError, StopIteration, AttributeError):
        return None


def median(xs: list) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(metrics: list[dict], events: list[dict]) -> dict:
    """Step time and period after the warm-up, and the checkpoints of one job."""
    times = [m["step_time_s"] for m in metrics]
    stamps = [m["time"] for m in metrics]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]  # gaps[i]: from row i to row i + 1
    timed = gaps[SKIP - 1:] if len(stamps) > SKIP else []
    # what the scheduler did between two steps: commit, then the checkpoint's pause, and the
    # manifest (and keep's deletions) of the one before once its parts are written
    between = [g - t for g, t in zip(timed, times[SKIP:])]
    ck = [e for e in events if e["type"] == "checkpoint"]
    failed = [e for e in events if e["type"] == "checkpoint_failed"]
    return {"step_times": times, "gaps": gaps,
            "step_median": median(times[SKIP:]),
            "step_mean": statistics.fmean(times[SKIP:]) if len(times) > SKIP else None,
            "period_mean": statistics.fmean(timed) if timed else None,
            "period_median": median(timed),
            "boundary_mean": statistics.fmean(between) if between else None,
            "boundary_max": max(between) if between else None,
            "checkpoints": [{k: e.get(k) for k in ("step", "asked_at", "bytes", "write_s", "pause_s", "copy_s")}
                            for e in ck],
            "failed": [{"step": e.get("step"), "reason": e.get("reason")} for e in failed],
            "bytes": median([e["bytes"] for e in ck]),
            "pause_median": median([e["pause_s"] for e in ck]),
            "copy_median": median([e["copy_s"] for e in ck]),
            "write_median": median([e["write_s"] for e in ck]),
            "written": len(ck), "late": sum(1 for e in ck if e.get("asked_at") != e.get("step"))}


def run_one(cfg: dict, every: int, storage: str, grid: dict, where: dict) -> dict:
    """One job: ``every`` 0 (no checkpoints) or 1, checkpoints to ``storage``."""
    from actors.runner import JobFailed, run_job

    h, mbs, compute, steps = cfg["hidden"], cfg["mbs"], cfg["compute"], grid["steps"]
    label = "none" if not every else storage
    name = f"ckpt-h{h}-mb{mbs}-{compute}-{label}-{uuid.uuid4().hex[:6]}"
    row = {"hidden": h, "mbs": mbs, "compute": compute, "storage": label, "every": every, "steps": steps,
           "params": param_count(h), "error": None, "skipped": None}
    avail = meminfo("MemAvailable")
    if avail < MIN_AVAILABLE:
        row["skipped"] = (f"MemAvailable {avail / GiB:.1f} GiB is below {MIN_AVAILABLE / GiB:.0f} GiB: "
                          "skipped to keep the shared machine alive")
        return row
    local = None
    if storage == "s3":
        path = f"s3://{BUCKET}/{name}"
    else:
        local = tempfile.mkdtemp(prefix="relaytrain-ckbench-", dir=where["local_dir"])
        path = local
    spec = job_spec(name, h, mbs, steps, compute, grid["sleep_ms"], every, path)
    load0, t0 = os.getloadavg()[0], time.time()
    final = {"metrics": [], "events": []}
    try:
        with tempfile.TemporaryDirectory(prefix="relaytrain-ckbench-out-") as out:
            final = run_job(spec=spec, out=out, progress=False, record=False, timeout=JOB_TIMEOUT,
                            spec_dir=where["paced"] if compute == "paced" else None)
    except JobFailed as e:
        final, row["error"] = e.result or final, str(e)
    except Exception as e:  # noqa: BLE001  a bench goes on to the next job
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        if local:
            shutil.rmtree(local, ignore_errors=True)
        if storage == "s3" and every and where.get("moto"):
            row["moto_rss"] = moto_rss(where["moto"])
            try:
                moto_empty(where["moto"], BUCKET, name + "/")
            except Exception as e:  # noqa: BLE001
                print(f"could not empty s3://{BUCKET}/{name}: {e}", flush=True)
    row.update(summarize(final.get("metrics", []), final.get("events", [])))
    row.update(wall_s=time.time() - t0, load=[load0, os.getloadavg()[0]])
    return row


def describe(r: dict) -> str:
    if r["skipped"]:
        return f"skipped: {r['skipped']}"
    parts = [f"{r['wall_s']:.0f} s", f"step median {_f(r['step_median'], '.3f')} s",
             f"period mean {_f(r['period_mean'], '.3f')} s"]
    if r["every"]:
        parts += [f"{r['written']} checkpoints of {_f(r['bytes'] and r['bytes'] / MiB, '.0f')} MiB "
                  f"({r['late']} late, {len(r['failed'])} failed)",
                  f"pause median {_f(r['pause_median'] and r['pause_median'] * 1e3, '.0f')} ms",
                  f"write median {_f(r['write_median'], '.2f')} s"]
    parts.append(f"load {r['load'][1]:.1f}")
    if r["error"]:
        parts.append(r["error"][:300])
    return ", ".join(parts)


# ---------------------------------------------------------------- the bench

def fs_type(path: str) -> str:
    """The filesystem type of the mount holding ``path`` (from /proc/mounts)."""
    path, best, kind = os.path.realpath(path), "", "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, kind = mnt, f"{typ} ({dev} on {mnt})"
    except OSError:
        pass
    return kind


def measure(grid: dict, local_dir: str) -> dict:
    import ray

    moto = None
    if "s3" in grid["storages"]:
        from tests import s3server  # the tests' moto server: `python -m moto.server` on a loopback port

        # the endpoint and fake credentials in AWS_* before ray.init: the workers inherit them
        moto = s3server.MotoServer(s3server.configure_env()).start()
        moto.create_bucket(BUCKET)
        print(f"moto server on {moto.endpoint}, bucket {BUCKET}", flush=True)
    rows = []
    try:
        with tempfile.TemporaryDirectory(prefix="relaytrain-paced-") as paced:
            (Path(paced) / "paced.py").write_text(PACED)
            where = {"local_dir": local_dir, "paced": paced, "moto": moto}
            ray.init(address="local", num_cpus=16, include_dashboard=False, logging_level="ERROR",
                     log_to_driver=False)
            try:
                plan = [{"hidden": h, "mbs": m, "compute": c}
                        for c in grid["computes"] for h in grid["sizes"] for m in grid["mbss"]]
                n_jobs, k = len(plan) * (1 + len(grid["storages"])), 0
                for cfg in plan:
                    for every, storage in [(0, "none")] + [(1, s) for s in grid["storages"]]:
                        k += 1
                        r = run_one(cfg, every, storage, grid, where)
                        rows.append(r)
                        print(f"[{k}/{n_jobs}] H {cfg['hidden']} mb {cfg['mbs']} {cfg['compute']} "
                              f"{r['storage']}: {describe(r)}", flush=True)
            finally:
                ray.shutdown()
    finally:
        if moto is not None:
            moto.stop()
    return {"rows": rows}


# ---------------------------------------------------------------- tables

def _f(x, fmt: str) -> str:
    return "" if x is None else format(x, fmt)


def between(r: dict) -> float | None:
    """The mean time between two timed steps (the period less the step time), from the rows."""
    if not r or not r.get("step_times"):
        return None
    d = [g - t for g, t in zip(r["gaps"][SKIP - 1:], r["step_times"][SKIP:])]
    return statistics.fmean(d) if d else None


def _ms(x) -> str:
    return "" if x is None else f"{x * 1e3:.0f}"


def _pct(a, b) -> str:
    return "" if a is None or not b else f"{(a / b - 1) * 100:+.1f}%"


def pairs(rows: list[dict]) -> list[tuple[dict, dict | None]]:
    """Each checkpointing job with the job without checkpoints of its (H, microbatch, compute)."""
    base = {(r["hidden"], r["mbs"], r["compute"]): r for r in rows if not r["every"]}
    return [(r, base.get((r["hidden"], r["mbs"], r["compute"]))) for r in rows if r["every"]]


def table(rows: list[dict]) -> str:
    lines = ["| hidden | params (M) | train state (MiB) | microbatch | compute | storage "
             "| step time, none (s) | step time, every step (s) | overhead "
             "| step period, none (s) | step period, every step (s) | overhead (period) "
             "| between steps, none / every step (ms) "
             "| checkpoint (MiB) | pause median (ms) | write median (s) | written / asked | late | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r, b in pairs(rows):
        b = b or {}
        lead = (f"| {r['hidden']} | {r['params'] / 1e6:.1f} | {r['params'] * 16 / MiB:.0f} | {r['mbs']} "
                f"| {r['compute']} | {r['storage']} ")
        if r["skipped"] or b.get("skipped"):
            lines.append(lead + f"| {(r['skipped'] or b['skipped'])[:100]} |" + " |" * 12)
            continue
        err = "; ".join(x[:80] for x in (b.get("error"), r["error"]) if x)
        asked = len(r["step_times"])  # every_steps 1: every committed step asks for one
        lines.append(
            lead + f"| {_f(b.get('step_median'), '.3f')} | {_f(r['step_median'], '.3f')} "
            f"| **{_pct(r['step_median'], b.get('step_median'))}** "
            f"| {_f(b.get('period_mean'), '.3f')} | {_f(r['period_mean'], '.3f')} "
            f"| **{_pct(r['period_mean'], b.get('period_mean'))}** "
            f"| {_ms(between(b))} / {_ms(between(r))} "
            f"| {_f(r['bytes'] and r['bytes'] / MiB, '.0f')} | {_f(r['pause_median'] and r['pause_median'] * 1e3, '.0f')} "
            f"| {_f(r['write_median'], '.2f')} | {r['written']} / {asked} | {r['late']} | {len(r['failed'])}"
            f"{' (' + err + ')' if err else ''} |")
    return "\n".join(lines)


def render(res: dict) -> str:
    m, g = res["machine"], res["grid"]
    head = (f"{time.strftime('%Y-%m-%d %H:%M', time.localtime(res['time']))}; {m['cpu']}, {m['cores']} cores, "
            f"{m['mem_total_gib']} GiB; torch {m['torch']}, Ray {m['ray']}, s3fs {m.get('s3fs')}, moto {m.get('moto')}; "
            f"load average {res['load_start']:.1f} at the start, {res['load_end']:.1f} at the end "
            f"({m['cores']} cores, shared); bench time {res['wall_s'] / 60:.1f} min "
            f"({'--quick' if res['quick'] else 'full' if not res.get('tag') else res['tag']})")
    text = [head, "",
            f"Built-in MLP (64 -> {LAYERS} blocks of Linear+ReLU of width H -> 10; digits), Adam, dp 1, pp 2 "
            f"(partition {partition()}), 1F1B, collective transport, {MICROBATCHES} microbatches a step, "
            f"{g['steps']} steps, the first {SKIP} not counted. Checkpoints every step (keep 1) against none, to a "
            f"local folder ({res.get('local_fs', '?')}) or to s3:// on a moto server on loopback (same machine: "
            f"its CPU is the machine's). Compute 'paced': each block also sleeps {g['sleep_ms']} ms per sample "
            f"(forward; twice in backward), as a device would. Step time: median step_time_s (the step itself, "
            f"without the boundary's pause). Step period: mean time between metrics rows (the step, its commit "
            f"and what the scheduler does between steps: the mean step time, which the uploads slow too, plus "
            f"'between steps'). Between steps: the period less the step time, a mean: the "
            f"commit and the checkpoint's pause (the manifest and keep's deletions are written in a thread of "
            f"the scheduler). Train state: 16 B a parameter (parameters, gradients, two Adam "
            f"slots); a checkpoint holds the parameters and Adam's two slots (12 B a parameter). Pause: what the "
            f"boundary waited for (the step's own optimizer update, moved there, and starting each stage's part; "
            f"the copy of the state runs in the upload's thread beside the next step). Write: from the boundary "
            f"until the scheduler saw every part written (looked at at boundaries). Written / asked: a checkpoint "
            f"due while the previous one is being written waits; with every_steps 1 the boundary where the "
            f"previous one is found written asks for one itself, so the waiting ones are dropped, none is late "
            f"(late: asked_at != step), and written < asked says how far behind the uploads fell. The last "
            f"step's checkpoint is always written, after the last step (not in any step's time).\n",
            table(res["rows"])]
    ok = [(r, b) for r, b in pairs(res["rows"]) if b and not r["skipped"] and not b.get("skipped")
          and not r["error"] and not b.get("error") and r["period_mean"] and b.get("period_mean")]
    if ok:
        worst = max(ok, key=lambda p: p[0]["period_mean"] / p[1]["period_mean"])
        r, b = worst
        big = [(r, b) for r, b in ok if r["bytes"] and r["bytes"] >= 100 * MiB]
        text.append("")
        text.append(f"Largest overhead on the step period: {_pct(r['period_mean'], b['period_mean'])} "
                    f"(H {r['hidden']}, microbatch {r['mbs']}, {r['compute']}, {r['storage']}; step time "
                    f"{_pct(r['step_median'], b['step_median'])}). Goal: under +5% at checkpoints of hundreds of "
                    f"MB; {sum(1 for r, b in big if r['period_mean'] / b['period_mean'] < 1.05)} of {len(big)} "
                    f"configurations with checkpoints of 100 MiB or more meet it on the period, "
                    f"{sum(1 for r, b in big if r['step_median'] and b['step_median'] and r['step_median'] / b['step_median'] < 1.05)}"
                    f" on the step time.")
    skipped = [r for r in res["rows"] if r["skipped"]]
    if skipped:
        text.append(f"\n{len(skipped)} job(s) skipped by the memory guard (MemAvailable below "
                    f"{MIN_AVAILABLE / GiB:.0f} GiB).")
    return "\n".join(text)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="H 2048, microbatch 8, local and s3, real compute")
    ap.add_argument("--sizes", nargs="+", type=int, help="hidden widths H (default: 1024 2048 2896)")
    ap.add_argument("--mbs", nargs="+", type=int, help="microbatch sizes (default: 8 32)")
    ap.add_argument("--storage", nargs="+", choices=["local", "s3"], help="where checkpoints go (default: both)")
    ap.add_argument("--compute", nargs="+", choices=["real", "paced"], help="default: both (--quick: real)")
    ap.add_argument("--steps", type=int, help=f"steps per job (default 12; the first {SKIP} are not counted)")
    ap.add_argument("--sleep-ms", type=float, help="paced compute: ms of sleep per sample per block (default 2)")
    ap.add_argument("--local-dir", default=tempfile.gettempdir(),
                    help="where the local checkpoints go (a fresh folder per job; default: the temporary folder)")
    ap.add_argument("--tag", help="write bench/results/checkpoint_<tag>.{json,txt}")
    ap.add_argument("--from-json", metavar="PATH", help="print the table of a saved result again, run nothing")
    args = ap.parse_args()
    if args.from_json:
        res = json.loads(Path(args.from_json).read_text())
        out = render(res)
        print(out)
        Path(args.from_json).with_suffix(".txt").write_text(out + "\n")
        return
    grid = dict(QUICK if args.quick else FULL)
    for key, value in (("sizes", args.sizes), ("mbss", args.mbs), ("storages", args.storage),
                       ("computes", args.compute), ("steps", args.steps), ("sleep_ms", args.sleep_ms)):
        if value:
            grid[key] = value
    if grid["steps"] <= SKIP:
        ap.error(f"--steps must be above {SKIP}: the first {SKIP} are the warm-up")
    RESULTS.mkdir(parents=True, exist_ok=True)
    t_start, load_start = time.time(), os.getloadavg()[0]
    res = measure(grid, args.local_dir)
    res.update(time=t_start, quick=args.quick, tag=args.tag, grid=grid, machine=machine("moto", "s3fs"),
               local_fs=fs_type(args.local_dir), wall_s=time.time() - t_start, load_start=load_start,
               load_end=os.getloadavg()[0])
    out = render(res)
    print()
    print(out)
    name = f"checkpoint_{args.tag}" if args.tag else "checkpoint_quick" if args.quick else "checkpoint"
    (RESULTS / f"{name}.txt").write_text(out + "\n")
    (RESULTS / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
